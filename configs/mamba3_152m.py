"""Mamba-3 (SISO) baseline, 152M (docs/papers.md §1.4: d 768, 30 layers, d_state 64, expand 2).

At the defaults (head dim 64, one B/C group) the model has 149,878,944 parameters, 1.32% under
the Transformer's 151,878,144 (one more head: +1.64%). Two B/C groups (each shared by 12
heads, before the per-head bias and rotation) give 152,828,064 (+0.63%), with expand, head dim
and d_state as in the table.
"""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=768, n_heads=12, n_layers=30)
  c.model.pattern = ("mamba3:nomlp",)
  c.model.mamba3.update(d_state=64, expand=2.0, head_dim=64, n_groups=2)
  return c
