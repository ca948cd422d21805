"""The fused SSD kernels' census (`train/kernel_census.ssd_census`): instructions and `ex2`
per element of a chunk's tile and the MMA kinds of every kernel (states, scan, dstates,
dchunk) as Mamba-2, Mamba-3 and Mamba-3 MIMO call them, compiled for an H100, with limits the
kernels meet.

The limits, and why (measured at the commit that set them: Mamba-2 146.2, Mamba-3 208.9,
Mamba-3 MIMO 91.2 instructions per element over the four kernels; 6.6 / 6.3 / 6.4
instructions per 64 tensor-core multiply-adds; ex2 3.28 / 3.28 / 2.89; every MMA a wgmma.
Since the states kernel makes the per-chunk decay sums itself (for the launches of
tests/test_launches.py): 153.9 / 216.7 / 93.1; the limits unchanged):
- instructions per 64 tensor-core multiply-adds <= 7.0 (`kernel_census.per_64_macs`): the
  figure that compares with flash attention, whose per-element work is a third of the SSD's
  (2 head-dim-64 matmuls forward and 5 backward against the SSD's 22 for Mamba-2:
  `tensor_macs`). JAX's own Pallas flash attention (`mha`, the census's reference row, same
  compile) spends 10.1 instructions per element on 128 multiply-adds forward (5.0 per 64) and
  43.8 on 448 backward (6.25), 6.0 over both; the decayed kernel 3.0-4.7 per pass. 7.0 is
  flash attention's backward with ~10% to spare: the SSD's elementwise work per matmul (its
  exponents, masks, casts) at flash attention's;
- instructions per element summed over the four kernels <= 160 (Mamba-2), 230 (Mamba-3), 100
  (MIMO): the measured figures with ~10% to spare, so that a regression shows;
- ex2 per element <= 3.5: L is exponentiated once forward and once in dchunk (2 per element);
  the per-row factors (exp A, exp E, exp z: a column each, held by several threads) make the
  rest;
- no `mma.sync`: every matmul of every kernel on Hopper's wgmma (64-row tiles, 4 warps).
"""

import pytest

from attn_jax import targets
from attn_jax.train import kernel_census as kc

LIMITS = {"Mamba-2": 160.0, "Mamba-3": 230.0, "Mamba-3 MIMO": 100.0}
PER_64_MACS_LIMIT = 7.0
EX2_LIMIT = 3.5


def test_tensor_macs_counts_each_mma_by_its_shape():
  """Per element of the tile: 4 warpgroup MMAs of 64 x 64 x 16 over a [64, 64] tile are one
  head-dim-64 matmul's 64 multiply-adds per element; an `mma.sync` is a warp's."""
  wg = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
  ms = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
  p = kc.Pass("v", "ssd_scan", ((64, 64),), 4, 2, 128, None, 64.0, 1.0, {wg: 4}, {wg: 4})
  assert kc.tensor_macs(p) == 64.0
  q = kc.Pass("v", "ssd_dchunk", ((64, 128),), 4, 2, 128, None, 64.0, 1.0, {ms: 8}, {ms: 8})
  assert kc.tensor_macs(q) == 8 * 16 * 8 * 16 * 4 / (64 * 128)
  assert kc.per_64_macs([p, q]) == {"v": 128.0 / ((64.0 + kc.tensor_macs(q)) / 64)}


@pytest.mark.slow
@pytest.mark.ci_extra
def test_ssd_kernels_cost_what_flash_attention_costs():
  """Every SSD kernel compiled for an H100 at T 2048, head dim and d_state 64, bf16, as each
  mixer calls them: within the limits of the module docstring (~30 s: three compiles)."""
  if not targets.available("h100x1"):
    pytest.skip("no compiler plugin for h100x1 (pip install -e '.[targets]')")
  passes = kc.ssd_census("h100x1", seq_len=2048, head_dim=64, d_state=64)
  table = kc.format_census(passes, unit=kc.SSD_UNIT)
  assert {(p.variant, p.kernel) for p in passes} == {
      (v, f"ssd_{n}") for v in LIMITS for n in ("states", "scan", "dstates", "dchunk")}, table
  tot, ratio = kc.totals(passes), kc.per_64_macs(passes)
  over = [f"{v}: {tot[v].instructions:.1f} instructions > {limit}"
          for v, limit in LIMITS.items() if tot[v].instructions > limit]
  over += [f"{v}: {r:.2f} instructions per 64 MACs > {PER_64_MACS_LIMIT}"
           for v, r in ratio.items() if r > PER_64_MACS_LIMIT]
  over += [f"{v}: {t.ex2:.2f} ex2 > {EX2_LIMIT}" for v, t in tot.items() if t.ex2 > EX2_LIMIT]
  over += [f"{p.variant} {p.kernel}: mma.sync" for p in passes if p.mma_kinds().get("mma.sync")]
  over += [f"{p.variant} {p.kernel}: no MMA" for p in passes if not p.mma_kinds()]
  assert not over, "; ".join(over) + "\n" + table


def test_compile_only_prints_the_ssd_census_when_the_step_runs_the_ssd_kernels(monkeypatch,
                                                                               capsys):
  """`--compile_only` (aot.compile_only_main): a step whose programs run the `ssd_` Pallas
  kernels gets the SSD census after the attention one, with each variant's instructions per
  64 tensor-core multiply-adds; a step without them does not."""
  import dataclasses
  import ml_collections
  from attn_jax.train import aot
  if not targets.available("h100x1"):
    pytest.skip("no compiler plugin for h100x1")
  wg = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
  one = kc.Pass("Mamba-2", "ssd_scan", ((64, 64),), 4, 2, 128, 32768, 39.1, 1.0, {wg: 24},
                {wg: 24})
  asked = []
  monkeypatch.setattr(kc, "census", lambda target, **kw: [])
  monkeypatch.setattr(kc, "ssd_census", lambda target, **kw: asked.append(kw["seq_len"])
                      or [one, dataclasses.replace(one, kernel="ssd_states")])
  kernels = {"Triton (Pallas GPU)": 4, "Pallas kernels: ssd_dchunk, ssd_scan": 2}
  report = lambda *a, **k: aot.Report("c", targets.get("h100x1"), {}, 1, [aot.Program(
      "train", "", 0.0, None, dict(kernels), {}, [])], None, None)
  monkeypatch.setattr(aot, "compile_for_target", report)
  monkeypatch.setattr(aot, "format_report", lambda r: "the report")
  config = ml_collections.ConfigDict({"model": {"d_model": 128, "n_heads": 2,
                                                "dtype": "bfloat16"}, "data": {"seq_len": 300}})
  aot.compile_only_main(config, "h100x1")
  out = capsys.readouterr().out
  assert asked == [384]
  assert "kernel census (SSD, h100x1, T 384, head dim 64, d_state 64, bfloat16)" in out
  assert "Mamba-2  scan" in out and "Mamba-2  sum" in out
  assert "Mamba-2  6.52 instructions per 64 tensor-core multiply-adds" in out   # 78.2 / 12
  del kernels["Pallas kernels: ssd_dchunk, ssd_scan"]
  aot.compile_only_main(config, "h100x1")
  assert "SSD" not in capsys.readouterr().out and asked == [384]
