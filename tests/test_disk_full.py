"""A training run whose disk fills (or hangs) at each place it writes bytes: TensorBoard's event
file, metrics.jsonl, a checkpoint. Every case ends the same way, within a bounded time: a
WriteError naming the writer, the file, the disk and the step; no save after it; the newest
checkpoint whole and kept as the resume point. A SIGTERM that arrives while a writer hangs is
acted on at that step.

The default cases simulate the disk (tests/test_writers.fill_after: the files of one place
raise ENOSPC once they hold a number of bytes; a checkpoint's bytes are checked through its
manifest, the one file of a step that Python writes). The slow ones mount real tmpfs disks
(root only; skipped elsewhere) and run the command that once hung (a 3 MB disk under the
quickstart, which hung at step 8 on the old code)."""

import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train import trainer as trainer_lib
from attn_jax.train import writers as writers_lib
from attn_jax.train.checkpoint import Checkpointer, CheckpointSaveError
from attn_jax.train.metrics import read_metrics
from attn_jax.train.writers import WriteError
from tests.test_faults import run_config, tmpfs
from tests.test_writers import fill_after, watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# place -> (the files it writes, bytes that fit before the disk is full)
PLACES = {
    "TensorBoard": ("tfevents", 2000),              # ~550 bytes of events a row: step 4
    "metrics.jsonl": ("metrics.jsonl", 1700),        # ~470 bytes a row: step 4
    "checkpoint": ("attn_jax_sha256.json", 4000),   # ~2.6 KB a manifest: step 4's save
}


def _run_until_it_stops(c, workdir):
  t0 = time.monotonic()
  with watchdog(240), pytest.raises(WriteError) as e:
    trainer_lib.train_and_evaluate(c, str(workdir))
  return e.value, time.monotonic() - t0


def _check_resume_point(workdir):
  """The kept steps: periodic ones only (no save on the way out), each one whole."""
  ckpt = Checkpointer(str(workdir))
  kept = ckpt.all_steps()
  assert kept and all(s % 2 == 0 for s in kept), kept
  for s in kept:
    assert ckpt.verify(s) is None and ckpt.has_manifest(s)
  ckpt.close()
  return kept


@pytest.mark.parametrize("place", list(PLACES))
def test_a_disk_that_fills_stops_the_run_in_one_named_error(place, tmp_path, monkeypatch):
  match, room = PLACES[place]
  disk = fill_after(monkeypatch, match, room=room)
  c = run_config(steps=10)
  e, seconds = _run_until_it_stops(c, tmp_path / "run")
  msg = str(e)
  assert e.errno == errno.ENOSPC or isinstance(e, CheckpointSaveError), msg
  assert "the disk mounted at /" in msg and "no space left" in msg.lower(), msg
  kept = _check_resume_point(tmp_path / "run")
  rows = [r["step"] for r in read_metrics(str(tmp_path / "run"))]
  if place == "checkpoint":
    assert isinstance(e, CheckpointSaveError)
    assert msg.startswith("saving checkpoint step 4 ") and "the disk is full" in msg, msg
    assert f"Older steps are kept: {kept}" in msg and kept == [2], msg
    assert max(rows) <= 6                             # stopped at the next step boundary
  else:
    failed = int(re.search(r"failed at step (\d+)", msg).group(1))
    assert msg.startswith(f"writing {place} ({tmp_path / 'run'}"), msg
    assert (f"the latest checkpoint, step {max(kept)} in {tmp_path / 'run' / 'checkpoints'}, "
            "is kept: rerun the same command to resume from it") in msg, msg
    assert 2 <= failed <= 6 and max(kept) <= failed + 2, (failed, kept)   # stopped there
    assert max(rows) <= failed + 2
  assert disk.room >= 0 and seconds < 200
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "10")


def test_a_failed_write_during_a_save_names_the_last_committed_step(tmp_path, monkeypatch):
  """metrics.jsonl fails (a full disk) while step 4's save is still being written, and that save
  fails too: the message names step 2, the step a rerun resumes from, not step 4 (orbax counts
  a save in progress; on a 3 MB disk "step 6 is kept" while only 6.orbax-checkpoint-tmp
  existed)."""
  real_manifest, real_write = ckpt_lib.write_manifest, writers_lib.JsonlWriter.write

  def slow_full_disk(step_dir):   # step 4's commit: still under way at step 6, then ENOSPC
    if int(os.path.basename(step_dir).split(".")[0]) >= 4:
      time.sleep(2)
      raise OSError(errno.ENOSPC, "No space left on device", step_dir)
    return real_manifest(step_dir)

  def rows_until_5(self, step, row):
    if step >= 5:
      raise writers_lib.write_error(self.name, self.path, step,
                                    OSError(errno.ENOSPC, "No space left on device"))
    return real_write(self, step, row)

  monkeypatch.setattr(ckpt_lib, "write_manifest", slow_full_disk)
  monkeypatch.setattr(writers_lib.JsonlWriter, "write", rows_until_5)
  e, _ = _run_until_it_stops(run_config(steps=10), tmp_path / "run")
  msg = str(e)
  assert msg.startswith(f"writing metrics.jsonl ({tmp_path / 'run' / 'metrics.jsonl'}) failed "
                        "at step 5"), msg
  assert (f"the latest checkpoint, step 2 in {tmp_path / 'run' / 'checkpoints'}, is kept: "
          "rerun the same command to resume from it (step 4, which was being saved, is not: "
          "its save failed too)") in msg, msg
  assert Checkpointer(str(tmp_path / "run")).all_steps() == [2]   # what the rerun resumes from


def test_sigterm_while_tensorboard_hangs_stops_at_that_step(tmp_path, monkeypatch, caplog):
  """The TensorBoard disk hangs at its first write (a dead network share); the loop fills the
  writer's queue and waits on it when SIGTERM comes: the run stops at that step with its
  checkpoint, as it would with no writer at all."""
  hung = threading.Event()
  fill_after(monkeypatch, "tfevents", room=10**9, blocked=hung)
  monkeypatch.setattr(writers_lib, "QUEUE_ROWS", 1)
  real_put = writers_lib.Background._put

  def put(self, method, *args, step=None):   # the first wait on a full queue: SIGTERM in 1 s
    if self._queue.full() and not hasattr(put, "armed"):
      put.armed = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
      put.armed.start()
    return real_put(self, method, *args, step=step)

  monkeypatch.setattr(writers_lib.Background, "_put", put)
  t0 = time.monotonic()
  try:
    with watchdog(240):
      out = trainer_lib.train_and_evaluate(run_config(steps=10), str(tmp_path / "run"))
  finally:
    hung.set()
  assert out["preempted"] == "SIGTERM" and out["step"] < 10, out
  assert time.monotonic() - t0 < 200
  assert Checkpointer(str(tmp_path / "run")).all_steps()[-1] == out["step"]   # saved there
  assert any("is not taking rows" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ real disks (root: tmpfs)


def _fill(folder, leave_kib):
  """Fills the tmpfs holding `folder` until `leave_kib` KiB are free."""
  st = os.statvfs(folder)
  free = st.f_bavail * st.f_frsize
  with open(os.path.join(folder, "ballast"), "wb") as f:
    f.write(b"\0" * max(0, free - leave_kib * 1024))


def _fill_once_saved(checkpoints, step, leave_kib):
  """A thread that fills the checkpoints/ disk once `step` is saved whole (its manifest is
  written): the next save runs out of room, whatever a save needs while it is written."""
  manifest = checkpoints / str(step) / ckpt_lib.MANIFEST

  def watch():
    deadline = time.monotonic() + 200
    while not manifest.exists() and time.monotonic() < deadline:
      time.sleep(0.005)
    _fill(checkpoints, leave_kib)

  t = threading.Thread(target=watch, daemon=True)
  t.start()
  return t


@pytest.fixture
def disks(tmp_path):
  """Mounts tmpfs disks on demand: `disks(folder, size)`; all unmounted at the end."""
  mounted = []

  def mount(folder, size):
    os.makedirs(folder, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode:
      pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the simulated disks of "
                  "test_a_disk_that_fills_stops_the_run_in_one_named_error cover it")
    mounted.append(folder)
    return folder

  yield mount
  for folder in reversed(mounted):
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow   # three training runs on real disks, ~20 s each
@pytest.mark.parametrize("place", ["TensorBoard", "metrics.jsonl", "checkpoint"])
def test_a_real_disk_that_fills_stops_the_run(place, tmp_path, disks):
  """The run folder, its tb/ and its checkpoints/ are three tmpfs disks; the place's one fills
  during the run, the others have room: tb/ of 12 KiB (its lock takes a page, the events ~550
  bytes a row), the run folder filled to 12 KiB free (metrics.jsonl beside the lock), a
  checkpoints/ filled to 64 KiB free once step 2 is saved (a step keeps ~0.4 MB, but what a save
  needs while it is written varies: a fixed small disk sometimes failed the first save and
  sometimes never filled)."""
  run = tmp_path / "run"
  disks(run, "16m")
  disks(run / "checkpoints", "16m")
  disks(run / "tb", "12k" if place == "TensorBoard" else "16m")
  if place == "metrics.jsonl":
    _fill(run, leave_kib=12)
  if place == "checkpoint":
    _fill_once_saved(run / "checkpoints", 2, leave_kib=64)
  e, seconds = _run_until_it_stops(run_config(steps=40), run)
  msg = str(e)
  mount = run / {"TensorBoard": "tb", "metrics.jsonl": "", "checkpoint": "checkpoints"}[place]
  assert f"the disk mounted at {str(mount).rstrip('/')} (" in msg, msg
  assert "no space left" in msg, msg
  if place == "checkpoint":
    assert isinstance(e, CheckpointSaveError) and msg.startswith("saving checkpoint step "), msg
  else:
    assert msg.startswith(f"writing {place} ") and "the latest checkpoint, step" in msg, msg
    assert int(re.search(r"failed at step (\d+)", msg).group(1)) >= 4, msg
  _check_resume_point(run)
  assert seconds < 200


@pytest.mark.slow   # the quickstart as a subprocess (~1 min)
def test_issue_43_quickstart_on_a_3mb_disk_ends_in_one_line(tmp_path):
  """The reported command: a 3 MB disk, checkpoints every 2 steps. The old code hung at step 8
  with TensorBoard's writer thread dead (2 of 2 tries); now one line and status 2."""
  disk = next(tmpfs(tmp_path, "3m"))
  try:
    r = subprocess.run([sys.executable, "experiments/train.py", "--config=configs/quickstart.py",
                        f"--workdir={disk / 'run'}", "--config.train.steps=14",
                        "--config.checkpoint.every_steps=2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=400, env=dict(os.environ, PYTHONPATH=ROOT))
    kept = Checkpointer(str(disk / "run")).all_steps()
    ok = [s for s in kept if Checkpointer(str(disk / "run")).verify(s) is None]
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
  lines = [x for x in r.stderr.splitlines() if x.strip() and not re.match(r"[IW]\d{4} ", x)]
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert lines[-1].startswith("error: ") and "the disk mounted at " in lines[-1], lines
  assert kept and ok == kept, (kept, ok)
