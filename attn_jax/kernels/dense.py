"""The softmax-attention cores (no decay) and their explicit reference; `entry.attend` chooses
among them and calls them.

    out_i = sum_j p_ij v_j,   p_ij = exp(s_ij) / (sum_{j' visible} exp(s_ij') + exp(sink_h))
    s_ij  = scale * q_i . k_j + bias_ij          (j visible to i; p_ij = 0 otherwise)

Shapes: q [B, T, H, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] with H = K * G (grouped-query
attention: query head h reads kv head h // G). Q/K may be wider than V (SISA appends its
state channels to Q and K only).

Sink logit (`sink_logit_H`, optional, [H]): one extra softmax column per head with logit
sink_h and a zero value, dropped after the softmax (attention sinks, "gpt-oss" style;
softmax1 / "off-by-one" softmax is sink_h = 0). A query may then put weight on "nothing".
Without a sink the term exp(sink_h) is absent.

Masking is positional (masks.py): a key at position p_k is visible to a query at position p_q
iff 0 <= p_k <= p_q (causal) — or iff 0 <= p_k (non-causal). Empty cache slots carry position -1.
When neither q nor kv positions are given and the call is causal, the standard lower-triangular
mask is used.

Documents (packed rows, `q_segments` / `kv_segments`, [B, T] / [B, S] int32): a key is visible
only to queries of its own document, i.e. iff seg_k == seg_q, or seg_k == SHARED_SEGMENT (0):
a shared prefix every document may read (the decoder's learned sink tokens). Documents are
numbered from 1. Segments only ever remove keys, so every implementation below keeps its
structure (the blocked path still skips the upper triangle); the plain-causal fast paths
become masked ones. A query that sees no key (e.g. a padding query at position -1) returns zeros in
every implementation, as the reference does.

Implementations (`impl`):
- "einsum": scores with an fp32-accumulating einsum over the whole [T, S] square, the fp32
  softmax below, then an einsum with V.
- "blocked": the same maths over query chunks of `chunk` rows; for causal self-attention a
  chunk [a, e) reads only its key prefix [0, e) (key j > query i is never visible), so the
  masked upper triangle is never computed: (n+1)/(2n) of the square for n chunks. Only the
  diagonal block carries a mask. Valid for the plain causal call (no positions, T == S), and
  for positional masks when the caller promises `prefix_causal` (queries and keys are the same
  stream: valid positions increase along the sequence, padding is -1). Otherwise it runs one
  chunk over all keys (the einsum path).
- "xla" / "cudnn" (dpa.py, called by `entry.attend`): `jax.nn.dot_product_attention` with that
  implementation, the sink as an extra key slot, V padded to Q/K's width.
- "splash" (TPU; splash.py, called by `entry.attend`): the Pallas splash-attention kernel
  shipped with JAX (MQA form
  vmapped over batch and kv heads, block-sparse causal mask, native per-head sinks, V narrower
  than Q/K as it is, documents and padding as the kernel's segment ids, and a `shard_map` over
  the batch / head axes of the mesh the program is traced for, so it runs on any slice). Used
  for causal self-attention of one stream (the plain call, or positions / segments with
  `prefix_causal`) with no bias, no window, T a multiple of 128 and no shared prefix among the
  keys (`shared_prefix=False` with segments); anything else falls back to "xla"
  (`splash.splash_problem` names why). Off TPU the same kernel runs in the Pallas interpreter
  (tests).

The softmax of the einsum / blocked paths (`_softmax`) is fp32 with a hand-written backward,
ds = p * (g - sum_j g_j p_j) (the sink column's output is dropped, so its cotangent is 0), and
d sink = -sum_i p_sink,i * sum_j g_ij p_ij; the row maximum is floored at NEG_INF / 2 so a
fully-masked row gives exp(NEG_INF / 2) = 0 for every entry and a zero output.

Segments by implementation: "einsum" / "blocked" / "xla" / "cudnn" take them through the
boolean mask (`positional_mask`); the blocked path keeps skipping the upper triangle when the
caller promises `prefix_causal` (every mixer's full forward does), but a block masked only by
segments is still computed (which blocks are empty depends on the traced ids). cuDNN: through
`jax.nn.dot_product_attention(mask=)`, its API having no segment ids (a mask costs a [T, S]
bias on that path). TPU "splash": the kernel's own `SegmentIds` (splash.py), which express
"same document" and padding exactly but not "or segment 0" (an equality of labels, ANDed with
the kernel's mask): a call that may hold a shared prefix (`shared_prefix`, default True: the
decoder's sink tokens with packed rows) falls back to "xla"; a caller that knows its row has
none (no sink tokens) passes `shared_prefix=False`. A fully masked query row returns zeros on
every path.

"auto" resolves by platform in `kernel_choice.attention_impl` (from
`experiments/bench_attention.py`, fwd + bwd; entry.py's docstring lists the choices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_jax.kernels.masks import NEG_INF, positional_mask
from attn_jax.layers import causal_positions

DEFAULT_CHUNK = 256  # query rows per block of the "blocked" path

def attention_reference(q, k, v, *, scale, causal=True, q_positions=None, kv_positions=None,
                        bias=None, sink_logit_H=None, window=None, q_segments=None,
                        kv_segments=None):
  """Explicit O(T*S) attention in fp32 with repeated kv heads: the ground truth for tests.

  The sink is an explicit extra softmax column (logit sink_h, value 0) that is then dropped;
  a query with no visible key (and no sink) gets zeros."""
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
  m = positional_mask(q_positions, kv_positions, causal, window, q_segments, kv_segments)
  s = jnp.where(m, s, -jnp.inf)
  if sink_logit_H is not None:
    col = jnp.broadcast_to(sink_logit_H.astype(jnp.float32)[None, :, None, None], (B, H, T, 1))
    s = jnp.concatenate([s, col], axis=-1)
    m = jnp.concatenate([m, jnp.ones((B, 1, T, 1), bool)], axis=-1)
  any_visible = jnp.any(m, axis=-1, keepdims=True)
  p = jax.nn.softmax(jnp.where(any_visible, s, 0.0), axis=-1)
  p = jnp.where(m, p, 0.0)[..., :S]
  return jnp.einsum("bhts,bshd->bthd", p, v)


# ------------------------------------------------------------------ softmax with sink + guard

@jax.custom_vjp
def _softmax(s, sink):
  """fp32 softmax over the last axis with an optional extra sink column (dropped).

  s [..., c, S] already masked with NEG_INF; sink broadcastable to [..., c, 1] or None."""
  return _softmax_fwd(s, sink)[0]


def _softmax_fwd(s, sink):
  m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), NEG_INF / 2)
  if sink is not None:
    m = jnp.maximum(m, sink)
  e = jnp.exp(s - m)
  z = jnp.sum(e, axis=-1, keepdims=True)
  p_sink = None
  if sink is not None:
    e_sink = jnp.exp(sink - m)
    z = z + e_sink
  inv = jnp.where(z > 0, 1.0 / jnp.where(z > 0, z, 1.0), 0.0)
  p = e * inv
  if sink is not None:
    p_sink = e_sink * inv
  return p, (p, p_sink, sink)


def _softmax_bwd(res, g):
  p, p_sink, sink = res
  t = jnp.sum(g * p, axis=-1, keepdims=True)
  ds = p * (g - t)
  if p_sink is None:
    return ds, None
  d = -t * p_sink  # [..., c, 1]: d L / d sink per row; sum over what the sink broadcast over
  d = jnp.sum(d, axis=tuple(range(d.ndim - sink.ndim)))
  axes = tuple(i for i, n in enumerate(sink.shape) if n == 1 and d.shape[i] != 1)
  return ds, jnp.sum(d, axis=axes, keepdims=True).astype(sink.dtype)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


# ------------------------------------------------------------------ einsum / blocked paths

def _rows(x, G):
  """[..., c, S] (shared by the G query heads of a kv head) -> [..., G*c, S] row layout."""
  return x if G == 1 or x.shape[-2] == 1 else jnp.concatenate([x] * G, axis=-2)


def _chunk(q_BKMD, k_BKSD, v_BKSE, *, scale, mask, bias, sink_logit_H, c, v_dtype):
  """One block of M = G*c query rows against S keys: [B, K, M, E] fp32 output (fp64 for float64).
  `mask`, `bias`: the chunk's, in query layout ([B|1, 1, c, S], [B|1, H|1, c|1, S]).

  Everything is 4-D, [B, K, G*c, .] (the G query heads of a kv head times c rows form one
  matrix dimension): the two matmuls are plain batched matmuls for XLA."""
  f = jnp.promote_types(q_BKMD.dtype, jnp.float32)   # fp32 (fp64 for float64 inputs)
  s = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=f)
  p = rows_softmax(s * scale, mask=mask, bias=bias, sink_logit_H=sink_logit_H, T=c)
  return jnp.einsum("bkms,bkse->bkme", p.astype(v_dtype), v_BKSE, preferred_element_type=f)


def blocked_attention(q, k, v, *, scale: float, mask_fn=None, bias_fn=None, sink_logit_H=None,
                      chunk: int = DEFAULT_CHUNK, prefix: bool = False):
  """The "blocked" path with the bias and mask given per query chunk: [B, T, H, E] in q's dtype.

  Query chunks of `chunk` rows; with `prefix` (q and k one causal stream), chunk [a, e) reads
  keys [0, e) only, skipping the upper triangle. mask_fn(a, e, s_end) -> bool mask
  broadcastable to [B, 1, e - a, s_end] or None; bias_fn(a, e, s_end) -> fp32 bias
  broadcastable to [B, H, e - a, s_end] or None. A caller whose bias has structure (a rank-1
  decay, fox.py) forms each chunk's bias from O(T) vectors and never holds a [T, T] one; the
  chunk's probabilities are the backward's residual (O(T^2 / 2) over the chunks, as for any
  blocked attention)."""
  B, T, H, D = q.shape
  S, K, E = k.shape[1], k.shape[2], v.shape[-1]
  G = H // K
  q5 = q.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
  kt = k.transpose(0, 2, 1, 3)                            # [B, K, S, D]
  vt = v.transpose(0, 2, 1, 3)                            # [B, K, S, E]
  outs = []
  for a in range(0, T, chunk):   # scores, bias, sink: fp32 (fp64 for float64; `_chunk`)
    e = min(a + chunk, T)
    c, s_end = e - a, (e if prefix else S)
    qc = q5[:, :, :, a:e].reshape(B, K, G * c, D)
    mask = None if mask_fn is None else mask_fn(a, e, s_end)
    bc = None if bias_fn is None else bias_fn(a, e, s_end)
    o = _chunk(qc, kt[:, :, :s_end], vt[:, :, :s_end], scale=scale, mask=mask, bias=bc,
               sink_logit_H=sink_logit_H, c=c, v_dtype=v.dtype)
    outs.append(o.reshape(B, K, G, c, E))
  o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(q.dtype)


def to_rows(x_BTHE: jax.Array, K: int) -> jax.Array:
  """[B, T, H, E] -> the row layout [B, K, G*T, E] of `_chunk` (row g*T + t: query t of head
  k*G + g), so a kv head's G query heads form one matrix with its keys."""
  B, T, H, E = x_BTHE.shape
  return x_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4).reshape(B, K, -1, E)


def from_rows(o_BKME: jax.Array, T: int) -> jax.Array:
  """The inverse of `to_rows`: [B, K, G*T, E] -> [B, T, H, E]."""
  B, K, M, E = o_BKME.shape
  return o_BKME.reshape(B, K, M // T, T, E).transpose(0, 3, 1, 2, 4).reshape(B, T, -1, E)


def rows_softmax(s_BKMS, *, mask=None, bias=None, sink_logit_H=None, T: int):
  """Probabilities of fp32 scores in the row layout (`to_rows`, T queries per head): `mask`
  [B|1, 1, T, S] boolean, `bias` [B|1, H|1, T|1, S] added first, the sink column as everywhere
  in this module (`_softmax`). The blocked path (`_chunk`) and the KV cache's core
  (`cache.attend_cache`) both end here."""
  B, K, M, S = s_BKMS.shape
  G = M // T
  if bias is not None:
    s_BKMS = s_BKMS + _bias_rows(jnp.asarray(bias, s_BKMS.dtype), K, G, T)
  if mask is not None:
    s_BKMS = jnp.where(_rows(mask, G), s_BKMS, NEG_INF)
  sink = None
  if sink_logit_H is not None:
    sink = jnp.broadcast_to(sink_logit_H.astype(s_BKMS.dtype).reshape(K, G, 1, 1), (K, G, T, 1))
    sink = sink.reshape(K, M, 1)
  return _softmax(s_BKMS, sink)


def _bias_rows(b, K, G, c):
  """A chunk's bias [B|1, H|1, c|1, S] in the [B|1, K|1, G*c|1, S] row layout of `_chunk`."""
  if b.shape[1] == 1:   # one bias for every head: the G heads' rows repeat it
    return _rows(b, G)
  b5 = b.reshape(b.shape[0], K, G, b.shape[-2], b.shape[-1])
  b5 = jnp.broadcast_to(b5, b5.shape[:3] + (c,) + b5.shape[4:])
  return b5.reshape(b5.shape[0], K, G * c, b5.shape[4])
