"""Mamba-3 (SISO) baseline, 50M (docs/papers.md §1.4: d 512, 14 layers, d_state 64, expand 2).

At expand 2 (16 heads of 64) the model has 49,176,768 parameters, 3.41% under the
Transformer's 50,914,304; 17 heads (d_inner 1088, expand 2.125) give 50,576,348 (-0.66%).
"""

from configs import transformer_50m


def get_config():
  c = transformer_50m.get_config()
  c.model.update(d_model=512, n_heads=8, n_layers=14)
  c.model.pattern = ("mamba3:nomlp",)
  c.model.mamba3.update(d_state=64, head_dim=64, n_heads=17)
  return c
