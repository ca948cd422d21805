"""Orbax checkpoints holding everything a run needs to continue bit-identically:

    <workdir>/checkpoints/<step>/state   params, non-trainable state, optimizer state, step, rng
    <workdir>/checkpoints/<step>/data    the grain iterator position (one JSON file per host)
    <workdir>/checkpoints/<step>/meta    the config that produced it (JSON), for evaluation
    <workdir>/checkpoints/<step>/attn_jax_sha256.json   checksums, written in the save's commit

Restoring takes abstract arrays *with shardings*, so each host reads only its shards.

Reliability (the choices):
  * Never save garbage: `save` refuses a state with a NaN/Inf float leaf (`all_finite`, one
    on-device reduction) and names the last finite checkpoint.
  * Never load garbage: orbax writes a step into a temporary folder and renames it when the
    (possibly asynchronous) save is complete, so interrupted saves are not steps; leftover
    temporary folders are deleted when a Checkpointer opens. The sha256 manifest of every file
    of a step is written into the temporary folder just before orbax renames it
    (`_ManifestRename`, part of the commit), so every committed step carries its manifest, the
    one a crashed run resumes from included. On object storage (a `gs://` workdir) there is no
    rename: orbax writes the step in place and commits it with a `commit_success.txt` object,
    the manifest written just before it (`_ManifestCommit`), and only steps holding that object
    are steps (`all_steps`). A step without one (copied without it, or written
    by other code) cannot be verified, so it is refused (`CheckpointUnverifiedError`, nothing
    moved, no older step tried in its place) unless the user allows it
    (`checkpoint.allow_unverified=True`, `--allow_unverified` of eval.py / stream.py: old
    checkpoints keep a way in); allowed, orbax's own checks and the finiteness check still run
    and a warning says plainly that the step is unverified.
  * Corrupt vs mismatched. `restore` walks the steps newest first. A step whose files disagree
    with the manifest, that orbax cannot read, or whose values are not finite is corrupt: it is
    moved aside to `<step>.corrupt` with a warning and the previous step is tried. Only one
    step is ever moved per restore: a second bad step stops with an error and stays in place (two
    bad steps in a row point at a cause other than a torn file). A step whose stored arrays have
    other shapes/dtypes/structure than the requested state is the caller's mistake (a changed
    model config), not corruption: `CheckpointMismatchError` names the differing leaves and
    nothing is moved. The comparison is made on orbax's metadata before any array is read, and
    it is strict: every stored leaf must be requested and the other way round (no partial
    restore that would drop or invent parameters). A step whose files match their checksums
    but that orbax still cannot restore is not moved either (`CheckpointError`).
  * Failed saves (a full disk): a save that fails in the background is noticed at the next step
    boundary (`check_saves`) and raised as `CheckpointSaveError` naming the step, the cause and
    the older steps, which orbax keeps (it deletes old steps only after a successful commit).
  * Preemption: `PreemptionGuard` turns SIGTERM (what SLURM/Kubernetes/TPU maintenance send),
    SIGINT and SIGHUP (a closed terminal or ssh session) into a flag the training loop polls at
    step boundaries, so the last step is saved before exit instead of dying mid-step; SIGINT
    and SIGHUP that the parent process ignored (a background job, `nohup`) stay ignored. The
    trainer enters it before its first check; before that, experiments/train.py's
    `early_signals` take them from the process's first second.
  * Steps named in messages (`all_steps`, `latest_step`) are the committed step folders on
    disk, not orbax's list, which counts a save in progress and forgets a step it will prune.
  * No wait without an end. Every wait for a background save (`wait`, and through it `save`,
    `settle`, `check_saves`, `close`) polls orbax's save-in-progress flag instead of joining its
    thread: it ends after `checkpoint.save_timeout_s` (a stalled bucket, a hung network mount;
    orbax's own commit wait gets the same bound) and, once a stop signal came (`stop_when`: the
    trainer's PreemptionGuard), `checkpoint.signal_grace_s` after the signal, so that a
    scheduler's grace period (~30 s before SIGKILL) is never spent waiting. A save that did not
    end in time is abandoned (`CheckpointStalledError`, or `CheckpointStoppedError` after a
    signal: exit 128 + signal), the message naming the step and the last committed one
    (`last_committed`, known without asking the storage); orbax's threads are never waited for
    again (`close` skips orbax's own close), and the process is expected to end.
  * Readers never write: `load_for_inference` (evaluation, streaming, notebooks) opens the
    folder read-only and takes no lock, so it can run beside the training run that writes it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from attn_jax import bounded, outputs, paths, sharding as shd, storage
from attn_jax.config import RunConfig, config_rules
from attn_jax.field_checks import is_number
from attn_jax.model import abstract_model
from attn_jax.run_layout import RunLayout
from attn_jax.train import early_signals
from attn_jax.train.writers import WriteError, describe_disk, disk_full

MANIFEST = "attn_jax_sha256.json"
# Written by orbax's own commit (after the manifest): not covered by it.
_COMMIT_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
_CHUNK = 1 << 22
SAVE_TIMEOUT_S = 600.0   # config.checkpoint.save_timeout_s's default: a save that takes longer
                         # has stalled (a 152M model's state saves to a bucket in seconds)
SIGNAL_GRACE_S = 15.0    # config.checkpoint.signal_grace_s's default: a save still running this
                         # long after SIGTERM is abandoned (schedulers SIGKILL ~30 s after it)
_LIST_S = 10.0           # how long a message may spend listing the committed steps
_POLL_S = 0.05




class CheckpointError(RuntimeError):
  """A checkpoint step cannot be restored (the message says why and what was left in place)."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint whose files are damaged (checksum mismatch, unreadable, non-finite)."""


class CheckpointUnverifiedError(CheckpointError):
  """A step without its checksum manifest, refused because unverified steps were not allowed."""


class CheckpointMismatchError(CheckpointError, ValueError):
  """The stored tree differs from the requested one (shapes, dtypes, leaves): a changed config,
  not corruption. `step` and `differences` (one line per differing leaf) say where."""

  def __init__(self, message: str, *, step: int | None = None, differences=()):
    super().__init__(message)
    self.step, self.differences = step, list(differences)


class CheckpointSaveError(WriteError):
  """A checkpoint save failed (e.g. the disk is full); older steps are kept. A WriteError like
  a failed metrics write: the trainer stops both the same way (writers.py)."""


class CheckpointStalledError(CheckpointSaveError):
  """A save that did not end within `checkpoint.save_timeout_s`; it was abandoned (orbax's
  threads may still hold it: nothing waits for them again). `step`: the abandoned save,
  `last_committed`: the resume point (None: none)."""

  def __init__(self, message: str, *, step: int | None, last_committed: int | None):
    super().__init__(message)
    self.step, self.last_committed = step, last_committed


class CheckpointStoppedError(CheckpointStalledError, early_signals.StoppedBySignal):
  """A stop signal came while a save was still running, and the save did not end within
  `checkpoint.signal_grace_s` of it: abandoned, the run ends with exit 128 + the signal."""

  def __init__(self, message: str, *, step: int | None, last_committed: int | None,
               signal_name: str):
    CheckpointStalledError.__init__(self, message, step=step, last_committed=last_committed)
    self.signal_name = signal_name


class NonFiniteStateError(FloatingPointError):
  """`Checkpointer.save` was given a state with NaN/Inf values."""


@jax.jit
def _finite_flags(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.bool_(True)])


def _float_leaves(tree: Any) -> list:
  return [x for x in jax.tree.leaves(tree)
          if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]


def nonfinite_paths(tree: Any, limit: int = 5) -> list[str]:
  """Paths of (up to `limit`) float leaves holding NaN/Inf."""
  flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
  if not flat:
    return []
  ok = np.asarray(jax.device_get(_finite_flags([x for _, x in flat])))
  return [jax.tree_util.keystr(p) for (p, _), good in zip(flat, ok) if not good][:limit]


def all_finite(state: Any) -> bool:
  """True when every float leaf of `state` is free of NaN/Inf (one jitted reduction; works
  on sharded global arrays)."""
  leaves = _float_leaves(state)
  return not leaves or bool(np.all(jax.device_get(_finite_flags(leaves))))


# ------------------------------------------------------------------ checksums


def _sha256(path) -> str:
  h = hashlib.sha256()
  with paths.run_path(path).open("rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir) -> list[str]:
  return [rel for rel in paths.files(step_dir) if rel != MANIFEST and rel not in _COMMIT_FILES]


def write_manifest(step_dir) -> None:
  """sha256 + size of every file of a finished step folder, in `<step_dir>/MANIFEST`."""
  root = paths.run_path(step_dir)
  files = {rel: {"sha256": _sha256(root / rel), "size": (root / rel).stat().length}
           for rel in _files(root)}
  text = json.dumps({"version": 1, "files": files}, indent=0, sort_keys=True)
  if paths.is_uri(root):   # an object is written whole or not at all
    (root / MANIFEST).write_text(text)
    return
  tmp = os.path.join(root, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(root, MANIFEST))  # atomic: a manifest is whole or absent


def verify_manifest(step_dir) -> str | None:
  """None when the files match the manifest, else what is wrong; "no manifest" if absent."""
  root = paths.run_path(step_dir)
  path = root / MANIFEST
  if not path.is_file():
    return "no manifest"
  try:
    files = json.loads(path.read_text())["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"unreadable manifest {path}: {e}"
  for rel, want in files.items():
    full = root / rel
    if not full.is_file():
      return f"missing file {rel}"
    size = full.stat().length
    if size != want["size"]:
      return f"{rel} has {size} bytes, the manifest says {want['size']} (truncated?)"
    if _sha256(full) != want["sha256"]:
      return f"{rel} does not match its sha256 (corrupted bytes)"
  return None


# ------------------------------------------------------------------ checkpointer


class _ManifestRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """orbax's atomic rename, with the step's sha256 manifest written into the temporary folder
  first: a step folder that exists under its final name has its manifest. (The per-item
  folders use the same class; only the step folder, named by a bare step number, gets one.)"""

  async def finalize(self, *args, **kwargs):
    if self.get_final().name.isdigit():
      await asyncio.to_thread(write_manifest, os.fspath(self.get()))
    return await super().finalize(*args, **kwargs)


class _ManifestCommit(ocp.path.atomicity.CommitFileTemporaryPath):
  """The same on object storage, where orbax writes a step in place and commits it with a
  `commit_success.txt` object (no rename there): the manifest is written just before that
  object, so a committed step has its manifest."""

  async def finalize(self, *args, **kwargs):
    if self.get_final().name.isdigit():
      await asyncio.to_thread(write_manifest, os.fspath(self.get()))
    return await super().finalize(*args, **kwargs)


def _short(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _unwritable(directory) -> str | None:
  """None when a file can be created in `directory` (made if missing), else why not
  (`outputs.unwritable`'s probe)."""
  try:
    paths.run_path(directory).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    return e.strerror or str(e)
  return outputs.unwritable(directory)


def check_writable(directory: str) -> None:
  """A run's checkpoint folder must be writable before it trains: orbax only finds out at the
  first save, in a background thread, and then waits for its directory-creation signal until
  a timeout (minutes) before the save fails with that timeout."""
  why = _unwritable(directory)
  if why:
    raise CheckpointSaveError(f"checkpoint folder {directory} is not writable ({why}); make "
                              "it writable or point --workdir elsewhere")


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _leaf_shapes(tree: Any) -> dict[str, tuple]:
  """{"params/embed": ((V, D), "float32"), ...} for every array leaf of `tree`."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      out["/".join(_key_name(k) for k in path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
  return out


def tree_differences(stored: Any, requested: Any, limit: int = 4) -> list[str]:
  """What differs between a stored tree's metadata and the requested abstract tree (parameters
  first: they say most about the config)."""
  have, want = _leaf_shapes(stored), _leaf_shapes(requested)
  order = lambda keys: sorted(keys, key=lambda k: (not k.startswith("params"), k))
  out = [f"{k}: stored {have[k][0]} {have[k][1]}, requested {want[k][0]} {want[k][1]}"
         for k in order(have.keys() & want.keys()) if have[k] != want[k]]
  out += [f"{k}: not in the checkpoint" for k in order(want.keys() - have.keys())]
  out += [f"{k}: in the checkpoint, not requested" for k in order(have.keys() - want.keys())]
  return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


class Checkpointer:
  """One run directory's checkpoints. `read_only=True` (evaluation, notebooks): the folder is
  only read, never created, cleaned or pruned, and no save is possible, so a training run that
  is saving into it at the same time is not disturbed (orbax lists committed steps only: a save
  in progress is a temporary folder until its rename)."""

  def __init__(self, workdir: str, *, max_to_keep: int = 3, save_interval_steps: int = 1,
               checksums: bool = True, read_only: bool = False, allow_unverified: bool = False,
               save_timeout_s: float = SAVE_TIMEOUT_S, signal_grace_s: float = SIGNAL_GRACE_S):
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"config.checkpoint.max_to_keep: must be an integer >= 1, got "
                       f"{max_to_keep!r}")
    for name, value in (("save_timeout_s", save_timeout_s), ("signal_grace_s", signal_grace_s)):
      if not (is_number(value) and value > 0):
        raise ValueError(f"config.checkpoint.{name}: must be a number of seconds > 0, got "
                         f"{value!r}")
    self.save_timeout_s, self.signal_grace_s = float(save_timeout_s), float(signal_grace_s)
    self._guard = None           # stop_when: the PreemptionGuard whose signal shortens waits
    self._abandoned: int | None = None   # a save given up on: orbax's threads may still hold it
    self._committed: int | None = None   # the newest step this process saw committed
    self.directory = paths.name(RunLayout.of(workdir).checkpoints)
    self.remote = paths.is_uri(self.directory)
    self.checksums, self.read_only = checksums, read_only
    if not isinstance(allow_unverified, bool):
      raise ValueError(f"config.checkpoint.allow_unverified: must be True or False, got "
                       f"{allow_unverified!r}")
    self.allow_unverified = allow_unverified
    if read_only:   # every option that would write, clean or prune, off (orbax warns otherwise)
      options = ocp.CheckpointManagerOptions(
          read_only=True, create=False, cleanup_tmp_directories=False, max_to_keep=None,
          save_interval_steps=0, save_root_metadata=False)
    else:
      check_writable(self.directory)
      options = ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep, create=True, save_interval_steps=save_interval_steps,
          cleanup_tmp_directories=True,
          # orbax's own wait for a save's commit ends no later than ours (`wait`)
          async_options=ocp.AsyncOptions(timeout_secs=max(1, math.ceil(self.save_timeout_s))),
          temporary_path_class=(None if not checksums else
                                _ManifestCommit if self.remote else _ManifestRename))
    self._mngr = ocp.CheckpointManager(paths.run_path(self.directory), item_names=("state", "data", "meta"),
                                       options=options)
    self._pending: int | None = None   # step of a save that may still run in the background
    self.restored_step: int | None = None

  def latest_step(self) -> int | None:
    """The newest committed step (`all_steps`), or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The committed steps on disk, oldest first: what a rerun can resume from. Read from the
    folder, not from orbax's own list, which also holds a save still in progress (or one that
    is failing: a temporary folder on disk, never a step) and drops the steps it is about to
    prune before their folders are gone. On object storage a step is written in place, so only
    the folders holding orbax's commit object count (`_ManifestCommit`)."""
    root = paths.run_path(self.directory)
    try:
      found = [p for p in root.iterdir() if p.name.isdigit() and p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
      return []
    if self.remote:
      found = [p for p in found if (p / ocp.path.atomicity.COMMIT_SUCCESS_FILE).exists()]
    return sorted(int(p.name) for p in found)

  @property
  def pending_step(self) -> int | None:
    """The step of a save that may still run in the background (None: none)."""
    return self._pending

  def step_dir(self, step: int) -> str:
    return paths.name(paths.run_path(self.directory) / str(step))

  def settle(self) -> CheckpointSaveError | None:
    """Waits for a save still in flight and returns its failure instead of raising it: for a
    caller already reporting another error, which then names the resume point from
    `all_steps` / `latest_step` (exactly the committed steps after this)."""
    try:
      self.wait()
    except CheckpointSaveError as e:
      return e
    return None

  def save(self, step: int, state: Any, data_iter: Any = None, meta: dict | None = None, *,
           force: bool = False) -> bool:
    """Starts an (asynchronous) save; raises NonFiniteStateError instead of saving NaN/Inf and
    CheckpointSaveError when this save or the previous one failed."""
    if self.read_only:
      raise CheckpointError(f"{self.directory} was opened read-only: nothing can be saved")
    if not all_finite(state):
      good = [s for s in self.all_steps() if s < step]
      last = (f"the last finite checkpoint is step {max(good)} in {self.directory}" if good
              else f"there is no earlier checkpoint in {self.directory}")
      raise NonFiniteStateError(
          f"refusing to save step {step}: non-finite values in {nonfinite_paths(state)}; {last}")
    self.wait()   # a failure of the previous save surfaces here, with its step
    if self._abandoned is not None:   # orbax's own save would wait for that one, without end
      raise CheckpointStalledError(
          f"not saving checkpoint step {step} in {self.directory}: the save of step "
          f"{self._abandoned} was abandoned and may still hold orbax; {self.resume_point()}",
          step=step, last_committed=self.last_committed)
    items = {"state": ocp.args.StandardSave(state),
             "meta": ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      import grain  # only with a data iterator: benchmarks import the trainer without it
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    try:
      saved = self._mngr.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:
      raise self._save_error(step, e) from e
    if saved:
      self._pending = step
    return saved

  def steps_for_message(self) -> list[int]:
    """The committed steps (`all_steps`) for a message about a failure, listed within
    `_LIST_S`: the storage may be what failed (a bucket that stopped answering, a network gone).
    When the listing fails or does not end in time, the steps known without the storage
    (`last_committed`)."""
    try:
      return bounded.call(self.all_steps, _LIST_S, f"listing {self.directory}")
    except Exception:  # noqa: BLE001 - the storage that failed: say what is known
      return [] if self.last_committed is None else [self.last_committed]

  def resume_step(self) -> int | None:
    """The newest committed step (`steps_for_message`), or None."""
    steps = self.steps_for_message()
    return steps[-1] if steps else None

  def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
    kept = sorted(s for s in self.steps_for_message() if s != step)
    if disk_full(e):
      why = (f"the disk is full: {describe_disk(self.directory)} has no space left; free space "
             "or point --workdir elsewhere, then rerun to resume")
    elif unwritable := self._unwritable_now():   # orbax reports it as a timeout
      why = f"the folder is not writable any more ({unwritable}); {_short(e)}"
    else:
      why = _short(e)
    return CheckpointSaveError(
        f"saving checkpoint step {step} in {self.directory} failed: {why}. Older steps are "
        f"kept: {kept or 'none'}")

  def _unwritable_now(self) -> str | None:
    """`_unwritable(directory)`, within `_LIST_S` (a probe object on storage that went away
    would go through gcsfs's retries)."""
    try:
      return bounded.call(lambda: _unwritable(self.directory), _LIST_S,
                          f"a write probe in {self.directory}")
    except Exception as e:  # noqa: BLE001 - the probe itself failing says it
      return storage.describe(e)

  def check_saves(self) -> None:
    """Raises CheckpointSaveError once a background save has failed (cheap: polled at step
    boundaries, it waits only for a save that has already ended)."""
    if self._pending is not None and not self._mngr.is_saving_in_progress():
      self.wait()

  def verify(self, step: int) -> str | None:
    """None if step's files match their manifest or it has none (`has_manifest`: such a step
    cannot be verified, see `check_verifiable`), else the problem."""
    if not paths.run_path(self.step_dir(step)).is_dir():   # pruned by the run while read
      return f"its folder {self.step_dir(step)} is gone"
    problem = verify_manifest(self.step_dir(step))
    return None if problem == "no manifest" else problem

  def check_verifiable(self, step: int) -> bool:
    """Whether `step` has its manifest; without one, CheckpointUnverifiedError unless
    `allow_unverified` (the caller then warns once the step has loaded: `warn_unverified`)."""
    if self.has_manifest(step):
      return True
    if not self.allow_unverified:
      raise CheckpointUnverifiedError(
          f"checkpoint step {step} in {self.directory} has no checksum manifest ({MANIFEST}), "
          "so damaged bytes in it cannot be detected, and it was not loaded (nothing was moved). "
          "Steps saved by attn_jax carry one; this one was copied without it or written by "
          "other code. To load it anyway: --config.checkpoint.allow_unverified=True (train.py) "
          "or --allow_unverified (eval.py, stream.py)")
    return False

  def has_manifest(self, step: int) -> bool:
    return (paths.run_path(self.step_dir(step)) / MANIFEST).is_file()

  def warn_unverified(self, step: int) -> None:
    """The warning for a step without a checksum manifest that orbax read without complaint."""
    logging.warning(
        "checkpoint step %d in %s is UNVERIFIED: it has no checksum manifest (%s), so damaged "
        "bytes in its arrays cannot be detected. Only orbax's own checks ran (its metadata and "
        "every array read back at the shapes and dtypes expected) and all values are finite. "
        "Steps saved by attn_jax carry a manifest; this one was copied without it or written "
        "by other code, and it was loaded because unverified steps were allowed "
        "(checkpoint.allow_unverified / --allow_unverified).", step, self.directory, MANIFEST)

  def _set_aside(self, step: int) -> str:
    """Moves a bad step folder to `<step>.corrupt[.n]` so it is neither restored nor in the
    way of the run saving that step again; returns the new path."""
    target = self.step_dir(step) + ".corrupt"
    n = 0
    while paths.run_path(target).exists():
      n += 1
      target = f"{self.step_dir(step)}.corrupt.{n}"
    assert not self.read_only, "a read-only Checkpointer never moves a step"
    if jax.process_index() == 0:
      paths.move(self.step_dir(step), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"attn_jax_ckpt_set_aside_{step}")
    self._mngr.reload()
    return target

  def stored_differences(self, step: int, abstract_state: Any,
                         only: tuple[str, ...] = ()) -> list[str] | None:
    """How step's stored state differs from `abstract_state` ([] when it does not), or None
    when its metadata cannot be read. `only`: compare just these top-level entries (e.g.
    ("params", "rest") for the parameters without the optimizer state)."""
    from etils import epath
    try:
      stored = ocp.StandardCheckpointHandler().metadata(
          epath.Path(self.step_dir(step)) / "state")
    except Exception:  # unreadable metadata: corruption, judged by the caller
      return None
    if only:
      tree = getattr(stored, "tree", stored)
      try:
        stored = {k: tree[k] for k in only if k in tree}
      except TypeError:  # not a mapping: let the comparison below name what differs
        pass
    return tree_differences(stored, abstract_state)

  def check_matches(self, step: int, abstract_state: Any) -> None:
    """CheckpointMismatchError when step's stored arrays differ from the requested ones; checked
    on the metadata, before orbax reads any array (a restore that fails part-way leaves
    tensorstore reads behind that report into a closed event loop)."""
    diffs = self.stored_differences(step, abstract_state)
    if diffs:
      raise self._mismatch(step, diffs)

  def _mismatch(self, step: int, diffs: list) -> "CheckpointMismatchError":
    return CheckpointMismatchError(
        f"checkpoint step {step} in {self.directory} holds a different state than this "
        f"config builds (nothing was moved or changed): {'; '.join(diffs)}", step=step,
        differences=diffs)

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any):
    problem = self.verify(step)
    if problem:
      raise CheckpointCorruptError(problem)
    manifested = self.check_verifiable(step)
    self.check_matches(step, abstract_state)
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      state = self._mngr.restore(step, args=ocp.args.Composite(**items))["state"]
    except Exception as e:  # orbax/tensorstore: missing metadata, undecodable chunks, shapes
      raise self._restore_error(step, manifested, e) from e
    if not all_finite(state):
      raise CheckpointCorruptError(f"non-finite values in {nonfinite_paths(state)}")
    if not manifested:
      self.warn_unverified(step)
    return state

  def _restore_error(self, step, manifested, e) -> CheckpointError:
    """Corruption, or neither (files intact); a mismatch was ruled out before the read
    (`check_matches`)."""
    if manifested:
      return CheckpointError(
          f"checkpoint step {step} in {self.directory} matches its checksums but orbax cannot "
          f"restore it ({_short(e)}); left in place")
    return CheckpointCorruptError(f"orbax could not restore it: {_short(e)}")

  def restore(self, abstract_state: Any, data_iter: Any = None, step: int | None = None):
    """The restored state (and `data_iter` restored in place), or None if no checkpoint.

    Without `step`: the newest step that restores. A corrupt newest step is set aside with a
    warning and the previous one tried; a second corrupt step is an error (left in place).
    CheckpointMismatchError (the requested tree differs) moves nothing. With `step`: that step
    or an error.
    """
    if step is not None:
      state = self._restore_step(step, abstract_state, data_iter)
      self.restored_step = step
      return state
    steps = sorted(self.all_steps(), reverse=True)
    moved = None
    for s in steps:
      try:
        state = self._restore_step(s, abstract_state, data_iter)
      except CheckpointCorruptError as e:
        if moved is not None:
          raise CheckpointCorruptError(
              f"no usable checkpoint in {self.directory}: step {moved[0]} was corrupt "
              f"({moved[1]}) and was moved to {moved[2]}; step {s} is unusable too ({e}) and "
              "was left in place (two bad steps in a row: check the disk)") from None
        target = self._set_aside(s)
        logging.warning("checkpoint step %d in %s is unusable (%s); moved it to %s and trying "
                        "the previous step", s, self.directory, e, target)
        moved = (s, e, target)
        continue
      if moved is not None:
        logging.warning("resuming from step %d instead of the newest step %d", s, steps[0])
      self.restored_step = s
      return state
    if moved is not None:
      raise CheckpointCorruptError(
          f"no usable checkpoint in {self.directory}: its only step {moved[0]} was corrupt "
          f"({moved[1]}) and was moved to {moved[2]}")
    return None

  def restore_subtree(self, target: Any, step: int) -> Any:
    """Restore only the leaves of `target` (a sub-tree of the saved state, abstract arrays with
    shardings), e.g. the parameters without the optimizer state. orbax's partial restore skips
    stored leaves that `target` lacks, so callers first check that the entries they ask for
    match the stored ones leaf for leaf (`stored_differences(..., only=...)`)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                     restore_args=ocp.checkpoint_utils.construct_restore_args(
                                         target))))
    return out["state"]

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def saved_config(self, step: int):
    """The ml-collections config saved in `step`'s meta, with JSON's lists turned back into the
    tuples configs hold (config_flags cannot override lists)."""
    return ml_collections.ConfigDict(_tuples(self.restore_meta(step)["config"]))

  def stop_when(self, guard: "PreemptionGuard") -> None:
    """Once `guard` has a stop signal (`should_stop`, since `stop_time`), no wait for a save
    lasts past `signal_grace_s` after that signal (the trainer passes its PreemptionGuard)."""
    self._guard = guard

  @property
  def last_committed(self) -> int | None:
    """The newest step known to be committed without asking the storage (which may be what is
    failing): the step this process saw its last save of commit, else the step it restored."""
    known = [s for s in (self._committed, self.restored_step) if s is not None]
    return max(known) if known else None

  def resume_point(self) -> str:
    last = self.last_committed
    return (f"the last committed step is {last} in {self.directory}: rerun the same command "
            "to resume from it" if last is not None
            else f"there is no committed step in {self.directory} yet")

  def _deadline(self, start: float) -> tuple[float, str | None]:
    """When a wait that began at `start` ends, and the stop signal that set it (None: the
    save timeout did)."""
    end, signal_name = start + self.save_timeout_s, None
    g = self._guard
    if g is not None and g.should_stop:
      since = start if g.stop_time is None else g.stop_time
      if since + self.signal_grace_s < end:
        end, signal_name = since + self.signal_grace_s, g.signal_name or "signal"
    return end, signal_name

  def _abandon(self, step: int | None, signal_name: str | None) -> CheckpointStalledError:
    """The save of `step` given up on: never waited for again (`wait`, `close`)."""
    self._abandoned = step if step is not None else -1
    if signal_name is not None:
      return CheckpointStoppedError(
          f"stopped by {signal_name} while checkpoint step {step} was being saved in "
          f"{self.directory}: the save did not end within {self.signal_grace_s:g} s of the "
          f"signal (config.checkpoint.signal_grace_s), so it was abandoned; "
          f"{self.resume_point()}", step=step, last_committed=self.last_committed,
          signal_name=signal_name)
    return CheckpointStalledError(
        f"saving checkpoint step {step} in {self.directory} stalled: it did not end within "
        f"{self.save_timeout_s:g} s (config.checkpoint.save_timeout_s), so it was abandoned "
        f"(is the storage answering?); {self.resume_point()}", step=step,
        last_committed=self.last_committed)

  def _wait_for(self, step: int | None) -> None:
    """Polls orbax's save-in-progress flag until the save ends, or raises the abandonment once
    its deadline (`_deadline`) passes. A polled flag, never a join of orbax's thread: a join
    cannot be given up on, and a signal heard meanwhile could do nothing."""
    start = time.monotonic()
    while self._mngr.is_saving_in_progress():
      end, signal_name = self._deadline(start)
      if time.monotonic() >= end:
        raise self._abandon(step, signal_name)
      time.sleep(_POLL_S)

  def wait(self) -> None:
    """Waits for a background save, within the bounds of `_deadline`; CheckpointSaveError if
    it failed, CheckpointStalledError (CheckpointStoppedError after a signal) when it did not
    end in time. After an abandoned save, returns at once. Ctrl-C while a save is being
    committed first lets that commit finish (a process that exits now would leave the step as
    an uncommitted temporary folder: lost) within the signal grace, then re-raises; a second
    Ctrl-C abandons it."""
    step, self._pending = self._pending, None
    if self._abandoned is not None:
      return   # orbax's threads may still hold that save: never wait for them again
    try:
      try:
        if step is not None:
          self._wait_for(step)
        self._mngr.wait_until_finished()   # the save's thread has ended: returns at once,
                                           # raising the save's error if it failed
      except KeyboardInterrupt:
        logging.warning("interrupted while checkpoint step %s in %s was being committed: "
                        "finishing that commit before stopping (Ctrl-C again abandons it)",
                        step, self.directory)
        try:
          self._wait_for(step)
        except CheckpointStalledError:
          pass
        finally:   # the wait above may itself be interrupted (a third Ctrl-C): given up on
          if self._mngr.is_saving_in_progress():
            self._abandoned = step if step is not None else -1
        raise
    except CheckpointStalledError:
      raise
    except Exception as e:
      raise self._save_error(step, e) from e
    if step is not None:
      self._committed = step

  def close(self) -> None:
    """Waits for the save in flight (bounded, `wait`), then closes orbax's manager; after an
    abandoned save, orbax is left alone (its close would wait for that save without end)."""
    try:
      self.wait()
    finally:
      if self._abandoned is None:
        self._mngr.close()


# ------------------------------------------------------------------ preemption


class PreemptionGuard:
  """SIGTERM/SIGINT/SIGHUP -> `should_stop`, polled by the training loop at step boundaries.

      with PreemptionGuard() as guard:
        for step in ...:
          state = train_step(state, batch)
          if guard.poll(step):            # all hosts agree (one tiny all-gather when P > 1)
            ckpt.save(step, state, ...)
            break

  A second SIGINT while a stop is pending raises KeyboardInterrupt at once (impatient Ctrl-C).
  SIGHUP (the terminal or ssh session closed) is a stop request like SIGTERM. SIGHUP and
  SIGINT that were ignored when the guard started stay ignored: `nohup` asked the run to
  outlive the terminal, and a shell starts a script's background job (`cmd &`) with SIGINT
  ignored so that the terminal's Ctrl-C does not reach it (Python itself then installs no
  KeyboardInterrupt handler). SIGTERM, the scheduler's notice, is always a stop request.
  Whatever handlers were installed before (SIG_IGN and SIG_DFL included) come back on exit.
  Outside the main thread (where Python cannot install signal handlers) it only warns and
  `should_stop` stays False.
  """

  SIGNALS = early_signals.SIGNALS              # one list for the guard and the early handlers
  KEEP_IGNORED = early_signals.KEEP_IGNORED

  def __init__(self, *, sync_every: int = 1):
    self.should_stop = False
    self.signal_name: str | None = None
    self.stop_time: float | None = None   # time.monotonic() of the first stop signal
    # Where the trainer arms it: the process ends `backstop_s` after the first signal whatever
    # it waits in, printing `backstop_line()` (early_signals.end_after); `disarm` cancels it.
    self.backstop_s: float | None = None
    self.backstop_line = lambda: early_signals.stopped_line(
        self.signal_name or "signal", "(the run did not end in time)")
    self._backstop = None
    self.sync_every = max(1, int(sync_every))
    self._previous: dict[int, Any] = {}
    self._active = False
    # What the warning at a signal says the run will do (the trainer changes it by phase).
    self.then = "stopping at the end of this step after a checkpoint"

  def _handle(self, signum, frame):
    del frame
    if self.should_stop and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if self.stop_time is None:
      self.stop_time = time.monotonic()   # a save still running signal_grace_s after this
      if self.backstop_s is not None:     # is abandoned (Checkpointer.stop_when)
        self._backstop = early_signals.end_after(self.backstop_s, signum, self.backstop_line)
    self.should_stop = True
    self.signal_name = signal.Signals(signum).name
    logging.warning("received %s: %s", self.signal_name, self.then)

  def __enter__(self) -> "PreemptionGuard":
    if threading.current_thread() is not threading.main_thread():
      logging.warning("PreemptionGuard outside the main thread: signals are not intercepted")
      return self
    for sig in self.SIGNALS:
      current = signal.getsignal(sig)
      if sig in self.KEEP_IGNORED and current is signal.SIG_IGN:
        continue   # nohup / a background job: the parent asked for these to be ignored
      self._previous[sig] = signal.signal(sig, self._handle)
    self._active = True
    early_signals.guard_entered()   # the entry point's handlers step aside (early_signals.py)
    return self

  def disarm(self) -> None:
    """Cancels the backstop timer (the run ended by itself)."""
    if self._backstop is not None:
      self._backstop.cancel()
      self._backstop = None

  def __exit__(self, *exc) -> None:
    """Puts the previous handlers back; a second call does nothing."""
    for sig, handler in self._previous.items():
      # None: a handler installed outside Python; the default is the closest we can restore.
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    self._previous = {}
    if self._active:
      self._active = False
      early_signals.guard_exited()

  def poll(self, step: int) -> bool:
    """Whether to stop after `step`; multi-host: True on all hosts once any host got a signal
    (checked every `sync_every` steps so hosts stop at the same step)."""
    if jax.process_count() == 1:
      return self.should_stop
    if step % self.sync_every:
      return False
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray([self.should_stop]))
    return bool(np.any(flags))


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


_READ_S = 120.0   # the most a reader waits for its first listing of a run on object storage


def run_checkpoints(workdir) -> str:
  """`<workdir>/checkpoints`, or FileNotFoundError when `workdir` is not a training run's
  folder (checked before anything else is done with it). On object storage, storage that
  cannot be used is said as such (`storage.check`: no gcsfs, no network; a listing that fails
  for another reason, e.g. no credentials, names that error), never as a missing run."""
  directory = paths.name(RunLayout.of(workdir).checkpoints)
  if paths.is_uri(directory):
    storage.check(workdir, "the run directory")
    try:
      found = bounded.call(lambda: _lists(directory), _READ_S, f"listing {directory}")
    except (OSError, ValueError, RuntimeError) as e:
      raise storage.StorageError(f"cannot read the run directory {paths.name(workdir)} "
                                 f"({directory}): {storage.describe(e)}") from None
  else:
    found = paths.run_path(directory).is_dir()
  if not found:
    raise FileNotFoundError(f"no checkpoint found under {directory} (is {workdir!r} a "
                            "training run directory?)")
  return directory


def _lists(directory) -> bool:
  """Whether `directory` holds anything; FileNotFoundError reads as no; any other error of the
  storage propagates (gcsfs's `is_dir` would turn it into False)."""
  try:
    return any(True for _ in paths.run_path(directory).iterdir())
  except FileNotFoundError:
    return False


def load_for_inference(workdir: str, step: int | None = None, *, devices=None,
                       allow_unverified: bool = False):
  """(model, config, step) from a training run directory, for a notebook or the evaluator;
  `config` is the run's typed `attn_jax.config.RunConfig`, read from the checkpoint's meta.

  Read-only: the run directory is opened with `Checkpointer(read_only=True)` (no folder
  created, no temporary folder cleaned, nothing pruned or moved) and its lock is not taken, so
  a training run that is saving into it at the same time goes on undisturbed; only committed
  steps are seen (a save in progress is a temporary folder until orbax renames it).

  The config is read from the checkpoint's `meta`; only the parameters (and non-trainable
  state) are restored — never the optimizer moments (2x the parameters) — sharded over a mesh
  of `devices` (default: all devices) by the config's logical-axis rules, each host reading
  only its shards. The stored parameters must be exactly the ones that config builds (same
  leaves, shapes, dtypes): otherwise CheckpointMismatchError names the differing arrays, since
  loading the shared subset would run, e.g., FoX weights as plain attention. Every step is
  checked against its sha256 manifest first; a step without one is refused
  (CheckpointUnverifiedError) unless `allow_unverified`, then loads with a warning. Without
  `step`, a damaged newest step is skipped with a warning (left in place) for the newest one
  that loads, and a step that the training run deleted while it was
  being read (`checkpoint.max_to_keep`) is replaced by the newest committed one; with `step`, a
  damaged step is CheckpointCorruptError.
  """
  run_checkpoints(workdir)
  ckpt = Checkpointer(workdir, read_only=True, allow_unverified=allow_unverified)
  try:
    return _load_newest(ckpt, step, devices)
  finally:
    ckpt.close()


def _load_newest(ckpt: Checkpointer, step: int | None, devices, retries: int = 3):
  steps = sorted(ckpt.all_steps())
  if not steps:
    raise FileNotFoundError(f"no checkpoint found under {ckpt.directory}")
  if step is not None and step not in steps:
    raise FileNotFoundError(f"no checkpoint for step {step} under {ckpt.directory} (have "
                            f"{steps})")
  if step is not None:   # that step or an error: no other step is tried in its place
    try:
      model, config = _load_step(ckpt, step, devices)
    except CheckpointCorruptError as e:
      raise CheckpointCorruptError(f"checkpoint step {step} in {ckpt.directory} is unusable "
                                   f"({e}); no other step was tried in its place (it was asked "
                                   "for by number)") from None
    return model, config, step
  problems = []
  for s in steps[::-1]:
    try:
      model, config = _load_step(ckpt, s, devices)
    except CheckpointCorruptError as e:
      if retries and not paths.run_path(ckpt.step_dir(s)).is_dir():
        logging.warning("checkpoint step %d in %s was deleted while it was read (the training "
                        "run keeps checkpoint.max_to_keep steps); loading the newest again", s,
                        ckpt.directory)
        ckpt._mngr.reload()
        return _load_newest(ckpt, None, devices, retries - 1)
      problems.append(f"step {s}: {e}")
      if s != steps[0]:   # the oldest step: the error below says it all
        logging.warning("checkpoint step %d in %s is unusable (%s); trying the previous step",
                        s, ckpt.directory, e)
      continue
    if problems:
      logging.warning("loaded step %d instead of the newest step %d", s, steps[-1])
    return model, config, s
  raise CheckpointCorruptError(f"no usable checkpoint in {ckpt.directory}: "
                               + "; ".join(problems))


def _load_step(ckpt: Checkpointer, step: int, devices):
  """(model, RunConfig) of one verified step; CheckpointCorruptError when it cannot be read,
  CheckpointMismatchError when its saved config does not build its stored parameters."""
  problem = ckpt.verify(step)
  if problem:
    raise CheckpointCorruptError(problem)
  manifested = ckpt.check_verifiable(step)
  try:
    config = ckpt.saved_config(step)
  except Exception as e:
    raise CheckpointCorruptError(f"its meta (the saved config) cannot be read: {_short(e)}")
  try:
    run = RunConfig.from_config(config)
  except ValueError as e:
    raise CheckpointCorruptError(f"its meta (the saved config) is not a valid config: {e}")
  mesh = shd.make_mesh(run.mesh.shape, run.mesh.axis_names, devices)
  rules = config_rules(run)
  graphdef, abs_params, abs_rest = nnx.split(abstract_model(run.model), nnx.Param, ...)
  target = {}
  for name, abs_part in (("params", abs_params), ("rest", abs_rest)):
    shardings = shd.state_shardings(abs_part, mesh, rules)
    target[name] = abstract_with_shardings(nnx.to_pure_dict(abs_part), shardings)
  _check_meta_matches(ckpt, step, run.model, target)
  try:
    restored = ckpt.restore_subtree(target, step)
  except Exception as e:  # tensorstore: undecodable chunks, missing files
    raise CheckpointCorruptError(f"orbax could not restore it: {_short(e)}") from e
  if not manifested:
    ckpt.warn_unverified(step)
  params, rest = nnx.State(abs_params), nnx.State(abs_rest)
  nnx.replace_by_pure_dict(params, restored["params"])
  nnx.replace_by_pure_dict(rest, restored["rest"])
  return nnx.merge(graphdef, params, rest), run


def _check_meta_matches(ckpt: Checkpointer, step: int, m, target: dict) -> None:
  """The parameters the saved config builds must be the stored ones, leaf for leaf."""
  diffs = ckpt.stored_differences(step, target, only=tuple(target))
  if diffs is None:
    raise CheckpointCorruptError("orbax cannot read the metadata of its arrays")
  if diffs:
    raise CheckpointMismatchError(
        f"checkpoint step {step} in {ckpt.directory}: the config saved with it (its meta: "
        f"model.mixer={m.mixer!r}, model.pattern={tuple(m.pattern)!r}, "
        f"d_model={m.d_model}, n_layers={m.n_layers}) does not build the "
        f"parameters stored in it, so nothing was loaded (was the meta edited, or written by "
        f"other code?): {'; '.join(diffs)}", step=step, differences=diffs)


def _tuples(x):
  """`x` with every list (JSON's form of a tuple) a tuple again."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x
