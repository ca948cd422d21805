"""One row of experiments/bench.py's tables: a config's train step timed at one length (with its
decode figures), or its step on packed rows beside plain rows (--document_mask).

The step is the trainer's jitted train step (`setup.build_setup`, compiled as the trainer
compiles it, `setup.compile_step`); best wall time of the timed steps and the median process
CPU time per step (on a shared machine the steadier comparison). A config/length whose step
does not fit the device (`train.memory.check_fit` on the compiled step's `memory_analysis()`)
is a skipped row with the fit message. Decode: `decode.generate` extends min(batch,
decode_batch) prompts of the sequence length by decode_tokens greedy tokens (tokens/s of the
whole call after a compiling call), and the decode-step table (`roofline.decode_row`) against
the copy bandwidth. `DeviceLimits` measures the machine once (matmul peak per dtype, copy
bandwidth) and prints each figure when first measured.
"""

from __future__ import annotations

import os
import time

import numpy as np

from attn_jax import decode
from attn_jax.bench import kernel_profile, roofline
from attn_jax.bench.configs import Options, named_config, row_policy
from attn_jax.config import check_document_mask, validate
from attn_jax.data.documents import document_fields
from attn_jax.model import build_model, count_params
from attn_jax.study import throughput
from attn_jax.train import flops as flops_lib, memory
from attn_jax.train.setup import compile_step


class DeviceLimits:
  """Measured matmul peak per dtype, datasheet peak, copy bandwidth: measured once each."""

  def __init__(self, peak_n: int = 0):
    self.peak_n = peak_n
    self.measured: dict = {}

  def __call__(self, dtype: str) -> dict:
    if "bandwidth" not in self.measured:
      self.measured["bandwidth"] = roofline.copy_bandwidth()
      print(f"copy bandwidth {self.measured['bandwidth'] / 1e9:.2f} GB/s (read + write, best "
            "of 5)")
    if dtype not in self.measured:
      peak = roofline.matmul_peak(dtype, n=self.peak_n or None)
      sheet = flops_lib.peak_flops_per_device(dtype=dtype)
      self.measured[dtype] = {"peak_measured": peak, "peak_sheet": sheet,
                              "bandwidth": self.measured["bandwidth"]}
      print(f"matmul peak ({dtype}) {peak / 1e12:.3f} TFLOP/s measured (square jnp.dot, "
            f"best of 5), datasheet {'n/a' if sheet is None else f'{sheet / 1e12:.0f} TFLOP/s'}",
            flush=True)
    return self.measured[dtype]


def aux_maxima(aux) -> dict:
  """Each monitor's max over layers: {name: float}; a pattern's per-layer-kind groups
  ({"1.sisa": {name: [R]}}) become "1.sisa/name"."""
  out = {}
  for k, v in (aux or {}).items():
    if isinstance(v, dict):
      out.update({f"{k}/{n}": x for n, x in aux_maxima(v).items()})
    else:
      out[k] = float(np.max(np.asarray(v)))
  return out


def bench_one(name: str, seq_len: int, options: Options, limits, decode: bool = True,
              config=None) -> dict:
  """The train-step row of `name` at `seq_len` (decode figures too when `decode`)."""
  import jax


  o = options
  config = (config or named_config(name, o)).copy_and_resolve_references()
  config.train.steps = 1000
  setup, state, toks, batch, compiled, compile_s = throughput.prepare_step(
      config, seq_len, batch_tokens=o.batch_tokens)
  cfg, n_params, B = setup.cfg, setup.n_params, toks.shape[1]
  fit = memory.check_fit(compiled.memory_analysis(), micro_batch=B, grad_accum=1,
                         remat=cfg.remat)
  if not fit.fits:
    return {"config": name, "seq_len": seq_len, "batch": B, "skipped": fit.message,
            "mem_gib": fit.needed / memory.GiB}
  t0 = time.perf_counter()
  state, _, _, _ = throughput.time_steps(compiled, state, batch, steps=0, warmup=o.warmup)
  compile_s += time.perf_counter() - t0
  state, metrics, times, cpu = throughput.time_steps(compiled, state, batch, steps=o.steps,
                                                     warmup=0)
  if o.profile_top:
    state = _profile(compiled, state, batch, f"{name} T {seq_len}", min(times), o)
  flops = flops_lib.train_flops_per_token(cfg, n_params, seq_len)
  lim = limits(cfg.dtype)
  tok_s = B * seq_len / min(times)
  n_dev = jax.device_count()
  aux = metrics.get("aux", {}) if isinstance(metrics, dict) else {}
  policy = row_policy(name, o.policy_window)
  decode_tok_s = (_decode_tok_s(cfg, state, toks, seq_len, o, policy)
                  if decode and o.decode_tokens else None)
  steps = ([roofline.decode_row(model_with(cfg, state), n_params, int(b), o.decode_step_prompt,
                                o.decode_steps, lim["bandwidth"], policy=policy)
            for b in o.decode_step_batches] if decode else [])
  return {"config": name, "seq_len": seq_len, "batch": B, "step_s": min(times),
          "cpu_s": float(np.median(cpu)), "tok_s": tok_s,
          "mfu": roofline.mfu(tok_s, flops, lim["peak_sheet"], n_dev),
          "mfu_measured": roofline.mfu(tok_s, flops, lim["peak_measured"], n_dev),
          "flops_s": tok_s * flops, "decode_steps": steps,
          "params": n_params["total"], "flops_tok": flops, "compile_s": compile_s,
          "d_ff": cfg.d_ff, "aux": aux_maxima(aux),
          "mem_gib": fit.needed / memory.GiB, "decode_tok_s": decode_tok_s}


def _profile(compiled, state, batch, label: str, step_s: float, o: Options):
  """One more step under the profiler; prints its longest kernels; returns the new state."""
  import tempfile

  out = {}

  def one():
    out["state"], _ = compiled(state, batch)
    return out["state"]
  root = o.profile_dir or tempfile.mkdtemp(prefix="attn_jax_profile_")
  path = kernel_profile.trace_call(one, os.path.join(root, label.replace(" ", "_")))
  rows, busy = kernel_profile.top_kernels(path, o.profile_top)
  print(kernel_profile.format_top(label, rows, busy, step_s), flush=True)
  return out["state"]


def merge(prev, r):
  """Across repeats: best wall time, lowest median CPU time, first decode figure."""
  if prev is None or "skipped" in r:
    return r
  r["cpu_s"] = min(r["cpu_s"], prev["cpu_s"])
  r["decode_tok_s"] = prev.get("decode_tok_s") or r.get("decode_tok_s")
  r["decode_steps"] = prev.get("decode_steps") or r.get("decode_steps")
  if r["step_s"] > prev["step_s"]:
    r = dict(prev, cpu_s=r["cpu_s"], decode_tok_s=r["decode_tok_s"],
             decode_steps=r["decode_steps"])
  return r


def model_with(cfg, state):
  """The model with the trained state's parameters."""
  from flax import nnx

  graphdef, _, _ = nnx.split(build_model(cfg, seed=0), nnx.Param, ...)
  return nnx.merge(graphdef, state["params"], state["rest"])


def _decode_tok_s(cfg, state, toks, seq_len, o: Options, policy=None):
  """Generated tokens/s of decode.generate (prefill of the prompts + decode_tokens) under the
  cache `policy`."""
  import jax
  import jax.numpy as jnp


  model = model_with(cfg, state)
  b = min(toks.shape[1], o.decode_batch)
  prompt = jnp.asarray(toks[0, :b, :seq_len])
  n = o.decode_tokens
  run = lambda: decode.generate(model, prompt, max_new_tokens=n, policy=policy)
  jax.block_until_ready(run())  # compiles
  t = time.perf_counter()
  jax.block_until_ready(run())
  return b * n / (time.perf_counter() - t)


def decode_only_row(name: str, config, options: Options, limits) -> dict:
  """The decode-step rows of `config` at initialisation (--decode_only: no train step)."""
  o = options
  cfg = validate(config).model
  lim = limits(cfg.dtype)
  model, n_params = build_model(cfg, seed=0), count_params(cfg)
  return {"decode_steps": [
      roofline.decode_row(model, n_params, int(b), o.decode_step_prompt, o.decode_steps,
                          lim["bandwidth"], policy=row_policy(name, o.policy_window))
      for b in o.decode_step_batches]}


def packed_fields(batch: dict, doc_len: int) -> dict:
  """`segment_ids` / `positions` [1, B, L] of rows of consecutive `doc_len`-token documents."""
  import jax.numpy as jnp

  _, B, L = batch["inputs"].shape
  fields = document_fields(np.arange(doc_len, L, doc_len), L)
  return {k: jnp.broadcast_to(jnp.asarray(v), (1, B, L)) for k, v in fields.items()}


def bench_document_mask(name: str, seq_len: int, options: Options, config=None) -> dict:
  """Per config and length, the same train step (same model, same parameters) on the same
  random tokens, once as plain rows and once as packed rows of document_len-token documents
  (`data.document_mask`: segment ids and positions restarting per document), alternated
  `repeats` times; both best step times and masked / unmasked (wall and median CPU time). A
  mixer that does not take segment ids (NotImplementedError), or a config the switch does not
  allow, is a "skipped" row with the reason."""
  import ml_collections


  o = options
  config = ml_collections.ConfigDict((config or named_config(name, o)).to_dict())
  config.train.steps = 1000
  setup, state, _, plain, compiled, _ = throughput.prepare_step(
      config, seq_len, batch_tokens=o.batch_tokens)
  doc_len = o.document_len or max(1, seq_len // 4)
  row = {"config": name, "seq_len": seq_len, "batch": plain["inputs"].shape[1],
         "doc_len": doc_len}
  packed = dict(plain, **packed_fields(plain, doc_len))
  try:
    check_document_mask(setup.cfg, setup.run.replace_in("data", document_mask=True).data)
    compiled_packed = compile_step(setup, packed)   # the same step; the batch has the keys
  except (NotImplementedError, ValueError) as e:
    return dict(row, skipped=f"{type(e).__name__}: {e}")
  best = {"plain": (np.inf, np.inf), "packed": (np.inf, np.inf)}
  for _ in range(max(1, o.repeats)):     # alternated: load bursts hit both
    for kind, fn, batch in (("plain", compiled, plain), ("packed", compiled_packed, packed)):
      state, _, _, _ = throughput.time_steps(fn, state, batch, steps=0, warmup=o.warmup)
      state, _, walls, cpus = throughput.time_steps(fn, state, batch, steps=o.steps, warmup=0)
      wall, cpu = best[kind]
      best[kind] = (min(wall, min(walls)), min(cpu, float(np.median(cpus))))
  (pw, pc), (mw, mc) = best["plain"], best["packed"]
  return dict(row, plain_s=pw, packed_s=mw, ratio=mw / pw, plain_cpu_s=pc, packed_cpu_s=mc,
              cpu_ratio=mc / pc)
