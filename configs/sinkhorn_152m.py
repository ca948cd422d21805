"""Sparse Sinkhorn attention LM, 152M: the Transformer baseline (configs/transformer_152m.py:
d 768, 12 heads, 12 layers, seq 2048, same data/optimizer/steps) with every attention layer
replaced by the causal Sinkhorn mixer (attn_jax/attention/sinkhorn.py).

Blocks of 64 tokens (32 blocks at 2048), soft sorting in training with Gumbel noise, the paper's
7 iterations at tau 0.75, hard sorting at inference. The SortNet adds D W + 2 W K d_s parameters
per layer (~0.2M); the SwiGLU is narrowed by that amount so the parameter count matches the
Transformer's (as the SISA presets do). `--config=configs/sinkhorn_152m.py:sortcut=2` keeps the
top-2 sorted blocks per query block instead (SortCut).
"""

import ml_collections

from configs import transformer_152m

def sinkhorn_extra_params(c: ml_collections.ConfigDict) -> int:
  m, s = c.model, c.model.sinkhorn
  kv = m.n_kv_heads or m.n_heads
  w = s.sortnet_width
  return m.d_model * w + (s.sortnet_depth - 1) * w * w + 2 * w * kv * s.sort_dim


def to_sinkhorn(c: ml_collections.ConfigDict, match_params: bool = True,
                **options) -> ml_collections.ConfigDict:
  """Turn a preset into its Sinkhorn twin: mixer, options, matched d_ff (the SortNet's logical
  axes sort_hidden / sort_dim are replicated by the mixer's own `axis_rules`)."""
  c.model.sinkhorn.update(options)
  c.model.update(mixer="sinkhorn", pattern=())   # every layer Sinkhorn (a preset's pattern goes)
  if match_params and c.model.d_ff:
    d_ff = c.model.d_ff - sinkhorn_extra_params(c) / (3 * c.model.d_model)
    c.model.d_ff = int(4 * round(d_ff / 4))
  return c


def get_config(config_string: str = ""):
  c = transformer_152m.get_config()
  cut = int(config_string.split("=")[-1]) if config_string else 0
  return to_sinkhorn(c, block_size=64, causal=True, n_iters=7, temperature=0.75,
                     gumbel_noise=True, sortnet_depth=1, sortnet_width=128, sort_dim=32,
                     n_sortcut=cut, hard_inference=True)
