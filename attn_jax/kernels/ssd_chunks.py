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

In-kernel exponents, in log2 units (a2 = a log2 e, then every exp is one `exp2`: one PTX
`ex2.approx.ftz` on a GPU, `decayed_tiles.exp2`). seg is a product of masked matrices,
seg = (M_le diag(a)) U_gt with M_le[t, r] = [r <= t], U_gt[r, s] = [r > s]; the 0/1 mask is
exact in bf16, so the product runs as three bf16 matmuls on the exact split a = hi + mid + lo
(`_mask_sum`): each entry a direct fp32 sum of its own terms, at the tensor cores' rate, not a
Q-deep fp32 loop (the same for da's sum over s < r). A and E are masked row sums. A matmul
multiplies -inf by the mask's zeros (NaN), so the kernels floor a2 at NEG = -1e30 first: a sum
holding a start is then <= -1e30 (its exp 0, as with -inf), every other sum unchanged; Q such
floors stay far from fp32's range. The a_{t0} gradient the kernel returns at a start is
discarded by `restart_decay`'s `where`, as in the XLA path. The index masks are built once per
program (`Masks`), outside the loops.

Precision (`ssd.py`'s "Precision"): decays, exponents, the carried states and accumulations
fp32; every matmul step the XLA path runs in `dot_dtype` takes its operands in `dot_dtype` here
(C B^T, its decayed product with x, the states, the state -> output, and their backward products
with the cotangents cast to it). The passing is the sequential fp32 recurrence here, a segsum
matmul in `ssd.pass_chunk_states`: the same sums, in another order.

Layout: heads first, [B, H, T, P] (B and C [B, G, T, N]; a [B, H, C, 1, Q]; the states
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
GPU_MAX_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static configuration of one call (hashable: a `custom_vjp` nondiff argument)."""
  chunk: int           # Q
  groups: int          # heads per B/C group (J = H / G)
  dot_dtype: str       # operand dtype of the matmul steps, and of the states written
  interpret: bool
  inputs: int = 1      # R: terms x_i B_i^T per token (2: Mamba-3's `extra`; 2r: MIMO)
  outputs: int = 1     # O: output columns C_o (r: MIMO)
  warps: int = 4       # Triton
  stages: int = 2
  ex2: bool = False    # exp2 as one PTX `ex2` (Triton on a GPU)


def _dot(a, b, dims=None):
  """fp32-accumulating matmul of two operands of one dtype."""
  return lax.dot_general(a, b, dims or (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _mask_sum(v, mask):
  """v @ mask for fp32 v [Q, K] and a 0/1 mask [K, K] (bf16, exact) as three bf16 matmuls on
  v's exact split v = hi + mid + lo (8 significant bits each; fp32 has 24): every product is
  exact, the sums accumulate in fp32, so each entry is a direct fp32 sum of its own terms, at
  a tensor core's bf16 rate rather than a Q-deep fp32 FMA loop (module docstring)."""
  hi = v.astype(BF16)
  r = v - hi.astype(F32)
  mid = r.astype(BF16)
  lo = (r - mid.astype(F32)).astype(BF16)
  return _dot(lo, mask) + _dot(mid, mask) + _dot(hi, mask)


class Masks:
  """A program's index masks, built once and shared by its loop's iterations: [t, s] lower
  (s <= t) and its strict upper complement, and the 0/1 matrices gt [r, s] = [r > s] and lt
  [r, s] = [r < s] (bf16) that `_mask_sum` multiplies by."""

  def __init__(self, Q: int):
    row = lax.broadcasted_iota(jnp.int32, (Q, Q), 0)
    col = lax.broadcasted_iota(jnp.int32, (Q, Q), 1)
    self.lower = col <= row
    self.upper = col > row
    self.gt = jnp.where(row > col, 1.0, 0.0).astype(BF16)
    self.lt = jnp.where(row < col, 1.0, 0.0).astype(BF16)


class Exps:
  """A chunk's exponents from its log-decays a [1, Q] (natural units), in log2 units
  (a2 = a log2 e, floored at NEG): A2, E2 [Q, 1] and the total z2 [1, 1]; `seg` adds L [t, s]
  = 2^seg2(t, s) = exp(seg(t, s)) on s <= t, else 0."""

  def __init__(self, spec: Spec, a_1Q, m: Masks, seg: bool = True):
    a = jnp.maximum(a_1Q.astype(F32) * LOG2E, NEG)
    terms = jnp.where(m.lower, a, 0.0)                             # [t, r] = a_r, r <= t
    self.A2 = jnp.sum(terms, axis=1, keepdims=True)                # [Q, 1]
    self.E2 = jnp.sum(jnp.where(m.upper, a, 0.0), axis=1, keepdims=True)
    self.z2 = jnp.sum(a, axis=1, keepdims=True)                    # [1, 1]
    self.spec = spec
    if seg:
      self.L = jnp.where(m.lower, self.exp(_mask_sum(terms, m.gt)), 0.0)

  def exp(self, x):
    return exp2(self.spec.ex2, x)


def _rows(ref, c, Q: int):
  """Chunk c's Q rows of a per-program [T, K] block."""
  return ref[pl.ds(pl.multiple_of(c * Q, Q), Q), :]


# ---------------------------------------------------------------- kernels

def _states_kernel(spec: Spec, *refs):
  """The states entering each chunk, passed along the chunks in one loop (one head):
  H_0 = h0, H_{c+1} = exp(z_c) H_c + S_c, S_c = sum_i sum_s exp(E_s) x_is B_is^T; writes
  H_c [P, N] in `dot_dtype` and the final state fp32 (refs: x_i..., B_i..., a, [h0], H,
  final)."""
  R, Q = spec.inputs, spec.chunk
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs, rest = refs[:R], refs[R:2 * R], refs[2 * R:]
  a_ref, rest = rest[0], rest[1:]
  h0_ref, (hin_ref, final_ref) = (rest[0], rest[1:]) if len(rest) == 3 else (None, rest)
  m = Masks(Q)
  Pd, N = hin_ref.shape[-2:]

  def chunk(c, h):
    e = Exps(spec, a_ref[c], m, seg=False)
    eE = e.exp(e.E2)
    s = 0.0
    for x_ref, b_ref in zip(xs, bs):
      xe = (_rows(x_ref, c, Q).astype(F32) * eE).astype(dt)
      s = s + _dot(xe, _rows(b_ref, c, Q).astype(dt), _AT_B)
    hin_ref[c] = h.astype(hin_ref.dtype)
    return e.exp(e.z2) * h + s

  h0 = jnp.zeros((Pd, N), F32) if h0_ref is None else h0_ref[...].astype(F32)
  final_ref[...] = lax.fori_loop(0, a_ref.shape[0], chunk, h0)


def _scan_kernel(spec: Spec, *refs):
  """y_o = sum_i (L o C_o B_i^T) x_i + exp(A) o (C_o H^T)  [Q, P]  (one chunk of one head;
  refs: x_i..., B_i..., C_o..., a, H, y_o...)."""
  R, O = spec.inputs, spec.outputs
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs, cs = refs[:R], refs[R:2 * R], refs[2 * R:2 * R + O]
  a_ref, h_ref = refs[2 * R + O:2 * R + O + 2]
  ys = refs[2 * R + O + 2:]
  e = Exps(spec, a_ref[...], Masks(spec.chunk))
  eA = e.exp(e.A2)
  h = h_ref[...].astype(dt)
  for c_ref, y_ref in zip(cs, ys):
    c = c_ref[...].astype(dt)
    y = 0.0
    for x_ref, b_ref in zip(xs, bs):
      cb = _dot(c, b_ref[...].astype(dt), _A_BT)                    # [t, s]
      y = y + _dot((cb * e.L).astype(dt), x_ref[...].astype(dt))
    y_ref[...] = y + eA * _dot(c, h, _A_BT)


def _dstates_kernel(spec: Spec, *refs):
  """The state cotangents, passed back along the chunks in one loop (one head): g_C = d final,
  dS_c = g_{c+1}, g_c = exp(z_c) g_{c+1} + sum_o sum_t exp(A_t) dy_ot C_ot^T, d h0 = g_0;
  writes dS_c [P, N] in `dot_dtype` (refs: dy_o..., C_o..., a, d final, dS, [d h0])."""
  O, Q = spec.outputs, spec.chunk
  dt = jnp.dtype(spec.dot_dtype)
  dys, cs = refs[:O], refs[O:2 * O]
  a_ref, dfinal_ref, ds_ref = refs[2 * O:2 * O + 3]
  dh0_ref = refs[2 * O + 3] if len(refs) > 2 * O + 3 else None
  m = Masks(Q)
  n = a_ref.shape[0]

  def chunk(k, g):
    c = n - 1 - k
    e = Exps(spec, a_ref[c], m, seg=False)
    eA = e.exp(e.A2)
    dh = 0.0
    for dy_ref, c_ref in zip(dys, cs):
      dya = (_rows(dy_ref, c, Q).astype(F32) * eA).astype(dt)
      dh = dh + _dot(dya, _rows(c_ref, c, Q).astype(dt), _AT_B)
    ds_ref[c] = g.astype(ds_ref.dtype)
    return e.exp(e.z2) * g + dh

  g = lax.fori_loop(0, n, chunk, dfinal_ref[...].astype(F32))
  if dh0_ref is not None:
    dh0_ref[...] = g


def _dchunk_kernel(spec: Spec, *refs):
  """Every per-token gradient of one chunk of a B/C group (module docstring), its J heads in
  one loop: dx_i and da per head, dB_i and dC_o summed over the group's heads in the loop
  (refs: x_i..., B_i..., C_o..., a, dy_o..., H, dS, then dx_i..., dB_i..., dC_o..., da; the
  per-head blocks [J, ...], indexed by the loop's head)."""
  R, O, J = spec.inputs, spec.outputs, spec.groups
  dt = jnp.dtype(spec.dot_dtype)
  it = iter(refs)
  take = lambda k: tuple(next(it) for _ in range(k))
  xs, bs, cs, (a_ref,), dys, (h_ref, ds_ref) = take(R), take(R), take(O), take(1), take(O), \
      take(2)
  dxs, dbs, dcs, (da_ref,) = take(R), take(R), take(O), take(1)
  m = Masks(spec.chunk)
  b = [r[...].astype(dt) for r in bs]
  c = [r[...].astype(dt) for r in cs]
  shared = J > 1 and R * O == 1     # C B^T once for the group's heads (Mamba-2)
  cb0 = _dot(c[0], b[0], _A_BT) if shared else None

  def head(j, carry):
    db_acc, dc_acc = list(carry[:R]), list(carry[R:])
    e = Exps(spec, a_ref[j], m)
    eA, eE = e.exp(e.A2), e.exp(e.E2)
    h, ds = h_ref[j].astype(dt), ds_ref[j].astype(dt)
    dy32 = [r[j].astype(F32) for r in dys]
    dy = [v.astype(dt) for v in dy32]
    g = 0.0
    for o in range(O):       # entering state: y_o += exp(A) o (C_o H^T)
      dc_acc[o] = dc_acc[o] + _dot((dy32[o] * eA).astype(dt), h)
      g = g + eA * jnp.sum(dy32[o] * _dot(c[o], h, _A_BT), axis=1, keepdims=True)   # [Q, 1]
    G, es = 0.0, 0.0
    for i in range(R):
      x32 = xs[i][j].astype(F32)
      x = x32.astype(dt)
      dx, db = 0.0, 0.0
      for o in range(O):     # intra-chunk: y_o = (L o C_o B_i^T) x_i
        dyx = _dot(dy[o], x, _A_BT)                                  # [t, s] = dy_t . x_s
        mm = (cb0 if shared else _dot(c[o], b[i], _A_BT)) * e.L
        dcb = (dyx * e.L).astype(dt)
        dx = dx + _dot(mm.astype(dt), dy[o], _AT_B)
        dc_acc[o] = dc_acc[o] + _dot(dcb, b[i])
        db = db + _dot(dcb, c[o], _AT_B)
        G = G + dyx * mm
      # chunk state: S = sum_s exp(E_s) x_s B_s^T
      bds = _dot(b[i], ds, _A_BT)                                    # [s, P] = dS B_s
      dxs[i][j] = (dx + eE * bds).astype(dxs[i].dtype)
      db_acc[i] = db_acc[i] + db + _dot((x32 * eE).astype(dt), ds)
      es = es + eE * jnp.sum(x32 * bds, axis=1, keepdims=True)      # [Q, 1]
    # da_r: seg's pairs s < r <= t, A's tokens t >= r, E's tokens s < r, and the passing's
    # exp(z) H (z = the chunk's sum) for every r (as a row [1, Q])
    W = _mask_sum(G, m.lt)                                           # [t, r] = sum_{s<r} G_ts
    da = jnp.sum(jnp.where(m.lower, W + g, 0.0), axis=0, keepdims=True)
    da = da + jnp.sum(jnp.where(m.upper, es, 0.0), axis=0, keepdims=True)
    hds = ds_ref[j].astype(F32) * h_ref[j].astype(F32)
    dz = e.exp(e.z2) * jnp.sum(jnp.sum(hds, axis=1, keepdims=True), axis=0, keepdims=True)
    da_ref[j] = da + dz
    return tuple(db_acc) + tuple(dc_acc)

  zeros = lambda like: jnp.zeros(like.shape, F32)
  init = tuple(zeros(v) for v in b) + tuple(zeros(v) for v in c)
  out = lax.fori_loop(0, J, head, init) if J > 1 else head(0, init)
  for ref, v in zip(dbs + dcs, out):
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
  """Block of the whole [T, K] (or [C, ...]) of one head of [B, H, ...] at grid (b, h); a
  group's array ([B, G, ...]) when `group` (J) > 1."""
  nd = x.ndim - 2
  return pl.BlockSpec((None, None) + x.shape[2:],
                      lambda b, h: (b, lax.div(h, jnp.int32(group))) + (0,) * nd)


def _chunk_of(spec: Spec, x, group: int = 1):
  """Block of chunk c of one head of [B, H, T, K] at grid (b, h, c) (a group's array when
  `group` > 1)."""
  Q, K = spec.chunk, x.shape[-1]
  return pl.BlockSpec((None, None, Q, K),
                      lambda b, h, c: (b, lax.div(h, jnp.int32(group)), c, 0))


def _per_chunk(x):
  """Block of chunk c of one head of [B, H, C, r, k] at grid (b, h, c)."""
  return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, c: (b, h, c, 0, 0))


def _states(spec: Spec, xs, bs, a, h0):
  """(H_c [B, H, C, P, N] in `dot_dtype`, final [B, H, P, N] fp32)."""
  B, H, _, Pd = xs[0].shape
  C, N, J = a.shape[2], bs[0].shape[-1], spec.groups
  outs = (jax.ShapeDtypeStruct((B, H, C, Pd, N), jnp.dtype(spec.dot_dtype)),
          jax.ShapeDtypeStruct((B, H, Pd, N), F32))
  ins = tuple(xs) + tuple(bs) + (a,) + (() if h0 is None else (h0,))
  specs = ([_whole(x) for x in xs] + [_whole(b, J) for b in bs] + [_whole(a)]
           + ([] if h0 is None else [_whole(h0)]))
  return _call(spec, _states_kernel, "states", (B, H), ins, specs, outs,
               tuple(_whole(o) for o in outs))


def _scan(spec: Spec, xs, bs, cs, a, h_in):
  """y_o [B, H, T, P] fp32 for each output column."""
  B, H, T, Pd = xs[0].shape
  J = spec.groups
  outs = tuple(jax.ShapeDtypeStruct((B, H, T, Pd), F32) for _ in cs)
  ins = tuple(xs) + tuple(bs) + tuple(cs) + (a, h_in)
  specs = ([_chunk_of(spec, x) for x in xs] + [_chunk_of(spec, z, J) for z in bs + cs]
           + [_per_chunk(a), _per_chunk(h_in)])
  return _call(spec, _scan_kernel, "scan", (B, H, a.shape[2]), ins, specs, outs,
               tuple(_chunk_of(spec, o) for o in outs))


def _dstates(spec: Spec, dys, cs, a, dfinal, want_dh0: bool):
  """(dS_c [B, H, C, P, N] in `dot_dtype`, d h0 [B, H, P, N] fp32 or None)."""
  B, H, C = a.shape[:3]
  Pd, N = dfinal.shape[-2:]
  outs = (jax.ShapeDtypeStruct((B, H, C, Pd, N), jnp.dtype(spec.dot_dtype)),)
  outs += (jax.ShapeDtypeStruct((B, H, Pd, N), F32),) if want_dh0 else ()
  ins = tuple(dys) + tuple(cs) + (a, dfinal)
  specs = ([_whole(d) for d in dys] + [_whole(c, spec.groups) for c in cs]
           + [_whole(a), _whole(dfinal)])
  res = _call(spec, _dstates_kernel, "dstates", (B, H), ins, specs, outs,
              tuple(_whole(o) for o in outs))
  return res[0], (res[1] if want_dh0 else None)


def _dchunk(spec: Spec, xs, bs, cs, a, dys, h_in, ds):
  """(dx_i..., dB_i..., dC_o..., da): per-head arrays viewed [B, G, J, ...] (a free reshape),
  one program per chunk of a group, its heads in the kernel's loop."""
  B, H, T, Pd = xs[0].shape
  G, J, C = bs[0].shape[1], spec.groups, a.shape[2]
  Q = spec.chunk
  grp = lambda z: z.reshape((B, G, J) + z.shape[2:])
  heads = lambda z: pl.BlockSpec((None, None, J, Q, z.shape[-1]),
                                 lambda b, g, c: (b, g, 0, c, 0))
  chunk_heads = lambda z: pl.BlockSpec((None, None, J, None) + z.shape[4:],
                                       lambda b, g, c: (b, g, 0, c, 0, 0))
  group = lambda z: pl.BlockSpec((None, None, Q, z.shape[-1]), lambda b, g, c: (b, g, c, 0))
  per_head_in = [grp(z) for z in xs]
  dy_in = [grp(z) for z in dys]
  a_g, h_g, ds_g = grp(a), grp(h_in), grp(ds)
  ins = tuple(per_head_in) + tuple(bs) + tuple(cs) + (a_g,) + tuple(dy_in) + (h_g, ds_g)
  specs = ([heads(z) for z in per_head_in] + [group(z) for z in bs + cs] + [chunk_heads(a_g)]
           + [heads(z) for z in dy_in] + [chunk_heads(h_g), chunk_heads(ds_g)])
  outs = (tuple(jax.ShapeDtypeStruct(z.shape, z.dtype) for z in per_head_in)
          + tuple(jax.ShapeDtypeStruct(z.shape, z.dtype) for z in bs + cs)
          + (jax.ShapeDtypeStruct(a_g.shape, F32),))
  out_specs = ([heads(z) for z in per_head_in] + [group(z) for z in bs + cs]
               + [chunk_heads(a_g)])
  res = _call(spec, _dchunk_kernel, "dchunk", (B, G, C), ins, specs, outs, tuple(out_specs))
  R, O = spec.inputs, spec.outputs
  ungrp = lambda z: z.reshape((B, H) + z.shape[3:])
  return (tuple(ungrp(z) for z in res[:R]), tuple(res[R:2 * R]), tuple(res[2 * R:2 * R + O]),
          ungrp(res[-1]))


# ---------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(spec: Spec, xs, bs, cs, a, h0):
  """Kernel-layout SSD (x_i [B, H, T, P], B_i, C_o [B, G, T, N], a [B, H, C, 1, Q], h0
  [B, H, P, N] fp32 or None): (y_o [B, H, T, P] fp32..., final state [B, H, P, N] fp32)."""
  return _core_fwd(spec, xs, bs, cs, a, h0)[0]


def _core_fwd(spec, xs, bs, cs, a, h0):
  h_in, final = _states(spec, xs, bs, a, h0)
  return (_scan(spec, xs, bs, cs, a, h_in), final), (xs, bs, cs, a, h0, h_in)


def _core_bwd(spec, res, cts):
  xs, bs, cs, a, h0, h_in = res
  dys, dfinal = cts
  ds, dh0 = _dstates(spec, dys, cs, a, dfinal, h0 is not None)
  dxs, dbs, dcs, da = _dchunk(spec, xs, bs, cs, a, dys, h_in, ds)
  return dxs, dbs, dcs, da, dh0


_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------- public entry

def unsupported(x_shape, b_shape, chunk: int, plat: str | None = None) -> str | None:
  """Why the kernel cannot take these shapes on platform `plat` (None: it can)."""
  plat = kernel_choice.target() if plat is None else kernel_choice.normalize(plat)
  Q = min(int(chunk), x_shape[1])
  if plat == "gpu":
    p2 = lambda n: n >= 16 and n & (n - 1) == 0
    for name, n in (("chunk", Q), ("head_dim", x_shape[-1]), ("d_state", b_shape[-1])):
      if not p2(n):
        return f"Triton tiles need powers of two >= 16: {name} is {n}"
    if Q > GPU_MAX_CHUNK:
      return (f"chunk {Q} > {GPU_MAX_CHUNK}: the [chunk, chunk] fp32 tiles of one program "
              "exceed an H100's shared memory (256 did; 128 not checked)")
  if plat == "tpu" and Q % 8:
    return f"TPU tiles need a chunk that is a multiple of 8, got {Q}"
  return None


def _local(spec: Spec, xs, bs, cs, a, h0):
  """One device's call: time padded to whole chunks, heads first ([B, H, T, P]; a [B, H, C, 1,
  Q]), the custom-VJP core, back to [B, T, H, P]: (y_o..., final)."""
  Bsz, T, H, _ = xs[0].shape
  Q = spec.chunk
  nc = -(-T // Q)
  pad = nc * Q - T
  padT = lambda z: jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2)) if pad else z
  heads_first = lambda zs: tuple(padT(z).transpose(0, 2, 1, 3) for z in zs)
  a_l = padT(a).transpose(0, 2, 1).reshape(Bsz, H, nc, 1, Q)
  h0 = None if h0 is None else h0.astype(F32)
  ys, final = _core(spec, heads_first(xs), heads_first(bs), heads_first(cs), a_l, h0)
  return tuple(y[:, :, :T].transpose(0, 2, 1, 3) for y in ys), final


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


def _spec(T: int, H: int, G: int, chunk: int, dot_dtype, interpret, R: int, O: int, warps,
          stages) -> Spec:
  if interpret is None:
    interpret = kernel_choice.target() == "cpu"
  return Spec(max(1, min(int(chunk), T)), H // G,
              jnp.dtype(F32 if dot_dtype is None else dot_dtype).name, bool(interpret), R, O,
              int(warps), int(stages), ex2=not interpret and kernel_choice.target() == "gpu")


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
  spec = _spec(T, H, G, chunk, dot_dtype, interpret, len(xs), 1, warps, stages)
  ys, final = _sharded(functools.partial(_local, spec), xs, bs, (c_BTGN,), a, h0_BHPN)
  return ys[0], final


def mimo_kernel(u_BTHIP, a_BTH, k_BTHIN, q_BTHON, *, chunk: int, h0_BHPN=None, reset_BT=None,
                dot_dtype=None, interpret: bool | None = None, warps: int = 4,
                stages: int = 2):
  """Mamba-3's MIMO SSD (`mamba3.mimo_chunked`, same arguments and returns: y [B, T, H, O, P],
  h_T [B, H, P, N] fp32) through the kernels: its I input columns (u_i, k_i) are the kernels'
  inputs x_i B_i^T, its O output columns q_o their outputs C_o (keys and queries per head,
  G = H)."""
  Bsz, T, H, I, Pd = u_BTHIP.shape
  O, N = q_BTHON.shape[3], q_BTHON.shape[-1]
  if a_BTH.shape != (Bsz, T, H) or k_BTHIN.shape != (Bsz, T, H, I, N) or \
      q_BTHON.shape[:3] != (Bsz, T, H):
    raise ValueError(f"MIMO SSD shapes do not fit: u {u_BTHIP.shape}, a {a_BTH.shape}, "
                     f"k {k_BTHIN.shape}, q {q_BTHON.shape}")
  a = ssd.restart_decay(a_BTH, reset_BT).astype(F32)
  cols = lambda z: tuple(z[:, :, :, i] for i in range(z.shape[3]))
  spec = _spec(T, H, H, chunk, dot_dtype, interpret, I, O, warps, stages)
  ys, final = _sharded(functools.partial(_local, spec), cols(u_BTHIP), cols(k_BTHIN),
                       cols(q_BTHON), a, h0_BHPN)
  return jnp.stack(ys, axis=3), final


def use_kernel(x_shape, b_shape, chunk: int, *, what: str) -> bool:
  """Whether a mixer's chunked SSD takes the kernel (`kernel_choice.ssd_kernel`: a GPU or TPU,
  and these shapes fit `unsupported`; a misfit is logged once, naming `what`)."""
  return kernel_choice.ssd_kernel(lambda plat: unsupported(x_shape, b_shape, chunk, plat),
                                  what=what)


def chunked_ssd(full: bool, x_shape, b_shape, chunk: int, *, what: str):
  """The chunked SSD a mixer call runs: a full forward (no decoding state) whose shapes the
  kernels take on a GPU / TPU (`use_kernel`) gets `ssd_kernel`, else `ssd.ssd_chunked` (same
  arguments and returns, the same numerics up to rounding)."""
  if full and use_kernel(x_shape, b_shape, chunk, what=what):
    return ssd_kernel
  return ssd.ssd_chunked
