"""The tile maths of the decayed-attention kernel (`kernels/decayed.py`): one (query tile,
key tile) pair's contribution to each pass, in the two forms a pair may take.

Logits are kept in log2 units inside the kernel (s2 = s log2 e), so every exponential is one
`exp2` with log2 e folded into the factor that already scales q.k (`_exp2`: one PTX `ex2` on a
GPU, never libdevice's `expf`); the forward writes lse in natural units.

Orientation: the fwd and dq passes hold a query tile and walk key tiles; their tiles are
[bq, bk], row vectors (per query) [bq, 1], column vectors (per key) [1, bk]. The dkv pass holds
a key tile and walks query tiles in the transposed orientation: tiles [bk, bq] (so its
products dk += ds^T q, dv += p^T do have M = bk, what Hopper's wgmma needs), key vectors
[bk, 1], query vectors [1, bq]. `_mm(a_rows, a_cols, t)` is the pair product in either.

Partial form (`partial_scores`: PARTIAL tiles; document boundaries, padding, a shared prefix
read across a document start, SISA diagonals of a long span): the visibility mask of every
element and the decay per element, as `masks.positional_mask`:

    s_ij = scale q_i.k_j + [fox] (g_i - g_j) + [sisa] e_ij (c_i . b_j)
    e_ij = exp(min(g_i - g_j, 0))

(g_i - g_j from the double word when given: rounded at the pair's own size). A masked pair is
NEG_INF; e is 0 there and on a visible pair across a document start (module docstring of
`decayed.py`).

Full form (FULL tiles: every pair visible; `decayed._classes`): no mask, and the decay splits
at two references per tile pair, R_I = max g (high word) over the query tile and R_J = min g
over the key tile (`decayed._frames`, computed before the call):

    (g_i - g_j) log2 e = rho_i + sig_IJ + beta_j,
    rho_i = (g_i - R_I) log2 e <= 0,  sig_IJ = (R_I - R_J) log2 e,  beta_j = (R_J - g_j) log2 e <= 0

(lo words in rho / beta). On a full tile all rows come after all keys inside one document, so
g_i <= R_I <= R_J <= g_j: the three pieces have one sign and each is at most |g_i - g_j|, so
each is rounded at the pair's own size, as the partial form's double word.

- FoX / ALiBi. rho_i is the same for every key of row i: it shifts the row's softmax and
  enters only through the running max / lse, once per row (fwd: the carry's frame offset
  rho + sig; dq: lse2 - rho - sig; dkv: nu = lse2 - rho computed before the call, sig added to
  the held key side), so the per-element work is one FFMA, s2 = (q.k) scale log2 e + beta_j,
  then the subtraction of the row's offset and one ex2. The row frame and the true frame
  differ by the row offset, rounded once per row: it moves the full tiles' keys against the
  partial tiles' by ulp(|rho_i|), and their weight is at most exp(rho_i + the spread of
  scale q.k), so the error stays below fp32 rounding of the logits wherever it is not
  multiplied by a vanishing weight.
- SISA. e_ij = exp(g_i - g_j) = exp(rho_i / log2 e) exp(sig) exp(beta_j / log2 e): with
  c' = c exp(g - R_I) and b' = b exp(R_J - g) (factors <= 1, before the call) the tile is
  plain attention over widened operands, one accumulator:

      s = scale (q.k + c~_i . b~_j),  fwd / dq: c~ = c' / scale, b~ = b' 2^sig;
                                       dkv:      c~ = c' 2^sig / scale, b~ = b'

  (the walked side scaled per tile by the pair's scalar: a [tile, ds] product, never an
  exponential per element). With sig <= 0 (FULL) every factor is <= 1; if one underflows, the
  product it bounds is below fp32's range too. Gradients follow the factoring: with
  A = sum_J ds b~ (dq pass), dc = exp(g - R_I) A and the rows' part of dg is rowsum(c * dc);
  with B = sum_I ds^T c~ (dkv pass), db = exp(R_J - g) scale B and the keys' part of dg is
  -rowsum(b * db) (`dq_unfactor`, `dkv_unfactor`, after the factored tiles).
- SISA, MASKED_FACTORED tiles (`decayed._classes`; SISA without FoX): the same factoring
  under the tile's mask, where every visible pair has g_i <= g_j (one document, g not rising
  over the two tiles: the diagonal) and sig <= FACTOR_SPAN log2 e, so the key factors
  exp(R_I - g_j) <= e^40 stay finite and a visible pair's product is <= 1. Any other tile
  keeps the partial form (the fallback).

The rows' part of FoX's dg is sum_j ds_ij, summed per element as the reference does
(mathematically it is dlse_i, but the explicit sum is what the fp32 paths compute).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
F32 = jnp.float32
_A_BT = (((1,), (1,)), ((), ()))    # a @ b.T
_AB = (((1,), (0,)), ((), ()))      # a @ b


class Rows(NamedTuple):
  """A query tile's operands: q [bq, D]; g / glo / pos / seg per query (row vectors of the
  pass's orientation); c [bq, ds] or None; the full form's row side (`decayed._frames`, with
  R_I the tile's max g): rho = (g - R_I) log2 e per query, c' = c exp(g - R_I) (SISA)."""
  q: jax.Array
  g: jax.Array
  glo: jax.Array | None
  c: jax.Array | None
  pos: jax.Array
  seg: jax.Array
  rho: jax.Array | None = None
  cp: jax.Array | None = None


class Cols(NamedTuple):
  """A key tile's operands: k [bk, D], v [bk, Dv]; g / glo / pos / seg per key; b [bk, ds] or
  None; the full form's key side (R_J the tile's min g): beta = (R_J - g) log2 e per key,
  b' = b exp(R_J - g) (SISA)."""
  k: jax.Array
  v: jax.Array
  g: jax.Array
  glo: jax.Array | None
  b: jax.Array | None
  pos: jax.Array
  seg: jax.Array
  beta: jax.Array | None = None
  bp: jax.Array | None = None


class Grads(NamedTuple):
  """A query tile's backward operands: do [bq, Dv]; lse2 (log2 units, +1e30 on a row that sees
  no key, so every p of it is 0), delta and (dkv pass, FoX) nu = lse2 - rho per query."""
  do: jax.Array
  lse2: jax.Array
  delta: jax.Array
  nu: jax.Array | None = None


def exp2(asm: bool, x):
  """2^x in fp32: on a GPU one `ex2.approx.ftz.f32` (relative error 2^-22, denormal results
  flushed to 0, which only ever drops terms below fp32's range); elsewhere, and for a scalar
  (one per tile), `jnp.exp2`."""
  if not asm or x.ndim == 0:
    return jnp.exp2(x)
  from jax.experimental.pallas import triton as pltriton
  [y] = pltriton.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
  return y


def dot(a, b, dims=_AB):
  """fp32-accumulating matmul; fp32 operands at full precision (Triton's default for them is
  TF32, Mosaic's may round them too), bf16 ones native. Both precisions explicit: None would
  take `jax_default_matmul_precision`, and its "highest" asks Mosaic for an fp32 contraction
  of bf16 operands, which it refuses ("Bad lhs type")."""
  both32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(a, b, dims,
                         precision=lax.Precision.HIGHEST if both32 else lax.Precision.DEFAULT,
                         preferred_element_type=jnp.float32)


def _mm(a_rows, a_cols, t: bool):
  """The pair product of a row-side and a column-side operand: [bq, bk] (t False) or its
  transpose [bk, bq] (t True, the dkv pass)."""
  return dot(a_cols, a_rows, _A_BT) if t else dot(a_rows, a_cols, _A_BT)


def rowb(x, t: bool):
  """A per-query vector made broadcastable against the pass's tiles (a 1D vector of the loop
  driver: [bq, 1] or [1, bq]; the grid driver's are laid out so already)."""
  if x.ndim == 2:
    return x
  return x[None, :] if t else x[:, None]


def colb(x, t: bool):
  """A per-key vector made broadcastable against the pass's tiles."""
  if x.ndim == 2:
    return x
  return x[:, None] if t else x[None, :]


def along(x):
  """A per-row vector of a [rows, n] operand (q, c, b, an accumulator) as [rows, 1]."""
  if x.ndim == 1:
    return x[:, None]
  return x if x.shape[1] == 1 else x.T


def _red(f, x, axis: int, keep: bool):
  """A reduction over the tile's axis: 1D (the loop driver's vectors, Triton's slice layout:
  one value per row, not one per element of a [bq, 1] tensor's replicated layout) or kept
  2D (the grid driver's, Mosaic's)."""
  return f(x, axis=axis, keepdims=keep)


def _gdiff(hi_a, lo_a, hi_b, lo_b):
  """(hi_a - hi_b) + (lo_a - lo_b), the lo words absent when g is one word."""
  d = hi_a - hi_b
  if lo_a is not None:
    d = d + (lo_a - lo_b)
  return d


def visible(spec, r: Rows, c: Cols, t: bool):
  """The positional mask of a tile (`masks.positional_mask`) in the pass's orientation."""
  rpos, cpos = rowb(r.pos, t), colb(c.pos, t)
  rseg, cseg = rowb(r.seg, t), colb(c.seg, t)
  vis = (cpos >= 0) & ((cseg == rseg) | (cseg == 0))
  if spec.causal:
    vis = vis & (cpos <= rpos)
  if spec.window is not None:
    vis = vis & (rpos - cpos < spec.window)
  return vis


def partial_scores(spec, r: Rows, c: Cols, t: bool, frame=None):
  """Partial form: (s2 [log2 units, NEG_INF where masked], e, c.b) of a tile (e, c.b: SISA
  only, else None). With `frame` (rho2, beta2, sig2: the TPU driver's FULL SISA tile) no mask,
  and e the rank-one product 2^rho2_i 2^(beta2_j + sig2) instead of an exp per element."""
  s = _mm(r.q, c.k, t) * spec.scale
  vis = None if frame is not None else visible(spec, r, c, t)
  e = cb = None
  if spec.fox or (spec.sisa and frame is None):
    lo = lambda a, f: None if a is None else f(a, t)
    dg = _gdiff(rowb(r.g, t), lo(r.glo, rowb), colb(c.g, t), lo(c.glo, colb))
  if spec.fox:
    s = s + dg
  if spec.sisa:   # min(., 0): a no-op on pairs inside one document (module docstring)
    if frame is None:
      e = exp2(spec.ex2_asm, jnp.where(vis & (dg <= 0), dg * LOG2E, NEG_INF))
    else:
      rho2, beta2, sig2 = frame
      e = rowb(exp2(spec.ex2_asm, rho2), t) * colb(exp2(spec.ex2_asm, beta2 + sig2), t)
    cb = _mm(r.c, c.b, t)
    s = s + e * cb
  if vis is None:
    return s * LOG2E, e, cb
  return jnp.where(vis, s * LOG2E, NEG_INF), e, cb


def fma(asm: bool, a, b, c):
  """a b + c elementwise (b, c broadcast to a's shape): one PTX `fma.rn.f32` on a GPU (Triton
  writes a separate mul.rn and add.rn, which ptxas may not contract), else a * b + c."""
  if not asm:
    return a * b + c
  from jax.experimental.pallas import triton as pltriton
  b = jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)
  c = jnp.broadcast_to(c, a.shape)
  [y] = pltriton.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, a.dtype)])
  return y


# ---------------------------------------------------------------- full form, fwd / dq

class RowFrame(NamedTuple):
  """The held query tile's side of the full form (fwd / dq), once per program: c~ = c' /
  scale (SISA)."""
  ct: jax.Array | None


def row_frame(spec, r: Rows) -> RowFrame:
  ct = (r.cp.astype(F32) * (1.0 / spec.scale)).astype(r.cp.dtype) if spec.sisa else None
  return RowFrame(ct)


def full_scores_rows(spec, fr: RowFrame, c: Cols, q, sig2):
  """Full form of a key tile against the held query tile: (s2 - rho2 - sig2 [bq, bk], b~ or
  None), sig2 = (R_I - R_J) log2 e the pair's scalar (`decayed._frames`). On a
  MASKED_FACTORED tile (SISA only) sig2 may be > 0 (b~'s factors up to e^FACTOR_SPAN)."""
  acc = _mm(q, c.k, False)
  bt = None
  if spec.sisa:
    bt = (c.bp.astype(F32) * exp2(spec.ex2_asm, sig2)).astype(c.bp.dtype)
    acc = acc + _mm(fr.ct, bt, False)
  C = spec.scale * LOG2E
  s2 = fma(spec.ex2_asm, acc, C, colb(c.beta, False)) if spec.fox else acc * C
  return s2, bt


# ---------------------------------------------------------------- forward

def fwd_init(spec, bq: int, dv: int):
  vec = (bq,) if spec.flat else (bq, 1)
  return (jnp.full(vec, NEG_INF / 2, F32), jnp.zeros(vec, F32), jnp.zeros((bq, dv), F32))


def _online(spec, s2, off, v, carry):
  """One tile of the online softmax (log2 units): s2 - off are the tile's logits in the
  carry's frame (off: a per-row shift, or None)."""
  m, l, acc = carry
  mx = _red(jnp.max, s2, 1, not spec.flat)
  if off is not None:
    mx = mx + off
  m_new = jnp.maximum(m, mx)
  alpha = exp2(spec.ex2_asm, m - m_new)
  p = exp2(spec.ex2_asm, s2 - rowb(m_new if off is None else m_new - off, False))
  l = alpha * l + _red(jnp.sum, p, 1, not spec.flat)
  acc = along(alpha) * acc + dot(p.astype(v.dtype), v)
  return m_new, l, acc


def _masked(spec, s2, r: Rows, c: Cols, t: bool, masked: bool):
  """A MASKED_FACTORED tile's scores with the mask applied (a FULL tile's unchanged)."""
  return jnp.where(visible(spec, r, c, t), s2, NEG_INF) if masked else s2


def fwd_full(spec, fr: RowFrame, r: Rows, c: Cols, sig2, carry, masked=False):
  s2, _ = full_scores_rows(spec, fr, c, r.q, sig2)
  s2 = _masked(spec, s2, r, c, False, masked)
  return _online(spec, s2, r.rho + sig2 if spec.fox else None, c.v, carry)


def fwd_partial(spec, r: Rows, c: Cols, carry, frame=None):
  s2, _, _ = partial_scores(spec, r, c, False, frame)
  return _online(spec, s2, None, c.v, carry)


def fwd_finish(carry, o_ref, lse_ref):
  m, l, acc = carry
  seen = l > 0
  safe = jnp.where(seen, l, 1.0)
  o_ref[...] = jnp.where(along(seen), acc / along(safe), 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(safe)) * LN2, NEG_INF)


def lse2_of(lse):
  """lse (natural units, NEG_INF on a row that sees no key) -> log2 units, +1e30 there (every
  p of such a row is then 0 without a mask)."""
  return jnp.where(lse > NEG_INF / 2, lse * LOG2E, -NEG_INF)


# ---------------------------------------------------------------- dq pass

def dq_init(spec, r: Rows):
  vec = r.g.shape
  return (jnp.zeros(r.q.shape, F32), jnp.zeros(r.c.shape, F32) if spec.sisa else None,
          jnp.zeros(vec, F32) if spec.fox or spec.sisa else None)


def dq_full(spec, fr: RowFrame, lam2, r: Rows, c: Cols, d: Grads, sig2, carry, masked=False):
  """carry (dq, A, dg): A = sum ds b~ (SISA), turned into dc and dg by `dq_unfactor`.
  lam2 = lse2 - rho (FoX; lse2 otherwise)."""
  dq, a, dg = carry
  s2, bt = full_scores_rows(spec, fr, c, r.q, sig2)
  s2 = _masked(spec, s2, r, c, False, masked)
  p = exp2(spec.ex2_asm, s2 - rowb(lam2 - sig2 if spec.fox else lam2, False))
  ds = p * (dot(d.do, c.v, _A_BT) - rowb(d.delta, False))
  dq = dq + dot(ds.astype(c.k.dtype), c.k)
  if spec.fox:
    dg = dg + _red(jnp.sum, ds, 1, not spec.flat)
  if spec.sisa:
    a = a + dot(ds.astype(bt.dtype), bt)
  return dq, a, dg


def dq_unfactor(spec, fr: RowFrame, r: Rows, carry):
  """After the full tiles: dc = f A, the rows' SISA part of dg = rowsum(c dc)."""
  dq, a, dg = carry
  if not spec.sisa:
    return carry
  dc = along(exp2(spec.ex2_asm, r.rho)) * a
  return dq, dc, dg + _red(jnp.sum, r.c.astype(F32) * dc, 1, not spec.flat)


def dq_partial(spec, r: Rows, c: Cols, d: Grads, carry, frame=None):
  dq, dc, dg = carry
  s2, e, cb = partial_scores(spec, r, c, False, frame)
  p = exp2(spec.ex2_asm, s2 - rowb(d.lse2, False))
  ds = p * (dot(d.do, c.v, _A_BT) - rowb(d.delta, False))
  dq = dq + dot(ds.astype(c.k.dtype), c.k)
  w = ds if spec.fox else None
  if spec.sisa:
    dse = ds * e
    dc = dc + dot(dse.astype(c.b.dtype), c.b)
    w = dse * cb if w is None else w + dse * cb
  if w is not None:
    dg = dg + _red(jnp.sum, w, 1, not spec.flat)
  return dq, dc, dg


def dq_finish(spec, carry, dq_ref, dg_ref, dc_ref):
  dq, dc, dg = carry
  dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)
  if dg is not None:
    dg_ref[...] = dg
  if spec.sisa:
    dc_ref[...] = dc.astype(dc_ref.dtype)


# ---------------------------------------------------------------- dkv pass (transposed)

def dkv_init(spec, c: Cols):
  vec = c.g.shape
  return (jnp.zeros(c.k.shape, F32), jnp.zeros(c.v.shape, F32),
          jnp.zeros(vec, F32) if spec.fox or spec.sisa else None,
          jnp.zeros(c.b.shape, F32) if spec.sisa else None)


def _dkv_common(spec, pT, r: Rows, c: Cols, d: Grads, carry):
  dk, dv, dg, db = carry
  dsT = pT * (dot(c.v, d.do, _A_BT) - rowb(d.delta, True))
  dv = dv + dot(pT.astype(d.do.dtype), d.do)
  dk = dk + dot(dsT.astype(r.q.dtype), r.q)
  return dsT, (dk, dv, dg, db)


def dkv_full(spec, r: Rows, c: Cols, d: Grads, sig2, carry, masked=False):
  """carry (dk, dv, dg, B): B = sum ds^T c~ (SISA), turned into db and dg by
  `dkv_unfactor`. The per-query offset is nu = lse2 - rho (FoX; lse2 otherwise), computed
  before the call; the pair's scalar sig2 goes to the held key side."""
  acc = _mm(r.q, c.k, True)
  ct = None
  if spec.sisa:
    ct = (r.cp.astype(F32) * (exp2(spec.ex2_asm, sig2) * (1.0 / spec.scale))).astype(r.cp.dtype)
    acc = acc + _mm(ct, c.bp, True)
  C = spec.scale * LOG2E
  if spec.fox:
    s2 = fma(spec.ex2_asm, acc, C, colb(c.beta + sig2, True)) - rowb(d.nu, True)
  else:
    s2 = _masked(spec, acc * C, r, c, True, masked) - rowb(d.lse2, True)
  pT = exp2(spec.ex2_asm, s2)
  dsT, (dk, dv, dg, b) = _dkv_common(spec, pT, r, c, d, carry)
  if spec.fox:
    dg = dg - _red(jnp.sum, dsT, 1, not spec.flat)
  if spec.sisa:
    b = b + dot(dsT.astype(ct.dtype), ct)
  return dk, dv, dg, b


def dkv_unfactor(spec, c: Cols, carry):
  """After the full tiles: db = f scale B (f = exp(R_J - g)), the keys' SISA part of dg =
  -rowsum(b db)."""
  dk, dv, dg, b = carry
  if not spec.sisa:
    return carry
  db = along(exp2(spec.ex2_asm, c.beta)) * (spec.scale * b)
  return dk, dv, dg - _red(jnp.sum, c.b.astype(F32) * db, 1, not spec.flat), db


def dkv_partial(spec, r: Rows, c: Cols, d: Grads, carry, frame=None):
  s2, e, cb = partial_scores(spec, r, c, True, frame)
  pT = exp2(spec.ex2_asm, s2 - rowb(d.lse2, True))
  dsT, (dk, dv, dg, db) = _dkv_common(spec, pT, r, c, d, carry)
  w = dsT if spec.fox else None
  if spec.sisa:
    dse = dsT * e
    w = dse * cb if w is None else w + dse * cb
    db = db + dot(dse.astype(r.c.dtype), r.c)
  if w is not None:
    dg = dg - _red(jnp.sum, w, 1, not spec.flat)
  return dk, dv, dg, db


def dkv_finish(spec, carry, dk_ref, dv_ref, dg_ref, db_ref):
  dk, dv, dg, db = carry
  dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  if dg is not None:
    dg_ref[...] = dg
  if spec.sisa:
    db_ref[...] = db.astype(db_ref.dtype)
