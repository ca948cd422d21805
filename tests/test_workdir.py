"""One run per workdir: the second stops at once naming the holder; stale locks are taken over;
a run refused for its config or its data writes nothing (no workdir skeleton left behind)."""

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from attn_jax.train import trainer as trainer_lib
from attn_jax.train import workdir as workdir_lib
from attn_jax.train.workdir import ObjectLock, WorkdirLock, WorkdirLockedError, lock_workdir
from tests.test_train import tiny_config

HOLDER = """
import sys, time
from attn_jax.train.workdir import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def _start_holder(workdir):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  p = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE,
                       text=True, env=env)
  assert p.stdout.readline().strip() == "locked"
  return p


def test_second_run_stops_with_the_holders_pid_and_stale_lock_is_taken_over(tmp_path, caplog):
  holder = _start_holder(tmp_path)
  try:
    t0 = time.perf_counter()
    with pytest.raises(WorkdirLockedError, match=rf"in use by pid {holder.pid} "):
      WorkdirLock(str(tmp_path)).acquire()
    assert time.perf_counter() - t0 < 1.0  # at once, no waiting
  finally:
    holder.kill()   # dies without releasing: SIGKILL
    holder.wait()
  with caplog.at_level(logging.WARNING):
    lock = WorkdirLock(str(tmp_path)).acquire()
  assert any(f"stale lock of pid {holder.pid}" in r.getMessage() for r in caplog.records)
  lock.release()


def test_release_then_reacquire_is_clean(tmp_path, caplog):
  with WorkdirLock(str(tmp_path)):
    with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
      WorkdirLock(str(tmp_path)).acquire()
  with caplog.at_level(logging.WARNING):
    with WorkdirLock(str(tmp_path)):
      pass
  assert not any("stale" in r.getMessage() for r in caplog.records)
  assert lock_workdir(str(tmp_path), process_index=1) is None   # only process 0 locks


# ------------------------------------------------------------------ the lease lock
# ObjectLock on a local folder (epath writes the same JSON object a bucket would hold): the
# rules for a holder this process cannot check, without an emulator.

def _holder(**kw) -> dict:
  return dict({"pid": os.getpid(), "host": socket.gethostname(), "started": "before",
               "renewed": time.time(), "token": "previous", "space": "other-boot/pid:[1]"}, **kw)


def _renewing(path, holder, stop):
  """A live holder elsewhere: rewrites its lease every 50 ms until `stop`."""
  while not stop.wait(0.05):
    path.write_text(json.dumps(dict(holder, renewed=time.time())))


def _refused_while_renewing(lock_file, holder, lease_s: float, match: str) -> None:
  """`holder` written to `lock_file` and renewed by a live thread: a newcomer's acquire is
  refused with an error matching `match`."""
  lock_file.write_text(json.dumps(holder))
  stop = threading.Event()
  t = threading.Thread(target=_renewing, args=(lock_file, holder, stop), daemon=True)
  t.start()
  try:
    with pytest.raises(WorkdirLockedError, match=match):
      ObjectLock(str(lock_file.parent), lease_s=lease_s, settle_s=0).acquire()
  finally:
    stop.set()
    t.join()


def test_a_restarted_container_takes_its_own_lock(tmp_path, caplog):
  """A container restarted in its pod comes back with the same host name and pid (1) in a new
  pid namespace: its previous incarnation's lock is taken after one renewal period without a
  renewal, well before the lease lapses; it used to be refused (exit 2) until then."""
  lock_file = tmp_path / ".lock"
  lock_file.write_text(json.dumps(_holder()))
  t0 = time.monotonic()
  with caplog.at_level(logging.WARNING):
    lock = ObjectLock(str(tmp_path), lease_s=3.2, settle_s=0).acquire()
  waited = time.monotonic() - t0
  assert 0.5 < waited < 3.2 * 0.6, waited          # RESTART_WATCH = 1 s of this 3.2 s lease
  assert "cannot check: waiting up to" in caplog.text and "taking over the stale" in caplog.text
  assert json.loads(lock_file.read_text())["token"] != "previous"
  lock.release()
  assert lock_file.read_text() == ""


def test_a_live_holder_with_the_same_host_and_pid_is_still_refused(tmp_path):
  """Another live process that happens to have this host name and pid (another container with
  host networking) renews its lease while the newcomer watches: refused."""
  lock_file = tmp_path / ".lock"
  _refused_while_renewing(lock_file, _holder(token="theirs"), 3.2,
                          "renewed its lease while this run waited")
  assert json.loads(lock_file.read_text())["token"] == "theirs"


def test_a_rerun_on_another_host_waits_for_the_lease_instead_of_being_refused(tmp_path, caplog):
  """A TPU worker rerun (or a preempted VM's replacement) before the old lease lapsed: waited
  for, then taken; a live holder on another host renewing meanwhile is refused."""
  lock_file = tmp_path / ".lock"
  lock_file.write_text(json.dumps(_holder(host="tpu-worker-old", pid=4321, space="x")))
  t0 = time.monotonic()
  with caplog.at_level(logging.WARNING):
    lock = ObjectLock(str(tmp_path), lease_s=1.0, settle_s=0).acquire()
  assert 0.7 < time.monotonic() - t0 < 3.0
  assert "taking over the stale lock of pid 4321 on host tpu-worker-old" in caplog.text
  lock.release()
  _refused_while_renewing(lock_file, _holder(host="tpu-worker-live", pid=4321, token="theirs"),
                          1.0, "tpu-worker-live")


def test_a_holder_this_process_can_check_is_judged_at_once(tmp_path):
  """Same host, same pid namespace: the pid decides, without waiting (a second lock in this
  process is refused; a dead pid's lock is taken)."""
  first = ObjectLock(str(tmp_path), settle_s=0).acquire()
  t0 = time.monotonic()
  with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
    ObjectLock(str(tmp_path), settle_s=0).acquire()
  first.release()
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  (tmp_path / ".lock").write_text(json.dumps(_holder(pid=int(dead),
                                                     space=workdir_lib.process_space())))
  ObjectLock(str(tmp_path), settle_s=0).acquire().release()
  assert time.monotonic() - t0 < 1.0


def test_a_file_system_without_flock_gets_the_lease_lock(tmp_path, monkeypatch, caplog):
  """Lustre without `-o flock` (ENOSYS), NFS without lockd (ENOLCK): the lock is the lease
  object on the same .lock file, with one warning saying why; a second run is refused and a
  release empties it. Other errors are not swallowed."""
  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(workdir_lib.fcntl, "flock", no_flock)
  with caplog.at_level(logging.WARNING):
    lock = WorkdirLock(str(tmp_path)).acquire()
  assert "has no flock (ENOLCK" in caplog.text and "-o flock" in caplog.text
  assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
  with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
    WorkdirLock(str(tmp_path)).acquire()
  lock.release()
  assert (tmp_path / ".lock").read_text() == ""

  def broken(fd, op):
    raise OSError(errno.EIO, "I/O error")

  monkeypatch.setattr(workdir_lib.fcntl, "flock", broken)
  with pytest.raises(OSError, match="I/O error"):
    WorkdirLock(str(tmp_path)).acquire()


def _bad_field(c, tmp_path):
  c.train.log_every = 0
  return r"config.train.log_every"


def _missing_data_file(c, tmp_path):
  c.data.update(source="text", paths=str(tmp_path / "nowhere.txt"), tokenizer="bytes")
  c.model.vocab_size = 512   # holds the byte tokenizer's ids: only the file is wrong
  return r"data file not found: .*nowhere.txt"


@pytest.mark.parametrize("mistake", [_bad_field, _missing_data_file])
def test_a_refused_run_writes_nothing(tmp_path, mistake):
  """Every check runs before the workdir is set up: a refused run used to leave .lock,
  checkpoints/ and tb/ behind (an empty run folder that looks like a run)."""
  c = tiny_config()
  match = mistake(c, tmp_path)
  with pytest.raises((ValueError, OSError), match=match):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
