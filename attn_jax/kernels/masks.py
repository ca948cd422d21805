"""Which keys a query sees: the boolean masks every attention core shares, and the masked score.

A key at position p_k is visible to a query at position p_q iff 0 <= p_k (empty cache slots and
padding carry position -1), [causal] p_k <= p_q, [window w] p_q - p_k < w, and [packed rows]
seg_k == seg_q or seg_k == SHARED_SEGMENT (0): a shared prefix every document may read (the
decoder's learned sink tokens). Documents are numbered from 1.

Masked scores are NEG_INF, a finite number: a softmax that floors its row maximum at
NEG_INF / 2 gives a fully masked row exp(NEG_INF / 2) = 0 for every entry, never a NaN.
"""

from __future__ import annotations

import jax
import numpy as np

from attn_jax.layers import SHARED_SEGMENT

NEG_INF = -1e30  # finite: masked scores; the softmax floors its row max at NEG_INF / 2


def segment_mask(q_seg_BT: jax.Array, kv_seg_BS: jax.Array) -> jax.Array:
  """[B, T, S] boolean: key in the query's document, or in the shared prefix (segment 0)."""
  kv = kv_seg_BS[:, None, :]
  return (kv == q_seg_BT[:, :, None]) | (kv == SHARED_SEGMENT)


def positional_mask(q_pos_BT: jax.Array, kv_pos_BS: jax.Array, causal: bool,
                    window: int | None = None, q_seg_BT: jax.Array | None = None,
                    kv_seg_BS: jax.Array | None = None) -> jax.Array:
  """[B, 1, T, S] boolean: key visible to query. `window`: only keys with q_pos - k_pos <
  window (a sliding window of that many tokens, the query included). Segments (both or
  neither): only keys of the query's document or of the shared prefix (`segment_mask`)."""
  valid = kv_pos_BS[:, None, :] >= 0
  if causal:
    valid = valid & (kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
  if window is not None:
    valid = valid & (q_pos_BT[:, :, None] - kv_pos_BS[:, None, :] < window)
  if (q_seg_BT is None) != (kv_seg_BS is None):
    raise ValueError("q and kv segment ids come together (both or neither)")
  if q_seg_BT is not None:
    valid = valid & segment_mask(q_seg_BT, kv_seg_BS)
  return valid[:, None, :, :]


def causal_block_mask(a, e, s_end):
  """Static lower-triangular mask of rows [a, e) over keys [0, s_end) (None if all visible)."""
  if s_end <= a + 1:
    return None
  return np.arange(s_end)[None, :] <= np.arange(a, e)[:, None]
