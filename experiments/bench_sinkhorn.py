"""Sparse Sinkhorn attention vs dense causal attention: fwd+bwd time and compiled peak temp memory
against sequence length, in one run; writes JSON and a PNG plot and prints the crossover length
(flags in, `attn_jax.bench.sinkhorn_scaling.run` out).

Both sides are whole mixers with the same head configuration (q/k/v/o projections + RoPE):
"dense" is `attend` (kernels/entry.py, causal), "soft" the Sinkhorn mixer with soft sorting
(training mode, Gumbel noise), "sortcut" the same with SortCut (top-m gathered blocks). Memory is the
compiled program's `memory_analysis().temp_size_in_bytes` (activations/residuals, not params).

  python experiments/bench_sinkhorn.py --seq_lens=1024,2048,4096,8192,16384 \
      --out=runs/bench_sinkhorn/result.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096", "8192", "16384"], "Lengths.")
_B = flags.DEFINE_integer("batch", 1, "Batch size.")
_H = flags.DEFINE_integer("heads", 2, "Heads (query = kv heads).")
_D = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_BLOCK = flags.DEFINE_integer("block_size", 128, "Sinkhorn block size b.")
_CUT = flags.DEFINE_integer("n_sortcut", 2, "SortCut blocks m for the sortcut variant.")
_VARIANTS = flags.DEFINE_list("variants", ["dense", "soft", "sortcut"], "What to time.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions after one warm-up (median).")
_DTYPE = flags.DEFINE_string("dtype", "", "float32 | bfloat16 (default: bf16 on GPU, fp32 else)")
_OUT = flags.DEFINE_string("out", "runs/bench_sinkhorn/result.json", "JSON path (PNG beside).")
_FROM = flags.DEFINE_string("from_json", "", "Re-summarise and re-plot a saved result (no timing).")


def main(argv):
  del argv
  from attn_jax.bench import sinkhorn_scaling
  s = sinkhorn_scaling.Setting(batch=_B.value, heads=_H.value, head_dim=_D.value,
                       block_size=_BLOCK.value, n_sortcut=_CUT.value,
                       variants=tuple(_VARIANTS.value), reps=_REPS.value)
  sinkhorn_scaling.run(s, _SEQ.value, out=_OUT.value, dtype=_DTYPE.value, from_json=_FROM.value)


if __name__ == "__main__":
  cli.run(main)
