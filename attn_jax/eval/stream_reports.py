"""Reports of streaming scores (`streaming.score_stream`): what one run writes, the statistics
over per-position losses, and the report over several runs.

One run (`write_results`, experiments/stream.py): losses.json (meta, per-policy summary, every
position's loss; an unscored position is null), losses.csv (one column per policy) and loss.png
(running mean per policy; a subsampled policy as binned means).

Statistics. losses[i] is the loss at position i (predicting token i + 1, from tokens 0..i); NaN
marks a position a subsampled policy ("recompute" with stride > 1) did not score, and every
mean here is over the scored positions only (`summarize`: the whole stream and consecutive
slices; `summarize_ranges`: ranges of the query's position, the same ranges whatever the
stream's length). A policy compared with a subsampled one is compared at the positions that one
scored (`paired`, `scored_from`).

Several runs (`read_results`, `report_table`, `table_markdown`, `plot_report`;
experiments/stream_report.py): the losses.json of runs over the same text (a run may score a
prefix of it), one table (overall, past the first eviction, per position range, paired means)
and three figures.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Iterable

import numpy as np

from attn_jax import paths as paths_lib


# ------------------------------------------------------------------ results

def write_results(out_dir: str, results: dict[str, np.ndarray], meta: dict,
                  smooth: int = 64) -> dict[str, str]:
  """losses.json ({meta, policies: {label: [loss per position]}}), losses.csv (position,
  one column per policy) and loss.png (running mean over `smooth` positions vs position)."""
  paths = {k: paths_lib.name(paths_lib.run_path(out_dir) / f) for k, f in
           (("json", "losses.json"), ("csv", "losses.csv"), ("png", "loss.png"))}
  summary = {k: summarize(v) for k, v in results.items()}
  with paths_lib.open_for_write(paths["json"]) as f:   # unscored positions (NaN) as null
    json.dump({"meta": meta, "summary": summary,
               "policies": {k: [None if np.isnan(x) else round(float(x), 5) for x in v]
                            for k, v in results.items()}}, f)
  n = max(len(v) for v in results.values())
  with paths_lib.open_for_write(paths["csv"]) as f:   # csv's own \r\n, as with newline=""
    w = csv.writer(f)
    w.writerow(["position"] + list(results))
    for i in range(n):
      w.writerow([i + 1] + [f"{v[i]:.5f}" if i < len(v) and not np.isnan(v[i]) else ""
                            for v in results.values()])
  plot_losses(paths["png"], results, smooth=smooth, title=meta.get("title", ""))
  return paths


def _nanmean(x) -> float:
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  return float(x.mean()) if x.size else float("nan")


def summarize(losses: np.ndarray, parts: int = 4) -> dict:
  """Mean loss (nats) over the whole stream and over `parts` consecutive slices (scored
  positions only: NaN = not scored)."""
  sl = np.array_split(np.asarray(losses, np.float64), parts)
  return {"mean": _nanmean(losses), "slices": [_nanmean(s) for s in sl]}


def summarize_ranges(losses: np.ndarray, edges) -> list[dict]:
  """Mean loss and perplexity over ranges [e_k, e_{k+1}) of the query's position (losses[i]
  is computed at position i, from tokens 0..i, and predicts token i + 1; `edges` are the
  inner boundaries, the stream's ends are added), scored positions only; a range past the
  end of a shorter stream has n = 0 (mean NaN), so that runs of different lengths give the
  same ranges. -> [{"start", "end" (exclusive), "n", "mean", "ppl"}]."""
  v = np.asarray(losses, np.float64)
  pos = np.arange(len(v))
  inner = sorted(int(e) for e in edges if int(e) > 0)
  cuts = [0] + inner + [max([len(v)] + [e + 1 for e in inner])]
  out = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    sel = v[(pos >= a) & (pos < b)]
    sel = sel[~np.isnan(sel)]
    mean = float(sel.mean()) if sel.size else float("nan")
    out.append({"start": a, "end": b, "n": int(sel.size), "mean": mean,
                "ppl": float(np.exp(mean))})
  return out


def scored_from(losses: np.ndarray, start: int) -> np.ndarray:
  """Mask of the scored (not NaN) loss indices >= `start`."""
  mask = ~np.isnan(np.asarray(losses, np.float64))
  mask[:start] = False
  return mask


def paired(results: dict[str, np.ndarray], reference: str, start: int = 0) -> dict[str, float]:
  """Mean loss of every policy at the positions `reference` scored (a subsampled recompute),
  from loss index `start` on (its first window, where the cache policies agree, left out):
  a side-by-side comparison on the same tokens."""
  mask = scored_from(results[reference], start)
  return {k: _nanmean(np.asarray(v, np.float64)[mask]) if len(v) >= len(mask) else float("nan")
          for k, v in results.items()}   # NaN: a policy scored a shorter prefix


def binned_means(losses: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
  """(bin centres, mean loss of the scored positions in each bin of `width` positions)."""
  v = np.asarray(losses, np.float64)
  n = -(-len(v) // width)
  centres, means = [], []
  for b in range(n):
    part = v[b * width:(b + 1) * width]
    part = part[~np.isnan(part)]
    if part.size:
      centres.append(b * width + (min((b + 1) * width, len(v)) - b * width) / 2)
      means.append(part.mean())
  return np.asarray(centres), np.asarray(means)


def running_mean(losses: np.ndarray, smooth: int) -> tuple[np.ndarray, np.ndarray]:
  """(positions k..N, mean loss over the `smooth` positions ending at each; k = the window,
  at most N) of a fully scored stream."""
  v = np.asarray(losses, np.float64)
  k = max(1, min(smooth, len(v)))
  return np.arange(k, len(v) + 1), np.convolve(v, np.ones(k) / k, mode="valid")


def plot_losses(path: str, results: dict[str, np.ndarray], *, smooth: int = 64,
                title: str = "") -> None:
  import matplotlib   # here, not at the top: only the plots need it (slow to import)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for label, v in results.items():
    v = np.asarray(v, np.float64)
    if np.isnan(v).any():     # subsampled: the mean of the scored positions per bin
      x, mean = binned_means(v, max(1, smooth))
      ax.plot(x, mean, label=label, lw=1.2, marker=".", ms=3)
      continue
    ax.plot(*running_mean(v, smooth), label=label, lw=1.2)
  ax.set_xlabel("position in the stream (tokens)")
  ax.set_ylabel(f"loss (nats), mean over {smooth} positions")
  ax.set_title(title or "streaming loss per policy")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  paths_lib.save_figure(fig, path, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------ reports over several runs

def read_results(out_dirs: Iterable[str]) -> tuple[dict[str, np.ndarray], int]:
  """({label: losses (NaN = not scored)}, longest stream's tokens) from the losses.json of
  several `write_results` folders, which must have read the same text (meta "text", "tail");
  a run may score fewer tokens of it (--max_tokens: a prefix of the same stream)."""
  results, source, tokens = {}, None, 0
  for d in out_dirs:
    path = os.path.join(d, "losses.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: no losses.json (an experiments/stream.py output folder?)")
    with open(path) as f:
      data = json.load(f)
    meta = data["meta"]
    src = (meta.get("text"), meta.get("tail", 0.0))
    if source is not None and src != source:
      raise ValueError(f"{path}: read {src[0]!r} (tail {src[1]}), the runs before it "
                       f"{source[0]!r} (tail {source[1]}); a report compares one stream")
    source, tokens = src, max(tokens, int(meta["tokens"]))
    for label, vals in data["policies"].items():
      if label in results:
        raise ValueError(f"{path}: policy {label} is in two of the runs")
      results[label] = np.asarray([np.nan if x is None else x for x in vals], np.float64)
  return results, tokens


def cache_of(label: str) -> int | None:
  """Tokens a policy label keeps ("streaming(4+1020)" -> 1024; "dense" -> None)."""
  if "(" not in label:
    return None
  inner = label[label.index("(") + 1:label.rindex(")")]
  return sum(int(x) for x in inner.split("+"))


def report_table(results: dict[str, np.ndarray], edges) -> dict:
  """Per policy: scored positions, mean NLL and perplexity overall, past its first eviction
  (loss index >= its cache size: the context no longer fits) and per range
  (`summarize_ranges`); per subsampled policy: every policy's mean at the positions it scored
  past its first window, and how many."""
  rows = []
  for label, v in results.items():
    mean, c = _nanmean(v), cache_of(label)
    rows.append({"label": label, "cache": c,
                 "scored": int(np.count_nonzero(~np.isnan(v))), "mean": mean,
                 "ppl": float(np.exp(mean)), "past": _nanmean(v[c:]) if c else None,
                 "ranges": summarize_ranges(v, edges)})
  out = {}
  for k, v in results.items():
    if np.isnan(v).any():
      c = cache_of(k) or 0
      out[k] = {"n": int(scored_from(v, c).sum()),
                "means": paired(results, k, start=c)}
  return {"rows": rows, "paired": out}


def table_markdown(table: dict, tokens: int) -> str:
  rows = table["rows"]
  ranges = rows[0]["ranges"] if rows else []
  head = ["policy", "cache", "scored", "NLL", "ppl", "NLL past eviction"] + [
      f"NLL {r['start']}-{r['end'] - 1}" for r in ranges]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["label"], str(r["cache"] or "all"), str(r["scored"]), f"{r['mean']:.3f}",
             f"{r['ppl']:.2f}", "-" if r["past"] is None else f"{r['past']:.3f}"]
    sparse = any(x["n"] < min(x["end"], r["scored"]) - x["start"] for x in r["ranges"]
                 if x["n"])   # subsampled: say how many positions each mean has
    cells += ["-" if not x["n"] else f"{x['mean']:.3f}" + (f" (n={x['n']})" if sparse else "")
              for x in r["ranges"]]
    lines.append("| " + " | ".join(cells) + " |")
  out = "\n".join(lines)
  if table["paired"]:
    labels = [r["label"] for r in rows]
    lines = ["", "", f"Mean NLL at the positions each subsampled policy scored past its first "
             f"window ({tokens} tokens):", "",
             "| positions of | n | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for ref, p in table["paired"].items():
      lines.append(f"| {ref} | {p['n']} | " + " | ".join(
          "-" if np.isnan(p["means"][k]) else f"{p['means'][k]:.3f}" for k in labels) + " |")
    out += "\n".join(lines)
  return out


def plot_report(path: str, eviction_path: str, results: dict[str, np.ndarray], *,
                bin_width: int = 512, smooth: int = 64, zoom: int = 4096, mark: int = 0,
                paired_path: str | None = None) -> None:
  """`path`: binned mean NLL vs position, one panel per cache size (dense in each; subsampled
  policies left out: single tokens are too noisy to draw against position).
  `eviction_path`: the first `zoom` positions, running mean over `smooth` (lighter shades for
  smaller caches). `paired_path`: per subsampled policy, the loss of each policy of its cache
  size against its own, token by token at the positions it scored past its first window."""
  import matplotlib   # here, not at the top: only the plots need it (slow to import)
  matplotlib.use("Agg")
  import matplotlib.colors as mcolors
  import matplotlib.pyplot as plt
  caches = sorted({c for c in map(cache_of, results) if c})
  base = {"dense": "black", "window": "tab:red", "recompute": "tab:green",
          "streaming": "tab:blue"}

  def draw(ax, label, x, y, marker=None):
    rgb = np.asarray(mcolors.to_rgb(base.get(label.split("(")[0], "gray")))
    c = cache_of(label)
    fade = 0.0 if not c else 0.55 * (len(caches) - 1 - caches.index(c)) / max(1, len(caches) - 1)
    ax.plot(x, y, color=tuple(rgb + (1 - rgb) * fade), marker=marker, ms=3, lw=1.1, label=label)


  fig, axes = plt.subplots(1, max(1, len(caches)), figsize=(6 * max(1, len(caches)), 4),
                           sharey=True, squeeze=False)
  for ax, c in zip(axes[0], caches or [None]):
    for label, v in results.items():
      if cache_of(label) in (None, c) and not np.isnan(v).any():
        draw(ax, label, *binned_means(v, bin_width))
    if mark:
      ax.axvline(mark, color="gray", lw=0.8, ls=":")
    ax.set_title(f"cache {c} tokens" if c else "", fontsize=9)
    ax.set_xlabel("position (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel(f"NLL (nats), mean per {bin_width} positions")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 3.6))
  for label, v in results.items():
    v = np.asarray(v[:zoom], np.float64)
    if np.isnan(v).any():
      continue
    draw(ax, label, *running_mean(v, smooth))
  for c in caches:
    ax.axvline(c, color="gray", lw=0.6, ls=":")
  ax.set_xlabel("position (tokens); dotted: the cache sizes (first eviction)")
  ax.set_ylabel(f"NLL, running mean over {smooth}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(eviction_path, dpi=90)
  plt.close(fig)
  refs = [k for k, v in results.items() if np.isnan(v).any()]
  if not (paired_path and refs):
    return
  fig, axes = plt.subplots(1, len(refs), figsize=(4 * len(refs), 4), squeeze=False)
  for ax, ref in zip(axes[0], refs):
    c = cache_of(ref) or 0
    mask = scored_from(results[ref], c)
    x = results[ref][mask]
    for label, v in results.items():
      if label != ref and cache_of(label) == c and len(v) >= len(mask):
        rgb = mcolors.to_rgb(base.get(label.split("(")[0], "gray"))
        ax.scatter(x, v[mask], s=10, color=rgb, label=label)
    lim = [0, float(np.nanmax([x.max()] + [v[mask].max() for v in results.values()
                                           if len(v) >= len(mask)])) + 0.5]
    ax.plot(lim, lim, color="gray", lw=0.8)
    ax.set_xlabel(f"{ref} NLL ({int(mask.sum())} tokens)")
    ax.set_ylabel("NLL of the same token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(paired_path, dpi=90)
  plt.close(fig)
