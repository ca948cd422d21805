"""Streaming perplexity of a trained model under KV-cache policies (SPEC.md section 3).

  python experiments/stream.py --workdir=runs/stream_tiny --text=input.txt --tail=0.01 \
      --policies=dense,window,recompute,streaming --window=60 --sinks=4 --out=runs/stream_eval

Loads the checkpoint of an `experiments/train.py` run (`load_for_inference`: parameters only),
reads the stream (files concatenated, tokenized with the run's tokenizer unless --tokenizer),
scores it chunk by chunk under each policy (`attn_jax.streaming`) and writes, under --out:
losses.json (per-position losses + summary), losses.csv (one column per policy), loss.png
(running mean vs position, one line per policy). --attention_mass=N also writes the share of
attention each layer puts on the first tokens for N sequences of the stream
(attention_mass.json + attention_mass.png, `attn_jax.eval.attention_mass`).
Policy windows: "window" and "recompute" keep --window + --sinks tokens (the same cache size as
"streaming", which keeps --sinks first tokens + --window recent ones).
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
_WINDOW = flags.DEFINE_integer("window", 1020, "Recent tokens kept by streaming.")
_SINKS = flags.DEFINE_integer("sinks", 4, "First tokens kept by streaming.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Tokens per scoring call (capped at the window).")
_BATCH = flags.DEFINE_integer("batch", 64, "Windows per forward of the recompute policy.")
_SMOOTH = flags.DEFINE_integer("smooth", 64, "Running-mean width of the plot.")
_MASS = flags.DEFINE_integer("attention_mass", 0, "Sequences for the attention-mass diagnostic.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: <workdir>/stream).")
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


def run(workdir, text, *, step=None, tokenizer=None, tail=0.0, max_tokens=0,
        names=("dense", "window", "recompute", "streaming"), window=1020, sinks=4, chunk=256,
        batch=64, smooth=64, mass=0, out=None, progress=True) -> dict:
  if not workdir:
    raise ValueError("--workdir is required (a run directory of experiments/train.py)")
  if not text:
    raise ValueError("--text is required (the files to stream)")
  from attn_jax import streaming
  from attn_jax.train.checkpoint import load_for_inference
  pols = policies(names, window, sinks)
  model, config, ckpt_step = load_for_inference(workdir, step)
  for p in pols:    # clear errors before any scoring
    streaming.check_policy(model.cfg, p)
  tokens = streaming.read_stream(text, tokenizer or config.data.tokenizer, tail=tail,
                                 max_tokens=max_tokens)
  results = {}
  for p in pols:
    results[p.label] = streaming.score_stream(model, tokens, p, chunk=chunk, batch=batch,
                                              progress=progress)
  out = out or os.path.join(workdir, "stream")
  meta = {"workdir": os.path.abspath(workdir), "step": int(ckpt_step), "text": text,
          "tokens": int(len(tokens)), "train_seq_len": int(config.data.seq_len),
          "sink_tokens": int(model.cfg.sink_tokens),
          "title": f"{os.path.basename(os.path.abspath(workdir))}: {len(tokens)} tokens, "
                   f"trained at {config.data.seq_len}"}
  paths = streaming.write_results(out, results, meta, smooth=smooth)
  if mass:
    from attn_jax.eval import attention_mass
    paths.update(attention_mass.run(model, tokens, out, n_seqs=mass,
                                    seq_len=int(config.data.seq_len)))
  return {"paths": paths, "summary": {k: streaming.summarize(v) for k, v in results.items()}}


def main(argv):
  del argv
  res = run(_WORKDIR.value, _TEXT.value, step=_STEP.value, tokenizer=_TOKENIZER.value,
            tail=_TAIL.value, max_tokens=_MAX_TOKENS.value, names=_POLICIES.value,
            window=_WINDOW.value, sinks=_SINKS.value, chunk=_CHUNK.value, batch=_BATCH.value,
            smooth=_SMOOTH.value, mass=_MASS.value, out=_OUT.value, progress=_PROGRESS.value)
  print(f"{'policy':<24}{'mean':>8}  quarters")
  for label, s in res["summary"].items():
    print(f"{label:<24}{s['mean']:8.3f}  " + " ".join(f"{x:.3f}" for x in s["slices"]))
  print(json.dumps(res["paths"], indent=1))


if __name__ == "__main__":
  cli.run(main)
