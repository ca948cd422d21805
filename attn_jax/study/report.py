"""The study's report, from results.json only: markdown tables, PNG plots (matplotlib, Agg)
and the README section between `<!-- study:begin -->` and `<!-- study:end -->`.

Spread over seeds: "mean ± std (min–max)", std the sample standard deviation (n - 1); one seed
shows its value alone. Accuracies are in percent. Nothing here reads the clock or the machine: the same
results.json always gives the same text, so regenerating the README is idempotent.
"""

from __future__ import annotations

import json
import os

import numpy as np

from attn_jax.study import sinks
from attn_jax.study.tables import markdown_table as _table, spread

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
PLOTS = ("loss.png", "niah.png", "recall.png", "throughput.png")
LM_PLOTS = ("lm_position.png",)   # added when the runs have language-modelling metrics
SINK_PLOTS = ("sink_layouts.png",)  # added when the study streamed its runs (sinks.py)


def marker_pair(name: str) -> tuple[str, str]:
  """The begin / end comments that delimit a generated section called `name` in a page."""
  return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def markers(res: dict) -> tuple[str, str]:
  """The README markers of this study (`study.readme_marker`, default "study")."""
  return marker_pair(res["meta"]["config"].get("study", {}).get("readme_marker") or "study")


def has_lm(res: dict) -> bool:
  return any(r.get("bpb") is not None for r in res["runs"])


def has_sinks(res: dict) -> bool:
  return bool((res.get("sinks") or {}).get("runs"))


def _has_metric(res: dict, metric: str | None) -> bool:
  return bool(metric) and any(metric in e for r in res["runs"] for e in r.get("evals", ()))


def plot_names(res: dict) -> tuple[str, ...]:
  """The plots this study has data for (no empty NIAH / recall / throughput panels)."""
  m = res["meta"]
  has = {"loss.png": True, "niah.png": _has_metric(res, m.get("niah_metric")),
         "recall.png": _has_metric(res, m.get("recall_metric")),
         "throughput.png": bool(res.get("throughput"))}
  return (tuple(p for p in PLOTS if has[p]) + (LM_PLOTS if has_lm(res) else ())
          + (SINK_PLOTS if has_sinks(res) else ()))


def load_results(workdir: str) -> dict:
  """results.json; a partial one (written after every run, before the throughput is measured)
  takes the rows of throughput.json when that was measured for the same variants."""
  with open(os.path.join(workdir, "results.json")) as f:
    res = json.load(f)
  thr = os.path.join(workdir, "throughput.json")
  if not res.get("throughput") and os.path.isfile(thr):
    with open(thr) as f:
      t = json.load(f)
    if t["key"]["variants"] == list(res["variants"]):
      res["throughput"] = t["rows"]
  return res


def _variants(res: dict) -> list[str]:
  return list(res["variants"])


def _by_variant(res: dict) -> dict[str, list[dict]]:
  out = {v: [] for v in _variants(res)}
  for r in res["runs"]:
    out.setdefault(r["variant"], []).append(r)
  return out


def params_table(res: dict) -> str:
  rows = []
  for v, info in res["variants"].items():
    knob = f"{info['match_field']} = {info['match_value']}" if info["match_field"] else "-"
    lr = f"{info['lr']:g}" if info.get("lr") else "-"
    rows.append([v, f"{info['params']:,}", f"{info['diff_pct']:+.2f}%", knob, lr,
                 info.get("setting") or "-"])
  return _table(["variant", "parameters", "vs baseline", "matched by", "lr",
                 "declared setting (source)"], rows)


def _sweep_cell(r: dict) -> str:
  """'recall % / loss' (MQAR) or 'bpb / loss' (LM); 'diverged' without a final loss."""
  if r.get("final_loss") is None or not np.isfinite(r["final_loss"]):
    return "diverged"
  head = (f"{100 * r['recall_acc']:.1f}" if r.get("recall_acc") is not None else
          f"{r['bpb']:.3f} bpb" if r.get("bpb") is not None else "-")
  return f"{head} / {r['final_loss']:.3f}"


def sweep_table(res: dict) -> str:
  """Rows = swept variants, columns = learning rates, cells = 'recall % / held-out loss' of
  the sweep seed's run (the chosen lr in bold)."""
  rows_in = res.get("sweep") or []
  lrs = sorted({r["lr"] for r in rows_in})
  cell = {(r["variant"], r["lr"]): r for r in rows_in}
  rows = []
  for v in _variants(res):
    if not any((v, lr) in cell for lr in lrs):
      continue
    row = [v]
    for lr in lrs:
      r = cell.get((v, lr))
      txt = "-" if r is None else _sweep_cell(r)
      row.append(f"**{txt}**" if r is not None and res["variants"][v].get("lr") == lr else txt)
    rows.append(row)
  return _table(["variant"] + [f"lr {lr:g}" for lr in lrs], rows)


def eval_steps(res: dict) -> list[int]:
  steps = sorted({e["step"] for r in res["runs"] for e in r["evals"]})
  return steps


def metric_at(run: dict, metric: str, step: int):
  for e in run["evals"]:
    if e["step"] == step:
      return e.get(metric)
  return None


def step_table(res: dict, metric: str) -> str:
  """Rows = variants, columns = evaluation steps, cells = mean ± std over seeds (percent)."""
  steps = eval_steps(res)
  rows = []
  for v, runs in _by_variant(res).items():
    rows.append([v] + [spread([metric_at(r, metric, s) for r in runs], 100.0, 1, minmax=False)
                       for s in steps])
  return _table(["variant"] + [f"step {s}" for s in steps], rows)


def needle_cells(res: dict) -> list[str]:
  """The needle grid's cell metrics (`eval/needle/C<length>_d<depth>`) in the last evals."""
  cells = {k for r in res["runs"] if r["evals"] for k in r["evals"][-1]
           if k.startswith("eval/needle/C")}
  def order(k):
    c, d = k[len("eval/needle/C"):].split("_d")
    return int(c), float(d)
  return sorted(cells, key=order)


def needle_grid_table(res: dict) -> str:
  """Rows = variants, columns = needle cells (context length C, depth d), at the last
  evaluation of each run (mean ± std over seeds, percent)."""
  cells = needle_cells(res)
  rows = [[v] + [spread([r["evals"][-1].get(k) if r["evals"] else None for r in runs], 100.0, 1,
                        minmax=False) for k in cells]
          for v, runs in _by_variant(res).items()]
  return _table(["variant"] + [k[len("eval/needle/"):].replace("_", " ") for k in cells], rows)


def final_table(res: dict) -> str:
  niah, recall = bool(res["meta"].get("niah_metric")), bool(res["meta"].get("recall_metric"))
  lm = has_lm(res)
  rows = []
  for v, runs in _by_variant(res).items():
    row = [v, f"{res['variants'][v]['params']:,}", str(len(runs)),
           spread([r["final_loss"] for r in runs], 1.0, 3)]
    if lm:
      row.append(spread([r.get("bpb") for r in runs], 1.0, 3))
    if recall:
      row.append(spread([r["recall_acc"] for r in runs], 100.0, 1))
    if niah:
      row.append(spread([r["niah_acc"] for r in runs], 100.0, 1))
    row.append(spread([r["train_tokens_per_sec"] for r in runs], 1.0, 0, minmax=False))
    rows.append(row)
  head = ["variant", "params", "seeds", "held-out loss"]
  head += ["held-out bits/byte"] if lm else []
  head += ["recall acc %"] if recall else []
  head += ["NIAH acc %"] if niah else []
  return _table(head + ["train tok/s (wall, median of logged intervals)"], rows)


def lm_positions(res: dict) -> list[tuple[int, int]]:
  """The (a, b) position buckets `eval/lm/pos<a>_<b>` of the last evaluations, in order."""
  keys = {k for r in res["runs"] if r["evals"] for k in r["evals"][-1]
          if k.startswith("eval/lm/pos")}
  return sorted(tuple(int(x) for x in k[len("eval/lm/pos"):].split("_")) for k in keys)


def lm_position_table(res: dict) -> str:
  cols = lm_positions(res)
  rows = [[v] + [spread([r["evals"][-1].get(f"eval/lm/pos{a}_{b}") if r["evals"] else None
                         for r in runs], 1.0, 3, minmax=False) for a, b in cols]
          for v, runs in _by_variant(res).items()]
  return _table(["variant"] + [f"pos {a}-{b}" for a, b in cols], rows)


def throughput_table(res: dict) -> str:
  thr = res.get("throughput") or []
  if not thr:
    return "(no throughput measured)"
  lens = sorted({r["seq_len"] for r in thr})
  cell = {(r["variant"], r["seq_len"]): r for r in thr}
  rows = []
  for v in _variants(res):
    row = [v]
    for L in lens:
      r = cell.get((v, L))
      row.append("-" if r is None else
                 f"{r['tok_s']:,.0f} tok/s, {r['ratio']:.2f}x wall, {r['cpu_ratio']:.2f}x CPU")
    rows.append(row)
  head = ["variant"] + [f"L={L} (batch {cell[(_variants(res)[0], L)]['batch']})" for L in lens]
  return _table(head, rows)


def _data_text(d: dict) -> str:
  if d["source"] == "synthetic":
    return (f"synthetic/{d.get('synthetic_task', '')}: {d['mqar_num_pairs']} pairs, "
            f"{d['mqar_num_queries']} queries, key/value vocabulary {d['mqar_vocab']}")
  return (f"{d['source']} {os.path.basename(str(d['paths']).rstrip('/'))}, tokenizer "
          f"{os.path.basename(str(d['tokenizer']))}, held-out last {d['eval_fraction']:g}")


def conditions(res: dict) -> str:
  m = res["meta"]
  mc = m["machine"]
  c = m["config"]
  mdl, d = c["model"], c["data"]
  runs = res["runs"]
  n_all = len(res["variants"]) * len(m["seeds"])
  partial = ("" if m.get("complete", True) else
             f"PARTIAL STUDY: {len(runs)} of {n_all} runs finished"
             f"{'' if res.get('throughput') else ', throughput not measured'} (rerun the "
             "study command to complete it). ")
  sw = res.get("sweep") or []
  sweep = (f"; each variant's lr chosen from {sorted({r['lr'] for r in sw})} on seed "
           f"{sw[0]['seed']} ({len(sw)} sweep runs)" if sw else "")
  return (f"{partial}{len(res['variants'])} variants x {len(m['seeds'])} seeds (seeds {m['seeds']}"
          f"{sweep}), "
          f"{m['steps']} steps of {m['batch']} x {m['seq_len']} tokens each, equal data stream "
          f"({_data_text(d)}), "
          f"d_model {mdl['d_model']}, {mdl['n_heads']} heads, {mdl['dtype']}; evaluation every "
          f"{m['eval_every']} steps. Machine: {mc['backend']} ({mc['device_kind']}) x"
          f"{mc['devices']}, {mc['cpu_count']} CPU cores, {mc['platform']}, JAX {mc['jax']}, "
          f"attn_jax commit {mc.get('commit', 'not recorded')}; "
          f"load average {m['loadavg_start'][0]:.1f} at the start, {m['loadavg_end'][0]:.1f} at "
          f"the end (the machine is shared: wall times are noisy). {_time_text(m, runs)}; "
          f"{m['started']} to {m['finished']}.")


def _time_text(m: dict, runs: list[dict]) -> str:
  """Training time: every distinct run (sweep included) and the throughput comparison."""
  t = m.get("training") or {"runs": len(runs), "wall_s": sum(r["wall_s"] for r in runs),
                            "cpu_s": sum(r["cpu_s"] for r in runs)}
  txt = (f"Training time over all {t['runs']} runs (sweep included): {t['wall_s'] / 60:.1f} min "
         f"wall, {t['cpu_s'] / 60:.1f} min CPU")
  if m.get("throughput_wall_s"):
    txt += (f"; with the throughput comparison {(t['wall_s'] + m['throughput_wall_s']) / 60:.1f}"
            " min wall")
  return txt


def tables_markdown(res: dict, *, image_dir: str = "", heading: str = "###") -> str:
  m = res["meta"]
  parts = [f"{heading} Parameters (matched to `{m['baseline']}`), lr and declared setting",
           params_table(res)]
  if res.get("sweep"):
    parts += [f"{heading} Learning-rate sweep (seed {res['sweep'][0]['seed']}; recall % / "
              f"held-out loss at the last evaluation; bold = chosen by "
              f"`{m.get('sweep_metric') or m['recall_metric']}`)", sweep_table(res)]
  if m.get("niah_metric"):
    parts += [f"{heading} NIAH accuracy (%) vs training step (`{m['niah_metric']}`, "
              "mean ± std over seeds)", step_table(res, m["niah_metric"])]
    if needle_cells(res):
      parts += [f"{heading} NIAH by cell at the last evaluation (%; C = context length, d = "
                "depth of the needle pair, 0 = written first)", needle_grid_table(res)]
  if m.get("recall_metric"):
    parts += [f"{heading} Recall accuracy (%) vs training step (`{m['recall_metric']}`, "
              "mean ± std over seeds)", step_table(res, m["recall_metric"])]
  if has_lm(res):
    parts += [f"{heading} Held-out bits per byte by target position (last evaluation, windows "
              f"of {lm_positions(res)[-1][1]} tokens; training length {m['seq_len']}: later "
              "columns are extrapolation; mean ± std over seeds)", lm_position_table(res)]
  if has_sinks(res):
    parts += sinks.sinks_markdown(res, heading)
  parts += [f"{heading} Final (last evaluation; mean ± std (min–max) over seeds)",
            final_table(res),
            f"{heading} Train-step throughput vs `{m['baseline']}` (same process, same shapes; "
            "ratio > 1 = faster)", throughput_table(res)]
  if image_dir is not None:
    parts.append(" ".join(f"![{p[:-4]}]({os.path.join(image_dir, p)})" for p in plot_names(res)))
  return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------- plots
def _curves(runs, metric_fn, steps):
  y = np.array([[metric_fn(r, s) if metric_fn(r, s) is not None else np.nan for s in steps]
                for r in runs], np.float64)
  if np.all(np.isnan(y)):
    return None
  return np.nanmean(y, 0), np.nanmin(y, 0), np.nanmax(y, 0)


def _plot_steps(res, path, title, ylabel, steps_fn, value_fn, scale=1.0):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  for v, runs in _by_variant(res).items():
    steps = steps_fn(runs) if runs else []
    if not steps:
      continue
    curves = _curves(runs, value_fn, steps)
    if curves is None:   # no such metric (e.g. no recall task in the LM study)
      continue
    mean, lo, hi = curves
    line, = ax.plot(steps, mean * scale, label=v, lw=1.5)
    if len(runs) > 1:
      ax.fill_between(steps, lo * scale, hi * scale, color=line.get_color(), alpha=0.15)
  ax.set_xlabel("training step")
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:   # nothing drawn when the study has no such metric
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, format="png")
  plt.close(fig)


def _train_at(run, step):
  for t in run["train"]:
    if t["step"] == step:
      return t["loss"]
  return None


def plot_all(res: dict, out_dir: str) -> list[str]:
  """The PNGs of `plot_names` in `out_dir`; returns their paths."""
  m = res["meta"]
  band = f"line: mean over {len(m['seeds'])} seeds, band: min–max"

  def steps_plot(metric, name):
    return lambda path: _plot_steps(
        res, path, f"{name} accuracy, `{metric}` ({band})", f"{name} accuracy %",
        lambda runs: eval_steps({"runs": runs}),
        lambda r, s: metric_at(r, metric, s), scale=100.0)
  makers = {
      "loss.png": lambda path: _plot_steps(
          res, path, f"training loss ({band})", "loss (answer tokens)",
          lambda runs: sorted({t["step"] for t in runs[0]["train"]}), _train_at),
      "niah.png": steps_plot(m.get("niah_metric"), "NIAH"),
      "recall.png": steps_plot(m["recall_metric"], "recall"),
      "throughput.png": lambda path: _plot_throughput(res, path),
      LM_PLOTS[0]: lambda path: _plot_lm_positions(res, path),
      SINK_PLOTS[0]: lambda path: _plot_sinks(res, path)}
  paths = []
  for name in plot_names(res):
    paths.append(os.path.join(out_dir, name))
    makers[name](paths[-1])
  return paths


def _plot_sinks(res, path):
  sinks.plot_layouts(res, path)


def _plot_lm_positions(res, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = lm_positions(res)
  x = [(a + b) / 2 for a, b in cols]
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  for v, runs in _by_variant(res).items():
    y = np.array([[r["evals"][-1].get(f"eval/lm/pos{a}_{b}", np.nan) if r["evals"] else np.nan
                   for a, b in cols] for r in runs], np.float64)
    if not runs or np.all(np.isnan(y)):
      continue
    line, = ax.plot(x, np.nanmean(y, 0), marker="o", label=v, lw=1.5)
    if len(runs) > 1:
      ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), color=line.get_color(), alpha=0.15)
  ax.axvline(res["meta"]["seq_len"], color="k", lw=0.8, ls="--")
  ax.set_xlabel("target position (dashed: training length)")
  ax.set_ylabel("held-out bits per byte")
  ax.set_title("loss vs position past the training length (mean, band: min–max over seeds)",
               fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, format="png")
  plt.close(fig)


def _plot_throughput(res, path):
  """Two panels: tokens per wall second (best step) and per CPU second (median step): on a
  shared machine the second is the steadier comparison."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
  thr = res["throughput"]   # `plot_names` lists this plot only when it was measured
  for ax, key, label in ((axes[0], "wall", "train tokens / wall s (best step)"),
                         (axes[1], "cpu", "train tokens / CPU s (median step)")):
    for v in _variants(res):
      pts = sorted((r["seq_len"], r["tok_s"] if key == "wall" else
                    r["batch"] * r["seq_len"] / r["cpu_s"]) for r in thr if r["variant"] == v)
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v, lw=1.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (same tokens per step)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].set_title("train-step throughput vs sequence length", fontsize=10)
  axes[1].legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, format="png")
  plt.close(fig)


# ---------------------------------------------------------------------------------- outputs
def _title(res: dict) -> str:
  if has_sinks(res):
    return "Attention-sink study"
  return "Language-modelling study" if has_lm(res) else "Comparison study"


def write_report(workdir: str) -> dict:
  """tables.md and the PNGs in `workdir`, from its results.json; returns their paths."""
  res = load_results(workdir)
  pngs = plot_all(res, workdir)
  md = os.path.join(workdir, "tables.md")
  with open(md, "w") as f:
    f.write(f"# {_title(res)}\n\n" + conditions(res) + "\n\n"
            + tables_markdown(res, image_dir="", heading="##"))
  return {"tables": md, "plots": pngs}


def page_links(page_path: str, workdir: str, assets: str = ""):
  """(images, path): the folder the page's images link to (`assets` when given, a tracked
  folder the PNGs are copied to, else the study's workdir), relative to the page; and the
  function that writes a path for the page's commands: from the working directory when the
  page lies under it (the checkout root, where the command runs), else from the page's folder."""
  here = os.path.dirname(os.path.abspath(page_path))
  images = os.path.relpath(os.path.abspath(assets or workdir), here)
  cwd = os.getcwd()
  base = cwd if os.path.abspath(page_path).startswith(cwd + os.sep) else here
  return images, lambda p: os.path.relpath(os.path.abspath(p), base)


def copy_plots(workdir: str, assets: str, names) -> None:
  """The PNGs `names` of `workdir` copied to `assets` (runs/ is not tracked by git, so a page
  that links into it shows no images on a fresh clone)."""
  import shutil
  os.makedirs(assets, exist_ok=True)
  for p in names:
    shutil.copyfile(os.path.join(workdir, p), os.path.join(assets, p))


def readme_section(res: dict, readme_path: str, workdir: str, assets: str = "") -> str:
  """The generated section, markers included. Images link into `assets` when given (a
  tracked folder the PNGs are copied to), else into the study's workdir."""
  images, path = page_links(readme_path, workdir, assets)
  rel = path(workdir)
  cmd = res["meta"].get("command") or "python experiments/study.py ..."
  regen = (f"python experiments/study.py --report={rel} --readme={path(readme_path)}"
           + (f" --assets={path(assets)}" if assets else ""))
  begin, end = markers(res)
  return (f"{begin}\n<!-- generated by `{regen}` from {rel}/results.json; do not edit by "
          "hand -->\n"
          f"Conditions: {conditions(res)}\n\nReproduce (the first command trains and "
          f"measures, resumable; the second rewrites this section):\n```bash\n{cmd}\n"
          f"{regen}\n```\n\n"
          + tables_markdown(res, image_dir=images, heading="####") + end)


def update_readme(readme_path: str, workdir: str, assets: str = "") -> bool:
  """Replace the text between the markers (markers included) with the generated section; a
  README without the markers gets a "## Comparison study" section appended. Returns whether
  the file changed. With `assets`, the PNGs of `workdir` are copied there first (runs/ is not
  tracked by git, so a README that links into it shows no images on a fresh clone)."""
  res = load_results(workdir)
  if assets:
    copy_plots(workdir, assets, plot_names(res))
  begin, end = markers(res)
  return splice(readme_path, readme_section(res, readme_path, workdir, assets), begin, end,
                f"## {_title(res)}")


def splice(page_path: str, section: str, begin: str, end: str, heading: str) -> bool:
  """Put `section` (its markers included) in place of the text between `begin` and `end` in
  the page; a page without them gets `heading` and the section appended. Returns whether the
  file changed."""
  with open(page_path) as f:
    text = f.read()
  b, e = text.find(begin), text.find(end)
  if b < 0 and e < 0:
    new = text.rstrip("\n") + f"\n\n{heading}\n" + section + "\n"
  elif b < 0 or e < b:
    raise ValueError(f"{page_path}: markers {begin} ... {end} are missing or out of order")
  else:
    new = text[:b] + section + text[e + len(end):]
  if new != text:
    with open(page_path, "w") as f:
      f.write(new)
  return new != text
