"""Mamba-3 (SISO) baseline, 369M (docs/papers.md §1.4: d 1024, 48 layers, d_state 64, expand 2).

Defaults give 365,526,016 parameters (-1.01% vs the Transformer's 369,252,352); two B/C groups,
as at 152M, give 371,817,472 (+0.69%). lr 3e-4 as the Transformer.
"""

from configs import transformer_369m


def get_config():
  c = transformer_369m.get_config()
  c.model.update(d_model=1024, n_heads=16, n_layers=48)
  c.model.pattern = ("mamba3:nomlp",)
  c.model.mamba3.update(d_state=64, expand=2.0, head_dim=64, n_groups=2)
  return c
