"""The fine-tuning study (configs/study_finetune.py): what an attention variant buys a
*pretrained* model when it is added at step 0 without changing it and then fine-tuned.

For every variant of `config.study.variants` (name, convert --mixer, its inits, config
overrides, the setting in words):
  1. convert `study.src` into the variant (`pretrained.convert(mixer=...)`: the logits equal
     the plain import's; the measured distance is kept) -> <workdir>/converted/<name>/;
  2. fine-tune it (`train.init_from`) on the same tokens for the same steps at each lr of
     `study.lrs` (seed `study.seeds[0]`), keep the lr with the lowest held-out NLL
     (eval/loss) -> <workdir>/runs/<name>/lr<lr>/seed<k>/;
  3. the control and the best variant (lowest held-out NLL among the others) again at
     `study.seeds[1:]` (the seed changes the data order; the conversion is the same);
  4. score `study.stream_tokens` held-out tokens (the data's eval split, never trained on) as a
     stream under two caches of `study.stream_cache` tokens: window-only eviction
     (`window(cache)`: the first tokens leave) and StreamingLLM (`streaming(4+cache-4)`: 4
     first tokens kept); also the pretrained model itself (the converted control at step 0);
  5. results.json (per run: held-out NLL, stream NLLs, NLL past the cache, NLL by position,
     the new parameters' values before and after, wall time), tables.md and a plot.

Resumable: each stage writes its output last (a conversion: the run directory renamed into
place; a fine-tune: finetune_run.json after the trainer's final checkpoint; a stream score:
stream.json), so a rerun of the same command skips what is done and resumes a fine-tune from
its latest checkpoint. A finished fine-tune whose config has changed since (a field's value;
a field added to attn_jax/config.py since, at its default, is not a change) is an error naming
it and the fields. Entry point: experiments/finetune_study.py.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from attn_jax import jsonio, paths
from attn_jax.config import config_to_json
from attn_jax.pretrained.convert import convert
from attn_jax.pretrained.variants import VariantInit
from attn_jax.provenance import machine_info
from attn_jax.run_layout import RunLayout
from attn_jax.streaming import StreamPolicy, score_stream
from attn_jax.study.lm import heldout_stream
from attn_jax.study.matching import set_override
from attn_jax.study.report import copy_plots, marker_pair, page_links, splice
from attn_jax.study.runner import enable_compilation_cache, train_once
from attn_jax.train.checkpoint import load_for_inference
from attn_jax.train.init_from import finetune_config
from attn_jax.train.trainer import train_and_evaluate

RESULTS = "results.json"
RUN_DONE = "finetune_run.json"
STREAM_DONE = "stream.json"


def variant_specs(config) -> dict[str, dict]:
  """{name: {mixer, init, overrides, setting}} in the order of `study.variants`, the control
  (`study.control`) first."""
  out = {}
  for v in config.study.variants:
    if len(v) != 5:
      raise ValueError(f"config.study.variants: want (name, mixer, inits, overrides, setting), "
                       f"got {v!r}")
    name, mixer, init, overrides, setting = v
    if name in out:
      raise ValueError(f"config.study.variants: duplicate name {name!r}")
    out[name] = {"mixer": mixer, "init": dict(init), "overrides": tuple(map(tuple, overrides)),
                 "setting": setting}
  control = config.study.control
  if control not in out:
    raise ValueError(f"config.study.control: {control!r} is not one of {list(out)}")
  return {control: out[control], **{k: v for k, v in out.items() if k != control}}


# ------------------------------------------------------------------ stage 1: conversion

def converted_dir(workdir: str, name: str) -> str:
  return os.path.join(workdir, "converted", name)


def convert_variant(config, base_config, workdir: str, name: str, spec: dict, log) -> dict:
  """The converted run of `name` (made once, its training fields from `base_config`) and its
  record from pretrained.json."""
  path = converted_dir(workdir, name)
  if not RunLayout.of(path).pretrained_info.is_file():
    log(f"[finetune] {name}: converting {config.study.src} -> --mixer={spec['mixer']}")
    out = convert(str(config.study.src), workdir=path, base_config=base_config,
                  mixer=spec["mixer"], variant_init=VariantInit(**spec["init"]),
                  seed=int(config.study.convert_seed))
    log(f"[finetune] {name}: step-0 logits within {out['step0_rel_logit_diff']:.2e} relative "
        "of the plain import")
  return jsonio.read(paths.name(RunLayout.of(path).pretrained_info))["variant"]


# ------------------------------------------------------------------ stage 2/3: fine-tuning

def run_config(config, workdir: str, name: str, spec: dict, seed: int, lr: float):
  """The fine-tune's config: the study's data/train/optim/eval settings, the converted run's
  model and tokenizer (`init_from.finetune_config`), the variant's overrides, seed and lr."""
  c = finetune_config(converted_dir(workdir, name), config)
  for path, value in spec["overrides"]:
    set_override(c, path, value)
  c.seed, c.optim.lr = int(seed), float(lr)
  return c


def run_dir_of(workdir: str, name: str, lr: float, seed: int) -> str:
  return os.path.join(workdir, "runs", name, f"lr{lr:g}", f"seed{seed}")


def run_fields(config) -> dict:
  """What a fine-tune computes: its config as JSON without the study's own fields."""
  d = config_to_json(config)
  d.pop("study", None)
  return d


def finetune_one(c, run_dir: str, name: str, log) -> dict:
  """Train (or resume, or skip when done) one fine-tune; its record."""
  what = f"{name} lr {c.optim.lr:g} seed {c.seed}"

  def train():
    log(f"[finetune] {what}: {c.train.steps} steps of "
        f"{c.data.global_batch_size} x {c.data.seq_len} tokens")
    return train_and_evaluate(c, run_dir)

  def record(out, wall, cpu):
    rec = {"variant": name, "seed": int(c.seed), "lr": float(c.optim.lr),
           "steps": int(c.train.steps),
           "tokens": int(c.train.steps) * int(c.train.grad_accum) *
           int(c.data.global_batch_size) * int(c.data.seq_len),
           "heldout_nll": float(out["eval/loss"]), "final_train_loss": out.get("loss"),
           "wall_s": wall, "cpu_s": cpu, "workdir": os.path.abspath(run_dir)}
    log(f"[finetune] {what}: held-out NLL {rec['heldout_nll']:.4f} in {wall:.0f} s")
    return rec

  return train_once("[finetune]", what, os.path.join(run_dir, RUN_DONE), run_fields(c), log,
                    train, record)


# ------------------------------------------------------------------ stage 4: streams

def stream_policies(config):
  """window(cache), then streaming(k + cache - k) for every k > 0 of `study.stream_keep`
  (default: `study.stream_sinks` alone)."""
  s = config.study
  cache = int(s.stream_cache)
  keep = [int(k) for k in s.stream_keep] or [int(s.stream_sinks)]
  if any(not 0 <= k < cache for k in keep):
    raise ValueError(f"config.study.stream_keep: kept first tokens must be in [0, "
                     f"study.stream_cache={cache}), got {keep}")
  return [StreamPolicy("window", window=cache)] + [
      StreamPolicy("streaming", window=cache - k, sinks=k) for k in keep if k > 0]


def stream_one(config, run_dir: str, tokens: np.ndarray, log, label: str) -> dict:
  """NLL of `tokens` as a stream under each policy (stream.json in `run_dir`; skipped when
  there). A policy the model cannot run (a FoX with RoPE keeps no ring cache) is recorded
  with the reason."""
  path = os.path.join(run_dir, STREAM_DONE)
  if os.path.isfile(path):
    return jsonio.read(path)
  model, _, step = load_for_inference(run_dir)
  cache, bin_w = int(config.study.stream_cache), int(config.study.stream_bin)
  out = {"step": int(step), "tokens": int(len(tokens)), "policies": {}}
  for pol in stream_policies(config):
    t0 = time.perf_counter()
    try:
      losses = score_stream(model, tokens, pol, chunk=int(config.study.stream_chunk),
                            progress=False)
    except ValueError as e:
      out["policies"][pol.label] = {"refused": str(e)}
      log(f"[finetune] {label}: {pol.label}: not run: {e}")
      continue
    centres = list(range(0, len(losses), bin_w))
    out["policies"][pol.label] = {
        "nll": float(np.mean(losses)), "nll_past_cache": float(np.mean(losses[cache:])),
        "by_position": [float(np.mean(losses[a:a + bin_w])) for a in centres],
        "bin": bin_w, "wall_s": time.perf_counter() - t0}
    log(f"[finetune] {label}: {pol.label}: NLL {out['policies'][pol.label]['nll']:.4f} "
        f"({out['policies'][pol.label]['wall_s']:.0f} s)")
  jsonio.write(out, path)
  return out


def heldout_tokens(config) -> np.ndarray:
  """The first `study.stream_tokens` + 1 tokens of the data's eval split (never trained on)."""
  stream = heldout_stream(config)
  n = int(config.study.stream_tokens) + 1
  if len(stream) < n:
    raise ValueError(f"config.study.stream_tokens={n - 1}: the held-out split has only "
                     f"{len(stream)} tokens (raise config.data.eval_fraction)")
  return stream[:n]


def new_param_values(run_dir: str, new: list[str]) -> dict[str, dict]:
  """{path: {mean, absmax}} of the new parameters in `run_dir`'s latest checkpoint."""
  from flax import nnx

  model, _, _ = load_for_inference(run_dir)
  flat = jsonio.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)), "/")
  return {p: {"mean": float(np.mean(flat[p])), "absmax": float(np.abs(flat[p]).max())}
          for p in new if p in flat}


# ------------------------------------------------------------------ the study

def _best(recs: list[dict]) -> dict:
  return min(recs, key=lambda r: (not np.isfinite(r["heldout_nll"]), r["heldout_nll"]))


def run_study(config: ml_collections.ConfigDict, workdir: str, *,
              base_config: ml_collections.ConfigDict, command: str = "",
              log: Callable[[str], Any] = print) -> dict:
  """Every stage of the module docstring; results.json rewritten after each; returns it.
  `base_config`: the training config the converted runs start from (configs/base.py's, from
  the entry point)."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  enable_compilation_cache(workdir)
  s = config.study
  specs = variant_specs(config)
  seeds = [int(x) for x in s.seeds]
  lrs = [float(x) for x in s.lrs] or [float(config.optim.lr)]
  t0 = time.perf_counter()
  path = os.path.join(workdir, RESULTS)
  calls = earlier_invocations(path)
  machine = machine_info()
  calls.append({"started": _now(), "loadavg_start": os.getloadavg()[0],
                "commit": machine["commit"]})
  res: dict = {"meta": {"command": command, "started": calls[0]["started"],
                        "machine": machine, "invocations": calls,
                        "config": json.loads(json.dumps(config.to_dict(), default=str))},
               "variants": {}, "runs": [], "sweep": [], "streams": {}}

  def save(complete=False):
    calls[-1].update(finished=_now(), wall_s=time.perf_counter() - t0,
                     loadavg_end=os.getloadavg()[0])
    res["meta"].update(finished=_now(), complete=complete)
    jsonio.write(res, path)

  for name, spec in specs.items():
    rec = convert_variant(config, base_config, workdir, name, spec, log)
    res["variants"][name] = {"mixer": spec["mixer"], "init": spec["init"],
                             "overrides": [list(o) for o in spec["overrides"]],
                             "setting": spec["setting"], "new": rec["new"],
                             "expanded": rec["expanded"], "step0": rec["step0"]}
  save()
  tokens = None
  best_lr, first = {}, {}
  for name, spec in specs.items():   # the sweep on the first seed
    recs = [finetune_one(run_config(config, workdir, name, spec, seeds[0], lr),
                         run_dir_of(workdir, name, lr, seeds[0]), name, log) for lr in lrs]
    res["sweep"].extend(recs)
    first[name] = _best(recs)
    best_lr[name] = first[name]["lr"]
    res["variants"][name]["lr"] = best_lr[name]
    save()
  control = s.control
  others = [n for n in specs if n != control]
  best_variant = min(others, key=lambda n: first[n]["heldout_nll"]) if others else None
  res["meta"]["best_variant"] = best_variant
  runs = {(n, seeds[0]): first[n] for n in specs}
  for seed in seeds[1:]:
    for name in [control] + ([best_variant] if best_variant else []):
      runs[(name, seed)] = finetune_one(
          run_config(config, workdir, name, specs[name], seed, best_lr[name]),
          run_dir_of(workdir, name, best_lr[name], seed), name, log)
      save()
  res["runs"] = list(runs.values())
  save()
  tokens = heldout_tokens(run_config(config, workdir, control, specs[control], seeds[0],
                                     best_lr[control]))
  res["streams"]["pretrained"] = stream_one(config, converted_dir(workdir, control), tokens,
                                            log, "pretrained")
  save()
  for (name, seed), rec in runs.items():
    label = f"{name}/seed{seed}"
    res["streams"][label] = stream_one(config, rec["workdir"], tokens, log, label)
    new = list(res["variants"][name]["new"])
    rec["new_values"] = {"converted": new_param_values(converted_dir(workdir, name), new),
                         "finetuned": new_param_values(rec["workdir"], new)}
    save()
  save(complete=True)
  return res


def earlier_invocations(path: str) -> list[dict]:
  """The study command's earlier invocations ({started, finished, wall_s, loadavg_*}) from the
  results.json at `path`: a resumed study's wall time is their sum."""
  if not os.path.isfile(path):
    return []
  meta = jsonio.read(path).get("meta", {})
  if "invocations" in meta:
    return list(meta["invocations"])
  if "this_invocation_wall_s" in meta:   # written before invocations were kept: one call
    return [{"started": meta["started"], "finished": meta["finished"],
             "wall_s": meta["this_invocation_wall_s"]}]
  return []


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------ report

PLOT = "nll_by_position.png"


def finetunes(res: dict) -> list[dict]:
  """Every distinct fine-tune (variant, lr, seed) of the sweep and the seeds, in run order."""
  return list({(r["variant"], r["lr"], r["seed"]): r for r in res["sweep"] + res["runs"]}.values())


def _cell(vals) -> str:
  """Mean over seeds, spread = half the range; "n/a" without a finite value."""
  vals = [v for v in vals if v is not None and np.isfinite(v)]
  if not vals:
    return "n/a"
  m = float(np.mean(vals))
  return f"{m:.4f}" if len(vals) == 1 else f"{m:.4f} ± {(max(vals) - min(vals)) / 2:.4f}"


def policies(res: dict) -> list[str]:
  """The stream policies in the order scored (window-only first, then the sinks' cache)."""
  out: list[str] = []
  for st in res["streams"].values():
    out += [p for p in st["policies"] if p not in out]
  return out


def _past(res: dict, label: str, pol: str):
  p = res["streams"].get(label, {}).get("policies", {}).get(pol, {})
  return p.get("nll_past_cache")


def _kept(label: str) -> int:
  """First tokens a policy label keeps: streaming(k+w) -> k; window(...) -> 0."""
  return int(label[len("streaming("):].split("+")[0]) if label.startswith("streaming(") else 0


def _gap(res: dict, label: str, a_pol: str, b_pol: str):
  a, b = _past(res, label, a_pol), _past(res, label, b_pol)
  return None if a is None or b is None else a - b


def table(res: dict) -> str:
  """Per model (mean over its seeds, ± half the range): held-out NLL, each cache's stream NLL
  past the cache, and each cache's excess over the one keeping the most first tokens (per
  seed, then mean)."""
  pols = sorted(policies(res), key=_kept)   # window first, then by kept first tokens
  pairs = [(p, pols[-1]) for p in pols[:-1]]
  head = ("| model | lr | seeds | held-out NLL | " +
          " | ".join(f"{p} NLL past the cache" for p in pols) +
          "".join(f" | {a} - {b}" for a, b in pairs) + " |")
  lines = [head, "|" + "---|" * (4 + len(pols) + len(pairs))]

  def row(name, lr, labels, heldout):
    cells = [_cell([_past(res, lb, p) for lb in labels]) for p in pols]
    cells += [_cell([_gap(res, lb, a, b) for lb in labels]) for a, b in pairs]
    return f"| {name} | {lr} | {len(labels)} | {heldout} | " + " | ".join(cells) + " |"

  lines.append(row("pretrained (step 0)", "-", ["pretrained"], "-"))
  for name, v in res["variants"].items():
    recs = [r for r in res["runs"] if r["variant"] == name]
    if recs:
      lines.append(row(name, f"{v.get('lr', float('nan')):g}",
                       [f"{name}/seed{r['seed']}" for r in recs],
                       _cell([r["heldout_nll"] for r in recs])))
  return "\n".join(lines)


def sweep_table(res: dict) -> str:
  """Every fine-tune: variant, lr, seed, held-out NLL, last training loss, wall time."""
  lines = ["| variant | lr | seed | held-out NLL | last train loss | wall s |",
           "|---|---|---|---|---|---|"]
  for r in finetunes(res):
    loss = r.get("final_train_loss")
    lines.append(f"| {r['variant']} | {r['lr']:g} | {r['seed']} | {r['heldout_nll']:.4f} | "
                 f"{'n/a' if loss is None else f'{loss:.4f}'} | {r['wall_s']:.0f} |")
  return "\n".join(lines)


def new_params_table(res: dict) -> str:
  """The new parameters' mean (and max |.|) in the conversion and after fine-tuning, per run."""
  lines = ["| run | parameter | converted: mean (max abs) | fine-tuned: mean (max abs) |",
           "|---|---|---|---|"]
  for r in res["runs"]:
    nv = r.get("new_values") or {}
    for p, after in nv.get("finetuned", {}).items():
      before = nv.get("converted", {}).get(p, {})
      fmt = lambda d: f"{d['mean']:.4g} ({d['absmax']:.4g})" if d else "n/a"
      lines.append(f"| {r['variant']}/seed{r['seed']} | `{p}` | {fmt(before)} | {fmt(after)} |")
  return "\n".join(lines)


def refusals(res: dict) -> list[str]:
  """'label: policy: reason' of every stream a model could not run."""
  return [f"{label}: {pol}: {p['refused']}" for label, st in res["streams"].items()
          for pol, p in st["policies"].items() if "refused" in p]


def conditions(res: dict) -> str:
  """The budget in words: model, data, steps and tokens, sweep and seeds, wall time, machine."""
  m, c = res["meta"], res["meta"]["config"]
  s, mc = c["study"], m["machine"]
  fts = finetunes(res)
  tok = fts[0]["tokens"] if fts else 0
  ft_s = sum(r["wall_s"] for r in fts)
  st = [p for v in res["streams"].values() for p in v["policies"].values() if "wall_s" in p]
  calls = m.get("invocations", [])
  wall = sum(x.get("wall_s", 0.0) for x in calls)
  loads = [x[k] for x in calls for k in ("loadavg_start", "loadavg_end") if k in x]
  commits = [x.get("commit", "not recorded") for x in calls]
  partial = "" if m.get("complete") else "PARTIAL (rerun the study command to complete it). "
  return (f"{partial}`{s['src']}` converted into {len(res['variants'])} models; every "
          f"fine-tune {c['train']['steps']} steps of {c['data']['global_batch_size']} x "
          f"{c['data']['seq_len']} tokens ({tok:,} tokens of `{c['data']['paths']}`, its last "
          f"{c['data']['eval_fraction']:.0%} held out), AdamW (eps {c['optim']['eps']:g}), warm-up "
          f"{c['optim']['warmup_steps']}, cosine to {c['optim']['min_lr_ratio']:g} x lr, lr from "
          f"{list(s['lrs'])} on seed {s['seeds'][0]}, seeds {list(s['seeds'])} for the control and "
          f"the best variant ({m.get('best_variant')}); streams of {s['stream_tokens']:,} "
          f"held-out tokens, cache {s['stream_cache']}, scored {s['stream_chunk']} tokens per "
          f"call. Wall time on this machine: {wall / 60:.1f} min in {len(calls)} invocation(s) "
          f"({len(fts)} fine-tunes {ft_s / 60:.1f} min, {len(st)} stream scores "
          f"{sum(p['wall_s'] for p in st) / 60:.1f} min, the rest conversions and loading); "
          f"{mc['backend']} x{mc['devices']}, {mc['cpu_count']} CPU cores, JAX {mc['jax']}, "
          f"attn_jax commit per invocation {', '.join(commits)}"
          + (f"; load average {min(loads):.1f} to {max(loads):.1f}" if loads else "")
          + f"; {m['started']} to {m['finished']}.")


def page_marker(res: dict) -> str:
  """The page section's marker name (`study.page_marker`, default "finetune_study")."""
  return res["meta"]["config"]["study"].get("page_marker") or "finetune_study"


def page_section(res: dict, workdir: str, image_dir: str, regen: str) -> str:
  """The generated part of the page, markers included."""
  begin, end = marker_pair(page_marker(res))
  refused = "".join(f"\n- not run: {r}" for r in refusals(res))
  return (f"{begin}\n<!-- generated by `{regen}` from {workdir}/results.json; do not edit "
          f"by hand -->\nConditions: {conditions(res)}\n\n```bash\n{res['meta']['command']}\n"
          f"{regen}\n```\n\n{table(res)}\n\nNLL past the cache: mean over the stream's "
          f"tokens after the first {res['meta']['config']['study']['stream_cache']} (where the "
          "two caches differ); ± half the range over seeds; the last column per seed, then "
          f"averaged.{refused}\n\n![NLL against position]({image_dir}/{PLOT})\n\n"
          f"Every fine-tune:\n\n{sweep_table(res)}\n\nThe new parameters:\n\n"
          f"{new_params_table(res)}\n{end}")


def plot(res: dict, path: str) -> str:
  """NLL against position (bins of study.stream_bin), one panel per cache policy, one line
  per variant's first seed and the pretrained model."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  pols = sorted({p for st in res["streams"].values() for p in st["policies"]})
  fig, axes = plt.subplots(1, len(pols), figsize=(6 * len(pols), 4), sharey=True, squeeze=False)
  seen = set()
  for label, st in res["streams"].items():
    name = label.split("/")[0]
    if name in seen:
      continue
    seen.add(name)
    for ax, pol in zip(axes[0], pols):
      p = st["policies"].get(pol, {})
      if "by_position" in p:
        x = np.arange(len(p["by_position"])) * p["bin"] + p["bin"] / 2
        ax.plot(x, p["by_position"], label=name)
  for ax, pol in zip(axes[0], pols):
    ax.set_title(pol)
    ax.set_xlabel("position in the held-out stream")
    ax.axvline(int(res["meta"]["config"]["study"]["stream_cache"]), color="grey", lw=0.5)
  axes[0][0].set_ylabel("NLL (nats/token)")
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_report(workdir: str, page: str = "", assets: str = "") -> dict[str, str]:
  """tables.md and the plot in `workdir` from its results.json; with `page`, its generated
  section replaced (the plot copied to `assets` when given, linked from there)."""
  res = jsonio.read(os.path.join(workdir, RESULTS))
  tables = os.path.join(workdir, "tables.md")
  with open(tables, "w") as f:
    f.write(table(res) + "\n")
  out = {"tables": tables, "plot": plot(res, os.path.join(workdir, PLOT))}
  if page:
    if assets:
      copy_plots(workdir, assets, [PLOT])
    images, rel = page_links(page, workdir, assets)
    regen = (f"python experiments/finetune_study.py --report={rel(workdir)} --page={rel(page)}"
             + (f" --assets={rel(assets)}" if assets else ""))
    splice(page, page_section(res, rel(workdir), images, regen),
           *marker_pair(page_marker(res)), "## The study's results")
    out["page"] = page
  return out
