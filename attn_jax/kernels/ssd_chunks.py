"""Fused chunked SSD (Mamba-2's scalar-decay recurrence, `ssm/ssd.py`) in Pallas: four kernels.

Per chunk c of Q tokens and head h (one program each, grid [B, H, chunks]), with the chunk's
log-decays a_r (fp32, <= 0, -inf at a document start, `ssd.restart_decay`) and

    seg(t, s) = a_{s+1} + ... + a_t  (s <= t)      A_t = a_0 + ... + a_t
    E_s = a_{s+1} + ... + a_{Q-1}      (tokens 0 .. Q-1 of the chunk)

(all *direct* segment sums within the chunk, never differences of one running sum: `ssd.py`'s
convention), the chunked SSD is

    states      S_c   = sum_s exp(E_s) x_s B_s^T                                  [P, N]
    passing     H_c   = exp(z_{c-1}) H_{c-1} + S_{c-1}  (z the chunk's total log-decay; XLA:
                        `ssd.pass_chunk_states`, exact and small)
    scan        y_t   = sum_{s<=t} exp(seg(t, s)) (C_t . B_s) x_s + exp(A_t) H_c C_t

Forward: `_states` (S_c), `ssd.pass_chunk_states` in XLA, `_scan` (y: the intra-chunk product
C B^T, its decay mask and both outputs fused, so no [B, chunks, H, Q, Q] tensor is written).
Backward (custom VJP; the inputs are the residuals, S and H recomputed as mamba_ssm's Triton
backward does): `_dstates` (dH_c = sum_t exp(A_t) dy_t C_t^T), the passing's VJP in XLA (dS_c,
d z, d h0), and `_dchunk`, which gives every per-token gradient of a chunk at once:

    dx_s = sum_{t>=s} L_ts (C_t . B_s) dy_t + exp(E_s) dS B_s
    dC_t = sum_s L_ts (dy_t . x_s) B_s + exp(A_t) dy_t H
    dB_s = sum_t L_ts (dy_t . x_s) C_t + exp(E_s) dS^T x_s
    da_r = sum_{s < r <= t} G_ts + sum_{t >= r} g_t + sum_{s < r} e_s   (+ d z from the passing)

with L_ts = exp(seg(t, s)), G_ts = L_ts (C_t . B_s)(dy_t . x_s), g_t = exp(A_t) dy_t . (H C_t),
e_s = exp(E_s) x_s . (dS B_s): each exponent's cotangent goes to the a_r it sums. dB, dC come
per head and are summed over a group's heads in XLA. Four kernels (two forward, two backward,
and the states once more in the backward) against the authors' (state-spaces/mamba,
`ssd_combined.py`) five forward (chunk cumsum, C B^T, chunk states, state passing, chunk scan)
and a dozen or so backward (dstates, the passing's, dx, dB, dC, d(C B^T), the dA pieces, the
cumsum's, with recomputes): their cumsum, C B^T and dA work are folded into the chunk programs
here, and their state passing is XLA's `pass_chunk_states` (with its VJP) here.

A second input (`extra = (x2, B2)`, Mamba-3's trapezoid, `ssd.ssd_chunked(extra=)`) adds
x2_t B2_t^T per token: S and the intra-chunk output sum over the two inputs (x B^T and
x2 B2^T), and `_dchunk` gives dx2, dB2 as dx, dB, their G and e terms added to da's.

In-kernel exponents. seg is a product of masked matrices, seg = (M_le diag(a)) U_gt with
M_le[t, r] = [r <= t], U_gt[r, s] = [r > s]: one fp32 Q x Q x Q matmul at full precision
(IEEE on Triton), each entry a sum of its own terms (no difference). A and E are masked row
sums. A matmul multiplies -inf by the mask's zeros (NaN), so the kernels floor a at
NEG = -1e30 first: a sum holding a start is then <= -1e30 (its exp 0, as with -inf), every
other sum unchanged; Q such floors stay far from fp32's range. The a_{t0} gradient the kernel
returns at a start is discarded by `restart_decay`'s `where`, as in the XLA path.

Precision (`ssd.py`'s "Precision"): decays, exponents, states and accumulations fp32; every
matmul step the XLA path runs in `dot_dtype` takes its operands in `dot_dtype` here (C B^T,
its decayed product with x, the states, the state -> output, and their backward products with
the cotangents cast to it); the exponent and da products are fp32.

Layout: heads first and time in chunks, [B, H, chunks, Q, P] (B and C [B, G, chunks, Q, N],
a [B, H, chunks, 1, Q]); states [B, chunks, H, P, N] as `pass_chunk_states` takes them. Every
block's last two dims are the array's (TPU's tiling rule holds for any Q, P, N). T is padded to
whole chunks (a = 0, x = B = C = 0: the state is unchanged, the padded outputs dropped).

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
from attn_jax.ssm import ssd

F32 = jnp.float32
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
  dot_dtype: str       # operand dtype of the matmul steps
  interpret: bool
  inputs: int = 1      # terms x_i B_i^T per token (2: Mamba-3's `extra`)
  warps: int = 4       # Triton
  stages: int = 2


def _dot(a, b, dims=None):
  """fp32-accumulating matmul; fp32 x fp32 at full precision (Triton's default is TF32)."""
  both32 = a.dtype == F32 and b.dtype == F32
  return lax.dot_general(a, b, dims or (((1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST if both32 else None,
                         preferred_element_type=F32)


class Exps:
  """A chunk's exponents from its log-decays a [1, Q] (module docstring): L [Q (t), Q (s)]
  = exp(seg(t, s)) on s <= t else 0, A and E as columns [Q, 1]; the index grids row / col."""

  def __init__(self, a_1Q):
    Q = a_1Q.shape[-1]
    a = jnp.maximum(a_1Q.astype(F32), NEG)
    self.row = lax.broadcasted_iota(jnp.int32, (Q, Q), 0)
    self.col = lax.broadcasted_iota(jnp.int32, (Q, Q), 1)
    lower = self.col <= self.row
    terms = jnp.where(lower, a, 0.0)                               # [t, r] = a_r, r <= t
    self.A = jnp.sum(terms, axis=1, keepdims=True)                 # [Q, 1]
    self.E = jnp.sum(jnp.where(self.col > self.row, a, 0.0), axis=1, keepdims=True)
    seg = _dot(terms, jnp.where(self.row > self.col, 1.0, 0.0).astype(F32))
    self.L = jnp.where(lower, jnp.exp(seg), 0.0)


# ---------------------------------------------------------------- kernels (one chunk, one head)

def _states_kernel(spec: Spec, *refs):
  """S = sum_i sum_s exp(E_s) x_is B_is^T  [P, N]  (refs: x_i..., B_i..., a, S)."""
  R = spec.inputs
  dt = jnp.dtype(spec.dot_dtype)
  a_ref, s_ref = refs[2 * R:]
  eE = jnp.exp(Exps(a_ref[...]).E)
  s = 0.0
  for x_ref, b_ref in zip(refs[:R], refs[R:2 * R]):
    s = s + _dot((x_ref[...].astype(F32) * eE).astype(dt), b_ref[...].astype(dt), _AT_B)
  s_ref[...] = s


def _scan_kernel(spec: Spec, *refs):
  """y = sum_i (L o C B_i^T) x_i + exp(A) o (C H^T)  [Q, P]  (refs: x_i..., B_i..., C, a, H,
  y)."""
  R = spec.inputs
  dt = jnp.dtype(spec.dot_dtype)
  c_ref, a_ref, h_ref, y_ref = refs[2 * R:]
  e = Exps(a_ref[...])
  c = c_ref[...].astype(dt)
  y = jnp.exp(e.A) * _dot(c, h_ref[...].astype(dt), _A_BT)
  for x_ref, b_ref in zip(refs[:R], refs[R:2 * R]):
    cb = _dot(c, b_ref[...].astype(dt), _A_BT)
    y = y + _dot((cb * e.L).astype(dt), x_ref[...].astype(dt))
  y_ref[...] = y


def _dstates_kernel(spec: Spec, dy_ref, c_ref, a_ref, dh_ref):
  """dH = sum_t exp(A_t) dy_t C_t^T  [P, N]."""
  dt = jnp.dtype(spec.dot_dtype)
  e = Exps(a_ref[...])
  dya = (dy_ref[...].astype(F32) * jnp.exp(e.A)).astype(dt)
  dh_ref[...] = _dot(dya, c_ref[...].astype(dt), _AT_B)


def _dchunk_kernel(spec: Spec, *refs):
  """dx_i, dB_i (this head's share), dC (idem) and da of one chunk (module docstring; refs:
  x_i..., B_i..., C, a, dy, H, dS, then dx_i..., dB_i..., dC, da)."""
  R = spec.inputs
  dt = jnp.dtype(spec.dot_dtype)
  xs, bs = refs[:R], refs[R:2 * R]
  c_ref, a_ref, dy_ref, h_ref, ds_ref = refs[2 * R:2 * R + 5]
  outs = refs[2 * R + 5:]
  dx_refs, db_refs, (dc_ref, da_ref) = outs[:R], outs[R:2 * R], outs[2 * R:]
  e = Exps(a_ref[...])
  dy32 = dy_ref[...].astype(F32)
  c, dy = c_ref[...].astype(dt), dy32.astype(dt)
  h, ds = h_ref[...].astype(dt), ds_ref[...].astype(dt)
  eA, eE = jnp.exp(e.A), jnp.exp(e.E)
  # entering state: y += exp(A) o (C H^T)
  dc = _dot((dy32 * eA).astype(dt), h)
  g = eA * jnp.sum(dy32 * _dot(c, h, _A_BT), axis=1, keepdims=True)       # [Q, 1]
  G, es = 0.0, 0.0
  for x_ref, b_ref, dx_ref, db_ref in zip(xs, bs, dx_refs, db_refs):
    x32 = x_ref[...].astype(F32)
    x, b = x32.astype(dt), b_ref[...].astype(dt)
    # intra-chunk: y = (L o C B^T) x
    cb = _dot(c, b, _A_BT)                                         # [t, s]
    m = cb * e.L
    dyx = _dot(dy, x, _A_BT)                                       # [t, s] = dy_t . x_s
    dcb = (dyx * e.L).astype(dt)
    dx = _dot(m.astype(dt), dy, _AT_B)
    dc = dc + _dot(dcb, b)
    db = _dot(dcb, c, _AT_B)
    G = G + dyx * m
    # chunk state: S = sum_s exp(E_s) x_s B_s^T
    bds = _dot(b, ds, _A_BT)                                       # [s, P] = dS B_s
    dx_ref[...] = (dx + eE * bds).astype(dx_ref.dtype)
    db_ref[...] = (db + _dot((x32 * eE).astype(dt), ds)).astype(db_ref.dtype)
    es = es + eE * jnp.sum(x32 * bds, axis=1, keepdims=True)      # [Q, 1]
  # da_r: seg's pairs s < r <= t, A's tokens t >= r, E's tokens s < r (as a row [1, Q])
  W = _dot(G, jnp.where(e.row < e.col, 1.0, 0.0).astype(F32))     # [t, r] = sum_{s<r} G_ts
  da = jnp.sum(jnp.where(e.col <= e.row, W + g, 0.0), axis=0, keepdims=True)
  da = da + jnp.sum(jnp.where(e.row < e.col, es, 0.0), axis=0, keepdims=True)
  dc_ref[...] = dc.astype(dc_ref.dtype)
  da_ref[...] = da


# ---------------------------------------------------------------- calls

def _compiler_params(spec: Spec):
  """Mosaic on TPU (every grid axis independent), Triton on GPU, none in the interpreter."""
  if spec.interpret:
    return None
  plat = kernel_choice.target()
  if plat == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
  if plat == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=spec.warps, num_stages=spec.stages)
  return None


def _per_head(x):
  """Block of one chunk of one head of [B, H, C, r, k] at grid (b, h, c)."""
  return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, c: (b, h, c, 0, 0))


def _per_group(spec: Spec, x):
  """Block of one chunk of head h's group of [B, G, C, Q, N]."""
  return pl.BlockSpec((None, None, None) + x.shape[3:],
                      lambda b, h, c: (b, lax.div(h, jnp.int32(spec.groups)), c, 0, 0))


def _state_block(x):
  """Block of one state of [B, C, H, P, N] at grid (b, h, c)."""
  return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, c: (b, c, h, 0, 0))


def _call(spec: Spec, kernel, name: str, grid, ins, in_specs, outs, out_specs):
  return pl.pallas_call(functools.partial(kernel, spec), grid=grid, in_specs=in_specs,
                        out_specs=out_specs, out_shape=outs, interpret=spec.interpret,
                        name="ssd_" + name, compiler_params=_compiler_params(spec))(*ins)


def _inputs(spec: Spec, xs, bs):
  """The inputs' arrays and blocks: x_i... (per head), B_i... (per group)."""
  return (tuple(xs) + tuple(bs), [_per_head(x) for x in xs] + [_per_group(spec, b) for b in bs])


def _states(spec: Spec, xs, bs, a):
  B, H, C, Q, Pd = xs[0].shape
  N = bs[0].shape[-1]
  out = jax.ShapeDtypeStruct((B, C, H, Pd, N), F32)
  ins, specs = _inputs(spec, xs, bs)
  return _call(spec, _states_kernel, "states", (B, H, C), ins + (a,), specs + [_per_head(a)],
               out, _state_block(out))


def _scan(spec: Spec, xs, bs, c, a, h_in):
  out = jax.ShapeDtypeStruct(xs[0].shape, F32)
  ins, specs = _inputs(spec, xs, bs)
  return _call(spec, _scan_kernel, "scan", out.shape[:3], ins + (c, a, h_in),
               specs + [_per_group(spec, c), _per_head(a), _state_block(h_in)], out,
               _per_head(out))


def _dstates(spec: Spec, dy, c, a):
  B, H, C, Q, Pd = dy.shape
  out = jax.ShapeDtypeStruct((B, C, H, Pd, c.shape[-1]), F32)
  return _call(spec, _dstates_kernel, "dstates", (B, H, C), (dy, c, a),
               [_per_head(dy), _per_group(spec, c), _per_head(a)], out, _state_block(out))


def _dchunk(spec: Spec, xs, bs, c, a, dy, h_in, ds):
  """(dx_i..., dB_i... per head, dC per head, da)."""
  B, H, C, Q, Pd = xs[0].shape
  per_head = lambda like: jax.ShapeDtypeStruct(
      (B, H, C, Q, like.shape[-1]), like.dtype if spec.groups == 1 else F32)   # summed after
  outs = (tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs)
          + tuple(per_head(b) for b in bs) + (per_head(c), jax.ShapeDtypeStruct(a.shape, F32)))
  ins, specs = _inputs(spec, xs, bs)
  return _call(spec, _dchunk_kernel, "dchunk", (B, H, C), ins + (c, a, dy, h_in, ds),
               specs + [_per_group(spec, c), _per_head(a), _per_head(dy), _state_block(h_in),
                        _state_block(ds)], outs, tuple(_per_head(o) for o in outs))


def _passing(a, S, h0):
  """`ssd.pass_chunk_states` on kernel-layout decays a [B, H, C, 1, Q] (their chunk totals,
  a direct sum) and states S [B, C, H, P, N]: (H_in, final)."""
  z = jnp.sum(a[:, :, :, 0, :], axis=-1).transpose(0, 2, 1)      # [B, C, H]
  return ssd.pass_chunk_states(z, S, h0)


# ---------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(spec: Spec, xs, bs, c, a, h0):
  """Kernel-layout SSD of the inputs (x_i, B_i): (y [B, H, C, Q, P] fp32, final state
  [B, H, P, N] fp32)."""
  return _core_fwd(spec, xs, bs, c, a, h0)[0]


def _core_fwd(spec, xs, bs, c, a, h0):
  h_in, final = _passing(a, _states(spec, xs, bs, a), h0)
  return (_scan(spec, xs, bs, c, a, h_in), final), (xs, bs, c, a, h0)


def _core_bwd(spec, res, cts):
  xs, bs, c, a, h0 = res
  R = spec.inputs
  dy, dfinal = cts
  (h_in, _), vjp = jax.vjp(_passing, a, _states(spec, xs, bs, a), h0)
  dh = _dstates(spec, dy, c, a)
  da_z, ds, dh0 = vjp((dh, dfinal))
  grads = _dchunk(spec, xs, bs, c, a, dy, h_in, ds)
  dxs, dbs, dc, da = grads[:R], grads[R:2 * R], grads[2 * R], grads[2 * R + 1]

  def group(d, like):   # a group's heads' shares summed
    B, H, C, Q, N = d.shape
    return d.reshape(B, H // spec.groups, spec.groups, C, Q, N).sum(2).astype(like.dtype)

  return (tuple(dxs), tuple(group(d, b) for d, b in zip(dbs, bs)), group(dc, c), da + da_z,
          dh0)


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


def _local(spec: Spec, x, a, b, c, h0, x2=None, b2=None):
  """One device's call: layout, the custom-VJP core, back to [B, T, H, P]."""
  Bsz, T, H, Pd = x.shape
  G = b.shape[2]
  Q = spec.chunk
  nc = -(-T // Q)
  pad = nc * Q - T
  padT = lambda z: jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2)) if pad else z
  heads_first = lambda z: padT(z).transpose(0, 2, 1, 3).reshape(Bsz, -1, nc, Q, z.shape[-1])
  a_l = padT(a).transpose(0, 2, 1).reshape(Bsz, H, nc, 1, Q)
  h0 = None if h0 is None else h0.astype(F32)
  xs = tuple(heads_first(z) for z in (x, x2) if z is not None)
  bs = tuple(heads_first(z) for z in (b, b2) if z is not None)
  y, final = _core(spec, xs, bs, heads_first(c), a_l, h0)
  y = y.reshape(Bsz, H, nc * Q, Pd)[:, :, :T].transpose(0, 2, 1, 3)
  return y, final


def _sharded(fn, args: dict):
  """fn(**args) under `jax.shard_map` over the active `sharding.use_rules` mesh (a plain call
  outside one): XLA does not partition Pallas calls. Rows follow the `batch` rule; heads,
  groups and time stay whole on every device."""
  active = sharding.active()
  if active is None:
    return fn(**args)
  mesh, rules = active
  batch = sharding.activation_spec(("batch",), args["x"].shape[:1], mesh, rules)[0]
  keys = [k for k in args if args[k] is not None]
  spec = lambda k: P(batch, *(None,) * (args[k].ndim - 1))

  def body(*xs):
    return fn(**dict(args, **dict(zip(keys, xs))))

  return jax.shard_map(body, mesh=mesh, in_specs=tuple(spec(k) for k in keys),
                       out_specs=(P(batch, None, None, None), P(batch, None, None, None)),
                       check_vma=False)(*(args[k] for k in keys))


def ssd_kernel(x_BTHP, a_BTH, b_BTGN, c_BTGN, *, chunk: int, h0_BHPN=None, extra=None,
               reset_BT=None, dot_dtype=None, interpret: bool | None = None, warps: int = 4,
               stages: int = 2):
  """`ssd.ssd_chunked` through the kernels (module docstring), same arguments and returns:
  (y_BTHP fp32, final state h_BHPN fp32). `extra = (x2_BTHP, b2_BTGN)`: a second input
  x2_t B2_t^T per token (Mamba-3's trapezoid), through the same kernels.

  interpret: the Pallas interpreter (default: on CPU). warps / stages: Triton's."""
  _, T, H, G = ssd._check(x_BTHP, a_BTH, b_BTGN, c_BTGN)
  a = ssd.restart_decay(a_BTH, reset_BT).astype(F32)
  if interpret is None:
    interpret = kernel_choice.target() == "cpu"
  x2, b2 = (None, None) if extra is None else extra
  if extra is not None and (x2.shape != x_BTHP.shape or b2.shape != b_BTGN.shape):
    raise ValueError(f"extra = (x2 {x2.shape}, B2 {b2.shape}) must have x's and B's shapes "
                     f"({x_BTHP.shape}, {b_BTGN.shape})")
  spec = Spec(max(1, min(int(chunk), T)), H // G,
              jnp.dtype(F32 if dot_dtype is None else dot_dtype).name, bool(interpret),
              1 + (extra is not None), int(warps), int(stages))
  args = dict(x=x_BTHP, a=a, b=b_BTGN, c=c_BTGN, h0=h0_BHPN, x2=x2, b2=b2)
  return _sharded(functools.partial(_local, spec), args)


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
