"""Autoregressive decoding over mixer-owned states: prefill, one decode step, and `generate`.

Every mixer creates and updates its own decoding state (a KV buffer, a ring buffer, an SSM's
recurrent state, ...), including the positions it needs; this module only passes states and
per-row positions along:

    state = model.init_state(batch, capacity, policy)
    logits_BTV, state = model.step(tokens_BT, positions_BT=positions, state=state)

so it never computes a cache slot and never branches on a mixer's name. `policy` (default
linear) is the KV-cache policy of the attention-style mixers (`attention/cache.py`: Linear,
Ring(W), SinksRing(n, W)), chosen here at decode time for any model.

- Prompts of different lengths share a batch: right-padded to T, with per-row `lengths`; padding
  carries position -1, which every mixer ignores. Row b's new tokens follow its own prompt.
- A prompt longer than what one stateful call can take (`max_chunk` of a bounded state, e.g. a
  sliding window's ring) is prefilled in chunks of that size, after a first call of up to
  `max_fresh_chunk` tokens into the fresh states (any length for a mixer that runs its full
  forward there, e.g. Sinkhorn's: then no loop at all).
- Mixers whose state is bounded (`stream_limit` None: ring buffers, SSMs) generate past
  `cache_len` in constant memory; for the others `cache_len` must hold the whole stream.

`generate` runs prefill and the decode loop inside one `jax.jit` (`nnx.split` once; graphdef
static; `nnx.merge` inside; compiled with `kernel_choice.stateful_compiler_options`, so states
update in place; weight matrices cast to the compute dtype, and the projections that read one
input fused into one matrix, once (`model.for_decoding()`), and
`model.layer_params()` sliced once, both before the loop) with a `jax.lax.while_loop` over
steps, so `decode_step` is traced once per generation shape, never once per token (tests guard
it with `chex.assert_max_traces`).
Sampling: greedy (`temperature == 0`) is argmax; otherwise logits / temperature, optionally
restricted to the `top_k` largest, sampled with `jax.random.categorical`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax import kernel_choice
from attn_jax.attention import cache as cache_lib
from attn_jax.model import mixer_limits
from attn_jax.model_config import check_seq_len


def jit_stateful(fn, **kw):
  """`jax.jit` with `kernel_choice.stateful_compiler_options` (for steps that carry a decoding
  state)."""
  return jax.jit(fn, compiler_options=kernel_choice.stateful_compiler_options(), **kw)


def prompt_positions(lengths_B: jax.Array, start: int, length: int) -> jax.Array:
  """Positions [B, length] of prompt tokens start..start+length-1; -1 past each row's length."""
  pos = start + jnp.arange(length, dtype=jnp.int32)[None, :]
  return jnp.where(pos < lengths_B[:, None], pos, -1)


def prefill(model, prompt_BT: jax.Array, lengths_B: jax.Array | None = None, *,
            capacity: int, policy=None, layer_params=None) -> tuple[jax.Array, Any]:
  """Run right-padded prompts through fresh states of `capacity`, in chunks of at most the
  mixers' `max_chunk`. -> (logits of each row's last prompt token [B, V] fp32, state).
  `layer_params`: `model.layer_params()`, made once for the calls (`Decoder.layer_params`)."""
  B, T = prompt_BT.shape
  lengths_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else lengths_B.astype(jnp.int32)
  chunk, stream = mixer_limits(model.cfg, capacity, policy)
  first, _ = mixer_limits(model.cfg, capacity, policy, fresh=True)
  if stream is not None and T > stream:
    raise ValueError(f"prompt length {T} exceeds what the decoding state holds ({stream} "
                     "tokens; raise cache_len)")
  chunk = T if chunk is None else min(chunk, T)
  first = T if first is None else min(first, T)

  def run(carry, a, toks_BN):
    """One stateful call on prompt tokens a..a+N-1 (a may be traced)."""
    state, last_BD = carry
    n = toks_BN.shape[1]
    h_BTD, state = model.step_hidden(toks_BN, positions_BT=prompt_positions(lengths_B, a, n),
                                     state=state, layer_params=layer_params)
    idx_B = lengths_B - 1 - a
    here_B = (idx_B >= 0) & (idx_B < n)
    h_BD = jnp.take_along_axis(h_BTD, jnp.clip(idx_B, 0, n - 1)[:, None, None], axis=1)[:, 0]
    return state, (h_BD if last_BD is None else jnp.where(here_B[:, None], h_BD, last_BD))

  # The first call, into states known empty (`KVCache.fresh`: a mixer may take its full
  # forward or its kernel), up to `first` tokens; the state then unmarked so every later call
  # has the same structure; then the other whole chunks in one `lax.scan` (traced once, so
  # compile time does not grow with the prompt: a ring of window 2 takes T / 2 calls), then
  # the rest.
  fresh = cache_lib.as_fresh(model.init_state(B, capacity, policy))
  state, last_BD = run((fresh, None), 0, prompt_BT[:, :first])
  carry = (cache_lib.as_fresh(state, False), last_BD)
  n_full = (T - first) // chunk
  end = first + n_full * chunk
  if n_full:
    chunks = prompt_BT[:, first:end].reshape(B, n_full, chunk).swapaxes(0, 1)
    starts = first + chunk * jnp.arange(n_full, dtype=jnp.int32)
    carry, _ = jax.lax.scan(lambda c, xs: (run(c, *xs), None), carry, (starts, chunks))
  if end < T:
    carry = run(carry, end, prompt_BT[:, end:])
  state, last_BD = carry
  return model.unembed(last_BD), state


def decode_step(model, token_B: jax.Array, positions_B: jax.Array, state: Any,
                layer_params=None) -> tuple[jax.Array, Any]:
  """Feed one token per row at its position: -> (logits [B, V] fp32, new state).
  `layer_params`: `model.layer_params()`, made once before a decoding loop."""
  logits_B1V, state = model.step(token_B[:, None], positions_BT=positions_B[:, None], state=state,
                                 layer_params=layer_params)
  return logits_B1V[:, 0], state


def sample_logits(logits_BV: jax.Array, rng: jax.Array | None, *, temperature=0.0,
                  top_k: int = 0) -> jax.Array:
  """Next tokens [B] int32: argmax if `temperature == 0`, else top-k / temperature sampling.

  `temperature` must be a Python number when it is 0 (greedy is chosen at trace time); a traced
  temperature always samples. `top_k` <= 0 keeps the whole vocabulary.
  """
  if isinstance(temperature, (int, float)) and temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  if rng is None:
    raise ValueError("sampling with temperature > 0 needs an `rng` key")
  logits = logits_BV.astype(jnp.float32) / temperature
  if 0 < top_k < logits.shape[-1]:
    kth_B1 = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_B1, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


_GENERATE_STATIC = ("graphdef", "max_new_tokens", "cache_len", "greedy", "top_k", "policy")


@functools.cache
def _generate_jitted(options: tuple):
  """`_generate_jit` compiled with these XLA options (`kernel_choice.stateful_compiler_options`
  at the top level, none inside another jit, whose options hold)."""
  return jax.jit(_generate_jit, static_argnames=_GENERATE_STATIC,
                 compiler_options=dict(options) or None)


def _generate_jit(graphdef, state, prompt_BT, lengths_B, rng, temperature, eos_id, pad_id, *,
                  max_new_tokens: int, cache_len: int, greedy: bool, top_k: int, policy):
  """eos_id / pad_id: int32 scalars (traced: changing them does not recompile); -1 = no EOS."""
  model = nnx.merge(graphdef, state).for_decoding()   # weights cast once, not every step
  B, T = prompt_BT.shape
  temp = 0.0 if greedy else temperature
  rows_B = jnp.arange(B)

  def sample(logits_BV, step):
    key = None if greedy else jax.random.fold_in(rng, step)
    return sample_logits(logits_BV, key, temperature=temp, top_k=top_k)

  def finish(tok_B, done_B):
    """Sequences already done emit `pad_id`; EOS marks a sequence done (never when eos_id < 0)."""
    tok_B = jnp.where(done_B, pad_id, tok_B)
    return tok_B, done_B | (tok_B == eos_id)

  in_prompt_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
  out_BL = jnp.full((B, T + max_new_tokens), pad_id, jnp.int32)
  out_BL = out_BL.at[:, :T].set(jnp.where(in_prompt_BT, prompt_BT, pad_id))
  layer_params = model.layer_params()   # sliced once, not in every step of the loop
  logits_BV, dstate = prefill(model, prompt_BT, lengths_B, capacity=cache_len, policy=policy,
                              layer_params=layer_params)
  tok_B, done_B = finish(sample(logits_BV, 0), jnp.zeros((B,), bool))
  out_BL = out_BL.at[rows_B, lengths_B].set(tok_B)

  def cond(carry):
    step, _, _, _, done_B = carry
    return (step < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    step, out_BL, dstate, tok_B, done_B = carry
    logits_BV, dstate = decode_step(model, tok_B, lengths_B + step - 1, dstate, layer_params)
    tok_B, done_B = finish(sample(logits_BV, step), done_B)
    out_BL = out_BL.at[rows_B, lengths_B + step].set(tok_B)
    return step + 1, out_BL, dstate, tok_B, done_B

  carry = (jnp.asarray(1, jnp.int32), out_BL, dstate, tok_B, done_B)
  return jax.lax.while_loop(cond, body, carry)[1]


def generate(model, prompt_BT: jax.Array, *, max_new_tokens: int, lengths=None,
             temperature: float = 0.0, top_k: int = 0, rng: jax.Array | None = None,
             eos_id: int | None = None, pad_id: int | None = None,
             cache_len: int | None = None, policy=None) -> jax.Array:
  """Extend each prompt by `max_new_tokens` tokens: -> tokens [B, T + max_new_tokens] int32.

  - lengths: per-row prompt lengths (right padding; default all T). Row b holds its prompt,
    then its new tokens from column lengths[b], then `pad_id`.
  - temperature 0 (default): greedy argmax; > 0: sample from softmax(logits / temperature),
    restricted to the `top_k` most likely tokens when top_k > 0 (needs `rng`; new token i is
    drawn with `fold_in(rng, i)`). Changing temperature, rng, eos_id, pad_id or lengths does
    not recompile; changing greedy/sampling, top_k, shapes or cache_len does.
  - eos_id: once a sequence emits it, the rest of that sequence is `pad_id` (default: eos_id),
    and the loop stops early when every sequence is done. EOS inside the prompt is ignored.
  - cache_len: capacity of the decoding states (default T + max_new_tokens). States that hold
    the whole stream (a linear KV buffer) need >= T + max_new_tokens - 1 (the last token is
    never fed back); bounded states (ring buffers, SSMs) generate any length.
  - policy: the KV-cache policy (`attention/cache.py`; None = linear); a ring (`Ring(W)`,
    `SinksRing(n, W)`) generates any length in constant memory.
  """
  prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
  if prompt_BT.ndim != 2:
    raise ValueError(f"prompt must be [batch, length], got shape {prompt_BT.shape}")
  B, T = prompt_BT.shape
  check_seq_len(model.cfg.max_seq_len, T, "decode.generate: the prompt")
  if T < 1 or max_new_tokens < 1:
    raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1 (got T={T}, "
                     f"max_new_tokens={max_new_tokens})")
  lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  if lengths.shape != (B,):
    raise ValueError(f"lengths must have shape ({B},), got {lengths.shape}")
  if not isinstance(lengths, jax.core.Tracer) and (
      int(jnp.min(lengths)) < 1 or int(jnp.max(lengths)) > T):
    raise ValueError(f"lengths must lie in [1, {T}] (the prompt width), got {lengths.tolist()}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if cache_len is None:
    cache_len = T + max_new_tokens
  _, stream = mixer_limits(model.cfg, int(cache_len), policy)
  if stream is not None and stream < T + max_new_tokens - 1:
    raise ValueError(f"cache_len={cache_len} is too small for prompt length {T} + "
                     f"{max_new_tokens} new tokens (needs >= {T + max_new_tokens - 1})")
  greedy = temperature == 0
  if not greedy and rng is None:
    raise ValueError("sampling with temperature > 0 needs an `rng` key")
  if eos_id is not None and eos_id < 0:
    raise ValueError(f"eos_id must be a token id >= 0, got {eos_id}")
  if pad_id is None:
    pad_id = 0 if eos_id is None else eos_id
  if rng is None:
    rng = jax.random.key(0)  # unused when greedy; keeps the jitted signature fixed
  graphdef, state = nnx.split(model)
  scalar = lambda x: jnp.asarray(x, jnp.int32)
  nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, prompt_BT)))
  options = () if nested else tuple(sorted(kernel_choice.stateful_compiler_options().items()))
  return _generate_jitted(options)(graphdef, state, prompt_BT, lengths, rng,
                       jnp.asarray(temperature, jnp.float32),
                       scalar(-1 if eos_id is None else eos_id), scalar(pad_id),
                       max_new_tokens=int(max_new_tokens), cache_len=int(cache_len),
                       greedy=greedy, top_k=int(top_k), policy=policy)
