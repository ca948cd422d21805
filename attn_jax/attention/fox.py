"""Forgetting Attention (FoX): softmax attention whose logits carry a data-dependent forget gate.

Paper: Lin, Nikishin, He, Courville, "Forgetting Transformer: Softmax Attention with a Forget
Gate" (ICLR 2025); docs/papers.md §6.1. Per head h, with x = RMSNorm(input), d_h = d_model / H:

    q, k, v = x W_q, x W_k, x W_v
    f_t = sigmoid(w_f . x_t + b_f),  log f_t = -softplus(-(w_f . x_t + b_f))   (one per head)
    g_t = sum_{s<=t} log f_s                                                 (fp32 cumsum)
    s_ij = q_i.k_j / sqrt(d_h) + (g_i - g_j)  =  q_i.k_j / sqrt(d_h) + sum_{l=j+1..i} log f_l
    y_i = sum_{j<=i} softmax_j(s_ij) v_j,   out = y W_o

The whole logit decays (SISA instead decays an *added* read/write term, sisa.py): FoX is
attention with a learned, content-dependent recency prior. b_f starts at 0 (f ~ 1/2 at init,
the paper's default "full" gate; `forget_bias_init` moves it).

RoPE: off by default (`rope=False`), as in the paper, whose FoX models use no positional
embedding: g_i - g_j already orders the keys by (learned) distance, and the paper reports
RoPE adds nothing on top of the gate. Without RoPE the ring caches need no re-assigned
positions either (below). `rope=True` rotates q and k at their stream positions like
`attention` (dense cache only).

"Pro" block options (the paper's FoX (Pro)): `qk_norm` (per-head RMSNorm of q and k, its
scale per head), `key_shift` / `value_shift` (data-dependent token shift on the projected keys
/ values: k_t <- a_t k_{t-1} + (1 - a_t) k_t, a_t = sigmoid(w . x_t) per kv head, before the
QK-norm), `output_norm` (per-head RMSNorm of the attention output) and `output_gate`
(y <- y * sigmoid(x W_g), [H, d_h] per token, before W_o). Each adds parameters
(`extra_params`); the configs narrow the SwiGLU to match the Transformer.

Exact and causal at any length, with no [T, T] bias (`forget_attention`): the sequence is cut
into blocks of c tokens (`block_size`, 256), and every pair's decay g_i - g_j (i in block I,
j in block J) is assembled from sums over disjoint ranges, never as the difference of two long
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
- "blocked" (under "auto": on CPU, for T <= BLOCKED_MAX_LEN): query block I over keys [0, e_I) in one
  `core.blocked_attention` call per block, as the Transformer's CPU core does (two large
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
  "auto" takes it for longer T, and at every T on GPU / TPU (`kernel_choice.forget_path`): there the
  blocked path's O(T^2 / 2) residuals per layer (all layers' at once in a training step) cost
  twice the Transformer's memory at 152M (17.2 vs 8.2 GiB on H100 at 4 x 2048 per device,
  compiled for the target), while CPU's measured speed favours the blocked path at moderate lengths.
Every bias is g_i - g_j <= 0 for a causal pair, so nothing overflows however strong the
forgetting: a far key's logit is a large negative number, its weight underflows to 0, and a
row's own diagonal entry (bias 0) keeps its log-sum-exp finite. Measured against the explicit
reference in float64 (`forget_attention_reference`; tests/test_fox.py: log f down to -20 nats
per token, T up to 8192, both paths) the output is within 1e-5 of the largest |value|.

Packed rows (`segment_ids_BT`, full forwards): a pair (i, j) of different documents is masked
(`core.segment_mask`: p_ij = 0) on every part (the blocked path's mask; the flash path's
diagonal-block mask and its loops' visibility), l restarts at every document start and r
stops at every document end (segmented sums, `_decay_parts`). A visible pair has no document
start in (j, i], so its l_i, M[I, J] and r_j sum only that document's gates:
g_i - g_j = sum_{l=j+1..i} log f_l is exactly the document's alone value, and no gradient
crosses a boundary (M is not segmented, but the pairs whose blocks between hold a start are
masked, and a finite score with p_ij = 0 has a zero cotangent). Masked pairs cannot produce
inf/NaN: their bias is a sum of finite sums. A query whose document starts inside its block
sees no past block (lse NEG_INF) and its diagonal entry keeps the combination finite. The
token shift (`key_shift` / `value_shift`) restarts at a document's first token (its previous
token is the zero carry, as at the start of a row). A shared prefix (segment 0, the decoder's
sink tokens) is visible by `core.segment_mask`, but its pairs cross a document start, so their
bias mixes restarted sums, not the alone decay (which sums over the tokens in between):
`reads_shared_prefix` stays False, and packed rows with sink tokens are not exact for FoX /
ALiBi.

Padding (position -1) gets log f = 0: it leaves g unchanged. The full forward is index-causal
(right-padded rows: padding sits after the row's tokens), as SISA's chunked path.

Decoding (`init_state`, `FoXState`): the typed KV cache (`cache.py`) whose per-key extra is
s_j = g_j - g_last (<= 0, g_last: the row's running g after its last token), plus, with a token
shift, the last projected key / value. T new tokens attend to [cache ; themselves] with the
bias ell_i - s_j for cached keys and ell_i - ell_j among themselves, ell = the cumulative log f
over the new tokens only; then every s_j moves by the new tokens' decay. The large running sum
never forms, under any policy.

Eviction and the forget gate (a `Ring(W)` / `SinksRing(n, W)` policy at decode time; with
`rope=False` only, since FoX's ring keeps keys without RoPE). The cache's s_j is shifted by the
new tokens' decay after every call, so a kept key keeps its true decay to the query, accumulated
over every token in between, evicted ones included. Evicting a key j removes a weight proportional
to e^{g_i - g_j + q.k scale}: for a head that forgets (g_i - g_{i-W} << 0 across the window) the
window loses exponentially little, so a ring is close to exact; a head with f ~ 1 loses what
attention loses. The StreamingLLM sinks are decayed like any old key (their logit includes
g_i - g_sink, the whole stream's decay), so under forgetting they cannot soak up attention mass as
they do in a Transformer; the learned sink *logit* (`sink_logit`, a constant column, not decayed)
still can.

ALiBi (alibi.py) is the same computation with log f = -m_h fixed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax import kernel_choice
from attn_jax.attention import cache as cache_lib
from attn_jax.attention import blockwise, lse_merge
from attn_jax.attention.core import (attention_flops_per_token, blocked_attention,
                                     causal_block_mask, causal_keys, segment_mask)
from attn_jax.attention.projection import (QKVProjection, SinkLogitOptions, make_sink_logit,
                                           probs_with_sink, rope, sink_logit_of)
from attn_jax.field_checks import field_check, is_int, is_number
from attn_jax.kernels import decayed
from attn_jax.layers import (Linear, causal_positions, dtype_of, param, segment_starts,
                             stat_dtype, time_cumsum)
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

DEFAULT_BLOCK = 256


# ---------------------------------------------------------------- the attention computation

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


def _cumsum2(x_BTH, starts_BT=None):
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
  l_MCH = _cumsum2(x_MCH, st_MC)
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


def _pair_decay2(lq, lk):
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
  bias = jnp.where(causal, _pair_decay2(lf, lf), 0.0)
  mask = causal if seg is None else causal & segment_mask(fold(seg), fold(seg))[:, None]
  diag = lse_merge.partial_attention(fold(q), fold(k), fold(v), scale=scale, bias=bias, mask=mask)
  past = blockwise.past_blocks(functools.partial(_past_scores, float(scale)), (), (q, l[0] + l[1]),
                           (k, r), v, block=c, segment_ids_BT=seg, block_bias_BHNN=m)
  return lse_merge.combine([tuple(map(unfold, diag)), past], sink_logit_H)


def _blocked(q, k, v, l, r, m, *, scale, c, sink_logit_H, seg):
  """Query block I = [a, a + c) over keys [0, a + c) (`core.blocked_attention`), the bias of
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


def forget_attention_reference(q_BTHD, k_BTKD, v_BTKE, g_BTH, *, scale: float,
                               sink_logit_H=None, query_idx=None, segment_ids_BT=None):
  """Explicit O(T^2) Forgetting Attention (the tests' ground truth), in fp32 (fp64 for
  float64): masked softmax of q_i.k_j scale + (g_i - g_j), g the cumulative log f, with an
  optional sink column. `query_idx` restricts the query rows; `segment_ids_BT` masks pairs of
  different documents. Returns (out, scores)."""
  f32 = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
  T = k_BTKD.shape[1]
  idx = jnp.arange(T) if query_idx is None else jnp.asarray(query_idx)
  G = q_BTHD.shape[2] // k_BTKD.shape[2]
  k, v = jnp.repeat(f32(k_BTKD), G, axis=2), jnp.repeat(f32(v_BTKE), G, axis=2)
  g = f32(g_BTH)
  s = jnp.einsum("bihd,bjhd->bhij", f32(q_BTHD)[:, idx], k) * scale
  s = s + g[:, idx].transpose(0, 2, 1)[..., :, None] - g.transpose(0, 2, 1)[..., None, :]
  vis = idx[:, None] >= jnp.arange(T)[None, :]
  if segment_ids_BT is not None:
    vis = vis & segment_mask(segment_ids_BT[:, idx], segment_ids_BT)[:, None]
  s = jnp.where(vis, s, -jnp.inf)
  p = probs_with_sink(s, sink_logit_H)[..., :-1]
  return jnp.einsum("bhij,bjhd->bihd", p, v), s


# ---------------------------------------------------------------- options

@dataclasses.dataclass(frozen=True)
class BiasOptions(SinkLogitOptions):
  """Options of the score-bias mixers (fox, alibi): the sink logit plus the block."""
  block_size: int = 0             # block of the blockwise path; 0 = auto (256)
  path: str = "auto"              # blocked | flash | auto (CPU: blocked up to BLOCKED_MAX_LEN)

  def validate_bias(self, where: str) -> None:
    check = field_check(where)
    check(is_int(self.block_size, 0), "block_size",
          f"must be an integer >= 0 (0 = auto), got {self.block_size!r}")
    check(self.path in PATHS, "path", f"must be one of {' | '.join(PATHS)}, got {self.path!r}")
    self.validate_sink_logit(where)

  @property
  def block(self) -> int:
    return int(self.block_size) or DEFAULT_BLOCK


def extra_params(d_model: int, n_heads: int, n_kv_heads: int, opts: "FoX.Options") -> int:
  """Parameters FoX adds per layer over attention: the gate (d H + H) and the Pro options."""
  d, H, K, dh = d_model, n_heads, n_kv_heads, d_model // n_heads
  n = d * H + H
  n += opts.qk_norm * (H + K) * dh + opts.output_norm * H * dh + opts.output_gate * d * H * dh
  return n + (opts.key_shift + opts.value_shift) * d * K


def matched_d_ff(transformer_model, extra: int, multiple: int = 4) -> int:
  """SwiGLU width whose 3 d d_ff weights absorb `extra` mixer parameters per layer."""
  d = int(transformer_model.d_model)
  return int(multiple * round((int(transformer_model.d_ff) - extra / (3 * d)) / multiple))


# ---------------------------------------------------------------- the shared mixer body

def _rms(x, scale, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def token_shift(x_BTKD, alpha_BTK, prev_BKD, valid_BT, segment_ids_BT=None):
  """x_t <- a_t x_prev + (1 - a_t) x_t with x_prev the previous valid token of the row (the
  carried `prev_BKD` for the first, and for a document's first token in a packed row);
  returns (shifted, the last valid token's x = next prev)."""
  B, T = valid_BT.shape
  idx_BT = jnp.where(valid_BT, jnp.arange(T)[None, :], -1)
  last_BT = jax.lax.cummax(idx_BT, axis=1)                       # last valid index <= t
  before_BT = jnp.pad(last_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :T]
  if segment_ids_BT is not None:   # the previous token belongs to another document: none
    seg_before = jnp.take_along_axis(segment_ids_BT, jnp.maximum(before_BT, 0), axis=1)
    before_BT = jnp.where(seg_before == segment_ids_BT, before_BT, -1)
  gather = lambda i_BT: jnp.take_along_axis(x_BTKD, jnp.maximum(i_BT, 0)[..., None, None], 1)
  prev = jnp.where((before_BT >= 0)[..., None, None], gather(before_BT),
                   prev_BKD[:, None].astype(x_BTKD.dtype))
  a = alpha_BTK[..., None].astype(jnp.float32)
  out = (a * prev.astype(jnp.float32) + (1 - a) * x_BTKD.astype(jnp.float32))
  nxt = jnp.where((last_BT[:, -1] >= 0)[:, None, None], gather(last_BT[:, -1:])[:, 0],
                  prev_BKD.astype(x_BTKD.dtype))
  return out.astype(x_BTKD.dtype), nxt


class FoXState(NamedTuple):
  """Decoding state of a score-bias mixer: the KV cache, whose per-key extra is g_j - g_last
  [B, S, H] (fp32; <= 0), and the token-shift carry (previous projected key / value)."""
  cache: cache_lib.KVCache
  carry: dict


class ScoreBiasAttention(cache_lib.CachedMixer):
  """Attention with the logit bias g_i - g_j, g a cumulative per-head log forget rate.

  Subclasses own their parameters and define `features(x, positions, state, segment_ids=None)
  -> (q, k, v, log f, carry)` (q, k after any RoPE; carry: extra state entries such as the
  token-shift keys) and `finish(y, x)` (the output before W_o). Everything else (blockwise
  forward, caches, hooks) is here."""

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    cfg, opts = self.cfg, self.opts
    q, k, v, loga, carry = self.features(x_BTD, positions_BT, state, segment_ids_BT)
    sink = sink_logit_of(opts, self.sink_logit, cfg.n_heads)
    scale = cfg.head_dim ** -0.5
    if state is None and opts.path == "auto" and decayed.use_kernel(
        cfg.attention_impl, q.shape, k.shape, v.shape, what=type(self).__name__):
      # GPU / TPU: the decayed-attention kernel, g as fp32's double word (each pair's decay
      # rounded at its own size, as `_decay_parts` does)
      starts = None if segment_ids_BT is None else segment_starts(segment_ids_BT)
      hi, lo = _cumsum2(loga, starts)
      y = decayed.decayed_attention(q, k, v, scale=scale, g_BTH=hi, g_lo_BTH=lo, fox=True,
                                    segment_ids_BT=segment_ids_BT, sink_logit_H=sink)
    elif state is None:
      y = forget_attention(q, k, v, loga, scale=scale, block=opts.block, sink_logit_H=sink,
                           segment_ids_BT=segment_ids_BT, path=opts.path)
    else:
      y, kv = self._cached(q, k, v, loga, positions_BT, state.cache, sink)
      state = FoXState(kv, carry)
    aux = {"forget": jnp.mean(jnp.exp(loga))}       # mean forget rate (1 = no forgetting)
    return self.proj.o(self.finish(y, x_BTD)), state, aux

  def _cached(self, q, k, v, loga, positions_BT, kv: cache_lib.KVCache, sink):
    """T new tokens after the cache: bias ell_i - s_j on cached keys (s_j = g_j - g_last, kept
    relative under every policy), ell_i - ell_j among the new ones (ell: the new tokens' own
    cumulative log f); then every s_j moves by the new tokens' decay and the new keys join
    with s_j = ell_j - ell_last. Both differences of ell come from its double-word cumulative
    sum (`_cumsum2`), so a long prefill under strong forgetting rounds each pair's decay at
    its own size, as the training paths do (module docstring). A prefill's first call into a
    dense cache (`kv.fresh`, `Linear`) on GPU / TPU takes the full forward's kernel for its
    outputs (no [T, T] bias), then writes the same keys."""
    cfg = self.cfg
    hi, lo = _cumsum2(loga)        # ell as a double word: differences rounded at their size
    ell = hi + lo                                                      # [B, T, H]
    if kv.fresh and not kv.policy.bounded and decayed.use_kernel(
        cfg.attention_impl, q.shape, k.shape, v.shape, what=f"{type(self).__name__} prefill"):
      out = decayed.decayed_attention(q, k, v, scale=cfg.head_dim ** -0.5, g_BTH=hi,
                                      g_lo_BTH=lo, fox=True, positions_BT=positions_BT,
                                      sink_logit_H=sink)
    else:
      out = self._attend_cache(q, k, v, (hi, lo), positions_BT, kv, sink)
    last = ell[:, -1]                       # padding (log f = 0) keeps the last valid g
    shifted = kv.replace(extra=kv.extra - last[:, None].astype(kv.extra.dtype))
    own = (hi - hi[:, -1:]) + (lo - lo[:, -1:])                        # ell_j - ell_last
    return out, shifted.write(k, v, positions_BT, own)

  def _attend_cache(self, q, k, v, ell2, positions_BT, kv: cache_lib.KVCache, sink):
    """`attend_cache` with the decay bias: ell_i - s_j on cached keys, ell_i - ell_j (from the
    double word `ell2`) among the new ones."""
    T, (hi, lo) = q.shape[1], ell2
    rel = jnp.where((kv.pos >= 0)[..., None], -kv.extra, 0.0)          # g_last - g_j
    rel = rel.transpose(0, 2, 1)[:, :, None, :]                        # [B, H, 1, S]
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    new = jnp.where(causal, _pair_decay2((hi, lo), (hi, lo)), 0.0)      # [B, H, T, T]
    bias = jnp.concatenate([(hi + lo).transpose(0, 2, 1)[..., None] + rel, new], axis=-1)
    return cache_lib.attend_cache(kv, q, k, v, positions_BT, scale=self.cfg.head_dim ** -0.5,
                                  bias=bias, sink_logit_H=sink)

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward from the explicit reference's scores
    (last column: the sink); diagnostics."""
    q, k, v, loga, _ = self.features(x_BTD, None, None)
    _, s = forget_attention_reference(q, k, v, time_cumsum(loga),
                                      scale=self.cfg.head_dim ** -0.5)
    return probs_with_sink(s, sink_logit_of(self.opts, self.sink_logit, self.cfg.n_heads))

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads): blocks of 8 so
    that short test sequences take the blocked path."""
    return dataclasses.replace(cls.Options(), block_size=8)

  @classmethod
  def cache_policy(cls, cfg, opts, policy):
    policy = super().cache_policy(cfg, opts, policy)
    if getattr(opts, "rope", False) and policy.bounded:
      raise ValueError(f"fox.rope: the {policy.label} cache needs rope=False (a ring keeps keys "
                       "without re-assigned RoPE positions; see fox.py)")
    return policy

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts, batch: int, capacity: int, dtype,
                 policy=None) -> FoXState:
    g = jax.ShapeDtypeStruct((cfg.n_heads,), stat_dtype(cfg))   # g_j - g_last per key
    kv = cache_lib.init_cache(cls.cache_policy(cfg, opts, policy), batch, capacity, cfg.kv_heads,
                              cfg.head_dim, cfg.head_dim, dtype, extra=g)
    return FoXState(kv, cls.carry_state(cfg, opts, batch, dtype))

  @classmethod
  def carry_state(cls, cfg, opts, batch, dtype) -> dict:
    return {}

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                     causal_keys(seq_len))


# ---------------------------------------------------------------- the mixer

@register_mixer("fox")
class FoX(ScoreBiasAttention):
  """Forgetting Attention (module docstring). Options: `config.model.fox`."""

  @dataclasses.dataclass(frozen=True)
  class Options(BiasOptions):
    forget_bias_init: float = 0.0   # b_f: f = sigmoid(w.x + b_f) ~ 1/2 at init (the paper's)
    rope: bool = False              # RoPE on q, k (the paper: none; linear cache only)
    qk_norm: bool = False           # Pro: per-head RMSNorm of q and k
    key_shift: bool = False         # Pro: data-dependent token shift of the keys
    value_shift: bool = False       # Pro: ... of the values
    output_norm: bool = False       # Pro: per-head RMSNorm of the attention output
    output_gate: bool = False       # Pro: y * sigmoid(x W_g) before W_o

    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      need = field_check(where)
      b = self.forget_bias_init
      need(is_number(b), "forget_bias_init", f"must be a finite number, got {b!r}")
      for name in ("rope", "qk_norm", "key_shift", "value_shift", "output_norm", "output_gate"):
        need(isinstance(getattr(self, name), bool), name,
             f"must be True or False, got {getattr(self, name)!r}")
      self.validate_bias(where)

  def __init__(self, cfg: ModelConfig, opts: "FoX.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, K, Dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, init_std=cfg.init_std)
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.fgate = Linear((D,), (H,), in_axes=("embed",), out_axes=("heads",), **kw)
    self.fgate_bias = param(rngs, nnx.initializers.constant(float(opts.forget_bias_init)), (H,),
                            ("heads",), pdt, kind="bias")
    ones = nnx.initializers.ones_init()
    norm = lambda n, ax: param(rngs, ones, (n, Dh), (ax, "head_dim"), pdt, kind="norm")
    self.q_norm = norm(H, "heads") if opts.qk_norm else None
    self.k_norm = norm(K, "kv_heads") if opts.qk_norm else None
    self.out_norm = norm(H, "heads") if opts.output_norm else None
    shift = lambda: Linear((D,), (K,), in_axes=("embed",), out_axes=("kv_heads",), **kw)
    self.k_shift = shift() if opts.key_shift else None
    self.v_shift = shift() if opts.value_shift else None
    self.ogate = (Linear((D,), (H, Dh), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
                  if opts.output_gate else None)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def log_forget(self, x_BTD, positions_BT):
    """log f [B, T, H] in fp32 (fp64 for float64); 0 for padding."""
    f = stat_dtype(self.cfg)
    pre = self.fgate(x_BTD).astype(f) + self.fgate_bias[...].astype(f)
    loga = jax.nn.log_sigmoid(pre)
    if positions_BT is not None:
      loga = jnp.where((positions_BT >= 0)[..., None], loga, 0.0)
    return loga

  def features(self, x_BTD, positions_BT, state, segment_ids_BT=None):
    cfg, opts, p = self.cfg, self.opts, self.proj
    B, T, _ = x_BTD.shape
    pos = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = p.q(x_BTD), p.k(x_BTD), p.v(x_BTD)
    carry = {}
    for name, lin in (("k", self.k_shift), ("v", self.v_shift)):
      if lin is None:
        continue
      x = k if name == "k" else v
      prev = (jnp.zeros((B,) + x.shape[2:], x.dtype) if state is None
              else state.carry[f"{name}_prev"])
      x, carry[f"{name}_prev"] = token_shift(x, jax.nn.sigmoid(lin(x_BTD).astype(jnp.float32)),
                                             prev, pos >= 0, segment_ids_BT)
      k, v = (x, v) if name == "k" else (k, x)
    if opts.qk_norm:
      q, k = _rms(q, self.q_norm[...], cfg.norm_eps), _rms(k, self.k_norm[...], cfg.norm_eps)
    if opts.rope:
      q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    return q, k, v, self.log_forget(x_BTD, positions_BT), carry

  def finish(self, y_BTHD, x_BTD):
    if self.out_norm is not None:
      y_BTHD = _rms(y_BTHD, self.out_norm[...], self.cfg.norm_eps)
    if self.ogate is not None:
      y_BTHD = y_BTHD * jax.nn.sigmoid(self.ogate(x_BTD).astype(jnp.float32)).astype(y_BTHD.dtype)
    return y_BTHD

  @classmethod
  def carry_state(cls, cfg, opts, batch, dtype) -> dict:
    prev = jnp.zeros((batch, cfg.kv_heads, cfg.head_dim), dtype)
    return {f"{n}_prev": prev for n, on in (("k", opts.key_shift), ("v", opts.value_shift)) if on}
