"""attn_jax's Mamba-2 beside a minimal plain-JAX Mamba-2 on identical MQAR batches.

  python experiments/mamba2_parity.py --seeds=0,1,2,3,4 --steps=3000 --out=/tmp/parity.json
  python experiments/mamba2_parity.py --models=ours,minimal:ours,minimal:torch/embed=normal02 \
      --steps=1000 --out=/tmp/ablate.json

The minimal model is written from the Mamba-2 paper (Dao & Gu 2024, section 7.1, the
"parallel Mamba block", Fig. 6), not from attn_jax's mixer: one fused in-projection
[z, x, B, C, dt] = u W_in, one depthwise causal conv (with bias) over the concatenated
[x, B, C] channels followed by SiLU, dt = softplus(dt_raw + dt_bias), A = -exp(A_log) per head,
and the selective scan run token by token (`jax.lax.scan` over time):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T     (h [H, P, N])
    y_t = h_t C_t + D x_t;   out_t = W_out RMSNorm(y_t * SiLU(z_t))

inside the same pre-norm language model as attn_jax's decoder (embedding, x + mixer(norm(x)),
x + SwiGLU(norm(x)), final norm, tied head). Both models are therefore the same function of
their parameters; `to_minimal` maps attn_jax's parameters onto the minimal layout, and the test
checks that the two agree in logits and gradients. What can differ is what the optimizer is
given: the initial parameters (an init "recipe", per component below) and which parameters
are decayed. Both are trained by `optim.optimizer_from_groups`, the trainer's optax chain
(clip, AdamW b2 0.95, warmup + cosine), on batch i = examples [iB, (i+1)B) of the MQAR train
stream (the trainer's order), and scored on the trainer's held-out MQAR batches
(`pipeline.make_eval_batches`, 4 x 128 examples).

Init recipe components (`RECIPES`; "minimal:<recipe>/component=choice+..." changes some):
  embed    normal02 N(0, 0.02) | normal1 N(0, 1) (PyTorch's nn.Embedding default)
  in_proj  fan_in U(+-1/sqrt(d)) (nn.Linear default) | normal02
  out_proj fan_in | fan_in_res (fan_in / sqrt(2 L), mamba_ssm's rescale) | normal02 |
           normal02_res (N(0, 0.02 / sqrt(2 L)), the Transformer's)
  mlp      the SwiGLU's up/gate and down projections: same four choices (the _res
           rescale acts on the down projection only)
  conv     fan_in U(+-1/sqrt(d_conv)) kernel and bias (nn.Conv1d default) | normal02 (bias 0)
  dt_bias  mamba (softplus^-1 of log-uniform [1e-3, 1e-1]) | const (softplus^-1(0.01))
  a_log    mamba (log U[1, 16]) | one (A = -1)
and what the optimizer does with them:
  embed_lr the token table's lr multiplier: 1 | 0.02
  decay    weights (matrices, conv kernels, embedding; not biases, norms, A_log, D, dt_bias) |
           no_embed (as weights, embedding not decayed) | matrices (conv kernel not decayed)

"minimal:ours" starts from attn_jax's initial parameters themselves (mapped), so beside "ours"
it isolates the chunked SSD and its backward from everything else (same seed, same start).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from attn_jax.data import pipeline  # noqa: E402
from attn_jax.eval import mqar  # noqa: E402
from attn_jax.model import build_model  # noqa: E402
from attn_jax.train import optim  # noqa: E402
from attn_jax.train.loss import cross_entropy  # noqa: E402

f32 = jnp.float32

# The minimal model's single-layer setting (docs/mamba_parity.md): 4 heads of 16 (expand 1),
# d_state 24, d_ff 192.
SETTING = {"d_model": 64, "expand": 1.0, "head_dim": 16, "d_state": 24, "d_ff": 192,
           "n_layers": 1, "lr": 3e-3}

RECIPES = {
    # attn_jax today: mamba_ssm's mixer init inside the Transformer trunk's N(0, 0.02)
    "ours": {"embed": "normal02", "in_proj": "fan_in", "out_proj": "fan_in_res",
             "mlp": "normal02_res", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
             "decay": "weights", "embed_lr": "1"},
    # every module at its PyTorch default (no _init_weights pass)
    "torch": {"embed": "normal1", "in_proj": "fan_in", "out_proj": "fan_in", "mlp": "fan_in",
              "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba", "decay": "weights",
              "embed_lr": "1"},
    # mamba_ssm's language model (models/mixer_seq_simple.py _init_weights, GatedMLP)
    "mamba_lm": {"embed": "normal02", "in_proj": "fan_in", "out_proj": "fan_in_res",
                 "mlp": "fan_in_res", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
                 "decay": "weights", "embed_lr": "1"},
    # N(0, 0.02) on every matrix and the embedding
    "normal": {"embed": "normal02", "in_proj": "normal02", "out_proj": "normal02",
               "mlp": "normal02", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
               "decay": "weights", "embed_lr": "1"},
}
CHOICES = {"embed": ("normal02", "normal1"),
           "in_proj": ("fan_in", "normal02"),
           "out_proj": ("fan_in", "fan_in_res", "normal02", "normal02_res"),
           "mlp": ("fan_in", "fan_in_res", "normal02", "normal02_res"),
           "conv": ("fan_in", "normal02"),
           "dt_bias": ("mamba", "const"),
           "a_log": ("mamba", "one"),
           "decay": ("weights", "no_embed", "matrices"),
           "embed_lr": ("1", "0.02")}


# ----------------------------------------------------------------------- configuration

def study_config(seed: int, steps: int, *, batch: int = 128, lr: float | None = None,
                 setting: dict | None = None) -> ml_collections.ConfigDict:
  """configs/study_tiny.py's task, trunk and optimizer with one Mamba-2 block of `SETTING`."""
  from configs import study_tiny
  s = dict(SETTING, **(setting or {}))
  c = study_tiny.get_config()
  c.seed = int(seed)
  c.model.update(pattern=("mamba2",), n_layers=int(s["n_layers"]), d_model=int(s["d_model"]),
                 d_ff=int(s["d_ff"]))
  c.model.mamba2.update(expand=float(s["expand"]), head_dim=int(s["head_dim"]),
                        d_state=int(s["d_state"]), chunk_size=32)
  c.train.steps = int(steps)
  c.data.global_batch_size = int(batch)
  c.optim.lr = float(s["lr"] if lr is None else lr)
  return c


def dims_of(c: ml_collections.ConfigDict) -> dict:
  m, o = c.model, c.model.mamba2
  d_inner = int(round(o.expand * m.d_model))
  return {"V": int(m.vocab_size), "D": int(m.d_model), "E": d_inner, "H": d_inner // o.head_dim,
          "P": int(o.head_dim), "N": int(o.d_state), "G": int(o.n_groups), "K": int(o.d_conv),
          "F": int(m.d_ff), "L": int(m.n_layers), "eps": float(m.norm_eps)}


# ----------------------------------------------------------------------- data

def train_batches(c: ml_collections.ConfigDict, steps: int) -> dict[str, np.ndarray]:
  """[steps, B, T] arrays: the trainer's first `steps` batches (`pipeline.make_train_dataset`;
  batch i holds train examples [iB, (i+1)B))."""
  ds = pipeline.make_train_dataset(c.data, seed=int(c.seed))
  bs = [ds[i] for i in range(steps)]
  return {k: np.stack([np.asarray(b[k]) for b in bs]) for k in ("inputs", "targets", "weights")}


def eval_batches(c: ml_collections.ConfigDict) -> list[dict]:
  """The trainer's held-out MQAR batches (`eval.run.task_callback`: 4 x 128 examples)."""
  return pipeline.make_eval_batches(c.data, seed=int(c.seed), num_batches=4, batch_size=128)


# ----------------------------------------------------------------------- the minimal model

def _normal(key, shape, std):
  return std * jax.random.normal(key, shape, f32)


def _uniform(key, shape, bound):
  return jax.random.uniform(key, shape, f32, -bound, bound)


def _matrix(key, fan_in, fan_out, choice, n_layers):
  res = 1.0 / math.sqrt(2 * n_layers) if choice.endswith("_res") else 1.0
  if choice.startswith("fan_in"):
    return _uniform(key, (fan_in, fan_out), res / math.sqrt(fan_in))
  return _normal(key, (fan_in, fan_out), 0.02 * res)


def _softplus_inv(x):
  return x + jnp.log(-jnp.expm1(-x))


def init_minimal(key: jax.Array, dims: dict, recipe: dict) -> dict:
  """Parameters of the minimal model (plain dict) under an init recipe (`RECIPES`)."""
  V, D, E, H, N, G, K, F, L = (dims[k] for k in "VDEHNGKFL")
  C = E + 2 * G * N                                  # conv channels [x, B, C]
  keys = iter(jax.random.split(key, 4 + 8 * L))
  emb_std = 1.0 if recipe["embed"] == "normal1" else 0.02
  params = {"embed": _normal(next(keys), (V, D), emb_std), "final_norm": jnp.ones((D,), f32),
            "layers": []}
  mlp_in = recipe["mlp"].replace("_res", "")
  for _ in range(L):
    k = next(keys)
    if recipe["conv"] == "fan_in":
      kw, kb = jax.random.split(k)
      conv_w, conv_b = _uniform(kw, (K, C), 1 / math.sqrt(K)), _uniform(kb, (C,), 1 / math.sqrt(K))
    else:
      conv_w, conv_b = _normal(k, (K, C), 0.02), jnp.zeros((C,), f32)
    if recipe["dt_bias"] == "mamba":
      u = jax.random.uniform(next(keys), (H,), f32)
      dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)), 1e-4)
    else:
      dt = jnp.full((H,), 0.01, f32)
    a_log = (jnp.log(jax.random.uniform(next(keys), (H,), f32, 1.0, 16.0))
             if recipe["a_log"] == "mamba" else jnp.zeros((H,), f32))
    params["layers"].append({
        "norm1": jnp.ones((D,), f32),
        "w_in": _matrix(next(keys), D, 2 * E + 2 * G * N + H, recipe["in_proj"], L),
        "conv_w": conv_w, "conv_b": conv_b, "dt_bias": _softplus_inv(dt), "a_log": a_log,
        "d_skip": jnp.ones((H,), f32), "gnorm": jnp.ones((E,), f32),
        "w_out": _matrix(next(keys), E, D, recipe["out_proj"], L),
        "norm2": jnp.ones((D,), f32),
        "w_gate": _matrix(next(keys), D, F, mlp_in, L),
        "w_up": _matrix(next(keys), D, F, mlp_in, L),
        "w_down": _matrix(next(keys), F, D, recipe["mlp"], L)})
  return params


def minimal_decay_mask(params: dict, decay: str) -> dict:
  """True where AdamW decays (`CHOICES["decay"]`)."""
  decayed = {"w_in", "w_out", "w_gate", "w_up", "w_down"} | ({"conv_w"} if decay != "matrices"
                                                             else set())
  layer = lambda lp: {k: k in decayed for k in lp}
  return {"embed": decay != "no_embed", "final_norm": False,
          "layers": [layer(lp) for lp in params["layers"]]}


def _rms(x, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def selective_scan(x_BTHP, dt_BTH, a_H, b_BTGN, c_BTGN):
  """y_t = h_t C_t, h_t = exp(dt_t a) h_{t-1} + dt_t x_t B_t^T, one token at a time."""
  Bsz, _, H, P = x_BTHP.shape
  G, N = b_BTGN.shape[2:]
  rep = H // G

  def step(h_BHPN, inp):
    x, dt, b, c = inp
    b_BHN, c_BHN = jnp.repeat(b, rep, axis=1), jnp.repeat(c, rep, axis=1)
    h_BHPN = (jnp.exp(dt * a_H)[:, :, None, None] * h_BHPN
              + (dt[:, :, None] * x)[..., None] * b_BHN[:, :, None, :])
    return h_BHPN, jnp.einsum("bhpn,bhn->bhp", h_BHPN, c_BHN)

  seq = tuple(jnp.moveaxis(z, 1, 0) for z in (x_BTHP, dt_BTH, b_BTGN, c_BTGN))
  _, y_TBHP = jax.lax.scan(step, jnp.zeros((Bsz, H, P, N), f32), seq)
  return jnp.moveaxis(y_TBHP, 0, 1)


def minimal_mixer(lp: dict, u_BTD, dims: dict):
  E, H, P, N, G, K, eps = (dims[k] for k in ("E", "H", "P", "N", "G", "K", "eps"))
  Bsz, T, _ = u_BTD.shape
  zxbcdt = u_BTD @ lp["w_in"]
  z, xbc, dt_raw = jnp.split(zxbcdt, [E, 2 * E + 2 * G * N], axis=-1)
  xbc_pad = jnp.pad(xbc, ((0, 0), (K - 1, 0), (0, 0)))
  xbc = jax.nn.silu(lp["conv_b"] + sum(lp["conv_w"][k] * xbc_pad[:, k:k + T] for k in range(K)))
  x, b, c = jnp.split(xbc, [E, E + G * N], axis=-1)
  x_BTHP = x.reshape(Bsz, T, H, P)
  dt_BTH = jax.nn.softplus(dt_raw + lp["dt_bias"])
  y = selective_scan(x_BTHP, dt_BTH, -jnp.exp(lp["a_log"]), b.reshape(Bsz, T, G, N),
                     c.reshape(Bsz, T, G, N))
  y = y + lp["d_skip"][:, None] * x_BTHP
  y = y.reshape(Bsz, T, E) * jax.nn.silu(z)
  y = _rms(y.reshape(Bsz, T, G, E // G), eps).reshape(Bsz, T, E) * lp["gnorm"]
  return y @ lp["w_out"]


def minimal_logits(params: dict, tokens_BT, dims: dict):
  eps = dims["eps"]
  x = params["embed"][tokens_BT]
  for lp in params["layers"]:
    x = x + minimal_mixer(lp, _rms(x, eps) * lp["norm1"], dims)
    u = _rms(x, eps) * lp["norm2"]
    x = x + (jax.nn.silu(u @ lp["w_gate"]) * (u @ lp["w_up"])) @ lp["w_down"]
  return (_rms(x, eps) * params["final_norm"]) @ params["embed"].T


def to_minimal(ours: dict, dims: dict) -> dict:
  """attn_jax's pure-dict parameters (`nnx.to_pure_dict`) in the minimal layout."""
  V, D, E, H, N, G, L = (dims[k] for k in "VDEHNGL")
  out = {"embed": ours["embed"][:V], "final_norm": ours["final_norm"]["scale"], "layers": []}
  for r in range(L):
    blk = jax.tree.map(lambda a: a[r], ours["blocks"]["layers"][0])
    m = blk["mixer"]
    flat = lambda a: a.reshape(a.shape[0], -1)
    w_in = jnp.concatenate([flat(m[n]["kernel"]) for n in ("in_z", "in_x", "in_b", "in_c",
                                                           "in_dt")], axis=1)
    conv_w = jnp.concatenate([m[n]["kernel"].reshape(m[n]["kernel"].shape[0], -1)
                              for n in ("conv_x", "conv_b", "conv_c")], axis=1)
    conv_b = jnp.concatenate([m[n]["bias"].reshape(-1) for n in ("conv_x", "conv_b", "conv_c")])
    out["layers"].append({
        "norm1": blk["mixer_norm"]["scale"], "w_in": w_in, "conv_w": conv_w, "conv_b": conv_b,
        "dt_bias": m["dt_bias"], "a_log": m["A_log"], "d_skip": m["D"],
        "gnorm": m["norm_scale"].reshape(-1), "w_out": m["out"]["kernel"].reshape(E, D),
        "norm2": blk["mlp_norm"]["scale"], "w_gate": blk["mlp"]["gate"]["kernel"],
        "w_up": blk["mlp"]["up"]["kernel"], "w_down": blk["mlp"]["down"]["kernel"]})
  return out


# ----------------------------------------------------------------------- the two models

def build_ours(c: ml_collections.ConfigDict, changes: dict | None = None):
  """-> (logits_fn(params, tokens), pure-dict params, decay mask, lr multipliers).
  `changes` {"embed": "normal1"}: the token table redrawn N(0, 1) (the trunk's table is
  N(0, init_std)); every other parameter as attn_jax draws it."""
  model = build_model(c.model, seed=int(c.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  decay, mult = optim.param_groups(params)
  rest = nnx.to_pure_dict(rest)
  V = int(c.model.vocab_size)
  params = nnx.to_pure_dict(params)
  if (changes or {}).get("embed", "normal02") == "normal1":
    key = jax.random.fold_in(jax.random.key(int(c.seed)), 1)
    params["embed"] = jax.random.normal(key, params["embed"].shape, f32)

  def logits_fn(p, tokens_BT):
    return nnx.merge(graphdef, p, rest)(tokens_BT)[..., :V]
  return logits_fn, params, decay, mult


def build_minimal(c: ml_collections.ConfigDict, recipe: dict | str):
  """As `build_ours`; recipe "ours" maps attn_jax's initial parameters (same seed)."""
  dims = dims_of(c)
  if recipe == "ours":
    _, ours_params, _, _ = build_ours(c)
    params, recipe = to_minimal(ours_params, dims), RECIPES["ours"]
  else:
    params = init_minimal(jax.random.key(int(c.seed)), dims, recipe)
  mult = jax.tree.map(lambda _: 1.0, params)
  mult["embed"] = float(recipe["embed_lr"])
  return (lambda p, t: minimal_logits(p, t, dims)), params, \
      minimal_decay_mask(params, recipe["decay"]), mult


def resolve(spec: str) -> dict | str | None:
  """"ours[/embed=normal1]" -> ("ours", changes); "minimal:<recipe>[/component=choice[+...]]"
  -> the recipe (plain "minimal:ours": attn_jax's own initial parameters, mapped; with changes,
  the "ours" recipe drawn by the minimal model's initialisers)."""
  if spec.partition("/")[0] == "ours":
    changes = dict(kv.partition("=")[::2] for kv in filter(None, spec.partition("/")[2]
                                                            .split("+")))
    if set(changes.items()) - {("embed", "normal1"), ("embed", "normal02")}:
      raise ValueError(f"--models: {spec!r}: attn_jax's model takes only embed=normal1")
    return ("ours", changes)
  kind, _, rest = spec.partition(":")
  name, _, changes = rest.partition("/")
  if kind != "minimal" or name not in RECIPES:
    raise ValueError(f"--models: {spec!r}: want 'ours' or 'minimal:<{'|'.join(RECIPES)}>"
                     "[/component=choice+...]'")
  if name == "ours" and not changes:
    return "ours"
  recipe = dict(RECIPES[name])
  for kv in filter(None, changes.split("+")):
    comp, _, choice = kv.partition("=")
    if comp not in CHOICES or choice not in CHOICES[comp]:
      raise ValueError(f"--models: {spec!r}: {kv!r}: components and choices are {CHOICES}")
    recipe[comp] = choice
  return recipe


# ----------------------------------------------------------------------- training

class _Scorer:
  """`logits_fn(params, tokens)` as the evaluators' scorer (`harness.scorer_fns`): the
  parameters are its `state`, so every evaluation of a run reuses one compilation."""

  def __init__(self, logits_fn):
    self.logits_apply, self.state = logits_fn, ()


def recall(scorer: _Scorer, params, batches) -> float:
  """The trainer's MQAR accuracy (`eval.mqar.mqar_accuracy`) of `params` on `batches`."""
  scorer.state = params
  return mqar.mqar_accuracy(scorer, batches, batch_size=len(batches[0]["inputs"]))["acc"]


def mean_nll(logits_fn):
  """loss(params, batch): the weighted mean token NLL (`loss.cross_entropy`)."""
  def loss_fn(p, b):
    nll, w, _ = cross_entropy(logits_fn(p, b["inputs"]), b["targets"], b["weights"])
    return nll / w
  return loss_fn


def train(c, logits_fn, params, decay, mult, batches, evals, *, every: int):
  """The optax chain of the trainer over `batches`; -> (final params, curve rows)."""
  tx, _ = optim.optimizer_from_groups(c, decay, mult)
  scorer = _Scorer(logits_fn)
  loss_fn = mean_nll(logits_fn)

  def one(carry, b):
    p, s = carry
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    upd, s = tx.update(g, s, p)
    return (optax.apply_updates(p, upd), s), loss

  run = jax.jit(lambda p, s, bs: jax.lax.scan(one, (p, s), bs))
  opt_state, rows = tx.init(params), []
  steps = batches["inputs"].shape[0]
  for start in range(0, steps, every):
    chunk = {k: jnp.asarray(v[start:start + every]) for k, v in batches.items()}
    (params, opt_state), losses = run(params, opt_state, chunk)
    rows.append({"step": start + len(losses), "train_loss": float(np.mean(losses[-10:])),
                 "recall": recall(scorer, params, evals)})
  return params, rows


def run_one(spec_label, recipe, seed, steps, batches, every, batch_size=128, lr=None,
            schedule_steps=None):
  """`schedule_steps` (default `steps`): the lr schedule's horizon, so that a shorter run is
  the first `steps` of a longer one."""
  c = study_config(seed, schedule_steps or steps, batch=batch_size, lr=lr)
  build = (build_ours(c, recipe[1]) if isinstance(recipe, tuple)
           else build_minimal(c, recipe))
  logits_fn, params, decay, mult = build
  t0 = time.perf_counter()
  _, rows = train(c, logits_fn, params, decay, mult, batches, eval_batches(c), every=every)
  n = sum(int(np.size(a)) for a in jax.tree.leaves(params))
  return {"model": spec_label, "seed": seed, "params": n, "curve": rows,
          "final_recall": rows[-1]["recall"], "wall_s": time.perf_counter() - t0}


def main(argv):
  del argv
  from absl import flags
  F = flags.FLAGS
  if F.compile_cache:   # the train / eval programs compile once across runs and invocations
    jax.config.update("jax_compilation_cache_dir", F.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  seeds = [int(s) for s in F.seeds]
  models = [(m, resolve(m)) for m in F.models]
  cache = {}
  results = []
  if os.path.exists(F.out):
    with open(F.out) as f:
      results = json.load(f)["runs"]
  done = {(r["model"], r["seed"], len(r["curve"]) and r["curve"][-1]["step"]) for r in results}
  for seed in seeds:
    for label, recipe in models:
      if (label, seed, F.steps) in done:
        continue
      if seed not in cache:
        cache = {seed: train_batches(study_config(seed, F.steps, batch=F.batch), F.steps)}
      r = run_one(label, recipe, seed, F.steps, cache[seed], F.every, F.batch, F.lr,
                  F.schedule_steps)
      results.append(r)
      curve = " ".join(f"{row['recall']:.3f}" for row in r["curve"])
      print(f"{label:44s} seed {seed}  params {r['params']:,}  recall by {F.every} steps: "
            f"{curve}  ({r['wall_s']:.0f} s)", flush=True)
      with open(F.out + ".tmp", "w") as f:
        json.dump({"runs": results, "setting": SETTING, "steps": F.steps, "batch": F.batch,
                   "schedule_steps": F.schedule_steps or F.steps}, f, indent=1)
      os.replace(F.out + ".tmp", F.out)
  print_summary(results, F.steps)


def print_summary(results, steps):
  by = {}
  for r in results:
    if r["curve"] and r["curve"][-1]["step"] == steps:
      by.setdefault(r["model"], []).append(r)
  print(f"\nheld-out recall at step {steps} (median [min, max] over seeds)")
  for label, rs in by.items():
    v = np.array([r["final_recall"] for r in sorted(rs, key=lambda r: r["seed"])])
    print(f"  {label:44s} {100 * np.median(v):5.1f}%  [{100 * v.min():5.1f}, "
          f"{100 * v.max():5.1f}]  n={len(v)}  ({', '.join(f'{100 * x:.1f}' for x in v)})")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_list("seeds", ["0", "1"], "Seeds (model init and data stream).")
  flags.DEFINE_list("models", ["ours", "minimal:torch"],
                    "'ours' and/or 'minimal:<recipe>' (recipes: " + ", ".join(RECIPES) + ").")
  flags.DEFINE_integer("steps", 3000, "Training steps.")
  flags.DEFINE_integer("schedule_steps", None, "The lr schedule's horizon (default --steps): "
                       "a shorter run that is the start of a longer one.")
  flags.DEFINE_integer("every", 250, "Held-out recall every this many steps.")
  flags.DEFINE_integer("batch", 128, "Batch size.")
  flags.DEFINE_float("lr", None, "Peak lr (default: the setting's 3e-3).")
  flags.DEFINE_string("compile_cache", "", "JAX persistent compilation cache directory.")
  flags.DEFINE_string("out", "mamba2_parity.json", "JSON results (appended to; runs done are "
                      "skipped).")
  app.run(main)
