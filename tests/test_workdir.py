"""One run per workdir: the second stops at once naming the holder; stale locks are taken over;
a run refused for its config or its data writes nothing (no workdir skeleton left behind)."""

import logging
import os
import subprocess
import sys
import time

import pytest

from attn_jax.train import trainer as trainer_lib
from attn_jax.train.workdir import WorkdirLock, WorkdirLockedError, lock_workdir
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
