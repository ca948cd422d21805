"""Sparse Sinkhorn attention (Tay et al. 2020, arXiv 2002.11296; docs/papers.md §4).

The sequence (length T, padded to N = ceil(T / b) blocks of b tokens) is cut into contiguous
blocks X_0 .. X_{N-1}. Per kv head:

    s_i = SortNet(mean of the tokens of block i)                 (a small GELU MLP)
    R_ij = u_i . r_j / sqrt(d_s),   u_i = W_u s_{q(i)},  r_j = W_r s_j
    P = Sinkhorn(R / tau)               (log space, n_iters row/column normalisations)
    sorted_i = sum_j P_ij K_j,  sum_j P_ij V_j                   (soft: one mixed block)
    y_t = softmax over [sorted_{i(t)} ; local block i(t)] of q_t . k / sqrt(d_h)

with Gumbel noise added to R in training (`gumbel_noise`, only when `train` and an rng are
given). Cost: O(T (m+1) b) scores instead of O(T^2) (m = 1 sorted block without SortCut); the
soft mix forms N sorted blocks from N blocks each, O(N^2 b d) = O(T^2 d / b) multiply-adds in
O(T d) memory (SortCut gathers instead: O(T m d)); the sorting is O(N^2 d_s) scores plus the
Sinkhorn iterations (causal: O(n_iters N^3) per kv head). Measured against dense attention by
`python experiments/bench_sinkhorn.py` (time, compiled memory, crossover length; docs/benchmarks.md).

Choices where the paper leaves room (reasons in docs/sinkhorn.md):

1. SortNet: R is a bilinear score of query- and key-side embeddings of the block means over
   valid tokens (`sort_dim` per kv head), not an MLP to N logits: any length, per-block
   decoding. One sort per kv head.
2. Causal: the query side of block i reads the summary of block i-1 (q(i) = i - 1), the key
   side of a past block its own: P_i may depend only on tokens before block i.
3. Causal balancing: rows take strictly earlier blocks; column targets t_j = H_i - H_j (H the
   harmonic numbers: the column sums of the uniform causal matrix), since no doubly
   stochastic matrix lives on the strict lower triangle; row i is the last row of the
   balanced prefix problem on rows 1..i (`causal_prefix_problem`), so it reads no later block.
   The iterations end with a row normalisation (every row a convex combination). Sinkhorn in
   scaling form: the matrix stays L + a[r] + c[j] and each normalisation sets one of the two
   vectors, so the N prefix problems together hold O(N^2) numbers and are solved at once
   (`causal_rows`: fused reductions over the [N, N, N] terms, none stored, forward or
   backward; a hand-written backward keeps autodiff from saving them).
4. Hard sorting at inference (`hard_inference`, without SortCut): a greedy permutation
   (non-causal), the argmax past block (causal). The greedy rule runs in rounds that take
   every entry largest in its free row and column at once (`greedy_permutation`), a fixed
   GREEDY_ROUNDS = 32 of them: exact for N <= 32 and whenever the rule has finished in 32
   rounds (random N = 512 matrices took 10 to 12); rows still free after them take their
   best free column (not always a permutation then). The exact rule needs up to N rounds on
   some inputs (it is P-complete), so only a bounded count keeps the loop from growing with T.
5. SortCut (`n_sortcut` = m > 0): per query block the top-m blocks of the balanced matrix are
   gathered; gradient through w = 1 + (p - stop_gradient(p)) on the selected blocks.
6. Padding (position -1, and the pad to a multiple of b): zero keys and values, left out of
   the means, masked as keys; fully padded blocks leave the non-causal Sinkhorn.
7. aux["sinkhorn_sharpness"]: the mean largest weight of a sort row.
8. Positions: RoPE at absolute positions before sorting.
9. Sink logit (`sink_logit`, `projection.SinkLogitOptions`): the extra column of every query's
   one softmax over [sorted ; local] (`entry.attend(sink_logit_H=)`), in every mode; not sorted.
10. Packed rows (`segment_ids_BT`): a block sorts for the document of its first token, from
   that document's pure blocks only, attention masked by segment: nothing crosses a document
   boundary, and a document that starts at a block boundary (or lies inside one block) gets
   exactly its alone outputs. Documents packed at arbitrary offsets would not (their blocks
   would be cut differently from their alone blocks, and the blocks they share are not sort
   sources), so the causal mode first moves them (`document_layout`): in a row of 2 N blocks,
   every document that does not fit in the rest of the current block starts a fresh block;
   the outputs are gathered back to the packed positions. Each document's outputs then equal
   the document alone (up to rounding; the Gumbel noise of training is drawn for the wider
   sort matrix, so it is not the alone draw). The cost is that of 2 N blocks. The non-causal
   mode keeps the packed blocks (exact for block-aligned documents only), and
   `config.validate` refuses it with `data.document_mask`. `reads_shared_prefix` is False.

Loops: no step runs a while loop (XLA:GPU pays a host round trip for every iteration of
one, measured on an H200): the Sinkhorn iterations are a Python loop (n_iters copies), the causal rows
one batched problem (3), the greedy permutation a fixed number of rounds (4) and the
document layout an associative scan (`document_layout`); tests lower the train step and the
eval forward for the GPU and find no `while`.

Decoding (causal mode): `SinkhornState` holds a `cache.KVCache` under the linear policy
whatever the decode asks for (the sort reads every block seen so far) and the running
per-block sums and counts of the mixer input; a new token recomputes its block's row of the
causal balancing (`causal_rows` over the tokens of a chunk). `max_chunk` is b; the first call
into a fresh state (a prefill's, `KVCache.fresh`) runs the full forward on any length and then
fills the cache and sums, so a prefill runs no loop over its blocks.

Logical axes: "sort_hidden" (the SortNet width) and "sort_dim" (replicated), plus "embed" and
"kv_heads".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import (QKVProjection, SinkLogitOptions, make_sink_logit,
                                    sink_logit_of)
from attn_jax.field_checks import field_check, is_int, is_number
from attn_jax.kernels import entry
from attn_jax.kernels.masks import NEG_INF
from attn_jax.layers import (Linear, apply_rope, causal_positions, dtype_of, rope_angles,
                             segment_starts)
from attn_jax.mixer import Mixer, register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


# ---------------------------------------------------------------- Sinkhorn in log space

def _lse_of_finite_or_neg_inf(x, axis):
  """log sum exp(x) along `axis` (dropped), x finite or -inf; 0 where every entry is -inf."""
  m = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(x - m), axis=axis, keepdims=True)
  return jnp.squeeze(m + jnp.log(jnp.where(s > 0, s, 1.0)), axis)


def _masked_lse(l, mask, axis):
  """log sum_{mask} exp(l) along `axis` (dropped); 0 where nothing is allowed."""
  return _lse_of_finite_or_neg_inf(jnp.where(mask, l, -jnp.inf), axis)


def sinkhorn_log(logits, mask, log_row_target, log_col_target, n_iters: int):
  """Log-space Sinkhorn on the allowed entries of `mask`: n_iters (column, row) normalisations.

  logits [..., R, C], mask broadcastable to it, log targets [..., R] / [..., C] (their sums must
  agree for a fixed point to exist). Ends with a row normalisation, so every allowed row sums
  to exp(row target) exactly; columns converge to their targets. Returns the log matrix with
  -inf outside the mask.

  In scaling form (docstring 3): the matrix is L + a[r] + c[j] throughout, and a normalisation
  sets one of the vectors, c = log t_col - logsumexp_r(L + a), a = log t_row -
  logsumexp_j(L + c) (a = c = 0 at the start), the arithmetic `causal_rows` repeats for many
  problems at once. The iterations are unrolled: no while loop (docstring, "Loops").
  """
  mask = jnp.broadcast_to(mask, logits.shape)
  L = jnp.where(mask, logits.astype(jnp.float32), 0.0)
  a = jnp.zeros_like(L[..., 0])
  c = jnp.zeros_like(L[..., 0, :])
  for _ in range(n_iters):
    c = log_col_target - _masked_lse(L + a[..., :, None], mask, -2)
    a = log_row_target - _masked_lse(L + c[..., None, :], mask, -1)
  return jnp.where(mask, L + a[..., :, None] + c[..., None, :], -jnp.inf)


def _harmonic(n: int) -> np.ndarray:
  """H_0 .. H_n (H_0 = 0), float32 constants computed in float64."""
  return np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n + 1))]).astype(np.float32)


def causal_prefix_problem(n: int, i, start=None):
  """Mask and log targets of the causal balancing of rows 1..i (see docstring 3).

  Allowed: j < r <= i. Row targets 1, column targets H_i - H_j for j < i (the column sums of
  the uniform causal matrix). `i` may be traced. Returns (mask [n, n], log_row [n], log_col [n]).

  `start` ([B] int, packed rows, docstring 10): the problem of a document whose sorting blocks
  begin at block `start`: allowed start <= j < r <= i, column targets H_{i-start} - H_{j-start};
  exactly the problem of rows 1..i-start of that document alone. Returns (mask [B, 1, n, n],
  log_row [n], log_col [B, 1, n]).

  One problem as a full [n, n] matrix: the explicit form `causal_rows` solves for many rows at
  once (tests check the two agree).
  """
  if start is not None:
    return _document_prefix_problem(n, i, start)
  r = jnp.arange(n)[:, None]
  j = jnp.arange(n)[None, :]
  mask = (j < r) & (r <= i)
  h = jnp.asarray(_harmonic(n))
  cols = jnp.arange(n)
  # H_i without indexing by the (possibly batch-sharded) i: a masked sum of 1/r, r <= i.
  h_i = jnp.sum(jnp.where(jnp.arange(1, n + 1) <= i, 1.0 / jnp.arange(1, n + 1), 0.0))
  t = h_i - h[cols]
  log_col = jnp.where(cols < i, jnp.log(jnp.where(cols < i, t, 1.0)), 0.0)
  return mask, jnp.zeros((n,), jnp.float32), log_col


def _document_prefix_problem(n: int, i, start_B):
  """`causal_prefix_problem` of a document whose sorting blocks begin at `start_B` [B]."""
  st = start_B[:, None, None, None]                      # [B, 1, 1, 1]
  r = jnp.arange(n)[:, None]
  j = jnp.arange(n)[None, :]
  mask = (j >= st) & (j < r) & (r <= i)                  # [B, 1, n, n]
  recip = 1.0 / jnp.arange(1, n + 1, dtype=jnp.float32)  # 1/r, r = 1..n
  harm = lambda m_BN: jnp.sum(jnp.where(jnp.arange(1, n + 1) <= m_BN[..., None], recip, 0.0),
                              axis=-1)                   # H_m by masked sums (no gather)
  st = start_B[:, None]                                  # [B, 1]
  cols = jnp.arange(n)[None, :]
  h_i = harm(jnp.maximum(i - st, 0))                     # [B, 1]
  h_j = harm(jnp.maximum(cols - st, 0))                  # [B, n]
  ok = (cols >= st) & (cols < i)
  log_col = jnp.where(ok, jnp.log(jnp.where(ok, h_i - h_j, 1.0)), 0.0)
  return mask, jnp.zeros((n,), jnp.float32), log_col[:, None, :]


# ---------------------------------------------------------------- all causal rows at once

def _prefix_terms(L_BKNN, p_BKMN, i_BM, s_BM, over_rows: bool):
  """(x, axis): x[b, k, m, r, j] = L[r, j] + p[m, r] (over_rows) or + p[m, j] on the prefix
  mask of row i_m, s <= j < r <= i, and -inf off it.

  The mask is put on the operands as -inf: j < r on L ([n, n]), r <= i on the r-side vector
  and j >= s on the j-side one ([M, n] each), so x is a broadcast sum of 2-D arrays that XLA
  fuses into every reduction reading it. A [M, n, n] boolean mask shared by the reductions
  (the form before) was stored by XLA:TPU, n^3 bytes (512 GiB at n = 8192). On the allowed
  entries x is L + p + 0, bit for bit the masked sum."""
  n = L_BKNN.shape[-1]
  idx = jnp.arange(n)
  L = jnp.where(idx[None, :] < idx[:, None], L_BKNN, -jnp.inf)          # j < r
  row_ok = (idx <= i_BM[..., None])[:, None]                             # [B, 1, M, n(r)]
  col_ok = (idx >= s_BM[..., None])[:, None]                             # [B, 1, M, n(j)]
  zero = jnp.zeros((), L.dtype)
  u = jnp.where(row_ok, p_BKMN if over_rows else zero, -jnp.inf)
  w = jnp.where(col_ok, zero if over_rows else p_BKMN, -jnp.inf)
  x = L[:, :, None] + u[..., :, None] + w[..., None, :]                  # [B, K, M, n, n]
  return x, -2 if over_rows else -1


def _prefix_lse_fwd(L_BKNN, p_BKMN, i_BM, s_BM, over_rows):
  x, axis = _prefix_terms(L_BKNN, p_BKMN, i_BM, s_BM, over_rows)
  out = _lse_of_finite_or_neg_inf(x, axis)                     # [B, K, M, n]
  return out, (L_BKNN, p_BKMN, i_BM, s_BM, out)


def _prefix_lse_bwd(over_rows, res, g_BKMN):
  """d out / d x = softmax weights w on the mask (0 at the -inf entries); both cotangents are
  reductions of g w, an expression of [B, K, M, n, n] that XLA fuses into each (never
  stored)."""
  L_BKNN, p_BKMN, i_BM, s_BM, out = res
  x, axis = _prefix_terms(L_BKNN, p_BKMN, i_BM, s_BM, over_rows)
  w = jnp.exp(x - jnp.expand_dims(out, axis))
  gw = w * jnp.expand_dims(g_BKMN, axis)
  other = -1 if over_rows else -2
  return jnp.sum(gw, axis=2), jnp.sum(gw, axis=other), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _prefix_lse(L_BKNN, p_BKMN, i_BM, s_BM, over_rows: bool):
  """[B, K, M, n]: log sum over the prefix mask of row i_m of exp(L + p), along rows r
  (`over_rows`, p indexed by r; result by column j) or along columns j (p by j; result by r)."""
  return _prefix_lse_fwd(L_BKNN, p_BKMN, i_BM, s_BM, over_rows)[0]


_prefix_lse.defvjp(_prefix_lse_fwd, _prefix_lse_bwd)


def _prefix_col_targets(n: int, i_BM, s_BM):
  """[B, 1, M, n]: log(H_{i-s} - H_{j-s}) for s <= j < i (docstring 3), 0 elsewhere."""
  h = jnp.asarray(_harmonic(n))                      # a replicated constant: gathers are local
  j = jnp.arange(n)
  h_i = h[jnp.clip(i_BM - s_BM, 0, n)][..., None]    # [B, M, 1]
  h_j = h[jnp.clip(j - s_BM[..., None], 0, n)]       # [B, M, n]
  ok = (j >= s_BM[..., None]) & (j < i_BM[..., None])
  return jnp.where(ok, jnp.log(jnp.where(ok, h_i - h_j, 1.0)), 0.0)[:, None]


def causal_rows(logits_BKNN, i_BM, n_iters: int, start_BM=None):
  """Rows i_BM [B, M] of the causal sort matrix: [B, K, M, n] log weights, -inf where j >= i
  (or j < start). Row i is the last row of its prefix problem (`causal_prefix_problem`), all M
  problems solved together in scaling form (docstring 3): the problem of row i is
  l = L + a_i[r] + c_i[j] on its mask, so its state is two vectors,

      c_i[j] <- log t_j - logsumexp_{j < r <= i} (L[r, j] + a_i[r])
      a_i[r] <- 0       - logsumexp_{s <= j < r} (L[r, j] + c_i[j])

  (a = c = 0 at the start): O(M n) state, O(n_iters M n^2) work in fused reductions, no loop
  over rows and no [M, n, n] array stored, forward or backward (`_prefix_lse`)."""
  B, K, n, _ = logits_BKNN.shape
  L = logits_BKNN.astype(jnp.float32)
  s_BM = jnp.zeros_like(i_BM) if start_BM is None else start_BM
  lc = _prefix_col_targets(n, i_BM, s_BM)
  a = jnp.zeros_like(L[:, :, :1, :1]) + jnp.zeros_like(lc)      # [B, K, M, n]
  c = a
  for _ in range(n_iters):
    c = lc - _prefix_lse(L, a, i_BM, s_BM, over_rows=True)
    a = -_prefix_lse(L, c, i_BM, s_BM, over_rows=False)
  pick = jnp.arange(n)[:, None] == i_BM[:, None, :, None, None]   # [B, 1, M, n(r), 1]
  L_i = jnp.sum(jnp.where(pick, L[:, :, None], 0.0), axis=-2)    # row i of L, by a mask
  a_i = jnp.sum(jnp.where(pick[..., 0], a, 0.0), axis=-1, keepdims=True)
  j = jnp.arange(n)
  ok = ((j >= s_BM[..., None]) & (j < i_BM[..., None]))[:, None]   # [B, 1, M, n]
  return jnp.where(ok, L_i + a_i + c, -jnp.inf)


def causal_sort_row(logits_KNN, i, n_iters: int, start=None):
  """Row i of the causal sort matrix (log space, -inf where j >= i): the last row of the
  balanced prefix problem on rows 1..i. logits [..., N, N]; i a scalar (may be traced).
  `start` [B]: packed rows, the row's document's first sorting block (logits [B, K, N, N])."""
  n = logits_KNN.shape[-1]
  if start is None:
    lead = logits_KNN.shape[:-2]
    rows = causal_rows(logits_KNN.reshape((1, -1, n, n)), jnp.reshape(i, (1, 1)), n_iters)
    return rows.reshape(lead + (n,))
  i_B1 = jnp.zeros_like(start[:, None]) + i
  return causal_rows(logits_KNN, i_B1, n_iters, start[:, None])[:, :, 0]


def causal_sinkhorn_rows(logits_BKNN, n_iters: int, starts_BN=None):
  """All rows of the causal sort matrix [B, K, N, N] (log space); row i from prefix i only.
  `starts_BN`: packed rows, each row's document's first sorting block (docstring 10)."""
  n = logits_BKNN.shape[-1]
  i_BN = jnp.zeros_like(logits_BKNN[:, 0, 0], jnp.int32) + jnp.arange(n, dtype=jnp.int32)
  return causal_rows(logits_BKNN, i_BN, n_iters, starts_BN)


# ---------------------------------------------------------------- hard sorting

GREEDY_ROUNDS = 32   # rounds of `greedy_permutation`: exact whenever N <= 32 (docstring 4)


def greedy_permutation(logp_BKNN, mask_BKNN, rounds: int = GREEDY_ROUNDS):
  """Hard assignment row -> column by the greedy rule: repeatedly take the largest allowed
  entry (ties: the first in row-major order) whose row and column are both free. Returns
  (idx [B, K, N] int32, ok [B, K, N] bool: row assigned).

  In rounds instead of one entry at a time: an entry that is the largest of its free row and
  of its free column (same order, ties included) is taken by the greedy rule too (every entry
  before it in that order lies in a row or column retired already), and the largest free
  entry is always one, so each round takes every such entry at once and at least one.
  `rounds` rounds, unrolled (no while loop): exact when N <= rounds, and otherwise whenever
  the rule has finished by then (random N = 512 matrices took 10 to 12). Rows still free after
  the last round take their largest free allowed column, which two of them may share.
  The exact rule itself is sequential (lexicographically first maximal matching, P-complete),
  so no formulation with a fixed number of steps is exact for every input."""
  n = logp_BKNN.shape[-1]
  mask = jnp.broadcast_to(mask_BKNN, logp_BKNN.shape)
  s = jnp.where(mask & (logp_BKNN > -jnp.inf), logp_BKNN, -jnp.inf)   # free allowed entries
  idx = jnp.full_like(logp_BKNN[..., 0], -1, jnp.int32)  # *_like: keeps the input's sharding
  cols = jnp.arange(n)
  for _ in range(min(n, rounds)):
    best_c = jnp.argmax(s, axis=-1)                      # row r's best column (first of ties)
    best_r = jnp.argmax(s, axis=-2)                      # column c's best row (first of ties)
    free = jnp.max(s, axis=-1) > -jnp.inf
    take = free & (jnp.take_along_axis(best_r, best_c, axis=-1) == cols)     # [B, K, N] rows
    idx = jnp.where(take, best_c, idx)
    hit = take[..., :, None] & (best_c[..., :, None] == cols)               # [B, K, N, N]
    s = jnp.where(take[..., :, None] | jnp.any(hit, axis=-2)[..., None, :], -jnp.inf, s)
  left = jnp.max(s, axis=-1) > -jnp.inf
  idx = jnp.where(left, jnp.argmax(s, axis=-1), idx)
  return jnp.maximum(idx, 0), idx >= 0


# ---------------------------------------------------------------- sorting blocks

@dataclasses.dataclass
class SortPlan:
  """How query rows read past/other blocks: a soft mix (P) or a gather (idx, w, ok)."""
  P: jax.Array | None = None        # [B, K, Nq, N] weights (mix)
  idx: jax.Array | None = None      # [B, K, Nq, m] source blocks (gather)
  w: jax.Array | None = None        # [B, K, Nq, m] per-block scale (1 in the forward pass)
  ok: jax.Array | None = None       # [B, K, Nq, m] slot holds a real source

  def source_weights(self, n: int) -> jax.Array:
    """[B, K, Nq, m, N]: sorted slot r = sum_j W[..., r, j] block_j (for references/tests)."""
    if self.P is not None:
      return self.P[..., None, :]
    return jax.nn.one_hot(self.idx, n) * (self.w * self.ok)[..., None]


def sort_blocks(k_BNSKD, v_BNSKD, slot_valid_BNS, plan: SortPlan):
  """Sorted keys/values per query row: ([B, Nq, m*b, K, D], same, valid [B, K, Nq, m*b]).

  Keys and values go through the same permutation (each from its own tensor)."""
  B, N, b, K, D = k_BNSKD.shape
  if plan.P is not None:
    P = plan.P.astype(jnp.float32)
    mix = lambda x: jnp.einsum("bkqn,bnskd->bqskd", P, x,
                               preferred_element_type=jnp.float32).astype(x.dtype)
    valid = jnp.einsum("bkqn,bns->bkqs", P, slot_valid_BNS.astype(jnp.float32)) > 0
    return mix(k_BNSKD), mix(v_BNSKD), valid
  idx, w, ok = plan.idx, plan.w, plan.ok
  Nq, m = idx.shape[2], idx.shape[3]
  # Gathers vmapped over batch (and kv heads): batched gathers keep the batch sharding.
  take = jax.vmap(jax.vmap(lambda x_NbD, i_Qm: x_NbD[i_Qm]))

  def gather(x):
    g = take(jnp.moveaxis(x, 3, 1), idx)                        # [B, K, Nq, m, b, D]
    g = (g * w[..., None, None].astype(g.dtype)).astype(x.dtype)
    return jnp.moveaxis(g, 1, 4).reshape(B, Nq, m * b, K, D)

  slot_ok = jax.vmap(lambda sv_Nb, i_KQm: sv_Nb[i_KQm])(slot_valid_BNS, idx)
  valid = ok[..., None] & slot_ok                                 # [B, K, Nq, m, b]
  return gather(k_BNSKD), gather(v_BNSKD), valid.reshape(B, K, Nq, m * b)


def block_attend(q_BNQHD, sk_BNSKD, sv_BNSKD, s_valid_BKNS, lk_BNLKD, lv_BNLKD, lpos_BNL,
                 qpos_BNQ, *, scale, causal, impl, sink_logit_H=None, segments=None):
  """Each query row of block n attends to [sorted keys ; local keys] under one softmax (with
  the extra sink column when `sink_logit_H` [H] is given).

  Sorted slots are visible iff valid; local keys by position (causal: 0 <= p_k <= p_q).
  `segments` (packed rows, docstring 10): (query segments [B, N, Q], the sorted slots' document
  [B, N], local keys' segments [B, N, L]); a key is then visible only to its document."""
  B, N, Q, H, D = q_BNQHD.shape
  S, K = sk_BNSKD.shape[2], sk_BNSKD.shape[3]
  L = lk_BNLKD.shape[2]
  fold = lambda x: x.reshape((B * N,) + x.shape[2:])
  k = fold(jnp.concatenate([sk_BNSKD, lk_BNLKD.astype(sk_BNSKD.dtype)], axis=2))
  v = fold(jnp.concatenate([sv_BNSKD, lv_BNLKD.astype(sv_BNSKD.dtype)], axis=2))
  q = fold(q_BNQHD)
  seg_kw = {}
  if segments is not None:
    q_seg, s_doc, l_seg = segments
    kv_seg = jnp.concatenate([jnp.broadcast_to(s_doc[..., None], s_doc.shape + (S,)), l_seg], -1)
    seg_kw = dict(q_segments=fold(q_seg), kv_segments=fold(kv_seg))
  if causal:  # a causal sorted slot only holds past blocks: visible to every valid query
    spos = jnp.where(jnp.all(s_valid_BKNS, axis=1), 0, -1).astype(jnp.int32)
    kv_pos = fold(jnp.concatenate([spos, lpos_BNL], axis=-1))
    out = entry.attend(q, k, v, scale=scale, causal=True, q_positions=fold(qpos_BNQ),
                 kv_positions=kv_pos, sink_logit_H=sink_logit_H, impl=impl, **seg_kw)
  else:       # validity may differ per head: an additive bias on the sorted slots
    # (*_like: new arrays keep the batch sharding of the inputs under explicit meshes)
    spos = jnp.zeros_like(s_valid_BKNS[:, 0], jnp.int32)
    kv_pos = fold(jnp.concatenate([spos, lpos_BNL], axis=-1))
    g = H // K
    sb = jnp.where(s_valid_BKNS, 0.0, NEG_INF).astype(jnp.float32)     # [B, K, N, S]
    sb = jnp.repeat(jnp.moveaxis(sb, 1, 2), g, axis=2)                  # [B, N, H, S]
    lb = jnp.zeros_like(sb[..., :1]) + jnp.zeros_like(lpos_BNL, jnp.float32)[:, :, None, :]
    bias = jnp.concatenate([sb, lb], axis=-1)
    bias = jnp.broadcast_to(fold(bias)[:, :, None, :], (B * N, H, Q, S + L))
    out = entry.attend(q, k, v, scale=scale, causal=False, kv_positions=kv_pos, bias=bias,
                 sink_logit_H=sink_logit_H, impl=impl, **seg_kw)
  return out.reshape(B, N, Q, H, -1)


def sinkhorn_attention_reference(q_BTHD, k_BTKD, v_BTKD, valid_BT, W_BKNMN, *, block: int,
                                 scale: float, causal: bool, sink_logit_H=None):
  """Explicit fp64 reference: for every query t in block i, build the sorted slots
  sum_j W[i, r, j] K_j (and V) by a Python loop over blocks, append the local block, mask
  (invalid keys, causal local keys, sorted slots with no valid source) and softmax densely
  (with the sink column sink_h, value 0, when given; padding queries return zeros)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q_BTHD, k_BTKD, v_BTKD))
  valid = np.asarray(valid_BT)
  W = np.asarray(W_BKNMN, np.float64)
  sink = None if sink_logit_H is None else np.asarray(sink_logit_H, np.float64)
  B, T, H, _ = q.shape
  K = k.shape[2]
  g = H // K
  n = -(-T // block)
  pad = n * block - T
  kp = np.pad(k * valid[..., None, None], ((0, 0), (0, pad), (0, 0), (0, 0)))
  vp = np.pad(v * valid[..., None, None], ((0, 0), (0, pad), (0, 0), (0, 0)))
  vdp = np.pad(valid, ((0, 0), (0, pad)))
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for bb in range(B):
    for h in range(H):
      kh = h // g
      for t in range(T):
        i = t // block
        keys, vals, vis = [], [], []
        for r in range(W.shape[3]):
          for s in range(block):
            kk = sum(W[bb, kh, i, r, j] * kp[bb, j * block + s, kh] for j in range(n))
            vv = sum(W[bb, kh, i, r, j] * vp[bb, j * block + s, kh] for j in range(n))
            ok = any(W[bb, kh, i, r, j] != 0 and vdp[bb, j * block + s] for j in range(n))
            keys.append(kk), vals.append(vv), vis.append(ok and valid[bb, t])
        for s in range(block):
          p = i * block + s
          ok = p < T and valid[bb, p] and (not causal or p <= t)
          keys.append(kp[bb, p, kh]), vals.append(vp[bb, p, kh]), vis.append(ok)
        sc = np.array([q[bb, t, h] @ kk for kk in keys]) * scale
        sc = np.where(vis, sc, -np.inf)
        if not np.any(vis):
          continue
        if sink is not None:        # the virtual column: logit sink_h, value 0
          sc = np.append(sc, sink[h])
          vals = vals + [np.zeros_like(vals[0])]
        p_ = np.exp(sc - sc.max())
        out[bb, t, h] = (p_ / p_.sum()) @ np.stack(vals)
  return out


# ---------------------------------------------------------------- packed rows

class DocumentBlocks(NamedTuple):
  """Which blocks of a packed row may sort into which (docstring 10)."""
  seg: jax.Array      # [B, N, b] segment ids by block (-1: the pad to a multiple of b)
  owner: jax.Array    # [B, N]: the document of the block's first token
  pure: jax.Array     # [B, N]: every valid token of the block is of the owner's document
  same: jax.Array     # [B, N, N]: block j is pure and of block i's owner's document


def document_blocks(seg_BNb, slot_valid_BNb) -> DocumentBlocks:
  """The blocks' documents: a block is a sort source (and a query-side summary) only for the
  document all its tokens belong to."""
  owner = seg_BNb[:, :, 0]
  pure = slot_valid_BNb[:, :, 0] & jnp.all((seg_BNb == owner[..., None]) | ~slot_valid_BNb, -1)
  same = pure[:, None, :] & (owner[:, None, :] == owner[:, :, None])
  return DocumentBlocks(seg_BNb, owner, pure, same)


def document_layout(segment_ids_BT, b: int):
  """[B, T] int32: each token's index in a row of 2 ceil(T / b) blocks where a document that
  does not fit in the rest of the current block starts a fresh one (docstring 10): every
  document then either starts at a block boundary or lies inside one block.

  Bound: a document moves only when it is longer than the gap it leaves (< b), so the gaps add
  up to less than T and every index is < 2 T.

  The placement of a document depends on the ones before it: a cursor p moves left to right,
  token t taking p -> p + d_t(p mod b) and landing at p + d_t - 1 (d_t = 1, plus the gap b - r
  when t starts a document of n tokens with 0 < r and r + n > b). A step reads p only through
  its residue r, so the first t steps from p = 0 are one table over r in [0, b) of (residue
  after, distance moved); tables compose associatively (the later one read at the earlier's
  residue), and `lax.associative_scan` gives every prefix in O(T b log T) work without a loop
  over the tokens (docstring, "Loops"). The sequential form is the test reference."""
  B, T = segment_ids_BT.shape
  t = jnp.arange(T, dtype=jnp.int32)
  starts = segment_starts(segment_ids_BT) | (t == 0)[None]
  nxt = jnp.where(starts, t[None], T)                    # the next start after t
  after = jnp.pad(jax.lax.cummin(nxt[:, ::-1], axis=1)[:, ::-1][:, 1:], ((0, 0), (0, 1)),
                  constant_values=T)
  length = after - t[None]                               # at a start: its document's length
  r = jnp.arange(b, dtype=jnp.int32)
  moved = starts[..., None] & (r != 0) & (r + length[..., None] > b)          # [B, T, b]
  step_BTb = 1 + jnp.where(moved, b - r, 0)                 # d_t(r)
  _, dist_BTb = jax.lax.associative_scan(_then, ((r + step_BTb) % b, step_BTb), axis=1)
  return dist_BTb[..., 0] - 1                            # from p = 0 (residue 0)


def _then(first, second):
  """The cursor table of `first`'s steps followed by `second`'s: (residue, distance) [..., b]."""
  res1, dist1 = first
  res2, dist2 = second
  at = lambda x: jnp.take_along_axis(x, res1, axis=-1)
  return at(res2), dist1 + at(dist2)


# ---------------------------------------------------------------- the mixer

def _blocks(x_BT, n: int, b: int, fill=0):
  """[B, T, ...] -> [B, n, b, ...] contiguous blocks (block i = tokens [i b, (i+1) b)),
  padded at the end with `fill`."""
  pad = n * b - x_BT.shape[1]
  x = jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2), constant_values=fill)
  return x.reshape((x.shape[0], n, b) + x.shape[2:])


class SinkhornState(NamedTuple):
  """Sinkhorn's decoding state: the KV cache and the per-block input sums and counts."""
  cache: cache_lib.KVCache
  sums: jax.Array     # [B, N, D] fp32
  counts: jax.Array   # [B, N] fp32


@register_mixer("sinkhorn")
class SinkhornAttention(Mixer):
  """Sparse Sinkhorn attention (see the module docstring). Options: config.model.sinkhorn."""
  # The SortNet's hidden width and the per-head sort embedding: small, replicated.
  axis_rules = (("sort_hidden", None), ("sort_dim", None))

  @dataclasses.dataclass(frozen=True)
  class Options(SinkLogitOptions):
    block_size: int = 64         # b: tokens per block
    causal: bool = True          # False: sort freely (sets, classification; no decoding)
    n_iters: int = 7             # Sinkhorn iterations (paper's best: 7)
    temperature: float = 0.75    # tau (paper's best: 0.75)
    gumbel_noise: bool = True    # Gumbel noise on the sort logits when train and rng given
    sortnet_depth: int = 1       # GELU layers of the SortNet MLP
    sortnet_width: int = 128     # their width
    sort_dim: int = 32           # per kv head width of the bilinear sort score
    n_sortcut: int = 0           # 0: soft sorting (one mixed block); m > 0: top-m blocks
    hard_inference: bool = True  # without SortCut: hard sorting when not training

    def validate(self, cfg: ModelConfig, where: str) -> None:
      need = field_check(where)
      self.validate_sink_logit(where)

      for f in ("block_size", "n_iters", "sortnet_depth", "sortnet_width", "sort_dim"):
        val = getattr(self, f)
        need(is_int(val, 1), f, f"must be a positive integer, got {val!r}")
      need(is_int(self.n_sortcut, 0), "n_sortcut",
           f"must be an integer >= 0 (0 = soft sorting), got {self.n_sortcut!r}")
      t = self.temperature
      need(is_number(t) and t > 0, "temperature", f"must be a positive finite number, got {t!r}")
      for f in ("causal", "gumbel_noise", "hard_inference"):
        need(isinstance(getattr(self, f), bool), f, f"must be True or False, got "
             f"{getattr(self, f)!r}")

  @classmethod
  def packed_rows_problem(cls, opts) -> str | None:
    """Why packed rows (`data.document_mask`) would not be exact, or None (docstring 10)."""
    if opts.causal:
      return None
    return (f"sinkhorn.causal=False keeps the packed blocks of block_size={opts.block_size}, "
            "exact only for documents that start at multiples of it")

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads)."""
    return dataclasses.replace(cls.Options(), block_size=4, sortnet_width=16, sort_dim=8)

  def __init__(self, cfg: ModelConfig, opts: "SinkhornAttention.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)
    pdt = dtype_of(cfg.param_dtype)
    W, D, K, S = opts.sortnet_width, cfg.d_model, cfg.kv_heads, opts.sort_dim
    kw = dict(rngs=rngs, dtype=jnp.float32, param_dtype=pdt)
    layers = [Linear((D,), (W,), in_axes=("embed",), out_axes=("sort_hidden",),
                     init_std=D ** -0.5, **kw)]
    for _ in range(opts.sortnet_depth - 1):
      layers.append(Linear((W,), (W,), in_axes=("sort_hidden",), out_axes=("sort_hidden",),
                           init_std=W ** -0.5, **kw))
    self.sortnet = nnx.List(layers)
    self.sort_u = Linear((W,), (K, S), in_axes=("sort_hidden",), out_axes=("kv_heads", "sort_dim"),
                         init_std=W ** -0.5, **kw)
    self.sort_r = Linear((W,), (K, S), in_axes=("sort_hidden",), out_axes=("kv_heads", "sort_dim"),
                         init_std=W ** -0.5, **kw)

  # ---------------------------------------------------------------- pieces
  def project(self, x_BTD, positions_BT):
    """q [B,T,H,D], k/v [B,T,K,D] (RoPE at the positions; padding tokens' k, v zeroed)."""
    cfg = self.cfg
    q, k, v = self.proj.qkv(x_BTD)
    cos, sin = rope_angles(jnp.maximum(positions_BT, 0), cfg.head_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    valid = (positions_BT >= 0)[..., None, None]
    return q, jnp.where(valid, k, 0).astype(k.dtype), jnp.where(valid, v, 0).astype(v.dtype)

  def sort_logits(self, sums_BND, counts_BN, rng, train, query_from_previous=None):
    """R / tau [B, K, N, N] fp32 from per-block input sums and token counts.

    `query_from_previous` (default: the causal flag) makes block i's query side read block
    i-1's summary (docstring 2); tests switch it off to show the leak it prevents."""
    o = self.opts
    if query_from_previous is None:
      query_from_previous = o.causal
    h = sums_BND.astype(jnp.float32) / jnp.maximum(counts_BN, 1.0)[..., None]
    for layer in self.sortnet:
      h = jax.nn.gelu(layer(h))
    r = self.sort_r(h)                                    # [B, N, K, S]
    if query_from_previous:  # block i decides from block i-1; row 0 is masked anyway
      h = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    u = self.sort_u(h)
    R = jnp.einsum("biks,bjks->bkij", u, r) / math.sqrt(o.sort_dim)
    if train and rng is not None and o.gumbel_noise:
      R = R + jax.random.gumbel(rng, R.shape, jnp.float32)
    return R / o.temperature

  def plan(self, logp_BKQN, allowed_BKQN, train, full_square=False) -> SortPlan:
    """Soft mix, hard sort or SortCut from the balanced log matrix (docstring 4, 5)."""
    o = self.opts
    m = o.n_sortcut
    allowed = jnp.broadcast_to(allowed_BKQN, logp_BKQN.shape)
    if m == 0 and (train or not o.hard_inference):
      return SortPlan(P=jnp.where(allowed, jnp.exp(logp_BKQN), 0.0))
    if m == 0 and not o.causal:
      assert full_square, "the greedy permutation needs the whole square matrix"
      idx, ok = greedy_permutation(logp_BKQN, allowed)
      idx, ok = idx[..., None], ok[..., None]
      return SortPlan(idx=idx, w=jnp.ones(idx.shape, jnp.float32), ok=ok)
    k = max(1, min(m, logp_BKQN.shape[-1]))
    vals, idx = jax.lax.top_k(jnp.where(allowed, logp_BKQN, -jnp.inf), k)
    ok = vals > -jnp.inf
    p = jnp.where(ok, jnp.exp(jnp.where(ok, vals, 0.0)), 0.0)
    w = 1.0 + (p - jax.lax.stop_gradient(p))                # 1 forward, dp backward
    return SortPlan(idx=idx.astype(jnp.int32), w=w, ok=ok)

  def core(self, x_BTD, positions_BT, rng=None, train=False, segment_ids_BT=None):
    """Full-sequence forward before the output projection.

    Returns (y [B,T,H,D], aux dict with q, k, v, the plan and the log sort matrix). Causal
    packed rows run in the `document_layout` row (twice as many blocks; aux then describes
    that row) and come back by a gather (docstring 10)."""
    if segment_ids_BT is None or not self.opts.causal:
      return self._core(x_BTD, positions_BT, rng, train, segment_ids_BT)
    B = x_BTD.shape[0]
    n = -(-x_BTD.shape[1] // self.opts.block_size)
    dest_BT = document_layout(segment_ids_BT, self.opts.block_size)
    rows = jnp.arange(B)[:, None]
    wide = 2 * n * self.opts.block_size

    def put(a, fill):
      return jnp.full((B, wide) + a.shape[2:], fill, a.dtype).at[rows, dest_BT].set(a)

    y, aux = self._core(put(x_BTD, 0), put(positions_BT, -1), rng, train,
                        put(segment_ids_BT, -1))
    return y[rows, dest_BT], aux

  def _core(self, x_BTD, positions_BT, rng, train, segment_ids_BT):
    cfg, o = self.cfg, self.opts
    B, T, _ = x_BTD.shape
    b = o.block_size
    n = -(-T // b)
    valid = positions_BT >= 0
    q, k, v = self.project(x_BTD, positions_BT)
    pos_blk = _blocks(jnp.where(valid, positions_BT, -1).astype(jnp.int32), n, b, fill=-1)
    slot_valid = pos_blk >= 0
    xs = _blocks(jnp.where(valid[..., None], x_BTD.astype(jnp.float32), 0.0), n, b)
    logits = self.sort_logits(xs.sum(2), slot_valid.sum(2).astype(jnp.float32), rng, train)
    docs = None if segment_ids_BT is None else document_blocks(
        _blocks(segment_ids_BT, n, b, fill=-1), slot_valid)
    if o.causal:
      allowed = jnp.tril(jnp.ones((n, n), bool), -1)[None, None]
      starts = None
      if docs is not None:
        allowed = allowed & docs.same[:, None]
        starts = jnp.min(jnp.where(allowed[:, 0], jnp.arange(n)[None, None, :],
                                   jnp.arange(n)[None, :, None]), axis=-1)   # [B, N]
      logp = causal_sinkhorn_rows(logits, o.n_iters, starts)
    else:
      bv = jnp.any(slot_valid, axis=2)                         # [B, N] block has a token
      allowed = (bv[:, :, None] & bv[:, None, :])[:, None]
      if docs is not None:
        allowed = allowed & (docs.same & docs.pure[:, :, None])[:, None]
      zeros = jnp.zeros((B, 1, n), jnp.float32)
      logp = sinkhorn_log(logits, allowed, zeros, zeros, o.n_iters)
    plan = self.plan(logp, allowed, train, full_square=True)
    kb, vb = _blocks(k, n, b), _blocks(v, n, b)
    sk, sv, s_valid = sort_blocks(kb, vb, slot_valid, plan)
    y = block_attend(_blocks(q, n, b), sk, sv, s_valid, kb, vb, pos_blk, pos_blk,
                     scale=cfg.head_dim ** -0.5, causal=o.causal, impl=cfg.attention_impl,
                     sink_logit_H=self.sink(),
                     segments=None if docs is None else (docs.seg, docs.owner, docs.seg))
    y = y.reshape(B, n * b, cfg.n_heads, -1)[:, :T]
    return y, dict(q=q, k=k, v=v, plan=plan, logp=logp, n_blocks=n, allowed=allowed)

  def sink(self):
    """The [H] sink logit for `entry.attend` (None without one; docstring 9)."""
    return sink_logit_of(self.opts, self.sink_logit, self.cfg.n_heads)

  @staticmethod
  def sharpness(logp_BKNN, allowed) -> jax.Array:
    """Mean over rows that may take a block of the largest balanced weight (1 = hard sort)."""
    allowed = jnp.broadcast_to(allowed, logp_BKNN.shape)
    top = jnp.max(jnp.where(allowed, jnp.exp(logp_BKNN), 0.0), axis=-1)
    rows = jnp.any(allowed, axis=-1)
    return jnp.sum(jnp.where(rows, top, 0.0)) / jnp.maximum(jnp.sum(rows), 1)

  # ---------------------------------------------------------------- interface
  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    if positions_BT is None:   # a plain 0..T-1 full forward
      positions_BT = causal_positions(*x_BTD.shape[:2])
    if state is not None:
      return self._step(x_BTD, positions_BT, state, rng, train)
    y, aux = self.core(x_BTD, positions_BT, rng, train, segment_ids_BT)
    sharp = jax.lax.stop_gradient(self.sharpness(aux["logp"], aux["allowed"]))
    return self.proj.o(y), None, {"sinkhorn_sharpness": sharp}

  def _step(self, x_BTD, positions_BT, state, rng, train):
    """Stateful call: T new tokens continue the stream held in `state` (causal mode)."""
    cfg, o = self.cfg, self.opts
    if not o.causal:
      raise ValueError("config.model.sinkhorn.causal: decoding needs the causal mode")
    if state.cache.fresh:   # nothing cached: the full forward, whatever the length
      y, aux = self._core(x_BTD, positions_BT, rng, train, None)
      new_state = self._remember(state, x_BTD, aux["k"], aux["v"], positions_BT)
      return self.proj.o(y), new_state, {}
    B, T, _ = x_BTD.shape
    b = o.block_size
    nb = state.cache.pos.shape[1] // b
    valid = positions_BT >= 0
    q, k, v = self.project(x_BTD, positions_BT)
    new_state = self._remember(state, x_BTD, k, v, positions_BT)
    kv = new_state.cache
    kbuf, vbuf, pbuf = kv.k.swapaxes(1, 2), kv.v.swapaxes(1, 2), kv.pos   # slot-major

    logits = self.sort_logits(new_state.sums, new_state.counts, rng, train)   # [B,K,nb,nb]
    i_BT = jnp.where(valid, positions_BT // b, 0)
    logp = causal_rows(logits, i_BT, o.n_iters)               # [B, K, T, nb]
    allowed = (jnp.arange(nb)[None, :] < i_BT[..., None])[:, None]
    plan = self.plan(logp, allowed, train)
    to_blocks = lambda x: x.reshape((B, nb, b) + x.shape[2:])
    kb, vb, pb = to_blocks(kbuf), to_blocks(vbuf), to_blocks(pbuf)
    sk, sv, s_valid = sort_blocks(kb, vb, pb >= 0, plan)      # [B, T, m b, K, D]
    own = jax.vmap(lambda x_N, i_T: x_N[i_T])                 # each token's own block
    y = block_attend(q[:, :, None], sk, sv, s_valid, own(kb, i_BT), own(vb, i_BT), own(pb, i_BT),
                     positions_BT[:, :, None].astype(jnp.int32), scale=cfg.head_dim ** -0.5,
                     causal=True, impl=cfg.attention_impl, sink_logit_H=self.sink())
    return self.proj.o(y.reshape(B, T, cfg.n_heads, -1)), new_state, {}

  def _remember(self, state, x_BTD, k_BTKD, v_BTKD, positions_BT) -> SinkhornState:
    """`state` with the new tokens' k, v cached and their inputs added to their blocks' sums
    and counts (padding, position -1, goes nowhere)."""
    nb = state.sums.shape[1]
    blk = jnp.where(positions_BT >= 0, positions_BT // self.opts.block_size, nb)  # nb: dropped
    add = jax.vmap(lambda buf, i, val: buf.at[i].add(val, mode="drop"))
    return SinkhornState(state.cache.write(k_BTKD, v_BTKD, positions_BT),
                         add(state.sums, blk, x_BTD.astype(jnp.float32)),
                         add(state.counts, blk, jnp.ones_like(blk, jnp.float32)))

  @classmethod
  def init_state(cls, cfg, opts, batch: int, capacity: int, dtype, policy=None):
    del policy   # the sort needs every block: always the linear cache
    if not opts.causal:
      return None
    b = opts.block_size
    C = -(-capacity // b) * b
    K, D = cfg.kv_heads, cfg.head_dim
    return SinkhornState(cache_lib.init_cache(cache_lib.LINEAR, batch, C, K, D, D, dtype),
                         sums=jnp.zeros((batch, C // b, cfg.d_model), jnp.float32),
                         counts=jnp.zeros((batch, C // b), jnp.float32))

  @classmethod
  def flops_per_token(cls, cfg, opts, seq_len: int) -> float:
    """Scores and values over (m+1) b keys (local block causal: (b+1)/2 on average), the soft
    mix of K and V (N blocks, without SortCut) and the Sinkhorn iterations (~4 FLOPs per entry
    and iteration; causal: N prefix problems of N^2 entries)."""
    b = opts.block_size
    n = -(-seq_len // b)
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    m = opts.n_sortcut or 1
    local = (b + 1) / 2.0 if opts.causal else float(b)
    attn = 4.0 * H * D * (m * b + local)
    mix = 0.0 if opts.n_sortcut else 4.0 * K * D * n
    sink = 4.0 * K * opts.n_iters * n * n * (n if opts.causal else 1) / seq_len
    return attn + mix + sink

  @classmethod
  def max_chunk(cls, cfg, opts, capacity: int, policy=None) -> int | None:
    return opts.block_size

  @classmethod
  def max_fresh_chunk(cls, cfg, opts, capacity: int, policy=None) -> int | None:
    return None   # a fresh state runs the full forward (`_step`)

  @classmethod
  def stream_limit(cls, cfg, opts, capacity: int, policy=None) -> int:
    return capacity   # the buffer keeps every block seen so far
