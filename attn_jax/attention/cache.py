"""Decoding caches: one typed KV cache, and the policies that decide what it keeps.

    cache = init_cache(policy, batch, capacity, n_kv, d_k, d_v, dtype, extra=...)
    out, cache = cached_attention(cache, q, k, v, positions_BT, theta=..., scale=...)  # RoPE'd
    out = attend_cache(cache, q, k, v, positions_BT, scale=..., bias=...)   # then cache.write

(`cached_attention`: RoPE mixers, the policy's frame and sinks below; `attend_cache`: the
scoring core it calls, for mixers that rotate nothing or carry their own bias, e.g. FoX.)

`KVCache` (a pytree; its policy is static): k [B, K, S, Dk], v [B, K, S, Dv] (head-major:
the layout the score and value products read without a transpose), pos [B, S]
int32 (the stream position each slot holds, -1 = empty), ptr [B] int32 (valid tokens written
so far, per row), base [B] int32 (the rings' RoPE frame, below; 0 for `Linear`) and `extra`,
a mixer's own per-key data (any pytree of [B, S, ...] arrays, e.g.
SISA's g_j and R(Phi_j) B_j), written slot for slot with the keys. Slots are not positions:
masks come from `pos` (`masks.positional_mask`), so a caller never computes a slot.

A `CachePolicy` is an inference-time choice (the parameters do not depend on it), passed when the
state is made (`model.init_state(batch, capacity, policy=...)`); it owns three things:
- slot writes: `Linear()` puts token n of a row in slot n (capacity = the longest stream);
  `Ring(W)` in slot n mod W (the last W tokens, constant memory); `SinksRing(n, W)`
  (StreamingLLM, Xiao et al. 2023) keeps tokens 0..n-1 in slots 0..n-1 forever and token
  n' >= n in slot n + (n' - n) mod W;
- the visible-key set: every cached key, plus the new tokens themselves, within the policy's
  window of stream positions (W, query included; none for `Linear`);
- the RoPE frame. `Linear` caches keys after RoPE at their stream positions. The rings use
  positions assigned inside the cache, as in the paper: the visible keys of a query, oldest
  first, sit at 0, 1, ..., and the query at m = their number (cache [0,1,2,3,6,7,8] decoding
  token 9 uses 0..7). For a query at stream position p: m = min(p, n + W - 1). A window key j
  gets m - (p - j): its true distance p - j; a sink key j gets j: distance m - j. So only the
  sinks' distances are rewritten. Implementation, exact for chunks of any length <= W (each
  query has its own m), with no per-call rotation of the cache:
  * the window keys are cached after RoPE in a per-row frame `base` [B]: key j rotated by
    p_j - base, and the queries by p - base, so every relative distance is the true one. The
    frame is kept while it lags the ideal one, max(0, p_first - (n + W - 1)) (p_first: the
    row's first valid query), by at most W; then it moves there and the cached window keys
    are rotated once by the difference (a `lax.cond`: once per W tokens when streaming). Every
    angle stays below n + 3W however long the stream (fp32 RoPE angles of positions ~1e6 would
    lose ~0.1 rad);
  * the n sink slots hold their keys rotated by their own stream position j; their columns of
    the score are the exact scale * R(m_p) q_p . R(j) k_j (a second, [B, H, T, n] product with
    the query rotated by m);
  * masking uses stream positions: a sink slot is given the first query's position (always
    causal and inside the window for the chunk), other keys their own, window = W.
  With n + W >= the stream length nothing is evicted, m = p, and the result is dense attention.

New tokens attend to [cache ; themselves] before they are written, so a ring takes a chunk of
up to W tokens at once without the chunk overwriting keys its own queries still need
(`CachePolicy.max_chunk`). Rows advance independently (prompts of different lengths); padding
tokens (position -1) are never written and never advance a row.

Queries and keys may carry extra channels beside the rotated q.k (`Widening`: scored apart and
added, the cached keys' channels with an optional per-key factor; the new keys' share comes as
`bias_new`): that is how SISA feeds its state term to the same softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from attn_jax import kernel_choice
from attn_jax.attention.projection import rope
from attn_jax.field_checks import is_int
from attn_jax.kernels import entry
from attn_jax.kernels import decode_attend
from attn_jax.kernels.dense import from_rows, rows_softmax, to_rows
from attn_jax.kernels.masks import positional_mask
from attn_jax.layers import apply_rope, rope_angles
from attn_jax.mixer import Mixer


# ------------------------------------------------------------------ policies

@dataclasses.dataclass(frozen=True)
class CachePolicy:
  """Base of the cache policies (module docstring). Subclasses set `sinks` / `window`."""
  sinks = 0                     # first tokens kept forever
  window = None                 # recent tokens kept (query included); None: all

  @property
  def bounded(self) -> bool:
    return self.window is not None

  def slots(self, capacity: int) -> int:
    return capacity if self.window is None else self.sinks + self.window

  @property
  def max_chunk(self) -> int | None:
    """Most new tokens one call takes (a ring: its window; None = any)."""
    return self.window

  def stream_limit(self, capacity: int) -> int | None:
    """Longest stream the cache holds (None = any)."""
    return None if self.bounded else capacity

  def validate(self) -> None:
    if not is_int(self.sinks, 0):
      raise ValueError(f"{self.label}: sinks must be an integer >= 0, got {self.sinks!r}")
    w = self.window
    if w is not None and not is_int(w, 1):
      raise ValueError(f"{self.label}: window must be an integer >= 1, got {w!r}")

  @property
  def label(self) -> str:
    return type(self).__name__.lower()

  def slot_of(self, n_BT: jax.Array, S: int) -> jax.Array:
    """Slot of a row's n-th token (n counted from 0 over valid tokens)."""
    if self.window is None:
      return n_BT                       # past the capacity: dropped by the write
    n = self.sinks
    return jnp.where(n_BT < n, n_BT, n + (n_BT - n) % (S - n))

  def frame(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(base [B], m [B, T], first [B]): base = the ideal RoPE frame of a call (positions in
    the cache are stream position - base; a ring keeps its stored frame while it lags this one
    by at most W, module docstring); a query's position as the sinks see it is m; first: each
    row's first valid position."""
    valid = positions_BT >= 0
    first = jnp.min(jnp.where(valid, positions_BT, jnp.iinfo(jnp.int32).max), axis=1)
    first = jnp.where(jnp.any(valid, axis=1), first, 0)
    if self.window is None:
      return jnp.zeros_like(first), positions_BT, first
    span = self.sinks + self.window - 1
    return jnp.maximum(first - span, 0), jnp.minimum(positions_BT, span), first


@dataclasses.dataclass(frozen=True)
class Linear(CachePolicy):
  """Every token stays: slot n for token n (a dense cache of `capacity` slots)."""


@dataclasses.dataclass(frozen=True)
class Ring(CachePolicy):
  """The last `window` tokens (query included): slot n mod window."""
  window: int = 1020

  @property
  def label(self) -> str:
    return f"ring({self.window})"


@dataclasses.dataclass(frozen=True)
class SinksRing(CachePolicy):
  """StreamingLLM: the first `sinks` tokens plus the last `window` tokens."""
  sinks: int = 4
  window: int = 1020

  @property
  def label(self) -> str:
    return f"sinks+ring({self.sinks}+{self.window})"


LINEAR = Linear()


# ------------------------------------------------------------------ the cache

@struct.dataclass
class KVCache:
  """A fixed-size KV buffer that knows its positions (module docstring)."""
  k: jax.Array            # [B, K, S, Dk] after RoPE: at stream positions (Linear, sink slots)
                          # or at stream position - base (the rings' window slots)
  v: jax.Array            # [B, K, S, Dv]
  pos: jax.Array          # [B, S] int32, -1 = empty slot
  ptr: jax.Array          # [B] int32, valid tokens written so far
  extra: Any = None       # the mixer's per-key data: a pytree of [B, S, ...] arrays
  base: Any = None        # [B] int32: the RoPE frame of the window slots (rings; module doc)
  kx: Any = None          # [B, K, S, E] extra key channels scored beside q.k (`Widening`),
                          # head-major like k, written with the keys, never rotated
  policy: CachePolicy = struct.field(pytree_node=False, default=LINEAR)
  # Known empty at trace time (`as_fresh`: a prefill's first call): the new tokens attend to
  # themselves alone, with no run-time test of `pos`, and a mixer may compute them as its full
  # forward does (e.g. a fused kernel). Every write clears it.
  fresh: bool = struct.field(pytree_node=False, default=False)

  def write(self, k_BTKD, v_BTKD, positions_BT, extra=None, kx_BTKE=None,
            extra_update=None) -> "KVCache":
    """Write the valid new tokens (position >= 0) after each row's pointer, in order (padding
    may sit anywhere), into the policy's slots; `extra`: their per-key data (as `self.extra`);
    `kx_BTKE`: their extra key channels (a cache made with `kx_dim`); `extra_update`: a map of
    every cached key's extra before the new ones go in (FoX's shift of s_j: with one token,
    one elementwise pass writes both)."""
    B, T = positions_BT.shape
    S = self.pos.shape[1]
    if self.policy.bounded and T > S - self.policy.sinks:
      raise ValueError(f"{self.policy.label}: a chunk of {T} tokens is longer than the ring "
                       f"({S - self.policy.sinks} slots); feed at most `max_chunk` tokens")
    valid_BT = positions_BT >= 0
    n_BT = self.ptr[:, None] + jnp.cumsum(valid_BT, axis=1, dtype=jnp.int32) - 1
    slot_BT = jnp.where(valid_BT, self.policy.slot_of(n_BT, S), S)   # out of range: dropped
    if B == 1 and T == 1:   # one slot: an in-place dynamic-update-slice (`_put_one`)
      slot = slot_BT[0, 0]
      put = lambda buf, new: _put_one(buf, new, slot, 1)
      put_kv = lambda buf, new: _put_one(buf, jnp.swapaxes(new, 1, 2), slot, 2)
      if extra_update is None:
        put_extra = put
      else:   # the whole extra is rewritten anyway: the new slot selected in the same pass
        at = lambda b: (jnp.arange(S) == slot).reshape((1, S) + (1,) * (b.ndim - 2))
        put_extra = lambda b, new: jnp.where(at(b), new.astype(b.dtype), extra_update(b))
    else:
      rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
      put = lambda buf, new: buf.at[rows_BT, slot_BT].set(new.astype(buf.dtype), mode="drop")
      # head-major k / v: the indexed axes 0 and 2 come first in the update ([B, T, K, D])
      put_kv = lambda buf, new: buf.at[rows_BT, :, slot_BT].set(new.astype(buf.dtype),
                                                                mode="drop")
      put_extra = put if extra_update is None else lambda b, new: put(extra_update(b), new)
    return self.replace(
        k=put_kv(self.k, k_BTKD), v=put_kv(self.v, v_BTKD), pos=put(self.pos, positions_BT),
        ptr=self.ptr + jnp.sum(valid_BT, axis=1, dtype=jnp.int32),
        extra=self._extra(put_extra, extra, extra_update),
        kx=self.kx if kx_BTKE is None else put_kv(self.kx, kx_BTKE), fresh=False)

  def _extra(self, put, extra, update):
    if extra is not None:
      return jax.tree.map(put, self.extra, extra)
    return self.extra if update is None else jax.tree.map(update, self.extra)


def _put_one(buf: jax.Array, new: jax.Array, slot, axis: int) -> jax.Array:
  """`buf` (batch 1) with `new` (one token: size 1 along `axis`, the slot axis) at `slot`, or
  unchanged when slot is out of range (padding, a full `Linear` cache): the slice at the
  clamped slot is read, selected and written back at the same index, which XLA does in place
  in one kernel (the scatter's drop semantics, without a scatter)."""
  S = buf.shape[axis]
  idx = [jnp.zeros((), jnp.int32)] * buf.ndim
  idx[axis] = jnp.minimum(slot, S - 1).astype(jnp.int32)
  old = jax.lax.dynamic_slice(buf, idx, new.shape)
  return jax.lax.dynamic_update_slice(buf, jnp.where(slot < S, new.astype(buf.dtype), old), idx)


def as_fresh(state: Any, fresh: bool = True) -> Any:
  """`state` with every KVCache in it marked (un)known-empty (`KVCache.fresh`). Only for a
  state made by `init_state` and not yet written (decode.prefill's first call)."""
  mark = lambda x: x.replace(fresh=fresh) if isinstance(x, KVCache) else x
  return jax.tree.map(mark, state, is_leaf=lambda x: isinstance(x, KVCache))


def init_cache(policy: CachePolicy, batch: int, capacity: int, n_kv: int, dk: int, dv: int, dtype,
               extra=None, kx_dim: int = 0) -> KVCache:
  """An empty cache of `policy.slots(capacity)` slots; `extra`: a pytree of
  `jax.ShapeDtypeStruct` (per-key shape and dtype) for the mixer's own per-key data; `kx_dim`:
  extra key channels per kv head (`KVCache.kx`, for `Widening`; 0 = none)."""
  policy.validate()
  S = policy.slots(capacity)
  zeros = lambda s: jnp.zeros((batch, S) + tuple(s.shape), s.dtype)
  return KVCache(k=jnp.zeros((batch, n_kv, S, dk), dtype), v=jnp.zeros((batch, n_kv, S, dv), dtype),
                 pos=jnp.full((batch, S), -1, jnp.int32), ptr=jnp.zeros((batch,), jnp.int32),
                 extra=None if extra is None else jax.tree.map(zeros, extra),
                 base=jnp.zeros((batch,), jnp.int32), policy=policy,
                 kx=jnp.zeros((batch, n_kv, S, kx_dim), dtype) if kx_dim else None)


# ------------------------------------------------------------------ attending to it

class Widening(NamedTuple):
  """Extra q/k channels beyond the rotated q.k (SISA's state term), scored beside it: `q`
  [B, T, H, E] for every query against the cached keys' channels (`KVCache.kx`), `k_scale`
  [B, S, K] an optional per-key factor of their score (so the channels are not rescaled key by
  key), `bias_new` [B, H, T, T] the new keys' share of the score (their channels are not in the
  cache yet)."""
  q: jax.Array
  bias_new: jax.Array | None = None
  k_scale: jax.Array | None = None


def _in_frame(cache: KVCache, ideal_B, theta: float) -> KVCache:
  """A ring's cache with its window keys in the call's frame: the stored one while it lags the
  ideal frame `ideal_B` by at most W, else the ideal one, the cached window keys rotated once
  by the difference (skipped by `lax.cond` when no row moves)."""
  pol, S = cache.policy, cache.pos.shape[1]
  base = jnp.zeros_like(ideal_B) if cache.base is None else cache.base
  new_B = jnp.where(ideal_B - base > pol.window, ideal_B, base)
  window_S = jnp.arange(S) >= pol.sinks
  turn_BS = jnp.where(window_S[None, :], (base - new_B)[:, None], 0)   # -(new - old) per slot
  turn = lambda k: apply_rope(k, *rope_angles(turn_BS, k.shape[-1], theta), head_axis=1)
  k = jax.lax.cond(jnp.any(new_B != base), turn, lambda k: k, cache.k)
  return cache.replace(k=k, base=new_B)


def _stored_keys(cache: KVCache, k_BTKD, k_frame_BTKD, positions_BT, theta: float):
  """New keys as the cache keeps them: in the call's frame (`k_frame`), except those bound for
  a ring's sink slots, rotated by their stream position."""
  pol = cache.policy
  if not (pol.bounded and pol.sinks):
    return k_frame_BTKD
  n_BT = cache.ptr[:, None] + jnp.cumsum(positions_BT >= 0, axis=1, dtype=jnp.int32) - 1
  sink_BT = (positions_BT >= 0) & (n_BT < pol.sinks)
  return jnp.where(sink_BT[..., None, None], rope(k_BTKD, positions_BT, theta), k_frame_BTKD)


def _cache_scores(cache: KVCache, q_BTHD, q_sink_BTHD, widen: Widening | None, f):
  """Unscaled scores of the T queries against the S cached keys, [B, K, G*T, S] (`to_rows`
  layout): q.k in the cache's frame, the n sink slots with their own query if one is given
  (rotated by m), plus the widening channels' score."""
  K, n = cache.k.shape[1], cache.policy.sinks
  kbuf = cache.k.astype(q_BTHD.dtype)
  dot = lambda q, k: jnp.einsum("bkmd,bksd->bkms", to_rows(q, K), k, preferred_element_type=f)
  s = dot(q_BTHD, kbuf)
  if n and q_sink_BTHD is not None:   # the sink slots: exact scores, query at m (module doc)
    s = jnp.concatenate([dot(q_sink_BTHD, kbuf[:, :, :n]), s[..., n:]], axis=-1)
  if widen is not None:
    if cache.kx is None:
      raise ValueError("a widened call needs extra key channels in the cache (init_cache's "
                       "kx_dim)")
    w = jnp.einsum("bkme,bkse->bkms", to_rows(widen.q.astype(q_BTHD.dtype), K),
                   cache.kx.astype(q_BTHD.dtype), preferred_element_type=f)
    if widen.k_scale is not None:
      w = w * widen.k_scale.astype(f).transpose(0, 2, 1)[:, :, None, :]
    s = s + w
  return s


def attend_cache(cache: KVCache, q_BTHD, k_BTKD, v_BTKV, positions_BT, *, scale: float,
                 q_sink_BTHD=None, widen: Widening | None = None, bias=None, sink_logit_H=None,
                 window: int | None = None):
  """New tokens (q, k as the cache keeps them: after any rotation) attend to [cache ; themselves]
  under the cache's policy, nothing written: -> out [B, T, H, Dv].

  The cached keys and the new ones are scored apart (no [cache ; new] buffer is formed; the
  head-major cache is read where it lies) and share one fp32 softmax over their S + T columns
  (`dense.rows_softmax`), the same arithmetic on every platform: decoding reads the cache once
  per token, a bandwidth-bound product rather than a fused kernel's. `q_sink_BTHD`: the query
  the sink slots are scored with (default q); `bias` [B|1, H|1, T|1, S + T]: added to the scores
  of [cache ; new]; sink slots are visible to every query of the call (module docstring);
  `window`: a mixer's own sliding window, with the policy's.

  A chunk of several tokens into a cache with no valid slot (a prompt's first chunk) scores
  only its own T keys: every cached column would be masked, so dropping them changes no
  probability and saves the [T, S] products (a prefill into a cache of 8K slots would
  otherwise score 8K empty keys per query). A `lax.cond` on the cache's `pos` picks the path
  at run time, so the state's structure does not change; a cache known empty at trace time
  (`KVCache.fresh`) compiles the new-tokens path alone."""
  spans = [w for w in (cache.policy.window, window) if w is not None]
  span = min(spans) if spans else None
  run = lambda cached: lambda: _attend(cache, q_BTHD, k_BTKD, v_BTKV, positions_BT, scale,
                                       q_sink_BTHD, widen, bias, sink_logit_H, span, cached)
  if cache.fresh:
    return run(False)()
  if q_BTHD.shape[1] == 1:
    return run(True)()
  return jax.lax.cond(jnp.all(cache.pos < 0), run(False), run(True))


def _attend(cache, q_BTHD, k_BTKD, v_BTKV, positions_BT, scale, q_sink_BTHD, widen, bias,
            sink_logit_H, span, cached: bool):
  """`attend_cache` over the S cached columns and the T new ones, or (`cached` False: the
  cache holds no valid slot) over the T new ones alone, the cached columns of `bias` dropped."""
  pol, S, n = cache.policy, cache.pos.shape[1], cache.policy.sinks
  T, K = q_BTHD.shape[1], cache.k.shape[1]
  f = jnp.promote_types(q_BTHD.dtype, jnp.float32)
  s = jnp.einsum("bkmd,btkd->bkmt", to_rows(q_BTHD, K), k_BTKD.astype(q_BTHD.dtype),
                 preferred_element_type=f)
  kv_pos = positions_BT.astype(jnp.int32)
  if not cached and bias is not None:
    bias = jnp.asarray(bias)[..., S:]
  if widen is not None and widen.bias_new is not None:
    new = widen.bias_new.astype(f)
    if cached:
      new = jnp.pad(new, ((0, 0), (0, 0), (0, 0), (S, 0)))
    bias = new if bias is None else bias + new
  if cached:
    s = jnp.concatenate([_cache_scores(cache, q_BTHD, q_sink_BTHD, widen, f), s], axis=-1)
    kv_pos = jnp.concatenate([_mask_positions(cache, positions_BT), kv_pos], axis=1)
  mask = positional_mask(positions_BT, kv_pos, True, span)
  p = rows_softmax(s * scale, mask=mask, bias=bias, sink_logit_H=sink_logit_H, T=T)
  vd = v_BTKV.dtype
  o = jnp.einsum("bkmt,btke->bkme", p[..., -T:].astype(vd), v_BTKV, preferred_element_type=f)
  if cached:
    o = jnp.einsum("bkms,bkse->bkme", p[..., :S].astype(vd), cache.v.astype(vd),
                   preferred_element_type=f) + o
  return from_rows(o, T).astype(q_BTHD.dtype)


def _mask_positions(cache: KVCache, positions_BT) -> jax.Array:
  """[B, S]: the positions the mask reads for the cached slots (a ring's sink slots get the
  call's first query position: visible to every query, module docstring)."""
  n, S = cache.policy.sinks, cache.pos.shape[1]
  if not n:
    return cache.pos
  _, _, first = cache.policy.frame(positions_BT)
  return jnp.where((jnp.arange(S) < n)[None, :] & (cache.pos >= 0), first[:, None], cache.pos)


def attend_written(cache: KVCache, q_BTHD, positions_BT, *, scale: float, q_sink_BTHD=None,
                   bias=None, sink_logit_H=None, window: int | None = None):
  """One new token per row (T == 1) against a cache that already holds it: -> out [B, 1, H,
  Dv]. For a Linear cache, [cache ; itself] is the cache after the token's write, so the step
  writes first and scores the S cached columns alone: one score product, one softmax and one
  value product, no [cache ; new] columns to join (`attend_cache`'s arguments otherwise;
  `bias` [B|1, H|1, 1, S] on the cached columns)."""
  if q_BTHD.shape[1] != 1:
    raise ValueError(f"attend_written takes one token per row, got {q_BTHD.shape[1]}")
  spans = [w for w in (cache.policy.window, window) if w is not None]
  f = jnp.promote_types(q_BTHD.dtype, jnp.float32)
  s = _cache_scores(cache, q_BTHD, q_sink_BTHD, None, f)
  mask = positional_mask(positions_BT, _mask_positions(cache, positions_BT), True,
                         min(spans) if spans else None)
  p = rows_softmax(s * scale, mask=mask, bias=bias, sink_logit_H=sink_logit_H, T=1)
  vd = cache.v.dtype
  o = jnp.einsum("bkms,bkse->bkme", p.astype(vd), cache.v, preferred_element_type=f)
  return from_rows(o, 1).astype(q_BTHD.dtype)


def writes_first(cache: KVCache, q_BTHD) -> bool:
  """Whether a call takes `attend_written` after its write: one token per row into a Linear
  cache not known empty. Not for the rings: writing into the keys their frame move (a
  `lax.cond`) returns makes XLA copy them every step, and a ring's write evicts a key."""
  return q_BTHD.shape[1] == 1 and not cache.fresh and not cache.policy.bounded


def cached_attention(cache: KVCache, q_BTHD, k_BTKD, v_BTKV, positions_BT, *, theta: float,
                     scale: float, sink_logit_H=None, widen: Widening | None = None,
                     extra_new=None, kx_new=None, window: int | None = None, fresh_out=None,
                     impl: str = "auto", qkv_rows=None):
  """New tokens (q, k before RoPE) attend to [cache ; themselves] under the cache's policy
  (`attend_cache`, RoPE as the module docstring says), and are written. -> (out [B, T, H, Dv],
  new cache). `window`: a mixer's own sliding window (a mask on stream positions, with the
  policy's); `extra_new` / `kx_new`: the new tokens' per-key data and extra key channels
  ([B, T, K, E]); `fresh_out(q, k)`: the output of the new tokens alone from their rotated
  q, k (the mixer's full forward), used instead of `attend_cache` for a fresh `Linear` cache
  (`KVCache.fresh`: nothing cached, stream positions). Without one, a fresh `Linear` call with
  no widening (a prompt's first chunk, of any length) is the new tokens' causal attention to
  themselves by their positions: it goes to the kernels room (`entry.attend` with core `impl`,
  as the full forward: flash / splash / cuDNN / the blocked core, O(T) memory) rather than
  `attend_cache`'s dense [T, T] scores; the visible keys, the scores and the sink column are
  the same (`_fresh_attention`). The cache is read before the new tokens are written (a
  ring's writes may evict keys the chunk's earlier queries see); compiled with
  `kernel_choice.stateful_compiler_options`, the write then happens in place. One token per
  row into a Linear cache on a GPU runs as one kernel (`kernels/decode_attend.py`);
  `qkv_rows`: the [B, T, K, G + 2, Dh] buffer q, k, v are slices of, when there is one
  (`QKVProjection.qkv_and_rows`), which the kernel then reads as it is."""
  pol = cache.policy
  if (widen is None and extra_new is None and kx_new is None and window is None
      and sink_logit_H is None and _takes_kernel(cache, q_BTHD, v_BTKV)):
    return _kernel_step(cache, q_BTHD, k_BTKD, v_BTKV, positions_BT, theta, scale, qkv_rows)
  base, m, _ = pol.frame(positions_BT)
  if pol.bounded:
    cache = _in_frame(cache, base, theta)
    base = cache.base
  rel = positions_BT - base[:, None]
  q, k_new = rope(q_BTHD, rel, theta), rope(k_BTKD, rel, theta)
  q_sink = rope(q_BTHD, m, theta) if pol.sinks else None
  if widen is None and writes_first(cache, q_BTHD):   # (past its capacity, which
    # `stream_limit` refuses, a Linear cache drops the write and the token would not see itself)
    written = cache.write(_stored_keys(cache, k_BTKD, k_new, positions_BT, theta), v_BTKV,
                          positions_BT, extra_new, kx_new)
    return attend_written(written, q, positions_BT, scale=scale, q_sink_BTHD=q_sink,
                          sink_logit_H=sink_logit_H, window=window), written
  if fresh_out is not None and cache.fresh and not pol.bounded and window is None:
    out = fresh_out(q, k_new)
  elif widen is None and cache.fresh and not pol.bounded:
    out = _fresh_attention(q, k_new, v_BTKV, positions_BT, scale=scale,
                           sink_logit_H=sink_logit_H, window=window, impl=impl)
  else:
    out = attend_cache(cache, q, k_new, v_BTKV, positions_BT, scale=scale,
                       q_sink_BTHD=q_sink, widen=widen, sink_logit_H=sink_logit_H, window=window)
  written = cache.write(_stored_keys(cache, k_BTKD, k_new, positions_BT, theta), v_BTKV,
                        positions_BT, extra_new, kx_new)
  return out, written


def _fresh_attention(q_BTHD, k_BTKD, v_BTKV, positions_BT, *, scale, sink_logit_H, window,
                     impl):
  """The new tokens of a call into an empty `Linear` cache attending to themselves (what
  `attend_cache` computes when no slot is valid): key j visible to query i iff 0 <= p_j <= p_i
  (and p_i - p_j < window), the sink column, on the kernels room's core. Prompts are one stream
  per row (positions increase, padding -1), so `prefix_causal` holds."""
  return entry.attend(q_BTHD, k_BTKD, v_BTKV, scale=scale, causal=True,
                      q_positions=positions_BT, kv_positions=positions_BT,
                      sink_logit_H=sink_logit_H, window=window, impl=impl, prefix_causal=True)


def _takes_kernel(cache: KVCache, q_BTHD, v_BTKV) -> bool:
  """Whether a call's attention and write run as one kernel (`kernels/decode_attend.py`): one
  token per row into a Linear cache not known empty, on a platform and shapes it takes."""
  if q_BTHD.shape[1] != 1 or cache.fresh or cache.policy.bounded:
    return False
  return kernel_choice.decode_kernel(
      lambda plat: decode_attend.unsupported(q_BTHD.shape[2], cache.k, cache.v, plat),
      what="one-token KV-cache step")


def _kernel_step(cache: KVCache, q_BTHD, k_BTKD, v_BTKV, positions_BT, theta: float,
                 scale: float, qkv_rows=None):
  """`cached_attention` of one token per row into a Linear cache as one kernel: the token's
  RoPE at its stream position, its write into slot `ptr` (in place; none for padding or a full
  cache, as `KVCache.write` drops them) and its attention to [cache ; itself]. q / k / v go in
  as one [B, K, G + 2, D] array, the layout of the decoding copy's fused projection: its
  output `qkv_rows` when given (read as it is), else joined here (a copy)."""
  B, _, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  if qkv_rows is not None:
    qkv = qkv_rows[:, 0]
  else:
    qkv = jnp.concatenate([q_BTHD[:, 0].reshape(B, K, H // K, D), k_BTKD[:, 0, :, None],
                           v_BTKV[:, 0, :, None].astype(q_BTHD.dtype)], axis=2)
  cos, sin = rope_angles(positions_BT, D, theta)
  p_B = positions_BT[:, 0]
  ptr = cache.ptr + (p_B >= 0).astype(jnp.int32)
  o_BHD, k, v, pos = decode_attend.decode_attend(
      qkv, cos[:, 0], sin[:, 0], cache.k, cache.v, cache.pos, ptr, p_B, scale=scale)
  return o_BHD[:, None], cache.replace(k=k, v=v, pos=pos, ptr=ptr, fresh=False)


# ------------------------------------------------------------------ mixers with a KV cache

class CachedMixer(Mixer):
  """Class-level decoding hooks of a mixer whose state is a `KVCache` (attention, SISA, sliding
  window): the capacity limits follow from the policy it runs under (`cache_policy`: the one
  asked for, unless `follows_policy` is False and the mixer's function fixes it)."""
  follows_policy = True

  @classmethod
  def cache_policy(cls, cfg, opts, policy: CachePolicy | None) -> CachePolicy:
    return LINEAR if policy is None else policy

  @classmethod
  def init_state(cls, cfg, opts, batch: int, capacity: int, dtype,
                 policy: CachePolicy | None = None):
    """A plain KV cache (q/k/v heads of `cfg`) under `cache_policy`."""
    return init_cache(cls.cache_policy(cfg, opts, policy), batch, capacity, cfg.kv_heads,
                      cfg.head_dim, cfg.head_dim, dtype)

  @classmethod
  def max_chunk(cls, cfg, opts, capacity: int, policy: CachePolicy | None = None) -> int | None:
    return cls.cache_policy(cfg, opts, policy).max_chunk

  @classmethod
  def stream_limit(cls, cfg, opts, capacity: int, policy: CachePolicy | None = None) -> int | None:
    return cls.cache_policy(cfg, opts, policy).stream_limit(capacity)
