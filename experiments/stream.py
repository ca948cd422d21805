"""Streaming perplexity of a trained model under KV-cache policies (docs/papers.md §3.2, §8.4).

  python experiments/stream.py --workdir=runs/stream_tiny --text=input.txt --tail=0.01 \
      --policies=window,recompute,streaming --window=60 --sinks=4 --out=runs/stream_eval

Loads the checkpoint of an `experiments/train.py` run (`load_for_inference`: parameters only),
reads the stream (files concatenated, tokenized with the run's tokenizer unless --tokenizer),
scores it chunk by chunk under each policy (`attn_jax.eval.stream_run`, `attn_jax.streaming`)
and writes, under --out: losses.json (per-position losses + summary), losses.csv (one column
per policy), loss.png (running mean vs position, one line per policy). --attention_mass=N also
writes the share of attention each layer puts on the first tokens for N sequences of the stream
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


def main(argv):
  del argv
  from attn_jax import distributed
  from attn_jax.eval.stream_run import run, summary_lines
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
