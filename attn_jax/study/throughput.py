"""Train-step throughput side by side: the trainer's own jitted step (`build_setup`: forward,
backward, clipped AdamW with each mixer's optimizer treatment) on random tokens of the model's
vocabulary, every config at the same shapes in the same process.

Per (config, sequence length L): batch = max(1, batch_tokens // L) rows (rounded up to a
multiple of the mesh's batch shards), `warmup` untimed steps
(the first compiles), then `steps` timed steps. Reported: the best wall time of a step
(tokens/s = B L / best), the median process CPU time per step (on a shared machine the steadier
figure), and ratios to the first config at the same L (tokens/s ratio; CPU ratio =
baseline CPU s / this CPU s, so > 1 means faster). The configs are alternated `repeats` times
and the best of each kept, so a burst of load on the machine does not hit only one of them.
"""

from __future__ import annotations

import time
from typing import Mapping

import ml_collections
import numpy as np

from attn_jax import sharding as shd
from attn_jax.train.setup import build_setup, compile_step


def random_batch(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
  """(tokens [1, batch, seq_len + 1] numpy, train batch {inputs, targets, weights}): one
  micro-batch of uniform random tokens, the layout the train step takes."""
  import jax.numpy as jnp
  toks = np.random.default_rng(seed).integers(0, vocab_size, size=(1, batch, seq_len + 1),
                                              dtype=np.int32)
  return toks, {"inputs": jnp.asarray(toks[..., :-1]), "targets": jnp.asarray(toks[..., 1:]),
                "weights": jnp.ones((1, batch, seq_len), jnp.float32)}


def time_steps(compiled, state, batch, *, steps: int, warmup: int):
  """Run `warmup` untimed then `steps` timed calls of a compiled train step.
  Returns (state, last metrics, wall seconds per step, process CPU seconds per step)."""
  import jax
  metrics = None
  for _ in range(warmup):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(state)
  walls, cpus = [], []
  for _ in range(steps):
    t, cp = time.perf_counter(), time.process_time()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - cp)
  return state, metrics, walls, cpus


def prepare_step(config: ml_collections.ConfigDict, seq_len: int, *, batch_tokens: int):
  """The trainer's step for `config` at length `seq_len`, compiled for a random batch of
  max(1, batch_tokens // seq_len) rows rounded up to whole rows per batch shard.
  Returns (setup, state, tokens [1, B, L + 1], batch, compiled, compile seconds)."""

  c = ml_collections.ConfigDict(config.to_dict())
  B = max(1, int(batch_tokens) // int(seq_len))
  c.data.seq_len = int(seq_len)
  c.model.max_seq_len = max(int(c.model.max_seq_len), int(seq_len))
  c.train.grad_accum = 1
  setup = build_setup(c)
  shards = shd.batch_shards(setup.mesh, setup.rules)
  B = -(-B // shards) * shards     # whole rows per batch shard
  state = setup.init_fn()
  toks, batch = random_batch(setup.cfg.vocab_size, B, seq_len)
  t0 = time.perf_counter()
  compiled = compile_step(setup, batch)
  return setup, state, toks, batch, compiled, time.perf_counter() - t0


def time_train_step(config: ml_collections.ConfigDict, seq_len: int, *, batch_tokens: int,
                    steps: int = 3, warmup: int = 1) -> dict:
  """{seq_len, batch, step_s (best), cpu_s (median), tok_s, params, compile_s}."""
  setup, state, toks, batch, compiled, compile_s = prepare_step(config, seq_len,
                                                                batch_tokens=batch_tokens)
  B = toks.shape[1]
  t0 = time.perf_counter()
  state, _, _, _ = time_steps(compiled, state, batch, steps=0, warmup=max(1, int(warmup)))
  compile_s += time.perf_counter() - t0
  _, _, walls, cpus = time_steps(compiled, state, batch, steps=int(steps), warmup=0)
  return {"seq_len": int(seq_len), "batch": B, "step_s": min(walls),
          "cpu_s": float(np.median(cpus)), "tok_s": B * seq_len / min(walls),
          "params": int(setup.n_params["total"]), "compile_s": compile_s}


def compare(configs: Mapping[str, ml_collections.ConfigDict], seq_lens, *, batch_tokens: int,
            steps: int = 3, warmup: int = 1, repeats: int = 1, log=print) -> list[dict]:
  """Rows {variant, seq_len, ..., ratio, cpu_ratio}; the first config is the baseline."""
  names = list(configs)
  rows = []
  for L in seq_lens:
    best: dict[str, dict] = {}
    for _ in range(max(1, int(repeats))):
      for n in names:
        r = time_train_step(configs[n], int(L), batch_tokens=batch_tokens, steps=steps,
                            warmup=warmup)
        p = best.get(n)
        if p is not None:
          r = dict(r if r["step_s"] < p["step_s"] else p, cpu_s=min(r["cpu_s"], p["cpu_s"]))
        best[n] = r
    base = best[names[0]]
    for n in names:
      r = dict(best[n], variant=n, ratio=best[n]["tok_s"] / base["tok_s"],
               cpu_ratio=base["cpu_s"] / best[n]["cpu_s"])
      rows.append(r)
      log(f"throughput L={L} {n}: {r['tok_s']:.0f} tok/s ({r['ratio']:.2f}x), "
          f"cpu {r['cpu_s']:.3f} s/step ({r['cpu_ratio']:.2f}x)")
  return rows
