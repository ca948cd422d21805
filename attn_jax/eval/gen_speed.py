"""Batch-1 greedy generation speed of one set of weights in several engines, side by side.

Each engine offers two calls on the same prompt of T tokens:

  prefill(ids, N)     the prompt through a fresh KV cache made for N new tokens (ours: the
                      capacity `generate` gives it, T + N), logits of the last token only;
  generate(ids, N)    prefill, then N - 1 one-token steps with the KV cache, greedy argmax,
                      exactly N new tokens (no EOS stop) -> the new token ids.

and the measured wall times (after an untimed warm-up call of each, which compiles ours) give

  prefill tokens/s = T / t_prefill
  decode tokens/s  = (N - 1) / (t_generate - t_prefill)

(the first new token comes out of the prefill, so a generate call holds N - 1 decode steps).
The same with the process's CPU time (all its threads) in place of wall time gives tokens per
CPU-second, which a busy machine disturbs less than wall time (a descheduled engine loses
wall time, not CPU time; both engines use the same number of threads).
Repeats run the engines alternately, the order rotating each round, so that a machine whose
load drifts during the run (a shared one) slows each engine alike; the table reports the
median and the spread (min-max) over repeats, and the ratios of the medians. Decode tokens/s
uses t_prefill of the same round.

Engines: ours (`attn_jax.decode.generate`, and `decode.prefill` jitted with
`decode.jit_stateful` as experiments/bench.py's decode rows do), transformers
(`LlamaForCausalLM.generate`, greedy, its default dynamic KV cache, torch.inference_mode), and
llama.cpp through llama-cpp-python (`Llama.eval` of the prompt, then one token per `eval`,
argmax of the last logits) when it is installed. All in fp32 on the same weights.

Each engine's greedy tokens are kept; `agreement` counts how many leading tokens two engines
share (fp32 engines that sum in different orders can split at a near-tie of the argmax, after
which the continuations differ legitimately; a wrong model differs from the first token).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from attn_jax import decode
from attn_jax.pretrained import hf as hf_lib
from attn_jax.pretrained.loader import hf_tensors, spec_of
from attn_jax.train.flops import forward_flops_per_token


@dataclasses.dataclass
class Engine:
  """`prefill(ids, n) -> None` (a state made for n new tokens) and `generate(ids, n) ->
  list[int]` (n new token ids), both blocking until their results are computed."""
  name: str
  prefill: Callable[[list[int], int], None]
  generate: Callable[[list[int], int], list[int]]
  backend: str = ""   # whose dense matmuls it runs on (`gemm_rates`' keys), "" = not measured


def ours_engine(model, name: str = "attn_jax") -> Engine:
  """attn_jax's decoding path on an in-memory `Decoder`."""
  import jax
  import jax.numpy as jnp
  from flax import nnx


  graphdef, state = nnx.split(model)
  compiled = {}

  def prefill_fn(capacity):
    if capacity not in compiled:
      @decode.jit_stateful
      def run(state, prompt_BT):
        logits_BV, dstate = decode.prefill(nnx.merge(graphdef, state), prompt_BT,
                                           capacity=capacity)
        return jnp.argmax(logits_BV, axis=-1), dstate
      compiled[capacity] = run
    return compiled[capacity]

  def prefill(ids, n):   # the capacity decode.generate uses (its cache_len default)
    prompt = jnp.asarray([ids], jnp.int32)
    jax.block_until_ready(prefill_fn(len(ids) + n)(state, prompt))

  def generate(ids, n):
    out = decode.generate(model, jnp.asarray([ids], jnp.int32), max_new_tokens=n)
    return np.asarray(out)[0, len(ids):].tolist()

  return Engine(name, prefill, generate, backend="xla")


def transformers_engine(model, name: str = "transformers") -> Engine:
  """A transformers causal LM (`LlamaForCausalLM`, fp32, eval mode) on its own device (CPU or
  CUDA: a prefill waits for the device before it returns)."""
  import torch
  device = next(model.parameters()).device

  def prefill(ids, n):
    del n   # a dynamic cache grows as it goes
    with torch.inference_mode():
      model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    if device.type == "cuda":
      torch.cuda.synchronize(device)

  def generate(ids, n):
    with torch.inference_mode():
      out = model.generate(torch.tensor([ids], device=device),
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                     device=device),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           use_cache=True, num_beams=1, pad_token_id=0)
    return out[0, len(ids):].tolist()   # .tolist() waits for the device

  return Engine(name, prefill, generate, backend="torch" if device.type == "cpu" else "")


def transformers_twin(model, device: str = "cpu"):
  """transformers' `LlamaForCausalLM` (fp32, eval mode, on `device`) holding the parameters of
  an exportable attn_jax model, built in memory (no folder): the reference engine where no
  Hugging Face folder of the weights exists (random weights of a checkpoint's shape)."""
  import torch
  import transformers

  tensors = hf_tensors(model)
  config = transformers.LlamaConfig.from_dict(hf_lib.hf_config(spec_of(model.cfg)))
  twin = transformers.LlamaForCausalLM(config).eval()
  missing, unexpected = twin.load_state_dict({k: torch.from_numpy(np.array(v, np.float32))
                                              for k, v in tensors.items()}, strict=False)
  tied = {"lm_head.weight"} if model.cfg.tie_embeddings else set()
  if set(missing) - tied or unexpected:
    raise AssertionError(f"transformers_twin: missing {missing}, unexpected {unexpected}")
  twin.tie_weights()
  return twin.to(device)


def llama_cpp_engine(llm, name: str = "llama.cpp") -> Engine:
  """A `llama_cpp.Llama` (its own n_threads) on a GGUF file."""

  def prefill(ids, n):
    del n   # the context (n_ctx) is fixed when the model is loaded
    llm.reset()
    llm.eval(ids)

  def last_logits():
    # `Llama.eval` keeps no logits unless the model holds all of them (`logits_all`); the
    # context keeps the last evaluated token's, which llama.cpp's C API hands out
    import llama_cpp
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

  def generate(ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for i in range(n):
      tok = int(np.argmax(last_logits()))
      out.append(tok)
      if i < n - 1:
        llm.eval([tok])
    return out

  return Engine(name, prefill, generate)


def _timed(fn, *args):
  """(wall seconds, process CPU seconds, fn(*args))."""
  t, c = time.perf_counter(), time.process_time()
  out = fn(*args)
  return time.perf_counter() - t, time.process_time() - c, out


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
  """Number of leading tokens `a` and `b` share."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def measure(engines: Sequence[Engine], prompt: Sequence[int], new_tokens: int,
            repeats: int) -> dict:
  """Alternated timings of every engine (module docstring). Returns {"rows": [per engine:
  prefill/decode tok/s median, min, max, and the raw seconds], "tokens": {engine: new ids},
  "agreement": {engine: leading tokens shared with the first engine}, "config"}."""
  if new_tokens < 2:
    raise ValueError(f"new_tokens must be at least 2 (one decode step), got {new_tokens}")
  if repeats < 1:
    raise ValueError(f"repeats must be at least 1, got {repeats}")
  ids = [int(t) for t in prompt]
  tokens = {}
  raw = {e.name: {"prefill_s": [], "generate_s": [], "prefill_cpu_s": [], "generate_cpu_s": []}
         for e in engines}
  for e in engines:  # warm-up (compiles ours; first-call allocations elsewhere)
    t_warm, _, _ = _timed(e.prefill, ids, new_tokens)
    tokens[e.name] = [int(t) for t in e.generate(ids, new_tokens)]
    logging.info("warm-up %s done (prefill %.3f s)", e.name, t_warm)
  for r in range(repeats):
    k = r % len(engines)
    for e in list(engines[k:]) + list(engines[:k]):
      t_pre, c_pre, _ = _timed(e.prefill, ids, new_tokens)
      t_gen, c_gen, got = _timed(e.generate, ids, new_tokens)
      for key, value in (("prefill_s", t_pre), ("generate_s", t_gen),
                         ("prefill_cpu_s", c_pre), ("generate_cpu_s", c_gen)):
        raw[e.name][key].append(value)
      if [int(t) for t in got] != tokens[e.name]:
        raise RuntimeError(f"{e.name}: greedy tokens changed between repeats")
      logging.info("round %d/%d %s: prefill %.3f s, generate %.3f s", r + 1, repeats, e.name,
                   t_pre, t_gen)
  rows = []
  for e in engines:
    pre = [len(ids) / t for t in raw[e.name]["prefill_s"]]
    dec = [(new_tokens - 1) / max(g - p, 1e-9)
           for g, p in zip(raw[e.name]["generate_s"], raw[e.name]["prefill_s"])]
    cpu = raw[e.name]
    dec_cpu = [(new_tokens - 1) / max(g - p, 1e-9)
               for g, p in zip(cpu["generate_cpu_s"], cpu["prefill_cpu_s"])]
    rows.append({"engine": e.name, "backend": e.backend,
                 "prefill_tok_s": statistics.median(pre),
                 "prefill_tok_cpu_s": statistics.median(len(ids) / max(t, 1e-9)
                                                        for t in cpu["prefill_cpu_s"]),
                 "decode_tok_cpu_s": statistics.median(dec_cpu),
                 "prefill_min": min(pre), "prefill_max": max(pre),
                 "decode_tok_s": statistics.median(dec), "decode_min": min(dec),
                 "decode_max": max(dec), **raw[e.name]})
  first = engines[0].name
  return {"rows": rows, "tokens": tokens,
          "agreement": {e.name: agreement(tokens[first], tokens[e.name]) for e in engines},
          "config": {"prompt_len": len(ids), "new_tokens": new_tokens, "repeats": repeats}}


def to_markdown(result: dict) -> str:
  """The speed table: per engine median (min-max) tok/s and the ratio of ours (the first row)
  to each engine."""
  rows = result["rows"]
  base = rows[0]
  n = result["config"]["new_tokens"]
  lines = [f"| engine | prefill tok/s | decode tok/s | {base['engine']} / engine, prefill | "
           f"{base['engine']} / engine, decode | same, per CPU-second: prefill / decode | "
           f"greedy tokens equal to {base['engine']}'s |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['engine']} | {r['prefill_tok_s']:.0f} ({r['prefill_min']:.0f}-"
        f"{r['prefill_max']:.0f}) | {r['decode_tok_s']:.1f} ({r['decode_min']:.1f}-"
        f"{r['decode_max']:.1f}) | {base['prefill_tok_s'] / r['prefill_tok_s']:.2f}x | "
        f"{base['decode_tok_s'] / r['decode_tok_s']:.2f}x | "
        f"{base['prefill_tok_cpu_s'] / r['prefill_tok_cpu_s']:.2f}x / "
        f"{base['decode_tok_cpu_s'] / r['decode_tok_cpu_s']:.2f}x | "
        f"{result['agreement'][r['engine']]} / {n} |")
  return "\n".join(lines)


def prefill_flops_per_token(cfg, n_params: dict, prompt_len: int) -> float:
  """Model FLOPs per prompt token of a prefill (`train.flops` convention: 2 N per token, the
  causal lower triangle of attention), with the LM head applied to the last token only."""
  head = 2.0 * cfg.d_model * cfg.vocab_size
  return forward_flops_per_token(cfg, n_params, prompt_len) - head + head / prompt_len


def gemm_rates(m: int, k: int, n: int, chain: int = 8, repeats: int = 7) -> dict:
  """fp32 GFLOP/s of dense matmuls at a prefill's shape in XLA (one jitted program) and in
  torch (its threads as set by the caller): `chain` times [m, k] x [k, n] then [m, n] x [n, k]
  back to back (one call holds 4 m k n chain FLOPs, so a single launch's overhead does not
  count), timed alternately, medians. The dense rate each engine's prefill is built on (a
  prefill's matmuls have m = the prompt length)."""
  import jax
  import jax.numpy as jnp
  import torch

  rng = np.random.default_rng(0)
  x = rng.standard_normal((m, k), np.float32)
  up = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  down = (rng.standard_normal((n, k)) / np.sqrt(n)).astype(np.float32)

  def steps(x, up, down):
    for _ in range(chain):
      x = (x @ up) @ down
    return x

  xla = jax.jit(steps)
  jx, ju, jd = (jnp.asarray(a) for a in (x, up, down))
  tx, tu, td = (torch.from_numpy(a) for a in (x, up, down))
  run = {"xla": lambda: xla(jx, ju, jd).block_until_ready(), "torch": lambda: steps(tx, tu, td)}
  times = {name: [] for name in run}
  with torch.inference_mode():
    for fn in run.values():
      fn()
    for _ in range(repeats):
      for name, fn in run.items():
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)
  flops = 4.0 * m * k * n * chain
  return {name: flops / statistics.median(ts) / 1e9 for name, ts in times.items()}


def ceiling_markdown(result: dict, flops_per_token: float, gemm: dict) -> str:
  """Each engine's prefill in GFLOP/s of model FLOPs beside the dense matmul rate of its
  backend (a row's "backend", `gemm_rates`' key), and the prefill tok/s that rate would give
  if every FLOP ran at it."""
  lines = [f"Prefill FLOPs: {flops_per_token / 1e6:.1f} MFLOP per prompt token (model FLOPs). "
           f"Dense fp32 matmul at the prompt's shape: XLA {gemm['xla']:.0f} GFLOP/s, torch "
           f"{gemm['torch']:.0f} GFLOP/s.", "",
           "| engine | prefill GFLOP/s | backend matmul GFLOP/s | share of it | prefill tok/s "
           "at the matmul rate |", "|---|---|---|---|---|"]
  for r in result["rows"]:
    rate = gemm.get(r.get("backend", ""))
    got = r["prefill_tok_s"] * flops_per_token / 1e9
    if rate is None:
      lines.append(f"| {r['engine']} | {got:.0f} | - | - | - |")
      continue
    lines.append(f"| {r['engine']} | {got:.0f} | {rate:.0f} | {got / rate:.0%} | "
                 f"{rate * 1e9 / flops_per_token:.0f} |")
  return "\n".join(lines)


__all__ = ["Engine", "ours_engine", "transformers_engine", "transformers_twin",
           "llama_cpp_engine", "agreement",
           "measure", "to_markdown", "prefill_flops_per_token", "gemm_rates", "ceiling_markdown"]
