"""The comparison study: flags in, `attn_jax.study` out.

  python experiments/study.py --config=configs/study_tiny.py --workdir=runs/study
  python experiments/study.py --report=runs/study --readme=docs/studies.md
  python experiments/study.py --config=configs/study_lm_tiny.py --workdir=runs/study_lm \
      --config.data.paths=../shared/data/tinyshakespeare/input.txt     # language modelling
  python experiments/study.py --config=configs/study_sinks.py --workdir=runs/study_sinks \
      --config.data.paths=../shared/data/tinyshakespeare/input.txt     # attention sinks

The first trains every variant of `config.study.variants` for every seed (matched parameter
counts, same data, same trainer and evaluators), measures throughput side by side, and writes
results.json, tables.md and the PNG plots under --workdir; rerunning it skips finished runs and
resumes unfinished ones (each variant's lr sweep first when `study.lrs` has several). The
second regenerates tables.md, the plots and the section of docs/studies.md between
`<!-- study:begin -->` and `<!-- study:end -->` (`<!-- study_lm:... -->` for the LM study,
`<!-- study_sinks:... -->` for the sink study, whose runs are then streamed: study/sinks.py) from
results.json alone
(--assets=docs/study copies the PNGs to a tracked folder and links them from there). Both
flags together (--config ... --readme=docs/studies.md) do both.
"""

import os
import shlex
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from attn_jax import cli, run_layout  # noqa: E402
from attn_jax import config_flags as checked_flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Study config (configs/study_*.py).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/study", "Study directory.")
_REPORT = flags.DEFINE_string("report", "", "Only regenerate the report from this study "
                              "directory's results.json.")
_README = flags.DEFINE_string("readme", "", "Markdown page to update between the study markers "
                               "(docs/studies.md).")
_ASSETS = flags.DEFINE_string("assets", "", "With --readme: copy the PNGs to this (tracked) "
                              "folder and link them from there, e.g. docs/study.")


def _refuse_a_training_run(workdir: str, flag: str) -> None:
  """A study folder holds results.json and runs/<variant>/seed<k>/; one training run's own
  folder (experiments/train.py --workdir) holds checkpoints/ and metrics.jsonl at its top. A
  study started there would mix its runs into that run's files."""
  layout = run_layout.RunLayout.of(workdir)
  marks = [n for n, p in ((run_layout.CHECKPOINTS, layout.checkpoints),
                          (run_layout.METRICS, layout.metrics)) if p.exists()]
  if marks and not os.path.isfile(os.path.join(workdir, "results.json")):
    raise ValueError(f"{flag}={workdir} is a training run's folder (it holds "
                     f"{' and '.join(marks)}), not a study folder: give the study a folder of "
                     "its own (it trains its runs under <folder>/runs/)")


def main(argv):
  del argv
  from absl import logging

  from attn_jax.study import report, run_study
  from attn_jax.study.runner import StudyStopped

  logging.set_verbosity(logging.WARNING)
  workdir = _REPORT.value or _WORKDIR.value
  _refuse_a_training_run(workdir, "--report" if _REPORT.value else "--workdir")
  if not _REPORT.value:
    if _CONFIG.value is None:
      raise app.UsageError("--config=configs/study_tiny.py (train) or --report=<dir> (report)")
    cmd = "python experiments/study.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:] if not a.startswith(("--readme", "--assets")))
    try:
      run_study(_CONFIG.value, workdir, command=cmd)
    except StudyStopped as e:   # SIGTERM/SIGINT: the run in progress saved a checkpoint
      print(f"\n{e}")
      sys.exit(128 + int(getattr(signal, e.signal_name, signal.SIGTERM)))
  out = report.write_report(workdir)
  print(open(out["tables"]).read())
  print("plots: " + ", ".join(out["plots"]))
  if _README.value:
    changed = report.update_readme(_README.value, workdir, _ASSETS.value)
    print(f"{_README.value}: study section {'updated' if changed else 'unchanged'}")


if __name__ == "__main__":
  # a config file that fails to load, an unknown or mistyped --config.* field: one line, exit 2
  cli.run(main, flags_parser=checked_flags.flags_parser("config"))
