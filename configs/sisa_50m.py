"""SISA, 50M (docs/papers.md §1): the Transformer 50M preset with mixer "sisa" and a narrower
SwiGLU so that the parameter count matches (d_ff 1832 at d_state 32).

Preset override of d_state (16 / 32 / 64 / 128; d_ff is recomputed by `matched_d_ff`):
  --config=configs/sisa_50m.py:16     (or :d_state=16)
"""

from configs import base, transformer_50m


def get_config(config_string: str = ""):
  return base.sisa_matched(transformer_50m.get_config(), config_string)
