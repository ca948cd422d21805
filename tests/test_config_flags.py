"""Unknown --config.<path> overrides: one clear line naming the full path, no traceback."""

import os
import subprocess
import sys

import pytest

from attn_jax import config_flags
from configs import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_check_path_names_the_full_path_and_the_known_fields():
  c = quickstart.get_config()
  config_flags.check_path(c, "model.d_model")
  config_flags.check_path(c, "model.sisa.d_state")
  with pytest.raises(config_flags.ConfigFieldError,
                     match=r"^config\.model\.foo: unknown field \(known: .*d_model.*\)"):
    config_flags.check_path(c, "model.foo")
  with pytest.raises(config_flags.ConfigFieldError, match=r"did you mean config\.optim\.lr\?"):
    config_flags.check_path(c, "optim.lrr")
  with pytest.raises(config_flags.ConfigFieldError, match=r"config\.seed: is a int"):
    config_flags.check_path(c, "seed.x")


def test_override_paths_and_config_argument():
  argv = ["train.py", "--config", "configs/x.py:16", "--config.model.d_model=8",
          "--noconfig.train.progress_bar", "-config.data.paths", "a.txt", "--workdir=w",
          "--", "--config.after.double.dash=1"]
  assert config_flags.override_paths(argv) == ["model.d_model", "train.progress_bar",
                                               "data.paths"]
  assert config_flags.config_argument(argv) == "configs/x.py:16"
  assert config_flags.config_argument(["t", "--config=a.py"]) == "a.py"
  assert config_flags.config_argument(["t"], default="d.py") == "d.py"


def test_train_script_reports_an_unknown_field_in_one_line(tmp_path):
  r = subprocess.run([sys.executable, "experiments/train.py", "--config=configs/quickstart.py",
                      f"--workdir={tmp_path}", "--config.model.foo=1"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  assert r.returncode == 2
  assert "Traceback" not in r.stderr
  assert "config.model.foo: unknown field (known: " in r.stderr
  assert "d_model" in r.stderr
