"""Streaming benchmark (docs/papers.md §3.2), one run, on a tiny randomly initialised model
(timings do not depend on the weights):

1. per-token decoding time of StreamingLLM (4 sinks + L-4 recent tokens, one cached step)
   vs sliding window with re-computation (a fresh forward over the last L tokens per token),
   at cache sizes L = 1024 and 4096, for attention and SISA (the paper: up to 22.2x on
   Llama-2-7B at L = 4096); the two are timed alternately `--repeats` times and the medians
   are reported (speedup = median recompute / median streaming). Both are timed as a decoder
   runs them: one compiled call per token on inputs made beforehand, the parameters passed as
   a flat list of arrays; the streaming step takes the per-layer parameters made once
   (`Decoder.layer_params`), donates its state and is compiled with
   `kernel_choice.stateful_compiler_options` (the cache is updated in place);
2. constant memory: the streaming cache's bytes after 10K and after `--long` tokens (default
   1M) fed in chunks, the per-token time over the stream (median of the chunks of the first
   tenth after the cache is full vs median of the last tenth), the same chunks against a
   control timed right after each of them (a fresh cache just filled, restored from a copy:
   the ratio stream / control at the same moment cancels the machine's drift over the run)
   and the number of traces of the chunk step (`chex.assert_max_traces(n=1)`).

Entry point: experiments/bench_stream.py (prints a table and writes JSON).
"""

from __future__ import annotations

import json
import os
import time

from attn_jax import decode, streaming
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig


def tiny_cfg(mixer, max_len):
  cfg = ModelConfig(vocab_size=257, vocab_multiple=1, d_model=64, n_layers=2, n_heads=4,
                    d_ff=192, max_seq_len=max_len, dtype="float32", mixer=mixer)
  return cfg.with_options("sisa", d_state=16) if mixer == "sisa" else cfg


def _time(fn, reps):
  import jax
  jax.block_until_ready(fn())        # compile + warm
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / reps


def per_token(mixer, L, reps, repeats=1):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  model = build_model(tiny_cfg(mixer, L), seed=0)
  pol = streaming.StreamPolicy("streaming", window=L - 4, sinks=4)
  # Both sides take the parameters as a flat list of arrays (nnx.split and flatten once: no
  # per-call NNX pytree traversal) and inputs made before the timed loop; the streaming step
  # also takes the per-layer parameters made once (`Decoder.layer_params`), as a decoder does.
  gd, params = nnx.split(model)
  leaves, tree = jax.tree.flatten(params)
  per_layer, layer_tree = jax.tree.flatten(model.layer_params())
  model_of = lambda lv: nnx.merge(gd, jax.tree.unflatten(tree, lv))

  def step_fn(lv, pl, t, pos, s):
    return model_of(lv).step(t, positions_BT=pos, state=s,
                             layer_params=jax.tree.unflatten(layer_tree, pl))
  step = decode.jit_stateful(step_fn, donate_argnums=(4,))
  state = model.init_state(1, 1, pol.cache)
  tok = np.random.default_rng(0).integers(0, 256, (1, 2 * L)).astype(np.int32)
  W = L - 4
  for a in range(0, L + W, W):      # fill the cache past its size: evicting from now on
    n = min(W, L + W - a)
    _, state = step(leaves, per_layer, tok[:, a:a + n], np.arange(a, a + n, dtype=np.int32)[None],
                    state)
  t0 = L + W
  n_tok = repeats * (reps + 1)      # every timed token and each measurement's warm-up
  feed = [(jnp.asarray(tok[:, (t0 + i) % (2 * L)][:, None]), jnp.full((1, 1), t0 + i, jnp.int32))
          for i in range(n_tok)]
  holder = {"state": state, "i": 0}

  def one():
    t, pos = feed[holder["i"]]
    lg, holder["state"] = step(leaves, per_layer, t, pos, holder["state"])
    holder["i"] += 1
    return lg
  fwd = jax.jit(lambda lv, x: model_of(lv)(x)[:, -1])
  window = jnp.asarray(tok[:, :L])
  rec = lambda: fwd(leaves, window)
  t_stream, t_rec = [], []
  for _ in range(repeats):   # alternated, so both see the same machine
    t_stream.append(_time(one, reps))
    t_rec.append(_time(rec, max(3, reps // 4)))
  t_stream, t_rec = float(np.median(t_stream)), float(np.median(t_rec))
  return {"mixer": mixer, "cache": L, "streaming_ms": 1e3 * t_stream,
          "recompute_ms": 1e3 * t_rec, "speedup": t_rec / t_stream, "repeats": repeats}


def memory(mixer, n_tokens, chunk):
  import jax
  import jax.numpy as jnp
  import numpy as np
  model = build_model(tiny_cfg(mixer, 1024), seed=0)
  policy = streaming.StreamPolicy("streaming", window=1020, sinks=4)
  sc = streaming.CachedScorer(model, policy, chunk=chunk, trace_limit=1)
  rng = np.random.default_rng(0)
  tok = rng.integers(0, 256, 2 * chunk + 1).astype(np.int32)
  # The control: a second scorer holding a cache just filled (the first full-cache chunk),
  # timed on one chunk right after each stream chunk of the first and the last tenth, from a
  # copy of that state. Stream / control at the same moment cancels the machine's drift over
  # the run, which the first-vs-last-tenth figure does not.
  full = -(-(policy.sinks + policy.window) // sc.chunk) + 1   # first chunk after full
  n_chunks = -(-n_tokens // sc.chunk)
  k = max(1, (n_chunks - full) // 10)
  ctrl = streaming.CachedScorer(model, policy, chunk=chunk)
  for _ in range(full):
    ctrl.score(tok[:sc.chunk], tok[1:sc.chunk + 1])
  snap, snap_pos = jax.tree.map(jnp.copy, ctrl.state), ctrl.position
  times, ctrl_times, bytes_at = [], {}, {}
  for i, a in enumerate(range(0, n_tokens, sc.chunk)):
    n = min(sc.chunk, n_tokens - a)
    t0 = time.perf_counter()
    sc.score(tok[:n], tok[1:n + 1])
    times.append((time.perf_counter() - t0) / n)
    if full <= i < full + k or n_chunks - k <= i:
      ctrl.state, ctrl.position = jax.tree.map(jnp.copy, snap), snap_pos
      t0 = time.perf_counter()
      ctrl.score(tok[:n], tok[1:n + 1])
      ctrl_times[i] = (time.perf_counter() - t0) / n
    if sc.position >= 10_000 and "10K" not in bytes_at:
      bytes_at["10K"] = sc.cache_bytes
  bytes_at[f"{n_tokens}"] = sc.cache_bytes
  first, last = np.median(times[full:full + k]), np.median(times[-k:])
  ratio = lambda idx: float(np.median([times[i] / ctrl_times[i] for i in idx]))
  first_c, last_c = ratio(range(full, full + k)), ratio(range(n_chunks - k, n_chunks))
  return {"mixer": mixer, "tokens": n_tokens, "cache_bytes": bytes_at,
          "us_per_token_first_tenth": 1e6 * float(first),
          "us_per_token_last_tenth": 1e6 * float(last), "last_over_first": float(last / first),
          "first_tenth_over_control": first_c, "last_tenth_over_control": last_c,
          "traces_max": 1}


def run(mixers, caches, *, reps: int, repeats: int, long: int, chunk: int, out: str) -> dict:
  """The per-token table for every mixer and cache size, then (`long` > 0) the long-stream
  check per mixer; prints the rows, writes `out` (JSON); returns the result."""
  import jax
  res = {"device": str(jax.devices()[0]), "per_token": [], "memory": []}
  for mixer in mixers:
    for L in map(int, caches):
      r = per_token(mixer, L, reps, repeats)
      res["per_token"].append(r)
      print(f"{mixer:<10} cache {L:>5}: streaming {r['streaming_ms']:8.2f} ms/token, "
            f"recompute {r['recompute_ms']:9.2f} ms/token, speedup {r['speedup']:7.1f}x",
            flush=True)
  if long:
    for mixer in mixers:
      r = memory(mixer, long, chunk)
      res["memory"].append(r)
      print(f"{mixer:<10} {r['tokens']} tokens: cache bytes {r['cache_bytes']}, "
            f"us/token first tenth {r['us_per_token_first_tenth']:.1f}, last tenth "
            f"{r['us_per_token_last_tenth']:.1f} ({r['last_over_first']:.2f}x; medians; one "
            f"trace); against a fresh full cache timed beside each chunk: first tenth "
            f"{r['first_tenth_over_control']:.2f}x, last tenth "
            f"{r['last_tenth_over_control']:.2f}x", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"wrote {out}")
  return res
