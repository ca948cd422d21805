"""The fine-tuning study: flags in, `attn_jax.study.finetune` out.

  python experiments/finetune_study.py --config=configs/study_finetune.py \
      --workdir=runs/finetune_study
  python experiments/finetune_study.py --report=runs/finetune_study \
      --page=docs/pretrained_variants.md --assets=docs/finetune_study

The first converts SmolLM2 into each variant, fine-tunes every one (lr sweep, seeds), scores
the held-out stream under both caches and writes results.json, tables.md and
nll_by_position.png under --workdir; rerunning it resumes where it stopped. The second
regenerates tables.md and the plot from results.json alone (and, with --page, that page's
generated section, the plot copied to --assets).
"""

import os
import shlex
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from attn_jax import cli  # noqa: E402
from attn_jax import config_flags as checked_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/study_finetune.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/finetune_study", "Study directory.")
_REPORT = flags.DEFINE_string("report", "", "Only regenerate the report of this directory.")
_PAGE = flags.DEFINE_string("page", "", "Markdown page whose finetune_study section is rewritten "
                            "(e.g. docs/pretrained_variants.md).")
_ASSETS = flags.DEFINE_string("assets", "", "With --page: copy the plot to this tracked folder.")


def main(argv):
  del argv
  from absl import logging

  from attn_jax.study import finetune
  from attn_jax.study.runner import StudyStopped
  from configs.base import get_config as base_config

  logging.set_verbosity(logging.WARNING)
  workdir = _REPORT.value or _WORKDIR.value
  if not _REPORT.value:
    if _CONFIG.value is None:
      raise app.UsageError("--config=configs/study_finetune.py (run) or --report=<dir>")
    cmd = "python experiments/finetune_study.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
      finetune.run_study(_CONFIG.value, workdir, base_config=base_config(), command=cmd)
    except StudyStopped as e:
      print(f"\n{e}")
      sys.exit(128 + int(getattr(signal, e.signal_name, signal.SIGTERM)))
  out = finetune.write_report(workdir, _PAGE.value, _ASSETS.value)
  print(open(out["tables"]).read())
  print(f"plot: {out['plot']}" + (f"; page: {out['page']}" if "page" in out else ""))


if __name__ == "__main__":
  # a config file that fails to load, an unknown or mistyped --config.* field: one line, exit 2
  cli.run(main, flags_parser=checked_flags.flags_parser("config"))
