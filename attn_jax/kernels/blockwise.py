"""Attention of every query block over the key blocks before it, in O(T) memory: the
FlashAttention-2 loops (online softmax forward, recomputing backward) written with
`jax.lax.fori_loop`, for a score given as a function of one (query block, key block) pair.

With T = n c tokens cut into blocks of c, query block I attends to the keys of blocks J < I
(the *past* part of a causal attention whose diagonal blocks a caller handles itself, e.g. with
a bias; `lse_merge.combine` joins the parts). For a pair, `score_fn(shared, qa_I, ka_J)` returns
s [B, H, c, c] fp32 (the scale included); then

    forward   m, l, acc <- online softmax over J < I:  m' = max(m, max_j s),
              l' = l e^{m - m'} + sum_j e^{s - m'},  acc' = acc e^{m - m'} + e^{s - m'} V_J
              out_I = acc / l,  lse_I = m + log l          (block 0: no key, lse = NEG_INF, out 0)
    backward  p = e^{s - lse_I}  (recomputed),  D_I = rowsum(dout_I * out_I)
              dV_J += p^T dout_I,   dp = dout_I V_J^T,   ds = p (dp - D_I + dlse_I)
              (d shared, d qa_I, d ka_J) += VJP of score_fn at (shared, qa_I, ka_J) applied to ds

The lse cotangent enters ds because d lse_i / d s_ij = p_ij: the callers combine parts by
log-sum-exp, so lse is an output with a gradient. The residuals are the inputs, out and lse
(O(T)); temporaries are one pair's [B, H, c, c] scores, so memory grows linearly with T at a
fixed block. The loops run exactly the n (n - 1) / 2 causal pairs (trip counts depend on the
loop index: `fori_loop` becomes a while loop, which needs no reverse-mode rule here because the
VJP is written out). The score function is differentiated by `jax.vjp` inside the backward, so
any differentiable score works — SISA's widened Q/K with a per-pair reference (sisa_xla.py), or
the plain scaled dot product (`dot_scores`).

GQA: V has K <= H heads; query head h reads value head h // (H / K).

Block-pair term (`block_bias_BHNN`, [B, H, n, n]): an optional constant per head and (query
block I, key block J), added to every score of that pair after the score function (FoX's decay
between the two blocks, forget_xla.py). Its gradient is the sum of the pair's ds, written once per
pair into the [B, H, n, n] cotangent (each pair is visited once). It is n^2 per head, not
O(T): smaller than one [T, d_h] head while T < c^2 d_h.

Packed rows (`segment_ids_BT`, [B, T] int32, `masks.segment_mask`): a pair (i, j) is visible
iff key j is in query i's document (or the shared prefix, segment 0). Invisible pairs get
p_ij = 0 exactly, in the forward (the online softmax's e^{s - m'} is replaced by 0, so a block
of another document adds nothing even while m is still NEG_INF) and in the backward
(p = e^{s - lse} is recomputed as 0 there, so ds = 0 and the score function's VJP sees a zero
cotangent). A query with no visible past key (the first block of a document, or any query of
a document that starts inside its block) keeps l = 0: out = 0 and lse = NEG_INF, weight 0 in
`lse_merge.combine`. The score function is still evaluated on invisible pairs, so it must be finite
there (the callers' are: every factor is bounded whatever the pair, forget_xla.py / sisa_xla.py); a
finite score with a zero cotangent contributes exactly 0 to every gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from attn_jax.kernels.masks import NEG_INF, segment_mask

ScoreFn = Callable[[Any, Any, Any], jax.Array]


def dot_scores(scale: float) -> ScoreFn:
  """score_fn of plain attention: scale q_I k_J^T with qa = q [B, c, H, D], ka = k (H heads)."""
  return functools.partial(_dot_scores, float(scale))


def _dot_scores(scale, shared, q, k):
  del shared
  return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=_acc(q.dtype)) * scale


def _acc(dtype):
  """Gradient accumulation dtype: fp32 (fp64 for float64 inputs)."""
  return jnp.promote_types(dtype, jnp.float32)


def _block(tree, i, c):
  """The i-th block of c along axis 1 of every leaf (i may be traced)."""
  return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1), tree)


def _add_block(tree, upd, i, c):
  """tree with upd added to its i-th block along axis 1."""
  def add(x, u):
    cur = jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(x, cur + u.astype(x.dtype), i * c, axis=1)
  return jax.tree.map(add, tree, upd)


def _grouped(p_BHTS, n_kv):
  B, H, T, S = p_BHTS.shape
  return p_BHTS.reshape(B, n_kv, H // n_kv, T, S)


def _pv(p_BHTS, v_BSKE):
  """sum_s p v: [B, T, H, E] in p's dtype."""
  B, H, T, _ = p_BHTS.shape
  o = jnp.einsum("bkgts,bske->btkge", _grouped(p_BHTS, v_BSKE.shape[2]),
                 v_BSKE.astype(p_BHTS.dtype))
  return o.reshape(B, T, H, -1)


def _check(qa, ka, v, block) -> None:
  """Every array has the same length on axis 1, a multiple of the block."""
  T = jax.tree.leaves(qa)[0].shape[1]
  for x in jax.tree.leaves(qa) + jax.tree.leaves(ka) + [v]:
    if x.shape[1] != T:
      raise ValueError(f"flash: every query/key array needs the same length {T} on axis 1, "
                       f"got {x.shape}")
  if block < 1 or T % block:
    raise ValueError(f"flash: sequence length {T} is not a multiple of the block {block}")


def past_blocks(score_fn: ScoreFn, shared, qa, ka, v_BSKE, *, block: int,
                segment_ids_BT=None, block_bias_BHNN=None):
  """(out [B, T, H, E], lse [B, T, H]) in fp32 (fp64 for float64 v): query block I over the
  keys of blocks J < I.

  score_fn(shared, qa_I, ka_J) -> [B, H, c, c] scores (fp32, or fp64); qa / ka: pytrees of
  [B, T, ...] arrays cut along axis 1; shared: a pytree passed whole (e.g. a learned scale).
  `segment_ids_BT`: document ids of a packed row (queries and keys are one stream; module
  docstring), or None. `block_bias_BHNN`: the block-pair term (module docstring), or None.
  Differentiable in shared, qa, ka, v and the block-pair term (custom VJP, module docstring);
  score_fn must be hashable."""
  _check(qa, ka, v_BSKE, block)
  if segment_ids_BT is not None and segment_ids_BT.shape != v_BSKE.shape[:2]:
    raise ValueError(f"flash: segment ids {segment_ids_BT.shape} do not match the sequence "
                     f"{v_BSKE.shape[:2]}")
  bb = block_bias_BHNN
  if bb is not None:
    n = v_BSKE.shape[1] // block
    s0 = jax.eval_shape(lambda: score_fn(shared, _block(qa, 0, block), _block(ka, 0, block)))
    want = (*s0.shape[:2], n, n)                             # [B, H] of the scores, N x N blocks
    if bb.shape != want:
      raise ValueError(f"flash: the block-pair term needs shape [B, H, N, N] = {want}, "
                       f"got {bb.shape}")
  return _past(score_fn, block, shared, qa, ka, v_BSKE, bb, segment_ids_BT)


def _visible(seg, i, j, c):
  """[B, 1, c, c] bool: pair (query of block i, key of block j) visible; None without segments."""
  if seg is None:
    return None
  return segment_mask(_block(seg, i, c), _block(seg, j, c))[:, None]


def _pair_term(bb, i, j):
  """[B, H, 1, 1]: the block-pair term of (query block i, key block j)."""
  B, H = bb.shape[:2]
  return jax.lax.dynamic_slice(bb, (0, 0, i, j), (B, H, 1, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _past(score_fn, block, shared, qa, ka, v, bb, seg):
  return _past_fwd(score_fn, block, shared, qa, ka, v, bb, seg)[0]


def _past_fwd(score_fn, c, shared, qa, ka, v, bb, seg):
  B, T, K, E = v.shape
  n = T // c
  s0 = jax.eval_shape(lambda: score_fn(shared, _block(qa, 0, c), _block(ka, 0, c)))
  H, f = s0.shape[1], _acc(v.dtype)

  def query_block(i, carry):
    out, lse = carry
    qa_i = _block(qa, i, c)

    def key_block(j, st):
      m, l, acc = st
      s = score_fn(shared, qa_i, _block(ka, j, c)).astype(f)
      if bb is not None:
        s = s + _pair_term(bb, i, j).astype(f)
      vis = _visible(seg, i, j, c)
      if vis is not None:
        s = jnp.where(vis, s, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.exp(s - m_new[..., None])
      if vis is not None:
        p = jnp.where(vis, p, 0.0)
      corr = jnp.exp(m - m_new)
      acc = acc * corr.transpose(0, 2, 1)[..., None] + _pv(p, _block(v, j, c))
      return m_new, l * corr + jnp.sum(p, axis=-1), acc

    init = (jnp.full((B, H, c), NEG_INF, f), jnp.zeros((B, H, c), f), jnp.zeros((B, c, H, E), f))
    m, l, acc = jax.lax.fori_loop(0, i, key_block, init)
    if seg is not None:   # rows with no visible key: out 0, lse NEG_INF
      seen = l > 0
      l = jnp.where(seen, l, 1.0)
      m = jnp.where(seen, m, NEG_INF)
    o = acc / l.transpose(0, 2, 1)[..., None]
    out = jax.lax.dynamic_update_slice_in_dim(out, o, i * c, axis=1)
    lse = jax.lax.dynamic_update_slice_in_dim(lse, (m + jnp.log(l)).transpose(0, 2, 1), i * c,
                                              axis=1)
    return out, lse

  init = (jnp.zeros((B, T, H, E), f), jnp.full((B, T, H), NEG_INF, f))
  out, lse = jax.lax.fori_loop(1, n, query_block, init)
  return (out, lse), (shared, qa, ka, v, bb, seg, out, lse)


def _past_bwd(score_fn, c, res, cts):
  shared, qa, ka, v, bb, seg, out, lse = res
  dout, dlse = cts
  f = out.dtype
  dout = dout.astype(f)
  B, T, K, E = v.shape
  n = T // c
  dsum = jnp.sum(dout * out, axis=-1) - dlse.astype(f)                  # [B, T, H]: D - dlse
  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, _acc(x.dtype)), t)

  def key_block(j, carry):
    d_shared, d_qa, d_ka, d_v, d_bb = carry
    ka_j, v_j = _block(ka, j, c), _block(v, j, c).astype(f)

    def query_block(i, st):
      d_shared, d_qa, dka_j, dv_j, d_bb = st
      qa_i = _block(qa, i, c)
      s, vjp = jax.vjp(score_fn, shared, qa_i, ka_j)
      lse_i = _block(lse, i, c).transpose(0, 2, 1)[..., None]            # [B, H, c, 1]
      full = s.astype(f) if bb is None else s.astype(f) + _pair_term(bb, i, j).astype(f)
      p = jnp.exp(full - lse_i)
      vis = _visible(seg, i, j, c)
      if vis is not None:
        p = jnp.where(vis, p, 0.0)
      do_i = _block(dout, i, c)                                          # [B, c, H, E]
      Hq = p.shape[1]
      G = Hq // K
      do_g = do_i.reshape(B, c, K, G, E)
      dv_j = dv_j + jnp.einsum("bkgts,btkge->bske", _grouped(p, K), do_g)
      dp = jnp.einsum("btkge,bske->bkgts", do_g, v_j).reshape(p.shape)
      ds = p * (dp - _block(dsum, i, c).transpose(0, 2, 1)[..., None])
      g_shared, g_qa, g_ka = vjp(ds.astype(s.dtype))
      add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
      if d_bb is not None:   # each pair once: its entry is written, not accumulated
        d_bb = jax.lax.dynamic_update_slice(
            d_bb, jnp.sum(ds, axis=(2, 3), keepdims=True).astype(d_bb.dtype), (0, 0, i, j))
      return (add(d_shared, g_shared), _add_block(d_qa, g_qa, i, c), add(dka_j, g_ka), dv_j,
              d_bb)

    st = (d_shared, d_qa, zeros(ka_j), jnp.zeros((B, c, K, E), f), d_bb)
    d_shared, d_qa, dka_j, dv_j, d_bb = jax.lax.fori_loop(j + 1, n, query_block, st)
    return d_shared, d_qa, _add_block(d_ka, dka_j, j, c), _add_block(d_v, dv_j, j, c), d_bb

  init = (zeros(shared), zeros(qa), zeros(ka), jnp.zeros(v.shape, f),
          None if bb is None else zeros(bb))
  grads = jax.lax.fori_loop(0, n - 1, key_block, init)
  cast = lambda g, x: jax.tree.map(lambda a, b: a.astype(b.dtype), g, x)
  return tuple(cast(g, x) for g, x in zip(grads, (shared, qa, ka, v, bb))) + (None,)


_past.defvjp(_past_fwd, _past_bwd)
