"""Run the study: every (variant, seed) through `train_and_evaluate`, then the throughput
comparison, then results.json and the report.

Protocol: with `study.lrs` (a few log-spaced learning rates; a variant may declare its own
grid with an override of `study.lrs`), every variant is first trained at each of them on one
seed (`study.sweep_seed`, default the first), the best by `study.sweep_metric` (higher is
better; ties: lower held-out loss) is kept, and the other seeds run at that lr only; the sweep
table goes into the report (Zoology, Arora et al. 2023, reports the best of an lr sweep). With
one lr (or none: `optim.lr`) there is no sweep.

Layout under the study's workdir:
  runs/<variant>/seed<k>/   the trainer's workdir (checkpoints, metrics.jsonl, tb/) and
                            study_run.json once the run has finished (its summary);
                            runs/<variant>/lr<lr>/seed<k>/ when the variant's lr is swept
  jax_cache/                JAX's persistent compilation cache: seeds 2..n (and a rerun) load
                            the compiled train/eval steps of seed 1 instead of recompiling
  throughput.json           the side-by-side throughput rows (skipped when present with the
                            same settings)
  results.json              everything the report reads (`report.write_report`)

Resuming (`finished_record`, also the fine-tuning study's rule): a run with a study_run.json
whose saved config (every field but the study's selection fields, `SELECTION_FIELDS`) has the
values the study's config has now is skipped; a field the saved config lacks (added to
attn_jax/config.py since, at its default) is no change. Summaries from before configs were saved
in them are matched on their digest, or, older still, on steps, parameters and lr. An
unfinished run is restarted with the same command and the trainer resumes from its latest
checkpoint. A finished run whose config has changed since is an error naming the run and up to
four changed fields, never silently reused. Equal
conditions: every variant gets the same data stream (`data.*`, the seed), steps, batch,
optimizer and evaluation; only the model differs (`attn_jax.study.matching`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from attn_jax import jsonio, paths
from attn_jax.config import RunConfig, validate
from attn_jax.eval.run import task_callback
from attn_jax.provenance import machine_info
from attn_jax.run_layout import RunLayout
from attn_jax.study import matching, sinks, throughput
from attn_jax.study.lm import lm_callback
from attn_jax.study.needle import needle_callback
from attn_jax.train.resume import config_changes
from attn_jax.train.trainer import train_and_evaluate

RESULTS = "results.json"
RUN_SUMMARY = "study_run.json"
THROUGHPUT = "throughput.json"


class StudyStopped(Exception):
  """A run was stopped by a signal (checkpoint saved); rerunning the study resumes it."""

  def __init__(self, message: str, signal_name: str):
    super().__init__(message)
    self.signal_name = signal_name


def enable_compilation_cache(workdir: str) -> str:
  """JAX's persistent compilation cache in <workdir>/jax_cache, unless one is configured
  already (JAX_COMPILATION_CACHE_DIR), which is then kept."""
  import jax
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = os.path.join(os.path.abspath(workdir), "jax_cache")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def _read_jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _num(v):
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def summarize_run(run_dir: str, config: ml_collections.ConfigDict, variant: str, info: dict,
                  *, wall_s: float, cpu_s: float) -> dict:
  """The run's record for results.json, from its metrics.jsonl."""
  rows = _read_jsonl(paths.name(RunLayout.of(run_dir).metrics))
  train = [{"step": r["step"], "loss": _num(r["loss"]), "accuracy": _num(r.get("accuracy")),
            "tokens_per_sec": _num(r.get("tokens_per_sec"))} for r in rows if "loss" in r]
  evals: dict[int, dict] = {}
  for r in rows:
    ev = {k: _num(v) for k, v in r.items() if k.startswith("eval/") and _num(v) is not None}
    if ev:
      evals.setdefault(int(r["step"]), {"step": int(r["step"])}).update(ev)
  evals_l = [evals[s] for s in sorted(evals)]
  s = config.study
  last = evals_l[-1] if evals_l else {}
  tps = [t["tokens_per_sec"] for t in train[1:] if t["tokens_per_sec"]] or \
        [t["tokens_per_sec"] for t in train if t["tokens_per_sec"]]
  return {"variant": variant, "seed": int(config.seed), "params": info["params"],
          "param_diff_pct": info["diff_pct"], "match_field": info["match_field"],
          "match_value": info["match_value"], "mixer": config.model.mixer,
          "lr": float(config.optim.lr),
          "pattern": list(config.model.pattern), "sink_tokens": int(config.model.sink_tokens),
          "d_ff": int(config.model.d_ff), "n_layers": int(config.model.n_layers),
          "steps": int(config.train.steps),
          "tokens": int(config.train.steps) * int(config.train.grad_accum)
          * int(config.data.global_batch_size) * int(config.data.seq_len),
          "train": train, "evals": evals_l,
          "final_train_loss": train[-1]["loss"] if train else None,
          "final_loss": last.get("eval/loss"),
          "recall_acc": last.get(s.recall_metric),
          "niah_acc": last.get(s.niah_metric) if s.niah_metric else None,
          "bpb": last.get("eval/lm/bpb"),
          "train_tokens_per_sec": float(np.median(tps)) if tps else None,
          "wall_s": wall_s, "cpu_s": cpu_s, "workdir": os.path.relpath(run_dir)}


def eval_callbacks(config: ml_collections.ConfigDict, run: RunConfig) -> list[Callable]:
  """The same evaluators for every variant: `task_callback` (config.eval.tasks: MQAR recall,
  text NIAH, benchmarks), with `study.lm_eval` the language-modelling bits per byte and loss
  by position (attn_jax/study/lm.py), and with `study.niah == "synthetic"` the MQAR-space
  needle grid. `run`: `config` validated (the study's own section stays in `config`)."""
  cbs = []
  tasks = task_callback(run)
  if tasks is not None:
    cbs.append(tasks)
  if config.study.lm_eval:
    cbs.append(lm_callback(config))
  if config.study.niah == "synthetic":
    cbs.append(needle_callback(config))
  elif config.study.niah not in ("text", "none"):
    raise ValueError(f"config.study.niah: {config.study.niah!r} not in "
                     "('synthetic', 'text', 'none')")
  return cbs


def variant_lrs(config: ml_collections.ConfigDict) -> list[float]:
  """The learning rates a (variant's) config sweeps: `study.lrs`, or `optim.lr` alone."""
  lrs = [float(x) for x in (config.study.lrs or ())]
  if any(not x > 0 for x in lrs) or len(set(lrs)) != len(lrs):
    raise ValueError(f"config.study.lrs: want distinct positive learning rates, got {lrs}")
  return lrs or [float(config.optim.lr)]


def run_dir_of(workdir: str, variant: str, seed: int, lr: float, swept: bool) -> str:
  parts = [workdir, "runs", variant] + ([f"lr{lr:g}"] if swept else []) + [f"seed{seed}"]
  return os.path.join(*parts)


def best_lr(rows: list[dict], metric: str) -> float:
  """The lr of the run record (`summarize_run`) whose last evaluation has the highest
  `metric` ("-name": the lowest; missing/NaN last; ties: lower held-out loss)."""
  sign, field = (-1.0, metric[1:]) if metric.startswith("-") else (1.0, metric)

  def key(r):
    m, loss = (r["evals"][-1] if r.get("evals") else {}).get(field), r.get("final_loss")
    ok = m is not None and np.isfinite(m)
    return (ok, sign * m if ok else 0.0,
            -(loss if loss is not None and np.isfinite(loss) else np.inf))
  return max(rows, key=key)["lr"]


# study.* fields that choose which runs to do, or how to report them, not what a run computes
# (its evaluation settings, e.g. study.needle_*, stay in the digest).
SELECTION_FIELDS = ("variants", "baseline", "only", "seeds", "lrs", "sweep_seed", "sweep_metric",
                    "param_tolerance", "d_ff_multiple", "readme_marker", "throughput_seq_lens",
                    "throughput_batch_tokens", "throughput_steps", "throughput_repeats",
                    # the sink study's stream phase (sinks.py) reads finished runs only
                    "sink_stream", "sink_cache", "sink_keep", "sink_stream_tokens", "sink_chunk",
                    "sink_mass_seqs", "sink_mass_min_query", "sink_tolerance")


def run_fields(config: ml_collections.ConfigDict) -> dict:
  """What a study run computes: its config as JSON without the study's selection fields."""
  d = json.loads(json.dumps(config.to_dict(), default=str))
  d["study"] = {k: v for k, v in d["study"].items() if k not in SELECTION_FIELDS}
  return d


def changed_fields(saved: dict, now: dict) -> list[str]:
  """"field: saved -> now" for the fields whose value differs; a field the saved config lacks
  (added to attn_jax/config.py since, at its default) is not a change of the run."""
  return [c for c in config_changes(saved, now) if ": '(absent)' ->" not in c]


def finished_record(done: str, fields: dict, what: str, legacy=None) -> dict | None:
  """The record at `done` of a finished run that computed `fields` (module docstring,
  "Resuming"); None when no run finished there. A finished run of other values is a
  ValueError naming `what` and the changed fields. `legacy(rec)`: whether a record saved
  without its config is this run."""
  if not os.path.isfile(done):
    return None
  rec = jsonio.read(done)
  if "config" in rec:
    changes = changed_fields(rec["config"], fields)
  else:
    changes = [] if legacy is not None and legacy(rec) else ["a config from an older study"]
  if changes:
    raise ValueError(f"{done}: this finished run was made with another config than the study's "
                     f"{what} now has ({'; '.join(changes[:4])}); move "
                     f"{os.path.dirname(done)} aside (or use another --workdir) to retrain it")
  return rec


def _legacy_match(rec: dict, config, info) -> bool:
  """A summary saved before its config was: its digest, or steps, parameters and lr."""
  if "config_digest" in rec:
    d = json.dumps(run_fields(config), sort_keys=True, default=str)
    return rec["config_digest"] == hashlib.sha256(d.encode()).hexdigest()
  return (rec.get("steps") == int(config.train.steps) and rec.get("params") == info["params"]
          and rec.get("lr", float(config.optim.lr)) == float(config.optim.lr))


def train_once(tag: str, what: str, done: str, fields: dict, log, train, record, *,
               legacy=None) -> dict:
  """The record at `done` of a run that finished earlier with `fields` (`finished_record`),
  or a new one: `train()` runs it (its trainer result; a preempted run raises StudyStopped,
  rerun to resume), `record(out, wall_s, cpu_s)` makes its record, written to `done` with
  `fields` as its config. `tag` and `what` start the log lines ("[study]", "sisa seed 0")."""
  rec = finished_record(done, fields, what, legacy=legacy)
  if rec is not None:
    log(f"{tag} {what}: finished earlier, skipped")
    return rec
  t, c = time.perf_counter(), time.process_time()
  out = train()
  wall, cpu = time.perf_counter() - t, time.process_time() - c
  if out.get("preempted"):
    raise StudyStopped(f"{what}: stopped by {out['preempted']} (checkpoint saved); rerun the "
                       "same command to resume", str(out["preempted"]))
  rec = dict(record(out, wall, cpu), config=fields)
  jsonio.write(rec, done)
  return rec


def run_one(config, variant, info, workdir, log, run_dir=None) -> dict:
  run_dir = run_dir or os.path.join(workdir, "runs", variant, f"seed{config.seed}")
  what = f"{variant} seed {config.seed}"

  def train():
    log(f"[study] {what} lr {config.optim.lr:g}: {info['params']:,} params "
        f"({info['diff_pct']:+.2f}%), training {config.train.steps} steps")
    run = validate(config)   # once per run: the trainer and the evaluators read the typed config
    return train_and_evaluate(run, run_dir, eval_callbacks=eval_callbacks(config, run))

  def record(out, wall, cpu):
    rec = summarize_run(run_dir, config, variant, info, wall_s=wall, cpu_s=cpu)
    log(f"[study] {what}: done in {wall:.0f} s (CPU {cpu:.0f} s); "
        f"loss {rec['final_loss']}, recall {rec['recall_acc']}, niah {rec['niah_acc']}")
    return rec

  return train_once("[study]", what, os.path.join(run_dir, RUN_SUMMARY), run_fields(config),
                    log, train, record, legacy=lambda r: _legacy_match(r, config, info))


def run_throughput(config, cfgs: dict, workdir: str, log) -> list[dict]:
  s = config.study
  lens = [int(x) for x in s.throughput_seq_lens]
  if not lens:
    return []
  key = {"seq_lens": lens, "batch_tokens": int(s.throughput_batch_tokens),
         "steps": int(s.throughput_steps), "repeats": int(s.throughput_repeats),
         "variants": list(cfgs)}
  path = os.path.join(workdir, THROUGHPUT)
  if os.path.isfile(path):
    prev = jsonio.read(path)
    if prev.get("key") == key:
      log("[study] throughput: measured earlier, skipped")
      return prev["rows"]
  load0, t0 = os.getloadavg(), time.perf_counter()
  rows = throughput.compare(cfgs, lens, batch_tokens=key["batch_tokens"], steps=key["steps"],
                            warmup=1, repeats=key["repeats"], log=log)
  jsonio.write({"key": key, "rows": rows, "loadavg_before": load0,
                "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - t0}, path)
  return rows


def throughput_wall_s(workdir: str) -> float | None:
  """How long the throughput comparison took when it was measured (None: not measured)."""
  path = os.path.join(workdir, THROUGHPUT)
  return jsonio.read(path).get("wall_s") if os.path.isfile(path) else None


def _sweep_row(rec: dict) -> dict:
  return {k: rec.get(k) for k in ("variant", "seed", "lr", "final_loss", "recall_acc",
                                  "niah_acc", "bpb", "final_train_loss", "wall_s", "cpu_s")}


def training_time(runs: list[dict], sweep: list[dict]) -> dict:
  """Wall and CPU seconds of every distinct run the study trained: all sweep runs, plus the
  runs at the chosen lr that the sweep did not already count (a sweep seed's best run is in
  both lists). A resumed run counts the time of its last invocation only."""
  key = lambda r: (r["variant"], r["seed"], r["lr"])
  seen = {key(r): r for r in sweep}
  for r in runs:
    seen.setdefault(key(r), r)
  recs = list(seen.values())
  return {"runs": len(recs), "wall_s": sum(r.get("wall_s") or 0.0 for r in recs),
          "cpu_s": sum(r.get("cpu_s") or 0.0 for r in recs)}


def _runs(config, cfgs, workdir, log, on_run):
  """Train the sweep, then every seed at each variant's best lr. -> (runs, sweep rows, lrs).
  `on_run(runs, sweep, lrs)` is called after every run (to rewrite results.json)."""
  s = config.study
  metric = s.sweep_metric or s.recall_metric
  seed0 = int(s.sweep_seed) if s.sweep_seed >= 0 else int(s.seeds[0])
  runs, sweep, chosen, at_best = [], [], {}, {}

  def train(name, vc, info, seed, lr, swept):
    c = ml_collections.ConfigDict(vc.to_dict())
    c.seed, c.optim.lr = int(seed), float(lr)
    return run_one(c, name, info, workdir, log, run_dir_of(workdir, name, seed, lr, swept))

  for name, (vc, info) in cfgs.items():   # the sweep: one seed, every lr of the variant
    lrs = variant_lrs(vc)
    if len(lrs) == 1:
      chosen[name] = lrs[0]
      continue
    recs = {lr: train(name, vc, info, seed0, lr, True) for lr in lrs}
    for lr in lrs:
      sweep.append(_sweep_row(recs[lr]))
    chosen[name] = best_lr(list(recs.values()), metric)
    at_best[name] = recs[chosen[name]]
    log(f"[study] {name}: best lr {chosen[name]:g} by {metric}")
    on_run(runs, sweep, chosen)
  # Seed-major: after the first pass every variant has one finished seed, so a study stopped
  # part-way already compares them all (results.json is rewritten after every run).
  for seed in s.seeds:
    for name, (vc, info) in cfgs.items():
      swept = name in at_best
      if swept and int(seed) == seed0:
        runs.append(at_best[name])
      else:
        runs.append(train(name, vc, info, seed, chosen[name], swept))
      on_run(runs, sweep, chosen)
  return runs, sweep, chosen


def check_study(config: ml_collections.ConfigDict, cfgs: dict) -> None:
  """What the study reads only after runs have trained, checked before the first one: every
  variant's config (`config.validate`) and learning rates (study.lrs), and the sink study's
  stream layouts (study.sink_keep within study.sink_cache: `sinks.policies`), which it used to
  refuse after every run had trained. Errors name the field."""
  for vc, _ in cfgs.values():
    validate(vc)
    variant_lrs(vc)
  if config.study.get("sink_stream"):
    sinks.policies(config.study)


def run_study(config: ml_collections.ConfigDict, workdir: str, *, command: str = "",
              log: Callable[[str], Any] = print) -> dict:
  """Train every (variant, seed) (after the lr sweep), measure throughput, write
  results.json; returns it."""
  workdir = os.path.abspath(workdir)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  load0 = os.getloadavg()
  machine = machine_info()   # the commit of the code this process loaded, not of later edits
  t0, c0 = time.perf_counter(), time.process_time()
  cfgs = matching.all_variant_configs(config)
  check_study(config, cfgs)   # before anything is written or trained
  os.makedirs(workdir, exist_ok=True)
  enable_compilation_cache(workdir)
  for name, (_, info) in cfgs.items():
    log(f"[study] {name}: {info['params']:,} parameters ({info['diff_pct']:+.2f}% vs "
        f"{config.study.baseline}; {info['match_field'] or '-'} = {info['match_value']})")

  def results(runs, sweep, chosen, thr):
    m = config.study
    n_sweep = sum(len(variant_lrs(vc)) for vc, _ in cfgs.values() if len(variant_lrs(vc)) > 1)
    return {
        "meta": {"command": command, "started": started,
                 "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds"),
                 "complete": len(runs) == len(cfgs) * len(m.seeds) and thr is not None
                 and len(sweep) == n_sweep,
                 "machine": machine, "loadavg_start": load0,
                 "loadavg_end": os.getloadavg(),
                 "this_invocation": {"wall_s": time.perf_counter() - t0,
                                     "cpu_s": time.process_time() - c0},
                 "runs_wall_s": sum(r["wall_s"] for r in runs),
                 "runs_cpu_s": sum(r["cpu_s"] for r in runs),
                 "training": training_time(runs, sweep),
                 "throughput_wall_s": throughput_wall_s(workdir),
                 "baseline": m.baseline, "seeds": list(m.seeds),
                 "recall_metric": m.recall_metric, "niah_metric": m.niah_metric,
                 "niah": m.niah, "sweep_metric": m.sweep_metric or m.recall_metric,
                 "steps": int(config.train.steps), "eval_every": int(config.eval.every_steps),
                 "seq_len": int(config.data.seq_len),
                 "batch": int(config.data.global_batch_size) * int(config.train.grad_accum),
                 "config": json.loads(json.dumps(config.to_dict(), default=str))},
        "variants": {n: dict(info, lr=chosen.get(n)) for n, (_, info) in cfgs.items()},
        "runs": list(runs), "sweep": list(sweep), "throughput": thr or []}

  path = os.path.join(workdir, RESULTS)
  runs, sweep, chosen = _runs(config, cfgs, workdir, log,
                              lambda r, s, c: jsonio.write(results(r, s, c, None), path))
  thr = run_throughput(config, {n: c for n, (c, _) in cfgs.items()}, workdir, log)
  out = results(runs, sweep, chosen, thr)
  if config.study.sink_stream:   # the sink study's stream phase (sinks.py)
    out["sinks"] = sinks.stream_all(config, runs, log)
    out["meta"]["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds")
  jsonio.write(out, path)
  return out
