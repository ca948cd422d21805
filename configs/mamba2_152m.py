"""Mamba-2 baseline, 152M (SPEC.md table: d 768, 31 layers, d_state 64; expand 2, head dim 64).

Every layer is a Mamba-2 block without MLP (`pattern ("mamba2:nomlp",)`; d_ff is unused).
Parameters: 152,271,160 vs the Transformer's 151,878,144 (+0.26%, tests/test_mamba.py).
Training settings are the Transformer's (same data, batch, schedule).
"""

import ml_collections

from configs import transformer_152m


def mixer_options(c: ml_collections.ConfigDict, mixer: str, **fields) -> None:
  """Set `config.model.<mixer>.<field>`; creates the sub-dict if base.py has not made it."""
  if mixer not in c.model:
    c.model[mixer] = ml_collections.ConfigDict()
  for k, v in fields.items():
    c.model[mixer][k] = v


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=31)
  c.model.pattern = ("mamba2:nomlp",)
  mixer_options(c, "mamba2", d_state=64, expand=2.0, head_dim=64)
  return c
