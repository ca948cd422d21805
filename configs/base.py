"""Base configuration: every preset starts from `get_config()` here and edits it.

The defaults themselves are declared once, in the typed sections of `attn_jax/config.py`
(data, train, optim, checkpoint, eval, mesh, metrics: each field with its meaning) and in
`attn_jax/model_config.ModelConfig` (the model), with one sub-dict per registered mixer holding
that mixer's `Options` defaults (e.g. --config.model.sisa.d_state=16). Mesh axes and
logical->mesh rules are tuples (config_flags cannot override lists).
"""

import ml_collections

from attn_jax.config import default_config


def get_config() -> ml_collections.ConfigDict:
  return default_config()


def sisa_matched(c: ml_collections.ConfigDict, config_string: str = ""
                 ) -> ml_collections.ConfigDict:
  """A Transformer preset turned into its SISA twin: mixer "sisa", d_state from the preset
  override (`--config=configs/sisa_152m.py:16` or `:d_state=16`; default 32), and the SwiGLU
  narrowed by `matched_d_ff` (from the Transformer's width) so the parameter count matches."""
  from attn_jax.attention.sisa import matched_d_ff

  d_state = int(config_string.split("=")[-1]) if config_string else 32
  d_ff = matched_d_ff(c.model, d_state)   # from the Transformer's width, before editing
  c.model.update(mixer="sisa", d_ff=d_ff)
  c.model.sisa.d_state = d_state
  return c
