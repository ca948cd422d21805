"""The one attention core every mixer calls, plus its explicit reference.

    out_i = sum_j softmax_j(scale * q_i . k_j + bias_ij  |  mask_ij) v_j

Shapes: q [B, T, H, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] with H = K * G (grouped-query
attention: query head h reads kv head h // G). Q/K may be wider than V (SISA appends its
state channels to Q and K only).

Masking is positional: a key at position p_k is visible to a query at position p_q iff
0 <= p_k <= p_q (causal) — or iff 0 <= p_k (non-causal). Empty cache slots carry position -1.
When neither q nor kv positions are given and the call is causal, the standard lower-triangular
mask is used (the fast `is_causal` path of cuDNN).

Implementations (`impl`):
- "einsum": scores with an fp32-accumulating einsum, fp32 softmax, then an einsum with V.
- "xla" / "cudnn": `jax.nn.dot_product_attention` with that implementation. It requires V as
  wide as Q/K, so a narrower V is zero-padded to Dqk and the output sliced back (exact: the
  padded columns of the output are zero and dropped).
"auto" picks by measurement (`experiments/bench_attention.py`, fwd+bwd, 12 heads x 64): on CPU
(jax 0.10.2, 2 cores) "xla" beat "einsum" 1.21x at L=1024 and 1.29x at L=2048, so CPU and
TPU get "xla"; GPU gets "cudnn" for bf16/fp16 inputs with head dims cuDNN supports, else "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully-masked rows give a uniform (not NaN) softmax


def causal_positions(batch: int, length: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def positional_mask(q_pos_BT: jax.Array, kv_pos_BS: jax.Array, causal: bool,
                    window: int | None = None) -> jax.Array:
  """[B, 1, T, S] boolean: key visible to query. `window`: only keys with q_pos - k_pos <
  window (a sliding window of that many tokens, the query included)."""
  valid = kv_pos_BS[:, None, :] >= 0
  if causal:
    valid = valid & (kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
  if window is not None:
    valid = valid & (q_pos_BT[:, :, None] - kv_pos_BS[:, None, :] < window)
  return valid[:, None, :, :]


def attention_reference(q, k, v, *, scale, causal=True, q_positions=None, kv_positions=None,
                        bias=None, window=None):
  """Explicit O(T*S) attention in fp32 with repeated kv heads: the ground truth for tests."""
  B, T, H, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  g = H // K
  k = jnp.repeat(k.astype(jnp.float32), g, axis=2)
  v = jnp.repeat(v.astype(jnp.float32), g, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * scale
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  if q_positions is None:
    q_positions = causal_positions(B, T) + (S - T)
  if kv_positions is None:
    kv_positions = causal_positions(B, S)
  m = positional_mask(q_positions, kv_positions, causal, window)
  s = jnp.where(m, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(m, p, 0.0)
  return jnp.einsum("bhts,bshd->bthd", p, v)


def _einsum_attention(q, k, v, *, scale, mask, bias):
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  g = H // K
  q5 = q.reshape(B, T, K, g, D)
  s = jnp.einsum("btkgd,bskd->bkgts", q5, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:  # [B|1, H|1, T, S] -> broadcastable to [B, K, g, T, S]
    b = bias.astype(jnp.float32)
    s = s + (b.reshape(b.shape[0], K, g, T, S) if b.shape[1] == H else b[:, :, None])
  if mask is not None:  # [B, 1, T, S]
    s = jnp.where(mask[:, :, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  o = jnp.einsum("bkgts,bske->btkge", p, v, preferred_element_type=jnp.float32)
  return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


@functools.cache
def _platform() -> str:
  return jax.default_backend()


def choose_impl(impl: str, q_dtype, dqk: int) -> str:
  if impl != "auto":
    return impl
  plat = _platform()
  if plat == "gpu" and jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) and dqk <= 256 \
      and dqk % 8 == 0:
    return "cudnn"
  return "xla"


def attend(q, k, v, *, scale: float, causal: bool = True, q_positions=None, kv_positions=None,
           bias=None, impl: str = "auto", window: int | None = None) -> jax.Array:
  """Multi-head attention; see the module docstring. Returns [B, T, H, Dv] in q's dtype."""
  B, T, H, Dqk = q.shape
  S, K, Dv = k.shape[1], k.shape[2], v.shape[-1]
  if k.shape[-1] != Dqk or H % K or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"attention shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
  plain_causal = (causal and q_positions is None and kv_positions is None and T == S
                  and window is None)
  impl = choose_impl(impl, q.dtype, Dqk)
  mask = None
  if not plain_causal and (causal or kv_positions is not None or window is not None):
    if q_positions is None:
      q_positions = causal_positions(B, T) + (S - T)
    if kv_positions is None:
      kv_positions = causal_positions(B, S)
    mask = positional_mask(q_positions, kv_positions, causal, window)

  if impl == "einsum":
    if plain_causal:
      mask = positional_mask(causal_positions(B, T), causal_positions(B, S), True)
    return _einsum_attention(q, k, v, scale=scale, mask=mask, bias=bias)
  if impl not in ("xla", "cudnn"):
    raise ValueError(f"unknown attention impl {impl!r} (auto | einsum | xla | cudnn)")
  if Dv != Dqk:  # dot_product_attention needs V as wide as Q/K: pad with zeros, slice back.
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, Dqk - Dv)))
  out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=scale, is_causal=plain_causal, implementation=impl)
  return out[..., :Dv]
