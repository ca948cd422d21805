"""Causal multi-head (optionally grouped-query) self-attention with RoPE: the baseline mixer.

    q, k, v = x W_q, x W_k, x W_v;  q, k <- RoPE(q, k);  y = softmax(q k^T / sqrt(d_h)) v W_o

Decoding keeps a fixed-size KV cache (keys stored after RoPE, slot s = absolute position s), so
the jitted decode step has one shape for the whole generation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.attention.core import attend
from attn_jax.config import ModelConfig
from attn_jax.layers import Linear, apply_rope, dtype_of, rope_angles
from attn_jax.registry import register_mixer


def kv_cache_init(batch: int, max_len: int, n_kv: int, dk: int, dv: int, dtype) -> dict:
  return {"k": jnp.zeros((batch, max_len, n_kv, dk), dtype),
          "v": jnp.zeros((batch, max_len, n_kv, dv), dtype)}


def kv_cache_update(cache: dict, k_BTKD, v_BTKE, cache_index) -> dict:
  """Write T new entries at slot `cache_index` (slot = absolute position)."""
  idx = (0, cache_index, 0, 0)
  return {"k": jax.lax.dynamic_update_slice(cache["k"], k_BTKD.astype(cache["k"].dtype), idx),
          "v": jax.lax.dynamic_update_slice(cache["v"], v_BTKE.astype(cache["v"].dtype), idx)}


def attend_with_cache(q, k, v, *, scale, positions, cache, cache_index, impl):
  """Full causal attention (cache None) or attention over the updated fixed-size cache."""
  if cache is None:
    return attend(q, k, v, scale=scale, causal=True, impl=impl), None
  cache = kv_cache_update(cache, k, v, cache_index)
  B, S = cache["k"].shape[:2]
  kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  out = attend(q, cache["k"].astype(q.dtype), cache["v"].astype(q.dtype), scale=scale,
               causal=True, q_positions=positions, kv_positions=kv_pos, impl=impl)
  return out, cache


class QKVProjection(nnx.Module):
  """The q/k/v/o projections shared by attention-style mixers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, K, Dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, init_std=cfg.init_std)
    self.q = Linear((D,), (H, Dh), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
    self.k = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    self.v = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    kw["init_std"] = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # scaled residual init
    self.o = Linear((H, Dh), (D,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)


@register_mixer("attention")
class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.proj = QKVProjection(cfg, rngs=rngs)

  def __call__(self, x, *, positions, cache=None, cache_index=None):
    cfg = self.cfg
    q, k, v = self.proj.q(x), self.proj.k(x), self.proj.v(x)
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, cache = attend_with_cache(q, k, v, scale=cfg.head_dim ** -0.5, positions=positions,
                                   cache=cache, cache_index=cache_index, impl=cfg.attention_impl)
    return self.proj.o(out), cache, {}

  @staticmethod
  def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    return kv_cache_init(batch, max_len, cfg.kv_heads, cfg.head_dim, cfg.head_dim, dtype)

  @staticmethod
  def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    # QK^T and PV: 2 matmuls x 2 FLOPs/MAC x d_h x H per (query, key) pair. Causal convention:
    # a query at position i attends to i+1 keys, averaged over the sequence (L+1)/2 keys —
    # only the computed lower triangle is counted, as in the FlashAttention/MaxText convention.
    return 4.0 * cfg.n_heads * cfg.head_dim * (seq_len + 1) / 2.0
