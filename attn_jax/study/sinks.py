"""The attention-sink study's stream phase (configs/study_sinks.py): every trained run streamed
far past its cache under StreamingLLM's layouts, and the attention mass on its first tokens.

Streams. The held-out stream s (the data's eval split, `lm.heldout_stream`), its first
`study.sink_stream_tokens` tokens, is scored token by token (`streaming.score_stream`) under
  dense                every token kept (past the training length: positions never trained)
  window(W)            the last W tokens (the first ones evicted)
  recompute(W)         a fresh forward over the last W tokens for every token
  streaming(k+(W-k))   the first k tokens + the last W - k (positions inside the cache), k in
                       `study.sink_keep`; k = 0 is window(W) with positions re-assigned
with W = `study.sink_cache`. For a model with sink tokens the sink token is the stream's
first position, so k counts it (the paper's 1 + 1023 keeps just the sink). The figure is the
mean NLL (nats per token) over the targets past the first W (where the layouts differ).

The question (StreamingLLM's Table 3 claim): is NLL at 1 + (W - 1) within
`study.sink_tolerance` (0.05) nats of NLL at 4 + (W - 4) for the sink-token model, on every
seed, and not for the vanilla model? `answers` says it per variant.

Attention mass (`attention_mass.attention_maps`: each softmax layer's probabilities,
[B, H, T', T' + 1], sink tokens first, the sink-logit column last) on `study.sink_mass_seqs`
held-out windows of the training length L, queries at positions >= `study.sink_mass_min_query`
(of the real tokens), mean over heads, sequences and queries, per layer:
  sink    the sink-token column(s) (0 without sink tokens)
  first1  the first real token; first4  the first four real tokens
  null    the sink-logit column (softmax1 / learned; 0 without)
The seed's "37% lower" figure (a sink token lowers the attention on the initial tokens by 37%
on average) is checked as 1 - first4(sink_token) / first4(vanilla), per layer, then averaged
over layers and seeds (`first_token_drop`).

Per run the results go to <run>/sink_stream.json (skipped when present with the same key, so a
rerun resumes); the study's results.json gets them under "sinks".
"""

from __future__ import annotations

import os
import time
from typing import Callable

import ml_collections
import numpy as np

from attn_jax import jsonio, streaming
from attn_jax.eval.attention_mass import attention_maps, spread_windows
from attn_jax.eval.stream_reports import binned_means
from attn_jax.streaming import StreamPolicy
from attn_jax.study.lm import heldout_stream
from attn_jax.study.tables import markdown_table as _table, spread
from attn_jax.train.checkpoint import load_for_inference

SINK_RESULT = "sink_stream.json"
BIN = 64                                   # positions per bin of the stored NLL curves


def policies(s: ml_collections.ConfigDict) -> list:
  """The StreamPolicy list of the study (module docstring), references first."""
  W = int(s.sink_cache)
  keep = [int(k) for k in s.sink_keep]
  if any(not 0 <= k < W for k in keep):
    raise ValueError(f"config.study.sink_keep: every kept count must be in [0, "
                     f"study.sink_cache={W}), got {keep}")
  pols = [StreamPolicy("dense"), StreamPolicy("window", window=W),
          StreamPolicy("recompute", window=W)]
  pols += [StreamPolicy("streaming", window=W - k, sinks=k) for k in keep]
  for p in pols:
    p.validate()
  return pols


def layout(k: int, W: int) -> str:
  """The table's name of the layout keeping k first tokens: "1+127"."""
  return f"{k}+{W - k}"


def label_of(policy) -> str:
  """Short names: dense, window, recompute, or the layout k+(W-k)."""
  if policy.name == "streaming":
    return layout(policy.sinks, policy.sinks + policy.window)
  return policy.name


def stream_tokens(config: ml_collections.ConfigDict) -> np.ndarray:
  """The held-out stream, its first `study.sink_stream_tokens` tokens (fewer if it is shorter;
  at least the cache plus 2, else an error naming the fields)."""
  s = config.study
  tokens = heldout_stream(config)[: int(s.sink_stream_tokens)]
  if len(tokens) < int(s.sink_cache) + 2:
    raise ValueError(f"config.study.sink_stream_tokens: the held-out stream has {len(tokens)} "
                     f"tokens, too few to stream past study.sink_cache={s.sink_cache} (raise "
                     "data.eval_fraction or lower study.sink_cache)")
  return tokens


def _mass_rows(maps, n_sink: int, min_query: int) -> list[dict]:
  rows = []
  for i, p in enumerate(maps):
    if p is None:
      rows.append({"layer": i, "softmax": False})
      continue
    p = np.asarray(p[:, :, n_sink + min_query:], np.float64)   # [B, H, Q, T' + 1]
    m = p.mean(axis=(0, 1, 2))                                   # [T' + 1]
    rows.append({"layer": i, "softmax": True, "sink": float(m[:n_sink].sum()),
                 "first1": float(m[n_sink]), "first4": float(m[n_sink:n_sink + 4].sum()),
                 "null": float(m[-1])})
  return rows


def attention_mass(model, tokens: np.ndarray, *, seq_len: int, n_seqs: int,
                   min_query: int) -> list[dict]:
  """Per-layer mass (module docstring) on `n_seqs` windows spread over `tokens`."""
  import jax.numpy as jnp

  L = min(int(seq_len), len(tokens))
  if L <= min_query + 4:
    raise ValueError(f"config.study.sink_mass_min_query={min_query}: windows of {L} tokens "
                     "leave no query past the first tokens")
  batch, _ = spread_windows(tokens, n_seqs, L)
  return _mass_rows(attention_maps(model, jnp.asarray(batch)), int(model.cfg.sink_tokens),
                    min_query)


def _key(config) -> dict:
  s = config.study
  return {k: (list(s[k]) if isinstance(s[k], tuple) else s[k])
          for k in ("sink_cache", "sink_keep", "sink_stream_tokens", "sink_chunk",
                    "sink_mass_seqs", "sink_mass_min_query")}


def stream_run(config: ml_collections.ConfigDict, run: dict, log: Callable) -> dict:
  """The stream scores and attention mass of one finished run (cached in its folder)."""
  run_dir = run["workdir"]
  path = os.path.join(run_dir, SINK_RESULT)
  key = _key(config)
  if os.path.isfile(path):
    rec = jsonio.read(path)
    if rec.get("key") == key:
      return rec
  s = config.study
  W = int(s.sink_cache)
  t0 = time.perf_counter()
  model, _, step = load_for_inference(run_dir)
  tokens = stream_tokens(config)
  dense_model = streaming.with_max_seq_len(model, max(len(tokens), model.cfg.max_seq_len))
  nll, curves, skipped = {}, {}, {}
  for p in policies(s):
    name = label_of(p)
    try:
      losses = streaming.score_stream(dense_model if p.name == "dense" else model, tokens, p,
                                      chunk=int(s.sink_chunk), batch=32, progress=False)
    except ValueError as e:          # a layout this mixer's cache cannot hold: said, not hidden
      skipped[name] = str(e)
      continue
    nll[name] = float(np.nanmean(losses[W:]))
    centres, means = binned_means(losses, BIN)
    curves[name] = {"x": centres.tolist(), "nll": means.tolist()}
  mass = attention_mass(model, tokens, seq_len=int(config.data.seq_len),
                        n_seqs=int(s.sink_mass_seqs), min_query=int(s.sink_mass_min_query))
  rec = {"key": key, "variant": run["variant"], "seed": run["seed"], "step": int(step),
         "tokens": int(len(tokens)), "cache": W, "nll": nll, "curves": curves,
         "skipped": skipped, "mass": mass, "wall_s": time.perf_counter() - t0}
  jsonio.write(rec, path)
  log(f"[study] {run['variant']} seed {run['seed']}: streamed {len(tokens)} tokens, "
      + ", ".join(f"{k} {v:.3f}" for k, v in nll.items()))
  return rec


def stream_all(config: ml_collections.ConfigDict, runs: list[dict], log: Callable) -> dict:
  """`stream_run` for every finished run -> results.json's "sinks" entry."""
  t0 = time.perf_counter()
  recs = [stream_run(config, r, log) for r in runs]
  s = config.study
  return {"cache": int(s.sink_cache), "keep": [int(k) for k in s.sink_keep],
          "tolerance": float(s.sink_tolerance), "runs": recs,
          "wall_s": sum(r["wall_s"] for r in recs), "this_invocation_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------- report

def _by_variant(sinks: dict, variants: list[str]) -> dict[str, list[dict]]:
  out = {v: [] for v in variants}
  for r in sinks["runs"]:
    out.setdefault(r["variant"], []).append(r)
  return out


def columns(sinks: dict) -> list[str]:
  W = sinks["cache"]
  return ["dense", "window", "recompute"] + [layout(k, W) for k in sinks["keep"]]


def gap(rec: dict, sinks: dict, k: int = 1, ref: int = 4) -> float | None:
  """NLL at k + (W - k) minus NLL at ref + (W - ref) for one run (None if either is missing)."""
  W = sinks["cache"]
  a, b = rec["nll"].get(layout(k, W)), rec["nll"].get(layout(ref, W))
  return None if a is None or b is None else a - b


def answers(sinks: dict, variants: list[str]) -> dict[str, bool | None]:
  """Per variant: is NLL at 1 + (W - 1) within the tolerance of 4 + (W - 4) on every seed?"""
  out = {}
  for v, recs in _by_variant(sinks, variants).items():
    gaps = [gap(r, sinks) for r in recs]
    out[v] = None if not gaps or None in gaps else all(
        abs(g) <= sinks["tolerance"] for g in gaps)
  return out


def stream_table(sinks: dict, variants: list[str]) -> str:
  W, tol = sinks["cache"], sinks["tolerance"]
  cols = columns(sinks)
  head = (["model", "seeds"] + [c if c in ("dense",) else f"{c}({W})" if c in
                                ("window", "recompute") else c for c in cols]
          + [f"{layout(1, W)} minus {layout(4, W)}", f"within {tol:g}?"])
  ans = answers(sinks, variants)
  rows = []
  for v, recs in _by_variant(sinks, variants).items():
    if not recs:
      continue
    row = [v, str(len(recs))] + [spread([r["nll"].get(c) for r in recs], 1.0, 3, minmax=False)
                                 for c in cols]
    row.append(spread([gap(r, sinks) for r in recs], 1.0, 3))
    row.append({True: "yes", False: "no", None: "n/a"}[ans[v]])
    rows.append(row)
  return _table(head, rows)


def mass_table(sinks: dict, variants: list[str]) -> str:
  """Per variant and layer: sink / first1 / first4 / null (%; mean ± std over seeds)."""
  by = _by_variant(sinks, variants)
  n_layers = max((len(r["mass"]) for r in sinks["runs"]), default=0)
  rows = []
  for v, recs in by.items():
    for i in range(n_layers):
      cells = [r["mass"][i] for r in recs if i < len(r["mass"]) and r["mass"][i]["softmax"]]
      if not cells:
        continue
      rows.append([v, str(i)] + [spread([c[k] for c in cells], 100.0, 1, minmax=False)
                                 for k in ("sink", "first1", "first4", "null")])
  return _table(["model", "layer", "sink token %", "first real token %",
                 "first 4 real tokens %", "sink-logit column %"], rows)


def first_token_drop(sinks: dict, model: str = "sink_token",
                     reference: str = "vanilla") -> dict | None:
  """1 - first4(model) / first4(reference) per layer (seed means), and its mean over layers:
  the check of the "37% lower" figure. None when either model is missing."""
  def per_layer(v):
    recs = [r for r in sinks["runs"] if r["variant"] == v]
    if not recs:
      return None
    return np.mean([[row.get("first4", np.nan) for row in r["mass"]] for r in recs], axis=0)
  a, b = per_layer(model), per_layer(reference)
  if a is None or b is None:
    return None
  drop = 1.0 - a / np.where(b > 0, b, np.nan)
  return {"per_layer": [float(x) for x in drop], "mean": float(np.nanmean(drop)),
          "model": model, "reference": reference}


# The paper's Table 3 (StreamingLLM, 160M Pythia-recipe models, perplexity, cache 1024), the
# 1 + 1023 column as docs/papers.md §3.3 records it; our rows that correspond.
PAPER_1_PLUS = {"vanilla": ("vanilla", 18.49), "softmax1": ("zero sink (softmax1)", 19.90),
                "sink_token": ("learnable sink token", 18.01)}


def paper_rows(sinks: dict, variants: list[str]) -> str:
  """Row by row against the paper's 1 + 1023 column: their perplexity, our 1 + (W - 1) and its
  excess over 4 + (W - 4) (nats, the quantity the claim is about), and the answer."""
  W = sinks["cache"]
  ans = answers(sinks, variants)
  by = _by_variant(sinks, variants)
  rows = []
  for v, (name, ppl) in PAPER_1_PLUS.items():
    recs = by.get(v) or []
    if not recs:
      continue
    gaps = [gap(r, sinks) for r in recs]
    ones = [r["nll"].get(layout(1, W)) for r in recs]
    rows.append([name, f"{ppl:.2f}", v,
                 ", ".join("-" if x is None else f"{x:.3f}" for x in ones),
                 ", ".join("-" if g is None else f"{g:+.3f}" for g in gaps),
                 {True: "yes", False: "no", None: "n/a"}[ans[v]]])
  return _table(["paper row", "paper ppl at 1+1023", "our model",
                 f"our NLL at {layout(1, W)} (per seed)",
                 f"minus {layout(4, W)} (per seed)",
                 f"within {sinks['tolerance']:g} on every seed?"], rows)


def verdict(sinks: dict, variants: list[str]) -> str:
  """The plain answer to the study's question, from the numbers."""
  ans = answers(sinks, variants)
  W, tol = sinks["cache"], sinks["tolerance"]
  s, v = ans.get("sink_token"), ans.get("vanilla")
  word = {True: "yes", False: "no", None: "not measured"}
  claim = (s is True) and (v is False)
  return (f"At {layout(1, W)}, is the sink-token model's streaming NLL within {tol:g} nats/token "
          f"of its {layout(4, W)} NLL on every seed? {word[s]}. The vanilla model's? {word[v]}. "
          f"The paper's claim (sink token: yes; vanilla: no) "
          f"{'holds' if claim else 'does not hold'} here.")


def sinks_markdown(res: dict, heading: str) -> list[str]:
  """The study section's sink parts (tables and the computed answer)."""
  sinks = res.get("sinks")
  if not sinks or not sinks.get("runs"):
    return []
  variants = list(res["variants"])
  W = sinks["cache"]
  tok = sorted({r["tokens"] for r in sinks["runs"]})
  drop = first_token_drop(sinks)
  parts = [f"{heading} Streaming NLL past the cache (nats/token; cache {W}; "
           f"{'/'.join(map(str, tok))} held-out tokens streamed, mean over the targets past "
           f"the first {W}; mean ± std over seeds; streaming and attention mass of all runs "
           f"{sinks['wall_s'] / 60:.1f} min wall)",
           stream_table(sinks, variants),
           "**" + verdict(sinks, variants) + "**",
           f"{heading} Against the paper's Table 3, row by row (its 1 + 1023 column; "
           "perplexity of 160M models, cache 1024)", paper_rows(sinks, variants),
           f"{heading} Attention mass per layer (held-out windows of the training length; "
           "mean ± std over seeds)", mass_table(sinks, variants)]
  if drop is not None:
    parts.append(
        f"Attention on the first 4 real tokens, sink_token vs vanilla: "
        f"{100 * drop['mean']:.0f}% lower on average over layers (per layer: "
        + ", ".join(f"{100 * x:.0f}%" for x in drop["per_layer"])
        + "); the figure to check is 37% lower.")
  skipped = [f"{r['variant']}/seed{r['seed']}: {k}: {why}" for r in sinks["runs"]
             for k, why in r.get("skipped", {}).items()]
  if skipped:
    parts.append("Not run:\n" + "\n".join(f"- {x}" for x in skipped))
  return parts


def plot_layouts(res: dict, path: str) -> None:
  """NLL past the cache against the layout (kept first tokens), one line per model (mean,
  band min–max over seeds), recompute as the dotted reference."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sinks = res["sinks"]
  W = sinks["cache"]
  names = [layout(k, W) for k in sinks["keep"]]
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  for v, recs in _by_variant(sinks, list(res["variants"])).items():
    if not recs:
      continue
    y = np.array([[r["nll"].get(n, np.nan) for n in names] for r in recs], np.float64)
    line, = ax.plot(range(len(names)), np.nanmean(y, 0), marker="o", label=v, lw=1.5)
    if len(recs) > 1:
      ax.fill_between(range(len(names)), np.nanmin(y, 0), np.nanmax(y, 0),
                      color=line.get_color(), alpha=0.15)
    rec = [r["nll"].get("recompute", np.nan) for r in recs]
    ax.axhline(np.nanmean(rec), color=line.get_color(), lw=0.8, ls=":")
  ax.set_xticks(range(len(names)), [f"{n}\n(kept first + recent)" for n in names])
  ax.set_ylabel("held-out NLL past the cache (nats/token)")
  ax.set_title(f"streaming with cache {W} (dotted: recompute({W}) of each model)", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, format="png")
  plt.close(fig)
