"""Trainer reliability: interrupted runs resume to the same losses as uninterrupted ones
(SIGKILL and SIGTERM of experiments/train.py, an interrupt in the middle of gradient
accumulation), a truncated latest checkpoint is skipped with a warning, a step that raises is
not masked by a save from its donated state, and a diverging run (lr=1e3) never applies or saves
a non-finite update: it halts naming the last finite step, or skips and counts."""

import logging
import math
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from attn_jax.train import fitting, loss_monitor, setup as setup_lib, trainer as trainer_lib
from attn_jax.train.checkpoint import Checkpointer, all_finite
from attn_jax.train.metrics import read_metrics
from attn_jax.train.step import make_train_step
from tests.signal_setup import deliver, handled, killed_run_config
from tests.test_train import losses, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _finite_checkpoints(c, workdir):
  """Every checkpoint of a run restores to finite values (the Checkpointer checks that too)."""
  setup = setup_lib.build_setup(c)
  ckpt = Checkpointer(str(workdir))
  steps = ckpt.all_steps()
  for s in steps:
    assert all_finite(ckpt.restore(setup.abstract_state, step=s)), s
  ckpt.close()
  return steps


# ------------------------------------------------------------------ in-process interruptions


def test_interrupt_in_the_middle_of_gradient_accumulation_resumes_identically(tmp_path,
                                                                               monkeypatch):
  c = tiny_config(steps=5)
  c.train.grad_accum = 2
  trainer_lib.train_and_evaluate(c, str(tmp_path / "full"))
  full = losses(tmp_path / "full")
  assert [s for s, _ in full] == list(range(1, 6))

  real_next = setup_lib.next_batch
  calls = {"n": 0}

  def interrupting(it, *a, **k):
    calls["n"] += 1
    if calls["n"] == 4:   # step 4: the first micro-batch is pulled, then Ctrl-C
      next(it)
      raise KeyboardInterrupt
    return real_next(it, *a, **k)

  monkeypatch.setattr(setup_lib, "next_batch", interrupting)
  with pytest.raises(KeyboardInterrupt):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "resumed"))
  monkeypatch.setattr(setup_lib, "next_batch", real_next)
  assert Checkpointer(str(tmp_path / "resumed")).latest_step() == 3
  trainer_lib.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert losses(tmp_path / "resumed") == full   # no micro-batch skipped


def test_ctrl_c_during_the_first_compile_stops_before_training_with_the_lock_released(
    tmp_path, monkeypatch, caplog):
  """The trainer takes the signals from its first line (before: only from its loop, so a
  Ctrl-C in a compile was a KeyboardInterrupt and a SIGTERM killed the process): a signal during
  the memory check's compile stops the run at the next phase, before any step, nothing saved."""
  real = setup_lib.compile_step
  calls = []

  def compile_step(*a, **k):
    calls.append(1)
    deliver(signal.SIGINT)   # Ctrl-C in the middle of the first compile
    return real(*a, **k)

  monkeypatch.setattr(fitting, "compile_step", compile_step)
  with handled(signal.SIGINT), caplog.at_level(logging.WARNING):
    out = trainer_lib.train_and_evaluate(tiny_config(steps=4), str(tmp_path))
  assert out["preempted"] == "SIGINT" and out["before_training"] and out["step"] == 0, out
  assert len(calls) == 1                                 # the run's own compile never started
  assert (tmp_path / ".lock").read_text() == ""          # released
  assert os.listdir(tmp_path / "checkpoints") == [] and not (tmp_path / "metrics.jsonl").exists()
  assert any("SIGINT: stopped before training started" in r.getMessage()
             for r in caplog.records)


def test_a_failing_step_is_reraised_and_nothing_is_saved_from_its_input(tmp_path, monkeypatch):
  c = tiny_config(steps=6)
  c.checkpoint.every_steps = 2
  real_next = setup_lib.next_batch
  calls = {"n": 0}

  def bad_batch(*a, **k):
    calls["n"] += 1
    batch = real_next(*a, **k)
    if calls["n"] == 3:   # the compiled step rejects it (as a device error would fail it)
      batch = dict(batch, inputs=batch["inputs"][:, :4])
    return batch

  monkeypatch.setattr(setup_lib, "next_batch", bad_batch)
  with pytest.raises((TypeError, ValueError)) as e:
    trainer_lib.train_and_evaluate(c, str(tmp_path))
  assert "deleted" not in str(e.value)   # the step's own error, not one from saving
  assert Checkpointer(str(tmp_path)).all_steps() == [2]   # no save from the step-3 input


def test_truncated_latest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
  c = tiny_config(steps=4)
  c.checkpoint.every_steps = 2
  trainer_lib.train_and_evaluate(c, str(tmp_path))
  full = losses(tmp_path)
  ckpt_dir = tmp_path / "checkpoints"
  assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == [2, 4]
  arrays = [os.path.join(r, n) for r, _, ns in os.walk(ckpt_dir / "4" / "state") for n in ns
            if "ocdbt.process" in r]
  path = max(arrays, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with caplog.at_level(logging.WARNING):
    trainer_lib.train_and_evaluate(c, str(tmp_path))
  msgs = [r.getMessage() for r in caplog.records]
  assert any("step 4" in m and "unusable" in m for m in msgs), msgs
  assert any("resuming from step 2" in m for m in msgs), msgs
  assert losses(tmp_path) == full   # steps 3-4 redone from step 2 to the same losses
  assert (ckpt_dir / "4.corrupt").is_dir()


# ------------------------------------------------------------------ non-finite steps


def diverging_config(steps):
  """lr=1e3 without clipping: the loss jumps at step 3, and from step 7 on the gradient is NaN
  while the loss is still finite (the case a loss-only check misses)."""
  c = tiny_config(steps=steps)
  c.optim.update(lr=1e3, clip_norm=0.0)
  c.checkpoint.every_steps = 2
  return c


def test_nonfinite_halt_names_the_last_finite_step_and_never_saves_nan(tmp_path):
  c = diverging_config(10)
  c.train.nonfinite = "halt"
  with pytest.raises(loss_monitor.NonFiniteTrainingError) as e:
    trainer_lib.train_and_evaluate(c, str(tmp_path))
  msg = str(e.value)
  step = int(msg.split(":")[0].split()[-1])   # "step N: ..."
  assert 2 < step <= 10
  assert f"last finite step is {step - 1}" in msg
  steps = _finite_checkpoints(c, tmp_path)
  assert steps and max(steps) < step
  assert f"step {max(steps)} in" in msg   # the checkpoint from before the event


def test_nonfinite_skip_counts_and_halts_after_too_many_in_a_row(tmp_path):
  c = diverging_config(12)
  c.train.update(nonfinite="skip", nonfinite_max_consecutive=3)
  with pytest.raises(loss_monitor.NonFiniteTrainingError, match="3 non-finite steps in a row"):
    trainer_lib.train_and_evaluate(c, str(tmp_path))
  rows = [r for r in read_metrics(str(tmp_path)) if "loss" in r]
  skipped = [r["step"] for r in rows if r["nonfinite"] == 1.0]
  assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
  assert [r["nonfinite_steps"] for r in rows if r["step"] in skipped] == [1, 2, 3]
  # Params of a skipped step are those of the last finite step (the update was dropped).
  assert len({r["param_norm"] for r in rows if r["step"] >= skipped[0]}) == 1
  assert _finite_checkpoints(c, tmp_path)


def test_step_drops_an_update_that_would_make_params_nonfinite():
  c = tiny_config()
  setup = setup_lib.build_setup(c, devices=jax.devices()[:1])
  state = setup.init_fn()
  from tests.test_train import _batch
  batch = _batch(c)
  # loss and gradients finite, the update overflows float32
  tx = optax.chain(optax.scale(1e30), optax.scale(1e30))
  state = dict(state, opt_state=tx.init(state["params"]))
  new, m = jax.jit(make_train_step(setup.graphdef, tx))(state, batch)
  assert float(m["nonfinite"]) == 1.0 and math.isfinite(float(m["loss"]))
  assert int(new["step"]) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(new["params"]),
               jax.device_get(state["params"]))
  tx = optax.sgd(1e-3)
  state = dict(state, opt_state=tx.init(state["params"]))
  new, m = jax.jit(make_train_step(setup.graphdef, tx))(state, batch)
  assert float(m["nonfinite"]) == 0.0
  assert not np.array_equal(jax.device_get(new["params"]["embed"]),
                            jax.device_get(state["params"]["embed"]))


def test_loss_monitor_flags_spikes_and_round_trips():
  mon = loss_monitor.LossMonitor(window=8, threshold=4.0)
  rng = np.random.default_rng(0)
  flags = [mon.update(s, 2.0 + 1e-4 * rng.standard_normal(), False) for s in range(1, 9)]
  assert not any(flags)
  assert mon.update(9, 2.5, False) and mon.loss_spikes == 1   # ~50 std above the mean
  assert not mon.update(10, 2.0, False)
  assert not mon.update(11, float("nan"), True) and mon.nonfinite_steps == 1
  assert mon.last_finite_step == 10
  twin = loss_monitor.LossMonitor(window=8, threshold=4.0)
  twin.load(mon.state())
  assert twin.state() == mon.state()
  assert twin.update(12, 2.5, False) == mon.update(12, 2.5, False)
  flat = loss_monitor.LossMonitor(window=8, threshold=4.0)   # a flat curve is not noise
  assert not any(flat.update(s, 3.0, False) for s in range(1, 8))
  assert not flat.update(8, 3.0 + 1e-4, False)


# ------------------------------------------------------------------ killed processes

STEPS = 120
CONFIG = killed_run_config(STEPS, checkpoint_every=7)


def _train_cmd(config_path, workdir):
  return [sys.executable, "experiments/train.py", f"--config={config_path}",
          f"--workdir={workdir}"]


def _env():
  return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(config_path, workdir):
  r = subprocess.run(_train_cmd(config_path, workdir), cwd=ROOT, env=_env(),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]


def _logged_step(workdir):
  try:
    rows = read_metrics(str(workdir))
  except (OSError, ValueError):
    return 0
  return max((r["step"] for r in rows if "loss" in r), default=0)


def _start_and_signal(config_path, workdir, sig, at_step):
  p = subprocess.Popen(_train_cmd(config_path, workdir), cwd=ROOT, env=_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    while _logged_step(workdir) < at_step:
      assert p.poll() is None, p.communicate()[1][-3000:]
      time.sleep(0.005)
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  return p.returncode, err


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  d = tmp_path_factory.mktemp("ref")
  cfg = d / "tiny_config.py"
  cfg.write_text(CONFIG)
  _run(cfg, d / "run")
  full = losses(d / "run")
  assert [s for s, _ in full] == list(range(1, STEPS + 1))
  return cfg, full


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_the_same_final_loss(tmp_path, reference_run, sig):
  cfg, full = reference_run
  at = random.Random().randint(10, STEPS - 40)
  rc, err = _start_and_signal(cfg, tmp_path, sig, at)
  where = f"(signal {sig.name} once step {at} was logged)"
  if sig == signal.SIGKILL:
    assert rc == -signal.SIGKILL, where
  else:   # stops at a step boundary with a checkpoint, exit status 128 + 15
    assert rc == 128 + signal.SIGTERM, (where, err[-2000:])
    stopped = Checkpointer(str(tmp_path)).latest_step()
    assert at <= stopped < STEPS and stopped == _logged_step(tmp_path), where
  assert _logged_step(tmp_path) < STEPS, where
  _run(cfg, tmp_path)
  resumed = losses(tmp_path)
  assert [s for s, _ in resumed] == list(range(1, STEPS + 1)), where
  assert resumed[-1] == full[-1], where
  assert resumed == full, where


@pytest.mark.slow
def test_a_step_that_does_not_fit_stops_with_the_knobs_or_shrinks_the_micro_batch(tmp_path):
  """Before the first step: too little memory -> one paragraph naming needed vs available
  memory and what to change; with train.auto_microbatch the micro-batch shrinks (same tokens
  per optimizer step through grad_accum) and training runs."""
  from configs import quickstart
  from attn_jax.train import trainer as trainer_lib
  from attn_jax.train.metrics import read_metrics
  c = quickstart.get_config()
  c.train.update(steps=2, log_every=1, progress_bar=False)
  c.eval.every_steps = 0
  c.data.global_batch_size = 64
  from attn_jax.train.memory import needed_bytes
  setup = setup_lib.build_setup(c)
  need = lambda rows: needed_bytes(setup_lib.step_memory(setup, rows, 1, c.data.seq_len))
  assert need(16) < need(64)
  # usable (95%) memory half-way between the needs of 16 and 64 rows: 64 do not fit, 16 do
  # (the parameters and optimizer state are a fixed part: a fraction of need(64) alone may
  # leave no micro-batch fitting on the 8 simulated devices)
  c.train.device_memory_gb = (need(16) + need(64)) / 2 / 0.95 / 2**30
  with pytest.raises(MemoryError, match=r"needs .* available: .*data\.global_batch_size=64.*"
                     r"train\.grad_accum.*model\.remat"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "stop"))
  c.train.auto_microbatch = True
  trainer_lib.train_and_evaluate(c, str(tmp_path / "auto"))
  rows = [r for r in read_metrics(str(tmp_path / "auto")) if "loss" in r]
  assert rows and all(r["weighted_tokens"] == 64 * 8 for r in rows), rows


# ------------------------------------------------------------------ evaluation


def test_niah_lengths_beyond_max_seq_len_warn_and_too_long_ones_are_named(caplog):
  from attn_jax.eval.run import niah_lengths
  c = tiny_config()
  c.model.max_seq_len = 64
  c.eval.niah_lengths = (48, 96, 512)
  with caplog.at_level(logging.WARNING):
    assert niah_lengths(c, max_len=128) == (48, 96)
  msgs = " ".join(r.getMessage() for r in caplog.records)
  assert "config.eval.niah_lengths" in msgs and "(512,)" in msgs and "max_len=128" in msgs
  assert "(96,) exceed config.model.max_seq_len=64" in msgs
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert niah_lengths(c, max_len=48) == (48,)
  assert not any("max_seq_len" in r.getMessage() for r in caplog.records)
  with pytest.raises(ValueError, match="config.eval.niah_lengths"):
    niah_lengths(c, max_len=32)


def test_heldout_batches_are_global_arrays_with_the_batch_sharding():
  c = tiny_config()
  c.mesh.shape = (2, 4, 1)
  setup = setup_lib.build_setup(c)
  from attn_jax.data import pipeline
  batches = setup_lib.make_heldout_batches(c, setup, num_batches=2)
  plain = pipeline.make_eval_batches(c.data, seed=c.seed, num_batches=2)
  for b, p in zip(batches, plain):
    for k in ("inputs", "targets", "weights"):
      assert b[k].sharding.is_equivalent_to(setup_lib.eval_batch_sharding(setup), 2)
      assert b[k].addressable_shards[0].data.shape == (1, c.data.seq_len)   # 8 row shards
      np.testing.assert_array_equal(np.asarray(b[k]), p[k])
