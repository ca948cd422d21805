"""Chunked SSD (attn_jax/ssm/ssd.py) against the naive recurrence (lax.scan over time), forward +
backward, in one run; prints a table and writes JSON. Both compute the same thing (checked here
on the benchmark inputs); ratios are what matter, absolute times on shared machines are noise.

  python experiments/bench_ssd.py --seq_lens=4096 --out=/tmp/bench_ssd.json

Defaults: one Mamba-2 152M layer's SSD (24 heads x 64, d_state 64, one B/C group), chunk 64.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["4096"], "Sequence lengths.")
_B = flags.DEFINE_integer("batch", 1, "Batch size.")
_H = flags.DEFINE_integer("heads", 24, "Heads.")
_P = flags.DEFINE_integer("head_dim", 64, "Head dim (P).")
_N = flags.DEFINE_integer("d_state", 64, "State size (N).")
_G = flags.DEFINE_integer("groups", 1, "B/C groups.")
_Q = flags.DEFINE_list("chunks", ["64"], "Chunk sizes of the chunked form.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (after one warm-up).")
_OUT = flags.DEFINE_string("out", "bench_ssd.json", "JSON output path.")


def _time(f, args, reps):
  jax_block = __import__("jax").block_until_ready
  t = time.perf_counter()
  jax_block(f(*args))
  compile_s = time.perf_counter() - t
  t = time.perf_counter()
  for _ in range(reps):
    jax_block(f(*args))
  return (time.perf_counter() - t) / reps, compile_s


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from attn_jax.ssm import ssd

  plat = jax.default_backend()
  B, H, P, N, G = _B.value, _H.value, _P.value, _N.value, _G.value
  rows = []
  print(f"platform={plat} fp32 batch={B} heads={H} head_dim={P} d_state={N} groups={G}")
  print(f"{'T':>6s} {'form':>14s} {'fwd+bwd ms':>11s} {'compile s':>9s} {'speedup':>8s}")
  for T in map(int, _SEQ.value):
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (B, T, H, P))
    a = -jax.nn.softplus(jax.random.normal(k[1], (B, T, H)) - 2.0)
    b = jax.random.normal(k[2], (B, T, G, N)) / N ** 0.5
    c = jax.random.normal(k[3], (B, T, G, N)) / N ** 0.5
    w = jax.random.normal(k[4], (B, T, H, P))

    def grad_fn(fn):
      loss = lambda x, a, b, c: jnp.sum(fn(x, a, b, c)[0] * w)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    forms = {"recurrent": grad_fn(ssd.ssd_recurrent)}
    for q in map(int, _Q.value):
      forms[f"chunked Q={q}"] = grad_fn(lambda *z, q=q: ssd.ssd_chunked(*z, chunk=q))
    outs = {name: f(x, a, b, c) for name, f in forms.items()}
    ref = outs["recurrent"]
    for name, o in outs.items():   # same loss and gradients (fp32)
      for u, v in zip(jax.tree.leaves(o), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-3, atol=2e-3)
    base = None
    for name, f in forms.items():
      t, comp = _time(f, (x, a, b, c), _REPS.value)
      base = base or t
      rows.append(dict(seq_len=T, form=name, fwd_bwd_ms=t * 1e3, compile_s=comp,
                       speedup_vs_recurrent=base / t, platform=plat, batch=B, heads=H,
                       head_dim=P, d_state=N, groups=G))
      print(f"{T:6d} {name:>14s} {t * 1e3:11.1f} {comp:9.1f} {base / t:7.1f}x")
  with open(_OUT.value, "w") as fh:
    json.dump(rows, fh, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
