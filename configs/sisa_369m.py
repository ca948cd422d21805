"""SISA, 369M (docs/papers.md §1): the Transformer 369M preset with mixer "sisa" and a narrower
SwiGLU so that the parameter count matches (d_ff 2512 at d_state 32).

Preset override of d_state (16 / 32 / 64 / 128; d_ff is recomputed by `matched_d_ff`):
  --config=configs/sisa_369m.py:16     (or :d_state=16)
"""

from configs import base, transformer_369m


def get_config(config_string: str = ""):
  return base.sisa_matched(transformer_369m.get_config(), config_string)
