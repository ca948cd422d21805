"""Measure the attention core's implementations side by side (forward + backward), to justify
what `impl="auto"` picks on this platform. Ratios are what matter; absolute times on shared
machines are noise.

  python experiments/bench_attention.py --seq_lens=1024,4096 --heads=12 --head_dim=64
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["1024"], "Sequence lengths.")
_B = flags.DEFINE_integer("batch", 1, "Batch size.")
_H = flags.DEFINE_integer("heads", 12, "Heads.")
_D = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_DTYPE = flags.DEFINE_string("dtype", "", "float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions (after one warm-up).")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  from attn_jax.attention.core import attend, choose_impl

  plat = jax.default_backend()
  dtype = jnp.dtype(_DTYPE.value or ("bfloat16" if plat == "gpu" else "float32"))
  impls = ["einsum", "xla"] + (["cudnn"] if plat == "gpu" else [])
  print(f"platform={plat} dtype={dtype.name} auto->{choose_impl('auto', dtype, _D.value)}")
  for L in map(int, _SEQ.value):
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (_B.value, L, _H.value, _D.value), dtype) for kk in ks)
    times = {}
    for impl in impls:
      def loss(q, k, v, impl=impl):
        return attend(q, k, v, scale=_D.value ** -0.5, impl=impl).astype(jnp.float32).sum()
      f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      try:
        jax.block_until_ready(f(q, k, v))
      except Exception as e:  # an implementation this platform lacks
        print(f"  L={L} {impl}: unavailable ({type(e).__name__}: {str(e)[:80]})")
        continue
      t = time.perf_counter()
      for _ in range(_REPS.value):
        jax.block_until_ready(f(q, k, v))
      times[impl] = (time.perf_counter() - t) / _REPS.value
    base = times.get("einsum")
    for impl, t in times.items():
      print(f"  L={L:6d} {impl:7s} fwd+bwd {t * 1e3:9.2f} ms   x{base / t:5.2f} vs einsum")


if __name__ == "__main__":
  app.run(main)
