"""Mamba-2 baseline, 369M (docs/papers.md §1.4: d 1024, 49 layers, d_state 64; expand 2,
head dim 64).

Parameters: 368,482,528 vs the Transformer's 369,252,352 (-0.21%). lr 3e-4 as the Transformer.
"""

from configs import transformer_369m


def get_config():
  c = transformer_369m.get_config()
  c.model.update(d_model=1024, n_heads=16, n_layers=49)
  c.model.pattern = ("mamba2:nomlp",)
  c.model.mamba2.update(d_state=64, expand=2.0, head_dim=64)
  return c
