"""attn_jax's Mamba-2 trained beside the minimal plain-JAX Mamba-2 (attn_jax.study.mamba2_minimal)
on identical MQAR batches (entry point: experiments/mamba2_parity.py; docs/mamba_parity.md).

Both are trained by `optim.optimizer_from_groups`, the trainer's optax chain (clip, AdamW b2 0.95,
warmup + cosine), on batch i = examples [iB, (i+1)B) of the MQAR train stream (the trainer's
order), and scored on the trainer's held-out MQAR batches (`pipeline.make_eval_batches`, 4 x 128
examples), in configs/study_tiny.py's task and trunk with one Mamba-2 block of `SETTING`.

Models (`resolve`): "ours[/embed=normal1]" is attn_jax's model; "minimal:<recipe>[/component=
choice+...]" the minimal model under an init recipe (`mamba2_minimal.RECIPES`, changed per
component). "minimal:ours" starts from attn_jax's initial parameters themselves (mapped), so
beside "ours" it isolates the chunked SSD and its backward from everything else (same seed,
same start).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from attn_jax import jsonio
from attn_jax.config import RunConfig
from attn_jax.data import pipeline
from attn_jax.eval import mqar
from attn_jax.model import build_model
from attn_jax.study.mamba2_minimal import (CHOICES, RECIPES, dims_of, init_minimal,
                                         minimal_decay_mask, minimal_logits, to_minimal)
from attn_jax.train import optim
from attn_jax.train.loss import cross_entropy

f32 = jnp.float32

# The minimal model's single-layer setting (docs/mamba_parity.md): 4 heads of 16 (expand 1),
# d_state 24, d_ff 192.
SETTING = {"d_model": 64, "expand": 1.0, "head_dim": 16, "d_state": 24, "d_ff": 192,
           "n_layers": 1, "lr": 3e-3}


def study_config(base: ml_collections.ConfigDict, seed: int, steps: int, *, batch: int = 128,
                 lr: float | None = None, setting: dict | None = None) -> ml_collections.ConfigDict:
  """`base`'s task, trunk and optimizer (configs/study_tiny.py's, from the entry point) with
  one Mamba-2 block of `SETTING`."""
  s = dict(SETTING, **(setting or {}))
  c = base.copy_and_resolve_references()
  c.seed = int(seed)
  c.model.update(pattern=("mamba2",), n_layers=int(s["n_layers"]), d_model=int(s["d_model"]),
                 d_ff=int(s["d_ff"]))
  c.model.mamba2.update(expand=float(s["expand"]), head_dim=int(s["head_dim"]),
                        d_state=int(s["d_state"]), chunk_size=32)
  c.train.steps = int(steps)
  c.data.global_batch_size = int(batch)
  c.optim.lr = float(s["lr"] if lr is None else lr)
  return c


def train_batches(c: ml_collections.ConfigDict, steps: int) -> dict[str, np.ndarray]:
  """[steps, B, T] arrays: the trainer's first `steps` batches (`pipeline.make_train_dataset`;
  batch i holds train examples [iB, (i+1)B))."""
  ds = pipeline.make_train_dataset(c.data, seed=int(c.seed))
  bs = [ds[i] for i in range(steps)]
  return {k: np.stack([np.asarray(b[k]) for b in bs]) for k in ("inputs", "targets", "weights")}


def eval_batches(c: ml_collections.ConfigDict) -> list[dict]:
  """The trainer's held-out MQAR batches (`eval.run.task_callback`: 4 x 128 examples)."""
  return pipeline.make_eval_batches(c.data, seed=int(c.seed), num_batches=4, batch_size=128)


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


def train(c: RunConfig, logits_fn, params, decay, mult, batches, evals, *, every: int):
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


def run_one(base, spec_label, recipe, seed, steps, batches, every, batch_size=128, lr=None,
            schedule_steps=None):
  """`schedule_steps` (default `steps`): the lr schedule's horizon, so that a shorter run is
  the first `steps` of a longer one."""
  c = study_config(base, seed, schedule_steps or steps, batch=batch_size, lr=lr)
  build = (build_ours(c, recipe[1]) if isinstance(recipe, tuple)
           else build_minimal(c, recipe))
  logits_fn, params, decay, mult = build
  t0 = time.perf_counter()
  _, rows = train(RunConfig.from_config(c), logits_fn, params, decay, mult, batches,
                  eval_batches(c), every=every)
  n = sum(int(np.size(a)) for a in jax.tree.leaves(params))
  return {"model": spec_label, "seed": seed, "params": n, "curve": rows,
          "final_recall": rows[-1]["recall"], "wall_s": time.perf_counter() - t0}


def run(base, seeds, models, *, steps: int, out: str, every: int = 250, batch: int = 128,
        lr: float | None = None, schedule_steps: int | None = None) -> list[dict]:
  """Every (seed, model spec) run not already in the JSON file `out` (appended to after each
  run, so an interrupted invocation resumes); prints one line per run and the summary. `base`:
  the task's config (`study_config`)."""
  resolved = [(m, resolve(m)) for m in models]
  results = []
  if os.path.exists(out):
    results = jsonio.read(out)["runs"]
  done = {(r["model"], r["seed"], len(r["curve"]) and r["curve"][-1]["step"]) for r in results}
  cache = {}
  for seed in (int(s) for s in seeds):
    for label, recipe in resolved:
      if (label, seed, steps) in done:
        continue
      if seed not in cache:
        cache = {seed: train_batches(study_config(base, seed, steps, batch=batch), steps)}
      r = run_one(base, label, recipe, seed, steps, cache[seed], every, batch, lr,
                  schedule_steps)
      results.append(r)
      curve = " ".join(f"{row['recall']:.3f}" for row in r["curve"])
      print(f"{label:44s} seed {seed}  params {r['params']:,}  recall by {every} steps: "
            f"{curve}  ({r['wall_s']:.0f} s)", flush=True)
      jsonio.write({"runs": results, "setting": SETTING, "steps": steps, "batch": batch,
                    "schedule_steps": schedule_steps or steps}, out)
  print_summary(results, steps)
  return results


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
