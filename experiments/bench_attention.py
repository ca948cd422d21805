"""Measure the attention core's implementations side by side (forward + backward), to justify
what `impl="auto"` picks on this platform. Ratios are what matter; absolute times on shared
machines are noise.

  python experiments/bench_attention.py --seq_lens=1024,4096 --batch=4 --heads=8 --head_dim=64
  python experiments/bench_attention.py --impls=blocked --chunks=128,256,512   # chunk sweep
  python experiments/bench_attention.py --sink                                 # with sink logits

Each implementation is timed as jit(grad(sum(attend(q, k, v)))) w.r.t. q, k, v (causal,
no positions); the best wall time (and best process CPU time: steadier on a shared machine)
of --reps runs after one warm-up. "blocked@c" is the blocked path
with query chunks of c rows.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["1024"], "Sequence lengths.")
_B = flags.DEFINE_integer("batch", 4, "Batch size.")
_H = flags.DEFINE_integer("heads", 8, "Heads.")
_D = flags.DEFINE_integer("head_dim", 64, "Head dim (Q/K width).")
_DV = flags.DEFINE_integer("v_dim", 0, "V width (0 = head_dim).")
_DTYPE = flags.DEFINE_string("dtype", "", "float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (after one warm-up); best is shown.")
_IMPLS = flags.DEFINE_list("impls", [], "Implementations (default: all this platform has).")
_CHUNKS = flags.DEFINE_list("chunks", [], "Query chunk sizes of the blocked path to sweep.")
_SINK = flags.DEFINE_bool("sink", False, "Pass a per-head sink logit.")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from attn_jax.kernels.dense import DEFAULT_CHUNK
  from attn_jax.kernels.entry import attend
  from attn_jax.kernel_choice import attention_impl

  plat = jax.default_backend()
  dtype = jnp.dtype(_DTYPE.value or ("bfloat16" if plat == "gpu" else "float32"))
  impls = _IMPLS.value or (["einsum", "xla", "blocked"] + (["cudnn"] if plat == "gpu" else [])
                           + (["splash"] if plat == "tpu" else []))
  runs = []
  for impl in impls:
    if impl == "blocked":
      runs += [("blocked", int(c)) for c in (_CHUNKS.value or [DEFAULT_CHUNK])]
    else:
      runs.append((impl, None))
  dv = _DV.value or _D.value
  print(f"platform={plat} dtype={dtype.name} B={_B.value} H={_H.value} Dqk={_D.value} "
        f"Dv={dv} sink={_SINK.value} auto->{attention_impl('auto', dtype, _D.value)}")
  rng = np.random.default_rng(0)
  for L in map(int, _SEQ.value):
    q, k = (jnp.asarray(rng.standard_normal((_B.value, L, _H.value, _D.value)), dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((_B.value, L, _H.value, dv)), dtype)
    sink = jnp.zeros((_H.value,), jnp.float32) if _SINK.value else None
    times, cpu = {}, {}
    for impl, chunk in runs:
      name = impl if chunk is None else f"{impl}@{chunk}"

      def loss(q, k, v, impl=impl, chunk=chunk):
        out = attend(q, k, v, scale=_D.value ** -0.5, impl=impl, chunk=chunk, sink_logit_H=sink)
        return out.astype(jnp.float32).sum()
      f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      try:
        jax.block_until_ready(f(q, k, v))
      except Exception as e:  # an implementation this platform lacks
        print(f"  L={L} {name}: unavailable ({type(e).__name__}: {str(e)[:80]})")
        continue
      best = best_cpu = float("inf")
      for _ in range(_REPS.value):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(f(q, k, v))
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
      times[name] = best
      cpu[name] = best_cpu
    base = times.get("einsum") or next(iter(times.values()))
    for name, t in times.items():
      print(f"  L={L:6d} {name:12s} fwd+bwd {t * 1e3:9.2f} ms (CPU time {cpu[name] * 1e3:9.2f} "
            f"ms)   x{base / t:5.2f} vs {'einsum' if 'einsum' in times else 'first'}", flush=True)


if __name__ == "__main__":
  cli.run(main)
