"""Causal multi-head (optionally grouped-query) self-attention with RoPE: the baseline mixer.

    q, k, v = x W_q, x W_k, x W_v;  q, k <- RoPE(q, k);  y = softmax(q k^T / sqrt(d_h)) v W_o

Decoding state: a linear KV buffer (`kv_state`, keys stored after RoPE at their absolute
positions; capacity = the longest stream). New tokens attend to the buffer and to themselves,
masked by positions, so prompts of different lengths share a batch.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from attn_jax.attention import kv_state
from attn_jax.attention.core import attend, causal_positions
from attn_jax.config import ModelConfig
from attn_jax.layers import Linear, apply_rope, dtype_of, rope_angles
from attn_jax.registry import register_mixer


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

  def rotated_qkv(self, x_BTD, positions_BT, rope_theta: float):
    """q, k after RoPE at `positions` (padding's -1 rotates harmlessly: it is masked), and v."""
    q, k, v = self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)
    cos, sin = rope_angles(positions_BT, q.shape[-1], rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_flops_per_token(n_heads: int, d_qk: int, d_v: int, keys: float) -> float:
  """Scores (d_qk) and values (d_v) per query against `keys` keys: 2 FLOPs per MAC."""
  return 2.0 * n_heads * (d_qk + d_v) * keys


def causal_keys(seq_len: int, window: int | None = None) -> float:
  """Mean keys per query of a causal (optionally windowed) sequence of `seq_len` tokens: the
  lower triangle only ((L+1)/2 without a window), as in the FlashAttention/MaxText convention."""
  L = seq_len
  if window is None or window >= L:
    return (L + 1) / 2.0
  w = window  # the first w queries see 1..w keys, the rest w each
  return (w * (w + 1) / 2.0 + (L - w) * w) / L


@register_mixer("attention")
class Attention(nnx.Module):

  @dataclasses.dataclass(frozen=True)
  class Options:
    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg, where

  def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)

  def __call__(self, x_BTD, *, positions_BT, state=None, rng=None, train=False):
    del rng, train
    cfg = self.cfg
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = self.proj.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    scale = cfg.head_dim ** -0.5
    if state is None:  # positions None: plain 0..T-1, the kernels' fast causal path
      out = attend(q, k, v, scale=scale, causal=True, q_positions=positions_BT,
                   kv_positions=positions_BT, impl=cfg.attention_impl)
      return self.proj.o(out), None, {}
    keys = kv_state.with_new(state, {"k": k, "v": v}, positions_BT)
    out = attend(q, keys["k"].astype(q.dtype), keys["v"].astype(q.dtype), scale=scale,
                 causal=True, q_positions=positions_BT, kv_positions=keys["pos"],
                 impl=cfg.attention_impl)
    state = kv_state.write(state, {"k": k, "v": v}, positions_BT, ring=False)
    return self.proj.o(out), state, {}

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts, batch: int, capacity: int, dtype) -> dict:
    return kv_state.init_kv_state(batch, capacity, cfg.kv_heads, cfg.head_dim, cfg.head_dim,
                                  dtype)

  @classmethod
  def stream_limit(cls, cfg: ModelConfig, opts, capacity: int) -> int | None:
    return capacity   # a linear buffer holds `capacity` tokens of a stream

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                     causal_keys(seq_len))

