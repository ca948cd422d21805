"""docs/multihost.md's launch recipes run as written: every `experiments/{train,eval,stream}.py`
command on the page parses with that entry point's own flags (absl + the config overrides,
each field checked to exist), its config validates, and a preset trains on the data it names
(`data.source`, `data.paths`, `data.tokenizer` all given: without them it would train on
generated MQAR). Shell parts are stood in for: `$VAR` and `$(...)` by sample values."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "multihost.md")
COMMAND = re.compile(r"(?:\S*python3?) (experiments/(?:train|eval|stream)\.py)([^'\n;&|>]*)")
SAMPLE = {"HOME": "/home/user", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
          "SLURM_JOB_NODELIST": "gpu[01-04]"}

PARSE = r"""
import importlib.util, json, sys
from absl import flags
script, argv = sys.argv[1], json.loads(sys.argv[2])
sys.argv = [script] + argv   # ml_collections registers the --config.* overrides it finds here
spec = importlib.util.spec_from_file_location("entry_point", script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)          # defines the flags; main() is not run
flags.FLAGS([script] + argv)
out = {"flags": sorted(a.lstrip("-").split("=")[0] for a in argv)}
if "config" in flags.FLAGS:
  from attn_jax import config_flags
  from attn_jax.config import validate
  name = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
  config_flags.check_overrides(config_flags.load_config_file(name), [script] + argv)
  c = flags.FLAGS.config
  validate(c)
  out.update(source=c.data.source, paths=c.data.paths, tokenizer=c.data.tokenizer, config=name)
print(json.dumps(out))
"""


def _commands() -> list[tuple[str, list[str]]]:
  text = open(DOC).read().replace("\\\n", " ")
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  out = []
  for block in blocks:
    block = re.sub(r"\$\([^)]*\)", "node01", block)
    block = re.sub(r"\$(\w+)", lambda m: SAMPLE.get(m.group(1), m.group(0)), block)
    for script, args in COMMAND.findall(block):
      out.append((script, shlex.split(args)))
  return out


def test_the_page_has_the_recipes():
  scripts = [s for s, _ in _commands()]
  assert scripts.count("experiments/train.py") >= 5 and "experiments/eval.py" in scripts


@pytest.mark.parametrize("script, argv", _commands(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_recipe_command_parses_with_the_entry_points_flags(script, argv):
  r = subprocess.run([sys.executable, "-c", PARSE, script, json.dumps(argv)], cwd=ROOT,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, f"{script} {argv}: {r.stderr[-2000:]}"
  out = json.loads(r.stdout.strip().splitlines()[-1])
  if script.endswith("train.py") and "quickstart" not in out["config"]:
    assert out["source"] != "synthetic" and out["paths"] and out["tokenizer"], (argv, out)
    assert "workdir" in out["flags"]
