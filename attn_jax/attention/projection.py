"""What every attention-style mixer shares: the q/k/v/o projections with RoPE, and the
attention-sink logit (docs/papers.md §3.4; `config.model.<mixer>.sink_logit`):

- "none": the plain softmax;
- "learned": a learnable logit per head, an extra softmax column with a zero value that is then
  dropped (gpt-oss "sinks"): p_ij = e^{s_ij} / (e^{sink_h} + sum_j' e^{s_ij'}). Initialised at
  0, no weight decay;
- "softmax1": the same column with the logit fixed at 0 ("Attention is off by one").
All three go to `entry.attend(sink_logit_H=...)`, which every implementation supports natively.

Plus the explicit attention map of a q.k mixer (`qk_probs`, `probs_with_sink`), for
diagnostics.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.kernels.masks import positional_mask
from attn_jax.layers import (Linear, apply_rope, causal_positions, dtype_of, fused_matmul, fused_param,
                            out_major, param, rope_angles)

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

SINK_LOGITS = ("none", "learned", "softmax1")


@dataclasses.dataclass(frozen=True)
class SinkLogitOptions:
  """The sink-logit option of the softmax mixers (module docstring)."""
  sink_logit: str = "none"      # none | learned (per-head logit) | softmax1 (logit fixed at 0)

  def validate_sink_logit(self, where: str) -> None:
    if self.sink_logit not in SINK_LOGITS:
      raise ValueError(f"{where}.sink_logit: {self.sink_logit!r} not in {SINK_LOGITS}")


def make_sink_logit(cfg: ModelConfig, opts: SinkLogitOptions, rngs: nnx.Rngs):
  """The learnable per-head sink logit (None unless sink_logit == "learned")."""
  if opts.sink_logit != "learned":
    return None
  return param(rngs, nnx.initializers.zeros_init(), (cfg.n_heads,), ("heads",),
               dtype_of(cfg.param_dtype), kind="scalar")


def sink_logit_of(opts: SinkLogitOptions, sink_param, n_heads: int):
  """The [H] sink logit handed to `entry.attend` (None for the plain softmax)."""
  if opts.sink_logit == "learned":
    return sink_param[...].astype(jnp.float32)
  if opts.sink_logit == "softmax1":
    return jnp.zeros((n_heads,), jnp.float32)
  return None


def probs_with_sink(scores_BHTS, sink_H):
  """Explicit softmax over [scores ; sink column] ([B, H, T, S + 1], fp32 or wider): what a
  layer's attention map is (`attention_probs`), and the explicit references' softmax. The last
  column is the sink's share (0 without one)."""
  dt = jnp.promote_types(scores_BHTS.dtype, jnp.float32)
  s = scores_BHTS.astype(dt)
  col = jnp.full(s.shape[:3] + (1,), -jnp.inf, dt) if sink_H is None else jnp.broadcast_to(
      sink_H.astype(dt)[None, :, None, None], s.shape[:3] + (1,))
  return jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)


def qk_probs(mixer, x_BTD, window: int | None = None):
  """Attention map of a q.k mixer (RoPE at positions 0..T-1, causal, optional window, its sink
  logit): [B, H, T, T + 1] fp32."""
  cfg = mixer.cfg
  B, T, _ = x_BTD.shape
  pos = causal_positions(B, T)
  q, k, _ = mixer.proj.rotated_qkv(x_BTD, pos, cfg.rope_theta)
  k = jnp.repeat(k, cfg.n_heads // cfg.kv_heads, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
  s = jnp.where(positional_mask(pos, pos, True, window), s * cfg.head_dim ** -0.5, -jnp.inf)
  return probs_with_sink(s, sink_logit_of(mixer.opts, mixer.sink_logit, cfg.n_heads))


class QKVProjection(nnx.Module):
  """The q/k/v/o projections shared by attention-style mixers. `out_major_o`: whether the
  decoding copy stores `o` out-major (`fuse_for_decoding`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, out_major_o: bool = True):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, K, Dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, init_std=cfg.init_std)
    self.q = Linear((D,), (H, Dh), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
    self.k = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    self.v = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    kw["init_std"] = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # scaled residual init
    self.o = Linear((H, Dh), (D,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)
    self.dtype, self.heads, self.out_major_o = dt, (H, K), out_major_o

  def qkv(self, x_BTD):
    """(q [B, T, H, Dh], k [B, T, K, Dh], v [B, T, K, Dh]): three matmuls, or one on the
    decoding copy's fused kernel (`fuse_for_decoding`)."""
    return self.qkv_and_rows(x_BTD)[0]

  def qkv_and_rows(self, x_BTD):
    """((q, k, v) as `qkv`, the decoding copy's fused output [B, T, K, G + 2, Dh] they are
    slices of, or None unfused): a one-token cache step reads that one buffer
    (`cache.cached_attention`'s `qkv_rows`)."""
    if not hasattr(self, "qkv_kernel"):
      return (self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)), None
    H, K = self.heads
    y = fused_matmul(x_BTD, self.qkv_kernel[...], 1, self.dtype)   # [B, T, K, G + 2, Dh]
    lead = y.shape[:-3]
    return (y[..., :-2, :].reshape(lead + (H, y.shape[-1])), y[..., -2, :], y[..., -1, :]), y

  def fuse_for_decoding(self) -> None:
    """Replace `q`, `k`, `v` by one kernel [D, K, G + 2, Dh] (`qkv_kernel`; G = H / K query
    heads per kv head): kv head j's slice holds its G query heads (q head h reads kv head
    h // G), then its key, then its value, so a split of the kv heads over devices keeps
    each slice whole. One matmul reads x once (`Decoder.for_decoding`); every output element
    is the same dot product as before. With `out_major_o`, `o` is stored out-major
    (`layers.out_major`: for one token its reduction takes the attention output's last
    elementwise work in). A module already fused is left as it is."""
    if self.out_major_o:
      self.o = out_major(self.o)
    if not hasattr(self, "q"):
      return
    H, K = self.heads
    wq = self.q.kernel[...]
    lead, (D, _, Dh) = wq.shape[:-3], wq.shape[-3:]
    parts = [wq.reshape(lead + (D, K, H // K, Dh))] + [
        m.kernel[...].reshape(lead + (D, K, 1, Dh)) for m in (self.k, self.v)]
    self.qkv_kernel = fused_param(parts, ("embed", "kv_heads", None, "head_dim"), self.k.kernel)
    del self.q, self.k, self.v

  def rotated_qkv(self, x_BTD, positions_BT, rope_theta: float):
    """q, k after RoPE at `positions` (padding's -1 rotates harmlessly: it is masked), and v."""
    q, k, v = self.qkv(x_BTD)
    return rope(q, positions_BT, rope_theta), rope(k, positions_BT, rope_theta), v


def rope(x_BTHD, positions_BT, theta: float):
  cos, sin = rope_angles(positions_BT, x_BTHD.shape[-1], theta)
  return apply_rope(x_BTHD, cos, sin)
