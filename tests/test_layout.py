"""The package's layout rules: one file per stem, the library never reaches up into configs/,
and mixer discovery imports the mixer packages only (no reference models)."""

import collections
import pathlib
import re
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "attn_jax"
IMPORTS_CONFIGS = re.compile(r"^\s*(from configs\b|import configs\b)|import_module\(f?[\"']configs\.",
                             re.M)


def test_every_module_stem_is_unique():
  stems = collections.Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
  assert [s for s, n in stems.items() if n > 1] == []


def test_the_library_does_not_import_the_configs_folder():
  """Entry points (experiments/) load configs and pass them in. bench/configs.py, the
  benchmark's config names, is the one exception left (its names are configs/ files)."""
  readers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if IMPORTS_CONFIGS.search(p.read_text())}
  assert readers <= {"bench/configs.py"}, sorted(readers)


def test_mixer_discovery_imports_no_reference_model():
  code = ("import sys; from attn_jax.registry import available_mixers; available_mixers(); "
          "print(sorted(m for m in sys.modules if m.startswith('attn_jax.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""}).stdout
  assert "attn_jax.study" not in out and "mamba2_minimal" not in out
  assert "attn_jax.ssm.mamba2" in out and "attn_jax.attention.sisa" in out
