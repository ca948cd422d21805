"""config.train.profile_steps: a jax.profiler trace of the chosen steps in <workdir>/profile
(attn_jax/train/profile.py), on CPU as on any backend; a malformed window is a config error, and
a window the run never reaches (past its last step, or passed before a resume) is a warning at
start (it used to end with status 0 and no trace, silently)."""

import glob
import gzip
import json
import logging
import os

import pytest

from attn_jax import config as config_lib
from attn_jax.train import trainer as trainer_lib
from attn_jax.train.profile import StepProfiler
from tests.test_train import tiny_config


def _trace_files(workdir):
  root = os.path.join(workdir, "profile", "plugins", "profile")
  return (glob.glob(os.path.join(root, "*", "*.xplane.pb")),
          glob.glob(os.path.join(root, "*", "perfetto_trace.json.gz")))


@pytest.mark.parametrize("steps,window", [(4, "2:4"), (3, "2:9")],
                         ids=["window-inside-the-run", "run-ends-inside-the-window"])
def test_the_chosen_steps_are_traced_into_the_workdir(tmp_path, steps, window):
  """Steps 2 and 3 are traced, and only they: the train step's executions (one per step; the
  first step, which compiles, is outside the window)."""
  c = tiny_config(steps=steps)
  c.train.profile_steps = window
  trainer_lib.train_and_evaluate(c, str(tmp_path))
  xplane, perfetto = _trace_files(tmp_path)
  assert len(xplane) == 1 and os.path.getsize(xplane[0]) > 0, xplane
  assert len(perfetto) == 1, perfetto
  with gzip.open(perfetto[0]) as f:
    events = json.load(f)["traceEvents"]
  runs = [e for e in events if e.get("name") == "CommonPjRtLoadedExecutable::Execute (jit_step)"]
  assert len(runs) == 2, len(runs)


def test_no_window_writes_no_profile(tmp_path):
  trainer_lib.train_and_evaluate(tiny_config(steps=1), str(tmp_path))
  assert not os.path.exists(tmp_path / "profile")


@pytest.mark.parametrize("spec", ["20", "5:5", "0:3", "a:b", "7:3", "3:"])
def test_a_malformed_window_names_the_field(spec):
  c = tiny_config()
  c.train.profile_steps = spec
  with pytest.raises(ValueError, match="config.train.profile_steps: want 'first:stop'"):
    config_lib.validate(c)


def test_the_window_is_a_slice():
  assert config_lib.profile_steps("20:25") == (20, 25)
  assert config_lib.profile_steps("") is None


@pytest.mark.parametrize("steps, window, said", [
    (4, "20:25", "no trace will be written: the run ends at step 4 (config.train.steps), before "
                 "the window's first step 20"),
    (4, "3:9", "the trace stops at the run's last step 4 (config.train.steps), not at step 8"),
    (30, "20:25", None)], ids=["past-the-end", "cut-at-the-end", "inside-the-run"])
def test_a_window_past_the_runs_end_is_a_warning_at_start(caplog, steps, window, said):
  c = tiny_config(steps=steps)
  c.train.profile_steps = window
  with caplog.at_level(logging.WARNING):
    config_lib.validate(c)
  warned = [r.getMessage() for r in caplog.records if "profile_steps" in r.getMessage()]
  assert warned == ([f"config.train.profile_steps={window!r}: {said}"] if said else []), warned


def test_a_resume_past_the_window_is_a_warning_at_start(tmp_path, caplog):
  with caplog.at_level(logging.WARNING):
    StepProfiler("2:4", str(tmp_path), start=6, last=10)   # resumed after step 6
    StepProfiler("2:4", str(tmp_path), start=0, last=10)   # a fresh run: traced
    StepProfiler("2:9", str(tmp_path), start=6, last=10)   # the rest of the window: traced
  warned = [r.getMessage() for r in caplog.records]
  assert warned == ["config.train.profile_steps='2:4': no trace will be written: the run "
                    "resumes after step 6, past the window (steps 2 to 3)"], warned
