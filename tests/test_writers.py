"""The metrics writers (attn_jax/train/writers.py, metrics.MetricWriter) under a disk that fills
up or a writer that stops taking rows: never a blocked caller, always a WriteError naming the
writer, the file, the disk and the step; a signal ends a wait at once; a new writer plugs into
the same failure path; the TensorBoard events read back as written.

The disk is simulated: `fill_after` makes the files of one writer raise OSError(ENOSPC) once
they hold `room` bytes (every byte goes through the file object's `write`, so the failure comes
at a write, as a real disk's would; tests/test_disk_full.py has the trainer and a real tmpfs).
Each test runs under `watchdog`: on the code before writers.py the TensorBoard case blocked
forever in tensorboardX's Queue.put, and the watchdog turns that into a failure."""

import builtins
import contextlib
import errno
import math
import os
import signal
import struct
import threading
import time

import pytest

from attn_jax.train import writers as writers_lib
from attn_jax.train.metrics import MetricWriter, read_metrics
from attn_jax.train.writers import Background, WriteError

ROW = {f"metric_{i}": float(i) for i in range(14)}   # ~ a trainer row: 15 scalars


class _FilledFile:
  """A file object on a disk that holds `disk.room` more bytes: the write that does not fit
  raises ENOSPC (after writing what fits, as a short write of a real disk would leave)."""

  def __init__(self, f, disk):
    self._f, self._disk = f, disk

  def write(self, data):
    if self._disk.blocked is not None:
      self._disk.blocked.wait()
    if len(data) > self._disk.room:
      time.sleep(self._disk.slow_failure)   # meanwhile the caller goes on putting rows
      raise OSError(errno.ENOSPC, "No space left on device")
    self._disk.room -= len(data)
    return self._f.write(data)

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


class _Disk:
  def __init__(self, room, blocked=None, slow_failure=0.0):
    self.room, self.blocked, self.slow_failure = room, blocked, slow_failure


def fill_after(monkeypatch, match, room, blocked=None, slow_failure=0.0):
  """Files whose path contains `match` (opened for writing) get a disk with `room` bytes left;
  `blocked` (a threading.Event): their writes wait for it (a hung disk); the write that fails
  takes `slow_failure` seconds to return. Returns the disk."""
  disk, real = _Disk(room, blocked, slow_failure), builtins.open

  def fake_open(file, mode="r", *args, **kwargs):
    f = real(file, mode, *args, **kwargs)
    if match in os.fspath(file) and any(c in mode for c in "wax"):
      return _FilledFile(f, disk)
    return f

  monkeypatch.setattr(builtins, "open", fake_open)
  return disk


class Blocked(Exception):
  """Not an OSError: `pytest.raises(WriteError)` must not take it for the writer's error."""


@contextlib.contextmanager
def watchdog(seconds):
  """Fails the test (Blocked in the main thread) if its body runs longer than `seconds`: a
  blocked Queue.put / lock acquire is interrupted by the signal."""
  def expired(signum, frame):
    raise Blocked(f"blocked for more than {seconds} s")

  previous = signal.signal(signal.SIGALRM, expired)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def write_rows(w, n, start=1):
  for step in range(start, start + n):
    w.write(step, ROW)


# ------------------------------------------------------------------ a disk that fills


def test_a_full_disk_under_tensorboard_is_an_error_not_a_hang(tmp_path, monkeypatch):
  # A few rows of events, then full; the failing write returns late, so the writer thread
  # dies with the caller's next rows already waiting (on a 3 MB tmpfs the old run
  # then hung in Queue.put, 2 of 2 tries).
  fill_after(monkeypatch, "tfevents", room=3000, slow_failure=0.5)
  w = MetricWriter(str(tmp_path), enabled=True)
  with watchdog(30), pytest.raises(WriteError) as e:
    write_rows(w, 400)
    w.close()
  msg = str(e.value)
  assert e.value.errno == errno.ENOSPC
  assert f"writing TensorBoard ({tmp_path / 'tb'}) failed at step " in msg, msg
  assert "the disk mounted at /" in msg and "is full" in msg and "free of" in msg, msg
  failed_at = int(msg.split("failed at step ")[1].split(":")[0])
  assert 2 <= failed_at <= 6, msg               # the row whose events did not fit
  steps = [r["step"] for r in read_metrics(str(tmp_path))]
  assert steps[0] == 1 and steps[-1] <= failed_at + 70   # stopped within a queue's length


def test_a_full_disk_under_metrics_jsonl_names_the_step_lost(tmp_path, monkeypatch):
  fill_after(monkeypatch, "metrics.jsonl", room=2000)
  w = MetricWriter(str(tmp_path), enabled=True, tensorboard=False)
  with watchdog(30), pytest.raises(WriteError) as e:
    write_rows(w, 100)
  msg = str(e.value)
  rows = read_metrics(str(tmp_path))
  assert f"writing metrics.jsonl ({tmp_path / 'metrics.jsonl'}) failed at step " \
         f"{len(rows) + 1}: the disk mounted at /" in msg, msg
  assert "is full" in msg and e.value.errno == errno.ENOSPC


def test_a_writer_that_takes_no_row_is_an_error_after_stall_s(tmp_path, monkeypatch):
  hung = threading.Event()
  fill_after(monkeypatch, "tfevents", room=10**9, blocked=hung)
  w = MetricWriter(str(tmp_path), enabled=True, stall_s=0.5)
  t0 = time.monotonic()
  with watchdog(30), pytest.raises(WriteError, match=(
      r"writing TensorBoard \(.*tb\) stalled at step \d+: it took no row for 0 s \(the disk "
      r"mounted at /")) as e:
    write_rows(w, 1000)
  assert e.value.errno == errno.ETIMEDOUT
  assert time.monotonic() - t0 < 10
  hung.set()


def test_a_stop_request_ends_the_wait_for_a_stalled_writer_at_once(tmp_path, monkeypatch,
                                                                   caplog):
  hung = threading.Event()
  fill_after(monkeypatch, "tfevents", room=10**9, blocked=hung)
  w = MetricWriter(str(tmp_path), enabled=True, stall_s=3600)
  stop = []
  w.stop_when(lambda: bool(stop))
  with watchdog(30):
    write_rows(w, 60)              # the writer is stuck at its first row, the queue filling
    stop.append(True)              # SIGTERM arrives
    t0 = time.monotonic()
    write_rows(w, 10, start=61)    # those that do not fit are dropped, not waited for
    w.close()                      # not waited for either
  assert time.monotonic() - t0 < 2
  assert any("is not taking rows: dropped write of step 66" in r.getMessage()
             for r in caplog.records)
  assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(1, 71))
  hung.set()


class _Failing:
  """A writer of its own (the shape a W&B writer takes): its third row fails."""
  name, path = "uploader", "/"

  def __init__(self):
    self.rows = []

  def write(self, step, row):
    if len(self.rows) == 2:
      raise ConnectionError("the service went away")
    self.rows.append((step, row))

  def flush(self):
    pass

  def close(self):
    pass


def test_any_writer_fails_through_the_same_path(tmp_path):
  w = MetricWriter(str(tmp_path), enabled=True, tensorboard=False)
  mine = w.add(Background(_Failing()))
  with watchdog(30), pytest.raises(WriteError, match=(
      r"writing uploader \(/\) failed at step 3: ConnectionError: the service went away")):
    for step in range(1, 50):
      w.write(step, {"loss": 1.0})
      time.sleep(0.01)
      w.check()
  assert [s for s, _ in mine.writer.rows] == [1, 2]
  with pytest.raises(WriteError):   # closing reports it too (the trainer drops the repeat)
    w.close()


# ------------------------------------------------------------------ what TensorBoard reads


def read_events(folder):
  """(step, tag, value) of every scalar, and the steps of SessionLog START events, of the event
  files in `folder` (the TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2
  scalars, starts = [], []
  for name in sorted(os.listdir(folder)):
    if "tfevents" not in name:
      continue
    with open(os.path.join(folder, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("Q", data[pos: pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12: pos + 12 + length])
      pos += 12 + length + 4
      if event.HasField("session_log") and event.session_log.status == 1:
        starts.append(event.step)
      for v in event.summary.value:
        scalars.append((event.step, v.tag, v.simple_value))
  return scalars, starts


def test_tensorboard_events_hold_every_scalar_and_the_purge(tmp_path):
  w = MetricWriter(str(tmp_path), enabled=True)
  write_rows(w, 3)
  w.write(4, {"loss": float("nan"), "note": "text"})
  w.close()
  w = MetricWriter(str(tmp_path), enabled=True)   # resumed from step 2
  assert w.truncate_after(2) == 2
  w.write(3, {"loss": 0.5})
  w.close()
  scalars, starts = read_events(tmp_path / "tb")
  first = [(s, t, v) for s, t, v in scalars if s <= 3 and t != "loss"]
  assert first == [(s, k, v) for s in (1, 2, 3) for k, v in ROW.items()]
  nan = [v for s, t, v in scalars if (s, t) == (4, "loss")]
  assert len(nan) == 1 and math.isnan(nan[0])       # strings are not scalars: not written
  assert starts == [3] and scalars[-1] == (3, "loss", 0.5)
  assert read_metrics(str(tmp_path))[-1] == {"step": 3, "loss": 0.5}
  assert read_metrics(str(tmp_path))[-2]["step"] == 2


def test_describe_disk_names_the_mount_point_and_free_space(tmp_path):
  text = writers_lib.describe_disk(str(tmp_path / "not" / "yet" / "made"))
  mount = text.removeprefix("the disk mounted at ").split(" (")[0]
  assert os.path.ismount(mount) and str(tmp_path.resolve()).startswith(mount), text
  assert " free of " in text and text.endswith("B)"), text
