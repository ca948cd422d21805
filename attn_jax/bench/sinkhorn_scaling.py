"""Sparse Sinkhorn attention vs dense causal attention: fwd+bwd time and compiled peak temp memory
against sequence length, in one run; writes JSON and a PNG plot and prints the crossover length.

Both sides are whole mixers with the same head configuration (q/k/v/o projections + RoPE):
"dense" is `attend` (kernels/entry.py, causal), "soft" the Sinkhorn mixer with soft sorting
(training mode, Gumbel noise), "sortcut" the same with SortCut (top-m gathered blocks). Memory is the
compiled program's `memory_analysis().temp_size_in_bytes` (activations/residuals, not params).

Entry point: experiments/bench_sinkhorn.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from attn_jax.attention.projection import QKVProjection
from attn_jax.attention.sinkhorn import SinkhornAttention
from attn_jax.kernels.entry import attend
from attn_jax.layers import apply_rope, rope_angles
from attn_jax.model_config import ModelConfig
from attn_jax.provenance import machine_info


@dataclasses.dataclass(frozen=True)
class Setting:
  """What is timed (the experiments/bench_sinkhorn.py flags of the same names)."""
  batch: int = 1
  heads: int = 2
  head_dim: int = 64
  block_size: int = 128
  n_sortcut: int = 2
  variants: tuple = ("dense", "soft", "sortcut")
  reps: int = 3


def build(s: Setting, variant, d_model, dtype, L):
  """(jitted fwd+bwd of `variant`'s mixer, its arguments) at length L."""
  import jax
  import jax.numpy as jnp
  from flax import nnx


  cfg = ModelConfig(d_model=d_model, n_heads=s.heads, n_layers=1, dtype=dtype,
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
    opts = SinkhornAttention.Options(block_size=s.block_size,
                                     n_sortcut=s.n_sortcut if variant == "sortcut" else 0)
    model = SinkhornAttention(cfg, opts, rngs=nnx.Rngs(0))
    call = lambda m, x, pos, rng: m(x, positions_BT=pos, rng=rng, train=True)[0]
  graphdef, params = nnx.split(model)

  def loss(p, x, pos, rng):
    y = call(nnx.merge(graphdef, p), x, pos, rng)
    return jnp.mean(y.astype(jnp.float32) ** 2)

  f = jax.jit(jax.grad(loss, argnums=(0, 1)))
  x = jax.random.normal(jax.random.key(1), (s.batch, L, d_model), dtype)
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (s.batch, L))
  args = (params, x, pos, jax.random.key(2))
  return f, args


def measure(s: Setting, variant, d_model, dtype, L) -> dict:
  """Compiled temp memory and median wall / CPU time of `variant` at length L."""
  import jax
  f, args = build(s, variant, d_model, dtype, L)
  compiled = f.lower(*args).compile()
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
  jax.block_until_ready(compiled(*args))
  walls, cpus = [], []
  for _ in range(s.reps):
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


def plot(s: Setting, rows, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for v in s.variants:
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
  fig.suptitle(f"Sinkhorn (b={s.block_size}, SortCut m={s.n_sortcut}) vs dense, "
               f"{s.heads} heads x {s.head_dim}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def summarise(rows, variants) -> dict:
  """Per non-dense variant: the crossover lengths (wall and CPU time) and, at the longest
  length, the speed-up, CPU speed-up, memory ratio and temp bytes per token."""
  summary = {}
  for v in variants:
    if v == "dense":
      continue
    summary[v] = dict(crossover_len=crossover(rows, v),
                      crossover_len_cpu=crossover(rows, v, "cpu_s"))
    Lmax = max(r["seq_len"] for r in rows)
    d = next((r for r in rows if r["variant"] == "dense" and r["seq_len"] == Lmax), None)
    sp = next((r for r in rows if r["variant"] == v and r["seq_len"] == Lmax), None)
    if d and sp:
      Ls = sorted(r["seq_len"] for r in rows if r["variant"] == v)
      tmp = {r["seq_len"]: r["temp_bytes"] for r in rows if r["variant"] == v}
      summary[v].update(temp_bytes_per_token={L: tmp[L] / L for L in Ls},
                        speedup_at_max=d["wall_s"] / sp["wall_s"],
                        cpu_speedup_at_max=d["cpu_s"] / sp["cpu_s"],
                        memory_ratio_at_max=d["temp_bytes"] / max(sp["temp_bytes"], 1))
    print(f"{v}: {summary[v]}")
  return summary


def run(s: Setting, seq_lens, *, out: str, dtype: str = "", from_json: str = "") -> dict:
  """Times every variant at every length (or re-reads `from_json`'s rows), prints the rows and
  the summary, writes `out` (JSON) and the PNG beside it; returns the result."""
  machine = machine_info()
  plat = machine["backend"]
  dtype = dtype or ("bfloat16" if plat == "gpu" else "float32")
  d_model = s.heads * s.head_dim
  rows = []
  if from_json:
    with open(from_json) as fh:
      rows = json.load(fh)["rows"]
  for L in ([] if from_json else map(int, seq_lens)):
    for v in s.variants:
      r = measure(s, v, d_model, dtype, L)
      rows.append(r)
      print(f"L={L:6d} {v:8s} fwd+bwd {r['wall_s']:8.3f} s wall  {r['cpu_s']:8.3f} s cpu  "
            f"temp {r['temp_bytes'] / 2 ** 20:9.1f} MiB", flush=True)
  summary = summarise(rows, s.variants)
  res = dict(platform=plat, device=machine["device_kind"], dtype=dtype,
             batch=s.batch, heads=s.heads, head_dim=s.head_dim, block_size=s.block_size,
             n_sortcut=s.n_sortcut, jax=machine["jax"], rows=rows, summary=summary)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
  png = os.path.splitext(out)[0] + ".png"
  plot(s, rows, png)
  print(f"wrote {out} and {png}")
  return res
