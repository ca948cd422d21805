"""Mamba-2 baseline, 152M (docs/papers.md §1.4: d 768, 31 layers, d_state 64; expand 2,
head dim 64).

Every layer is a Mamba-2 block without MLP (`pattern ("mamba2:nomlp",)`; d_ff is unused).
Parameters: 152,271,160 vs the Transformer's 151,878,144 (+0.26%, tests/test_mamba.py).
Training settings are the Transformer's (same data, batch, schedule).
"""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=31)
  c.model.pattern = ("mamba2:nomlp",)
  c.model.mamba2.update(d_state=64, expand=2.0, head_dim=64)
  return c
