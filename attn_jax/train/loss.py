"""Blockwise cross-entropy from final hidden states: the [B, T, V] logits never exist at once.

For tokens n with final hidden state h_n (after the final norm), head matrix W [D, V] (tied
embeddings: W = embed^T), target y_n and weight w_n:

    z_n = h_n W  (fp32),   lse_n = log sum_v exp(z_nv),   nll_n = lse_n - z_{n, y_n}
    returns  sum_n w_n nll_n,   sum_n w_n,   sum_n w_n [z_{n, y_n} = max_v z_nv]

The sequence is cut into n chunks of c positions (the last one padded with weight 0); a
`lax.scan` visits them, each chunk holding the whole batch (so a batch-sharded h stays
sharded), so at most [B, c, V] logits are live. The chunk grows with T past a fixed count:

    c = max(chunk, ceil(T / max_chunks)),   n = ceil(T / c) <= max_chunks   (16 by default)

so the scan runs at most `max_chunks` iterations at any length (a loop iteration is a host
round trip on a GPU, and a step's serial iterations must stay within 2 n_layers + 64,
train/hlo_loops.py), while the live logits stay bounded by the larger of two terms: the fixed
[B, chunk, V] of short sequences (128 positions, the whole batch: the count reaches 16 at
T 2048), or 1 / max_chunks of the full [B, T, V] beyond. The second grows with B T as the
activations a step keeps for its backward do (tens of d_model-wide vectors per token and
layer), so it stays the same small fraction of the step's memory at every length, the
fraction it has at T 2048; `vocab_chunk` bounds it further when V is large. Two ways to get
the gradient without keeping [B*T, V]:

- "fused" (default): a `custom_vjp` whose forward also forms, per chunk, the logit gradient
  dz = w (softmax(z) - onehot(y)) and immediately contracts it: dh = dz W^T, dW += h^T dz.
  The residuals are dh [B, T, D], dW [D, V] and the per-token nll (for a weight cotangent); the
  backward only scales them by the incoming cotangent of the NLL sum. Three matmuls in all,
  as the plain form (the "fused linear cross-entropy" idea of Liger-Kernel / Levanter).
- "remat": the chunk's function is wrapped in `jax.checkpoint`, so autodiff keeps only the
  chunk's inputs and the backward recomputes its logits: four matmuls (one forward again).

`vocab_chunk` (optional) also splits V: the logsumexp is accumulated online over vocab blocks
(running max m and sum s: s <- s e^{m - m'} + sum e^{z - m'}) and the target logit likewise;
"fused" then makes a second pass over the vocab blocks for dz, which recomputes the logits once
(four matmuls). Padded vocab columns (when vocab_chunk does not divide V) are masked out of the
softmax and the maximum.

A hit is a target whose logit is the row's maximum (an exact tie for the maximum counts as a
hit; `jnp.argmax` would take the first index): one comparison per row, where an argmax is a
(value, index) reduction that XLA:CPU runs as scalar code, as costly as the exp pass.

The model side (a patch for train/step.py): `h = model.hidden(tokens)`,
`W = model.unembed_matrix()`, `cross_entropy_from_hidden(h, W, targets, weights)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MODES = ("fused", "remat")


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array):
  """The plain form: sum of weighted token NLL (fp32), sum of weights, weighted argmax hits."""
  logits = logits_BTV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  w = weights_BT.astype(jnp.float32)
  hits = (jnp.argmax(logits, axis=-1) == targets_BT).astype(jnp.float32)
  return jnp.sum((logz - tgt) * w), jnp.sum(w), jnp.sum(hits * w)


def _logits(h_cD, w_DV):
  return jnp.einsum("cd,dv->cv", h_cD, w_DV.astype(h_cD.dtype),
                    preferred_element_type=jnp.float32)


def _vocab_blocks(w_DV, vocab_chunk):
  """[nv, D, vc] blocks of W (zero-padded) and the number of real columns V."""
  D, V = w_DV.shape
  nv = -(-V // vocab_chunk)
  w = jnp.pad(w_DV, ((0, 0), (0, nv * vocab_chunk - V)))
  return w.reshape(D, nv, vocab_chunk).transpose(1, 0, 2), V


def _whole_vocab(w_DV, vocab_chunk) -> bool:
  """True when the vocabulary is taken at once (no vocab blocks)."""
  return vocab_chunk is None or vocab_chunk >= w_DV.shape[1]


def _full_vocab(z_cV, y_c):
  """(lse, target logit, hit, softmax) of logits over the whole vocabulary; the softmax reuses
  the exp of the logsumexp (one exp per logit for the loss and its gradient); hit: z_y is the
  row's maximum (module docstring)."""
  m = jnp.max(z_cV, axis=-1)
  e = jnp.exp(z_cV - m[:, None])
  s = jnp.sum(e, axis=-1)
  tgt = jnp.take_along_axis(z_cV, y_c[:, None], axis=-1)[:, 0]
  return m + jnp.log(s), tgt, tgt >= m, e * (1.0 / s)[:, None]


def _stats(h_cD, w_DV, y_c, vocab_chunk):
  """(lse, target logit, hit) of the chunk's logits, over V at once or online over blocks
  (hit: the target's logit is the largest, see `_full_vocab`)."""
  if _whole_vocab(w_DV, vocab_chunk):
    return _full_vocab(_logits(h_cD, w_DV), y_c)[:3]
  blocks, V = _vocab_blocks(w_DV, vocab_chunk)
  c = h_cD.shape[0]

  def body(carry, xs):
    m, s, tgt = carry
    w_blk, start = xs
    z = _logits(h_cD, w_blk)
    col = start + jnp.arange(vocab_chunk)
    z = jnp.where(col[None, :] < V, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
    local = y_c - start
    inside = (local >= 0) & (local < vocab_chunk)
    t = jnp.take_along_axis(z, jnp.clip(local, 0, vocab_chunk - 1)[:, None], axis=-1)[:, 0]
    return (m_new, s, jnp.where(inside, t, tgt)), None

  init = (jnp.full((c,), -jnp.inf), jnp.zeros((c,)), jnp.zeros((c,)))
  starts = jnp.arange(blocks.shape[0], dtype=jnp.int32) * vocab_chunk
  (m, s, tgt), _ = jax.lax.scan(body, init, (blocks, starts))
  return m + jnp.log(s), tgt, tgt >= m


def _chunk_sums(h_cD, w_DV, y_c, wt_c, vocab_chunk):
  lse, tgt, hit = _stats(h_cD, w_DV, y_c, vocab_chunk)
  nll_c = lse - tgt
  return nll_c, jnp.sum(nll_c * wt_c), jnp.sum(wt_c), jnp.sum(hit * wt_c)


def chunk_len(T: int, chunk: int, max_chunks: int) -> int:
  """Positions per chunk of the sequence scan: max(chunk, ceil(T / max_chunks)), at most T, so
  ceil(T / c) <= max_chunks iterations whatever T (module docstring)."""
  return min(max(chunk, -(-T // max_chunks)), T)


def _chunked(h_BTD, y_BT, wt_BT, chunk):
  """[B, T, .] -> [n, B*chunk, .]: sequence chunks (T padded with weight 0), batch kept whole in
  each chunk, so a batch-sharded (data-parallel) h stays sharded inside the scan."""
  B, T, D = h_BTD.shape
  n = -(-T // chunk)
  pad = n * chunk - T

  def split(x):
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    x = x.reshape((B, n, chunk) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((n, B * chunk) + x.shape[3:])

  return split(h_BTD), split(y_BT), split(wt_BT)


def _unchunked(x_NcD, B, T):
  n, _, D = x_NcD.shape
  x = x_NcD.reshape(n, B, -1, D)
  return jnp.swapaxes(x, 0, 1).reshape(B, -1, D)[:, :T]


def _remat_ce(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk):
  h, y, wt = _chunked(h_BTD, y_BT, wt_BT, chunk)

  @jax.checkpoint
  def one(h_cD, w_DV, y_c, wt_c):
    return _chunk_sums(h_cD, w_DV, y_c, wt_c, vocab_chunk)[1:]

  def body(acc, xs):
    return tuple(a + b for a, b in zip(acc, one(xs[0], w_DV, xs[1], xs[2]))), None

  (nll, wsum, hits), _ = jax.lax.scan(body, (0.0, 0.0, 0.0), (h, y, wt))
  return nll, wsum, hits


def _contract(h_cD, w_DV, dz_cV):
  """(dh = dz W^T [c, D], dW = h^T dz [D, V]), accumulated in fp32."""
  dz = dz_cV.astype(h_cD.dtype)
  dh = jnp.einsum("cv,dv->cd", dz, w_DV.astype(h_cD.dtype), preferred_element_type=jnp.float32)
  return dh, jnp.einsum("cd,cv->dv", h_cD, dz, preferred_element_type=jnp.float32)


def _fused_chunk(h_cD, w_DV, y_c, wt_c, vocab_chunk):
  """(nll [c], hit [c], dh [c, D], dW [D, V]) of one chunk: dz = wt (softmax - onehot) is
  formed and contracted at once."""
  if _whole_vocab(w_DV, vocab_chunk):
    lse, tgt, hit, p = _full_vocab(_logits(h_cD, w_DV), y_c)
    dz = p.at[jnp.arange(p.shape[0]), y_c].add(-1.0) * wt_c[:, None]
    return (lse - tgt, hit) + _contract(h_cD, w_DV, dz)
  lse, tgt, hit = _stats(h_cD, w_DV, y_c, vocab_chunk)
  return (lse - tgt, hit) + _vocab_block_grads(h_cD, w_DV, y_c, wt_c, lse, vocab_chunk)


def _vocab_block_grads(h_cD, w_DV, y_c, wt_c, lse_c, vocab_chunk):
  """`_contract` of dz over vocab blocks (the logits recomputed block by block)."""
  D, V = w_DV.shape
  blocks, _ = _vocab_blocks(w_DV, vocab_chunk)

  def body(dh, xs):
    w_blk, start = xs
    z = _logits(h_cD, w_blk)
    col = start + jnp.arange(vocab_chunk)
    p = jnp.where(col[None, :] < V, jnp.exp(z - lse_c[:, None]), 0.0)
    dh_blk, dw_blk = _contract(h_cD, w_blk, (p - (col[None, :] == y_c[:, None])) * wt_c[:, None])
    return dh + dh_blk, dw_blk

  starts = jnp.arange(blocks.shape[0], dtype=jnp.int32) * vocab_chunk
  dh, dw_blocks = jax.lax.scan(body, jnp.zeros((h_cD.shape[0], D), jnp.float32), (blocks, starts))
  return dh, dw_blocks.transpose(1, 0, 2).reshape(D, -1)[:, :V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ce(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk):
  return _fused_fwd(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk)[0]


def _fused_fwd(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk):
  B, T, _ = h_BTD.shape
  h, y, wt = _chunked(h_BTD, y_BT, wt_BT, chunk)

  def body(carry, xs):
    nll, wsum, hits, dw = carry
    h_c, y_c, wt_c = xs
    nll_c, hit, dh_c, dw_c = _fused_chunk(h_c, w_DV, y_c, wt_c, vocab_chunk)
    carry = (nll + jnp.sum(nll_c * wt_c), wsum + jnp.sum(wt_c),
             hits + jnp.sum(hit * wt_c), dw + dw_c)
    return carry, (dh_c, nll_c)

  init = (jnp.zeros(()), jnp.zeros(()), jnp.zeros(()), jnp.zeros(w_DV.shape, jnp.float32))
  (nll, wsum, hits, dw), (dh, nll_tok) = jax.lax.scan(body, init, (h, y, wt))
  dh = _unchunked(dh, B, T).astype(h_BTD.dtype)
  nll_tok = _unchunked(nll_tok[..., None], B, T)[..., 0]
  return (nll, wsum, hits), (dh, dw.astype(w_DV.dtype), nll_tok, y_BT)


def _fused_bwd(chunk, vocab_chunk, res, cots):
  del chunk, vocab_chunk
  dh, dw, nll_tok, y_BT = res
  g_nll, g_w, _ = cots  # hits have no gradient
  d_y = jnp.zeros(y_BT.shape, jax.dtypes.float0)
  return (g_nll.astype(dh.dtype) * dh, g_nll.astype(dw.dtype) * dw, d_y,
          g_nll * nll_tok + g_w)


_fused_ce.defvjp(_fused_fwd, _fused_bwd)


def cross_entropy_from_hidden(h_BTD: jax.Array, w_DV: jax.Array, targets_BT: jax.Array,
                              weights_BT: jax.Array, *, chunk: int = 128,
                              max_chunks: int = 16, vocab_chunk: int | None = None,
                              mode: str = "fused"):
  """(sum w nll, sum w, sum w hits) of the logits h W, computed `chunk_len(T, chunk,
  max_chunks)` positions (x the whole batch) at a time: `chunk` positions, or more where T
  needs more than `max_chunks` chunks of them.

  h_BTD: final hidden states (any float dtype; the matmuls accumulate in fp32);
  w_DV: head matrix (tied: embed.T). See the module docstring for `mode` and `vocab_chunk`."""
  if mode not in MODES:
    raise ValueError(f"cross-entropy mode must be one of {MODES}, got {mode!r}")
  if chunk < 1 or max_chunks < 1 or (vocab_chunk is not None and vocab_chunk < 1):
    raise ValueError(f"chunk ({chunk}), max_chunks ({max_chunks}) and vocab_chunk "
                     f"({vocab_chunk}) must be >= 1")
  y_BT = targets_BT.astype(jnp.int32)
  wt_BT = weights_BT.astype(jnp.float32)
  chunk = chunk_len(h_BTD.shape[1], chunk, max_chunks)
  if mode == "remat":
    return _remat_ce(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk)
  return _fused_ce(h_BTD, w_DV, y_BT, wt_BT, chunk, vocab_chunk)
