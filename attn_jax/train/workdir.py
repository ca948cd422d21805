"""One run per --workdir: an exclusive lock file `<workdir>/.lock` holding the holder's pid.

Two runs writing the same checkpoints and metrics corrupt both, so the second one must stop at
once, naming the first. Choices:
  * The lock is `fcntl.flock` on the file, held for the life of the process: the kernel drops it
    when the holder dies in any way (SIGKILL, OOM), so a crashed run never blocks the next one.
    The pid/host/time written inside are for the messages only.
  * A lock file whose flock is free but that still names a pid is stale (its run crashed): it is
    taken over with a warning naming that pid. Released locks are emptied, not deleted (deleting
    would let two processes lock two different files of the same name).
  * Only process 0 of a multi-host run takes it (every host shares the workdir).
  * The TensorBoard folder `<workdir>/tb` gets a lock of its own (`tb/.writer.lock`,
    `lock_tensorboard`): two runs can only reach one folder through a symlink or a bind mount
    (their workdirs differ), and their curves would interleave in it, so the second run stops
    naming the first. TensorBoard reads only event files and ignores it.
  * A `tb` that is a link into another run's folder (a folder holding a `.lock`, `checkpoints/`
    or `metrics.jsonl`, other than this workdir) is refused even when that run has ended
    (`TensorBoardLinkError`): the run would interleave its curves with that run's, and a
    restart from step 0 would move that run's events into this workdir's `tb.<k>/`. A link to a
    folder of its own (a faster disk) is fine.
  * Readers (evaluation, streaming) take no lock: they never write a run's files.
  * On object storage (a `gs://` workdir, attn_jax/paths.py) there is no flock: the lock is the
    object `<workdir>/.lock` holding the holder's host, pid, start time and a lease renewed
    every `LEASE_S / 4` seconds by a thread of the holder (`ObjectLock`). It is stale, and
    taken over with the same warning, when its holder is on this host and its pid is gone (a
    SIGKILLed run resumed on its machine goes on at once) or when its lease has not been
    renewed for `LEASE_S` (a holder on another host that died: a preempted VM's replacement
    waits at most that long). A released lock is an empty object, as locally. Two runs starting
    within the same second on one workdir cannot be told apart by a plain object store (no
    compare-and-swap through fsspec): each writes its claim, reads it back after a pause, and
    the one that does not find its own claim stops. The TensorBoard folder has no lock of its
    own there: it cannot be a link, so only this workdir's run reaches it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

from attn_jax import bounded, paths, storage
from attn_jax.train.metrics import row_steps


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir."""


class TensorBoardLinkError(ValueError):
  """`<workdir>/tb` is a link into another run's folder."""


RUN_MARKERS = (".lock", "checkpoints", "metrics.jsonl")


def _read(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = os.read(fd, 4096)
  try:
    return json.loads(raw) if raw.strip() else {}
  except ValueError:
    return {"raw": raw[:200].decode("utf-8", "replace")}


class WorkdirLock:
  """`with WorkdirLock(workdir): train(...)`; or `.acquire()` / `.release()`. `filename` and
  `what` (how messages name the folder) lock another folder the same way."""

  FILENAME = ".lock"

  def __init__(self, workdir: str, *, filename: str = FILENAME, what: str = "--workdir"):
    self.workdir = paths.name(workdir)
    self.path = os.path.join(self.workdir, filename)
    self.what = what
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    if self._fd is not None:
      return self
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise NotADirectoryError(f"{self.what} {self.workdir} is a file, not a directory")
    try:
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # unwritable (permissions, read-only file system, a file in the path)
      raise OSError(e.errno, f"{self.what} {self.workdir} is not usable: cannot create "
                    f"{self.path}: {e.strerror}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read(fd)
      os.close(fd)
      raise WorkdirLockedError(
          f"{self.what} {self.workdir}{self._resolved()} is in use by pid "
          f"{holder.get('pid', '?')} on host {holder.get('host', '?')} (since "
          f"{holder.get('started', '?')}); lock file {self.path}. Stop that run or choose "
          "another --workdir.") from None
    previous = _read(fd)
    if previous.get("pid") is not None:
      logging.warning("taking over the stale lock of pid %s on host %s in %s (that run ended "
                      "without releasing it)", previous.get("pid"), previous.get("host"),
                      self.path)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def _resolved(self) -> str:
    real = os.path.realpath(self.workdir)
    return "" if real == self.workdir else f" (= {real})"

  def release(self) -> None:
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)   # an empty lock file is a released one
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


LEASE_S = 120.0   # an object lock not renewed for this long is stale (its holder died)
RELEASE_S = 5.0   # the most a release waits for the storage (a run that is ending)
_SETTLE_S = 1.0   # how long a claim waits before reading itself back


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, OverflowError):
    return True   # someone else's process, or not a pid: not ours to call dead
  return True


class ObjectLock:
  """The lock of a workdir on object storage (see the module docstring); the same interface
  and messages as WorkdirLock."""

  def __init__(self, workdir, *, filename: str = WorkdirLock.FILENAME, what: str = "--workdir",
               lease_s: float = LEASE_S, settle_s: float = _SETTLE_S):
    self.workdir = paths.name(workdir)
    self.path = paths.run_path(workdir) / filename
    self.what, self.lease_s, self.settle_s = what, float(lease_s), float(settle_s)
    self._token: str | None = None
    self._started = ""
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _holder(self) -> dict:
    try:
      raw = self.path.read_bytes()
    except FileNotFoundError:
      return {}
    try:
      return json.loads(raw) if raw.strip() else {}
    except ValueError:
      return {"raw": raw[:200].decode("utf-8", "replace")}

  def stale(self, holder: dict) -> bool:
    """Whether `holder` (the lock object's content) names a run that is gone."""
    if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
      return True
    try:
      renewed = float(holder.get("renewed"))
    except (TypeError, ValueError):
      return True   # not a lock this code wrote
    return time.time() - renewed > self.lease_s

  def _claim(self) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started,
            "renewed": time.time(), "token": self._token}

  def _locked_error(self, holder: dict) -> WorkdirLockedError:
    return WorkdirLockedError(
        f"{self.what} {self.workdir} is in use by pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')} (since {holder.get('started', '?')}); lock object "
        f"{self.path}, renewed every {self.lease_s / 4:.0f} s while that run lives (stale "
        f"after {self.lease_s:.0f} s without renewal). Stop that run or choose another "
        "--workdir.")

  def acquire(self) -> "ObjectLock":
    if self._token is not None:
      return self
    storage.check(self.workdir, self.what)   # no gcsfs, no network: one line, at once
    try:
      holder = self._holder()
    except Exception as e:  # noqa: BLE001 - a missing bucket, no credentials: say which
      raise OSError(f"{self.what} {self.workdir} is not usable: cannot read {self.path}: "
                    f"{type(e).__name__}: {e}") from None
    if holder.get("pid") is not None:
      if not self.stale(holder):
        raise self._locked_error(holder)
      logging.warning("taking over the stale lock of pid %s on host %s in %s (that run ended "
                      "without releasing it)", holder.get("pid"), holder.get("host"), self.path)
    self._token = uuid.uuid4().hex
    self._started = time.strftime("%Y-%m-%d %H:%M:%S")
    claim = self._claim()
    try:
      self.path.write_text(json.dumps(claim))
    except Exception as e:  # noqa: BLE001
      self._token = None
      raise OSError(f"{self.what} {self.workdir} is not usable: cannot create {self.path}: "
                    f"{type(e).__name__}: {e}") from None
    time.sleep(self.settle_s)
    now = self._holder()
    if now.get("token") != self._token:
      self._token = None
      raise self._locked_error(now)
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew, name="attn_jax workdir lease",
                                    daemon=True)
    self._thread.start()
    return self

  def _renew(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        holder = self._holder()
        if holder.get("token") != self._token:   # taken over after a lapse: say so, stop
          logging.error("the workdir lock %s was taken over by pid %s on host %s after this "
                        "run's lease lapsed: two runs may now write %s", self.path,
                        holder.get("pid"), holder.get("host"), self.workdir)
          return
        self.path.write_text(json.dumps(self._claim()))
      except Exception as e:  # noqa: BLE001 - a lapse is retried; the run goes on
        logging.warning("could not renew the workdir lease %s: %s", self.path, e)

  def release(self) -> None:
    """Empties the lock object (when it is still this run's), within `RELEASE_S`: a run that
    is ending (a stalled bucket, a signal's grace) never waits longer on the storage here; a
    lock not released is stale once its lease lapses."""
    if self._token is None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(RELEASE_S / 2)
      self._thread = None

    def empty():
      if self._holder().get("token") == self._token:
        self.path.write_bytes(b"")   # an empty lock is a released one

    try:
      bounded.call(empty, RELEASE_S, f"releasing {self.path}")
    except Exception as e:  # noqa: BLE001 - the lease lapses on its own
      logging.warning("could not release the workdir lock %s (%s): it is taken over once its "
                      "lease lapses, %.0f s after its last renewal", self.path, e, self.lease_s)
    self._token = None

  def __enter__(self) -> "ObjectLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _on_process_0(lock, process_index: int | None) -> WorkdirLock | None:
  """`lock` taken on process 0; the other processes return None (every host shares it)."""
  if process_index is None:
    import jax
    process_index = jax.process_index()
  return lock.acquire() if process_index == 0 else None


def lock_workdir(workdir, *, process_index: int | None = None):
  """Takes the lock on process 0 (others return None); raises WorkdirLockedError if held. A
  WorkdirLock on a local disk, an ObjectLock on object storage."""
  lock = WorkdirLock(workdir) if paths.is_local(workdir) else ObjectLock(workdir)
  return _on_process_0(lock, process_index)


TB_LOCK = ".writer.lock"


def lock_tensorboard(workdir: str, *, process_index: int | None = None) -> WorkdirLock | None:
  """Takes the lock of `<workdir>/tb` on process 0; WorkdirLockedError when another live run
  writes the same folder (reached through a symlink or a bind mount), TensorBoardLinkError
  when it is a link into another run's folder (`check_tensorboard_link`). None on object
  storage (no links there: the workdir's lock covers it)."""
  if paths.is_uri(workdir):
    return None
  lock = _on_process_0(WorkdirLock(os.path.join(workdir, "tb"), filename=TB_LOCK,
                                   what="the TensorBoard folder"), process_index)
  try:
    check_tensorboard_link(workdir)
  except TensorBoardLinkError:
    if lock is not None:
      lock.release()
    raise
  return lock


def check_tensorboard_link(workdir: str) -> None:
  """TensorBoardLinkError when `<workdir>/tb` resolves into another run's folder."""
  tb = os.path.join(paths.name(workdir), "tb")
  real, home = os.path.realpath(tb), os.path.realpath(workdir)
  owner = os.path.dirname(real)
  if real == os.path.join(home, "tb") or owner == home:
    return
  found = [m for m in RUN_MARKERS if os.path.exists(os.path.join(owner, m))]
  if found:
    raise TensorBoardLinkError(
        f"the TensorBoard folder {tb} is a link to {real}, the TensorBoard folder of another "
        f"run ({owner} holds {', '.join(found)}): this run would mix its curves into that "
        "run's and could move that run's events into its own history. Remove the link (the "
        "run then makes its own tb/), or point it at a folder of its own")


# ------------------------------------------------------------------ history rotation

HISTORY = ("metrics.jsonl", "tb")


def _history_entries(workdir: str) -> dict[str, list[str]]:
  """{"metrics.jsonl": [it], "tb": [its event files...]} for the non-empty ones."""
  out = {}
  metrics = paths.run_path(workdir) / "metrics.jsonl"
  if metrics.is_file() and metrics.stat().length > 0:
    out["metrics.jsonl"] = [paths.name(metrics)]
  tb = paths.run_path(workdir) / "tb"
  if tb.is_dir():
    names = sorted(p.name for p in tb.iterdir() if p.name != TB_LOCK)
    if names:
      out["tb"] = [paths.name(tb / n) for n in names]
  return out


def rotate_history(workdir: str, checkpoint_dir: str = "") -> dict[str, str]:
  """Before a run starts at step 0 in `workdir`: an earlier run's metrics.jsonl and TensorBoard
  events (its checkpoints are gone or were set aside as corrupt) are moved to metrics.jsonl.<k>
  and tb.<k>/ (k: the first number free for both), with a warning saying so; nothing is
  deleted. (The TensorBoard folder stays where it is with its lock; its files move.) Returns
  {old path: new path}."""
  found = _history_entries(workdir)
  if not found:
    return {}
  home = paths.run_path(workdir)
  k = 1
  while any((home / f"{n}.{k}").exists() for n in HISTORY):
    k += 1
  moved = {}
  if "metrics.jsonl" in found:
    steps = [s for _, _, s in row_steps(found["metrics.jsonl"][0]) if s is not None]
    rows = (f"{len(steps)} metric rows" + (f", steps {min(steps)}-{max(steps)}" if steps
                                            else ""))
    moved[found["metrics.jsonl"][0]] = paths.name(home / f"metrics.jsonl.{k}")
  else:
    rows = "TensorBoard events"
  if "tb" in found:
    target = home / f"tb.{k}"
    target.mkdir(parents=True)
    moved.update({p: paths.name(target / paths.run_path(p).name) for p in found["tb"]})
  for old, new in moved.items():
    paths.move(old, new)
  ckpts = paths.run_path(checkpoint_dir) if checkpoint_dir else None
  corrupt = sorted(p.name for p in (ckpts.iterdir() if ckpts and ckpts.is_dir() else ())
                   if ".corrupt" in p.name)
  why = (f"its checkpoints were set aside as corrupt ({', '.join(corrupt)})" if corrupt
         else "it left no checkpoint to resume from")
  logging.warning("starting at step 0 in %s, which holds an earlier run's history (%s; %s): "
                  "moved it aside to %s, nothing was deleted", workdir, rows, why,
                  " and ".join(sorted({paths.name(home / f"{n}.{k}") for n in found})))
  return moved
