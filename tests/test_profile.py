"""config.train.profile_steps: a jax.profiler trace of the chosen steps in <workdir>/profile
(attn_jax/train/profile.py), on CPU as on any backend; a malformed window is a config error."""

import glob
import gzip
import json
import os

import pytest

from attn_jax import config as config_lib
from attn_jax.train import trainer as trainer_lib
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
