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
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time


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
    self.workdir = os.path.abspath(workdir)
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


def _on_process_0(lock: WorkdirLock, process_index: int | None) -> WorkdirLock | None:
  """`lock` taken on process 0; the other processes return None (every host shares it)."""
  if process_index is None:
    import jax
    process_index = jax.process_index()
  return lock.acquire() if process_index == 0 else None


def lock_workdir(workdir: str, *, process_index: int | None = None) -> WorkdirLock | None:
  """Takes the lock on process 0 (others return None); raises WorkdirLockedError if held."""
  return _on_process_0(WorkdirLock(workdir), process_index)


TB_LOCK = ".writer.lock"


def lock_tensorboard(workdir: str, *, process_index: int | None = None) -> WorkdirLock | None:
  """Takes the lock of `<workdir>/tb` on process 0; WorkdirLockedError when another live run
  writes the same folder (reached through a symlink or a bind mount), TensorBoardLinkError
  when it is a link into another run's folder (`check_tensorboard_link`)."""
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
  tb = os.path.join(os.path.abspath(workdir), "tb")
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
