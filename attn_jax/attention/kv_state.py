"""The decoding state of attention-like mixers: a fixed-size KV buffer that knows its positions.

    state = {"k": [B, S, K, Dk], "v": [B, S, K, Dv], "pos": [B, S] int32 (-1 = empty slot),
             "ptr": [B] int32 (tokens written so far, per row), ...extra per-slot arrays}

Slots are not positions: each slot records the position of the token it holds, so masks come
from positions (`core.positional_mask`) and the caller never computes a slot. Policies:

- linear: token n of a row goes to slot n (a dense cache; capacity = the longest stream);
- ring:   slot n mod S (a sliding window of the last S tokens; constant memory for any stream);
- sinks + ring (`sinks=n`, StreamingLLM): tokens 0..n-1 stay in slots 0..n-1 forever, token
  n' >= n goes to slot n + (n' - n) mod (S - n): the first n tokens plus the last S - n.

New tokens attend to the buffer *and* to themselves (`with_new`: keys [old S ; new T]) before
they are written, so a ring buffer can take a chunk of up to S tokens at once without the
chunk overwriting keys its own queries still need. Rows advance independently (prompts of
different lengths); padding tokens (position -1) are never written and never advance a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_kv_state(batch: int, capacity: int, n_kv: int, dk: int, dv: int, dtype,
                  **extra: tuple[tuple[int, ...], jnp.dtype]) -> dict:
  """An empty buffer; `extra` adds per-slot arrays: name=(per-slot shape, dtype)."""
  state = {"k": jnp.zeros((batch, capacity, n_kv, dk), dtype),
           "v": jnp.zeros((batch, capacity, n_kv, dv), dtype),
           "pos": jnp.full((batch, capacity), -1, jnp.int32),
           "ptr": jnp.zeros((batch,), jnp.int32)}
  for name, (shape, dt) in extra.items():
    state[name] = jnp.zeros((batch, capacity) + tuple(shape), dt)
  return state


def with_new(state: dict, new_BT: dict, positions_BT: jax.Array) -> dict:
  """Per-slot arrays of the buffer followed by the T new tokens' (keys [S + T])."""
  out = {name: jnp.concatenate([state[name], arr.astype(state[name].dtype)], axis=1)
         for name, arr in new_BT.items()}
  out["pos"] = jnp.concatenate([state["pos"], positions_BT.astype(jnp.int32)], axis=1)
  return out


def write(state: dict, new_BT: dict, positions_BT: jax.Array, *, ring: bool,
          sinks: int = 0) -> dict:
  """Write the valid new tokens (position >= 0) after each row's pointer, in order: the i-th
  valid token of a row is token n = ptr + i of its stream (padding may sit anywhere).

  ring=False: slot = n (writes past the capacity are dropped: the caller sizes the buffer);
  ring=True: slot = n mod S (needs T <= S, so no two new tokens share a slot); with `sinks`,
  slot = n for n < sinks, else sinks + (n - sinks) mod (S - sinks) (needs T <= S - sinks).
  """
  B, T = positions_BT.shape
  S = state["pos"].shape[1]
  valid_BT = positions_BT >= 0
  slot_BT = state["ptr"][:, None] + jnp.cumsum(valid_BT, axis=1, dtype=jnp.int32) - 1
  if ring:
    if not 0 <= sinks < S:
      raise ValueError(f"sinks={sinks} must leave ring slots in a buffer of {S}")
    ring_slot = sinks + (slot_BT - sinks) % (S - sinks)
    slot_BT = jnp.where(slot_BT < sinks, slot_BT, ring_slot)
  slot_BT = jnp.where(valid_BT, slot_BT, S)          # out of range: dropped
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  out = dict(state)
  for name, arr in dict(new_BT, pos=positions_BT).items():
    out[name] = state[name].at[rows_BT, slot_BT].set(arr.astype(state[name].dtype), mode="drop")
  out["ptr"] = state["ptr"] + jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
  return out
