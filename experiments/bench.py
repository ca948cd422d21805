"""Train-step throughput of several configs side by side (tokens/s, ratio, analytic FLOPs,
compiled peak memory, decode tokens/s).

  python experiments/bench.py --preset=cpu_50m_fp32   # the 50M Transformer's shapes (d 512 /
                                                      # 8 heads / 6 layers / vocab 50277) in
                                                      # fp32, batch 4 x 1024: sized for a CPU
  python experiments/bench.py --configs=transformer_152m,sisa_152m --seq_lens=1024,4096,16384
  python experiments/bench.py --scale=tiny --dtype=float32 --seq_lens=1024,4096 \
      --configs=transformer_152m,sisa_152m,sisa_152m@fast,sisa_152m@chunked   # a 2-core CPU
  python experiments/bench.py --study=configs/study_tiny.py --seq_lens=256,1024 # every mixer
  python experiments/bench.py --configs=transformer_152m,transformer_152m@model.n_layers=4

A config suffix `@a.b=v,...` sets any config fields; `--study` benches every variant of a study
config at its matched parameter count (attn_jax/study/variants.py) plus the window and
StreamingLLM cache policies of --policy_mixers (their decode tokens/s is the policy's cost; the
train step is the same model), all in one table with ratios to the study's baseline.

Each config is timed with the trainer's jitted train step (forward + backward + clipped AdamW
update with the mixer's optimizer overrides; `attn_jax.train.trainer.build_setup`), compiled
as the trainer compiles it (`trainer.compile_step`). The first config is the baseline of the
ratios. Reported: best wall time of the timed steps
(tok/s, ratio) and the median process CPU time per step (cpu s, cpu ratio) — on a shared
machine the CPU time is the steadier comparison.

Analytic training FLOPs per token (stated convention): 6 N_nonembedding + 6 d V (the LM head
matmul, also when tied) + 3 x n_layers x mixer.flops_per_token(seq_len) (attention: only the
causal lower triangle, (L+1)/2 keys per query; backward = 2 x forward), as computed by
`attn_jax.train.flops.train_flops_per_token` for the trainer's logs. Against what the machine
can do (`attn_jax.train.roofline`, measured in the same run, printed before the tables):
TFLOP/s = tok/s x that; MFU meas = TFLOP/s / (measured matmul peak x devices), the peak being
the best of 5 square `jnp.dot`s in the model's dtype (n = --peak_n); MFU sheet = the same
against the datasheet peak (`flops.PEAK_FLOPS` / `PEAK_FLOPS_TF32` by device kind and dtype;
n/a where unknown, e.g. CPU).

Decode against memory bandwidth: per config and each --decode_step_batches, one jitted loop of
--decode_steps greedy one-token steps after an untimed prefill of --decode_step_prompt random
tokens (capacity = prompt + steps), against bound = batch x copy bandwidth / (param bytes +
state bytes) (`roofline.decode_bytes`: non-embedding parameters + the LM head in the parameter
dtype, plus the whole decoding state); ratio = tok/s / bound. --decode_only prints only this
table, for freshly initialised parameters (no train step; what device_check.sh runs per mixer).

Memory: the step is compiled ahead of time (`trainer.compile_step`) and its
`memory_analysis()` gives the bytes one step needs (`attn_jax.train.memory.needed_bytes`:
arguments + outputs - donated + temporaries + code); a config/length whose step does not fit
the device (`train.memory.check_fit`) is skipped with the fit message, so --seq_lens=...,16384
runs "where memory allows". Decode: `attn_jax.decode.generate` extends a batch of prompts of
the sequence length (batch = min(batch, --decode_batch)) by --decode_tokens greedy tokens;
reported as generated tokens per second of the whole call (prefill included), after one
compiling call. --json writes every row.

Document masking (--document_mask, instead of the tables above): per config and length, the
same train step (same model, same parameters) on the same random tokens, once as plain rows and
once as packed rows of --document_len-token documents (`data.document_mask`: segment ids and
positions restarting per document, data/documents.py), alternated --repeats times in one
process; reported: both best step times and masked / unmasked (wall and median CPU time). A
mixer that does not take segment ids yet (NotImplementedError), or a config the switch does
not allow (sink tokens with a mixer that cannot read the shared prefix), is a "skipped" row
with the reason.

--scale=tiny keeps the architecture family at CPU size: d_model 256, 4 heads (d_h 64, as at
152M), 4 layers, vocab 4096, Transformer d_ff 4 d; SISA's d_ff is recomputed with
`matched_d_ff` so both models have the same parameter count. Explicit --d_model, --n_heads,
--n_layers, --vocab_size, --d_ff (Transformer width; SISA and the Transformer twins with a
`matched` function, fox_*, re-matched) override it.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["transformer_152m", "sisa_152m"],
                             "Config modules under configs/; the first is the baseline. "
                             "A suffix @auto|@fast|@chunked forces the SISA path.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096"], "Sequence lengths.")
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 8192, "Tokens per step (batch = this / L).")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per config (after warmup).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps (the first compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Alternate the configs this many times; best "
                                "time per config is reported (less noise on a shared CPU).")
_SCALE = flags.DEFINE_enum("scale", "full", ["full", "tiny"], "tiny: CPU-sized, see docstring.")
_D_MODEL = flags.DEFINE_integer("d_model", 0, "Override d_model (0 = keep).")
_N_HEADS = flags.DEFINE_integer("n_heads", 0, "Override n_heads.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 0, "Override n_layers.")
_VOCAB = flags.DEFINE_integer("vocab_size", 0, "Override vocab_size.")
_D_FF = flags.DEFINE_integer("d_ff", 0, "Transformer d_ff at the overridden width (0 = 4 d).")
_D_STATE = flags.DEFINE_integer("d_state", 0, "Override SISA d_state (d_ff re-matched).")
_DTYPE = flags.DEFINE_string("dtype", "", "Override the compute dtype (e.g. float32 on CPU).")
_SISA_PATH = flags.DEFINE_enum("sisa_path", "", ["", "auto", "fast", "chunked"],
                               "Force the SISA path.")
_SISA_DECAY_BIAS = flags.DEFINE_float("sisa_decay_bias", None, "Override decay_bias_init "
                                      "(e.g. -2.63: half-life ~10 tokens, long decay range).")
_REMAT = flags.DEFINE_string("remat", "", "Override model.remat.")
_PRESET = flags.DEFINE_enum("preset", "", ["", "cpu_50m_fp32"], "cpu_50m_fp32: configs "
                            "transformer_152m, sisa_152m, sisa_152m@fast at the 50M shapes "
                            "(d 512 / 8 heads / 6 layers / vocab 50277), fp32, batch 4 x 1024 "
                            "(explicit flags still override).")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "Generated tokens (0 = no decode).")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 4, "Largest decode batch.")
_STEP_BATCHES = flags.DEFINE_list("decode_step_batches", ["1", "32"], "Batches of the decode-"
                                  "step table (bandwidth ratio); empty = no table.")
_STEP_PROMPT = flags.DEFINE_integer("decode_step_prompt", 128, "Decode-step table: prompt "
                                    "length of the untimed prefill.")
_STEP_COUNT = flags.DEFINE_integer("decode_steps", 32, "Decode-step table: timed steps.")
_DECODE_ONLY = flags.DEFINE_bool("decode_only", False, "Only the decode-step table (freshly "
                                  "initialised parameters, no train step).")
_PEAK_N = flags.DEFINE_integer("peak_n", 0, "Matmul side of the measured peak (0: 2048 on "
                               "CPU, 8192 on an accelerator).")
_JSON = flags.DEFINE_string("json", "", "Write the rows to this JSON file.")
_STUDY = flags.DEFINE_string("study", "", "A study config (e.g. configs/study_tiny.py): bench "
                             "every variant of the study at its matched parameter count, plus "
                             "the streaming cache policies of --policy_mixers, in one table.")
_POLICY_MIXERS = flags.DEFINE_list("policy_mixers", ["transformer", "sisa_ds8"],
                                   "--study: variants also decoded under the window and "
                                   "streaming cache policies (a bounded ring).")
_POLICY_WINDOW = flags.DEFINE_integer("policy_window", 256, "--study: ring window of the "
                                      "window / streaming rows (streaming: 4 sinks).")

_DOCUMENT_MASK = flags.DEFINE_bool("document_mask", False, "Only the document-masking table: "
                                   "each config's step on packed rows next to plain rows.")
_DOCUMENT_LEN = flags.DEFINE_integer("document_len", 0, "--document_mask: tokens per packed "
                                     "document (0 = seq_len // 4).")

PRESETS = {"cpu_50m_fp32": dict(configs=["transformer_152m", "sisa_152m", "sisa_152m@fast"],
                                seq_lens=["1024"], batch_tokens=4096, d_model=512, n_heads=8,
                                n_layers=6, vocab_size=50277, dtype="float32")}


def _apply_preset(argv_flags) -> None:
  """Set the preset's values for every flag not given on the command line."""
  if not _PRESET.value:
    return
  for name, value in PRESETS[_PRESET.value].items():
    if not argv_flags[name].present:
      argv_flags[name].value = value


def _model_overrides(name: str, m) -> None:
  tiny = _SCALE.value == "tiny"
  d = _D_MODEL.value or (256 if tiny else 0)
  h = _N_HEADS.value or (4 if tiny else 0)
  n = _N_LAYERS.value or (4 if tiny else 0)
  vocab = _VOCAB.value or (4096 if tiny else 0)
  if d:
    m.d_model = d
    m.d_ff = _D_FF.value or 4 * d
  if h:
    m.n_heads = h
  if n:
    m.n_layers = n
  if vocab:
    m.vocab_size = vocab
  if _DTYPE.value:
    m.dtype = _DTYPE.value
  if _REMAT.value:
    m.remat = _REMAT.value
  if m.mixer == "sisa":
    from attn_jax.attention.sisa import matched_d_ff
    if _D_STATE.value:
      m.sisa.d_state = _D_STATE.value
    if d or h or _D_STATE.value:  # re-match the SwiGLU width to the (overridden) Transformer
      ref = importlib.import_module(f"configs.{name.replace('sisa_', 'transformer_')}")
      t = ref.get_config().model
      if d:
        t.d_model, t.d_ff = d, _D_FF.value or 4 * d
      if h:
        t.n_heads = h
      m.d_ff = matched_d_ff(t, m.sisa.d_state)
    if _SISA_PATH.value:
      m.sisa.path = _SISA_PATH.value
    if _SISA_DECAY_BIAS.value is not None:
      m.sisa.decay_bias_init = _SISA_DECAY_BIAS.value
  twin = importlib.import_module(f"configs.{name}")
  if hasattr(twin, "matched") and (d or h):  # a Transformer twin (fox_*): re-match its d_ff too
    ref = importlib.import_module(f"configs.transformer_{name.split('_', 1)[1]}").get_config()
    ref.model.update(d_model=m.d_model, d_ff=_D_FF.value or 4 * m.d_model, n_heads=m.n_heads)
    m.d_ff = twin.matched(ref).model.d_ff


def _set_path(config, path: str, text: str) -> None:
  """config.<path> = the literal `text` (a Python literal, else the string)."""
  import ast
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  *parents, leaf = path.split(".")
  node = config
  for p in parents + [leaf]:
    if p not in node:
      raise ValueError(f"config suffix {path}={text}: config.{path} is not a field")
    if p != leaf:
      node = node[p]
  node[leaf] = value


def _config_module(name: str, module: str):
  """configs/<module>.py, or a ValueError naming the config and the ones there are."""
  import importlib.util
  if not module.isidentifier() or importlib.util.find_spec(f"configs.{module}") is None:
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    have = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py") and f[0] != "_")
    raise ValueError(f"--configs: unknown config {name!r}: there is no configs/{module}.py "
                     f"(configs: {', '.join(have)})")
  return importlib.import_module(f"configs.{module}")


def named_config(name: str):
  """"module", "module@chunked" (SISA path, as before), "module@a.b=v,c.d=w" (any fields) or
  "module@window" / "module@streaming" (the same model, decoded under that cache policy:
  `row_policy`)."""
  module, _, suffix = name.partition("@")
  config = _config_module(name, module).get_config()
  _model_overrides(module, config.model)
  for item in filter(None, suffix.split(",")):
    if "=" in item:
      _set_path(config, *item.split("=", 1))
    elif item not in _ROW_POLICIES:
      config.model.sisa.path = item
  return config


def study_configs(path: str) -> dict:
  """{row name: config} for every study variant (parameters matched to the study's baseline,
  attn_jax.study.variants) plus cache-policy rows of --policy_mixers."""
  import runpy

  from attn_jax.study import variants
  study = runpy.run_path(path)["get_config"]()
  rows = {name: cfg for name, (cfg, _) in variants.all_variant_configs(study).items()}
  for name in _POLICY_MIXERS.value:
    for policy in _ROW_POLICIES:   # the same model; `row_policy` says how it decodes
      rows[f"{name}@{policy}"] = rows[name].copy_and_resolve_references()
  return rows


def row_policy(name: str):
  """The decode-time cache policy of a row: "<variant>@window" / "@streaming" (the
  --policy_window ring, 4 sinks), else None (linear)."""
  from attn_jax.attention import cache as cache_lib
  policy = name.rsplit("@", 1)[-1] if "@" in name else ""
  W = _POLICY_WINDOW.value
  return {"window": lambda: cache_lib.Ring(W),
          "streaming": lambda: cache_lib.SinksRing(4, W)}.get(policy, lambda: None)()


_ROW_POLICIES = ("window", "streaming")


def aux_maxima(aux) -> dict:
  """Each monitor's max over layers: {name: float}; a pattern's per-layer-kind groups
  ({"1.sisa": {name: [R]}}) become "1.sisa/name"."""
  import numpy as np
  out = {}
  for k, v in (aux or {}).items():
    if isinstance(v, dict):
      out.update({f"{k}/{n}": x for n, x in aux_maxima(v).items()})
    else:
      out[k] = float(np.max(np.asarray(v)))
  return out


def bench_one(name: str, seq_len: int, decode: bool = True, config=None, limits=None):
  import jax
  import numpy as np

  from attn_jax.study import throughput
  from attn_jax.train import flops as flops_lib
  from attn_jax.train import memory, roofline

  if config is None:
    config = named_config(name)
  config = config.copy_and_resolve_references()
  config.train.steps = 1000
  setup, state, toks, batch, compiled, compile_s = throughput.prepare_step(
      config, seq_len, batch_tokens=_BATCH_TOKENS.value)
  cfg, n_params, B = setup.cfg, setup.n_params, toks.shape[1]
  fit = memory.check_fit(compiled.memory_analysis(), micro_batch=B, grad_accum=1,
                         remat=cfg.remat)
  if not fit.fits:
    return {"config": name, "seq_len": seq_len, "batch": B, "skipped": fit.message,
            "mem_gib": fit.needed / memory.GiB}
  t0 = time.perf_counter()
  state, _, _, _ = throughput.time_steps(compiled, state, batch, steps=0, warmup=_WARMUP.value)
  compile_s += time.perf_counter() - t0
  state, metrics, times, cpu = throughput.time_steps(compiled, state, batch,
                                                     steps=_STEPS.value, warmup=0)
  flops = flops_lib.train_flops_per_token(cfg, n_params, seq_len)
  lim = (limits or device_limits)(cfg.dtype)
  tok_s = B * seq_len / min(times)
  n_dev = jax.device_count()
  mfu = roofline.mfu(tok_s, flops, lim["peak_sheet"], n_dev)
  mfu_meas = roofline.mfu(tok_s, flops, lim["peak_measured"], n_dev)
  aux = metrics.get("aux", {}) if isinstance(metrics, dict) else {}
  extra = aux_maxima(aux)
  decode_tok_s = (_decode_tok_s(cfg, state, toks, seq_len, row_policy(name))
                  if decode and _DECODE_TOKENS.value else None)
  steps = ([roofline.decode_row(_model(cfg, state), n_params, int(b), _STEP_PROMPT.value,
                                _STEP_COUNT.value, lim["bandwidth"], policy=row_policy(name))
            for b in _STEP_BATCHES.value] if decode else [])
  return {"config": name, "seq_len": seq_len, "batch": B, "step_s": min(times),
          "cpu_s": float(np.median(cpu)), "tok_s": tok_s, "mfu": mfu, "mfu_measured": mfu_meas,
          "flops_s": tok_s * flops, "decode_steps": steps,
          "params": n_params["total"], "flops_tok": flops, "compile_s": compile_s,
          "d_ff": cfg.d_ff, "aux": extra,
          "mem_gib": fit.needed / memory.GiB, "decode_tok_s": decode_tok_s}


def packed_fields(batch: dict, doc_len: int) -> dict:
  """`segment_ids` / `positions` [1, B, L] of rows of consecutive `doc_len`-token documents."""
  import jax.numpy as jnp
  import numpy as np

  from attn_jax.data.documents import document_fields
  _, B, L = batch["inputs"].shape
  fields = document_fields(np.arange(doc_len, L, doc_len), L)
  return {k: jnp.broadcast_to(jnp.asarray(v), (1, B, L)) for k, v in fields.items()}


def bench_document_mask(name: str, seq_len: int, config=None) -> dict:
  """One row of the --document_mask table (see the module docstring)."""
  import ml_collections
  import numpy as np

  from attn_jax.config import check_document_mask
  from attn_jax.study import throughput
  from attn_jax.train.trainer import compile_step

  config = ml_collections.ConfigDict((config or named_config(name)).to_dict())
  config.train.steps = 1000
  setup, state, _, plain, compiled, _ = throughput.prepare_step(
      config, seq_len, batch_tokens=_BATCH_TOKENS.value)
  doc_len = _DOCUMENT_LEN.value or max(1, seq_len // 4)
  row = {"config": name, "seq_len": seq_len, "batch": plain["inputs"].shape[1],
         "doc_len": doc_len}
  config.data.document_mask = True
  packed = dict(plain, **packed_fields(plain, doc_len))
  try:
    check_document_mask(setup.cfg, config.data)
    compiled_packed = compile_step(setup, packed)   # the same step; the batch has the keys
  except (NotImplementedError, ValueError) as e:
    return dict(row, skipped=f"{type(e).__name__}: {e}")
  best = {"plain": (np.inf, np.inf), "packed": (np.inf, np.inf)}
  for _ in range(max(1, _REPEATS.value)):     # alternated: load bursts hit both
    for kind, fn, batch in (("plain", compiled, plain), ("packed", compiled_packed, packed)):
      state, _, _, _ = throughput.time_steps(fn, state, batch, steps=0, warmup=_WARMUP.value)
      state, _, walls, cpus = throughput.time_steps(fn, state, batch, steps=_STEPS.value,
                                                    warmup=0)
      wall, cpu = best[kind]
      best[kind] = (min(wall, min(walls)), min(cpu, float(np.median(cpus))))
  (pw, pc), (mw, mc) = best["plain"], best["packed"]
  return dict(row, plain_s=pw, packed_s=mw, ratio=mw / pw, plain_cpu_s=pc, packed_cpu_s=mc,
              cpu_ratio=mc / pc)


def _print_document_mask(rows) -> None:
  print(f"\ndocument masking: packed rows (data.document_mask) vs plain rows, same step and "
        f"parameters; ratio = packed / plain (> 1: masking costs)")
  print(f"{'config':<26}{'seq_len':>8}{'batch':>6}{'doc len':>8}{'plain s':>9}{'packed s':>9}"
        f"{'ratio':>7}{'plain cpu':>10}{'packed cpu':>11}{'cpu ratio':>10}")
  for r in rows:
    head = f"{r['config']:<26}{r['seq_len']:>8}{r['batch']:>6}{r['doc_len']:>8}"
    if "skipped" in r:
      print(f"{head}  skipped: {r['skipped']}", flush=True)
      continue
    print(f"{head}{r['plain_s']:>9.3f}{r['packed_s']:>9.3f}{r['ratio']:>7.3f}"
          f"{r['plain_cpu_s']:>10.3f}{r['packed_cpu_s']:>11.3f}{r['cpu_ratio']:>10.3f}",
          flush=True)


def _model(cfg, state):
  """The model with the trained state's parameters."""
  from flax import nnx

  from attn_jax.model import build_model
  graphdef, _, _ = nnx.split(build_model(cfg, seed=0), nnx.Param, ...)
  return nnx.merge(graphdef, state["params"], state["rest"])


def _decode_tok_s(cfg, state, toks, seq_len, policy=None):
  """Generated tokens/s of decode.generate (prefill of the prompts + --decode_tokens) under the
  cache `policy`."""
  import jax
  import jax.numpy as jnp

  from attn_jax import decode

  model = _model(cfg, state)
  b = min(toks.shape[1], _DECODE_BATCH.value)
  prompt = jnp.asarray(toks[0, :b, :seq_len])
  n = _DECODE_TOKENS.value
  run = lambda: decode.generate(model, prompt, max_new_tokens=n, policy=policy)
  jax.block_until_ready(run())  # compiles
  t = time.perf_counter()
  jax.block_until_ready(run())
  return b * n / (time.perf_counter() - t)


def _merge(prev, r):
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


def _print_table(L, rows, names):
  base = rows[names[0]]
  print(f"\nseq_len {L} (batch {base['batch']}, step: trainer.build_setup)")
  print(f"{'config':<22}{'params':>12}{'d_ff':>6}{'step s':>9}{'tok/s':>9}{'ratio':>7}"
        f"{'cpu s':>8}{'cpu ratio':>10}{'GFLOP/tok':>10}{'FLOPs ratio':>12}{'TFLOP/s':>9}"
        f"{'MFU meas':>9}{'MFU sheet':>10}{'mem GiB':>8}{'decode tok/s':>13}{'compile s':>10}  aux (max over layers)")
  for name in names:
    r = rows[name]
    if "skipped" in r:
      print(f"{name:<22} skipped ({r['mem_gib']:.1f} GiB): {r['skipped']}")
      continue
    aux = ", ".join(f"{k}={v:.3g}" for k, v in r["aux"].items())
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"   # n/a: no datasheet peak (CPU)
    dec = "-" if r.get("decode_tok_s") is None else f"{r['decode_tok_s']:.1f}"
    ratio = cpu_ratio = "-"
    if "skipped" not in base:
      ratio = f"{r['tok_s'] / base['tok_s']:.3f}"
      cpu_ratio = f"{base['cpu_s'] / r['cpu_s']:.3f}"
      r["ratio"], r["cpu_ratio"] = r["tok_s"] / base["tok_s"], base["cpu_s"] / r["cpu_s"]
    flops_ratio = "-" if "skipped" in base else f"{r['flops_tok'] / base['flops_tok']:.3f}"
    print(f"{name:<22}{r['params']:>12,}{r['d_ff']:>6}{r['step_s']:>9.3f}{r['tok_s']:>9.0f}"
          f"{ratio:>7}{r['cpu_s']:>8.2f}{cpu_ratio:>10}{r['flops_tok'] / 1e9:>10.3f}"
          f"{flops_ratio:>12}{r['flops_s'] / 1e12:>9.3f}{pct(r['mfu_measured']):>9}"
          f"{pct(r['mfu']):>10}{r['mem_gib']:>8.2f}{dec:>13}{r['compile_s']:>10.1f}  {aux}",
          flush=True)
  _print_decode_steps(rows, names)


def _print_decode_steps(rows, names, header=True, width=22):
  """Decode-step tokens/s against the copy-bandwidth bound (attn_jax.train.roofline)."""
  if not any(rows[n].get("decode_steps") for n in names):
    return
  width = max([width] + [len(n) + 1 for n in names])
  if header:
    _decode_header(width)
  for name in names:
    for d in rows[name].get("decode_steps") or ():
      print(f"{name:<{width}}{d['batch']:>6}{d['capacity']:>9}{d['param_bytes'] / 1e6:>9.1f}"
            f"{d['state_bytes'] / 1e6:>9.1f}{d['tok_s']:>10.1f}{d['bound_tok_s']:>12.1f}"
            f"{d['ratio']:>7.3f}", flush=True)


def _decode_header(width):
  print(f"\ndecode steps after an untimed prefill of {_STEP_PROMPT.value} tokens "
        f"({_STEP_COUNT.value} steps timed): bound = batch x bandwidth / (param bytes + state "
        f"bytes)")
  print(f"{'config':<{width}}{'batch':>6}{'capacity':>9}{'param MB':>9}{'state MB':>9}"
        f"{'tok/s':>10}{'bound tok/s':>12}{'ratio':>7}")


def _decode_only(names, prepared):
  """--decode_only: the decode-step table of every config, at initialisation."""
  from attn_jax.config import validate
  from attn_jax.model import build_model, count_params
  from attn_jax.train import roofline
  for name in names:
    cfg = validate(prepared.get(name) or named_config(name))
    lim = device_limits(cfg.dtype)
    model, n_params = build_model(cfg, seed=0), count_params(cfg)
    row = {"decode_steps": [
        roofline.decode_row(model, n_params, int(b), _STEP_PROMPT.value, _STEP_COUNT.value,
                            lim["bandwidth"], policy=row_policy(name))
        for b in _STEP_BATCHES.value]}
    _print_decode_steps({name: row}, [name], header=name == names[0],
                        width=max(len(n) + 1 for n in names))


_LIMITS: dict = {}


def device_limits(dtype: str) -> dict:
  """Measured matmul peak for `dtype`, datasheet peak, copy bandwidth (measured once each,
  printed when first measured)."""
  from attn_jax.train import flops as flops_lib
  from attn_jax.train import roofline
  if "bandwidth" not in _LIMITS:
    _LIMITS["bandwidth"] = roofline.copy_bandwidth()
    print(f"copy bandwidth {_LIMITS['bandwidth'] / 1e9:.2f} GB/s (read + write, best of 5)")
  if dtype not in _LIMITS:
    measured = roofline.matmul_peak(dtype, n=_PEAK_N.value or None)
    sheet = flops_lib.peak_flops_per_device(dtype=dtype)
    _LIMITS[dtype] = {"peak_measured": measured, "peak_sheet": sheet,
                      "bandwidth": _LIMITS["bandwidth"]}
    print(f"matmul peak ({dtype}) {measured / 1e12:.3f} TFLOP/s measured (square jnp.dot, "
          f"best of 5), datasheet {'n/a' if sheet is None else f'{sheet / 1e12:.0f} TFLOP/s'}",
          flush=True)
  return _LIMITS[dtype]


def main(argv):
  del argv
  _apply_preset(flags.FLAGS)
  prepared = study_configs(_STUDY.value) if _STUDY.value else {}
  names = list(prepared) or list(_CONFIGS.value)
  # Every config is built first: an unknown name or field is one line before anything compiles.
  prepared = {n: prepared.get(n) or named_config(n) for n in names}
  import jax
  print(f"backend {jax.default_backend()} x{jax.device_count()}, "
        f"{os.cpu_count()} CPU cores, batch_tokens {_BATCH_TOKENS.value}", flush=True)
  if _DECODE_ONLY.value:
    _decode_only(names, prepared)
    return
  if _DOCUMENT_MASK.value:
    rows = [bench_document_mask(n, int(L), prepared.get(n)) for L in _SEQ_LENS.value
            for n in names]
    _print_document_mask(rows)
    _write_json(rows)
    return
  out = []
  for L in (int(s) for s in _SEQ_LENS.value):
    best = {}
    for rep in range(_REPEATS.value):
      for name in names:
        if rep and "skipped" in best.get(name, {}):
          continue
        decode = rep == 0 and L == int(_SEQ_LENS.value[0])   # decode rows do not depend on L
        best[name] = _merge(best.get(name), bench_one(name, L, decode=decode,
                                                      config=prepared.get(name)))
    _print_table(L, best, names)
    out += [best[n] for n in names]
  _write_json(out)


def _write_json(rows) -> None:
  import json
  if not _JSON.value:
    return
  with open(_JSON.value, "w") as f:
    json.dump({"flags": {k: flags.FLAGS[k].value for k in (
        "configs", "seq_lens", "batch_tokens", "d_model", "n_heads", "n_layers",
        "vocab_size", "dtype", "steps", "repeats", "preset", "study", "document_mask",
        "document_len")}, "rows": rows, "limits": _LIMITS}, f, indent=1)
  print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  cli.run(main)
