"""Checkpoint reliability: no NaN saves, corrupt/partial checkpoints skipped with fallback,
SIGTERM/SIGINT stop at a step boundary with a checkpoint (tests/test_faults.py: SIGHUP, changed
configs, full disks, crashes right after a save)."""

import logging
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train.checkpoint import Checkpointer, PreemptionGuard
from tests.signal_setup import deliver, handled


def make_state(step, value=None):
  w = jnp.arange(4096, dtype=jnp.float32) * 1e-3 + step if value is None else jnp.full(
      (4096,), value, jnp.float32)
  return {"params": {"w": w, "b": jnp.ones((3,), jnp.float32) * step},
          "step": jnp.asarray(step, jnp.int32)}


def abstract():
  return jax.eval_shape(lambda: make_state(0))


def save_steps(workdir, steps):
  c = Checkpointer(str(workdir), max_to_keep=5)
  for s in steps:
    c.save(s, make_state(s), meta={"step": s}, force=True)
  c.close()


def test_all_finite():
  assert ckpt_lib.all_finite(make_state(1))
  assert not ckpt_lib.all_finite(make_state(1, value=np.nan))
  assert not ckpt_lib.all_finite({"a": jnp.array([1.0, np.inf]), "n": jnp.arange(3)})
  assert ckpt_lib.all_finite({"n": jnp.arange(3)})  # integer leaves are always finite
  assert ckpt_lib.nonfinite_paths({"a": jnp.ones(2), "b": jnp.array([np.nan])}) == ["['b']"]


def test_nan_state_is_never_saved_and_names_the_last_finite_step(tmp_path):
  c = Checkpointer(str(tmp_path))
  c.save(2, make_state(2), force=True)
  c.wait()
  with pytest.raises(FloatingPointError, match=r"refusing to save step 5.*'w'.*step 2"):
    c.save(5, make_state(5, value=np.nan), force=True)
  c.close()
  assert Checkpointer(str(tmp_path)).all_steps() == [2]


def test_round_trip_writes_a_manifest(tmp_path):
  save_steps(tmp_path, [1, 2])
  c = Checkpointer(str(tmp_path))
  for s in (1, 2):
    assert os.path.isfile(os.path.join(c.step_dir(s), ckpt_lib.MANIFEST))
    assert c.verify(s) is None
  state = c.restore(abstract())
  assert c.restored_step == 2
  np.testing.assert_array_equal(state["params"]["w"], make_state(2)["params"]["w"])


def _largest_array_file(step_dir):
  files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, "state"))
           for n in ns if "ocdbt.process" in r]
  return max(files, key=os.path.getsize)


def _truncate(step_dir):
  path = _largest_array_file(step_dir)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _delete_metadata(step_dir):
  os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _flip_bytes(step_dir):
  path = _largest_array_file(step_dir)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(4)
    f.seek(-4, os.SEEK_CUR)
    f.write(bytes(x ^ 0xFF for x in b))


@pytest.mark.parametrize("corrupt", [_truncate, _delete_metadata, _flip_bytes])
def test_corrupt_latest_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, caplog,
                                                                        corrupt):
  save_steps(tmp_path, [1, 2, 3])
  corrupt(os.path.join(tmp_path, "checkpoints", "3"))
  c = Checkpointer(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    state = c.restore(abstract())
  assert c.restored_step == 2
  np.testing.assert_array_equal(state["params"]["w"], make_state(2)["params"]["w"])
  assert any("step 3" in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)
  # The bad step is set aside, so the resumed run can save step 3 again.
  assert c.all_steps() == [1, 2]
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "3.corrupt"))
  c.save(3, make_state(3), force=True)
  c.close()
  assert Checkpointer(str(tmp_path)).restore(abstract())["step"] == 3


def test_explicit_step_that_is_corrupt_raises(tmp_path):
  save_steps(tmp_path, [1])
  _flip_bytes(os.path.join(tmp_path, "checkpoints", "1"))
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match="sha256"):
    Checkpointer(str(tmp_path)).restore(abstract(), step=1)


def test_all_corrupt_is_an_error_not_a_silent_fresh_start(tmp_path):
  save_steps(tmp_path, [1])
  _truncate(os.path.join(tmp_path, "checkpoints", "1"))
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match="no usable checkpoint"):
    Checkpointer(str(tmp_path)).restore(abstract())


def test_partial_save_is_never_picked_up(tmp_path):
  save_steps(tmp_path, [1])
  # What an interrupted asynchronous save leaves: orbax's temporary folder, never renamed.
  root = os.path.join(tmp_path, "checkpoints")
  os.rename(os.path.join(root, "1"), os.path.join(root, "2.orbax-checkpoint-tmp-123"))
  save_steps(tmp_path, [1])
  c = Checkpointer(str(tmp_path))
  assert c.all_steps() == [1]
  assert not os.path.exists(os.path.join(root, "2.orbax-checkpoint-tmp-123"))  # cleaned up
  assert int(c.restore(abstract())["step"]) == 1


def test_steps_named_are_the_committed_ones_on_disk(tmp_path, monkeypatch):
  """While step 6's save is in progress (a temporary folder) and after it failed (a full disk),
  the steps a Checkpointer names are the ones a rerun can resume from: orbax's own list held
  the save in progress (a "latest step" that never was) and had dropped step 2, to be pruned
  once 6 committed, while 2 stayed on disk ("Older steps are kept: [4]")."""
  import errno
  import time
  real = ckpt_lib.write_manifest

  def full_disk_from_step_6(step_dir):
    if int(os.path.basename(step_dir).split(".")[0]) >= 6:
      time.sleep(0.5)   # the save is under way a while before it fails
      raise OSError(errno.ENOSPC, "No space left on device", step_dir)
    return real(step_dir)

  monkeypatch.setattr(ckpt_lib, "write_manifest", full_disk_from_step_6)
  c = Checkpointer(str(tmp_path), max_to_keep=2)
  for s in (2, 4):
    c.save(s, make_state(s), force=True)
    c.wait()
  c.save(6, make_state(6), force=True)
  assert c.latest_step() == 4 and c.all_steps() == [2, 4]   # 6: a temporary folder only
  with pytest.raises(ckpt_lib.CheckpointSaveError,
                     match=r"saving checkpoint step 6 .*Older steps are kept: \[2, 4\]$"):
    c.wait()
  assert c.all_steps() == [2, 4] and c.latest_step() == 4
  c.close()


def test_checkpoint_without_manifest_is_refused_or_restored_with_a_warning(tmp_path, caplog):
  save_steps(tmp_path, [1])
  os.remove(os.path.join(tmp_path, "checkpoints", "1", ckpt_lib.MANIFEST))
  with pytest.raises(ckpt_lib.CheckpointUnverifiedError, match="allow_unverified"):
    Checkpointer(str(tmp_path)).restore(abstract())
  with caplog.at_level(logging.WARNING):
    state = Checkpointer(str(tmp_path), allow_unverified=True).restore(abstract())
  assert int(state["step"]) == 1
  said = [r.getMessage() for r in caplog.records if "no checksum manifest" in r.getMessage()]
  assert len(said) == 1 and "UNVERIFIED" in said[0] and "older version" not in said[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, sig):
  c = Checkpointer(str(tmp_path))
  state = make_state(0)
  with handled(sig):   # as in a terminal, whatever the process running pytest inherited
    before = {s: signal.getsignal(s) for s in PreemptionGuard.SIGNALS}
    with PreemptionGuard() as guard:
      for step in range(1, 100):
        state = make_state(step)            # the "train step"
        if step == 4:                       # arrives mid-step; the process keeps running
          deliver(sig, until=lambda: guard.should_stop)
        if guard.poll(step):
          c.save(step, state, force=True)
          break
    c.close()
    assert guard.signal_name == signal.Signals(sig).name
    assert step == 4 and Checkpointer(str(tmp_path)).latest_step() == 4
    # Handlers are restored afterwards (SIG_IGN kept from a background job: test_faults).
    assert {s: signal.getsignal(s) for s in PreemptionGuard.SIGNALS} == before


def test_second_sigint_interrupts_at_once():
  with handled(signal.SIGINT), PreemptionGuard() as guard:
    deliver(signal.SIGINT, until=lambda: guard.should_stop)
    with pytest.raises(KeyboardInterrupt):
      deliver(signal.SIGINT)


# ------------------------------------------------------------------ metrics on resume


def test_metric_rows_after_the_restored_step_are_dropped_at_resume(tmp_path):
  from attn_jax.train.metrics import MetricWriter, read_metrics
  w = MetricWriter(str(tmp_path), enabled=True)
  for s in range(1, 7):
    w.write(s, {"loss": 1.0 / s})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "lo')               # a crash in the middle of a write
  # The run is resumed from the checkpoint of step 4: steps 5, 6 (and the torn row) will be
  # logged again.
  w = MetricWriter(str(tmp_path), enabled=True)
  assert w.truncate_after(4) == 3
  for s in range(5, 7):
    w.write(s, {"loss": 1.0 / s})
  w.close()
  steps = [r["step"] for r in read_metrics(str(tmp_path))]
  assert steps == [1, 2, 3, 4, 5, 6]
