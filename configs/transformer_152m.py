"""Transformer baseline, 152M (docs/papers.md §1.4: d 768, 12 heads, 12 layers, d_ff 3072)."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(mixer="attention", d_model=768, n_heads=12, n_layers=12, d_ff=3072)
  c.data.seq_len = 2048
  c.data.global_batch_size = 32
  c.train.grad_accum = 8          # 32 x 2048 x 8 = 524,288 tokens per optimizer step
  c.train.steps = 9_537           # ~5B tokens
  c.optim.lr = 6e-4
  return c
