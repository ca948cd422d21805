"""Decayed flash attention: one Pallas kernel for SISA, FoX, ALiBi (and plain attention).

With g_t a per-head cumulative log-decay (non-increasing along a document), the score of a
visible pair (i, j) is

    s_ij = scale q_i.k_j + [fox] (g_i - g_j) + [sisa] exp(g_i - g_j) (c_i . b_j)

- SISA: c = lambda_h R(Phi_i) C_i, b = R(Phi_j) B_j (lambda folded into c by the caller, so
  d lambda comes from c's cotangent by ordinary autodiff outside the kernel);
- FoX: g = cumsum log f;  ALiBi: FoX with g_t = -slope_h * t (fixed, no gradient wanted).

Every visible pair has g_i - g_j <= 0, so exp(g_i - g_j) <= 1 and nothing overflows at any
length: each score tile is formed from O(tile) inputs (the rows' q, g, c and the columns' k,
g, b), with references chosen per tile pair (never one for the whole row) and no [T, T]
tensor. A masked pair's difference
may be positive (g restarts per document, or j > i on a diagonal tile); it is replaced by
NEG_INF before the exponential, so its factor is 0, never inf. A *visible* pair with
g_i - g_j > 0 exists only across a document start (a shared-prefix key, segment 0, read by a
document whose g restarted): its SISA factor is set to 0 there (so are its gradients), and no
input makes the kernel overflow; within a document this is a no-op and the gradient exact.

Visibility (as `masks.positional_mask`): key j is visible to query i iff pos_j >= 0 (padding is
-1), [causal] pos_j <= pos_i, [window W] pos_i - pos_j < W, and seg_j == seg_i or seg_j == 0
(packed documents with the shared prefix). The kernel is for one self-attention stream (T == S,
positions increasing by one inside a document, padding -1), so a key tile after the query
tile's last index is never visible (causal) and one W or more indices before it never is
(window).

Tile classes (`_classes`, `_schedule`: in XLA before the call, one entry per tile pair, from
per-tile ranges of positions, segments and g): each (query tile, key tile) pair is EMPTY
(provably no visible pair: skipped, never loaded), FULL (provably every pair visible; for SISA
also max g of the query tile <= min g of the key tile), MASKED_FACTORED (SISA alone: a masked
tile whose decay still factors, the diagonal of a document) or PARTIAL (anything else). Each
program's schedule lists its tiles class by class; the loop driver runs one loop per class:
FULL tiles in the full form (no mask; FoX / ALiBi a per-key bias, SISA the decay factored per
tile pair), MASKED_FACTORED ones in the full form under the mask, PARTIAL ones in the partial
form (the mask and the decay per element): the forms and their maths are in `decayed_tiles`. The partial form is the exact per-pair definition above; the
full form equals it on a full tile (`decayed_tiles` says how the references are chosen and why
the roundings stay at each pair's own size).

Forward (`decayed_fwd`, grid [B, H, T / bq]): one query tile against its scheduled key tiles,
online softmax in fp32 log2 units (exp2 with log2 e folded in: one `ex2` per element on a GPU;
row max floored at NEG_INF / 2, so a fully masked row has weight 0 everywhere), returning the
output and the row log-sum-exp lse in natural units (NEG_INF for a row that sees no key).

Two drivers run the same tile steps (`decayed_tiles`): on GPU (and in the interpreter) loops
inside the program over whole-head refs of the other side, which stay in HBM and are loaded
tile by tile in schedule order; on TPU a fourth grid axis over the other side's tiles
("arbitrary"), the carry in VMEM scratch, the steps outside the index range clamped to a loaded
tile and skipped, so Mosaic pipelines one tile at a time and VMEM use does not grow with T
(whole-head refs in VMEM ran out of it at T 8192 for the 152M presets). There each visited
tile decides its class from its own ranges (`_grid_full`): on a FULL tile FoX / ALiBi take the
full form (frames from the loaded tiles, `_grid_frames`) and SISA the partial form's
arithmetic without the mask and with its decay the rank-one product of the pair's factors
(no exp per element; the widened matmul and its factored gradients would need accumulators
apart from the partial tiles' dc, db, as the tiles interleave on the grid); every other tile
the partial form.

The sink logit (one extra softmax column with zero value) is *not* in the kernel: with the
kernel's (o, lse) over the real keys, lse' = logaddexp(lse, sink_h) and o' = o exp(lse - lse')
is the same softmax (`decayed_attention`), and d sink follows by autodiff. The kernel's
custom VJP therefore takes a cotangent for lse as well: ds_ij = p_ij (dp_ij - D_i) with
D_i = do_i . o_i - dlse_i.

Backward (two kernels, as JAX's own GPU flash attention):
- `decayed_dq`, grid [B, H, T / bq], over key tiles: dq = scale ds k, for SISA dc, and the
  rows' part of dg, sum_j w_ij with w = ds ([fox]) + ds e (c.b) ([sisa]);
- `decayed_dkv`, grid [B, H, T / bk], over query tiles, in the transposed orientation (tiles
  [bk, bq], so dk += ds^T q and dv += p^T do have M = bk): dv, dk = scale ds^T q, db and the
  columns' part of dg, -sum_i w_ij with w = ds ([fox]) + ds e (c.b) ([sisa]). dk, dv are per
  query head and summed over the G heads of a kv head (GQA) outside.
The probabilities are recomputed from lse (fp32); residuals are the inputs, o and lse: O(T).

Layout: heads first, every block's last two dims equal to the array's (TPU's (8, 128) rule is
then met at any T and head dim): rows [B, H, nq, bq, D]; per-time vectors 1D per tile for the
loop driver ([.., n, bt]: Triton keeps one value per row in a slice layout), 2D for the grid
driver; each pass tiled by its own (block_q, block_k) (`Spec.tiles`); T is padded to a
multiple of every pass's tiles (padded keys have position -1, padded queries are dropped).

Targets (`_compiler_params`): Mosaic on TPU (tiles of 128, the grid driver), Triton on GPU
(`GpuTuning`: tiles, warps and stages per pass; JAX's Mosaic GPU backend would stage whole
blocks in shared memory). fp32 x fp32 tile matmuls run at HIGHEST precision (Triton's default is
TF32). On CPU the kernel runs in the Pallas interpreter (tests).

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
from attn_jax.kernels import decayed_tiles as T
from attn_jax.kernels.decayed_tiles import F32, Cols, Grads, Rows

# Tile sizes by target: TPU lanes are 128 wide; on H100 the Triton kernels at 128 x 128 with
# head dim 128 exceed the 227 KiB of shared memory a block may use (the dkv pass holds dk, dv,
# db), 64 x 64 fits (checked by compiling for `targets.devices("h100x1")`).
BLOCKS = {"tpu": 128, "gpu": 64, "cpu": 128}
PASSES = ("fwd", "dq", "dkv")


@dataclasses.dataclass(frozen=True)
class GpuTuning:
  """Triton launch choices on a GPU: the tiles of the fwd and dq passes (block_q x block_k),
  the dkv pass's (`dkv_tile`, (block_q, block_k); None: the same), and per pass (fwd, dq, dkv)
  warps per program and software-pipelining stages. The dkv pass holds a key tile and forms
  [bk, bq] tiles (`decayed_tiles`), so its block_k is the M of its products dk, dv: >= 64
  with warps a multiple of 4 for Hopper's wgmma (below that Triton emits Ampere's mma.sync).
  `experiments/tune_decayed.py` times candidates on a GPU; each must compile for the target
  (shared memory: `tests/test_kernels.py` compiles the chosen ones for an H100)."""
  block_q: int = 64
  block_k: int = 64
  warps: tuple[int, int, int] = (4, 4, 4)
  stages: tuple[int, int, int] = (2, 2, 2)
  dkv_tile: tuple[int, int] | None = None

  def label(self) -> str:
    dkv = f" dkv {self.dkv_tile[0]}x{self.dkv_tile[1]}" if self.dkv_tile else ""
    return (f"{self.block_q}x{self.block_k}{dkv} warps {'/'.join(map(str, self.warps))} "
            f"stages {'/'.join(map(str, self.stages))}")


# The GPU choice by head dim (default: `GpuTuning()`); the value used is the entry for the
# call's head dim. $ATTN_JAX_DECAYED_TUNING names a JSON file of choices measured on the
# machine (`experiments/tune_decayed.py --write`) that take precedence (`gpu_tuning`).
# Head dim 64 (the 152M / 369M presets): fwd and dq over 128 x 64 tiles (M 128 for wgmma),
# dkv over 64 x 128 (its M, the key tile, 128), 4 / 8 / 8 warps, chosen so each pass's
# products are Hopper wgmma when compiled for an H100 (the compiled-code census); not yet timed
# on a GPU (`experiments/tune_decayed.py` measures candidates).
GPU_TUNING: dict[int, GpuTuning] = {64: GpuTuning(128, 64, (4, 8, 8), (3, 2, 2), (64, 128))}
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
                              tuple(map(int, t["stages"])),
                              tuple(map(int, t["dkv_tile"])) if t.get("dkv_tile") else None)
            for d, t in raw.items()}
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
  lo: bool             # g as a double word (hi, lo): g_i - g_j = (hi_i - hi_j) + (lo_i - lo_j)
  causal: bool
  window: int | None
  block_q: int         # tiles of the fwd and dq passes
  block_k: int
  groups: int          # query heads per kv head (GQA)
  interpret: bool
  grid: bool = False   # the grid driver (TPU): the other side's tiles on grid axis 3
  warps: tuple[int, int, int] = (4, 4, 4)    # Triton, per pass (PASSES)
  stages: tuple[int, int, int] = (2, 2, 2)
  dkv_block_q: int = 0  # tiles of the dkv pass (0: block_q / block_k)
  dkv_block_k: int = 0
  ex2_asm: bool = False  # exp2 as one PTX ex2 (Triton on a GPU)

  @property
  def flat(self) -> bool:
    """Per-time vectors 1D in the kernel (the loop driver: Triton's slice layout holds one
    value per row; a [bq, 1] tensor would be replicated over the tile's columns and every op
    on it repeated per element), else 2D (the grid driver: Mosaic's tiles)."""
    return not self.grid

  def tiles(self, pass_name: str) -> tuple[int, int]:
    """(block_q, block_k) of a pass."""
    if pass_name == "dkv":
      return self.dkv_block_q or self.block_q, self.dkv_block_k or self.block_k
    return self.block_q, self.block_k


def _div(a, n: int):
  """a // n for a traced a >= 0 (truncating division: Mosaic lowers floor division of signed
  integers through `sign`, which asks the compiling host for its TPU generation)."""
  return lax.div(a, jnp.int32(n))


def _key_range(spec: Spec, i, nk: int, bq: int, bk: int):
  """Key tiles [lo, hi) that query tile i may see by index (module docstring)."""
  hi = jnp.minimum(nk, _div((i + 1) * bq - 1, bk) + 1) if spec.causal else nk
  lo = 0
  if spec.window is not None:
    lo = _div(jnp.maximum(0, i * bq - spec.window + 1), bk)
  return lo, hi


def _query_range(spec: Spec, j, nq: int, bq: int, bk: int):
  """Query tiles [lo, hi) that may see key tile j by index."""
  lo = _div(j * bk, bq) if spec.causal else 0
  hi = nq
  if spec.window is not None:
    hi = jnp.minimum(nq, _div((j + 1) * bk + spec.window - 2, bq) + 1)
  return lo, hi


# ---------------------------------------------------------------- layout

class Operands(NamedTuple):
  """Kernel-layout operands of one pass (module docstring): heads first, tiled along time;
  per-time vectors laid out for the pass's orientation (`decayed_tiles`): fwd / dq rows
  [.., bq, 1], columns [.., 1, bk]; dkv rows [.., 1, bq], columns [.., bk, 1]."""
  q: jax.Array      # [B, H, nq, bq, D]
  g: jax.Array      # [B, H, nq, *] fp32
  glo: jax.Array | None   # the low word of a double-word g
  c: jax.Array | None   # [B, H, nq, bq, ds]
  pos: jax.Array    # [B, nq, *] int32
  seg: jax.Array    # [B, nq, *] int32
  k: jax.Array      # [B, K, nk, bk, D]
  v: jax.Array      # [B, K, nk, bk, Dv]
  kg: jax.Array     # [B, H, nk, *] fp32
  kglo: jax.Array | None
  b: jax.Array | None   # [B, H, nk, bk, ds]
  kpos: jax.Array   # [B, nk, *]
  kseg: jax.Array   # [B, nk, *]
  meta: jax.Array   # [B, H, n_outer, 3 + n_inner] int32 (`_schedule`)
  sig: jax.Array    # [B, H, n_outer, n_inner] fp32, each scheduled pair's (R_I - R_J) log2 e
  rho: jax.Array | None     # the full form's row side (`_frames`), FoX or SISA
  cp: jax.Array | None      # SISA
  beta: jax.Array | None    # the full form's key side
  bp: jax.Array | None


def _tiles(x_BHTD, bt: int):
  """[B, H, T, D] (T = n bt) -> [B, H, n, bt, D]."""
  B, H, T, D = x_BHTD.shape
  return x_BHTD.reshape(B, H, T // bt, bt, D)


def _vec(x, bt: int, across: bool, flat: bool):
  """[..., T] -> [..., n, bt] (flat), else [..., n, bt, 1] (down a tile's rows) or
  [..., n, 1, bt] (across its columns)."""
  sh = x.shape[:-1] + (x.shape[-1] // bt,)
  return x.reshape(sh + ((bt,) if flat else (1, bt) if across else (bt, 1)))


def _untile_vec(x, T: int):
  """A per-time vector in tiles (any of `_vec`'s layouts) -> [B, T, H]."""
  B, H = x.shape[:2]
  return x.reshape(B, H, -1)[:, :, :T].transpose(0, 2, 1)


def _untile(x_BHNTD, T: int):
  """[B, H, n, bt, D] -> [B, T, H, D], cropped to T steps."""
  B, H, n, bt, D = x_BHNTD.shape
  return x_BHNTD.reshape(B, H, n * bt, D)[:, :, :T].transpose(0, 2, 1, 3)


def _padded_len(spec: Spec, T: int) -> int:
  """T rounded up to a multiple of every pass's tiles."""
  tile = 1
  for n in spec.tiles("fwd") + spec.tiles("dkv"):
    tile = tile * n // math.gcd(tile, n)
  return -(-T // tile) * tile


class Padded(NamedTuple):
  """The inputs heads first, padded to `_padded_len` (keys at position -1, g by its edge)."""
  q: jax.Array      # [B, H, Tp, D]
  k: jax.Array      # [B, K, Tp, D]
  v: jax.Array
  g: jax.Array      # [B, H, Tp] fp32
  glo: jax.Array | None
  c: jax.Array | None
  b: jax.Array | None
  pos: jax.Array    # [B, Tp]
  seg: jax.Array


def _pad(spec: Spec, q, k, v, g, glo, c, b, pos, seg) -> Padded:
  T = q.shape[1]
  pad = _padded_len(spec, T) - T
  tpad = lambda x, val=0: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2),
                                  constant_values=val)
  heads = lambda x: tpad(x).transpose(0, 2, 1, 3)
  vec = lambda x: jnp.pad(x.astype(F32), ((0, 0), (0, pad), (0, 0)),
                          mode="edge").transpose(0, 2, 1)
  return Padded(heads(q), heads(k), heads(v), vec(g), None if glo is None else vec(glo),
                None if c is None else heads(c), None if b is None else heads(b),
                tpad(pos, -1), tpad(seg, -1))


def _tile_stats(x_BT, bt: int):
  """(min, max) over each tile of bt steps: [B, n] each."""
  t = x_BT.reshape(x_BT.shape[:-1] + (-1, bt))
  return jnp.min(t, axis=-1), jnp.max(t, axis=-1)


class Frames(NamedTuple):
  """The full form's per-tile references and the operands built from them (`decayed_tiles`):
  R_I = max g (high word) over each query tile, R_J = min g over each key tile; per query
  rho = ((g - R_I) + lo) log2 e and c' = c exp(g - R_I); per key beta = ((R_J - g) - lo) log2 e
  and b' = b exp(R_J - g); per tile pair sig = (R_I - R_J) log2 e. On a full tile the three
  pieces of (g_i - g_j) log2 e = rho_i + sig + beta_j are each at most the pair's own size,
  so each is rounded at it; c' and b' scale by factors <= 1."""
  Rq: jax.Array     # [B, H, nq]
  Rk: jax.Array     # [B, H, nk]
  rho: jax.Array    # [B, H, Tp]
  beta: jax.Array
  cp: jax.Array | None      # [B, H, Tp, ds]
  bp: jax.Array | None
  sig: jax.Array    # [B, H, nq, nk]


def _frames(spec: Spec, x: Padded, bq: int, bk: int) -> Frames:
  B, H, Tp = x.g.shape
  Rq = jnp.max(x.g.reshape(B, H, -1, bq), axis=-1)
  Rk = jnp.min(x.g.reshape(B, H, -1, bk), axis=-1)
  rho = x.g - jnp.repeat(Rq, bq, axis=-1)
  beta = jnp.repeat(Rk, bk, axis=-1) - x.g
  if x.glo is not None:
    rho, beta = rho + x.glo, beta - x.glo
  rho, beta = rho * T.LOG2E, beta * T.LOG2E
  scaled = lambda a, f: None if a is None else (
      a.astype(F32) * jnp.exp2(f)[..., None]).astype(a.dtype)
  sig = (Rq[..., :, None] - Rk[..., None, :]) * T.LOG2E
  return Frames(Rq, Rk, rho, beta, scaled(x.c, rho), scaled(x.b, beta), sig)


FULL, MASKED_FACTORED, PARTIAL, EMPTY = 0, 1, 2, 3     # tile classes (`_classes`)
# SISA's decay factors on a masked tile (MASKED_FACTORED) while R_I - R_J stays below this many
# nats: the key factors exp(R_I - g_j) are then at most e^40 (fp32 and bf16 hold 3e38).
FACTOR_SPAN = 40.0


def _classes(spec: Spec, x: Padded, bq: int, bk: int, fr: Frames | None = None):
  """Each (query tile, key tile) pair's class, [B, H, nq, nk] int32:

  FULL             every pair visible, and for SISA the decay factors through the pair's
                   references with both factors <= 1 (R_I <= R_J, `_frames`);
  MASKED_FACTORED  (SISA without FoX) some pair may be masked, the decay factors: R_I <= R_J,
                   or the tiles lie in one document (one segment, no padding), g does not
                   rise anywhere from the first index of the two to the last (so a visible
                   pair, j <= i, has g_i <= g_j) and R_I - R_J <= FACTOR_SPAN (the key
                   factors exp(R_I - g_j) stay finite; on a visible pair the product is <= 1);
  PARTIAL          anything else that may have a visible pair: the mask and the per-element
                   decay (document boundaries, padding, a shared prefix read across a
                   document start, spans beyond FACTOR_SPAN);
  EMPTY            provably no visible pair (never visited).

  From per-tile ranges of positions, segments and g: a class is claimed only when the ranges
  prove it. Empty: the index skip of the module docstring (a key tile after the query tile,
  or W or more indices before it), all keys padding, [causal] every key position after every
  query position, [window] every pair W or more apart, or segment ranges that cannot meet (no
  key in segment 0). Full: no padding key, every key in segment 0 or all in the query tile's
  one segment, [causal] every key position <= every query position, [window] every pair less
  than W apart."""
  nq, nk = x.q.shape[2] // bq, x.q.shape[2] // bk
  qp0, qp1 = (a[:, :, None] for a in _tile_stats(x.pos, bq))
  kp0, kp1 = (a[:, None, :] for a in _tile_stats(x.pos, bk))
  qs0, qs1 = (a[:, :, None] for a in _tile_stats(x.seg, bq))
  ks0, ks1 = (a[:, None, :] for a in _tile_stats(x.seg, bk))
  i = jnp.arange(nq)[:, None]
  j = jnp.arange(nk)[None, :]
  empty = (kp1 < 0) | ((ks0 > 0) & ((ks1 < qs0) | (ks0 > qs1)))
  full = (kp0 >= 0) & (((ks0 == 0) & (ks1 == 0)) | ((ks0 == ks1) & (qs0 == qs1) & (ks0 == qs0)))
  if spec.causal:
    empty = empty | (j * bk > (i + 1) * bq - 1) | (kp0 > qp1)
    full = full & (kp1 <= qp0)
  if spec.window is not None:
    empty = empty | (i * bq - (j + 1) * bk + 1 >= spec.window) | (qp0 - kp1 >= spec.window)
    full = full & (qp1 - kp0 < spec.window)
  empty, full = empty[:, None], full[:, None]                         # [B, 1, nq, nk]
  factored = None
  if spec.sisa:
    fr = fr or _frames(spec, x, bq, bk)
    ordered = fr.Rq[..., :, None] <= fr.Rk[..., None, :]
    full = full & ordered
    if not spec.fox:
      one_doc = ((qs0 == qs1) & (ks0 == ks1) & (qs0 == ks0) & (kp0 >= 0) & (qp0 >= 0))[:, None]
      rises = jnp.cumsum(jnp.pad(x.g[..., 1:] > x.g[..., :-1], ((0, 0), (0, 0), (1, 0))),
                         axis=-1)                                      # [B, H, Tp]
      first = jnp.minimum(i * bq, j * bk)
      last = jnp.maximum((i + 1) * bq, (j + 1) * bk) - 1
      flat = jnp.take(rises, last, axis=-1) == jnp.take(rises, first, axis=-1)
      span_ok = fr.Rq[..., :, None] - fr.Rk[..., None, :] <= FACTOR_SPAN
      factored = ordered | (one_doc & flat & span_ok & spec.causal)
  shape = (x.q.shape[0], x.q.shape[1], nq, nk)
  cls = jnp.where(jnp.broadcast_to(full, shape), FULL, PARTIAL)
  if factored is not None:
    cls = jnp.where((cls == PARTIAL) & factored, MASKED_FACTORED, cls)
  return jnp.where(jnp.broadcast_to(empty, shape), EMPTY, cls).astype(jnp.int32)


def _schedule(cls, sig, rows_outer: bool):
  """Per outer tile, [n of each visited class (FULL, MASKED_FACTORED, PARTIAL), the inner
  tiles in class order] ([B, H, n_outer, 3 + n_inner] int32) and each scheduled pair's sig."""
  if not rows_outer:
    cls, sig = jnp.swapaxes(cls, -1, -2), jnp.swapaxes(sig, -1, -2)
  order = jnp.argsort(cls, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.stack([jnp.sum(cls == k, axis=-1) for k in (FULL, MASKED_FACTORED, PARTIAL)],
                     axis=-1)
  return (jnp.concatenate([counts.astype(jnp.int32), order], axis=-1),
          jnp.take_along_axis(sig, order, axis=-1))


def _layout(spec: Spec, x: Padded, pass_name: str) -> Operands:
  """One pass's operands (the dkv pass transposed: `decayed_tiles`); the full form's frames
  for the loop driver only (the grid driver builds FoX's from the loaded tiles: `_grid_frames`)."""
  bq, bk = spec.tiles(pass_name)
  t = pass_name == "dkv"
  opt = lambda a, f: None if a is None else f(a)
  rv = lambda a: _vec(a, bq, t, spec.flat)
  cv = lambda a: _vec(a, bk, not t, spec.flat)
  fr = _frames(spec, x, bq, bk)
  meta, sig = _schedule(_classes(spec, x, bq, bk, fr), fr.sig, rows_outer=not t)
  framed = spec.flat and (spec.fox or spec.sisa)
  sisa = framed and spec.sisa
  return Operands(
      q=_tiles(x.q, bq), g=rv(x.g), glo=opt(x.glo, rv), c=opt(x.c, lambda a: _tiles(a, bq)),
      pos=rv(x.pos), seg=rv(x.seg), k=_tiles(x.k, bk), v=_tiles(x.v, bk), kg=cv(x.g),
      kglo=opt(x.glo, cv), b=opt(x.b, lambda a: _tiles(a, bk)), kpos=cv(x.pos),
      kseg=cv(x.seg), meta=meta, sig=sig, rho=rv(fr.rho) if framed else None,
      cp=_tiles(fr.cp, bq) if sisa else None, beta=cv(fr.beta) if framed else None,
      bp=_tiles(fr.bp, bk) if sisa else None)


def _present(spec: Spec, name: str) -> bool:
  """Whether operand `name` is passed: c / b for SISA only, glo / kglo with a double-word g,
  the full form's frames (rho, beta; SISA's c', b') with the loop driver only."""
  if name in ("c", "b"):
    return spec.sisa
  if name in ("glo", "kglo"):
    return spec.lo
  if name in ("rho", "beta"):
    return spec.flat and (spec.fox or spec.sisa)
  if name in ("cp", "bp"):
    return spec.flat and spec.sisa
  return True


def _split(spec: Spec, refs, names):
  """Name a kernel's refs in the order `_operands` lays them out (`_present` ones only)."""
  names = [n for n in names if _present(spec, n)]
  return dict(zip(names, refs)), refs[len(names):]


_ROW_NAMES = ("q", "g", "glo", "c", "pos", "seg", "rho", "cp")
_COL_NAMES = ("k", "v", "kg", "kglo", "b", "kpos", "kseg", "beta", "bp")


def _read(x, at):
  """Every present ref of `x` read through `at`."""
  return {n: at(r) for n, r in x.items()}


def _cols_at(x, j=None) -> Cols:
  """The key tile (refs of one tile), or tile j of whole-head column refs ([nk, ...])."""
  v = _read({n: x[n] for n in _COL_NAMES if n in x},
            (lambda r: r[...]) if j is None else (lambda r: r[j]))
  return Cols(v["k"], v["v"], v["kg"], v.get("kglo"), v.get("b"), v["kpos"], v["kseg"],
              v.get("beta"), v.get("bp"))


def _rows_at(x, i=None) -> Rows:
  """The query tile (refs of one tile), or tile i of whole-head row refs ([nq, ...])."""
  v = _read({n: x[n] for n in _ROW_NAMES if n in x},
            (lambda r: r[...]) if i is None else (lambda r: r[i]))
  return Rows(v["q"], v["g"], v.get("glo"), v.get("c"), v["pos"], v["seg"], v.get("rho"),
              v.get("cp"))


def _grads_at(refs, i=None) -> Grads:
  """do, lse2, delta (and nu) of a query tile."""
  at = (lambda r: r[...]) if i is None else (lambda r: r[i])
  return Grads(*(at(r) for r in refs))


# ---------------------------------------------------------------- kernels
#
# Each pass is an accumulation over the tiles of the other side: `init` (the carry), a step
# per tile (`decayed_tiles`: full or partial form), `finish` (write the outputs). Two drivers
# run them: a loop inside one program over whole-head refs of the other side (`_loop_*`: GPU,
# the interpreter), visiting the full tiles, then the partial ones, of its schedule (`meta`:
# `_schedule`; empty tiles are never visited) and, on TPU, a fourth grid axis over the tiles
# the index range allows, the carry in VMEM scratch (`_grid_*`), each in the partial form.

def _n_out(spec: Spec, name: str) -> int:
  """How many outputs a pass writes (`_backward`'s lists)."""
  if name == "dq":
    return 1 + (spec.fox or spec.sisa) + spec.sisa
  return 2 + (spec.fox or spec.sisa) + spec.sisa


def _pad_outs(name: str, outs):
  """A pass's output refs, the absent ones (always the last: `_n_out`) as None."""
  outs = list(outs)
  return outs + [None] * ({"dq": 3, "dkv": 4}[name] - len(outs))


def _schedule_loops(sched, full_step, masked_step, partial_step, between, carry):
  """The schedule (`meta`, `sig` refs): its FULL tiles through full_step, its MASKED_FACTORED
  ones through masked_step (each (tile index, the pair's sig, carry)), `between` on the carry,
  its PARTIAL ones through partial_step (tile index, carry). masked_step None: none."""
  meta, sig = sched
  n0, n1, n2 = meta[0], meta[1], meta[2]
  carry = lax.fori_loop(0, n0, lambda t, cr: full_step(meta[3 + t], sig[t], cr), carry)
  if masked_step is not None:
    carry = lax.fori_loop(n0, n0 + n1, lambda t, cr: masked_step(meta[3 + t], sig[t], cr),
                          carry)
  carry = between(carry)
  return lax.fori_loop(n0 + n1, n0 + n1 + n2, lambda t, cr: partial_step(meta[3 + t], cr),
                       carry)


def _masks(spec: Spec) -> bool:
  """Whether a schedule may hold MASKED_FACTORED tiles (`_classes`)."""
  return spec.sisa and not spec.fox


_SCHED = ("meta", "sig")


def _loop_fwd(spec: Spec, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES + _SCHED)
  r = _rows_at(x)
  fr = T.row_frame(spec, r)
  carry = _schedule_loops(
      (x["meta"], x["sig"]), lambda j, sg, cr: T.fwd_full(spec, fr, r, _cols_at(x, j), sg, cr),
      (lambda j, sg, cr: T.fwd_full(spec, fr, r, _cols_at(x, j), sg, cr, masked=True))
      if _masks(spec) else None,
      lambda j, cr: T.fwd_partial(spec, r, _cols_at(x, j), cr), lambda cr: cr,
      T.fwd_init(spec, r.q.shape[0], rest[0].shape[-1]))
  T.fwd_finish(carry, *rest)


def _loop_dq(spec: Spec, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES + _SCHED)
  r, d = _rows_at(x), _grads_at(rest[:3])
  fr = T.row_frame(spec, r)
  lam2 = d.lse2 - r.rho if spec.fox else d.lse2
  carry = _schedule_loops(
      (x["meta"], x["sig"]),
      lambda j, sg, cr: T.dq_full(spec, fr, lam2, r, _cols_at(x, j), d, sg, cr),
      (lambda j, sg, cr: T.dq_full(spec, fr, lam2, r, _cols_at(x, j), d, sg, cr, masked=True))
      if _masks(spec) else None,
      lambda j, cr: T.dq_partial(spec, r, _cols_at(x, j), d, cr),
      lambda cr: T.dq_unfactor(spec, fr, r, cr), T.dq_init(spec, r))
  T.dq_finish(spec, carry, *_pad_outs("dq", rest[3:]))


def _loop_dkv(spec: Spec, *refs):
  y, refs = _split(spec, refs, _COL_NAMES + _SCHED)
  x, rest = _split(spec, refs, _ROW_NAMES)
  n_extra = 3 + spec.fox
  c = _cols_at(y)
  grads = lambda i: _grads_at(rest[:n_extra], i)
  full = lambda i, sg, cr: T.dkv_full(spec, _rows_at(x, i), c, grads(i), sg, cr)
  masked = lambda i, sg, cr: T.dkv_full(spec, _rows_at(x, i), c, grads(i), sg, cr, masked=True)
  part = lambda i, cr: T.dkv_partial(spec, _rows_at(x, i), c, grads(i), cr)
  carry = _schedule_loops((y["meta"], y["sig"]), full, masked if _masks(spec) else None, part,
                          lambda cr: T.dkv_unfactor(spec, c, cr), T.dkv_init(spec, c))
  T.dkv_finish(spec, carry, *_pad_outs("dkv", rest[n_extra:]))


# -- grid driver (TPU): grid axis 3 walks the other side's tiles, the carry in VMEM scratch

def _accumulate(init, step, finish, scratch, lo, hi, n: int):
  """Axis 3 of the grid: the scratch carry set to `init` at 0, each tile in [lo, hi) added,
  the outputs written at the last (tiles outside [lo, hi) are `_clamp`'s repeats: no compute).
  None parts of the carry have no scratch."""
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


def _grid_full(spec: Spec, r: Rows, c: Cols):
  """The grid driver's FULL test of the loaded pair (`_classes`' test on the tiles' own
  ranges, SISA's R_I <= R_J included), a 0-d bool; None without a decay."""
  if not (spec.fox or spec.sisa):
    return None
  kp0, kp1, qp0, qp1 = jnp.min(c.pos), jnp.max(c.pos), jnp.min(r.pos), jnp.max(r.pos)
  ks0, ks1, qs0, qs1 = jnp.min(c.seg), jnp.max(c.seg), jnp.min(r.seg), jnp.max(r.seg)
  full = (kp0 >= 0) & (((ks0 == 0) & (ks1 == 0)) | ((ks0 == ks1) & (qs0 == qs1) & (ks0 == qs0)))
  if spec.causal:
    full = full & (kp1 <= qp0)
  if spec.window is not None:
    full = full & (qp1 - kp0 < spec.window)
  if spec.sisa:
    full = full & (jnp.max(r.g) <= jnp.min(c.g))
  return full


def _grid_frames(spec: Spec, r: Rows, c: Cols):
  """The full form's frames of the loaded pair (`_frames`, from the tiles): (rho2 per query,
  beta2 per key, sig2)."""
  Rq, Rk = jnp.max(r.g), jnp.min(c.g)
  rho, beta = r.g - Rq, Rk - c.g
  if spec.lo:
    rho, beta = rho + r.glo, beta - c.glo
  return rho * T.LOG2E, beta * T.LOG2E, (Rq - Rk) * T.LOG2E


def _grid_step(spec: Spec, r: Rows, c: Cols, full_step, partial_step):
  """One grid step: on a FULL pair FoX's full form (full_step(rows with rho, cols with beta,
  sig2, carry)), SISA's decay as a rank-one product without the mask (partial_step(carry,
  frame)); else the partial form."""
  full = _grid_full(spec, r, c)
  if full is None:
    return partial_step
  rho2, beta2, sig2 = _grid_frames(spec, r, c)
  if spec.sisa:
    on_full = lambda k: partial_step(k, (rho2, beta2, sig2))
  else:
    on_full = lambda k: full_step(r._replace(rho=rho2), c._replace(beta=beta2), sig2, k)
  return lambda k: lax.cond(full, on_full, partial_step, k)


def _grid_fwd(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r, c = _rows_at(x), _cols_at(x)
  (o_ref, lse_ref), scratch = rest[:2], rest[2:]
  lo, hi = _key_range(spec, pl.program_id(2), nk, *spec.tiles("fwd"))
  step = _grid_step(spec, r, c,
                    lambda r2, c2, sg, k: T.fwd_full(spec, T.RowFrame(None), r2, c2, sg, k),
                    lambda k, fr=None: T.fwd_partial(spec, r, c, k, fr))
  _accumulate(T.fwd_init(spec, r.q.shape[0], o_ref.shape[-1]), step,
              lambda k: T.fwd_finish(k, o_ref, lse_ref), scratch, lo, hi, nk)


def _grid_dq(spec: Spec, nk: int, *refs):
  x, rest = _split(spec, refs, _ROW_NAMES + _COL_NAMES)
  r, c, d = _rows_at(x), _cols_at(x), _grads_at(rest[:3])
  n = _n_out(spec, "dq")
  outs, scratch = _pad_outs("dq", rest[3:3 + n]), rest[3 + n:]
  lo, hi = _key_range(spec, pl.program_id(2), nk, *spec.tiles("dq"))
  full = lambda r2, c2, sg, k: T.dq_full(spec, T.RowFrame(None), d.lse2 - r2.rho, r2, c2, d,
                                         sg, k)
  step = _grid_step(spec, r, c, full, lambda k, fr=None: T.dq_partial(spec, r, c, d, k, fr))
  _accumulate(T.dq_init(spec, r), step, lambda k: T.dq_finish(spec, k, *outs), scratch, lo,
              hi, nk)


def _grid_dkv(spec: Spec, nq: int, *refs):
  y, refs = _split(spec, refs, _COL_NAMES)
  x, rest = _split(spec, refs, _ROW_NAMES)
  r, c, d = _rows_at(x), _cols_at(y), _grads_at(rest[:3])
  n = _n_out(spec, "dkv")
  outs, scratch = _pad_outs("dkv", rest[3:3 + n]), rest[3 + n:]
  lo, hi = _query_range(spec, pl.program_id(2), nq, *spec.tiles("dkv"))
  full = lambda r2, c2, sg, k: T.dkv_full(spec, r2, c2, d._replace(nu=d.lse2 - r2.rho), sg, k)
  step = _grid_step(spec, r, c, full, lambda k, fr=None: T.dkv_partial(spec, r, c, d, k, fr))
  _accumulate(T.dkv_init(spec, c), step, lambda k: T.dkv_finish(spec, k, *outs), scratch,
              lo, hi, nq)


# ---------------------------------------------------------------- calls

def _head(b, h):
  """Leading indices of a per-query-head array at grid index (b, h)."""
  return (b, h)


def _sides(ops: Operands, groups: int):
  """The row operands and the column operands, each with the map from the grid's (b, h) to
  its leading indices: per query head, per kv head (GQA: head h reads kv head h // groups) or
  per row (positions and segments, shared by every head). Absent operands are None."""
  kv, row = (lambda b, h: (b, _div(h, groups))), (lambda b, h: (b,))
  rows = [(ops.q, _head), (ops.g, _head), (ops.glo, _head), (ops.c, _head), (ops.pos, row),
          (ops.seg, row), (ops.rho, _head), (ops.cp, _head)]
  cols = [(ops.k, kv), (ops.v, kv), (ops.kg, _head), (ops.kglo, _head), (ops.b, _head),
          (ops.kpos, row), (ops.kseg, row), (ops.beta, _head), (ops.bp, _head)]
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
  """(arrays, BlockSpecs) of the row and column operands and the schedule for the loop
  driver: one tile of the tiled side, the whole head of the other."""
  row, col = (_tile_spec, _full) if rows_tiled else (_full, _tile_spec)
  rows, cols = _sides(ops, spec.groups)
  rows = [(a, lead, row) for a, lead in rows]
  cols = [(a, lead, col) for a, lead in cols]
  meta = [(ops.meta, _head, _tile_spec), (ops.sig, _head, _tile_spec)]
  items = _present_items(rows + cols + meta if rows_tiled else cols + meta + rows)
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
  bq, bk = ops.q.shape[3], ops.k.shape[3]
  if rows_outer:
    rt, ct = (lambda i, j: i), (lambda i, j: _clamp(j, *_key_range(spec, i, nk, bq, bk)))
  else:
    ct, rt = (lambda i, j: i), (lambda i, j: _clamp(j, *_query_range(spec, i, nq, bq, bk)))
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


def _forward(spec: Spec, x: Padded):
  """(o [B, H, nq, bq, Dv], lse [B, H, nq, bq, 1] fp32) in the fwd pass's tiles."""
  ops = _layout(spec, x, "fwd")
  B, H, nq, bq, D = ops.q.shape
  nk, Dv = ops.k.shape[2], ops.v.shape[-1]
  outs = (jax.ShapeDtypeStruct((B, H, nq, bq, Dv), ops.q.dtype),
          jax.ShapeDtypeStruct(ops.g.shape, F32))
  if spec.grid:
    ins, in_specs = _grid_specs(spec, ops, rows_outer=True)
    return _call(spec, functools.partial(_grid_fwd, spec, nk), (B, H, nq, nk), ins, in_specs,
                 outs, _out_blocks(outs), _vmem([(bq, 1), (bq, 1), (bq, Dv)]))
  ins, in_specs = _specs(spec, ops, rows_tiled=True)
  out_specs = (_tile_spec(outs[0], _head), _tile_spec(outs[1], _head))
  return _call(spec, functools.partial(_loop_fwd, spec), (B, H, nq), ins, in_specs,
               outs, out_specs)


def _row_extra(spec: Spec, x: Padded, do_BHTE, lse_BHT, delta_BHT, pass_name: str):
  """The backward's per-query arrays in a pass's tiles: do [B, H, nq, bq, Dv]; lse2
  (`decayed_tiles.lse2_of`), delta and (the dkv pass's full form, FoX) nu = lse2 - rho as
  row vectors of the pass's orientation."""
  bq, bk = spec.tiles(pass_name)
  across = pass_name == "dkv"
  vec = lambda a: _vec(a, bq, across, spec.flat)
  lse2 = T.lse2_of(lse_BHT)
  out = [_tiles(do_BHTE, bq), vec(lse2), vec(delta_BHT)]
  if across and spec.fox and spec.flat:
    out.append(vec(lse2 - _frames(spec, x, bq, bk).rho))
  return tuple(out)


def _backward(spec: Spec, x: Padded, do_BHTE, lse_BHT, delta_BHT):
  """dq pass -> [dq] + [dg_row (SISA part), dc] with SISA, in its tiles; dkv pass -> [dk, dv]
  + [dg_col] (FoX or SISA) + [db] (SISA), per query head, in its tiles."""
  row_ops, col_ops = _layout(spec, x, "dq"), _layout(spec, x, "dkv")
  B, H, nq, bq, D = row_ops.q.shape
  nk, Dv = row_ops.k.shape[2], row_ops.v.shape[-1]
  ds_ = x.c.shape[-1] if spec.sisa else None
  row_outs = [jax.ShapeDtypeStruct(row_ops.q.shape, row_ops.q.dtype)]
  if spec.fox or spec.sisa:
    row_outs.append(jax.ShapeDtypeStruct(row_ops.g.shape, F32))
  if spec.sisa:
    row_outs.append(jax.ShapeDtypeStruct(row_ops.c.shape, row_ops.c.dtype))
  cB, cH, cnk, cbk, _ = col_ops.k.shape
  cnq = col_ops.q.shape[2]
  col_outs = [jax.ShapeDtypeStruct((B, H, cnk, cbk, D), col_ops.k.dtype),
              jax.ShapeDtypeStruct((B, H, cnk, cbk, Dv), col_ops.v.dtype)]
  if spec.fox or spec.sisa:
    col_outs.append(jax.ShapeDtypeStruct(col_ops.kg.shape, F32))
  if spec.sisa:
    col_outs.append(jax.ShapeDtypeStruct(col_ops.b.shape, col_ops.b.dtype))
  row_outs, col_outs = tuple(row_outs), tuple(col_outs)
  row_extra = _row_extra(spec, x, do_BHTE, lse_BHT, delta_BHT, "dq")
  col_extra = _row_extra(spec, x, do_BHTE, lse_BHT, delta_BHT, "dkv")
  if spec.grid:
    ins, in_specs = _grid_specs(spec, row_ops, rows_outer=True, extra=row_extra)
    row_grads = _call(spec, functools.partial(_grid_dq, spec, nk), (B, H, nq, nk), ins,
                      in_specs, row_outs, _out_blocks(row_outs),
                      _vmem([(bq, D), ds_ and (bq, ds_),
                             (spec.fox or spec.sisa) and (bq, 1)]))   # dq, dc, dg
    ins, in_specs = _grid_specs(spec, col_ops, rows_outer=False, extra=col_extra)
    col_grads = _call(spec, functools.partial(_grid_dkv, spec, cnq), (B, H, cnk, cnq), ins,
                      in_specs, col_outs, _out_blocks(col_outs),
                      _vmem([(cbk, D), (cbk, Dv), (spec.fox or spec.sisa) and (cbk, 1),
                             ds_ and (cbk, ds_)]))
    return row_grads, col_grads
  ins, in_specs = _specs(spec, row_ops, rows_tiled=True)     # dq pass: tiles of queries
  ins += list(row_extra)
  in_specs += [_tile_spec(a, _head) for a in row_extra]
  row_grads = _call(spec, functools.partial(_loop_dq, spec), (B, H, nq), ins, in_specs,
                    row_outs, tuple(_tile_spec(o, _head) for o in row_outs))
  ins, in_specs = _specs(spec, col_ops, rows_tiled=False)    # dkv pass: tiles of keys
  ins += list(col_extra)
  in_specs += [_full(a, _head) for a in col_extra]
  col_grads = _call(spec, functools.partial(_loop_dkv, spec), (B, H, cnk), ins, in_specs,
                    col_outs, tuple(_tile_spec(o, _head) for o in col_outs))
  return row_grads, col_grads


# ---------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec: Spec, q, k, v, g, glo, c, b, pos, seg):
  """(o [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32) over the real keys (no sink)."""
  return _attend_fwd(spec, q, k, v, g, glo, c, b, pos, seg)[0]


def _attend_fwd(spec, q, k, v, g, glo, c, b, pos, seg):
  T = q.shape[1]
  o, lse = _forward(spec, _pad(spec, q, k, v, g, glo, c, b, pos, seg))
  out = (_untile(o, T), _untile_vec(lse, T))
  return out, (q, k, v, g, glo, c, b, pos, seg, o, lse)


def _attend_bwd(spec, res, cts):
  """The two backward passes (dg = the rows' part from the dq pass + the keys' part from the
  dkv pass)."""
  q, k, v, g, glo, c, b, pos, seg, o, lse = res
  do_BTHE, dlse_BTH = cts
  B, T, H, D = q.shape
  K = k.shape[2]
  x = _pad(spec, q, k, v, g, glo, c, b, pos, seg)
  Tp = x.q.shape[2]
  do = jnp.pad(do_BTHE, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  dlse = jnp.pad(dlse_BTH.astype(F32), ((0, 0), (0, Tp - T), (0, 0))).transpose(0, 2, 1)
  o_BHT = o.reshape(B, H, Tp, -1)
  lse_BHT = lse.reshape(B, H, Tp)
  delta = jnp.sum(do.astype(F32) * o_BHT.astype(F32), axis=-1) - dlse
  rows, cols = _backward(spec, x, do.astype(o.dtype), lse_BHT, delta)
  vec = lambda a: _untile_vec(a, T)
  dg = jnp.zeros((B, T, H), F32)
  if spec.fox or spec.sisa:
    dg = dg + vec(rows[1]) + vec(cols[2])
  dc = db = None
  if spec.sisa:
    dc = _untile(rows[2], T).astype(c.dtype)
    db = _untile(cols[3], T).astype(b.dtype)
  group = lambda x: x.reshape(B, T, K, H // K, x.shape[-1]).sum(3)
  dk = group(_untile(cols[0], T).astype(F32)).astype(k.dtype)
  dv = group(_untile(cols[1], T).astype(F32)).astype(v.dtype)
  dglo = None if glo is None else dg.astype(glo.dtype)    # d/d lo = d/d hi
  return _untile(rows[0], T), dk, dv, dg.astype(g.dtype), dglo, dc, db, None, None


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
  double word (hi, lo) (`forget_xla.cumsum2`: each pair's difference is then rounded at its own
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
  dkv_q = dkv_k = 0
  if plat == "gpu" and block_q is None and block_k is None and tune.dkv_tile:
    dkv_q, dkv_k = tune.dkv_tile
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
              bool(tile_grid), tuple(tune.warps), tuple(tune.stages), int(dkv_q), int(dkv_k),
              plat == "gpu" and not interpret)
  args = dict(q=q_BTHD, k=k_BTKD, v=v_BTKE, g=g, glo=g_lo_BTH, c=c_BTHS, b=b_BTHS, pos=pos,
              seg=seg, sink=sink_logit_H)
  return _sharded(functools.partial(_local, spec), args, _NAMES)


# ---------------------------------------------------------------- what the loops visit

def tile_visits(T: int, head_dim: int, *, fox: bool = False, sisa: bool = False,
                window: int | None = None, gpu_tuning: GpuTuning | None = None,
                decay_per_token: float = 0.01) -> dict[str, tuple[int, int, int]]:
  """How many tiles each pass's loops visit on one unpacked causal row of T tokens on a GPU
  (`_classes` of its tiles; g decaying by `decay_per_token` nats a token): {pass: (FULL,
  MASKED_FACTORED, PARTIAL)}. A compiled-code census weighs each loop's cost per element by
  these (every visited tile is block_q x block_k elements of its pass); the loop driver runs
  one loop per class, in this order, the MASKED_FACTORED loop only for SISA without FoX."""
  tune = gpu_tuning or default_gpu_tuning(head_dim)
  dkv = tune.dkv_tile or (0, 0)
  spec = Spec(1.0, fox, sisa, False, True, window, tune.block_q, tune.block_k, 1, False,
              False, tune.warps, tune.stages, dkv[0], dkv[1])
  g = -decay_per_token * jnp.arange(T, dtype=F32)[None, :, None]
  pos = jnp.arange(T, dtype=jnp.int32)[None]
  z = jnp.zeros((1, T, 1, 1), jnp.bfloat16)
  x = _pad(spec, z, z, z, g, None, None, None, pos, jnp.ones((1, T), jnp.int32))
  count = jax.jit(lambda x, bq, bk: jnp.stack([jnp.sum(_classes(spec, x, bq, bk) == k)
                                              for k in (FULL, MASKED_FACTORED, PARTIAL)]),
                  static_argnums=(1, 2))
  return {name: tuple(int(n) for n in count(x, *spec.tiles(name))) for name in PASSES}


# ---------------------------------------------------------------- choosing the kernel

def use_kernel(impl: str, q_shape, k_shape, v_shape, *, what: str) -> bool:
  """Whether a mixer's full forward takes the kernel (`kernel_choice.decayed_kernel`: "auto",
  on GPU / TPU, and these shapes fit `unsupported`; a misfit is logged once per reason, naming
  `what`, and the caller takes its blockwise path)."""
  return kernel_choice.decayed_kernel(
      impl, lambda plat: unsupported(q_shape, k_shape, v_shape, plat=plat), what=what)
