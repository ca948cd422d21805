"""Causal multi-head (optionally grouped-query) self-attention with RoPE: the baseline mixer.

    q, k, v = x W_q, x W_k, x W_v;  q, k <- RoPE(q, k);  y = softmax(q k^T / sqrt(d_h)) v W_o

Options: the sink logit (`projection.SinkLogitOptions`: none | learned | softmax1). Decoding
state: a `cache.KVCache` under the policy asked for at decode time (dense, a ring, or
StreamingLLM's sinks + ring; `attention/cache.py`): the parameters do not depend on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flax import nnx

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import (QKVProjection, SinkLogitOptions, make_sink_logit,
                                           qk_probs, sink_logit_of)
from attn_jax.kernels import entry
from attn_jax.layers import causal_positions
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


@register_mixer("attention")
class Attention(cache_lib.CachedMixer):

  @dataclasses.dataclass(frozen=True)
  class Options(SinkLogitOptions):
    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      self.validate_sink_logit(where)

  def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  reads_shared_prefix = True   # packed rows: a masked key set (mixer.py)

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    cfg, p = self.cfg, self.proj
    scale = cfg.head_dim ** -0.5
    sink = sink_logit_of(self.opts, self.sink_logit, cfg.n_heads)
    if state is not None:
      qkv, rows = p.qkv_and_rows(x_BTD)
      out, state = cache_lib.cached_attention(
          state, *qkv, positions_BT, theta=cfg.rope_theta, scale=scale, sink_logit_H=sink,
          impl=cfg.attention_impl, qkv_rows=rows)
      return p.o(out), state, {}
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = p.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    out = entry.attend(   # positions None: the cores' fast causal path
        q, k, v, scale=scale, causal=True, q_positions=positions_BT, kv_positions=positions_BT,
        sink_logit_H=sink, impl=cfg.attention_impl, prefix_causal=True,
        q_segments=segment_ids_BT, kv_segments=segment_ids_BT,
        shared_prefix=cfg.sink_tokens > 0,   # no sink tokens: no segment-0 key in the row
        remat=True)                          # no [T, S] probabilities kept for the backward
    return p.o(out), None, {}

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward (last column: the sink); diagnostics."""
    return qk_probs(self, x_BTD)

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return entry.attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                           entry.causal_keys(seq_len))
