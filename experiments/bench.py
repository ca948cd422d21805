"""Train-step throughput of several configs side by side (tokens/s, ratio, analytic FLOPs).

  python experiments/bench.py --configs=transformer_152m,sisa_152m --seq_lens=1024,4096
  python experiments/bench.py --scale=tiny --dtype=float32 --seq_lens=1024,4096 \
      --configs=transformer_152m,sisa_152m,sisa_152m@fast,sisa_152m@chunked   # a 2-core CPU

Each config is timed with the jitted train step (forward + backward + clipped AdamW update):
`attn_jax.train.trainer.build_setup` when that module is present (the real trainer step, with
the mixer's optimizer overrides), else a minimal local step (optax AdamW, same loss). The
first config is the baseline of the ratios. Reported: best wall time of the timed steps
(tok/s, ratio) and the median process CPU time per step (cpu s, cpu ratio) — on a shared
machine the CPU time is the steadier comparison.

Analytic training FLOPs per token (stated convention): 6 N_nonembedding + 6 d V (the LM head
matmul, also when tied) + 3 x n_layers x mixer.flops_per_token(seq_len) (attention: only the
causal lower triangle, (L+1)/2 keys per query; backward = 2 x forward), as computed by
`attn_jax.train.flops.train_flops_per_token` for the trainer's logs. MFU = tok/s x that /
(dense bf16 peak x devices), from `flops.PEAK_FLOPS` by device kind; n/a where the peak is
unknown (CPU).

--scale=tiny keeps the architecture family at CPU size: d_model 256, 4 heads (d_h 64, as at
152M), 4 layers, vocab 4096, Transformer d_ff 4 d; SISA's d_ff is recomputed with
`matched_d_ff` so both models have the same parameter count. Explicit --d_model, --n_heads,
--n_layers, --vocab_size, --d_ff (Transformer width; SISA matched) override it.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

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


def _local_setup(config):
  """Minimal stand-in for trainer.build_setup: plain AdamW, same loss and batch layout."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from attn_jax.config import validate
  from attn_jax.model import build_model, count_params

  cfg = validate(config)
  model = build_model(cfg, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95,
                                                               weight_decay=0.1))
  state = {"params": params, "rest": rest, "opt_state": tx.init(params)}

  def loss_fn(params, rest, batch):
    logits = nnx.merge(graphdef, params, rest)(batch["inputs"][0])
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, batch["targets"][0][..., None], axis=-1)[..., 0]
    return jnp.mean(logz - tgt)

  def step(state, batch):
    loss, g = jax.value_and_grad(loss_fn)(state["params"], state["rest"], batch)
    updates, opt = tx.update(g, state["opt_state"], state["params"])
    return dict(state, params=optax.apply_updates(state["params"], updates),
                opt_state=opt), {"loss": loss}

  return cfg, jax.jit(step, donate_argnums=(0,)), lambda: state, count_params(cfg), "local"


def _setup(config):
  try:
    from attn_jax.train.trainer import build_setup
  except ImportError:
    return _local_setup(config)
  s = build_setup(config)
  return s.cfg, s.step_fn, s.init_fn, s.n_params, "trainer.build_setup"


def bench_one(name: str, seq_len: int):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from attn_jax.train import flops as flops_lib

  module, _, path = name.partition("@")     # "sisa_152m@chunked": force the SISA path
  config = importlib.import_module(f"configs.{module}").get_config()
  _model_overrides(module, config.model)
  if path:
    config.model.sisa.path = path
  B = max(1, _BATCH_TOKENS.value // seq_len)
  config.data.seq_len = seq_len
  config.model.max_seq_len = max(config.model.max_seq_len, seq_len)
  config.data.global_batch_size = B
  config.train.grad_accum = 1
  config.train.steps = 1000
  cfg, step_fn, init_fn, n_params, kind = _setup(config)
  state = init_fn()
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.vocab_size, size=(1, B, seq_len + 1), dtype=np.int32)
  batch = {"inputs": jnp.asarray(toks[..., :-1]), "targets": jnp.asarray(toks[..., 1:]),
           "weights": jnp.ones((1, B, seq_len), jnp.float32)}
  t0 = time.perf_counter()
  for _ in range(_WARMUP.value):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(state)
  compile_s = time.perf_counter() - t0
  times, cpu = [], []
  for _ in range(_STEPS.value):
    t, c = time.perf_counter(), time.process_time()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  flops = flops_lib.train_flops_per_token(cfg, n_params, seq_len)
  peak = flops_lib.peak_flops_per_device()
  tok_s = B * seq_len / min(times)
  mfu = tok_s * flops / (peak * jax.device_count()) if peak else None
  aux = metrics.get("aux", {}) if isinstance(metrics, dict) else {}
  extra = {k: float(np.max(np.asarray(v))) for k, v in aux.items()} if aux else {}
  return {"config": name, "seq_len": seq_len, "batch": B, "step_s": min(times),
          "cpu_s": float(np.median(cpu)), "tok_s": tok_s, "mfu": mfu,
          "params": n_params["total"], "flops_tok": flops, "compile_s": compile_s,
          "kind": kind, "d_ff": cfg.d_ff, "aux": extra}


def main(argv):
  del argv
  import jax
  print(f"backend {jax.default_backend()} x{jax.device_count()}, "
        f"{os.cpu_count()} CPU cores, batch_tokens {_BATCH_TOKENS.value}", flush=True)
  for L in (int(s) for s in _SEQ_LENS.value):
    best = {}
    for _ in range(_REPEATS.value):
      for name in _CONFIGS.value:
        r = bench_one(name, L)
        if name in best:  # best wall time; CPU time: the lowest per-repeat median
          r["cpu_s"] = min(r["cpu_s"], best[name]["cpu_s"])
          if r["step_s"] > best[name]["step_s"]:
            r = dict(best[name], cpu_s=r["cpu_s"])
        best[name] = r
    base = best[_CONFIGS.value[0]]
    print(f"\nseq_len {L} (batch {base['batch']}, step: {base['kind']})")
    print(f"{'config':<22}{'params':>12}{'d_ff':>6}{'step s':>9}{'tok/s':>10}{'ratio':>7}"
          f"{'cpu s':>8}{'cpu ratio':>10}{'GFLOP/tok':>11}{'FLOPs ratio':>12}{'MFU':>7}{'compile s':>10}"
          f"  aux (max over layers)")
    for name in _CONFIGS.value:
      r = best[name]
      aux = ", ".join(f"{k}={v:.3g}" for k, v in r["aux"].items())
      mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"  # n/a: peak unknown (CPU)
      print(f"{name:<22}{r['params']:>12,}{r['d_ff']:>6}{r['step_s']:>9.3f}{r['tok_s']:>10.0f}"
            f"{r['tok_s'] / base['tok_s']:>7.3f}{r['cpu_s']:>8.2f}"
            f"{base['cpu_s'] / r['cpu_s']:>10.3f}{r['flops_tok'] / 1e9:>11.3f}"
            f"{r['flops_tok'] / base['flops_tok']:>12.3f}"
            f"{mfu:>7}"
            f"{r['compile_s']:>10.1f}  {aux}",
            flush=True)


if __name__ == "__main__":
  app.run(main)
