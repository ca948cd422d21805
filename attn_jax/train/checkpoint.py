"""Orbax checkpoints holding everything a run needs to continue bit-identically:

    <workdir>/checkpoints/<step>/state   params, non-trainable state, optimizer state, step, rng
    <workdir>/checkpoints/<step>/data    the grain iterator position (one JSON file per host)
    <workdir>/checkpoints/<step>/meta    the config that produced it (JSON), for evaluation
    <workdir>/checkpoints/<step>/attn_jax_sha256.json   checksums, written after the save ended

Restoring takes abstract arrays *with shardings*, so each host reads only its shards.

Reliability (the choices):
  * Never save garbage: `save` refuses a state with a NaN/Inf float leaf (`all_finite`, one
    on-device reduction) and names the last finite checkpoint.
  * Never load garbage: orbax writes a step into a temporary folder and renames it when the
    (possibly asynchronous) save is complete, so interrupted saves are not steps; leftover
    temporary folders are deleted when a Checkpointer opens. After orbax finished a step, process
    0 writes a sha256 manifest of every file in it. `restore` walks the steps newest first and
    skips (with a warning naming the step, moving the folder aside to `<step>.corrupt`) any step
    whose manifest disagrees with the files (truncated, flipped or deleted files), that orbax
    cannot read, or whose restored values are not finite, and falls back to the previous good one.
    A step without a manifest (crash between orbax's commit and the manifest, or an older run) is
    trusted to orbax's own validation, with a warning.
  * Preemption: `PreemptionGuard` turns SIGTERM (what SLURM/Kubernetes/TPU maintenance send) and
    SIGINT into a flag the training loop polls at step boundaries, so the last step is saved
    before exit instead of dying mid-step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

MANIFEST = "attn_jax_sha256.json"
_CHUNK = 1 << 22


class CheckpointCorruptError(RuntimeError):
  """A checkpoint that cannot be used (checksum mismatch, unreadable, non-finite)."""


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


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != MANIFEST:
        out.append(rel)
  return sorted(out)


def write_manifest(step_dir: str) -> None:
  """sha256 + size of every file of a finished step folder, in `<step_dir>/MANIFEST`."""
  files = {rel: {"sha256": _sha256(os.path.join(step_dir, rel)),
                 "size": os.path.getsize(os.path.join(step_dir, rel))}
           for rel in _files(step_dir)}
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"version": 1, "files": files}, f, indent=0, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, MANIFEST))  # atomic: a manifest is whole or absent


def verify_manifest(step_dir: str) -> str | None:
  """None when the files match the manifest, else what is wrong; "no manifest" if absent."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.isfile(path):
    return "no manifest"
  try:
    with open(path) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"unreadable manifest {path}: {e}"
  for rel, want in files.items():
    full = os.path.join(step_dir, rel)
    if not os.path.isfile(full):
      return f"missing file {rel}"
    size = os.path.getsize(full)
    if size != want["size"]:
      return f"{rel} has {size} bytes, the manifest says {want['size']} (truncated?)"
    if _sha256(full) != want["sha256"]:
      return f"{rel} does not match its sha256 (corrupted bytes)"
  return None


# ------------------------------------------------------------------ checkpointer


class Checkpointer:
  def __init__(self, workdir: str, *, max_to_keep: int = 3, save_interval_steps: int = 1,
               checksums: bool = True):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.checksums = checksums
    self._mngr = ocp.CheckpointManager(
        self.directory,
        item_names=("state", "data", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             save_interval_steps=save_interval_steps,
                                             cleanup_tmp_directories=True),
    )
    self._unmanifested: list[int] = []   # saved steps whose manifest is not written yet
    self.restored_step: int | None = None

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, data_iter: Any = None, meta: dict | None = None, *,
           force: bool = False) -> bool:
    """Starts an (asynchronous) save; raises NonFiniteStateError instead of saving NaN/Inf."""
    if not all_finite(state):
      good = [s for s in self.all_steps() if s < step]
      last = (f"the last finite checkpoint is step {max(good)} in {self.directory}" if good
              else f"there is no earlier checkpoint in {self.directory}")
      raise NonFiniteStateError(
          f"refusing to save step {step}: non-finite values in {nonfinite_paths(state)}; {last}")
    self._finish_manifests()
    items = {"state": ocp.args.StandardSave(state),
             "meta": ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      import grain  # only with a data iterator: benchmarks import the trainer without it
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    saved = self._mngr.save(step, args=ocp.args.Composite(**items), force=force)
    if saved and self.checksums:
      self._unmanifested.append(step)
    return saved

  def _finish_manifests(self) -> None:
    """Waits for pending saves, then (process 0) checksums the steps they wrote."""
    if not self._unmanifested:
      return
    self._mngr.wait_until_finished()
    if jax.process_index() == 0:
      for step in self._unmanifested:
        if os.path.isdir(self.step_dir(step)):  # max_to_keep may have removed it already
          write_manifest(self.step_dir(step))
    self._unmanifested = []

  def verify(self, step: int) -> str | None:
    """None if step's files match their manifest (or it has none), else the problem."""
    self._finish_manifests()
    problem = verify_manifest(self.step_dir(step))
    if problem == "no manifest":
      logging.warning("checkpoint step %d in %s has no checksum manifest; relying on orbax's "
                      "validation", step, self.directory)
      return None
    return problem

  def _set_aside(self, step: int) -> None:
    """Moves a bad step folder to `<step>.corrupt[.n]` so it is neither restored nor in the
    way of the run saving that step again."""
    if jax.process_index() == 0:
      target = self.step_dir(step) + ".corrupt"
      n = 0
      while os.path.exists(target):
        n += 1
        target = f"{self.step_dir(step)}.corrupt.{n}"
      os.rename(self.step_dir(step), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"attn_jax_ckpt_set_aside_{step}")
    self._mngr.reload()

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any):
    problem = self.verify(step)
    if problem:
      raise CheckpointCorruptError(problem)
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      state = self._mngr.restore(step, args=ocp.args.Composite(**items))["state"]
    except Exception as e:  # orbax/tensorstore: missing metadata, undecodable chunks, ...
      raise CheckpointCorruptError(f"orbax could not restore it: {type(e).__name__}: "
                                   f"{str(e)[:300]}") from e
    if not all_finite(state):
      raise CheckpointCorruptError(f"non-finite values in {nonfinite_paths(state)}")
    return state

  def restore(self, abstract_state: Any, data_iter: Any = None, step: int | None = None):
    """The restored state (and `data_iter` restored in place), or None if no checkpoint.

    Without `step`: the newest step that passes verification; bad ones are skipped with a
    warning and set aside. With `step`: that step or CheckpointCorruptError.
    """
    if step is not None:
      state = self._restore_step(step, abstract_state, data_iter)
      self.restored_step = step
      return state
    steps = sorted(self.all_steps(), reverse=True)
    problems = []
    for s in steps:
      try:
        state = self._restore_step(s, abstract_state, data_iter)
      except CheckpointCorruptError as e:
        logging.warning("checkpoint step %d in %s is unusable (%s); skipping it (moved to "
                        "%s.corrupt) and trying the previous one", s, self.directory, e,
                        self.step_dir(s))
        problems.append(f"step {s}: {e}")
        self._set_aside(s)
        continue
      if problems:
        logging.warning("resuming from step %d instead of the newest step %d", s, steps[0])
      self.restored_step = s
      return state
    if problems:
      raise CheckpointCorruptError(
          f"no usable checkpoint in {self.directory} (all set aside as <step>.corrupt): "
          + "; ".join(problems))
    return None

  def restore_subtree(self, target: Any, step: int) -> Any:
    """Restore only the leaves of `target` (a sub-tree of the saved state, abstract arrays with
    shardings), e.g. the parameters without the optimizer state."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                     restore_args=ocp.checkpoint_utils.construct_restore_args(
                                         target))))
    return out["state"]

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()
    self._finish_manifests()

  def close(self) -> None:
    self.wait()
    self._mngr.close()


# ------------------------------------------------------------------ preemption


class PreemptionGuard:
  """SIGTERM/SIGINT -> `should_stop`, polled by the training loop at step boundaries.

      with PreemptionGuard() as guard:
        for step in ...:
          state = train_step(state, batch)
          if guard.poll(step):            # all hosts agree (one tiny all-gather when P > 1)
            ckpt.save(step, state, ...)
            break

  A second SIGINT while a stop is pending raises KeyboardInterrupt at once (impatient Ctrl-C).
  The previous handlers come back on exit. Outside the main thread (where Python cannot install
  signal handlers) it only warns and `should_stop` stays False.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, *, sync_every: int = 1):
    self.should_stop = False
    self.signal_name: str | None = None
    self.sync_every = max(1, int(sync_every))
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame):
    del frame
    if self.should_stop and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.should_stop = True
    self.signal_name = signal.Signals(signum).name
    logging.warning("received %s: stopping at the end of this step after a checkpoint",
                    self.signal_name)

  def __enter__(self) -> "PreemptionGuard":
    if threading.current_thread() is not threading.main_thread():
      logging.warning("PreemptionGuard outside the main thread: signals are not intercepted")
      return self
    for sig in self.SIGNALS:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

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


def config_to_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def load_for_inference(workdir: str, step: int | None = None, *, devices=None):
  """(model, config, step) from a training run directory, for a notebook or the evaluator.

  The config is read from the checkpoint's `meta`; only the parameters (and non-trainable
  state) are restored — never the optimizer moments (2x the parameters) — sharded over a mesh
  of `devices` (default: all devices) by the config's logical-axis rules, each host reading
  only its shards.
  """
  import ml_collections
  from flax import nnx

  from attn_jax import sharding as shd
  from attn_jax.model import abstract_model

  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if not os.path.isdir(directory):  # checked first: the manager would create the folder
    raise FileNotFoundError(f"no checkpoint found under {directory} (is {workdir!r} a "
                            "training run directory?)")
  ckpt = Checkpointer(workdir)
  steps = sorted(ckpt.all_steps())
  if not steps:
    raise FileNotFoundError(f"no checkpoint found under {ckpt.directory}")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint for step {step} under {ckpt.directory} (have "
                            f"{steps})")
  config = ml_collections.ConfigDict(_tuples(ckpt.restore_meta(step)["config"]))
  mesh = shd.make_mesh(config.mesh.shape, config.mesh.axis_names, devices)
  rules = shd.rules_dict(config.mesh.rules)
  graphdef, abs_params, abs_rest = nnx.split(abstract_model(config.model), nnx.Param, ...)
  target = {}
  for name, abs_part in (("params", abs_params), ("rest", abs_rest)):
    shardings = shd.state_shardings(abs_part, mesh, rules)
    target[name] = abstract_with_shardings(nnx.to_pure_dict(abs_part), shardings)
  restored = ckpt.restore_subtree(target, step)
  ckpt.close()
  params, rest = nnx.State(abs_params), nnx.State(abs_rest)
  nnx.replace_by_pure_dict(params, restored["params"])
  nnx.replace_by_pure_dict(rest, restored["rest"])
  return nnx.merge(graphdef, params, rest), config, step


def _tuples(x):
  """JSON turns tuples into lists; configs hold tuples (config_flags can't override lists)."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x
