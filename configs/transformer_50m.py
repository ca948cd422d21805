"""Transformer baseline, 50M (docs/papers.md §1.4: d 512, 8 heads, 6 layers, d_ff 2048)."""

from configs import transformer_152m


def get_config():
  c = transformer_152m.get_config()
  c.model.update(d_model=512, n_heads=8, n_layers=6, d_ff=2048)
  return c
