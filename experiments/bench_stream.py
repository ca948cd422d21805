"""Streaming benchmark (docs/papers.md §3.2) on a tiny randomly initialised model: per-token
decoding time of StreamingLLM vs sliding window with re-computation, and the streaming cache's
constant memory over a long stream (flags in, `attn_jax.bench.stream.run` out; what is timed
and how: attn_jax/bench/stream.py).

  python experiments/bench_stream.py --out=runs/bench_stream.json
Prints a table and writes JSON.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "runs/bench_stream.json", "JSON output.")
_CACHES = flags.DEFINE_list("caches", ["1024", "4096"], "Cache sizes L.")
_MIXERS = flags.DEFINE_list("mixers", ["attention", "sisa"], "Mixers to time.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed tokens per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternated measurements (medians reported).")
_LONG = flags.DEFINE_integer("long", 1_000_000, "Stream length of the memory check (0 = skip).")
_CHUNK = flags.DEFINE_integer("chunk", 1020, "Chunk of the memory check.")


def main(argv):
  del argv
  from attn_jax.bench import stream
  stream.run(_MIXERS.value, [int(L) for L in _CACHES.value], reps=_REPS.value,
             repeats=_REPEATS.value, long=_LONG.value, chunk=_CHUNK.value, out=_OUT.value)


if __name__ == "__main__":
  cli.run(main)
