"""Fused chunked SSD (Mamba-2's scalar-decay recurrence, `ssm/ssd.py`) in Pallas: four kernels.

Per chunk c of Q tokens and head h, with the chunk's log-decays a_r (fp32, <= 0, -inf at a
document start, `ssd.restart_decay`) and

    seg(t, s) = a_{s+1} + ... + a_t  (s <= t)      A_t = a_0 + ... + a_t
    E_s = a_{s+1} + ... + a_{Q-1}      z = a_0 + ... + a_{Q-1}   (tokens 0 .. Q-1 of the chunk)

(all *direct* segment sums within the chunk, never differences of one running sum: `ssd.py`'s
convention), the chunked SSD with R inputs (x_i, B_i) and O output columns C_o is

    states      S_c   = sum_i sum_s exp(E_s) x_is B_is^T                            [P, N]
    passing     H_0 = h0,  H_{c+1} = exp(z_c) H_c + S_c      (the final state H_C)
    scan        y_ot  = sum_i sum_{s<=t} exp(seg(t, s)) (C_ot . B_is) x_is + exp(A_t) H_c C_ot

R = O = 1 is Mamba-2 (and the hybrids' SSM heads); R = 2 Mamba-3 SISO's trapezoid (`extra =
(x2, B2)`, as `ssd.ssd_chunked(extra=)`); R = 2r, O = r Mamba-3's MIMO (`mimo_kernel`, as
`mamba3.mimo_chunked`: its input columns are the inputs, its r columns of Q the outputs, one
[P, N] state). Its complex phase is the rotation of B and C by the cumulative angles, applied
before the SSD: the kernels see rotated keys and queries, per head (G = H).

Kernels (forward, then the custom VJP's backward; grids in brackets):
  `_states`  [B, H]      the states entering every chunk, S_c and the passing in one loop over
                         the chunks (the state carried in fp32 registers): writes H_c in
                         `dot_dtype` and the final state in fp32;
  `_scan`    [B, H, C]   y: C B^T, its decay mask, the state term, both products fused (no
                         [.., Q, Q] tensor is written);
  `_dstates` [B, H]      the state cotangents in one loop back over the chunks: g_C = d final,
                         dS_c = g_{c+1}, g_c = exp(z_c) g_{c+1} + sum_o sum_t exp(A_t) dy_ot
                         C_ot^T, d h0 = g_0; writes dS_c in `dot_dtype`;
  `_dchunk`  [B, G, C]   every per-token gradient of a chunk, the group's J = H / G heads in a
                         loop, so dB and dC are summed over the group's heads in registers and
                         written once, in B's and C's dtype:

    dx_s = sum_{t>=s} L_ts (C_t . B_s) dy_t + exp(E_s) dS B_s
    dC_t = sum_s L_ts (dy_t . x_s) B_s + exp(A_t) dy_t H
    dB_s = sum_t L_ts (dy_t . x_s) C_t + exp(E_s) dS^T x_s
    da_r = sum_{s < r <= t} G_ts + sum_{t >= r} g_t + sum_{s < r} e_s + exp(z) <dS, H>

with L_ts = exp(seg(t, s)), G_ts = L_ts (C_t . B_s)(dy_t . x_s), g_t = exp(A_t) dy_t . (H C_t),
e_s = exp(E_s) x_s . (dS B_s): each exponent's cotangent goes to the a_r it sums (the last
term: z's, for every r of the chunk), summed over the inputs and output columns.

Between kernels only H_c and dS_c ([B, H, C, P, N], in `dot_dtype`: bf16 in the mixers) and the
outputs are written: no fp32 [B, chunks, H, P, N] or [.., Q, Q] array. The scan casts H_c to
`dot_dtype` for its matmul in any case (as `ssd.ssd_chunked` does), and dchunk dS_c, so those
roundings change nothing but d z's inner product, which reads them too. The authors'
(state-spaces/mamba, `ops/triton/ssd_combined.py`) forward runs five kernels (chunk cumsum,
C B^T, chunk states written in fp32, state passing written in C's dtype, chunk scan), their
backward a dozen or so (dstates, the passing's, dx, dB, dC, d(C B^T), the dA pieces, the
cumsum's, with the states recomputed): here the cumsum, C B^T and dA work are folded into the
chunk programs and the chunk states never leave the passing loop; the backward reads the
forward's H_c (a residual, one x-sized array at N = Q) instead of recomputing them.

Exponents, in log2 units (a2 = a log2 e, then every exp is one `exp2`: one PTX `ex2.approx.ftz`
on a GPU, `decayed_tiles.exp2`). The per-chunk sums (`Decays`: A_t = sum_{tau <= t} a_tau per
output row, E_s = sum_{tau > s} a_tau per input row, the total z, each a direct fp32 sum of its
own terms) are made once per call, by the states kernel, which reads a2 and writes them beside
its states; the scan and the backward's kernels read them as columns. The states kernel makes A
and E as masked sums on the tensor cores (`_row_sums`: one bf16 matmul of the 0/1 mask with the
row's exact three-part split): on the vector units a masked row sum reduces across lanes and
converts layouts, ~11 instructions per element of a chunk's tile each on an H100, which made in
every kernel cost ~45% more over the four. A cumulative sum in XLA (the authors' "chunk cumsum"
kernel) cost six kernels a layer on a GPU (its reduce-window passes, the reverse one, the
repeats); masked sums there three (measured: +3 launches a layer). seg is made in the kernels,
as a product of masked matrices, seg = (M_le diag(a)) U_gt with M_le[t, r] = [r <= t], U_gt[r,
s] = [r > s]; the 0/1 mask is exact in bf16, so the product runs as three bf16 matmuls on the
exact split a = hi + mid + lo (`_mask_sum`): each entry a direct fp32 sum of its own terms, at
the tensor cores' rate, not a Q-deep fp32 loop (the same for da's sum over s < r). A matmul
multiplies -inf by the mask's zeros (NaN), so a2 is floored at NEG = -1e30 first: a sum holding
a start is then <= -1e30 (its exp 0, as with -inf), every other sum unchanged; Q such floors
stay far from fp32's range. The a_{t0} gradient the kernel returns at a start is discarded by
`restart_decay`'s `where`, as in the XLA path. The index masks are built once per program
(`Masks`), outside the loops.

MIMO (`mimo_kernel`): a token's I input columns are I consecutive input rows and its O output
columns O output rows of the same kernels (x [B, H, T I, P], B [.., T I, N], C and y
[.., T O, ..]): L [QO, QI] has the entry of the rows' tokens, A repeats per output row, E per
input row, and da sums each token's rows; every matmul is then a chunk's [QO, QI] one (rank 4,
chunk 16: [64, 128], a wgmma tile) rather than r^2 small ones.

Precision (`ssd.py`'s "Precision"): decays, exponents, the carried states and accumulations
fp32; every matmul step the XLA path runs in `dot_dtype` takes its operands in `dot_dtype` here
(C B^T, its decayed product with x, the states, the state -> output, and their backward products
with the cotangents cast to it). The passing is the sequential fp32 recurrence here, a segsum
matmul in `ssd.pass_chunk_states`: the same sums, in another order.

Layout: heads first, [B, H, T, P] (B and C [B, G, T, N]; a2 [B, H, C, 1, Q], A2 [.., QO, 1],
E2 [.., QI, 1] and z2 [.., 1, 1]; the states
[B, H, C, P, N]); dchunk views the per-head arrays as [B, G, J, ...] (a free reshape). Every
block's last two dims are a chunk's [Q, P] / [Q, N], the array's [P, N] or [1, Q] (TPU's tiling
rule holds for Q a multiple of 8). T is padded to whole chunks (a = 0, x = B = C = 0: the state
is unchanged, the padded outputs dropped).

Targets (`_compiler_params`, as `kernels/decayed.py`): Triton on GPU, Mosaic on TPU, the
Pallas interpreter on CPU (tests). Sharding (`_sharded`): under `sharding.use_rules` the call
runs in a `jax.shard_map`, rows split by the `batch` rule (heads and time whole).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from attn_jax import kernel_choice, sharding
from attn_jax.kernels.decayed_tiles import LOG2E, exp2
from attn_jax.ssm import ssd

F32 = jnp.float32
BF16 = jnp.bfloat16
NEG = -1e30
_A_BT = (((1,), (1,)), ((), ()))    # a @ b.T
_AT_B = (((0,), (0,)), ((), ()))    # a.T @ b
PASSES = ("states", "scan", "dstates", "dchunk")
# Largest chunk a GPU program takes: 64 compiles for an H100 (tests/test_ssd_kernel.py, head
# dim and d_state 64); 256 (mamba_ssm's GPU default) exceeds its 227 KiB of shared memory.
# MIMO's rows (chunk x columns): 64 output and 128 input rows compile (rank 4, chunk 16, the
# census), more are not checked.
GPU_MAX_CHUNK = 64
GPU_MAX_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static configuration of one call (hashable: a `custom_vjp` nondiff argument)."""
  chunk: int           # Q tokens
  groups: int          # heads per B/C group (J = H / G)
  dot_dtype: str       # operand dtype of the matmul steps, and of the states written
  interpret: bool
  inputs: int = 1      # R: input arrays (x_i, B_i) (2: Mamba-3's `extra`)
  in_rows: int = 1     # I: rows per token of each input (2r: MIMO's input columns)
  out_rows: int = 1    # O: rows per token of C and y (r: MIMO's output columns)
  warps: int = 4       # Triton
  stages: int = 2
  ex2: bool = False    # exp2 as one PTX `ex2` (Triton on a GPU)


def _dot(a, b, dims=None):
  """fp32-accumulating matmul of two operands of one dtype."""
  return lax.dot_general(a, b, dims or (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _split3(v):
  """fp32 v's exact split (lo, mid, hi) in bf16, v = hi + mid + lo (8 significant bits each;
  fp32 has 24)."""
  hi = v.astype(BF16)
  r = v - hi.astype(F32)
  mid = r.astype(BF16)
  return (r - mid.astype(F32)).astype(BF16), mid, hi


def _mask_sum(v, mask):
  """v @ mask for fp32 v [M, K] and a 0/1 mask [K, L] (bf16, exact) as three bf16 matmuls on
  v's exact split v = hi + mid + lo (8 significant bits each; fp32 has 24): every product is
  exact, the sums accumulate in fp32, so each entry is a direct fp32 sum of its own terms, at
  a tensor core's bf16 rate rather than a K-deep fp32 FMA loop (module docstring)."""
  lo, mid, hi = _split3(v)
  return _dot(lo, mask) + _dot(mid, mask) + _dot(hi, mask)


def _row_sums(mask, v_1K):
  """mask @ v^T [M, 1] for a 0/1 mask [M, K] (bf16, exact) and a fp32 row v [1, K] as one
  bf16 matmul on the tensor cores: the row's exact split v = lo + mid + hi (`_mask_sum`) as
  rows 0, 1, 2 of a [16, K] operand (the rest 0), so output column j is the masked sum of part
  j (every product exact, fp32 accumulation), and the columns' sum is each entry's direct fp32
  sum of its own terms. (A masked row sum on the vector units reduces across lanes and
  converts layouts: ~2x the instructions.) The rows are picked by arithmetic on the row index,
  not a select: Mosaic cannot relayout a select's [16, K] mask against the broadcast row."""
  lo, mid, hi = _split3(v_1K)
  row = lax.broadcasted_iota(jnp.int32, (16, 1), 0).astype(F32)
  pick = lambda j: jnp.maximum(1.0 - jnp.abs(row - j), 0.0)   # [16, 1]: 1 on row j, else 0
  parts = (pick(0) * lo.astype(F32) + pick(1) * mid.astype(F32) + pick(2) * hi.astype(F32))
  return jnp.sum(_dot(mask, parts.astype(BF16), _A_BT), axis=1, keepdims=True)


class Masks:
  """A program's index masks, built once and shared by its loop's iterations. Rows of the
  outputs are (token t, column) pairs, O a token, rows of the inputs (s, column), I a token
  (1 and 1 but for MIMO); tau is a token of the chunk:
    out_le [QO, Q]   tau <= t          (A's terms; da's pairs and g)
    in_lt  [QI, Q]   tau > s           (E's terms; da's e)
    pairs  [QO, QI]  s <= t            (L's support)
    gt     [Q, QI]   tau > s  (bf16)   seg = (out_le o a) @ gt
    lt     [QI, Q]   s < tau  (bf16)   da's W = G @ lt; E = lt @ a
    le     [QO, Q]   tau <= t (bf16)   A = le @ a"""

  def __init__(self, Q: int, I: int, O: int):
    iota = lambda shape, d, k: lax.div(lax.broadcasted_iota(jnp.int32, shape, d), jnp.int32(k))
    self.out_le = iota((Q * O, Q), 1, 1) <= iota((Q * O, Q), 0, O)
    self.in_lt = iota((Q * I, Q), 1, 1) > iota((Q * I, Q), 0, I)
    self.pairs = iota((Q * O, Q * I), 1, I) <= iota((Q * O, Q * I), 0, O)
    self.gt = jnp.where(iota((Q, Q * I), 0, 1) > iota((Q, Q * I), 1, I), 1.0, 0.0).astype(BF16)
    self.lt = jnp.where(self.in_lt, 1.0, 0.0).astype(BF16)
    self.le = jnp.where(self.out_le, 1.0, 0.0).astype(BF16)


class Decays(NamedTuple):
  """A call's log-decays in log2 units per chunk and their direct sums (the sums made by the
  states kernel), each array [B, H, C, r, k], a chunk's block the last two dims:

      a2 [1, Q]   a log2 e, floored at NEG   (a row, for seg)
      A2 [QO, 1]  sum_{tau <= t} a2_tau      per output row (its token t's)
      E2 [QI, 1]  sum_{tau > s} a2_tau       per input row (its token s's)
      z2 [1, 1]   sum_tau a2_tau             the chunk's total

  (columns, as the kernels scale rows by them)."""
  a2: jax.Array
  A2: jax.Array
  E2: jax.Array
  z2: jax.Array


# the parts each kernel after the states kernel reads
_SCAN_PARTS, _DSTATES_PARTS, _DCHUNK_PARTS = ("a2", "A2"), ("A2", "z2"), Decays._fields


class Exps:
  """A chunk's exponents (log2 units): the parts of `Decays` a kernel reads (`parts`: {name:
  block}); `seg` adds L [QO, QI] = 2^seg2(t, s) = exp(seg(t, s)) on s <= t, else 0 (seg2 from
  a2: `_mask_sum`)."""

  def __init__(self, spec: Spec, parts: dict, m: Masks, seg: bool = False):
    self.spec = spec
    for k, v in parts.items():
      setattr(self, k, v)
    if seg:
      terms = jnp.where(m.out_le, parts["a2"], 0.0)               # [(t, o), tau] = a2_tau
      self.L = jnp.where(m.pairs, self.exp(_mask_sum(terms, m.gt)), 0.0)

  def exp(self, x):
    return exp2(self.spec.ex2, x)


def _load(refs, names, idx) -> dict:
  """{name: ref[idx]} of a kernel's decay refs."""
  return {n: r[idx] for n, r in zip(names, refs)}


def _masks(spec: Spec) -> Masks:
  return Masks(spec.chunk, spec.in_rows, spec.out_rows)


def _rows(ref, c, n: int):
  """Chunk c's n rows of a per-program [rows, K] block."""
  return ref[pl.ds(pl.multiple_of(c * n, n), n), :]


# ---------------------------------------------------------------- kernels

def _states_kernel(spec: Spec, *refs):
  """The states entering each chunk, passed along the chunks in one loop (one head):
  H_0 = h0, H_{c+1} = exp(z_c) H_c + S_c, S_c = sum_i sum_s exp(E_s) x_is B_is^T; writes
  H_c [P, N] in `dot_dtype`, the final state fp32 and the chunks' sums A2, E2, z2 of `Decays`
  for the kernels after it, made from a2 (A2 and E2 on the tensor cores: `_row_sums`; refs:
  x_i..., B_i..., a2, [h0], H, final, A2, E2, z2)."""
  R, n = spec.inputs, spec.chunk * spec.in_rows
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs, a2_ref, rest = refs[:R], refs[R:2 * R], refs[2 * R], refs[2 * R + 1:]
  h0_ref, (hin_ref, final_ref, A2_ref, E2_ref, z2_ref) = \
      (rest[0], rest[1:]) if len(rest) == 6 else (None, rest)
  m = _masks(spec)

  def chunk(c, h):
    a2 = a2_ref[c]
    E2, z2 = _row_sums(m.lt, a2), jnp.sum(a2, axis=1, keepdims=True)
    A2_ref[c], E2_ref[c], z2_ref[c] = _row_sums(m.le, a2), E2, z2
    eE = exp2(spec.ex2, E2)
    s = 0.0
    for x_ref, b_ref in zip(xs, bs):
      xe = (_rows(x_ref, c, n).astype(F32) * eE).astype(dt)
      s = s + _dot(xe, _rows(b_ref, c, n).astype(dt), _AT_B)
    hin_ref[c] = h.astype(hin_ref.dtype)
    return exp2(spec.ex2, z2) * h + s

  h0 = jnp.zeros(hin_ref.shape[-2:], F32) if h0_ref is None else h0_ref[...].astype(F32)
  final_ref[...] = lax.fori_loop(0, a2_ref.shape[0], chunk, h0)


def _scan_kernel(spec: Spec, *refs):
  """y = sum_i (L o C B_i^T) x_i + exp(A) o (C H^T)  [QO, P]  (one chunk of one head; refs:
  x_i..., B_i..., C, a2, A2, H, y)."""
  R = spec.inputs
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs = refs[:R], refs[R:2 * R]
  c_ref, a2_ref, A2_ref, h_ref, y_ref = refs[2 * R:]
  e = Exps(spec, _load((a2_ref, A2_ref), _SCAN_PARTS, ...), _masks(spec), seg=True)
  c = c_ref[...].astype(dt)
  y = 0.0
  for x_ref, b_ref in zip(xs, bs):
    cb = _dot(c, b_ref[...].astype(dt), _A_BT)                      # [t, s]
    y = y + _dot((cb * e.L).astype(dt), x_ref[...].astype(dt))
  y_ref[...] = y + e.exp(e.A2) * _dot(c, h_ref[...].astype(dt), _A_BT)


def _dstates_kernel(spec: Spec, *refs, with_final: bool):
  """The state cotangents, passed back along the chunks in one loop (one head): g_C = d final,
  dS_c = g_{c+1}, g_c = exp(z_c) g_{c+1} + sum_t exp(A_t) dy_t C_t^T, d h0 = g_0; writes dS_c
  [P, N] in `dot_dtype` (refs: dy, C, A2, z2, [d final], dS, [d h0]; no d final: g_C = 0, the
  final state unused)."""
  n = spec.chunk * spec.out_rows
  dt = jnp.dtype(spec.dot_dtype)
  dy_ref, c_ref, d_refs = refs[0], refs[1], refs[2:4]
  dfinal_ref = refs[4] if with_final else None
  ds_ref, *dh0 = refs[4 + with_final:]
  dh0_ref = dh0[0] if dh0 else None
  m = _masks(spec)
  nc = d_refs[0].shape[0]

  def chunk(k, g):
    c = nc - 1 - k
    e = Exps(spec, _load(d_refs, _DSTATES_PARTS, c), m)
    dya = (_rows(dy_ref, c, n).astype(F32) * e.exp(e.A2)).astype(dt)
    ds_ref[c] = g.astype(ds_ref.dtype)
    return e.exp(e.z2) * g + _dot(dya, _rows(c_ref, c, n).astype(dt), _AT_B)

  g0 = (jnp.zeros(ds_ref.shape[-2:], F32) if dfinal_ref is None
        else dfinal_ref[...].astype(F32))
  g = lax.fori_loop(0, nc, chunk, g0)
  if dh0_ref is not None:
    dh0_ref[...] = g


def _dchunk_kernel(spec: Spec, *refs):
  """Every per-token gradient of one chunk of a B/C group (module docstring), its J heads in
  one loop: dx_i and da per head, dB_i and dC summed over the group's heads in the loop
  (refs: x_i..., B_i..., C, a2, A2, E2, z2, dy, H, dS, then dx_i..., dB_i..., dC, da; the
  per-head blocks [J, ...], indexed by the loop's head)."""
  R, J = spec.inputs, spec.groups
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs = refs[:R], refs[R:2 * R]
  c_ref, d_refs = refs[2 * R], refs[2 * R + 1:2 * R + 5]
  dy_ref, h_ref, ds_ref = refs[2 * R + 5:2 * R + 8]
  outs = refs[2 * R + 8:]
  dxs, dbs, (dc_ref, da_ref) = outs[:R], outs[R:2 * R], outs[2 * R:]
  m = _masks(spec)
  b = [r[...].astype(dt) for r in bs]
  c = c_ref[...].astype(dt)
  shared = J > 1 and R == 1     # C B^T once for the group's heads (Mamba-2)
  cb0 = _dot(c, b[0], _A_BT) if shared else None

  def head(j, carry):
    db_acc, dc = list(carry[:R]), carry[R]
    e = Exps(spec, _load(d_refs, _DCHUNK_PARTS, j), m, seg=True)
    eA, eE = e.exp(e.A2), e.exp(e.E2)
    h, ds = h_ref[j].astype(dt), ds_ref[j].astype(dt)
    dy32 = dy_ref[j].astype(F32)
    dy = dy32.astype(dt)
    # entering state: y += exp(A) o (C H^T)
    dc = dc + _dot((dy32 * eA).astype(dt), h)
    g = eA * jnp.sum(dy32 * _dot(c, h, _A_BT), axis=1, keepdims=True)        # [QO, 1]
    G, es = 0.0, 0.0
    for i in range(R):
      x32 = xs[i][j].astype(F32)
      x = x32.astype(dt)
      # intra-chunk: y = (L o C B_i^T) x_i
      dyx = _dot(dy, x, _A_BT)                                       # [t, s] = dy_t . x_s
      mm = (cb0 if shared else _dot(c, b[i], _A_BT)) * e.L
      dcb = (dyx * e.L).astype(dt)
      dc = dc + _dot(dcb, b[i])
      G = G + dyx * mm
      # chunk state: S = sum_s exp(E_s) x_s B_s^T
      bds = _dot(b[i], ds, _A_BT)                                    # [s, P] = dS B_s
      dxs[i][j] = (_dot(mm.astype(dt), dy, _AT_B) + eE * bds).astype(dxs[i].dtype)
      db_acc[i] = db_acc[i] + _dot(dcb, c, _AT_B) + _dot((x32 * eE).astype(dt), ds)
      es = es + eE * jnp.sum(x32 * bds, axis=1, keepdims=True)      # [QI, 1]
    # da_tau: seg's pairs s < tau <= t, A's rows t >= tau, E's rows s < tau, and the passing's
    # exp(z) <dS, H> (z = the chunk's sum) for every tau (as a row [1, Q])
    W = _mask_sum(G, m.lt)                                           # [t, tau]: sum_{s<tau} G
    da = jnp.sum(jnp.where(m.out_le, W + g, 0.0), axis=0, keepdims=True)
    da = da + jnp.sum(jnp.where(m.in_lt, es, 0.0), axis=0, keepdims=True)
    hds = ds_ref[j].astype(F32) * h_ref[j].astype(F32)
    dz = e.exp(e.z2) * jnp.sum(jnp.sum(hds, axis=1, keepdims=True), axis=0, keepdims=True)
    da_ref[j] = da + dz
    return tuple(db_acc) + (dc,)

  init = tuple(jnp.zeros(v.shape, F32) for v in b) + (jnp.zeros(c.shape, F32),)
  out = lax.fori_loop(0, J, head, init) if J > 1 else head(0, init)
  for ref, v in zip(dbs + (dc_ref,), out):
    ref[...] = v.astype(ref.dtype)


# ---------------------------------------------------------------- calls

def _compiler_params(spec: Spec, axes: int):
  """Mosaic on TPU (`axes` grid axes: the chunk loops' programs independent), Triton on GPU,
  none in the interpreter."""
  if spec.interpret:
    return None
  plat = kernel_choice.target()
  if plat == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * axes)
  if plat == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=spec.warps, num_stages=spec.stages)
  return None


def _call(spec: Spec, kernel, name: str, grid, ins, in_specs, outs, out_specs):
  return pl.pallas_call(functools.partial(kernel, spec), grid=grid, in_specs=in_specs,
                        out_specs=out_specs, out_shape=outs, interpret=spec.interpret,
                        name="ssd_" + name,
                        compiler_params=_compiler_params(spec, len(grid)))(*ins)


def _whole(x, group: int = 1):
  """Block of the whole [rows, K] (or [C, ...]) of one head of [B, H, ...] at grid (b, h); a
  group's array ([B, G, ...]) when `group` (J) > 1."""
  nd = x.ndim - 2
  return pl.BlockSpec((None, None) + x.shape[2:],
                      lambda b, h: (b, lax.div(h, jnp.int32(group))) + (0,) * nd)


def _chunk_of(x, rows: int, group: int = 1):
  """Block of chunk c (`rows` rows) of one head of [B, H, rows x C, K] at grid (b, h, c) (a
  group's array when `group` > 1)."""
  return pl.BlockSpec((None, None, rows, x.shape[-1]),
                      lambda b, h, c: (b, lax.div(h, jnp.int32(group)), c, 0))


def _per_chunk(x):
  """Block of chunk c of one head of [B, H, C, r, k] at grid (b, h, c)."""
  return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, c: (b, h, c, 0, 0))


def _parts(d: Decays, names):
  return tuple(getattr(d, n) for n in names)


def _states(spec: Spec, xs, bs, a2, h0):
  """(H_c [B, H, C, P, N] in `dot_dtype`, final [B, H, P, N] fp32, `Decays`) of a2 [B, H, C,
  1, Q]."""
  B, H, _, Pd = xs[0].shape
  C, N, J = a2.shape[2], bs[0].shape[-1], spec.groups
  QO, QI = spec.chunk * spec.out_rows, spec.chunk * spec.in_rows
  f32 = lambda *shape: jax.ShapeDtypeStruct((B, H, C) + shape, F32)
  outs = (jax.ShapeDtypeStruct((B, H, C, Pd, N), jnp.dtype(spec.dot_dtype)),
          jax.ShapeDtypeStruct((B, H, Pd, N), F32), f32(QO, 1), f32(QI, 1), f32(1, 1))
  ins = tuple(xs) + tuple(bs) + (a2,) + (() if h0 is None else (h0,))
  specs = ([_whole(x) for x in xs] + [_whole(b, J) for b in bs] + [_whole(a2)]
           + ([] if h0 is None else [_whole(h0)]))
  h_in, final, A2, E2, z2 = _call(spec, _states_kernel, "states", (B, H), ins, specs, outs,
                                  tuple(_whole(o) for o in outs))
  return h_in, final, Decays(a2, A2, E2, z2)


def _scan(spec: Spec, xs, bs, c, d: Decays, h_in):
  """y [B, H, T x O, P] fp32."""
  B, H, _, Pd = xs[0].shape
  J, Q, I, O = spec.groups, spec.chunk, spec.in_rows, spec.out_rows
  out = jax.ShapeDtypeStruct((B, H, c.shape[2], Pd), F32)
  parts = _parts(d, _SCAN_PARTS)
  ins = tuple(xs) + tuple(bs) + (c,) + parts + (h_in,)
  specs = ([_chunk_of(x, Q * I) for x in xs] + [_chunk_of(b, Q * I, J) for b in bs]
           + [_chunk_of(c, Q * O, J)] + [_per_chunk(p) for p in parts] + [_per_chunk(h_in)])
  return _call(spec, _scan_kernel, "scan", (B, H, d.a2.shape[2]), ins, specs, out,
               _chunk_of(out, Q * O))


def _dstates(spec: Spec, dy, c, d: Decays, dfinal, shape_PN, want_dh0: bool):
  """(dS_c [B, H, C, P, N] in `dot_dtype`, d h0 [B, H, P, N] fp32 or None); `dfinal` None: the
  final state's cotangent is zero (not read)."""
  B, H, C = d.a2.shape[:3]
  Pd, N = shape_PN
  outs = (jax.ShapeDtypeStruct((B, H, C, Pd, N), jnp.dtype(spec.dot_dtype)),)
  outs += (jax.ShapeDtypeStruct((B, H, Pd, N), F32),) if want_dh0 else ()
  final = () if dfinal is None else (dfinal,)
  parts = _parts(d, _DSTATES_PARTS)
  specs = ([_whole(dy), _whole(c, spec.groups)] + [_whole(p) for p in parts]
           + [_whole(f) for f in final])
  kernel = functools.partial(_dstates_kernel, with_final=dfinal is not None)
  res = _call(spec, kernel, "dstates", (B, H), (dy, c) + parts + final, specs, outs,
              tuple(_whole(o) for o in outs))
  return res[0], (res[1] if want_dh0 else None)


def _dchunk(spec: Spec, xs, bs, c, d: Decays, dy, h_in, ds):
  """(dx_i..., dB_i..., dC, da): per-head arrays viewed [B, G, J, ...] (a free reshape), one
  program per chunk of a group, its heads in the kernel's loop."""
  B, H = xs[0].shape[:2]
  G, J, C = bs[0].shape[1], spec.groups, d.a2.shape[2]
  nI, nO = spec.chunk * spec.in_rows, spec.chunk * spec.out_rows
  grp = lambda z: z.reshape((B, G, J) + z.shape[2:])
  heads = lambda z, n: pl.BlockSpec((None, None, J, n, z.shape[-1]),
                                    lambda b, g, c: (b, g, 0, c, 0))
  chunk_heads = lambda z: pl.BlockSpec((None, None, J, None) + z.shape[4:],
                                       lambda b, g, c: (b, g, 0, c, 0, 0))
  group = lambda z, n: pl.BlockSpec((None, None, n, z.shape[-1]), lambda b, g, c: (b, g, c, 0))
  xg, dyg, h_g, ds_g = [grp(z) for z in xs], grp(dy), grp(h_in), grp(ds)
  parts = tuple(grp(p) for p in _parts(d, _DCHUNK_PARTS))
  a_g = parts[0]
  ins = tuple(xg) + tuple(bs) + (c,) + parts + (dyg, h_g, ds_g)
  specs = ([heads(z, nI) for z in xg] + [group(z, nI) for z in bs] + [group(c, nO)]
           + [chunk_heads(p) for p in parts]
           + [heads(dyg, nO), chunk_heads(h_g), chunk_heads(ds_g)])
  sds = lambda z, dtype=None: jax.ShapeDtypeStruct(z.shape, dtype or z.dtype)
  outs = tuple(sds(z) for z in xg) + tuple(sds(z) for z in bs) + (sds(c), sds(a_g, F32))
  out_specs = ([heads(z, nI) for z in xg] + [group(z, nI) for z in bs]
               + [group(c, nO), chunk_heads(a_g)])
  res = _call(spec, _dchunk_kernel, "dchunk", (B, G, C), ins, specs, outs, tuple(out_specs))
  R = spec.inputs
  ungrp = lambda z: z.reshape((B, H) + z.shape[3:])
  return tuple(ungrp(z) for z in res[:R]), tuple(res[R:2 * R]), res[2 * R], ungrp(res[-1])


# ---------------------------------------------------------------- custom VJP

def log2_decays(a):
  """Kernel-layout log-decays a [B, H, C, 1, Q] (natural units) in log2 units, floored at NEG
  (module docstring). (d a2 / d a = log2 e off the floor, which only a start's -inf reaches.)"""
  return jnp.maximum(a.astype(F32) * LOG2E, NEG)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(spec: Spec, xs, bs, c, a, h0):
  """Kernel-layout SSD (x_i [B, H, T x I, P], B_i [B, G, T x I, N], C [B, G, T x O, N], a
  [B, H, C, 1, Q] (natural units), h0 [B, H, P, N] fp32 or None): (y [B, H, T x O, P] fp32,
  final state [B, H, P, N] fp32). The kernels read `log2_decays(a)` and the sums the states
  kernel makes of it (`Decays`, kept for the backward); their da is a's cotangent (each
  exponent's chain rule through 2^x = e^(x ln 2) folded in)."""
  return _core_fwd(spec, xs, bs, c, a, h0)[0]


def _value(p):
  """A primal as custom_vjp's symbolic-zeros rules hand it (`CustomVJPPrimal`), unwrapped."""
  return getattr(p, "value", p)


def _zero(ct) -> bool:
  return isinstance(ct, jax.custom_derivatives.SymbolicZero)


def _core_fwd(spec, xs, bs, c, a, h0):
  xs, bs, c, a, h0 = jax.tree.map(_value, (xs, bs, c, a, h0))
  h_in, final, d = _states(spec, xs, bs, log2_decays(a), h0)
  return (_scan(spec, xs, bs, c, d, h_in), final), (xs, bs, c, d, h0, h_in)


def _core_bwd(spec, res, cts):
  """Symbolic zeros (`defvjp(symbolic_zeros=True)`): a final state no one reads (training's
  full forward) has a zero cotangent, and the dstates kernel then starts from 0 itself, so no
  zero [B, H, P, N] array is made (a kernel of its own) and read."""
  xs, bs, c, d, h0, h_in = res
  dy, dfinal = cts
  dy = jnp.zeros(dy.shape, dy.dtype) if _zero(dy) else dy
  dfinal = None if _zero(dfinal) else dfinal
  ds, dh0 = _dstates(spec, dy, c, d, dfinal, h_in.shape[-2:], h0 is not None)
  dxs, dbs, dc, da = _dchunk(spec, xs, bs, c, d, dy, h_in, ds)
  return dxs, dbs, dc, da, dh0


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------- public entry

def unsupported(x_shape, b_shape, chunk: int, plat: str | None = None, *, in_rows: int = 1,
                out_rows: int = 1) -> str | None:
  """Why the kernel cannot take these shapes on platform `plat` (None: it can); `in_rows`,
  `out_rows`: rows a token of the inputs and outputs (MIMO's 2r and r columns)."""
  plat = kernel_choice.target() if plat is None else kernel_choice.normalize(plat)
  Q = min(int(chunk), x_shape[1])
  if plat == "gpu":
    p2 = lambda n: n >= 16 and n & (n - 1) == 0
    for name, n in (("chunk x input rows", Q * in_rows), ("chunk x output rows", Q * out_rows),
                    ("head_dim", x_shape[-1]), ("d_state", b_shape[-1])):
      if not p2(n):
        return f"Triton tiles need powers of two >= 16: {name} is {n}"
    if Q * max(in_rows, out_rows) > GPU_MAX_ROWS or Q * out_rows > GPU_MAX_CHUNK:
      return (f"chunk {Q} x rows ({in_rows} in, {out_rows} out) exceeds [{GPU_MAX_CHUNK}, "
              f"{GPU_MAX_ROWS}]: the [chunk, chunk] fp32 tiles of one program exceed an "
              "H100's shared memory (256 x 256 did; larger than these not checked)")
  if plat == "tpu" and Q % 8:
    return f"TPU tiles need a chunk that is a multiple of 8, got {Q}"
  return None


def _local(spec: Spec, xs, bs, c, a, h0):
  """One device's call on arrays [B, T, X, rows, K] (rows a token: 1, or MIMO's columns): time
  padded to whole chunks, heads first and rows in time ([B, X, T x rows, K]; a [B, H, C, 1,
  Q]), the custom-VJP core, back to (y [B, T, H, O, P], final)."""
  Bsz, T, H = xs[0].shape[:3]
  Q = spec.chunk
  nc = -(-T // Q)
  pad = nc * Q - T
  padT = lambda z: jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2)) if pad else z

  def layout(z):
    z = padT(z).transpose(0, 2, 1, 3, 4)
    return z.reshape(z.shape[:2] + (-1, z.shape[-1]))

  a_l = padT(a).transpose(0, 2, 1).reshape(Bsz, H, nc, 1, Q)
  h0 = None if h0 is None else h0.astype(F32)
  y, final = _core(spec, tuple(layout(z) for z in xs), tuple(layout(z) for z in bs),
                   layout(c), a_l, h0)
  y = y.reshape(Bsz, H, nc * Q, spec.out_rows, -1)[:, :, :T]
  return y.transpose(0, 2, 1, 3, 4), final


def _sharded(fn, *args):
  """fn(*args) under `jax.shard_map` over the active `sharding.use_rules` mesh (a plain call
  outside one): XLA does not partition Pallas calls. Rows (every array's first axis) follow
  the `batch` rule; heads, groups and time stay whole on every device."""
  active = sharding.active()
  if active is None:
    return fn(*args)
  mesh, rules = active
  first = jax.tree.leaves(args)[0]
  batch = sharding.activation_spec(("batch",), first.shape[:1], mesh, rules)[0]
  specs = jax.tree.map(lambda z: P(batch), args)
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(batch),
                       check_vma=False)(*args)


def _spec(T: int, H: int, G: int, chunk: int, dot_dtype, interpret, R: int, I: int, O: int,
          warps, stages) -> Spec:
  if interpret is None:
    interpret = kernel_choice.target() == "cpu"
  return Spec(max(1, min(int(chunk), T)), H // G,
              jnp.dtype(F32 if dot_dtype is None else dot_dtype).name, bool(interpret), R, I,
              O, int(warps), int(stages), ex2=not interpret and kernel_choice.target() == "gpu")


def ssd_kernel(x_BTHP, a_BTH, b_BTGN, c_BTGN, *, chunk: int, h0_BHPN=None, extra=None,
               reset_BT=None, dot_dtype=None, interpret: bool | None = None, warps: int = 4,
               stages: int = 2):
  """`ssd.ssd_chunked` through the kernels (module docstring), same arguments and returns:
  (y_BTHP fp32, final state h_BHPN fp32). `extra = (x2_BTHP, b2_BTGN)`: a second input
  x2_t B2_t^T per token (Mamba-3's trapezoid), through the same kernels.

  interpret: the Pallas interpreter (default: on CPU). warps / stages: Triton's."""
  _, T, H, G = ssd._check(x_BTHP, a_BTH, b_BTGN, c_BTGN)
  a = ssd.restart_decay(a_BTH, reset_BT).astype(F32)
  xs, bs = (x_BTHP,), (b_BTGN,)
  if extra is not None:
    x2, b2 = extra
    if x2.shape != x_BTHP.shape or b2.shape != b_BTGN.shape:
      raise ValueError(f"extra = (x2 {x2.shape}, B2 {b2.shape}) must have x's and B's shapes "
                       f"({x_BTHP.shape}, {b_BTGN.shape})")
    xs, bs = xs + (x2,), bs + (b2,)
  spec = _spec(T, H, G, chunk, dot_dtype, interpret, len(xs), 1, 1, warps, stages)
  row = lambda z: z[..., None, :]
  y, final = _sharded(functools.partial(_local, spec), tuple(map(row, xs)),
                      tuple(map(row, bs)), row(c_BTGN), a, h0_BHPN)
  return y[:, :, :, 0], final


def mimo_kernel(u_BTHIP, a_BTH, k_BTHIN, q_BTHON, *, chunk: int, h0_BHPN=None, reset_BT=None,
                dot_dtype=None, interpret: bool | None = None, warps: int = 4,
                stages: int = 2):
  """Mamba-3's MIMO SSD through the kernels (`mamba3.mimo_chunked`'s arguments and returns:
  y [B, T, H, O, P], h_T [B, H, P, N] fp32): its I input columns (u_i, k_i) are I input rows a
  token, its O output columns q_o O output rows a token (module docstring; keys and queries
  per head, G = H)."""
  Bsz, T, H, I, Pd = u_BTHIP.shape
  O, N = q_BTHON.shape[3], q_BTHON.shape[-1]
  if a_BTH.shape != (Bsz, T, H) or k_BTHIN.shape != (Bsz, T, H, I, N) or \
      q_BTHON.shape[:3] != (Bsz, T, H):
    raise ValueError(f"MIMO SSD shapes do not fit: u {u_BTHIP.shape}, a {a_BTH.shape}, "
                     f"k {k_BTHIN.shape}, q {q_BTHON.shape}")
  a = ssd.restart_decay(a_BTH, reset_BT).astype(F32)
  spec = _spec(T, H, H, chunk, dot_dtype, interpret, 1, I, O, warps, stages)
  return _sharded(functools.partial(_local, spec), (u_BTHIP,), (k_BTHIN,), q_BTHON, a, h0_BHPN)


def use_kernel(x_shape, b_shape, chunk: int, *, what: str) -> bool:
  """Whether a mixer's chunked SSD takes the kernel (`kernel_choice.ssd_kernel`: a GPU or TPU,
  and these shapes fit `unsupported`; a misfit is logged once, naming `what`)."""
  return kernel_choice.ssd_kernel(lambda plat: unsupported(x_shape, b_shape, chunk, plat),
                                  what=what)


def chunked_mimo(full: bool, x_shape, k_shape, chunk: int, *, what: str):
  """`mimo_kernel` for a MIMO trapezoid's SSD (X [B, T, H, r, P], keys [B, T, H, r, N]: 2r
  input columns, r outputs) when a full forward's shapes fit the kernels on a GPU / TPU
  (`kernel_choice.ssd_kernel`), else None (the mixer keeps its XLA `mimo_chunked`)."""
  r = x_shape[3]
  flat = x_shape[:3] + x_shape[4:]
  why = lambda plat: unsupported(flat, k_shape[:3] + k_shape[4:], chunk, plat, in_rows=2 * r,
                                 out_rows=r)
  if full and kernel_choice.ssd_kernel(why, what=what):
    return mimo_kernel
  return None


def chunked_ssd(full: bool, x_shape, b_shape, chunk: int, *, what: str):
  """The chunked SSD a mixer call runs: a full forward (no decoding state) whose shapes the
  kernels take on a GPU / TPU (`use_kernel`) gets `ssd_kernel`, else `ssd.ssd_chunked` (same
  arguments and returns, the same numerics up to rounding)."""
  if full and use_kernel(x_shape, b_shape, chunk, what=what):
    return ssd_kernel
  return ssd.ssd_chunked
