"""Transformer baseline, 369M (docs/papers.md §1.4: d 1024, 16 heads, 24 layers, d_ff 2944,
lr 3e-4)."""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=1024, n_heads=16, n_layers=24, d_ff=2944)
  c.optim.lr = 3e-4
  return c
