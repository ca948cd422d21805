"""Cache-agnostic autoregressive decoding: prefill, one decode step, and `generate`.

Every mixer declares its decoding state through `init_cache` (see registry.py); the decoder
only ever calls

    cache = model.init_cache(batch, max_len)
    logits_BTV, cache = model(tokens_BT, cache=cache, cache_index=index)

so it never branches on a mixer's name. `index` is how many tokens the cache already holds (the
absolute position of the first new token).

`generate` runs the prompt through `prefill` and then `max_new_tokens - 1` decode steps, all
inside one `jax.jit` (`nnx.split` once; graphdef static; `nnx.merge` inside) with a
`jax.lax.while_loop` over steps, so the step is traced once per generation shape, never once per
token. The cache has a fixed size (`cache_len`, default T + max_new_tokens), so every step has
the same shapes. Sampling: greedy (`temperature == 0`) is argmax; otherwise logits / temperature,
optionally restricted to the `top_k` largest, sampled with `jax.random.categorical`.

`TRACE_COUNTS` counts Python traces of the jitted generate function ("generate") and of its
loop body ("step"); tests use it to check that decoding does not retrace as the text grows.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

TRACE_COUNTS: collections.Counter = collections.Counter()


def prefill(model, tokens_BT: jax.Array, max_len: int) -> tuple[jax.Array, Any, jax.Array]:
  """Run the prompt through a fresh fixed-size cache of `max_len` slots.

  Returns (logits of the last prompt token [B, V] fp32, cache, index = T as an int32 scalar).
  """
  B, T = tokens_BT.shape
  if T > max_len:
    raise ValueError(f"prompt length {T} exceeds the cache length max_len={max_len}")
  cache = model.init_cache(B, max_len)
  logits_BTV, cache = model(tokens_BT, cache=cache, cache_index=jnp.asarray(0, jnp.int32))
  return logits_BTV[:, -1], cache, jnp.asarray(T, jnp.int32)


def decode_step(model, token_B: jax.Array, cache: Any, index) -> tuple[jax.Array, Any]:
  """Feed one token per sequence at absolute position `index`: -> (logits [B, V] fp32, cache).

  The caller advances `index` by one after each step.
  """
  logits_B1V, cache = model(token_B[:, None], cache=cache,
                            cache_index=jnp.asarray(index, jnp.int32))
  return logits_B1V[:, 0], cache


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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_len", "greedy",
                                             "top_k"))
def _generate_jit(graphdef, state, prompt_BT, rng, temperature, eos_id, pad_id, *,
                  max_new_tokens: int, cache_len: int, greedy: bool, top_k: int):
  """eos_id / pad_id: int32 scalars (traced: changing them does not recompile); -1 = no EOS."""
  TRACE_COUNTS["generate"] += 1
  model = nnx.merge(graphdef, state)
  B, T = prompt_BT.shape
  temp = 0.0 if greedy else temperature

  def sample(logits_BV, step):
    key = None if greedy else jax.random.fold_in(rng, step)
    return sample_logits(logits_BV, key, temperature=temp, top_k=top_k)

  def finish(tok_B, done_B):
    """Sequences already done emit `pad_id`; EOS marks a sequence done (never when eos_id < 0)."""
    tok_B = jnp.where(done_B, pad_id, tok_B)
    return tok_B, done_B | (tok_B == eos_id)

  out_BL = jnp.full((B, T + max_new_tokens), pad_id, jnp.int32)
  out_BL = jax.lax.dynamic_update_slice(out_BL, prompt_BT.astype(jnp.int32), (0, 0))
  logits_BV, cache, index = prefill(model, prompt_BT, cache_len)
  tok_B, done_B = finish(sample(logits_BV, 0), jnp.zeros((B,), bool))
  out_BL = out_BL.at[:, T].set(tok_B)

  def cond(carry):
    step, _, _, _, done_B = carry
    return (step < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    TRACE_COUNTS["step"] += 1
    step, out_BL, cache, tok_B, done_B = carry
    logits_BV, cache = decode_step(model, tok_B, cache, index + step - 1)
    tok_B, done_B = finish(sample(logits_BV, step), done_B)
    out_BL = jax.lax.dynamic_update_slice(out_BL, tok_B[:, None], (0, T + step))
    return step + 1, out_BL, cache, tok_B, done_B

  carry = (jnp.asarray(1, jnp.int32), out_BL, cache, tok_B, done_B)
  return jax.lax.while_loop(cond, body, carry)[1]


def generate(model, prompt_BT: jax.Array, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, rng: jax.Array | None = None, eos_id: int | None = None,
             pad_id: int | None = None, cache_len: int | None = None) -> jax.Array:
  """Extend each prompt by `max_new_tokens` tokens: -> tokens [B, T + max_new_tokens] int32.

  All prompts share the length T (no padding inside the prompt).
  - temperature 0 (default): greedy argmax; > 0: sample from softmax(logits / temperature),
    restricted to the `top_k` most likely tokens when top_k > 0 (needs `rng`; new token i is
    drawn with `fold_in(rng, i)`). Changing temperature, rng, eos_id or pad_id does not
    recompile; changing greedy/sampling, top_k, shapes or cache_len does.
  - eos_id: once a sequence emits it, the rest of that sequence is `pad_id` (default: eos_id),
    and the loop stops early when every sequence is done. EOS inside the prompt is ignored.
  - cache_len: slots of the fixed-size cache (default T + max_new_tokens; at least
    T + max_new_tokens - 1, since the last token is never fed back).
  """
  prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
  if prompt_BT.ndim != 2:
    raise ValueError(f"prompt must be [batch, length], got shape {prompt_BT.shape}")
  B, T = prompt_BT.shape
  if T < 1 or max_new_tokens < 1:
    raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1 (got T={T}, "
                     f"max_new_tokens={max_new_tokens})")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if cache_len is None:
    cache_len = T + max_new_tokens
  if cache_len < T + max_new_tokens - 1:
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
  return _generate_jit(graphdef, state, prompt_BT, rng, jnp.asarray(temperature, jnp.float32),
                       scalar(-1 if eos_id is None else eos_id), scalar(pad_id),
                       max_new_tokens=int(max_new_tokens), cache_len=int(cache_len),
                       greedy=greedy, top_k=int(top_k))
