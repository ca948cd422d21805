"""Time the decayed-attention kernel's Triton choices on a GPU (attn_jax/bench/kernel_tuning.py).

  python experiments/tune_decayed.py --kinds=sisa,fox --seq_lens=2048,8192
  python experiments/tune_decayed.py --quick     # 10 candidates instead of 36
  python experiments/tune_decayed.py --write=tuning.json   # then ATTN_JAX_DECAYED_TUNING=tuning.json

It needs a GPU: elsewhere the kernel runs in the Pallas interpreter, whose times say nothing
about a GPU's (two CPU runs picked different "best" choices), so without one it stops at once
with one line saying so (exit 2). `--dry_run` runs the sweep anyway, as a check of the script
(experiments/device_check.sh's CPU dry run), and writes nothing, whatever --write says:
  python experiments/tune_decayed.py --dry_run --quick --kinds=sisa --seq_lens=128 --tokens=1024
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

flags.DEFINE_list("kinds", ["sisa", "fox"], "sisa (decay + c.b) and/or fox (decay only).")
flags.DEFINE_list("seq_lens", ["2048", "8192"], "Row lengths T.")
flags.DEFINE_integer("tokens", 65536, "Tokens per call (rows = tokens / T).")
flags.DEFINE_integer("head_dim", 64, "Head dim (the 152M presets: 64).")
flags.DEFINE_integer("heads", 12, "Heads.")
flags.DEFINE_integer("d_state", 32, "SISA's c / b width.")
flags.DEFINE_integer("steps", 5, "Timed calls per candidate (best is kept).")
flags.DEFINE_string("write", "", "Write the best choice for --head_dim to this JSON file (read "
                    "by the kernel when $ATTN_JAX_DECAYED_TUNING names it).")
flags.DEFINE_bool("quick", False, "10 candidates (kernel_tuning.quick_candidates) of the 36.")
flags.DEFINE_bool("dry_run", False, "Run without a GPU (the Pallas interpreter: meaningless "
                  "times) to check the script; nothing is written, --write included.")
FLAGS = flags.FLAGS


def needs_gpu(backend: str, dry_run: bool) -> str | None:
  """Why this process must not tune (no GPU, no --dry_run), else None."""
  if backend == "gpu" or dry_run:
    return None
  return (f"tune_decayed.py needs a GPU: JAX's backend here is {backend!r}, where the kernel "
          "runs in the Pallas interpreter and its times say nothing about a GPU's; run it on a "
          "GPU machine, or pass --dry_run to check the script (nothing is written)")


def main(_):
  import jax

  from attn_jax.bench import kernel_tuning
  from attn_jax.kernels import decayed

  problem = needs_gpu(jax.default_backend(), FLAGS.dry_run)
  if problem:
    raise ValueError(problem)
  write = "" if FLAGS.dry_run else FLAGS.write
  if FLAGS.dry_run:
    print(f"tune_decayed.py --dry_run on {jax.default_backend()}: times of the Pallas "
          "interpreter, not a GPU's; nothing is written" + (f" (not {FLAGS.write})"
                                                            if FLAGS.write else ""), flush=True)
  tunings = (kernel_tuning.quick_candidates() if FLAGS.quick else
             kernel_tuning.candidates())
  sweeps = []
  for kind in FLAGS.kinds:
    for T in map(int, FLAGS.seq_lens):
      rows = kernel_tuning.sweep(kind, T, tokens=FLAGS.tokens, H=FLAGS.heads, D=FLAGS.head_dim,
                                 d_state=FLAGS.d_state, steps=FLAGS.steps, tunings=tunings)
      kernel_tuning.print_sweep(kind, T, rows)
      sweeps.append(rows)
      if write:   # after every sweep: a time limit keeps the best so far
        best = kernel_tuning.best_choice(sweeps)
        if best is not None:
          decayed.write_tuning(write, {FLAGS.head_dim: best})
          print(f"best so far (least total time): {best.label()} -> {write}", flush=True)


if __name__ == "__main__":
  cli.run(main)
