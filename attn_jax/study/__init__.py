"""The comparison study: every variant through the one trainer and evaluator.

  matching.py    per-variant configs from `config.study.variants`, parameter matching
  needle.py      needle-in-a-haystack in MQAR's token space (for models trained on MQAR)
  throughput.py  train-step throughput side by side (tokens/s, CPU time per step)
  runner.py      run every (variant, seed), resumable; results.json
  report.py      tables (markdown), PNG plots, the README section between markers
  tables.py      the markdown helpers report.py and sinks.py share
  sinks.py       the attention-sink study's stream phase and tables (configs/study_sinks.py)
  mamba2_parity.py, mamba2_minimal.py  attn_jax's Mamba-2 beside a minimal plain-JAX one

Entry point: experiments/study.py.
"""

from attn_jax.study.matching import variant_config, match_params, variant_names  # noqa: F401
from attn_jax.study.report import write_report, update_readme  # noqa: F401
from attn_jax.study.runner import run_study  # noqa: F401

__all__ = ["write_report", "update_readme", "run_study", "variant_config", "match_params",
           "variant_names"]
