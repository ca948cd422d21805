"""One streaming evaluation of a trained run, as experiments/stream.py runs it: the stream
read and scored chunk by chunk under each cache policy (`attn_jax.streaming`), the results
written into the run's `stream/` folder or --out (`stream_reports`), and the attention-mass
diagnostics on request (`eval.attention_mass`). Every argument is checked before the model
loads, and the output folder before any work (`attn_jax.outputs`).

Policy windows: "window" and "recompute" keep `window + sinks` tokens (the same cache size as
"streaming", which keeps `sinks` first tokens + `window` recent ones); `window` 0 is what the
model holds (`default_window`).
"""

from __future__ import annotations

import json

from attn_jax import outputs, paths as paths_lib, streaming
from attn_jax.eval import attention_mass, stream_reports
from attn_jax.streaming import StreamPolicy
from attn_jax.train.checkpoint import load_for_inference, run_checkpoints

def policies(names, window, sinks):
  out = []
  for name in names:
    if name == "streaming":
      out.append(StreamPolicy("streaming", window=window, sinks=sinks))
    elif name == "dense":
      out.append(StreamPolicy("dense"))
    else:
      out.append(StreamPolicy(name, window=window + sinks))
  for p in out:
    p.validate()
  return out


def default_window(max_seq_len: int, sinks: int) -> int:
  """--window=0: the most recent tokens the model holds beside the sinks (its trained
  max_seq_len - sinks, whatever --max_seq_len says), so every policy's span is the length the
  model was trained at."""
  window = int(max_seq_len) - int(sinks)
  if window < 1:
    raise ValueError(f"--sinks={sinks} leaves no room for a window in model.max_seq_len="
                     f"{max_seq_len}")
  return window


def check_dense_length(cfg, pols, n_tokens: int) -> None:
  """Dense attention over a stream longer than the model's max_seq_len runs untrained
  positions: only when asked for (--max_seq_len). The model reads all tokens but the last
  (which is only predicted): positions 0..n_tokens - 2."""
  if any(p.name == "dense" for p in pols) and n_tokens - 1 > cfg.max_seq_len:
    raise ValueError(f"policy dense: the stream feeds {n_tokens - 1} tokens to the model, more "
                     f"than model.max_seq_len={cfg.max_seq_len}; pass --max_seq_len="
                     f"{n_tokens - 1} to score positions past the model's length, or "
                     "--max_tokens")


def _ranges(values) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ValueError(f"--ranges must be integers (positions), got {list(values)}") from None


def run(workdir, text, *, step=None, tokenizer=None, tail=0.0, max_tokens=0,
        names=("dense", "window", "recompute", "streaming"), window=0, sinks=4, chunk=256,
        batch=64, smooth=64, mass=0, out=None, progress=True, max_seq_len=0, stride=1,
        ranges=(), sink_mass=0, mass_len=0, mass_local=32, mass_min_query=64,
        allow_unverified=False) -> dict:
  """Scores the stream under each policy; `window` 0 = what the model holds
  (`default_window`)."""
  if not workdir:
    raise ValueError("--workdir is required (a run directory of experiments/train.py)")
  if not text:
    raise ValueError("--text is required (the files to stream)")
  if window < 0:
    raise ValueError(f"--window must be >= 0 (0 = what the model holds), got {window}")
  policies(names, window or 1, sinks)   # names and numbers checked before the model loads
  edges = _ranges(ranges)
  if stride < 1:
    raise ValueError(f"--recompute_stride must be >= 1, got {stride}")
  run_checkpoints(workdir)   # a run directory, before any folder is made in it
  if names or mass or sink_mass:   # the output folder, writable, before any work
    out = outputs.results_folder(workdir, "stream", explicit=out, flag="--out").path
  model, config, ckpt_step = load_for_inference(workdir, step, allow_unverified=allow_unverified)
  trained_len = int(model.cfg.max_seq_len)
  if max_seq_len:
    model = streaming.with_max_seq_len(model, max_seq_len)
  pols = policies(names, window or default_window(trained_len, sinks), sinks)
  for p in pols:    # clear errors before any scoring
    streaming.check_policy(model.cfg, p)
  tokens = streaming.read_stream(text, tokenizer or config.data.tokenizer, tail=tail,
                                 max_tokens=max_tokens)
  check_dense_length(model.cfg, pols, len(tokens))
  results = {}
  for p in pols:
    results[p.label] = streaming.score_stream(model, tokens, p, chunk=chunk, batch=batch,
                                              progress=progress, stride=stride)
  meta = {"workdir": paths_lib.name(workdir), "step": int(ckpt_step), "text": text,
          "tail": float(tail), "tokens": int(len(tokens)),
          "train_seq_len": int(config.data.seq_len),
          "model_max_seq_len": trained_len, "max_seq_len_override": int(max_seq_len),
          "recompute_stride": int(stride), "sink_tokens": int(model.cfg.sink_tokens),
          "title": f"{paths_lib.run_path(workdir).name}: {len(tokens)} tokens, "
                   f"trained at {config.data.seq_len}"}
  summary = {k: stream_reports.summarize(v) for k, v in results.items()}
  paths = {}
  if results:
    for k, v in results.items():
      if edges:
        summary[k]["ranges"] = stream_reports.summarize_ranges(v, edges)
    sub = [p for p in pols if p.name == "recompute" and stride > 1]
    extra = {"paired": {p.label: stream_reports.paired(results, p.label, start=p.window)
                        for p in sub}}   # past recompute's first window

    def write() -> dict:
      written = stream_reports.write_results(out, results, meta, smooth=smooth)
      written["summary"] = paths_lib.name(paths_lib.run_path(out) / "summary.json")
      with paths_lib.open_for_write(written["summary"]) as f:
        json.dump({"meta": meta, "summary": summary, **extra}, f, indent=1)
      return written

    paths = outputs.write_or_print(write, "\n".join(summary_lines(summary)), out, flag="--out")
  mass_len = int(mass_len or config.data.seq_len)
  if mass:
    paths.update(attention_mass.run(model, tokens, out, n_seqs=mass, seq_len=mass_len))
  if sink_mass:
    paths.update(attention_mass.run_sink_profile(model, tokens, out, n_seqs=sink_mass,
                                                 seq_len=mass_len, local=mass_local,
                                                 min_query=mass_min_query))
  return {"paths": paths, "summary": summary}


def summary_lines(summary: dict) -> list[str]:
  """The table main prints: each policy's mean loss and its quarters (or --ranges)."""
  lines = [f"{'policy':<24}{'mean':>8}  quarters / ranges"]
  for label, s in summary.items():
    parts = s.get("ranges") or [{"mean": x} for x in s["slices"]]
    lines.append(f"{label:<24}{s['mean']:8.3f}  " + " ".join(f"{x['mean']:.3f}" for x in parts))
  return lines
