"""Sparse Sinkhorn attention vs dense causal attention: fwd+bwd time and compiled peak temp memory
against sequence length, in one run; writes JSON and a PNG plot and prints the crossover length.

Both sides are whole mixers with the same head configuration (q/k/v/o projections + RoPE):
"dense" is `attend` (core.py, causal), "soft" the Sinkhorn mixer with soft sorting (training
mode, Gumbel noise), "sortcut" the same with SortCut (top-m gathered blocks). Memory is the
compiled program's `memory_analysis().temp_size_in_bytes` (activations/residuals, not params).

  python experiments/bench_sinkhorn.py --seq_lens=1024,2048,4096,8192,16384 \
      --out=runs/bench_sinkhorn/result.json
"""

import json
import os
import statistics
import sys
import time

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


def build(variant, d_model, dtype, L):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from attn_jax.attention.core import attend
  from attn_jax.attention.projection import QKVProjection
  from attn_jax.attention.sinkhorn import SinkhornAttention
  from attn_jax.config import ModelConfig
  from attn_jax.layers import apply_rope, rope_angles

  cfg = ModelConfig(d_model=d_model, n_heads=_H.value, n_layers=1, dtype=dtype,
                    max_seq_len=L)
  if variant == "dense":
    class Dense(nnx.Module):
      def __init__(self):
        self.proj = QKVProjection(cfg, rngs=nnx.Rngs(0))

      def __call__(self, x, pos):
        q, k, v = self.proj.q(x), self.proj.k(x), self.proj.v(x)
        cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.proj.o(attend(q, k, v, scale=cfg.head_dim ** -0.5, causal=True))
    model = Dense()
    call = lambda m, x, pos, rng: m(x, pos)
  else:
    opts = SinkhornAttention.Options(block_size=_BLOCK.value,
                                     n_sortcut=_CUT.value if variant == "sortcut" else 0)
    model = SinkhornAttention(cfg, opts, rngs=nnx.Rngs(0))
    call = lambda m, x, pos, rng: m(x, positions_BT=pos, rng=rng, train=True)[0]
  graphdef, params = nnx.split(model)

  def loss(p, x, pos, rng):
    y = call(nnx.merge(graphdef, p), x, pos, rng)
    return jnp.mean(y.astype(jnp.float32) ** 2)

  f = jax.jit(jax.grad(loss, argnums=(0, 1)))
  x = jax.random.normal(jax.random.key(1), (_B.value, L, d_model), dtype)
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (_B.value, L))
  args = (params, x, pos, jax.random.key(2))
  return f, args


def measure(variant, d_model, dtype, L):
  import jax
  f, args = build(variant, d_model, dtype, L)
  compiled = f.lower(*args).compile()
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
  jax.block_until_ready(compiled(*args))
  walls, cpus = [], []
  for _ in range(_REPS.value):
    w, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    walls.append(time.perf_counter() - w)
    cpus.append(time.process_time() - c)
  return dict(variant=variant, seq_len=L, temp_bytes=temp, wall_s=statistics.median(walls),
              cpu_s=statistics.median(cpus), walls=walls)


def crossover(rows, variant, key="wall_s"):
  """Smallest measured length from which `variant` is faster than dense at every longer one
  (by `key`: wall_s, or cpu_s = process CPU time, steadier on a shared machine)."""
  lens = sorted({r["seq_len"] for r in rows})
  t = {(r["variant"], r["seq_len"]): r[key] for r in rows}
  best = None
  for L in reversed(lens):
    if (variant, L) in t and ("dense", L) in t and t[(variant, L)] < t[("dense", L)]:
      best = L
    else:
      break
  return best


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for v in _VARIANTS.value:
    rr = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seq_len"])
    xs = [r["seq_len"] for r in rr]
    a1.plot(xs, [r["wall_s"] for r in rr], "o-", label=v)
    a2.plot(xs, [r["temp_bytes"] / 2 ** 20 for r in rr], "o-", label=v)
  for a, yl in ((a1, "fwd+bwd wall time (s)"), (a2, "compiled temp memory (MiB)")):
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("sequence length")
    a.set_ylabel(yl)
    a.grid(True, which="both", alpha=0.3)
    a.legend()
  fig.suptitle(f"Sinkhorn (b={_BLOCK.value}, SortCut m={_CUT.value}) vs dense, "
               f"{_H.value} heads x {_D.value}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  plat = jax.default_backend()
  dtype = _DTYPE.value or ("bfloat16" if plat == "gpu" else "float32")
  d_model = _H.value * _D.value
  rows = []
  if _FROM.value:
    with open(_FROM.value) as fh:
      rows = json.load(fh)["rows"]
  for L in ([] if _FROM.value else map(int, _SEQ.value)):
    for v in _VARIANTS.value:
      r = measure(v, d_model, dtype, L)
      rows.append(r)
      print(f"L={L:6d} {v:8s} fwd+bwd {r['wall_s']:8.3f} s wall  {r['cpu_s']:8.3f} s cpu  "
            f"temp {r['temp_bytes'] / 2 ** 20:9.1f} MiB", flush=True)
  summary = {}
  for v in _VARIANTS.value:
    if v == "dense":
      continue
    summary[v] = dict(crossover_len=crossover(rows, v),
                      crossover_len_cpu=crossover(rows, v, "cpu_s"))
    Lmax = max(r["seq_len"] for r in rows)
    d = next((r for r in rows if r["variant"] == "dense" and r["seq_len"] == Lmax), None)
    s = next((r for r in rows if r["variant"] == v and r["seq_len"] == Lmax), None)
    if d and s:
      Ls = sorted(r["seq_len"] for r in rows if r["variant"] == v)
      tmp = {r["seq_len"]: r["temp_bytes"] for r in rows if r["variant"] == v}
      summary[v].update(temp_bytes_per_token={L: tmp[L] / L for L in Ls},
                        speedup_at_max=d["wall_s"] / s["wall_s"],
                        cpu_speedup_at_max=d["cpu_s"] / s["cpu_s"],
                        memory_ratio_at_max=d["temp_bytes"] / max(s["temp_bytes"], 1))
    print(f"{v}: {summary[v]}")
  res = dict(platform=plat, device=str(jax.devices()[0].device_kind), dtype=dtype,
             batch=_B.value, heads=_H.value, head_dim=_D.value, block_size=_BLOCK.value,
             n_sortcut=_CUT.value, jax=jax.__version__, rows=rows, summary=summary)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as fh:
    json.dump(res, fh, indent=1)
  png = os.path.splitext(_OUT.value)[0] + ".png"
  plot(rows, png)
  print(f"wrote {_OUT.value} and {png}")
  del jnp


if __name__ == "__main__":
  cli.run(main)
