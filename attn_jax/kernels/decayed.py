"""Decayed flash attention: one Pallas kernel for SISA, FoX, ALiBi (and plain attention).

With g_t a per-head cumulative log-decay (non-increasing along a document), the score of a
visible pair (i, j) is

    s_ij = scale q_i.k_j + [fox] (g_i - g_j) + [sisa] exp(g_i - g_j) (c_i . b_j)

- SISA: c = lambda_h R(Phi_i) C_i, b = R(Phi_j) B_j (lambda folded into c by the caller, so
  d lambda comes from c's cotangent by ordinary autodiff outside the kernel);
- FoX: g = cumsum log f;  ALiBi: FoX with g_t = -slope_h * t (fixed, no gradient wanted).

Every visible pair has g_i - g_j <= 0, so exp(g_i - g_j) <= 1 and nothing overflows at any
length: each [bq, bk] score tile is formed from O(tile) inputs (the rows' q, g, c and the
columns' k, g, b), with no reference point and no [T, T] tensor. A masked pair's difference
may be positive (g restarts per document, or j > i on a diagonal tile); it is replaced by
NEG_INF before the exponential, so its factor is 0, never inf. A *visible* pair with
g_i - g_j > 0 exists only across a document start (a shared-prefix key, segment 0, read by a
document whose g restarted): its SISA factor is set to 0 there (so are its gradients), and no
input makes the kernel overflow; within a document this is a no-op and the gradient exact.

Visibility (as `core.positional_mask`): key j is visible to query i iff pos_j >= 0 (padding is
-1), [causal] pos_j <= pos_i, [window W] pos_i - pos_j < W, and seg_j == seg_i or seg_j == 0
(packed documents with the shared prefix). Tiles are *skipped* by index: the kernel is for
one self-attention stream (T == S, positions increasing by one inside a document, padding -1),
so a key after the query's index is never visible (causal) and one W or more indices before it
is never visible (window). Positions decide the mask inside a visited tile.

Forward (`_fwd_*`, grid [B, H, T / bq]): one query tile against its key tiles, online softmax
in fp32 (row max floored at NEG_INF / 2, so a fully masked row has weight 0 everywhere),
returning the output and the row log-sum-exp lse (NEG_INF for a row that sees no key). Only the
tiles a query tile may see are visited (above the diagonal / outside the window skipped).

Two drivers run the same tile steps (`_fwd_step`, `_dq_step`, `_dkv_step`): on GPU (and in the
interpreter) a loop inside the program over whole-head refs of the other side, which stay in
HBM and are loaded tile by tile; on TPU a fourth grid axis over the other side's tiles
("arbitrary"), the carry in VMEM scratch, the out-of-range steps clamped to a loaded tile and
skipped, so Mosaic pipelines one tile at a time and VMEM use does not grow with T (whole-head
refs in VMEM ran out of it at T 8192 for the 152M presets).

The sink logit (one extra softmax column with zero value) is *not* in the kernel: with the
kernel's (o, lse) over the real keys, lse' = logaddexp(lse, sink_h) and o' = o exp(lse - lse')
is the same softmax (`decayed_attention`), and d sink follows by autodiff. The kernel's
custom VJP therefore takes a cotangent for lse as well: ds_ij = p_ij (dp_ij - D_i) with
D_i = do_i . o_i - dlse_i.

Backward (two kernels, as JAX's own GPU flash attention):
- `_dq_*`, grid [B, H, T / bq], over key tiles: dq = scale ds k, dc = (ds e) b, and
  the row part of dg, sum_j w_ij, with w = ds ([fox]) + ds e (c.b) ([sisa]);
- `_dkv_*`, grid [B, H, T / bk], over query tiles: dv = p^T do, dk = scale ds^T q,
  db = (ds e)^T c and the column part of dg, -sum_i w_ij. dk, dv are per query head and summed
  over the G heads of a kv head (GQA) outside.
The probabilities are recomputed from lse (fp32); residuals are the inputs, o and lse: O(T).

Layout: heads first, every block's last two dims equal to the array's (TPU's (8, 128) rule is
then met at any T and head dim): rows [B, H, nq, bq, D], per-row vectors [.., bq, 1],
per-column vectors [.., nk, 1, bk]; T is padded to a multiple of the tiles (padded keys have
position -1, padded queries are dropped).

Targets (`_compiler_params`): Mosaic on TPU (tiles of 128, the grid driver), Triton on GPU
(tiles of 64: at 128 the backward exceeds H100's shared memory; JAX's Mosaic GPU backend would
stage whole blocks in shared memory). fp32 x fp32 tile matmuls run at HIGHEST precision (Triton's
default is TF32). On CPU the kernel runs in the Pallas interpreter (tests).

Sharding (`_sharded`): XLA does not partition Pallas calls, so under `sharding.use_rules` the
call runs in a `jax.shard_map` over the active mesh: rows by the `batch` rule, heads by the
`heads` / `kv_heads` rules when both split alike (else heads replicated), time whole.

Choosing it (`use_kernel`, decided by `kernel_choice.decayed_kernel`): the mixers (SISA, FoX,
ALiBi) take the kernel in their full forward when `attention_impl == "auto"` and the program is
compiled for a GPU or TPU; the CPU keeps their blockwise paths. Inputs the kernel cannot take
(`unsupported`: a head dim or block the target cannot tile, T != S) fall back to the
blockwise path with one logged line naming why. Decoding: a prompt's first call into empty
dense caches (`decode.prefill`, `KVCache.fresh`) takes the kernel too (SISA, FoX, ALiBi: no
[T, T] scores for a long prompt); later chunks and the one-token step keep the mixers' cached
paths, whose cost is reading the cache (a bandwidth-bound product a fused kernel would not
speed up).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from attn_jax import kernel_choice, sharding


NEG_INF = -1e30
_A_BT = (((1,), (1,)), ((), ()))    # a @ b.T
_AT_B = (((0,), (0,)), ((), ()))    # a.T @ b
# Tile sizes by target: TPU lanes are 128 wide; on H100 the Triton kernels at 128 x 128 with
# head dim 128 exceed the 227 KiB of shared memory a block may use (the dkv pass holds dk, dv,
# db), 64 x 64 fits (checked by compiling for `targets.devices("h100x1")`).
BLOCKS = {"tpu": 128, "gpu": 64, "cpu": 128}
PASSES = ("fwd", "dq", "dkv")


@dataclasses.dataclass(frozen=True)
class GpuTuning:
  """Triton launch choices on a GPU: the tiles (shared by the three passes: the operands are
  tiled once) and, per pass (fwd, dq, dkv), warps per program and software-pipelining stages.
  `experiments/tune_decayed.py` times candidates on a GPU; each must compile for the target
  (shared memory: `tests/test_kernels.py` compiles the chosen ones for an H100)."""
  block_q: int = 64
  block_k: int = 64
  warps: tuple[int, int, int] = (4, 4, 4)
  stages: tuple[int, int, int] = (2, 2, 2)

  def label(self) -> str:
    return (f"{self.block_q}x{self.block_k} warps {'/'.join(map(str, self.warps))} "
            f"stages {'/'.join(map(str, self.stages))}")


# The GPU choice by head dim (default: `GpuTuning()`); the value used is the entry for the
# call's head dim. $ATTN_JAX_DECAYED_TUNING names a JSON file of choices measured on the
# machine (`experiments/tune_decayed.py --write`) that take precedence (`gpu_tuning`).
# Head dim 64 (the 152M / 369M presets): the fastest of tune_decayed.py --quick's ten on one
# H200 (2026-12-04; SISA fwd + bwd, 65,536 tokens, T 2048 and 8192: 11.0 / 37.7 ms a layer
# against 14.3 / 50.0 for 64 x 64, 4 warps, 2 stages; docs/benchmarks.md).
GPU_TUNING: dict[int, GpuTuning] = {64: GpuTuning(128, 32, (4, 4, 4), (3, 3, 3))}
TUNING_ENV = "ATTN_JAX_DECAYED_TUNING"


def write_tuning(path: str, choices: dict[int, GpuTuning]) -> None:
  """{head dim: choice} as JSON (`read_tuning`)."""
  with open(path, "w") as f:
    json.dump({str(d): dataclasses.asdict(t) for d, t in choices.items()}, f, indent=1)


def read_tuning(path: str) -> dict[int, GpuTuning]:
  """`write_tuning`'s file back; a malformed one is an error naming the file and the field."""
  with open(path) as f:
    raw = json.load(f)
  try:
    return {int(d): GpuTuning(int(t["block_q"]), int(t["block_k"]), tuple(map(int, t["warps"])),
                              tuple(map(int, t["stages"]))) for d, t in raw.items()}
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path}: not a decayed-attention tuning file ({TUNING_ENV}): "
                     f"{type(e).__name__} {e}") from None


@functools.lru_cache(maxsize=None)
def _env_tuning(path: str) -> dict[int, GpuTuning]:
  return read_tuning(path) if path else {}


def default_gpu_tuning(head_dim: int) -> GpuTuning:
  """The Triton choice for a head dim: $ATTN_JAX_DECAYED_TUNING's file, then `GPU_TUNING`,
  then `GpuTuning()`."""
  measured = _env_tuning(os.environ.get(TUNING_ENV, ""))
  return measured.get(head_dim) or GPU_TUNING.get(head_dim) or GpuTuning()


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static configuration of one kernel call (hashable: a `custom_vjp` nondiff argument)."""
  scale: float
  fox: bool            # add g_i - g_j to the logit
  sisa: bool           # add exp(g_i - g_j) c_i . b_j (c, b given)
  lo: bool             # g comes as a double word (hi, lo): g_i - g_j = (hi_i - hi_j) + (lo_i - lo_j)
  causal: bool
  window: int | None
  block_q: int
  block_k: int
  groups: int          # query heads per kv head (GQA)
  interpret: bool
  grid: bool = False   # the grid driver (TPU): the other side's tiles on grid axis 3
  warps: tuple[int, int, int] = (4, 4, 4)    # Triton, per pass (PASSES)
  stages: tuple[int, int, int] = (2, 2, 2)


class Rows(NamedTuple):
  """A query tile's operands: q [bq, D], g / glo / pos / seg [bq, 1], c [bq, ds] or None."""
  q: jax.Array
  g: jax.Array
  glo: jax.Array | None
  c: jax.Array | None
  pos: jax.Array
  seg: jax.Array


class Cols(NamedTuple):
  """A key tile's operands: k [bk, D], v [bk, Dv], g / glo / pos / seg [1, bk], b [bk, ds] or
  None."""
  k: jax.Array
  v: jax.Array
  g: jax.Array
  glo: jax.Array | None
  b: jax.Array | None
  pos: jax.Array
  seg: jax.Array


def _dot(a, b, dims=None):
  """fp32-accumulating matmul; fp32 operands at full precision (Triton's default for them is
  TF32, Mosaic's may round them too), bf16 ones native. Both precisions explicit: None would
  take `jax_default_matmul_precision`, and its "highest" asks Mosaic for an fp32 contraction
  of bf16 operands, which it refuses ("Bad lhs type")."""
  both32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(a, b, dims or (((1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST if both32 else lax.Precision.DEFAULT,
                         preferred_element_type=jnp.float32)


def _tile(spec: Spec, r: Rows, c: Cols):
  """Scores of one tile, [bq, bk] fp32, masked with NEG_INF; with the visibility, the decay
  factor e = exp(g_i - g_j) (0 where masked or g_i - g_j > 0) and c.b (SISA only, else
  None)."""
  s = _dot(r.q, c.k, _A_BT) * spec.scale
  vis = (c.pos >= 0) & ((c.seg == r.seg) | (c.seg == 0))
  if spec.causal:
    vis = vis & (c.pos <= r.pos)
  if spec.window is not None:
    vis = vis & (r.pos - c.pos < spec.window)
  dg = r.g - c.g
  if spec.lo:
    dg = dg + (r.glo - c.glo)
  e = cb = None
  if spec.fox:
    s = s + dg
  if spec.sisa:   # min(., 0): a no-op on pairs inside one document (module docstring)
    e = jnp.exp(jnp.where(vis & (dg <= 0), dg, NEG_INF))
    cb = _dot(r.c, c.b, _A_BT)
    s = s + e * cb
  return jnp.where(vis, s, NEG_INF), vis, e, cb


def _div(a, n: int):
  """a // n for a traced a >= 0 (truncating division: Mosaic lowers floor division of signed
  integers through `sign`, which asks the compiling host for its TPU generation)."""
  return lax.div(a, jnp.int32(n))


def _key_range(spec: Spec, i, nk: int):
  """Key tiles [lo, hi) that query tile i may see (index skipping, module docstring)."""
  bq, bk = spec.block_q, spec.block_k
  hi = jnp.minimum(nk, _div((i + 1) * bq - 1, bk) + 1) if spec.causal else nk
  lo = 0
  if spec.window is not None:
    lo = _div(jnp.maximum(0, i * bq - spec.window + 1), bk)
  return lo, hi


def _query_range(spec: Spec, j, nq: int):
  """Query tiles [lo, hi) that may see key tile j."""
  bq, bk = spec.block_q, spec.block_k
  lo = _div(j * bk, bq) if spec.causal else 0
  hi = nq
  if spec.window is not None:
    hi = jnp.minimum(nq, _div((j + 1) * bk + spec.window - 2, bq) + 1)
  return lo, hi


def _present(spec: Spec, name: str) -> bool:
  """Whether operand `name` is passed: c / b for SISA only, glo / kglo with a double-word g."""
  if name in ("c", "b"):
    return spec.sisa
  if name in ("glo", "kglo"):
    return spec.lo
  return True


def _split(spec: Spec, refs, names):
  """Name a kernel's refs in the order `_operands` lays them out (`_present` ones only)."""
  names = [n for n in names if _present(spec, n)]
  return dict(zip(names, refs)), refs[len(names):]


_ROW_NAMES = ("q", "g", "glo", "c", "pos", "seg")
_COL_NAMES = ("k", "v", "kg", "kglo", "b", "kpos", "kseg")


def _read(x, at):
  """Every present ref of `x` read through `at`."""
  return {n: at(r) for n, r in x.items()}


def _cols_at(spec: Spec, x, j=None) -> Cols:
  """The key tile (refs of one tile), or tile j of whole-head column refs ([nk, ...])."""
  v = _read(x, (lambda r: r[...]) if j is None else (lambda r: r[j]))
  return Cols(v["k"], v["v"], v["kg"], v.get("kglo"), v.get("b"), v["kpos"], v["kseg"])


def _rows_at(spec: Spec, x, i=None) -> Rows:
  """The query tile (refs of one tile), or tile i of whole-head row refs ([nq, ...])."""
  v = _read(x, (lambda r: r[...]) if i is None else (lambda r: r[i]))
  return Rows(v["q"], v["g"], v.get("glo"), v.get("c"), v["pos"], v["seg"])


# ---------------------------------------------------------------- kernels
#
# Each pass is an accumulation over the tiles of the other side: `init` (the carry), `step`
# (one tile's contribution), `finish` (write the outputs). Two drivers run them: a loop inside
# one program over whole-head refs of the other side (`_loop_*`: GPU, the interpreter) and,
# on TPU, a fourth grid axis over its tiles with the carry in VMEM scratch (`_grid_*`), so
# Mosaic streams one tile at a time and VMEM does not grow with T.

F32 = jnp.float32


def _fwd_init(spec: Spec, r: Rows, dv: int):
  bq = r.q.shape[0]
  return (jnp.full((bq, 1), NEG_INF / 2, F32), jnp.zeros((bq, 1), F32), jnp.zeros((bq, dv), F32))


def _fwd_step(spec: Spec, r: Rows, c: Cols, carry):
  m, l, acc = carry
  s, _, _, _ = _tile(spec, r, c)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)
  l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + _dot(p.astype(c.v.dtype), c.v)
  return m_new, l, acc


def _fwd_finish(spec: Spec, carry, o_ref, lse_ref):
  m, l, acc = carry
  seen = l > 0
  safe = jnp.where(seen, l, 1.0)
  o_ref[...] = jnp.where(seen, acc / safe, 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(safe), NEG_INF)


def _probs(spec: Spec, r: Rows, c: Cols, lse, delta, do):
  """Recomputed p, ds = p (dp - D), e and c.b of a tile (backward)."""
  s, vis, e, cb = _tile(spec, r, c)
  p = jnp.where(vis, jnp.exp(s - lse), 0.0)
  ds = p * (_dot(do, c.v, _A_BT) - delta)
  return p, ds, e, cb


def _decay_weight(spec: Spec, ds, e, cb):
  """w = d L / d (g_i - g_j) per pair: ds (FoX) + ds e c.b (SISA)."""
  w = ds if spec.fox else None
  if spec.sisa:
    t = ds * e * cb
    w = t if w is None else w + t
  return w


class Grads(NamedTuple):
  """A row tile's extra backward operands: do [bq, Dv], lse and delta [bq, 1]."""
  do: jax.Array
  lse: jax.Array
  delta: jax.Array


def _dq_init(spec: Spec, r: Rows):
  return (jnp.zeros(r.q.shape, F32), jnp.zeros((r.q.shape[0], 1), F32),
          jnp.zeros(r.c.shape, F32) if spec.sisa else None)


def _dq_step(spec: Spec, r: Rows, c: Cols, d: Grads, carry):
  dq, dg, dc = carry
  _, ds, e, cb = _probs(spec, r, c, d.lse, d.delta, d.do)
  dq = dq + _dot(ds.astype(c.k.dtype), c.k)
  w = _decay_weight(spec, ds, e, cb)
  if w is not None:
    dg = dg + jnp.sum(w, axis=1, keepdims=True)
  if spec.sisa:
    dc = dc + _dot((ds * e).astype(c.b.dtype), c.b)
  return dq, dg, dc


def _dq_finish(spec: Spec, carry, dq_ref, dg_ref, dc_ref):
  dq, dg, dc = carry
  dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)
  dg_ref[...] = dg
  if spec.sisa:
    dc_ref[...] = dc.astype(dc_ref.dtype)


def _dkv_init(spec: Spec, c: Cols):
  return (jnp.zeros(c.k.shape, F32), jnp.zeros(c.v.shape, F32),
          jnp.zeros((1, c.k.shape[0]), F32), jnp.zeros(c.b.shape, F32) if spec.sisa else None)


def _dkv_step(spec: Spec, r: Rows, c: Cols, d: Grads, carry):
  dk, dv, dg, db = carry
  p, ds, e, cb = _probs(spec, r, c, d.lse, d.delta, d.do)
  dv = dv + _dot(p.astype(d.do.dtype), d.do, _AT_B)
  dk = dk + _dot(ds.astype(r.q.dtype), r.q, _AT_B)
  w = _decay_weight(spec, ds, e, cb)
  if w is not None:
    dg = dg - jnp.sum(w, axis=0, keepdims=True)
  if spec.sisa:
    db = db + _dot((ds * e).astype(r.c.dtype), r.c, _AT_B)
  return dk, dv, dg, db


def _dkv_finish(spec: Spec, carry, dk_ref, dv_ref, dg_ref, db_ref):
  dk, dv, dg, db = carry
  dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dg
  if spec.sisa:
    db_ref[...] = db.astype(db_ref.dtype)


def _grads_at(refs, i=None) -> Grads:
  at = (lambda r: r[...]) if i is None else (lambda r: r[i])
  return Grads(*(at(r) for r in refs))


def _outs(spec: Spec, rest, n: int):
  """The n output refs (the last one SISA's only) and what follows them (scratch)."""
  n_out = n if spec.sisa else n - 1
  outs = list(rest[:n_out]) + [None] * (n - n_out)
  return outs, rest[n_out:]


# -- loop driver: the other side whole-head, looped over inside the program

def _loop_fwd(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r = _rows_at(spec, x)
  lo, hi = _key_range(spec, pl.program_id(2), nk)
  step = lambda j, carry: _fwd_step(spec, r, _cols_at(spec, x, j), carry)
  _fwd_finish(spec, lax.fori_loop(lo, hi, step, _fwd_init(spec, r, rest[0].shape[-1])), *rest)


def _loop_dq(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r, d = _rows_at(spec, x), _grads_at(rest[:3])
  lo, hi = _key_range(spec, pl.program_id(2), nk)
  step = lambda j, carry: _dq_step(spec, r, _cols_at(spec, x, j), d, carry)
  outs, _ = _outs(spec, rest[3:], 3)
  _dq_finish(spec, lax.fori_loop(lo, hi, step, _dq_init(spec, r)), *outs)


def _loop_dkv(spec: Spec, nq: int, *refs):
  y, refs = _split(spec, refs, _COL_NAMES)
  x, rest = _split(spec, refs, _ROW_NAMES)
  c = _cols_at(spec, y)
  lo, hi = _query_range(spec, pl.program_id(2), nq)
  step = lambda i, carry: _dkv_step(spec, _rows_at(spec, x, i), c, _grads_at(rest[:3], i),
                                    carry)
  outs, _ = _outs(spec, rest[3:], 4)
  _dkv_finish(spec, lax.fori_loop(lo, hi, step, _dkv_init(spec, c)), *outs)


# -- grid driver (TPU): grid axis 3 walks the other side's tiles, the carry in VMEM scratch

def _accumulate(init, step, finish, scratch, lo, hi, n: int):
  """Axis 3 of the grid: the scratch carry set to `init` at 0, each tile in [lo, hi) added,
  the outputs written at the last (tiles outside [lo, hi) are `_clamp`'s repeats: no compute).
  None parts of the carry (SISA's alone) have no scratch."""
  j = pl.program_id(3)

  def put(carry):
    for ref, value in zip(scratch, [c for c in carry if c is not None]):
      ref[...] = value

  def read():
    it = iter(scratch)
    return tuple(None if c is None else next(it)[...] for c in init)

  pl.when(j == 0)(lambda: put(init))
  pl.when((j >= lo) & (j < hi))(lambda: put(step(read())))
  pl.when(j == n - 1)(lambda: finish(read()))


def _grid_fwd(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r, c = _rows_at(spec, x), _cols_at(spec, x)
  (o_ref, lse_ref), scratch = rest[:2], rest[2:]
  lo, hi = _key_range(spec, pl.program_id(2), nk)
  _accumulate(_fwd_init(spec, r, o_ref.shape[-1]), lambda k: _fwd_step(spec, r, c, k),
              lambda k: _fwd_finish(spec, k, o_ref, lse_ref), scratch, lo, hi, nk)


def _grid_dq(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r, c, d = _rows_at(spec, x), _cols_at(spec, x), _grads_at(rest[:3])
  outs, scratch = _outs(spec, rest[3:], 3)
  lo, hi = _key_range(spec, pl.program_id(2), nk)
  _accumulate(_dq_init(spec, r), lambda k: _dq_step(spec, r, c, d, k),
              lambda k: _dq_finish(spec, k, *outs), scratch, lo, hi, nk)


def _grid_dkv(spec: Spec, nq: int, *refs):
  y, refs = _split(spec, refs, _COL_NAMES)
  x, rest = _split(spec, refs, _ROW_NAMES)
  r, c, d = _rows_at(spec, x), _cols_at(spec, y), _grads_at(rest[:3])
  outs, scratch = _outs(spec, rest[3:], 4)
  lo, hi = _query_range(spec, pl.program_id(2), nq)
  _accumulate(_dkv_init(spec, c), lambda k: _dkv_step(spec, r, c, d, k),
              lambda k: _dkv_finish(spec, k, *outs), scratch, lo, hi, nq)


# ---------------------------------------------------------------- layout

class Operands(NamedTuple):
  """Kernel-layout operands (module docstring): heads first, tiled along time."""
  q: jax.Array      # [B, H, nq, bq, D]
  g: jax.Array      # [B, H, nq, bq, 1] fp32
  glo: jax.Array | None   # [B, H, nq, bq, 1] fp32: the low word of a double-word g
  c: jax.Array | None   # [B, H, nq, bq, ds]
  pos: jax.Array    # [B, nq, bq, 1] int32
  seg: jax.Array    # [B, nq, bq, 1] int32
  k: jax.Array      # [B, K, nk, bk, D]
  v: jax.Array      # [B, K, nk, bk, Dv]
  kg: jax.Array     # [B, H, nk, 1, bk] fp32
  kglo: jax.Array | None  # [B, H, nk, 1, bk] fp32
  b: jax.Array | None   # [B, H, nk, bk, ds]
  kpos: jax.Array   # [B, nk, 1, bk]
  kseg: jax.Array   # [B, nk, 1, bk]


def _tiles(x_BTHD, n: int, bt: int):
  """[B, T, H, D] (T = n bt) -> [B, H, n, bt, D]."""
  B, T, H, D = x_BTHD.shape
  return x_BTHD.transpose(0, 2, 1, 3).reshape(B, H, n, bt, D)


def _untile(x_BHNTD, T: int):
  """Inverse of `_tiles`, cropped to T steps: [B, T, H, D]."""
  B, H, n, bt, D = x_BHNTD.shape
  return x_BHNTD.reshape(B, H, n * bt, D)[:, :, :T].transpose(0, 2, 1, 3)


def _operands(spec: Spec, q, k, v, g, glo, c, b, pos, seg) -> Operands:
  """Pad T to a multiple of both tiles (keys at position -1) and lay the operands out."""
  bq, bk = spec.block_q, spec.block_k
  B, T = q.shape[:2]
  tile = bq * bk // math.gcd(bq, bk)
  Tp = -(-T // tile) * tile
  nq, nk = Tp // bq, Tp // bk
  pad = Tp - T
  tpad = lambda x, val=0: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2),
                                  constant_values=val)
  q, k, v, pos, seg = tpad(q), tpad(k), tpad(v), tpad(pos, -1), tpad(seg, -1)
  heads = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)),
                            mode="edge").transpose(0, 2, 1)              # [B, H, Tp]
  gH = heads(g)
  loH = None if glo is None else heads(glo)
  return Operands(
      q=_tiles(q, nq, bq), g=gH.reshape(B, -1, nq, bq, 1),
      glo=None if loH is None else loH.reshape(B, -1, nq, bq, 1),
      kglo=None if loH is None else loH.reshape(B, -1, nk, 1, bk),
      c=None if c is None else _tiles(tpad(c), nq, bq),
      pos=pos.reshape(B, nq, bq, 1), seg=seg.reshape(B, nq, bq, 1),
      k=_tiles(k, nk, bk), v=_tiles(v, nk, bk), kg=gH.reshape(B, -1, nk, 1, bk),
      b=None if b is None else _tiles(tpad(b), nk, bk),
      kpos=pos.reshape(B, nk, 1, bk), kseg=seg.reshape(B, nk, 1, bk))


def _head(b, h):
  """Leading indices of a per-query-head array at grid index (b, h)."""
  return (b, h)


def _sides(ops: Operands, groups: int):
  """The row operands and the column operands, each with the map from the grid's (b, h) to
  its leading indices: per query head, per kv head (GQA: head h reads kv head h // groups) or
  per row (positions and segments, shared by every head). Absent operands are None."""
  kv, row = (lambda b, h: (b, _div(h, groups))), (lambda b, h: (b,))
  rows = [(ops.q, _head), (ops.g, _head), (ops.glo, _head), (ops.c, _head), (ops.pos, row),
          (ops.seg, row)]
  cols = [(ops.k, kv), (ops.v, kv), (ops.kg, _head), (ops.kglo, _head), (ops.b, _head),
          (ops.kpos, row), (ops.kseg, row)]
  return rows, cols


def _present_items(items):
  return [it for it in items if it[0] is not None]


def _full(x, lead):
  """BlockSpec of x's whole trailing dims at grid index (b, h, i): `lead(b, h)` gives the
  leading indices."""
  nlead = len(lead(0, 0))
  zeros = (0,) * (x.ndim - nlead)
  return pl.BlockSpec((None,) * nlead + x.shape[nlead:], lambda b, h, i: lead(b, h) + zeros)


def _tile_spec(x, lead):
  """BlockSpec of one tile (grid axis 2 indexes the tile axis after `lead(b, h)`)."""
  nlead = len(lead(0, 0))
  shape = (None,) * (nlead + 1) + x.shape[nlead + 1:]
  zeros = (0,) * (x.ndim - nlead - 1)
  return pl.BlockSpec(shape, lambda b, h, i: lead(b, h) + (i,) + zeros)


def _specs(spec: Spec, ops: Operands, rows_tiled: bool):
  """(arrays, BlockSpecs) of the row and column operands for the loop driver: one tile of the
  tiled side, the whole head of the other."""
  row, col = (_tile_spec, _full) if rows_tiled else (_full, _tile_spec)
  rows, cols = _sides(ops, spec.groups)
  rows = [(a, lead, row) for a, lead in rows]
  cols = [(a, lead, col) for a, lead in cols]
  items = _present_items(rows + cols if rows_tiled else cols + rows)   # dkv reads keys first
  return [a for a, _, _ in items], [f(a, lead) for a, lead, f in items]


def _clamp(j, lo, hi):
  """Tile j kept within [lo, hi): a grid step outside the range maps to a tile already
  loaded, so Mosaic fetches nothing new for it (`_accumulate` skips its compute)."""
  return jnp.minimum(jnp.maximum(j, lo), hi - 1)


def _block(x, lead, tile):
  """BlockSpec of one tile of x at grid index (b, h, i, j): leading indices `lead(b, h)`, tile
  `tile(i, j)` on the tile axis after them."""
  nlead = len(lead(0, 0))
  shape = (None,) * (nlead + 1) + x.shape[nlead + 1:]
  zeros = (0,) * (x.ndim - nlead - 1)
  return pl.BlockSpec(shape, lambda b, h, i, j: lead(b, h) + (tile(i, j),) + zeros)


def _grid_specs(spec: Spec, ops: Operands, rows_outer: bool, extra=()):
  """(arrays, BlockSpecs) for the grid driver: one tile of every operand; the outer side's at
  grid axis 2, the inner side's at axis 3, clamped to the range the outer tile meets; `extra`
  (per-head row arrays: do, lse, delta) follow the rows."""
  nq, nk = ops.q.shape[2], ops.k.shape[2]
  if rows_outer:
    rt, ct = (lambda i, j: i), (lambda i, j: _clamp(j, *_key_range(spec, i, nk)))
  else:
    ct, rt = (lambda i, j: i), (lambda i, j: _clamp(j, *_query_range(spec, i, nq)))
  rows, cols = _sides(ops, spec.groups)
  rows = [(a, lead, rt) for a, lead in rows]
  cols = [(a, lead, ct) for a, lead in cols]
  items = (rows + cols if rows_outer else cols + rows) + [(a, _head, rt) for a in extra]
  items = _present_items(items)
  return [a for a, _, _ in items], [_block(a, lead, t) for a, lead, t in items]


def _out_blocks(outs):
  """Outputs: one tile per (b, h, outer tile), the same block for every inner step."""
  return tuple(_block(o, _head, lambda i, j: i) for o in outs)


def _compiler_params(spec: Spec, name: str):
  """The target's compiler: Mosaic on TPU (every grid axis independent), Triton on GPU (JAX's
  other GPU backend, Mosaic GPU, stages whole blocks in shared memory, and the whole-head K/V
  of this kernel do not fit there) with the pass's warps and stages (`GpuTuning`)."""
  if spec.interpret:
    return None
  plat = kernel_choice.target()
  if plat == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 3
                                + ("arbitrary",) * spec.grid)
  if plat == "gpu":
    from jax.experimental.pallas import triton as pltriton
    i = PASSES.index(name)
    return pltriton.CompilerParams(num_warps=spec.warps[i], num_stages=spec.stages[i])
  return None


def _call(spec: Spec, kernel, grid, ins, in_specs, outs, out_specs, scratch=()):
  """The Pallas call, named after its pass (decayed_fwd, decayed_dq, decayed_dkv: the name
  compile reports and profiles show); `scratch`: the grid driver's VMEM carry."""
  pass_name = kernel.func.__name__.split("_")[-1]
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=outs, interpret=spec.interpret, name="decayed_" + pass_name,
                        scratch_shapes=tuple(scratch),
                        compiler_params=_compiler_params(spec, pass_name))(*ins)


def _vmem(shapes):
  """VMEM scratch of fp32 arrays of these shapes (None: none)."""
  from jax.experimental.pallas import tpu as pltpu
  return [pltpu.VMEM(sh, F32) for sh in shapes if sh is not None]


def _forward(spec: Spec, ops: Operands):
  B, H, nq, bq, D = ops.q.shape
  nk, Dv = ops.k.shape[2], ops.v.shape[-1]
  outs = (jax.ShapeDtypeStruct((B, H, nq, bq, Dv), ops.q.dtype),
          jax.ShapeDtypeStruct((B, H, nq, bq, 1), F32))
  if spec.grid:
    ins, in_specs = _grid_specs(spec, ops, rows_outer=True)
    return _call(spec, functools.partial(_grid_fwd, spec, nk), (B, H, nq, nk), ins, in_specs,
                 outs, _out_blocks(outs), _vmem([(bq, 1), (bq, 1), (bq, Dv)]))
  ins, in_specs = _specs(spec, ops, rows_tiled=True)
  out_specs = (_tile_spec(outs[0], _head), _tile_spec(outs[1], _head))
  return _call(spec, functools.partial(_loop_fwd, spec, nk), (B, H, nq), ins, in_specs,
               outs, out_specs)


def _backward(spec: Spec, ops: Operands, do, lse, delta):
  """(dq, dg_row, dc) [row layout], (dk, dv, dg_col, db) [per query head, column layout]."""
  B, H, nq, bq, D = ops.q.shape
  nk, bk, Dv = ops.k.shape[2], ops.k.shape[3], ops.v.shape[-1]
  ds_ = ops.c.shape[-1] if spec.sisa else None
  extra = (do, lse, delta)
  row_outs = [jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype),
              jax.ShapeDtypeStruct((B, H, nq, bq, 1), F32)]
  col_outs = [jax.ShapeDtypeStruct((B, H, nk, bk, D), ops.k.dtype),
              jax.ShapeDtypeStruct((B, H, nk, bk, Dv), ops.v.dtype),
              jax.ShapeDtypeStruct((B, H, nk, 1, bk), F32)]
  if spec.sisa:
    row_outs.append(jax.ShapeDtypeStruct(ops.c.shape, ops.c.dtype))
    col_outs.append(jax.ShapeDtypeStruct(ops.b.shape, ops.b.dtype))
  row_outs, col_outs = tuple(row_outs), tuple(col_outs)
  if spec.grid:
    ins, in_specs = _grid_specs(spec, ops, rows_outer=True, extra=extra)
    row_grads = _call(spec, functools.partial(_grid_dq, spec, nk), (B, H, nq, nk), ins,
                      in_specs, row_outs, _out_blocks(row_outs),
                      _vmem([(bq, D), (bq, 1), ds_ and (bq, ds_)]))
    ins, in_specs = _grid_specs(spec, ops, rows_outer=False, extra=extra)
    col_grads = _call(spec, functools.partial(_grid_dkv, spec, nq), (B, H, nk, nq), ins,
                      in_specs, col_outs, _out_blocks(col_outs),
                      _vmem([(bk, D), (bk, Dv), (1, bk), ds_ and (bk, ds_)]))
    return row_grads, col_grads
  ins, in_specs = _specs(spec, ops, rows_tiled=True)     # dq pass: tiles of queries
  ins += list(extra)
  in_specs += [_tile_spec(a, _head) for a in extra]
  row_grads = _call(spec, functools.partial(_loop_dq, spec, nk), (B, H, nq), ins, in_specs,
                    row_outs, tuple(_tile_spec(o, _head) for o in row_outs))
  ins, in_specs = _specs(spec, ops, rows_tiled=False)    # dkv pass: tiles of keys
  ins += list(extra)
  in_specs += [_full(a, _head) for a in extra]
  col_grads = _call(spec, functools.partial(_loop_dkv, spec, nq), (B, H, nk), ins, in_specs,
                    col_outs, tuple(_tile_spec(o, _head) for o in col_outs))
  return row_grads, col_grads


# ---------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec: Spec, q, k, v, g, glo, c, b, pos, seg):
  """(o [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32) over the real keys (no sink)."""
  return _attend_fwd(spec, q, k, v, g, glo, c, b, pos, seg)[0]


def _attend_fwd(spec, q, k, v, g, glo, c, b, pos, seg):
  T = q.shape[1]
  ops = _operands(spec, q, k, v, g, glo, c, b, pos, seg)
  o, lse = _forward(spec, ops)
  out = (_untile(o, T), _untile(lse, T)[..., 0])
  return out, (q, k, v, g, glo, c, b, pos, seg, o, lse)


def _attend_bwd(spec, res, cts):
  q, k, v, g, glo, c, b, pos, seg, o, lse = res
  do_BTHE, dlse_BTH = cts
  B, T, H, D = q.shape
  K = k.shape[2]
  ops = _operands(spec, q, k, v, g, glo, c, b, pos, seg)
  nq, bq = ops.q.shape[2], ops.q.shape[3]
  do = _tiles(jnp.pad(do_BTHE, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0))), nq, bq)
  dlse = _tiles(jnp.pad(dlse_BTH.astype(jnp.float32)[..., None],
                        ((0, 0), (0, nq * bq - T), (0, 0), (0, 0))), nq, bq)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1,
                  keepdims=True) - dlse
  (dq, dg_row, *dc), (dk, dv, dg_col, *db) = _backward(spec, ops, do.astype(o.dtype), lse,
                                                      delta)
  dq = _untile(dq, T)
  dg = (_untile(dg_row, T)[..., 0]
        + dg_col.reshape(B, H, -1)[:, :, :T].transpose(0, 2, 1))
  group = lambda x: x.reshape(B, T, K, H // K, x.shape[-1]).sum(3)
  dk = group(_untile(dk, T).astype(jnp.float32)).astype(k.dtype)
  dv = group(_untile(dv, T).astype(jnp.float32)).astype(v.dtype)
  dc = _untile(dc[0], T).astype(c.dtype) if spec.sisa else None
  db = _untile(db[0], T).astype(b.dtype) if spec.sisa else None
  dglo = None if glo is None else dg.astype(glo.dtype)    # d/d lo = d/d hi
  return dq, dk, dv, dg.astype(g.dtype), dglo, dc, db, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


# ---------------------------------------------------------------- public entry

def unsupported(q_shape, k_shape, v_shape, *, block_q: int | None = None,
                block_k: int | None = None, plat: str | None = None) -> str | None:
  """Why the kernel cannot take these shapes on platform `plat` (None: it can)."""
  plat = kernel_choice.target() if plat is None else kernel_choice.normalize(plat)
  block_q = block_q or BLOCKS[plat]
  block_k = block_k or BLOCKS[plat]
  B, T, H, D = q_shape
  if k_shape[1] != T:
    return f"the kernel is for self-attention (T == S), got T {T}, S {k_shape[1]}"
  if H % k_shape[2]:
    return f"{H} query heads are not a multiple of {k_shape[2]} kv heads"
  if plat == "tpu":
    if block_q % 8 or block_k % 128:
      return f"TPU tiles need block_q % 8 == 0 and block_k % 128 == 0, got {block_q}, {block_k}"
  if plat == "gpu":
    p2 = lambda n: n > 0 and n & (n - 1) == 0
    for name, n in (("head dim", D), ("value head dim", v_shape[-1]), ("block_q", block_q),
                    ("block_k", block_k)):
      if not p2(n) or n < 16:
        return f"Triton tiles need powers of two >= 16: {name} is {n}"
  return None


def _local(spec: Spec, q, k, v, g, glo, c, b, pos, seg, sink):
  """One device's call: the kernel over the real keys, then the sink column by log-sum-exp."""
  o, lse = _attend(spec, q, k, v, g, glo, c, b, pos, seg)
  if sink is None:
    return o
  total = jnp.logaddexp(lse, sink.astype(jnp.float32)[None, None, :])
  return (o.astype(jnp.float32) * jnp.exp(lse - total)[..., None]).astype(o.dtype)


def _sharded(fn, args: dict, names: dict):
  """fn(**args) under `jax.shard_map` over the mesh of the active `sharding.use_rules` block
  (a plain call outside one): Pallas kernels are not partitioned by XLA. Rows follow the
  `batch` rule, heads the `heads` / `kv_heads` rules when both split alike (query head h reads
  kv head h // G, so a device's query heads then read exactly its kv heads), else heads are
  replicated; time is never split (each device sees whole rows). `names`: each argument's
  logical axes ("heads" for per-query-head ones)."""
  active = sharding.active()
  if active is None:
    return fn(**args)
  mesh, rules = active
  spec_of = lambda key: sharding.activation_spec(names[key], args[key].shape, mesh, rules)
  qs, ks = spec_of("q"), spec_of("k")
  heads = qs[2] if qs[2] == ks[2] else None
  batch = qs[0]
  axis = {"batch": batch, "heads": heads, "kv_heads": heads}
  keys = [key for key in args if args[key] is not None]
  spec = lambda key: P(*(axis.get(n) for n in names[key]))

  def body(*xs):
    return fn(**dict(args, **dict(zip(keys, xs))))

  return jax.shard_map(body, mesh=mesh, in_specs=tuple(spec(key) for key in keys),
                       out_specs=spec("q"), check_vma=False)(*(args[key] for key in keys))


_NAMES = {"q": ("batch", None, "heads", None), "k": ("batch", None, "kv_heads", None),
          "v": ("batch", None, "kv_heads", None), "g": ("batch", None, "heads"),
          "glo": ("batch", None, "heads"), "c": ("batch", None, "heads", None),
          "b": ("batch", None, "heads", None), "pos": ("batch", None),
          "seg": ("batch", None), "sink": ("heads",)}


def decayed_attention(q_BTHD, k_BTKD, v_BTKE, *, scale: float, g_BTH=None, g_lo_BTH=None,
                      c_BTHS=None,
                      b_BTHS=None, fox: bool = False, causal: bool = True,
                      window: int | None = None, positions_BT=None, segment_ids_BT=None,
                      sink_logit_H=None, block_q: int | None = None,
                      block_k: int | None = None, interpret: bool | None = None,
                      tile_grid: bool | None = None, gpu_tuning: GpuTuning | None = None):
  """Decayed attention through the kernel (module docstring): [B, T, H, Dv] in q's dtype.

  g_BTH: cumulative log-decay (fp32; None: no decay); g_lo_BTH: its low word when g is a
  double word (hi, lo) (fox.py's `_cumsum2`: each pair's difference is then rounded at its own
  size, not at |g|'s). fox: add g_i - g_j to the logit.
  c_BTHS / b_BTHS: SISA's query / key factors (lambda folded into c). positions_BT: None =
  0..T-1; -1 marks padding. segment_ids_BT: packed documents (0 = shared prefix). sink_logit_H:
  the extra softmax column. block_q / block_k: tile sizes (default `BLOCKS` of the platform).
  interpret: run the Pallas interpreter (default: on CPU). tile_grid: the grid driver, the
  other side's tiles on a grid axis with the carry in VMEM scratch (default: on TPU; the
  loop driver elsewhere). gpu_tuning: the Triton choices on a GPU (default:
  `default_gpu_tuning` of the head dim; block_q / block_k, when given, override its tiles)."""
  B, T, H, _ = q_BTHD.shape
  sisa = c_BTHS is not None
  if sisa != (b_BTHS is not None):
    raise ValueError("c and b come together (SISA) or not at all")
  if (fox or sisa) and g_BTH is None:
    raise ValueError("fox / SISA need the cumulative log-decay g_BTH")
  plat = kernel_choice.target()
  if interpret is None:
    interpret = plat == "cpu"
  if tile_grid is None:
    tile_grid = plat == "tpu"
  tune = gpu_tuning or default_gpu_tuning(q_BTHD.shape[-1])
  if plat == "gpu":
    block_q, block_k = block_q or tune.block_q, block_k or tune.block_k
  block_q, block_k = block_q or BLOCKS[plat], block_k or BLOCKS[plat]
  g = jnp.zeros((B, T, H), jnp.float32) if g_BTH is None else g_BTH
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions_BT is None \
      else positions_BT.astype(jnp.int32)
  seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT.astype(
      jnp.int32)
  spec = Spec(float(scale), bool(fox), sisa, g_lo_BTH is not None, bool(causal), window,
              int(block_q), int(block_k), H // k_BTKD.shape[2], bool(interpret),
              bool(tile_grid), tuple(tune.warps), tuple(tune.stages))
  args = dict(q=q_BTHD, k=k_BTKD, v=v_BTKE, g=g, glo=g_lo_BTH, c=c_BTHS, b=b_BTHS, pos=pos,
              seg=seg, sink=sink_logit_H)
  return _sharded(functools.partial(_local, spec), args, _NAMES)


# ---------------------------------------------------------------- choosing the kernel

def use_kernel(impl: str, q_shape, k_shape, v_shape, *, what: str) -> bool:
  """Whether a mixer's full forward takes the kernel (`kernel_choice.decayed_kernel`: "auto",
  on GPU / TPU, and these shapes fit `unsupported`; a misfit is logged once per reason, naming
  `what`, and the caller takes its blockwise path)."""
  return kernel_choice.decayed_kernel(
      impl, lambda plat: unsupported(q_shape, k_shape, v_shape, plat=plat), what=what)
