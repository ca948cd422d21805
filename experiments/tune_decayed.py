"""Time the decayed-attention kernel's Triton choices on a GPU (attn_jax/bench/kernel_tuning.py).

  python experiments/tune_decayed.py --kinds=sisa,fox --seq_lens=2048,8192
  python experiments/tune_decayed.py --quick     # 10 candidates instead of 36
  python experiments/tune_decayed.py --write=tuning.json   # then ATTN_JAX_DECAYED_TUNING=tuning.json
"""

from absl import app, flags

from attn_jax.bench import kernel_tuning
from attn_jax.kernels import decayed

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
FLAGS = flags.FLAGS


def main(_):
  tunings = (kernel_tuning.quick_candidates() if FLAGS.quick else
             kernel_tuning.candidates())
  sweeps = []
  for kind in FLAGS.kinds:
    for T in map(int, FLAGS.seq_lens):
      rows = kernel_tuning.sweep(kind, T, tokens=FLAGS.tokens, H=FLAGS.heads, D=FLAGS.head_dim,
                                 d_state=FLAGS.d_state, steps=FLAGS.steps, tunings=tunings)
      kernel_tuning.print_sweep(kind, T, rows)
      sweeps.append(rows)
      if FLAGS.write:   # after every sweep: a time limit keeps the best so far
        best = kernel_tuning.best_choice(sweeps)
        if best is not None:
          decayed.write_tuning(FLAGS.write, {FLAGS.head_dim: best})
          print(f"best so far (least total time): {best.label()} -> {FLAGS.write}", flush=True)


if __name__ == "__main__":
  app.run(main)
