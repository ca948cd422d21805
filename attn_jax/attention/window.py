"""Sliding-window causal attention: each token attends to itself and the `window - 1` tokens
before it (Longformer/Mistral-style local attention), with a ring-buffer decoding state.

    y_i = sum_{i - w < j <= i} softmax_j(q_i . k_j / sqrt(d_h)) v_j

The state is a `kv_state` ring of exactly `window` slots (keys after RoPE at their absolute
positions; RoPE is relative, so absolute positions inside a ring are exact), so a stream of any
length decodes in constant memory with one compiled step. A chunk of up to `window` new tokens
attends to [ring ; chunk] before it is written, which is why `max_chunk` is the window.
This is the `window` policy of StreamingLLM without the sinks.

Sink logit (`sink_logit`, `mha.SinkLogitOptions`): "learned" (a per-head logit, initialised at
0, no weight decay) or "softmax1" (fixed at 0) adds one extra softmax column with a zero value to
every query, dropped after the softmax, in the full forward and the decoding step alike:

    y_i = sum_{i - w < j <= i} v_j e^{s_ij} / (e^{sink_h} + sum_{i - w < j' <= i} e^{s_ij'})

It goes to `core.attend(sink_logit_H=...)` like in `attention`. The virtual column belongs to the
softmax, not to the stream, so the ring's window is unchanged. The mixer takes no `cache`
options (its state is already a ring of the window), hence the sink-logit field alone.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from attn_jax.attention import kv_state
from attn_jax.attention.core import attend, causal_positions
from attn_jax.attention.mha import (QKVProjection, SinkLogitOptions, attention_flops_per_token,
                                    causal_keys, make_sink_logit, qk_probs, sink_logit_of)
from attn_jax.config import ModelConfig
from attn_jax.registry import register_mixer


@register_mixer("sliding_window")
class SlidingWindowAttention(nnx.Module):

  @dataclasses.dataclass(frozen=True)
  class Options(SinkLogitOptions):
    window: int = 256   # tokens each query sees, itself included

    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      self.validate_sink_logit(where)
      w = self.window
      if not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
        raise ValueError(f"{where}.window: must be an integer >= 1, got {w!r}")

  def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def __call__(self, x_BTD, *, positions_BT, state=None, rng=None, train=False):
    del rng, train
    cfg, w = self.cfg, self.opts.window
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = self.proj.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    scale = cfg.head_dim ** -0.5
    sink = sink_logit_of(self.opts, self.sink_logit, cfg.n_heads)
    if state is None:
      out = attend(q, k, v, scale=scale, causal=True, q_positions=pos_BT, kv_positions=pos_BT,
                   window=w, sink_logit_H=sink, impl=cfg.attention_impl)
      return self.proj.o(out), None, {}
    keys = kv_state.with_new(state, {"k": k, "v": v}, pos_BT)
    out = attend(q, keys["k"].astype(q.dtype), keys["v"].astype(q.dtype), scale=scale,
                 causal=True, q_positions=pos_BT, kv_positions=keys["pos"], window=w,
                 sink_logit_H=sink, impl=cfg.attention_impl)
    state = kv_state.write(state, {"k": k, "v": v}, pos_BT, ring=True)
    return self.proj.o(out), state, {}

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward (last column: the sink); diagnostics."""
    return qk_probs(self, x_BTD, self.opts.window)

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts, batch: int, capacity: int, dtype) -> dict:
    del capacity  # the ring holds exactly the window, whatever the stream length
    return kv_state.init_kv_state(batch, opts.window, cfg.kv_heads, cfg.head_dim, cfg.head_dim,
                                  dtype)

  @classmethod
  def max_chunk(cls, cfg: ModelConfig, opts, capacity: int) -> int:
    return opts.window

  @classmethod
  def stream_limit(cls, cfg: ModelConfig, opts, capacity: int) -> None:
    return None

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                     causal_keys(seq_len, opts.window))
