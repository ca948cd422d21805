"""The mixer contract, followed literally: docs/mixers.md's two files, placed where it says,
give a mixer that trains with `experiments/train.py` and passes the suite's generic checks
(step-by-step decoding == full forward, ragged batches, packed rows equal each document alone,
causality by gradient inside each document) with no change anywhere else.

The files go into a temporary copy of the paths the guide names, appended to the package paths
(`attn_jax.attention.__path__`, `configs.__path__`) in a subprocess, so the registry discovers
the module exactly as it would in the checkout while no other test sees the extra mixer.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from attn_jax import registry
from attn_jax.mixer import Mixer, register_mixer

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "mixers.md"


def guide_files() -> dict[str, str]:
  """{path: text} of the guide's code blocks whose first line names a file (`# path`)."""
  blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
  files = {}
  for block in blocks:
    first, _, rest = block.partition("\n")
    if first.startswith("# ") and first.endswith(".py"):
      files[first[2:].strip()] = rest
  return files


def _prelude(tmp: pathlib.Path) -> str:
  return textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(ROOT)!r})
      import attn_jax.attention, configs
      attn_jax.attention.__path__.append({str(tmp / "attn_jax" / "attention")!r})
      configs.__path__.append({str(tmp / "configs")!r})
      """)


def _run(tmp, body: str, timeout: int = 600, **env_extra) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
  return subprocess.run([sys.executable, "-c", _prelude(tmp) + textwrap.dedent(body)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def guide_tree(tmp_path_factory) -> pathlib.Path:
  files = guide_files()
  assert set(files) == {"attn_jax/attention/causal_mean.py", "configs/causal_mean_tiny.py"}
  tmp = tmp_path_factory.mktemp("guide")
  for rel, text in files.items():
    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp / rel).write_text(text)
  return tmp


def test_guide_mixer_trains_with_the_entry_point(guide_tree, tmp_path):
  run = _run(guide_tree, f"""
      import runpy
      sys.argv = ["train.py", "--config={guide_tree / 'configs' / 'causal_mean_tiny.py'}",
                  "--workdir={tmp_path / 'run'}", "--config.train.steps=6",
                  "--config.train.log_every=3", "--config.eval.every_steps=0",
                  "--config.checkpoint.every_steps=3", "--config.train.progress_bar=False"]
      runpy.run_path("experiments/train.py", run_name="__main__")
      """)
  assert run.returncode == 0, run.stderr[-3000:]
  rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert any('"step": 6' in r for r in rows), rows
  assert (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.parametrize("target", ["h100x4", "v5e-4"])
def test_guide_mixer_compiles_for_gpu_and_tpu(guide_tree, target):
  """The guide's mixer, untouched, through `--compile_only` for 4 x H100 and a TPU v5e-4 slice
  on a data x fsdp mesh at bf16: train, eval and decode programs compile and fit (exit 0)."""
  from attn_jax import targets
  if not targets.available(target):
    pytest.skip(f"compile target {target} unavailable here (pip install -e '.[targets]')")
  run = _run(guide_tree, f"""
      import runpy
      sys.argv = ["train.py", "--config={guide_tree / 'configs' / 'causal_mean_tiny.py'}",
                  "--compile_only={target}", "--config.mesh.shape=(2,2,1)",
                  "--config.model.dtype=bfloat16"]
      runpy.run_path("experiments/train.py", run_name="__main__")
      """, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-3000:]
  assert target in out and "fits" in out, out[-3000:]
  for program in ("train", "eval", "decode"):
    assert program in out, (program, out[-3000:])


def test_guide_mixer_passes_the_generic_mixer_tests(guide_tree):
  run = _run(guide_tree, """
      import pytest
      sys.exit(pytest.main(["-q", "-m", "", "-p", "no:cacheprovider", "-k", "causal_mean",
                            "tests/test_trunk.py", "tests/test_packing.py"]))
      """)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-3000:]
  passed = re.search(r"(\d+) passed", out)
  assert passed and int(passed.group(1)) >= 4, out[-3000:]


def test_every_registered_mixer_meets_the_contract():
  for name in registry.available_mixers(include_private=True):
    cls = registry.get_mixer(name)
    assert issubclass(cls, Mixer), name
    opts = cls.tiny()
    assert isinstance(opts, cls.Options), name
    for axis, _ in cls.axis_rules:
      assert isinstance(axis, str), (name, axis)


def test_register_refuses_a_class_outside_the_contract():
  class NotAMixer:
    pass
  with pytest.raises(TypeError, match="must subclass attn_jax.mixer.Mixer"):
    register_mixer("_not_a_mixer")(NotAMixer)
