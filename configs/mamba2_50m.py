"""Mamba-2 baseline, 50M (docs/papers.md §1.4: d 512, 14 layers, d_state 64).

At expand 2 / head dim 64 (16 heads) the model has 48,897,440 parameters, 3.96% under the
Transformer's 50,914,304; one more head (17) is still 1.23% under, two (18) 1.49% over. Widening
the 16 heads to head dim 70 (d_inner 1120, expand 2.1875) gives 50,969,888 (+0.11%) and keeps
the head count, d_state and the number of B/C groups of the standard block.
"""

from configs import transformer_50m


def get_config():
  c = transformer_50m.get_config()
  c.model.update(d_model=512, n_heads=8, n_layers=14)
  c.model.pattern = ("mamba2:nomlp",)
  c.model.mamba2.update(d_state=64, head_dim=70, n_heads=16)
  return c
