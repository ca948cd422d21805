"""SISA, 50M (SPEC.md section 1): the Transformer 50M preset with mixer "sisa" and a narrower
SwiGLU so that the parameter count matches (d_ff 1832 at d_state 32).

Preset override of d_state (16 / 32 / 64 / 128; d_ff is recomputed by `matched_d_ff`):
  --config=configs/sisa_50m.py:16     (or :d_state=16)
"""

from attn_jax.attention.sisa import matched_d_ff
from configs import transformer_50m


def get_config(config_string: str = ""):
  d_state = int(config_string.split("=")[-1]) if config_string else 32
  c = transformer_50m.get_config()
  d_ff = matched_d_ff(c.model, d_state)   # from the Transformer's width, before editing
  c.model.update(mixer="sisa", d_ff=d_ff)
  c.model.sisa.d_state = d_state
  return c
