"""Streaming perplexity of a trained model under KV-cache policies (docs/papers.md §3.2, §8.4).

  python experiments/stream.py --workdir=runs/stream_tiny --text=input.txt --tail=0.01 \
      --policies=window,recompute,streaming --window=60 --sinks=4 --out=runs/stream_eval

Loads the checkpoint of an `experiments/train.py` run (`load_for_inference`: parameters only),
reads the stream (files concatenated, tokenized with the run's tokenizer unless --tokenizer),
scores it chunk by chunk under each policy (`attn_jax.streaming`) and writes, under --out:
losses.json (per-position losses + summary), losses.csv (one column per policy), loss.png
(running mean vs position, one line per policy). --attention_mass=N also writes the share of
attention each layer puts on the first tokens for N sequences of the stream
(attention_mass.json + attention_mass.png, `attn_jax.eval.attention_mass`).
Policy windows: "window" and "recompute" keep --window + --sinks tokens (the same cache size as
"streaming", which keeps --sinks first tokens + --window recent ones); the default --window=0
is what the model holds: its model.max_seq_len as trained minus --sinks. --allow_unverified
loads a checkpoint step that has no checksum manifest (refused otherwise).

A pretrained model (a run directory of experiments/convert.py; docs/pretrained_streaming.md):

  python experiments/stream.py --workdir=runs/smollm2 --text=input.txt --max_tokens=20481 \
      --policies=dense,window,streaming --window=1020 --sinks=4 --max_seq_len=20480 \
      --ranges=8192,16384 --out=runs/smollm2_stream

--max_seq_len raises the loaded run's config.model.max_seq_len (`streaming.with_max_seq_len`):
"dense" refuses a stream longer than the model's max_seq_len without it, since past it dense
attention runs positions the model was not trained at. --recompute_stride=S scores "recompute"
at every S-th position past its first window (one window forward per scored token); the
summary then also compares every policy at those positions. --ranges: position boundaries of
the per-range summary (summary.json). --sink_mass=N writes the per-layer mass on token 0, the
first 4 tokens and the last --mass_local tokens for N sequences of --mass_len tokens
(sink_mass.json, sink_mass.png, sink_mass_heads.png; `attention_mass.sink_profile`);
--policies= (empty) skips the scoring.

The output folder is checked before any work (`attn_jax.outputs`): an --out that cannot be
written is an error at once; a run directory that cannot be written (a read-only mount, a
shared copy of a colleague's run) sends the results to a fallback folder named at start and in
the printed paths.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (holds checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_TEXT = flags.DEFINE_string("text", None, "Comma-separated text files: the stream.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Default: the run's data.tokenizer.")
_TAIL = flags.DEFINE_float("tail", 0.0, "Score only the last fraction of the stream (0 = all).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 0, "At most this many tokens (0 = all).")
_POLICIES = flags.DEFINE_list("policies", ["dense", "window", "recompute", "streaming"],
                              "Cache policies to compare.")
_WINDOW = flags.DEFINE_integer("window", 0, "Recent tokens kept by streaming (0 = what the "
                              "model holds: its max_seq_len minus --sinks).")
_SINKS = flags.DEFINE_integer("sinks", 4, "First tokens kept by streaming.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Tokens per scoring call (capped at the window).")
_BATCH = flags.DEFINE_integer("batch", 64, "Windows per forward of the recompute policy.")
_SMOOTH = flags.DEFINE_integer("smooth", 64, "Running-mean width of the plot.")
_MASS = flags.DEFINE_integer("attention_mass", 0, "Sequences for the attention-mass diagnostic.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 0, "Raise config.model.max_seq_len of the "
                                    "run to this (a config override; 0 = as trained).")
_STRIDE = flags.DEFINE_integer("recompute_stride", 1, "Score recompute at every S-th position "
                               "past its first window.")
_RANGES = flags.DEFINE_list("ranges", [], "Position boundaries of the per-range summary.")
_SINK_MASS = flags.DEFINE_integer("sink_mass", 0, "Sequences for the per-layer sink profile.")
_MASS_LEN = flags.DEFINE_integer("mass_len", 0, "Tokens per attention-mass sequence (0 = the "
                                 "run's data.seq_len).")
_MASS_LOCAL = flags.DEFINE_integer("mass_local", 32, "Sink profile: the local neighbourhood "
                                   "(most recent keys, the query included).")
_MASS_MIN_QUERY = flags.DEFINE_integer("mass_min_query", 64, "Sink profile: first query "
                                       "position counted.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: <workdir>/stream; a run "
                           "directory that cannot be written: a fallback folder, named).")
_UNVERIFIED = flags.DEFINE_bool("allow_unverified", False, "Load a checkpoint step that has no "
                                "checksum manifest (its bytes cannot be verified).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bar.")


def policies(names, window, sinks):
  from attn_jax.streaming import StreamPolicy
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
  from attn_jax import outputs, streaming
  from attn_jax import paths as paths_lib
  from attn_jax.eval import stream_reports
  from attn_jax.train.checkpoint import load_for_inference, run_checkpoints
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
          "tail": float(tail), "tokens": int(len(tokens)), "train_seq_len": int(config.data.seq_len),
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
    from attn_jax.eval import attention_mass
    paths.update(attention_mass.run(model, tokens, out, n_seqs=mass, seq_len=mass_len))
  if sink_mass:
    from attn_jax.eval import attention_mass
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


def main(argv):
  del argv
  from attn_jax import distributed
  distributed.require_one_process("stream.py")   # one process reads a run; it joins no cluster
  res = run(_WORKDIR.value, _TEXT.value, step=_STEP.value, tokenizer=_TOKENIZER.value,
            tail=_TAIL.value, max_tokens=_MAX_TOKENS.value, names=_POLICIES.value,
            window=_WINDOW.value, sinks=_SINKS.value, chunk=_CHUNK.value, batch=_BATCH.value,
            smooth=_SMOOTH.value, mass=_MASS.value, out=_OUT.value, progress=_PROGRESS.value,
            max_seq_len=_MAX_SEQ_LEN.value, stride=_STRIDE.value, ranges=_RANGES.value,
            sink_mass=_SINK_MASS.value, mass_len=_MASS_LEN.value, mass_local=_MASS_LOCAL.value,
            mass_min_query=_MASS_MIN_QUERY.value, allow_unverified=_UNVERIFIED.value)
  print("\n".join(summary_lines(res["summary"])))
  print(json.dumps(res["paths"], indent=1))


if __name__ == "__main__":
  cli.run(main)
