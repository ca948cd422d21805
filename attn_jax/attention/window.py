"""Sliding-window causal attention: each token attends to itself and the `window - 1` tokens
before it (Longformer/Mistral-style local attention), with a ring-buffer decoding state.

    y_i = sum_{i - w < j <= i} softmax_j(q_i . k_j / sqrt(d_h)) v_j

The state is a `cache.KVCache` under `Ring(window)` (its own policy, whatever policy the
decode asks for: a window is this mixer's function), so a stream of any length decodes in
constant memory with one compiled step. A chunk of up to `window` new tokens attends to
[ring ; chunk] before it is written, which is why `max_chunk` is the window.
This is the `window` policy of StreamingLLM without the sinks.

Sink logit (`sink_logit`, `projection.SinkLogitOptions`): "learned" (a per-head logit,
initialised at 0, no weight decay) or "softmax1" (fixed at 0) adds one extra softmax column with
a zero value to every query, dropped after the softmax, in the full forward and the decoding
step alike:

    y_i = sum_{i - w < j <= i} v_j e^{s_ij} / (e^{sink_h} + sum_{i - w < j' <= i} e^{s_ij'})

It goes to `entry.attend(sink_logit_H=...)` like in `attention`. The virtual column belongs to the
softmax, not to the stream, so the ring's window is unchanged.

Packed rows (`segment_ids_BT`): the window's mask is intersected with the document mask
(`masks.segment_mask`): a query sees keys j with p_i - p_j < w *and* in its own document (or
the shared prefix of sink tokens, at positions 0..n-1 before every document's, so a document
reads them exactly as alone). Positions restart per document, so the window counts tokens of
the document only: exactly the document alone. The sink logit stays one column per query.
The full forward passes `prefix_causal` (queries and keys are one stream), so the blocked CPU
core reads only each query chunk's key prefix.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flax import nnx

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import (QKVProjection, SinkLogitOptions, make_sink_logit,
                                           qk_probs, sink_logit_of)
from attn_jax.field_checks import field_check, is_int
from attn_jax.kernels import entry
from attn_jax.layers import causal_positions
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


@register_mixer("sliding_window")
class SlidingWindowAttention(cache_lib.CachedMixer):

  @dataclasses.dataclass(frozen=True)
  class Options(SinkLogitOptions):
    window: int = 256   # tokens each query sees, itself included

    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      self.validate_sink_logit(where)
      w = self.window
      field_check(where)(is_int(w, 1), "window", f"must be an integer >= 1, got {w!r}")

  reads_shared_prefix = True   # packed rows: a masked key set (mixer.py)

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads)."""
    return dataclasses.replace(cls.Options(), window=4)

  def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    cfg, w, p = self.cfg, self.opts.window, self.proj
    scale = cfg.head_dim ** -0.5
    sink = sink_logit_of(self.opts, self.sink_logit, cfg.n_heads)
    if state is not None:
      out, state = cache_lib.cached_attention(
          state, *p.qkv(x_BTD), positions_BT, theta=cfg.rope_theta,
          scale=scale, sink_logit_H=sink, window=w, impl=cfg.attention_impl)
      return p.o(out), state, {}
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = p.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    mask_pos = positions_BT   # None: one plain stream, so a kernel may take its own window
    out = entry.attend(q, k, v, scale=scale, causal=True, q_positions=mask_pos,
                       kv_positions=mask_pos, window=w, sink_logit_H=sink,
                       impl=cfg.attention_impl, prefix_causal=True,
                       q_segments=segment_ids_BT, kv_segments=segment_ids_BT)
    return p.o(out), None, {}

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward (last column: the sink); diagnostics."""
    return qk_probs(self, x_BTD, self.opts.window)

  follows_policy = False

  @classmethod
  def cache_policy(cls, cfg: ModelConfig, opts, policy) -> cache_lib.CachePolicy:
    del cfg, policy   # the ring of the window, whatever the decode asks for
    return cache_lib.Ring(opts.window)

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return entry.attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                           entry.causal_keys(seq_len, opts.window))
