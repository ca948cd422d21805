"""The pure-XLA paths of state-decayed attention (SISA), exact at any decay range.

    s_ij = scale q_i.k_j + lambda e^{g_i - g_j} (R(Phi_i) C_i) . (R(Phi_j) B_j)   (j <= i)

(attention/sisa.py: the features; docs/sisa.md: the derivations.) With a reference r the added
term is a dot product of widened rows, Q^ = [q ; lambda sqrt(d_h) e^{g_i - r} R C_i] and
K^ = [k ; e^{r - g_j} R B_j] at scale 1/sqrt(d_h), so it runs on any softmax-attention core;
every exponential evaluated is <= 1 or <= e^T for a fixed T, and no reference reads a later
token:

- fast (`entry.attend_decayed`, path "fast"): r = 0, one softmax-attention call; query factors
  e^{g_i} <= 1, key factors e^{-g_j} <= e^T, valid while the decay range -g_{T-1} <= T (the
  mixer's `fast_max_range`).
- chunked (`chunked`): blocks of c tokens; a query block and an earlier key block take r = g at
  the key block's last token, so both factors are <= 1; a block's own pairs enter as a [c, c]
  bias lambda e^{g_i - g_j} C.B formed from the difference g_i - g_j <= 0 (`local_bias`,
  Mamba-2's segsum); the parts are combined by log-sum-exp (`lse_merge.combine`), the past
  through `blockwise.past_blocks` (O(T) memory, `blockwise_path`), or, with a fused cuDNN
  core, query chunks whose past goes through that kernel (`fused_chunks`).

Packed rows (`Operands.seg`): pairs of other documents are masked on every path, and a
chunked reference that lies in another document is clamped to a factor <= 1 (`_nonpositive`,
a no-op on visible pairs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn_jax import kernel_choice
from attn_jax.kernels import blockwise, lse_merge
from attn_jax.kernels.masks import segment_mask

PATHS = ("auto", "fast", "chunked")   # `entry.attend_decayed`: auto chooses by the decay range


class Operands(NamedTuple):
  """What every path reads: the features after the cumulative sums, C and B rotated
  (`sisa.SISA._operands`). A full forward's g is measured from the empty prefix; a cached
  call's from the last cached token (`sisa.SISA._cached`)."""
  q: jax.Array          # [B, T, H, d_h]: after RoPE (before it for a cached call)
  k: jax.Array          # [B, T, K, d_h]: likewise
  v: jax.Array          # [B, T, K, d_h]
  rc: jax.Array         # [B, T, H, d_s]: R(Phi_i) C_i (C itself without phase), stat dtype
  rb: jax.Array         # [B, T, H, d_s]: R(Phi_j) B_j
  g: jax.Array          # [B, T, H]: cumulative log-decay from the reference
  lam: jax.Array        # [H]: lambda
  qscale: jax.Array     # [H]: lambda sqrt(d_h), the query side's scale s^2
  sink: jax.Array | None = None   # [H]: the sink logit (None: no sink column)
  seg: jax.Array | None = None    # [B, T]: document ids of a packed row (None: one stream)


def local_bias(rc_BTHS, rb_BSHS, g_q_BTH, g_k_BSH, lam_H, causal_TS):
  """lambda e^{g_i - g_j} (R C_i).(R B_j) for an in-chunk block, [B, H, T, S] fp32.

  e^{g_i - g_j} is formed from the difference (<= 0 where causal), never from large factors.
  """
  match = jnp.einsum("bths,bjhs->bhtj", rc_BTHS, rb_BSHS, preferred_element_type=g_q_BTH.dtype)
  dg = g_q_BTH.transpose(0, 2, 1)[..., :, None] - g_k_BSH.transpose(0, 2, 1)[..., None, :]
  dec = jnp.exp(jnp.where(causal_TS, dg, -jnp.inf))
  return lam_H[None, :, None, None] * dec * match


def _nonpositive(x):
  """x where x <= 0, else 0: a decay exponent that is <= 0 on every visible pair; in a packed
  row g restarts at a document start, so a masked pair's exponent may be > 0, and this keeps its
  factor <= 1 (no inf, hence no NaN in the masked pair's zero-cotangent backward). A select,
  not a clamp: the gradient passes unchanged wherever x <= 0."""
  return jnp.where(x <= 0, x, jnp.zeros_like(x))


def _pad_operands(ops, pad: int):
  """`Operands` with `pad` tokens appended: zeros, g repeated (no decay), and a document
  id of their own (-1) in a packed row."""
  zpad = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
  seg = None if ops.seg is None else jnp.pad(ops.seg, ((0, 0), (0, pad)), constant_values=-1)
  return ops._replace(q=zpad(ops.q), k=zpad(ops.k), v=zpad(ops.v), rc=zpad(ops.rc),
                      rb=zpad(ops.rb), g=jnp.pad(ops.g, ((0, 0), (0, pad), (0, 0)), mode="edge"),
                      seg=seg)


def widen(x_BTHD, f_BTH, r_BTHS):
  """[x ; f r]: q or k widened by its scaled SISA factor (C or B, rotated), in x's dtype."""
  return jnp.concatenate([x_BTHD, (f_BTH[..., None] * r_BTHS).astype(x_BTHD.dtype)], axis=-1)


def _past_scores(scale, shared, qa, ka):
  """Score of a (query block, earlier key block) pair for `blockwise.past_blocks`: the widened
  q.k with reference r = g at the key block's last token, so query factors e^{g_i - r} <= 1
  (i after the block) and key factors e^{r - g_j} <= 1 (j in the block). [B, H, c, c] in fp32
  (fp64 for a float64 model)."""
  (qscale,) = shared
  q, rc, g_q = qa
  k, rb, g_k = ka
  dt = q.dtype
  r = g_k[:, -1]                                                       # [B, H]
  qf = jnp.exp(_nonpositive(g_q - r[:, None])) * qscale
  kf = jnp.exp(_nonpositive(r[:, None] - g_k))
  qh, kh = widen(q, qf, rc), widen(k, kf, rb)
  f = jnp.promote_types(dt, jnp.float32)
  return jnp.einsum("bthd,bshd->bhts", qh, kh, preferred_element_type=f) * scale


def block_len(chunk_size: int, seq_len: int) -> int:
  """Block of the blockwise chunked path: `chunk_size`, or auto (0) = 256 (fixed, so memory
  grows linearly with T), at most T rounded up to a multiple of 8."""
  c = int(chunk_size) if int(chunk_size) > 0 else 256
  return min(c, -(-seq_len // 8) * 8)


def chunk_len(chunk_size: int, seq_len: int) -> int:
  """Query chunk of the fused-kernel chunked path: `chunk_size`, or auto (0) = max(128, T/8)
  rounded up to 64 (at most 8 unrolled chunks; each reads only its key prefix)."""
  c = int(chunk_size)
  if c <= 0:
    c = max(128, -(-seq_len // 8))
    c = -(-c // 64) * 64
  return min(c, seq_len)


def core_impl(ops: Operands, impl: str) -> str:
  """The softmax-attention core a call of the widened Q/K (d_h + d_s channels) runs on."""
  return kernel_choice.attention_impl(impl, ops.q.dtype, ops.q.shape[-1] + ops.rc.shape[-1])


def chunked(ops: Operands, *, scale: float, impl: str, chunk_size: int = 0):
  """The exact path for any decay range: block pairs in O(T) memory (`blockwise_path`), or with
  a fused cuDNN core, query chunks whose past goes through that kernel (`fused_chunks`)."""
  run = fused_chunks if core_impl(ops, impl) == "cudnn" else blockwise_path
  return run(ops, scale=scale, impl=impl, chunk_size=chunk_size)


def blockwise_path(ops: Operands, *, scale: float, impl: str, chunk_size: int = 0):
  """Blocks of c tokens (T padded up to a multiple: padded keys sit in the last block, which
  no query's past contains; padded queries are dropped). Diagonal blocks: all n at once as a
  batch of [c, c] biased, masked blocks. Past blocks: `blockwise.past_blocks` with the pair's
  reference r = g at the key block's last token. Combined by log-sum-exp."""
  del impl
  dt = ops.q.dtype
  B, T, H, _ = ops.q.shape
  c = block_len(chunk_size, T)
  pad = -T % c
  if pad:
    ops = _pad_operands(ops, pad)
  q, k, v, rc, rb, g, seg = ops.q, ops.k, ops.v, ops.rc, ops.rb, ops.g, ops.seg
  n = (T + pad) // c
  fold = lambda x: x.reshape((B * n, c) + x.shape[2:])
  unfold = lambda x: x.reshape((B, n * c) + x.shape[2:])
  causal = jnp.tril(jnp.ones((c, c), bool))
  if seg is not None:
    causal = causal & segment_mask(fold(seg), fold(seg))[:, None]
  loc = local_bias(fold(rc), fold(rb), fold(g), fold(g), ops.lam, causal)
  diag = lse_merge.partial_attention(fold(q), fold(k), fold(v), scale=scale, bias=loc, mask=causal)
  past = blockwise.past_blocks(functools.partial(_past_scores, scale), (ops.qscale,), (q, rc, g),
                               (k, rb, g), v, block=c, segment_ids_BT=seg)
  out = lse_merge.combine([tuple(map(unfold, diag)), past], ops.sink)
  return out[:, :T].astype(dt)


def fused_chunks(ops: Operands, *, scale: float, impl: str, chunk_size: int = 0):
  """Query chunks with reference g_{a-1}, run one after another and rematerialised
  (`lse_merge.sequential`): the residuals are the full inputs; each chunk's past keys go through
  one call of the fused kernel (O(T) memory on GPU)."""
  T = ops.q.shape[1]
  c = chunk_len(chunk_size, T)
  fns = [functools.partial(_chunk, a, min(a + c, T), scale=float(scale), impl=impl)
         for a in range(0, T, c)]
  outs = lse_merge.sequential(fns, (ops,))
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  return out.astype(ops.q.dtype)


def _chunk(a: int, e: int, ops: Operands, *, scale: float, impl: str):
  """Queries [a, e): past keys [0, a) through one unbiased, unmasked call (the widened Q/K,
  key factors e^{r - g_j} <= 1), the chunk's own keys through a small block with the
  difference-form SISA bias; the two parts combined by log-sum-exp (`lse_merge.combine`).
  Packed rows: both parts masked by document (the past then takes the masked einsum route),
  the factors' exponents clamped at 0 (a no-op on every visible pair, module docstring)."""
  dt = ops.q.dtype
  q, k, v, rc, rb, g, seg = ops.q, ops.k, ops.v, ops.rc, ops.rb, ops.g, ops.seg
  r = g[:, a - 1] if a > 0 else jnp.zeros_like(g[:, 0])              # [B, H]
  causal = jnp.arange(a, e)[:, None] >= jnp.arange(a, e)[None, :]
  past_mask = None
  if seg is not None:
    causal = causal & segment_mask(seg[:, a:e], seg[:, a:e])[:, None]
    past_mask = segment_mask(seg[:, a:e], seg[:, :a])[:, None]
  loc = local_bias(rc[:, a:e], rb[:, a:e], g[:, a:e], g[:, a:e], ops.lam, causal)
  parts = [lse_merge.partial_attention(q[:, a:e], k[:, a:e], v[:, a:e], scale=scale,
                                       bias=loc, mask=causal)]
  if a > 0:
    qf = jnp.exp(_nonpositive(g[:, a:e] - r[:, None])) * ops.qscale   # <= qscale
    qh = widen(q[:, a:e], qf, rc[:, a:e])
    kf = jnp.exp(_nonpositive(r[:, None] - g[:, :a]))                 # <= 1
    kh = widen(k[:, :a], kf, rb[:, :a])
    impl = kernel_choice.attention_impl(impl, dt, qh.shape[-1])
    parts.append(lse_merge.partial_attention(qh, kh, v[:, :a], scale=scale, impl=impl,
                                             mask=past_mask))
  return lse_merge.combine(parts, ops.sink)
