"""Timing the decayed-attention kernel's Triton choices (`kernels.decayed.GpuTuning`) on a GPU.

For one layer's attention at a preset's shape (tokens per step split into rows of T), each
candidate's forward + backward (`jax.grad` of a sum of the output, the three passes fwd, dq,
dkv) is compiled and timed (best of `steps` after a warmup call), beside the same call through
JAX's cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`, no decay:
the floor a decayed kernel can approach). A candidate that does not compile (shared memory) is
reported as such. Times are wall times of a synchronised call: on a GPU only.
"""

from __future__ import annotations

import itertools
from typing import Callable

import jax
import jax.numpy as jnp

from attn_jax.bench import roofline
from attn_jax.kernels import decayed


def quick_candidates() -> list[decayed.GpuTuning]:
  """Ten of `candidates`: today's choice first, larger query or key tiles, deeper pipelines,
  8 warps with the larger tiles; the dkv pass over 64 x 128 tiles (its M, the key tile, 128:
  wgmma on Hopper) throughout."""
  pick = [(128, 64, (4, 8, 8), (3, 2, 2)), (64, 64, (4, 4, 4), (2, 2, 2)),
          (64, 64, (4, 4, 8), (3, 3, 2)), (128, 64, (4, 4, 8), (2, 2, 2)),
          (128, 64, (8, 8, 8), (2, 2, 2)), (128, 64, (8, 8, 8), (3, 3, 2)),
          (64, 128, (4, 4, 8), (2, 2, 2)), (128, 128, (8, 8, 8), (2, 2, 2)),
          (128, 32, (4, 4, 8), (3, 3, 2)), (128, 64, (4, 8, 4), (3, 2, 2))]
  return [decayed.GpuTuning(bq, bk, w, st, (64, 128)) for bq, bk, w, st in pick]


def candidates() -> list[decayed.GpuTuning]:
  """Tiles 64 / 128 (query) x 32 / 64 / 128 (key) for the fwd and dq passes, 64 x 128 or
  128 x 128 for dkv, 4 or 8 warps, 1-3 stages (one warps / stages choice for all three passes:
  a pass-wise refinement starts from the best of these)."""
  out = []
  for bq, bk, dkv, w, st in itertools.product((64, 128), (32, 64, 128), ((64, 128), (128, 128)),
                                              (4, 8), (1, 2, 3)):
    out.append(decayed.GpuTuning(bq, bk, (w,) * 3, (st,) * 3, dkv))
  return out


def _inputs(kind: str, B: int, T: int, H: int, D: int, d_state: int, dtype):
  """q, k, v [B, T, H, D], g [B, T, H] (a decaying cumulative sum) and SISA's c, b."""
  keys = jax.random.split(jax.random.key(0), 6)
  n = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
  q, k, v = (n(keys[i], (B, T, H, D)) for i in range(3))
  g = jnp.cumsum(-0.05 * jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H))), axis=1)
  extra = {}
  if kind == "sisa":
    extra = dict(c_BTHS=n(keys[4], (B, T, H, d_state)), b_BTHS=n(keys[5], (B, T, H, d_state)))
  return (q, k, v), dict(g_BTH=g, fox=kind == "fox", **extra)


def _grad_of(attend: Callable) -> Callable:
  """jit of d sum(attend(q, k, v, extra)) / d(q, k, v); `extra` (the decay and SISA's factors)
  is an argument too, so nothing large is a compile-time constant."""
  loss = lambda q, k, v, extra: jnp.sum(attend(q, k, v, extra).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _time_or_error(fn, args, steps: int) -> float | str:
  """`roofline.best_seconds`, or the error's first line where the call does not compile (a
  finding)."""
  try:
    return roofline.best_seconds(fn, args, steps)
  except Exception as e:   # noqa: BLE001 - reported in the table, not raised
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def time_cudnn(qkv, steps: int) -> float | str:
  """fwd + bwd of cuDNN's causal flash attention on the same q, k, v (an error off a GPU)."""
  f = lambda q, k, v, _: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="cudnn")
  return _time_or_error(_grad_of(f), (*qkv, {}), steps)


def time_candidate(qkv, kw, tune: decayed.GpuTuning, steps: int) -> float | str:
  """fwd + bwd through the kernel with `tune` (the Pallas interpreter off a GPU)."""
  scale = qkv[0].shape[-1] ** -0.5
  arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
  flags = {k: v for k, v in kw.items() if k not in arrays}
  f = lambda q, k, v, extra: decayed.decayed_attention(q, k, v, scale=scale, gpu_tuning=tune,
                                                       **extra, **flags)
  return _time_or_error(_grad_of(f), (*qkv, arrays), steps)


def sweep(kind: str, T: int, tokens: int = 65536, H: int = 12, D: int = 64,
          d_state: int = 32, steps: int = 5, tunings=None, dtype=jnp.bfloat16) -> list[dict]:
  """Rows {tuning, seconds or error, ratio = cuDNN time / this time} for one kind ("sisa",
  "fox") and length, best first; the first row is cuDNN's."""
  qkv, kw = _inputs(kind, max(1, tokens // T), T, H, D, d_state, dtype)
  base = time_cudnn(qkv, steps)
  rows = [{"tuning": "cuDNN (no decay)", "seconds": base, "ratio": 1.0}]
  ok = lambda t: isinstance(t, float)
  print(f"{kind} T {T}: " + _cell(rows[0]), flush=True)
  for tune in tunings or candidates():
    t = time_candidate(qkv, kw, tune, steps)
    rows.append({"tuning": tune.label(), "seconds": t, "choice": tune,
                 "ratio": base / t if ok(t) and ok(base) else None})
    print(f"  {kind} T {T} {tune.label()}: {_cell(rows[-1])}", flush=True)
  timed = sorted((r for r in rows[1:] if ok(r["seconds"])), key=lambda r: r["seconds"])
  return rows[:1] + timed + [r for r in rows[1:] if not ok(r["seconds"])]


def _cell(r: dict) -> str:
  t, ratio = r["seconds"], "" if r["ratio"] is None else f"{r['ratio']:.3f}x"
  return f"{t * 1e3:8.3f} ms  {ratio}" if isinstance(t, float) else t


def best_choice(sweeps: list[list[dict]]) -> decayed.GpuTuning | None:
  """The candidate with the least total time over several sweeps (lengths, kinds) that it
  compiled in all of; None if none did."""
  totals: dict = {}
  for rows in sweeps:
    for r in rows[1:]:
      if isinstance(r["seconds"], float):
        totals.setdefault(r["choice"], []).append(r["seconds"])
  full = {c: sum(ts) for c, ts in totals.items() if len(ts) == len(sweeps)}
  return min(full, key=full.get) if full else None


def print_sweep(kind: str, T: int, rows: list[dict], top: int = 8) -> None:
  print(f"\n{kind} T {T}: fwd + bwd of one layer's attention, bf16 (ratio = cuDNN / this)")
  for r in rows[:top + 1]:
    print(f"  {r['tuning']:<36} {_cell(r)}")
  failed = [r for r in rows[1:] if not isinstance(r["seconds"], float)]
  if failed:
    print(f"  ({len(failed)} candidates did not compile, e.g. {failed[0]['tuning']}: "
          f"{failed[0]['seconds']})")
