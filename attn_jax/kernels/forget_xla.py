"""The pure-XLA core of logit-decayed attention (FoX, ALiBi), and its explicit reference.

    s_ij = scale q_i.k_j + (g_i - g_j),  g_t = sum_{s<=t} log f_s  (per head; log f <= 0)
    y_i = sum_{j<=i} softmax_j(s_ij) v_j

(attention/fox.py: the forget gate; attention/alibi.py: log f = -m_h fixed.) This is the core
the mixers' full forward runs where the decayed Pallas kernel (`decayed.py`) is not taken: on a
CPU, or for shapes the kernel cannot tile (`entry.attend_decayed` chooses).

Exact and causal at any length, with no [T, T] bias (`forget_attention`): the sequence is cut
into blocks of c tokens (the mixers' `block_size`, 256), and every pair's decay g_i - g_j
(i in block I, j in block J) is assembled from sums over disjoint ranges, never as the difference of two long
prefix sums (`_decay_parts`):
- J = I: l_i - l_j, l the cumulative sum inside the block (from the block's first token), kept
  as a double word (hi, lo) by a compensated (TwoSum) scan: (hi_i - hi_j) + (lo_i - lo_j) is
  the pair's decay rounded once at its own size, not at the size of the block's decay.
- J < I: l_i + M[I, J] + r_j, with r_j the sum over the rest of block J after j and M[I, J]
  the sum of the totals of the blocks strictly between (an [n, n] suffix sum per query block,
  n = T / c, each entry adding only its own blocks). All three terms are <= 0, so each is at
  most |g_i - g_j| and the pair carries a rounding of its own decay only.
Why it matters: under strong forgetting (log f ~ -8 to -20 nats per token) |g| grows to ~10^5
at 8K tokens, and an fp32 prefix sum is rounded at 2^-24 |g| ~ 4e-3 nats, so a difference of
two of them puts that error on the logits of neighbouring keys, whose weights are not small;
a pair in one block would likewise carry the rounding of the whole block's decay. Two paths
compute the same softmax (`path`; "auto" = `choose_path`):
- "blocked" (under "auto": on CPU, for T <= BLOCKED_MAX_LEN): query block I over keys [0, e_I)
  in one `dense.blocked_attention` call per block, as the Transformer's CPU core does (two large
  matmuls per block, the upper triangle skipped). The bias is a row term l_i plus a column
  term (M[I, J] + r_j for earlier keys, -l_j in block I), formed from O(T + n^2) vectors. The
  row term cancels in exact arithmetic but is kept: without it the logits of row i are shifted
  by -l_i (up to a block's decay) and the softmax rounds them at that size. The backward keeps
  each block's probabilities (O(T^2 / 2) over the blocks, like any blocked attention): hence
  the length limit of "auto".
- "flash" (longer T): the diagonal blocks, j <= i in one block, as one batch of [c, c] biased,
  masked blocks (`lse_merge.partial_attention`); a query block I over an earlier key block J,
  s = q.k scale + l_i + r_j formed inside `blockwise.past_blocks`' loops, plus M[I, J] as its
  block-pair term (online softmax forward, recomputing backward; O(T) memory beside the
  n^2 block-pair terms); the two parts combined exactly by log-sum-exp (`lse_merge.combine`).
  "auto" takes it for longer T, and at every T on GPU / TPU (`kernel_choice.forget_path`,
  through `entry.attend_decayed`): there the
  blocked path's O(T^2 / 2) residuals per layer (all layers' at once in a training step) cost
  twice the Transformer's memory at 152M (17.2 vs 8.2 GiB on H100 at 4 x 2048 per device,
  compiled for the target), while CPU's measured speed favours the blocked path at moderate lengths.
Every bias is g_i - g_j <= 0 for a causal pair, so nothing overflows however strong the
forgetting: a far key's logit is a large negative number, its weight underflows to 0, and a
row's own diagonal entry (bias 0) keeps its log-sum-exp finite. Measured against the explicit
reference in float64 (`score_bias.forget_attention_reference`; tests/test_fox.py: log f down
to -20 nats per token, T up to 8192, both paths) the output is within 1e-5 of the largest |value|.


Packed rows (`segment_ids_BT`, full forwards): a pair (i, j) of different documents is masked
(`masks.segment_mask`: p_ij = 0) on every part (the blocked path's mask; the flash path's
diagonal-block mask and its loops' visibility), l restarts at every document start and r
stops at every document end (segmented sums, `_decay_parts`). A visible pair has no document
start in (j, i], so its l_i, M[I, J] and r_j sum only that document's gates:
g_i - g_j = sum_{l=j+1..i} log f_l is exactly the document's alone value, and no gradient
crosses a boundary (M is not segmented, but the pairs whose blocks between hold a start are
masked, and a finite score with p_ij = 0 has a zero cotangent). Masked pairs cannot produce
inf/NaN: their bias is a sum of finite sums. A query whose document starts inside its block
sees no past block (lse NEG_INF) and its diagonal entry keeps the combination finite. A shared
prefix (segment 0, the decoder's sink tokens) is visible by `masks.segment_mask`, but its pairs
cross a document start, so their bias mixes restarted sums, not the alone decay (which sums
over the tokens in between): the mixers' `reads_shared_prefix` stays False, and packed rows
with sink tokens are not exact for FoX / ALiBi.

"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_jax import kernel_choice
from attn_jax.kernels import blockwise, lse_merge
from attn_jax.kernels.dense import blocked_attention
from attn_jax.kernels.masks import causal_block_mask, segment_mask
from attn_jax.layers import segment_starts, time_cumsum

DEFAULT_BLOCK = 256


def _two_sum(a, b):
  """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's TwoSum, no branch)."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _add2(u, w):
  """Double-word sum of (hi, lo, reset) pairs for a segmented associative scan: w restarts the
  sum when its reset is set; otherwise hi + lo carries the sum to ~2^-48 of its size."""
  (uh, ul, ur), (wh, wl, wr) = u, w
  s, e = _two_sum(uh, wh)
  e = e + (ul + wl)
  hi = s + e
  lo = e - (hi - s)
  return jnp.where(wr, wh, hi), jnp.where(wr, wl, lo), ur | wr


def cumsum2(x_BTH, starts_BT=None):
  """Inclusive cumulative sum over axis 1 as a double word (hi, lo), hi + lo within ~2^-48 of
  the exact sum of the fp32 terms: then hi_i - hi_j is exact for nearby i, j (Sterbenz) and
  (hi_i - hi_j) + (lo_i - lo_j) is a difference of two long sums rounded once, at its own size
  rather than the sums'. Restarts where `starts_BT` is True (selects: exact zeros)."""
  r = jnp.zeros(x_BTH.shape, bool) if starts_BT is None else jnp.broadcast_to(
      starts_BT[..., None], x_BTH.shape)
  hi, lo, _ = jax.lax.associative_scan(_add2, (x_BTH, jnp.zeros_like(x_BTH), r), axis=1)
  return hi, lo


def _decay_parts(loga_BTH, c: int, starts_BT=None):
  """(l [B, T, H] as a double word (hi, lo), r [B, T, H], M [B, H, n, n]): the sums every
  pair's decay is built from (module docstring). T must be a multiple of c, n = T / c.

  l_i = sum of log f from the start of i's block to i (inclusive); r_j = sum over (j, end of
  j's block] (exclusive); M[I, J] = sum of the block totals strictly between J and I (J < I,
  0 elsewhere), each entry summed over its own blocks only. `starts_BT` (packed rows,
  `layers.segment_starts`): l restarts at every document start and r stops at every document
  end, so both read only their own document's gates (segmented sums whose restarts are
  selects); a visible pair has no document start in (j, i], so its three terms are then
  exactly its document's sums. M is not segmented: the pairs whose blocks between hold a start
  are masked."""
  B, T, H = loga_BTH.shape
  n = T // c
  x_MCH = loga_BTH.reshape(B * n, c, H)
  st_MC = None if starts_BT is None else starts_BT.reshape(B * n, c)
  l_MCH = cumsum2(x_MCH, st_MC)
  # suffix sums: a cumulative sum over the reversed block, restarting at each document's end
  nxt_MC = None if st_MC is None else jnp.pad(st_MC[:, 1:], ((0, 0), (0, 1)))
  rev = None if nxt_MC is None else nxt_MC[:, ::-1]
  incl_MCH = time_cumsum(x_MCH[:, ::-1], rev)[:, ::-1]       # sum over [m, end]
  r_MCH = jnp.pad(incl_MCH[:, 1:], ((0, 0), (0, 1), (0, 0)))  # sum over (m, end]
  if nxt_MC is not None:    # m is its document's last token: nothing of it follows
    r_MCH = jnp.where(nxt_MC[..., None], 0.0, r_MCH)
  tot_BNH = jnp.sum(x_MCH, axis=1).reshape(B, n, H)
  unfold = lambda a: a.reshape(B, T, H)
  return tuple(map(unfold, l_MCH)), unfold(r_MCH), _between(tot_BNH)


def _between(tot_BNH):
  """M [B, H, n, n], M[I, J] = sum_{J < K < I} tot_K (0 unless J < I): for each I a suffix sum
  over K of the totals of the blocks before I (zeros from K = I on), so each entry adds the
  blocks between its pair and nothing else (no difference of two long prefix sums)."""
  B, n, H = tot_BNH.shape
  before_NN = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]          # [I, K]: K < I
  a_BNNH = jnp.where(before_NN[None, :, :, None], tot_BNH[:, None], 0.0)
  suf = time_cumsum(a_BNNH.reshape(B * n, n, H)[:, ::-1])[:, ::-1]     # sum over K >= J
  m_BNNH = jnp.pad(suf[:, 1:], ((0, 0), (0, 1), (0, 0))).reshape(B, n, n, H)   # K > J
  return m_BNNH.transpose(0, 3, 1, 2).astype(tot_BNH.dtype)


def _qk(q_BTHD, k_BSKD, scale):
  """scale q.k [B, H, T, S] in fp32 (fp64 for float64), query head h on kv head h // G."""
  B, T, H, D = q_BTHD.shape
  K = k_BSKD.shape[2]
  f = jnp.promote_types(q_BTHD.dtype, jnp.float32)
  s = jnp.einsum("btkgd,bskd->bkgts", q_BTHD.reshape(B, T, K, H // K, D), k_BSKD,
                 preferred_element_type=f)
  return s.reshape(B, H, T, -1) * scale


def _heads_first(x_BTH):
  """[B, T, H] -> [B, H, T]."""
  return x_BTH.transpose(0, 2, 1)


def _pair_decay(l_q_BTH, l_k_BSH):
  """l_i - l_j as [B, H, T, S]."""
  return _heads_first(l_q_BTH)[..., :, None] - _heads_first(l_k_BSH)[..., None, :]


def pair_decay2(lq, lk):
  """l_i - l_j [B, H, T, S] of double words: (hi_i - hi_j) + (lo_i - lo_j)."""
  return _pair_decay(lq[0], lk[0]) + _pair_decay(lq[1], lk[1])


def _past_scores(scale, shared, qa, ka):
  """Score of (query block I, earlier key block J) for `blockwise.past_blocks`:
  q.k scale + l_i + r_j; past_blocks adds the pair's M[I, J], so that the decay is
  l_i + M[I, J] + r_j = g_i - g_j, three sums over disjoint ranges, each <= 0."""
  del shared
  q, l_q = qa
  k, r_k = ka
  s = _qk(q, k, scale)
  return s + (_heads_first(l_q)[..., :, None] + _heads_first(r_k)[..., None, :]).astype(s.dtype)


def forget_attention(q_BTHD, k_BTKD, v_BTKE, loga_BTH, *, scale: float, block: int,
                     sink_logit_H=None, segment_ids_BT=None, path: str = "auto"):
  """softmax_j(q_i.k_j scale + g_i - g_j) over j <= i, g = cumsum(log f), blockwise (module
  docstring): [B, T, H, E] in q's dtype. T is padded up to a multiple of the block.
  `segment_ids_BT`: packed rows, pairs of different documents masked (module docstring).
  `path`: "blocked" (query blocks over all their keys), "flash" (diagonal blocks + the O(T)
  loops over earlier blocks) or "auto" (`choose_path`)."""
  B, T, H, _ = q_BTHD.shape
  c = min(int(block), -(-T // 8) * 8)
  pad = -T % c
  seg = segment_ids_BT
  if pad:
    zpad = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    q_BTHD, k_BTKD, v_BTKE, loga_BTH = map(zpad, (q_BTHD, k_BTKD, v_BTKE, loga_BTH))
    if seg is not None:   # padded tokens: a document of their own (never read by a real query)
      seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
  l, r, m = _decay_parts(loga_BTH, c, None if seg is None else segment_starts(seg))
  run = _blocked if choose_path(path, T + pad) == "blocked" else _flash
  out = run(q_BTHD, k_BTKD, v_BTKE, l, r, m, scale=scale, c=c, sink_logit_H=sink_logit_H,
            seg=seg)
  return out[:, :T].astype(q_BTHD.dtype)


PATHS = ("auto", "blocked", "flash")
BLOCKED_MAX_LEN = 4096   # "auto": the blocked path up to this (padded) length, flash beyond


def choose_path(path: str, T: int) -> str:
  """"auto" -> `kernel_choice.forget_path` (module docstring: the blocked path keeps every
  block's probabilities for the backward, O(T^2 / 2), as the Transformer's blocked core does;
  the flash loops keep O(T)); another name is checked and kept."""
  if path not in PATHS:
    raise ValueError(f"forget_attention: unknown path {path!r} ({' | '.join(PATHS)})")
  return kernel_choice.forget_path(T, BLOCKED_MAX_LEN) if path == "auto" else path


def _flash(q, k, v, l, r, m, *, scale, c, sink_logit_H, seg):
  """The diagonal blocks as one batch of biased [c, c] blocks (l_i - l_j), the earlier blocks
  through `blockwise.past_blocks` (l_i + r_j per pair, M[I, J] per block pair), joined by
  log-sum-exp."""
  B, T = q.shape[:2]
  n = T // c
  fold = lambda x: x.reshape((B * n, c) + x.shape[2:])
  unfold = lambda x: x.reshape((B, n * c) + x.shape[2:])
  causal = jnp.tril(jnp.ones((c, c), bool))
  lf = tuple(map(fold, l))
  bias = jnp.where(causal, pair_decay2(lf, lf), 0.0)
  mask = causal if seg is None else causal & segment_mask(fold(seg), fold(seg))[:, None]
  diag = lse_merge.partial_attention(fold(q), fold(k), fold(v), scale=scale, bias=bias, mask=mask)
  past = blockwise.past_blocks(functools.partial(_past_scores, float(scale)), (), (q, l[0] + l[1]),
                           (k, r), v, block=c, segment_ids_BT=seg, block_bias_BHNN=m)
  return lse_merge.combine([tuple(map(unfold, diag)), past], sink_logit_H)


def _blocked(q, k, v, l, r, m, *, scale, c, sink_logit_H, seg):
  """Query block I = [a, a + c) over keys [0, a + c) (`dense.blocked_attention`), the bias of
  each block a row term plus a column term: l_i + (M[I, J] + r_j) for a key in an earlier
  block J, l_i - l_j in block I itself. The row term l_i is kept: it cancels in exact
  arithmetic, but without it the logits of one row are shifted by -l_i (up to a block's whole
  decay) and carry that magnitude's rounding into the softmax."""
  rows = lambda x, a, e: _heads_first(x[:, a:e])[..., :, None]          # [B, H, c, 1]
  hi, lo = l

  def bias_fn(a, e, s_end):
    del s_end
    col_hi, col_lo = -_heads_first(hi[:, a:e]), -_heads_first(lo[:, a:e])   # [B, H, c]
    if a:
      past = jnp.repeat(m[:, :, a // c, :a // c], c, axis=-1) + _heads_first(r[:, :a])
      col_hi = jnp.concatenate([past, col_hi], axis=-1)                 # [B, H, e]
      col_lo = jnp.pad(col_lo, ((0, 0), (0, 0), (a, 0)))
    return (rows(hi, a, e) + col_hi[..., None, :]) + (rows(lo, a, e) + col_lo[..., None, :])

  def mask_fn(a, e, s_end):
    causal = causal_block_mask(a, e, s_end)
    if seg is None:
      return causal
    vis = segment_mask(seg[:, a:e], seg[:, :s_end])[:, None]
    return vis if causal is None else vis & causal

  return blocked_attention(q, k, v, scale=scale, mask_fn=mask_fn, bias_fn=bias_fn,
                           sink_logit_H=sink_logit_H, chunk=c, prefix=True)
