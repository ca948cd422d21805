"""docs/hardware.md: every 152M / 369M preset's train step compiled for 8 x H100, v5e-8, v5p-8,
v6e-8 and two hosts of 8 H100, the attention presets' length scaling (T 2048 to 32768) and the
attention and SSD kernels' census on an H100 (attn_jax/bench/hardware_page.py). Resumes where it stopped.

  python experiments/hardware_page.py                        # every preset and target
  python experiments/hardware_page.py --presets=sisa_152m --targets=v5e-8
  python experiments/hardware_page.py --targets=h100x1       # the kernel census only
  python experiments/hardware_page.py --tables=lengths --fresh   # the length table again
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["JAX_PLATFORMS"] = "cpu"   # the targets' devices compile only; compute on the CPU

from absl import app, flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "docs/hardware.md", "The page (its cells: <out>.json beside).")
_PRESETS = flags.DEFINE_list("presets", [], "Presets to measure (default: every 152M / 369M).")
_TARGETS = flags.DEFINE_list("targets", [], "Targets of hardware_page.ROWS, and h100x1 for the "
                             "kernel census (default: all).")
_FRESH = flags.DEFINE_bool("fresh", False, "Re-measure the cells already measured.")
_TABLES = flags.DEFINE_list("tables", ["targets", "lengths", "census"], "Tables to measure: "
                            "targets (the presets on ROWS), lengths (LENGTH_ROWS), census.")


def load_presets(root: str = "configs") -> dict:
  """{name: get_config} of the configs/*_152m.py and *_369m.py files."""
  import glob
  import importlib
  names = [os.path.basename(p)[:-3] for pat in ("*_152m.py", "*_369m.py")
           for p in glob.glob(os.path.join(root, pat))]
  return {n: importlib.import_module(f"configs.{n}").get_config for n in names}


def main(argv):
  del argv
  from attn_jax.bench import hardware_page as hp
  picked = lambda rows: [r for r in rows if not _TARGETS.value or r.target in _TARGETS.value]
  presets = load_presets()
  every = hp.preset_names(presets)
  names = _PRESETS.value or every
  lengths = [n for n in hp.LENGTH_PRESETS if n in names]
  cells = os.path.splitext(_OUT.value)[0] + ".json"
  tables = set(_TABLES.value)
  if tables - {"targets", "lengths", "census"}:
    raise app.UsageError(f"--tables={','.join(_TABLES.value)}: each of targets, lengths, census")
  todo = hp.cells(names, picked(hp.ROWS) if "targets" in tables else [],
                  picked(hp.LENGTH_ROWS) if "lengths" in tables else [], lengths)
  done = hp.run(cells, todo, presets, fresh=_FRESH.value)
  if "census" in tables and (not _TARGETS.value or hp.CENSUS.target in _TARGETS.value):
    hp.run_census(cells, fresh=_FRESH.value)
    done = hp.run_ssd_census(cells, fresh=_FRESH.value)
  with open(_OUT.value, "w") as f:
    f.write(hp.page(done, every))
  print(f"wrote {_OUT.value} ({len(done)} cells in {cells})")


if __name__ == "__main__":
  cli.run(main)
