"""No wait for a checkpoint save without an end (train/checkpoint.py, "No wait without an end").

In-process: a save whose commit never ends (its manifest write blocked on an event, as a stalled
bucket or a hung network mount blocks it) is abandoned after `save_timeout_s` with a message
naming the step and the last committed one, and after a stop signal within `signal_grace_s` of
the signal (exit 128 + signal through the entry points); the checkpointer then never waits for
orbax again (its close returns at once). Config: both fields validated, naming the field.

As subprocesses (`slow`): SIGTERM during each wait of a training run ends it within 30 s with
exit 143, its workdir lock released and the last committed step named: a stalled save waited
for at the next save, a checkpoint folder that turned read-only before the next step's folder
exists (orbax then waits 300 s for it), and the final save awaited at close."""

import os
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest

from attn_jax import config as config_lib
from attn_jax.train import checkpoint as ckpt_lib
from attn_jax.train.checkpoint import (Checkpointer, CheckpointStalledError,
                                       CheckpointStoppedError)
from tests.signal_setup import killed_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.int32(0)}


class _Stall:
  """`checkpoint.write_manifest` blocked for steps >= `from_step` until `release()`."""

  def __init__(self, monkeypatch, from_step: int):
    self.gate, self.entered = threading.Event(), threading.Event()
    real = ckpt_lib.write_manifest

    def stalled(step_dir):
      if int(os.path.basename(os.fspath(step_dir)).split(".")[0]) >= from_step:
        self.entered.set()
        self.gate.wait()
      return real(step_dir)

    monkeypatch.setattr(ckpt_lib, "write_manifest", stalled)

  def release(self):
    self.gate.set()


class _Guard:
  """What `Checkpointer.stop_when` reads of a PreemptionGuard."""

  def __init__(self):
    self.should_stop, self.signal_name, self.stop_time = False, None, None

  def signal(self, name="SIGTERM"):
    self.should_stop, self.signal_name, self.stop_time = True, name, time.monotonic()


def _save(ckpt, step):
  ckpt.save(step, dict(STATE, step=jnp.int32(step)), None, {"step": step}, force=True)


def test_a_stalled_save_is_abandoned_after_save_timeout_naming_the_last_committed_step(
    tmp_path, monkeypatch):
  stall = _Stall(monkeypatch, from_step=4)
  ckpt = Checkpointer(str(tmp_path), save_timeout_s=1.0)
  try:
    _save(ckpt, 2)
    ckpt.wait()
    assert ckpt.last_committed == 2
    _save(ckpt, 4)
    assert stall.entered.wait(30)
    t = time.monotonic()
    with pytest.raises(CheckpointStalledError) as info:
      ckpt.wait()
    assert time.monotonic() - t < 5   # 1 s and a poll, not orbax's own timeout (minutes)
    msg = str(info.value)
    assert "checkpoint step 4" in msg and "1 s (config.checkpoint.save_timeout_s)" in msg
    assert "the last committed step is 2" in msg and not isinstance(info.value,
                                                                    CheckpointStoppedError)
    assert info.value.step == 4 and info.value.last_committed == 2
    with pytest.raises(CheckpointStalledError, match="the save of step 4 was abandoned"):
      _save(ckpt, 6)   # orbax's own save would wait for the abandoned one
    t = time.monotonic()
    ckpt.close()   # abandoned: orbax's close (which would wait for the save) is not called
    ckpt.wait()
    assert time.monotonic() - t < 1
  finally:
    stall.release()
  assert ckpt.all_steps() == [2] or ckpt.all_steps() == [2, 4]


def test_a_stop_signal_cuts_a_wait_to_the_signal_grace(tmp_path, monkeypatch):
  stall = _Stall(monkeypatch, from_step=2)
  ckpt = Checkpointer(str(tmp_path), save_timeout_s=600, signal_grace_s=0.5)
  guard = _Guard()
  ckpt.stop_when(guard)
  try:
    _save(ckpt, 2)
    assert stall.entered.wait(30)
    threading.Timer(0.3, guard.signal).start()   # SIGTERM arrives during the wait
    t = time.monotonic()
    with pytest.raises(CheckpointStoppedError) as info:
      ckpt.wait()
    assert time.monotonic() - t < 3
    e = info.value
    assert e.signal_name == "SIGTERM" and e.exit_status == 143 and e.last_committed is None
    assert str(e).startswith("stopped by SIGTERM while checkpoint step 2 was being saved")
    assert "there is no committed step" in str(e)
    from attn_jax import cli
    assert cli.exit_status(e) == 143
  finally:
    stall.release()
    ckpt.close()


def test_a_save_that_commits_within_the_grace_is_kept(tmp_path, monkeypatch):
  """A stop signal does not abandon a save that ends within the grace (the usual preemption:
  the step boundary's save commits, the run ends with it)."""
  stall = _Stall(monkeypatch, from_step=2)
  ckpt = Checkpointer(str(tmp_path), signal_grace_s=30)
  guard = _Guard()
  ckpt.stop_when(guard)
  _save(ckpt, 2)
  assert stall.entered.wait(30)
  guard.signal()
  threading.Timer(0.3, stall.release).start()
  ckpt.close()
  assert ckpt.all_steps() == [2] and ckpt.last_committed == 2


@pytest.mark.parametrize("field", ["save_timeout_s", "signal_grace_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf")])
def test_the_wait_bounds_are_checked(field, value):
  c = config_lib.default_config()
  c.checkpoint[field] = value
  with pytest.raises(ValueError, match=f"config.checkpoint.{field}: must be a number of "
                                       "seconds > 0"):
    config_lib.validate(c)


# ------------------------------------------------------------------ SIGTERM during each wait

# Runs experiments/train.py with the commit of checkpoint step STALL_STEP (and later ones)
# stalled (its manifest write, part of the commit, blocks for good), or with the checkpoint
# folder turned read-only (a read-only bind mount: root ignores permissions) just before step
# RO_AT is saved. Prints "STALLED <step>" / "READ-ONLY" on stderr when that happens.
_RUNNER = """
import os, subprocess, sys, threading
sys.path.insert(0, os.getcwd())
import attn_jax.cli  # JAX starts as in the entry point
from attn_jax.train import checkpoint

stall = int(os.environ.get("STALL_STEP", "0"))
ro_at = int(os.environ.get("RO_AT", "0"))
real_manifest, real_save = checkpoint.write_manifest, checkpoint.Checkpointer.save


def manifest(step_dir):
  step = int(os.path.basename(step_dir).split(".")[0])
  if stall and step >= stall:
    print(f"STALLED {step}", file=sys.stderr, flush=True)
    threading.Event().wait()
  return real_manifest(step_dir)


def save(self, step, *args, **kwargs):
  if ro_at and step == ro_at:
    self.wait()   # the step before committed, then the folder turns read-only
    folder = self.directory
    for cmd in (["mount", "--bind", folder, folder], ["mount", "-o", "remount,bind,ro", folder]):
      subprocess.run(cmd, check=True, capture_output=True)
    print("READ-ONLY", file=sys.stderr, flush=True)
  return real_save(self, step, *args, **kwargs)


checkpoint.write_manifest = manifest
checkpoint.Checkpointer.save = save
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(os.path.join("experiments", "train.py"), run_name="__main__")
"""


def _start(tmp_path, env, *flags, steps=400):
  cfg = tmp_path / "cfg.py"
  cfg.write_text(killed_run_config(steps=steps, checkpoint_every=2))
  runner = tmp_path / "runner.py"
  runner.write_text(_RUNNER)
  return subprocess.Popen(
      [sys.executable, str(runner), "train.py", f"--config={cfg}",
       f"--workdir={tmp_path / 'run'}", *flags],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(p, marker: str, timeout: float = 600) -> str:
  seen = []
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = p.stderr.readline()
    if not line:
      break
    seen.append(line)
    if marker in line:
      return "".join(seen)
  p.kill()
  raise AssertionError(f"never saw {marker!r}:\n" + "".join(seen)[-3000:])


def _sigterm_ends_it(p, tmp_path, last_committed: int):
  t = time.monotonic()
  p.send_signal(signal.SIGTERM)
  try:
    out, err = p.communicate(timeout=60)
  finally:
    if p.poll() is None:
      p.kill()
  took = time.monotonic() - t
  assert p.returncode == 143, err[-3000:]
  assert took < 30, f"took {took:.1f} s"
  lock = (tmp_path / "run" / ".lock").read_text()
  assert lock == "", lock   # released
  # The line: stderr's last (the abandoned save's error), or stdout's last (the backstop's, when
  # the run was blocked where no wait of its own could see the signal).
  tails = [text.strip().splitlines()[-1] for text in (err, out) if text.strip()]
  tail = next((t for t in tails if t.startswith("stopped by SIGTERM")), "")
  assert f"the last committed step is {last_committed}" in tail, (out[-1000:], err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  return tail


@pytest.mark.slow
def test_sigterm_during_a_stalled_save_ends_the_run_within_30_s(tmp_path):
  """Step 4's commit stalls; the run trains on until its step-6 save waits for it; SIGTERM."""
  p = _start(tmp_path, {"STALL_STEP": "4"})
  _wait_for_line(p, "STALLED 4")
  time.sleep(2)   # the loop reaches the step-6 save and waits there
  tail = _sigterm_ends_it(p, tmp_path, last_committed=2)
  assert "checkpoint step 4 was being saved" in tail
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints"))[0] == "2"


@pytest.mark.slow
def test_sigterm_during_the_final_close_ends_the_run_within_30_s(tmp_path):
  """A 5-step run: its final save (step 5) stalls and the close waits for it; SIGTERM."""
  p = _start(tmp_path, {"STALL_STEP": "5"}, steps=5)
  _wait_for_line(p, "STALLED 5")
  time.sleep(2)   # the run is in its close, waiting for that save
  tail = _sigterm_ends_it(p, tmp_path, last_committed=4)
  assert "checkpoint step 5 was being saved" in tail


@pytest.mark.slow
def test_sigterm_while_orbax_waits_for_a_read_only_folder_ends_the_run_within_30_s(tmp_path):
  """checkpoints/ turns read-only once step 2 has committed: orbax cannot create step 4's
  folder and waits 300 s for it; the next save waits for that one; SIGTERM."""
  if os.geteuid() != 0:
    pytest.skip("a read-only bind mount needs root")
  p = _start(tmp_path, {"RO_AT": "4"})
  try:
    _wait_for_line(p, "READ-ONLY")
    time.sleep(5)   # step 4's save has started and waits for its folder
    _sigterm_ends_it(p, tmp_path, last_committed=2)
  finally:
    subprocess.run(["umount", "-l", str(tmp_path / "run" / "checkpoints")], capture_output=True)
  assert "2" in os.listdir(tmp_path / "run" / "checkpoints")
