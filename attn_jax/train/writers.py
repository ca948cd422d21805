"""The run's output writers (metrics.jsonl, TensorBoard, any writer added later) and the one way
they fail.

A writer is anything with `name` (how messages call it), `path` (where its bytes go: names the
disk when it fills), `write(step, row)`, `flush()` and `close()` (`Writer`). A row is the flat
{metric: number or string} dict of one step (`MetricWriter` cleans it once for every writer).

How a write can fail, and what the run does (the choices):
  * A failed write (a full disk, an unwritable folder, a lost network share) is a `WriteError`:
    the run stops at the step boundary exactly as after a failed checkpoint save
    (`CheckpointSaveError` is a WriteError too): one line naming the writer, the file, the disk
    (its mount point and free space) and the step, no second save on the way out (that would
    leave checkpoints newer than the rows logged), the latest checkpoint kept as the resume
    point, exit status 2. A resumed run logs the lost rows again (metrics.py).
  * No writer can block the training loop. A writer that may be slow or that fails in a thread
    of its own (TensorBoard's event files, a W&B uploader) runs behind `Background`: its calls go
    through a bounded queue into one worker thread, the worker's first exception is kept and
    raised in the main thread at the next call or `check()` (polled every step), and a put waits
    in short slices: a writer that takes no row for `stall_s` seconds is a WriteError, and a
    stop request (SIGTERM / SIGINT, `should_stop`) ends the wait at once with the row dropped,
    so a signal is always acted on at the step it arrives in. (tensorboardX's own writer thread
    is not used: when it died on a full disk its bounded queue blocked the loop for good.)
  * metrics.jsonl is appended in the main thread (`JsonlWriter`): a few hundred bytes a row,
    and its failure is reported with the exact step that was lost.

A new writer (issue 44's W&B) joins by implementing `Writer` and being added with
`MetricWriter.add(Background(writer))` (or without `Background` when its calls cannot block):
its failures then stop the run through this same path."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Protocol

STALL_S = 120.0    # a writer that takes no row for this long is broken (a hung network share)
_SLICE_S = 0.05    # how often a waiting put looks at the writer's error and the stop request


class WriteError(OSError):
  """A run output could not be written; the run stops at the step boundary, older checkpoints
  kept (the message names the writer, the file, the disk and the step)."""


class Writer(Protocol):
  name: str
  path: str

  def write(self, step: int, row: Mapping[str, Any]) -> None: ...

  def flush(self) -> None: ...

  def close(self) -> None: ...


# ------------------------------------------------------------------ naming the disk


def _mount_point(path: str) -> str:
  p = os.path.realpath(path)
  while not os.path.exists(p) and os.path.dirname(p) != p:
    p = os.path.dirname(p)
  while not os.path.ismount(p):
    p = os.path.dirname(p)
  return p


def _size(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError


def describe_disk(path: str) -> str:
  """"the disk mounted at /mnt/x (12.0 KiB free of 3.0 MiB)" for the file system of `path`."""
  mount = _mount_point(path)
  try:
    st = os.statvfs(mount)
  except OSError:
    return f"the disk mounted at {mount}"
  return (f"the disk mounted at {mount} ({_size(st.f_bavail * st.f_frsize)} free of "
          f"{_size(st.f_blocks * st.f_frsize)})")


def disk_full(e: BaseException) -> bool:
  text = str(e)
  return (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
          or "No space left" in text or "os_error_code='28'" in text)


def write_error(name: str, path: str, step: int | None, e: BaseException) -> WriteError:
  """The WriteError of writer `name` failing on `path` at `step` with `e`."""
  if disk_full(e):
    why = (f"{describe_disk(path)} is full (no space left on the device); free space or point "
           "--workdir elsewhere, then rerun to resume")
  else:
    why = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e} ({describe_disk(path)})"
  at = f" at step {step}" if step is not None else ""
  return WriteError(getattr(e, "errno", None) or errno.EIO,
                    f"writing {name} ({path}) failed{at}: {why}")


# ------------------------------------------------------------------ the writers


class JsonlWriter:
  """One JSON object per line, appended (and closed) per row in the calling thread."""

  name = "metrics.jsonl"

  def __init__(self, path: str):
    self.path = path

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    # JSON has no NaN/Inf: they are written as strings, so every line stays valid JSON.
    clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in row.items()}
    try:
      with open(self.path, "a") as f:
        f.write(json.dumps(clean) + "\n")
    except OSError as e:
      raise write_error(self.name, self.path, step, e) from e

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class TensorBoardWriter:
  """Scalar events in `<directory>/events.out.tfevents.*`, written and flushed per row by the
  caller's thread (run it behind `Background`); the file is opened at the first call.
  `purge(step)` makes TensorBoard discard the events with step >= `step` written before it
  (a SessionLog START, what tensorboardX's purge_step writes)."""

  name = "TensorBoard"

  def __init__(self, directory: str):
    self.path = directory
    self._events = None

  def _file(self):
    if self._events is None:
      from tensorboardX.event_file_writer import EventsWriter
      os.makedirs(self.path, exist_ok=True)
      # A nanosecond suffix: two files of one second (a purge right after a start, a quick
      # rerun) neither overwrite each other nor sort out of order (TensorBoard reads them in
      # name order, and a purge only hides events of the files read before it).
      self._events = EventsWriter(os.path.join(self.path, "events"),
                                  filename_suffix=f".{time.time_ns()}")
    return self._events

  def _event(self, **fields):
    from tensorboardX.proto import event_pb2
    return event_pb2.Event(wall_time=time.time(), **fields)

  def purge(self, step: int) -> None:
    from tensorboardX.proto import event_pb2
    events = self._file()
    events.write_event(self._event(step=step, file_version="brain.Event:2"))
    events.write_event(self._event(step=step, session_log=event_pb2.SessionLog(
        status=event_pb2.SessionLog.START)))
    events.flush()

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    from tensorboardX import summary
    events = self._file()
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        events.write_event(self._event(step=step, summary=summary.scalar(k, v)))
    events.flush()

  def flush(self) -> None:
    if self._events is not None:
      self._events.flush()

  def close(self) -> None:
    if self._events is not None:
      self._events.close()


class Background:
  """Runs `writer` in a worker thread of its own behind a bounded queue (see the module
  docstring): `write`, `flush`, `close` and any other method of the writer (`call`) never block
  the caller for more than `stall_s` seconds, end at once when `should_stop()` turns true, and
  raise the worker's first failure as a WriteError."""

  def __init__(self, writer: Writer, *, queue_size: int = 64, stall_s: float = STALL_S,
               should_stop: Callable[[], bool] | None = None):
    self.writer, self.name, self.path = writer, writer.name, writer.path
    self.stall_s = float(stall_s)
    self.should_stop = should_stop or (lambda: False)
    self._queue: queue.Queue = queue.Queue(queue_size)
    self._error: WriteError | None = None
    self._step: int | None = None   # the last step handed over (names a failed flush / close)
    self._closed = False
    self._thread = threading.Thread(target=self._work, name=f"attn_jax {self.name} writer",
                                    daemon=True)
    self._thread.start()

  def _work(self) -> None:
    while True:
      method, args, step = self._queue.get()
      if self._error is None:   # after a failure the rest is drained unwritten: no put waits
        try:
          getattr(self.writer, method)(*args)
        except Exception as e:  # noqa: BLE001 - every failure ends this writer the same way
          if not isinstance(e, WriteError):
            err = write_error(self.name, self.path, step, e)
            err.__cause__, e = e, err
          self._error = e.with_traceback(None)   # raised again in the caller's thread
      if method == "close":
        return

  def check(self) -> None:
    """Raises the worker's failure (once it has failed), else nothing."""
    if self._error is not None:
      raise self._error

  def _put(self, method: str, *args, step: int | None = None) -> bool:
    """Hands a call to the worker; False when a stop request dropped it."""
    self.check()
    self._step = self._step if step is None else step
    deadline = time.monotonic() + self.stall_s
    while True:
      try:
        self._queue.put((method, args, self._step), timeout=_SLICE_S)
        return True
      except queue.Full:
        self.check()
        if self.should_stop():
          logging.warning("%s (%s) is not taking rows: dropped %s of step %s to stop now",
                          self.name, self.path, method, self._step)
          return False
        if time.monotonic() > deadline:
          raise WriteError(errno.ETIMEDOUT, (
              f"writing {self.name} ({self.path}) stalled at step {self._step}: it took no row "
              f"for {self.stall_s:.0f} s ({describe_disk(self.path)}; a hung network share?)"))

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    self._put("write", step, dict(row), step=step)

  def call(self, method: str, *args) -> None:
    """Any other method of the writer (e.g. TensorBoardWriter.purge), in the worker."""
    self._put(method, *args)

  def flush(self) -> None:
    self._put("flush")

  def close(self, timeout: float | None = None) -> None:
    """Hands over the close and waits for the worker (at most `timeout`, default `stall_s`;
    a few seconds once a stop was requested); raises its failure."""
    if self._closed:
      self.check()
      return
    self._closed = True
    if self._error is None and self._put("close"):
      wait = timeout if timeout is not None else (5.0 if self.should_stop() else self.stall_s)
      self._thread.join(wait)
      if self._thread.is_alive():
        logging.error("%s (%s) did not finish its writes within %.0f s; leaving it",
                      self.name, self.path, wait)
    self.check()
