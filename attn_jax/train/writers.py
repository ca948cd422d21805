"""The run's output writers (metrics.jsonl, TensorBoard, any writer added later) and the one way
they fail.

A writer is anything with `name` (how messages call it), `path` (where its bytes go: names the
disk when it fills), `write(step, row)`, `flush()` and `close()` (`Writer`). A row is the flat
{metric: number} dict of one step, "step" included (`MetricWriter` turns arrays into Python
numbers once for every writer; NaN / Inf stay floats, which metrics.jsonl writes as strings).

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

A new writer (such as train/wandb_writer.py's W&B) joins by implementing `Writer` and being added with
`MetricWriter.add(Background(writer))` (or without `Background` when its calls cannot block):
its failures then stop the run through this same path."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable, Mapping, Protocol

from attn_jax import paths

STALL_S = 120.0    # a writer that takes no row for this long is broken (a hung network share)
QUEUE_ROWS = 64   # calls a Background writer may hold (a burst of rows while it writes)
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
  """"the disk mounted at /mnt/x (12.0 KiB free of 3.0 MiB)" for the file system of `path`;
  "object storage gs://bucket" for a URI (no free-space figure there)."""
  if paths.is_uri(path):
    return f"object storage {paths.bucket(path)}"
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
  return _error(getattr(e, "errno", None) or errno.EIO, f"writing {name} ({path}) failed{at}: "
                f"{why}")


def _error(number: int, message: str) -> WriteError:
  """A WriteError whose text is `message` alone (no "[Errno n]" in front) and whose errno is
  `number`."""
  e = WriteError(message)
  e.errno = number
  return e


# ------------------------------------------------------------------ the writers


class JsonlWriter:
  """One JSON object per line, appended (and closed) per row in the calling thread. On object
  storage the object is written again whole after each row (paths.Appender)."""

  name = "metrics.jsonl"

  def __init__(self, path: str):
    self.path = path
    self._object = paths.Appender(path) if paths.is_uri(path) else None

  def reopen(self) -> None:
    """The file was replaced (MetricWriter.truncate_after): read it again at the next row."""
    if self._object is not None:
      self._object = paths.Appender(self.path)

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    # JSON has no NaN/Inf: they are written as strings, so every line stays valid JSON.
    clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in row.items()}
    try:
      if self._object is not None:
        self._object.write((json.dumps(clean) + "\n").encode())
        self._object.flush()
      else:
        with open(self.path, "a") as f:
          f.write(json.dumps(clean) + "\n")
    except OSError as e:
      raise write_error(self.name, self.path, step, e) from e

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class TensorBoardWriter:
  """Scalar events in `<directory>/events.out.tfevents.*` (TFRecord framing, tensorboardX's
  Event protos), written and flushed per row by the caller's thread (run it behind
  `Background`), fsync'ed by `flush`; the file is opened at the first call (on object storage
  an object written whole at each flush: paths.Appender). `purge(step)` makes
  TensorBoard discard the events with step >= `step` written before it (a SessionLog START,
  what tensorboardX's purge_step writes)."""

  name = "TensorBoard"

  def __init__(self, directory: str):
    self.path = directory
    self._f = None

  def _file(self):
    if self._f is None:
      paths.run_path(self.path).mkdir(parents=True, exist_ok=True)
      # A nanosecond suffix: two files of one second (a purge right after a start, a quick
      # rerun) neither overwrite each other nor sort out of order (TensorBoard reads them in
      # name order, and a purge only hides the events of files read before it).
      now = time.time_ns()
      name = f"events.out.tfevents.{now // 10**9:010d}.{socket.gethostname()}.{now}"
      self._f = paths.Appender(paths.run_path(self.path) / name)
      self._put(file_version="brain.Event:2")
    return self._f

  def _put(self, **fields) -> None:
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    data = event_pb2.Event(wall_time=time.time(), **fields).SerializeToString()
    header = struct.pack("<Q", len(data))
    self._file().write(header + struct.pack("<I", masked_crc32c(header)) + data
                       + struct.pack("<I", masked_crc32c(data)))

  def purge(self, step: int) -> None:
    from tensorboardX.proto import event_pb2
    self._put(step=step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    self._file().flush()

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    from tensorboardX import summary
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        self._put(step=step, summary=summary.scalar(k, v))
    self._file().flush()

  def flush(self) -> None:
    if self._f is not None:
      self._f.flush(sync=True)

  def close(self) -> None:
    if self._f is not None:
      self.flush()
      self._f.close()
      self._f = None


class Background:
  """Runs `writer` in a worker thread of its own behind a bounded queue (see the module
  docstring): `write`, `flush`, `close` and any other method of the writer (`call`) never block
  the caller for more than `stall_s` seconds, end at once when `should_stop()` turns true, and
  raise the worker's first failure as a WriteError."""

  def __init__(self, writer: Writer, *, queue_size: int | None = None, stall_s: float = STALL_S,
               should_stop: Callable[[], bool] | None = None):
    self.writer, self.name, self.path = writer, writer.name, writer.path
    self.stall_s = float(stall_s)
    self.should_stop = should_stop or (lambda: False)
    self._queue: queue.Queue = queue.Queue(queue_size or QUEUE_ROWS)
    self._error: WriteError | None = None
    self._step: int | None = None   # the last step handed over (names a failed flush / close)
    self._closed = False
    self._thread = threading.Thread(target=self._work, name=f"attn_jax {self.name} writer",
                                    daemon=True)
    self._thread.start()

  def _work(self) -> None:
    while True:
      method, args, step = self._queue.get()
      if method == "_synced":   # `sync`: every call before it has been made
        args[0].set()
        continue
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
          raise self._stalled()

  def _stalled(self) -> WriteError:
    return _error(errno.ETIMEDOUT, f"writing {self.name} ({self.path}) stalled at step "
                  f"{self._step}: it took no row for {self.stall_s:.0f} s "
                  f"({describe_disk(self.path)}; a hung network share?)")

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    self._put("write", step, dict(row), step=step)

  def call(self, method: str, *args) -> None:
    """Any other method of the writer (e.g. TensorBoardWriter.purge), in the worker."""
    self._put(method, *args)

  def flush(self) -> None:
    self._put("flush")

  def sync(self) -> None:
    """Waits until the writer has made every call handed to it so far (bounded like a put);
    raises its failure. The trainer syncs before each checkpoint, so no checkpoint is newer
    than the rows a writer has taken."""
    done = threading.Event()
    if not self._put("_synced", done):
      return
    deadline = time.monotonic() + self.stall_s
    while not done.wait(_SLICE_S):
      self.check()
      if self.should_stop():
        return
      if time.monotonic() > deadline:
        raise self._stalled()
    self.check()

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
