"""docs/hardware.md: every preset's train step compiled for the hardware it is meant for.

One command (`experiments/hardware_page.py`) compiles the train step of each `configs/*_152m.py`
and `*_369m.py` preset for each target of `ROWS` (`train/aot.py`: the trainer's own
`build_setup` over compile-only devices, nothing run) and writes the table: per-device memory
at the preset's own batch, whether it fits the target's usable memory, the largest micro-batch
that fits when it does not (same tokens per step through gradient accumulation), the kernels
and collectives of the compiled step, the serial iterations of its while loops per step (nested
loops multiply, `train/hlo_loops.py`: XLA:GPU pays a host round trip per iteration) and the
compile time on the machine that made the page.

A second table measures length scaling: the 152M attention presets (`LENGTH_PRESETS`) with one
row of T = 2048, 8192, 32768 tokens per device (`LENGTHS`) on a GPU and a TPU target with room
for the longest (`LENGTH_ROWS`): flash-style kernels keep the temporaries linear in T (x16 from
2048 to 32768), a [T, T] score tensor would make them quadratic (x256).

A third table is the kernel census (`train/kernel_census.py`, `CENSUS`): every pass of the
decayed-attention kernel (SISA, FoX, ALiBi) and JAX's own Pallas `mha`, compiled for an H100 at
T 2048, head dim 64, bf16: per (query, key) element of each inner loop, the PTX instructions
and MUFU ex2, the MMA kinds, tiles, warps, stages and shared memory. Its cell's fingerprint is
the kernels' and the census's source with jax's version (`census_fingerprint`).

Each result is kept in a JSON file beside the page as soon as it is measured, with the
fingerprint of the config it compiled (`fingerprint`: sha256 of the config's JSON), so a run
that stops resumes where it stopped and a cell whose preset changed is measured again
(`--fresh`: all of the cells asked for; `--targets` / `--presets` / `--tables` pick them, the
others are kept). A figure added to `measure` after a cell was stored is shown as '-'
for that cell until it is measured again. The fingerprint is the config's, not the code's: a
change of the code that moves a figure (the loss's chunk scan, a kernel) leaves the cells as
they were until `--fresh` measures the ones it moves, so each cell keeps the commit it was
compiled at: the line under each target's table names its cells' commits, the length
table's last column each row's.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import glob
import hashlib
import math
import os
import platform as host
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections

from attn_jax import jsonio, kernels
from attn_jax.provenance import source_commit
from attn_jax.train import aot, kernel_census, memory


@dataclasses.dataclass(frozen=True)
class Row:
  target: str
  mesh: tuple[int, int, int]     # (data, fsdp, tensor)
  why: str


ROWS = (
    Row("h100x8", (8, 1, 1), "data parallel"),
    Row("v5e-8", (1, 8, 1), "FSDP: a v5e chip holds 16 GiB"),
    Row("v5p-8", (4, 1, 1), "data parallel"),
    Row("v6e-8", (8, 1, 1), "data parallel"),
    Row("2x8xh100", (2, 4, 2), "two hosts: data x FSDP x tensor"),
)


Presets = Mapping[str, Callable[[], ml_collections.ConfigDict]]
"""{preset name: its get_config}: the entry point loads them from configs/ (this module never
imports the configs folder)."""


def preset_names(presets: Presets) -> list[str]:
  """The 152M / 369M model presets, 152M first (a study config of that size, which runs many,
  is not one)."""
  names = [n for n in presets if n.endswith(("_152m", "_369m"))]
  names = [n for n in names if "study" not in presets[n]()]
  return sorted(names, key=lambda n: (n.split("_")[-1], n))


LENGTH_PRESETS = ("transformer_152m", "sisa_152m", "fox_152m", "alibi_152m")
LENGTHS = (2048, 8192, 32768)
LENGTH_ROWS = (
    Row("h100x8", (8, 1, 1), "data parallel"),
    Row("v5p-8", (4, 1, 1), "data parallel: a v5p chip holds 95 GiB"),
)


@dataclasses.dataclass(frozen=True)
class Census:
  """Where and at which shapes the kernel census is compiled."""
  target: str = "h100x1"
  seq_len: int = 2048
  head_dim: int = 64
  dtype: str = "bfloat16"

  @property
  def key(self) -> str:
    return f"census@{self.target}@T{self.seq_len}@D{self.head_dim}@{self.dtype}"

  @property
  def ssd_key(self) -> str:
    """The fused SSD kernels' census (`kernel_census.ssd_census`: head dim, d_state 64)."""
    return f"ssd_census@{self.target}@T{self.seq_len}@{self.dtype}"


CENSUS = Census()


def _config(get_config, mesh, seq_len: int | None = None):
  """The preset on `mesh`; with `seq_len`, one row of that many tokens per device."""
  c = get_config()
  c.mesh.shape = tuple(mesh)
  if seq_len is not None:
    c.data.update(seq_len=seq_len, global_batch_size=math.prod(mesh))
    c.train.grad_accum = 1
    c.model.max_seq_len = max(c.model.max_seq_len, seq_len)
  return c


def fingerprint(get_config, row: Row, seq_len: int | None = None) -> str:
  """sha256 of the JSON of the config a cell compiles (a changed preset is measured again)."""
  text = _config(get_config, row.mesh, seq_len).to_json_best_effort(sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure(get_config, row: Row, seq_len: int | None = None) -> dict:
  """One cell: the preset's train step compiled for the row's target and mesh (with `seq_len`:
  one row of that length per device, no search for a smaller micro-batch)."""
  try:
    r = aot.compile_for_target(_config(get_config, row.mesh, seq_len), row.target,
                               programs=("train",), search_fit=seq_len is None)
  except Exception as e:   # a config that cannot be built for this mesh is a result too
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  (p,) = r.programs
  fit = r.fitting_batch
  return {"gib": p.needed / memory.GiB, "refused": isinstance(p.memory, memory.Refused),
          "temp_gib": p.memory.temp_size_in_bytes / memory.GiB,
          "fits": bool(r.fit.fits), "fit_micro": fit[0] if fit else None,
          "fit_accum": fit[1] if fit else None, "usable_gib": r.fit.available / memory.GiB,
          "kernels": p.kernels, "collectives": p.collectives, "tt": p.tt_buffers[:2],
          **_loops(p),
          "tt_maybe_width": r.t_is_a_width,
          "compile_s": p.compile_s, "params": r.n_params, "options": p.options}


def _loops(p: aot.Program) -> dict:
  """The step's serial loop iterations (hlo_loops), JSON-ready; none for a refused step."""
  if p.loops is None:
    return {}
  return {"serial_iterations": p.serial_iterations, "while_loops": p.while_loops,
          "unknown_loops": p.unknown_loops, "loop_sources": p.loops.by_source()}


def _serial(d: dict) -> str:
  """'20 (3 loops)'; '+ n?' for loops of unknown count; '-' for a cell measured before."""
  if "serial_iterations" not in d:
    return "-"
  unknown = f" + {d['unknown_loops']} of unknown count" if d.get("unknown_loops") else ""
  return f"{d['serial_iterations']}{unknown} ({d['while_loops']} loops)"


def _key(name: str, row: Row, seq_len: int | None = None) -> str:
  key = f"{name}@{row.target}@{'x'.join(map(str, row.mesh))}"
  return key if seq_len is None else f"{key}@T{seq_len}"


def cells(names, rows=ROWS, length_rows=LENGTH_ROWS, length_names=LENGTH_PRESETS):
  """(preset, row, seq_len or None) of every cell: the presets' table, then length scaling."""
  out = [(n, r, None) for n in names for r in rows]
  return out + [(n, r, t) for n in length_names for r in length_rows for t in LENGTHS]


def run(out_json: str, todo, presets: Presets, *, fresh: bool = False,
        progress: Callable[[str], None] = print) -> dict:
  """Measure every cell of `todo` (`cells`) not yet in `out_json` or measured from another
  config (every cell of `todo` with `fresh`), saving after each; the cells outside `todo` are
  kept as they are."""
  done = jsonio.read(out_json) if os.path.exists(out_json) else {}
  commit = source_commit()   # of the code this process loaded
  for name, row, seq_len in todo:
    k, fp = _key(name, row, seq_len), fingerprint(presets[name], row, seq_len)
    if not fresh and done.get(k, {}).get("config") == fp:
      continue
    progress(f"compiling {k} ...")
    done[k] = dict(measure(presets[name], row, seq_len), config=fp, commit=commit)
    jsonio.write(done, out_json, sort_keys=True)
  return done


def census_fingerprint(c: Census = CENSUS) -> str:
  """sha256 of what the census measures: the kernels' sources (attn_jax/kernels), the census's
  own, jax's version and the shapes (a changed kernel is measured again)."""
  h = hashlib.sha256(f"{jax.__version__} {c}".encode())
  files = sorted(glob.glob(os.path.join(kernels.__path__[0], "**", "*.py"), recursive=True))
  for path in files + [kernel_census.__file__]:
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def _census_cell(out_json: str, key: str, measure: Callable[[], list], c: Census,
                 fresh: bool) -> dict:
  """Cell `key` of `out_json` from `measure()` (its passes), measured when missing, stale (its
  config is not `c`'s) or `fresh`; saved with it. A census that cannot be read is recorded as
  its error: a result too."""
  done = jsonio.read(out_json) if os.path.exists(out_json) else {}
  fp = census_fingerprint(c)
  if fresh or done.get(key, {}).get("config") != fp:
    try:
      cell = {"passes": kernel_census.passes_json(measure())}
    except Exception as e:   # a kernel the census cannot read is a result too
      cell = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    done[key] = dict(cell, config=fp, commit=source_commit())
    jsonio.write(done, out_json, sort_keys=True)
  return done


def run_census(out_json: str, *, fresh: bool = False, c: Census = CENSUS,
               progress: Callable[[str], None] = print) -> dict:
  """The census cell of `out_json`, measured when missing, stale or `fresh`; saved with it."""
  return _census_cell(out_json, c.key, lambda: kernel_census.census(
      c.target, seq_len=c.seq_len, head_dim=c.head_dim, dtype=jnp.dtype(c.dtype),
      progress=progress), c, fresh)


def run_ssd_census(out_json: str, *, fresh: bool = False, c: Census = CENSUS,
                   progress: Callable[[str], None] = print) -> dict:
  """The SSD census cell of `out_json` (`run_census`'s rules: measured when missing, stale or
  `fresh`; saved with it)."""
  return _census_cell(out_json, c.ssd_key, lambda: kernel_census.ssd_census(
      c.target, seq_len=c.seq_len, dtype=jnp.dtype(c.dtype), progress=progress), c, fresh)


def _ssd_census_section(done: dict, c: Census = CENSUS) -> list[str]:
  d = done.get(c.ssd_key)
  lines = [
      "### The fused SSD kernels (Mamba-2, Mamba-3, Mamba-3 MIMO)", "",
      "The four kernels of `attn_jax/kernels/ssd_chunks.py` (states, scan, dstates, dchunk), "
      f"forward and backward, as each mixer calls them, compiled alike (T {c.seq_len}, head dim "
      f"and d_state 64, {c.dtype}, 4 heads; Mamba-2 one B/C group, chunk 64; Mamba-3 two "
      "inputs a token, B/C per head; MIMO rank 4, chunk 16) and read the same way "
      "(`kernel_census.ssd_census`, whose docstring states the convention): figures per element "
      "of a chunk's tile (the intra-chunk matrix: [Q, Q], MIMO's [Q r, Q 2r]) and head, the "
      "loop of the states / dstates kernels (an iteration a chunk) and of dchunk over a group's "
      "heads, the whole kernel where there is no loop. The last column divides by the "
      "tensor-core work per element (MMA shapes, in head-dim-64 matmuls of 64 multiply-adds: "
      "the SSD does ~3x attention's): instructions per 64 multiply-adds, JAX mha's 6.0 on the "
      "same compile (5.0 forward, 6.25 backward). The limits (tests/test_ssd_census.py): <= 7.0 "
      "per 64 multiply-adds, Mamba-2 <= 160, Mamba-3 <= 230, MIMO <= 100 instructions per "
      "element over the four, ex2 <= 3.5, no `mma.sync`.", ""]
  if not d:
    return lines + ["No SSD census in the cells yet: `python experiments/hardware_page.py "
                    f"--targets={c.target}` compiles it.", ""]
  if "error" in d:
    return lines + [f"error: {d['error']}", ""]
  passes = [kernel_census.Pass.from_json(p) for p in d["passes"]]
  ratio = kernel_census.per_64_macs(passes)
  return lines + [f"Measured at {d.get('commit', 'an unrecorded commit')}.", ""] \
      + kernel_census.markdown(passes) + ["", "| variant | instructions per 64 tensor-core "
                                          "multiply-adds |", "|---|---|"] \
      + [f"| {v} | {r:.2f} |" for v, r in ratio.items()] + [""]


def _census_section(done: dict, c: Census = CENSUS) -> list[str]:
  d = done.get(c.key)
  lines = [
      f"## Kernel census: the attention kernels' inner loops on {c.target}", "",
      "Every pass of the decayed-attention Pallas kernel (SISA, FoX, ALiBi, each called as its "
      "mixer calls it) and JAX's own Pallas-Triton flash attention (`mha`, the reference) "
      f"compiled for an H100 at T {c.seq_len}, head dim {c.head_dim}, {c.dtype} (one row, one "
      "head: the loops' code is the same for more) with `xla_dump_to`, read from each "
      "Triton kernel's PTX (`attn_jax/train/kernel_census.py`, whose docstring states the "
      "convention): instructions and MUFU `ex2` per (query, key) element of the inner loop(s) "
      "(per thread and iteration x threads / tile; loops that hand one accumulation on, "
      "'>' in the tiles column, weighted by the tiles each visits over the launch, in brackets: "
      "the kernel's own schedule, `decayed.tile_visits`, for one causal document of T tokens "
      "whose log-decay falls 0.01 nats a token, where SISA's per-element fallback visits no "
      "tile; loops of their own, '+', summed), MMA "
      "instructions per iteration of the loops, summed over them (`wgmma`: "
      "Hopper's warpgroup MMA; `mma.sync`: the Ampere path), the tiles, warps, stages and "
      "shared memory of each launch. The PTX is the compiler's input, not cycle counts: a "
      "figure to compare kernels compiled alike. The limits (tests/"
      "test_kernel_census.py): SISA <= 60 instructions per element over fwd + dq + dkv, FoX "
      "and ALiBi <= 45, ex2 <= 3.2, no `mma.sync`.", ""]
  if not d:
    return lines + ["No census in the cells yet: `python experiments/hardware_page.py "
                    f"--targets={c.target}` compiles it.", ""]
  if "error" in d:
    return lines + [f"error: {d['error']}", ""]
  passes = [kernel_census.Pass.from_json(p) for p in d["passes"]]
  return lines + [f"Measured at {d.get('commit', 'an unrecorded commit')}.", ""] \
      + kernel_census.markdown(passes) + [""]


def _kernels(d: dict) -> str:
  k = {n: c for n, c in d.get("kernels", {}).items()   # families (names: --compile_only)
       if not n.startswith(("cuBLAS", "Pallas kernels"))}
  return ", ".join(f"{n} x{c}" for n, c in sorted(k.items())) or "none (XLA)"


def _cell(d: dict) -> list[str]:
  if "error" in d:
    return ["error", "", "", d["error"], "", "", ""]
  fit = "yes" if d["fits"] else (f"at micro-batch {d['fit_micro']} x {d['fit_accum']}"
                                 if d["fit_micro"] else "no")
  coll = ", ".join(f"{n} x{c}" for n, c in d["collectives"].items()) or "none"
  tt = "; [T, T]" + ("?" * bool(d.get("tt_maybe_width"))) + ": " + ", ".join(d["tt"]) \
      if d["tt"] else ""
  tt += " (Triton GEMM fusions off: no tiling found without autotuning)" if d.get("options") else ""
  if d.get("refused"):
    return [f"> {d['gib']:.1f}", f"{d['usable_gib']:.1f}", fit,
            "unknown: the compiler refused the step for memory", "", "",
            f"{d['compile_s']:.0f}"]
  return [f"{d['gib']:.1f}", f"{d['usable_gib']:.1f}", fit, _kernels(d) + tt, coll, _serial(d),
          f"{d['compile_s']:.0f}"]


def measured_at(done: dict) -> str:
  """The commits the cells were measured at, most cells first: "abc1234 (90 cells), ..."
  (cells measured before commits were recorded: "an unrecorded commit")."""
  n = collections.Counter(d.get("commit", "an unrecorded commit") for d in done.values())
  return ", ".join(f"{c} ({k} cell{'s' * (k != 1)})" for c, k in n.most_common()) or "none"


# Written, not measured: which Pallas backend each kernel compiles to on each tested JAX line.
PALLAS_GPU = """## Pallas on GPU: which backend each kernel uses

| kernel | where | GPU, jax 0.10.2 (Python 3.11) | GPU, jax >= 0.11 (Python 3.12+) | TPU |
|---|---|---|---|---|
| decayed attention (SISA, FoX, ALiBi: forward, dq, dkv) | `attn_jax/kernels/decayed.py` | Pallas Triton | Pallas Triton, deprecated | Pallas Mosaic TPU |
| chunked SSD (Mamba-2, Mamba-3 SISO and MIMO, the hybrids' SSM heads: states with the chunk-state passing, scan, dstates, dchunk) | `attn_jax/kernels/ssd_chunks.py` | Pallas Triton | Pallas Triton, deprecated | Pallas Mosaic TPU |
| softmax attention (Transformer, sinks) | `kernels/dpa.py`, `kernels/splash.py` | cuDNN fused attention (XLA custom call), no Pallas | the same | splash attention (Pallas Mosaic TPU) |
| one-token decoding step into a Linear KV cache (Transformer, the hybrids' attention heads: RoPE, k / v / pos write, attention) | `attn_jax/kernels/decode_attend.py` | Pallas Triton | Pallas Triton, deprecated | XLA |
| Sinkhorn, sliding window, rings, SISA / FoX / ALiBi and Mamba decoding steps | `attention/`, `ssm/` | XLA | XLA | XLA |

JAX 0.11 deprecates the Pallas Triton backend in favour of Mosaic GPU, JAX's own GPU backend
for Pallas; the decayed and chunked-SSD kernels are affected. Until Triton is removed they
compile and run as before, with a `DeprecationWarning` ("jax-pallas-triton") at each lowering. One thing already
changed: from 0.11 Triton's lowering asks the mesh in context for the GPU it compiles for (0.10
assumed compute capability 9.0 wherever no GPU was attached), so a compile-only H100 program is
traced under its mesh (`sharding.use_rules`, `sharding.traced_for`); `--compile_only`, this page
and the target tests do so on both lines. Once a JAX release removes the backend, SISA, FoX and
ALiBi on a GPU would fall back to their blockwise XLA paths, Mamba's SSD to its XLA form and
the one-token cache step to its XLA path, slower and with more memory.

The plan: a Mosaic GPU version of the decayed kernel (same tile steps and custom VJP; Mosaic GPU
stages whole blocks in shared memory, where the Triton version loops over HBM tiles) as a second
GPU kernel behind `kernel_choice` (today `decayed_kernel` picks kernel or blockwise path), needing
jax >= 0.11.1, so the Python 3.12+ line. It becomes the default on GPU once measured faster than
the Triton kernel on an H100 / H200 at the presets' shapes (`experiments/tune_decayed.py`,
`experiments/device_check.sh`); Triton stays for jax 0.10.2 until that line is dropped.
"""


# Measured once (experiments/decode_graphs.py --markdown, the commit that added it), not per
# page: decoding programs and XLA's command buffers (attn_jax/command_buffers.py).
COMMAND_BUFFERS = """## Decoding as CUDA graphs: XLA command buffers

XLA:GPU records runs of thunks (its kernels, copies, library calls) into *command buffers*, CUDA
graphs launched with one call, and with `WHILE` in the set a whole `lax.while_loop` (condition
and body) as one graph node that CUDA's conditional nodes drive on the device. Decoding programs
on a GPU (`decode.jit_stateful`: prefill and the one-token step; `decode.generate`: prefill and
the generation loop) are compiled with `xla_gpu_enable_command_buffer` = the line's default set
plus `WHILE`, per program (`attn_jax/command_buffers.py`; `ATTN_JAX_DECODE_COMMAND_BUFFERS=0`
gives them XLA's default set instead). Read from each line's dump (`*.config.pbtxt`):

| option | what it does | jax 0.10.2 default | jax 0.12.0.1 default |
|---|---|---|---|
| `xla_gpu_enable_command_buffer` | thunk kinds that may be captured: FUSION (XLA's kernels, device copies), CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL (graph-safe FFI handlers), DYNAMIC_SLICE_FUSION, CONDITIONAL, WHILE, COLLECTIVES, CONVOLUTION (+ COLLECTIVES_KERNEL on 0.12) | FUSION, CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL, DYNAMIC_SLICE_FUSION, CONDITIONAL | the same + COLLECTIVES_KERNEL |
| `xla_gpu_graph_min_graph_size` | fewest consecutive capturable thunks made into a graph | 5 | 5 |
| `xla_gpu_command_buffer_unroll_loops` | a loop of known trip count unrolled into the graph | false | false |
| `xla_gpu_command_buffer_update_mode`, `_scheduling_mode` | graph update when buffers move between calls; grouping | ALWAYS_UPDATE, LHS | ALWAYS_UPDATE, LHS |
| `xla_gpu_graph_enable_concurrent_region` | independent thunks as parallel graph branches | false | false |

`xla_gpu_graph_level` and `xla_gpu_graph_num_runs_to_instantiate` are reserved (removed) names
on both lines. Per program (`jax.jit(..., compiler_options=...)`) the set is a full list of
names: the `+WHILE` form is accepted only in `XLA_FLAGS`, for every program of the process (an
`XLA_FLAGS` naming the option wins over the per-program set), and a name a line lacks
(COLLECTIVES_KERNEL on 0.10.2) is a compile error.

**Seen without a GPU.** The capture is a pass over the thunk sequence after the HLO is final,
so `compiled.as_text()` never shows it; the dump does: `*.thunk_sequence_after_thunk_passes.txt`
nests the captured thunks under `kCommandBuffer` (`command_buffers.read_dump`). jax 0.10.2's XLA
drops WHILE, CONDITIONAL and the library kinds when the device's CUDA driver or runtime is older
than 12.3 or unknown, so the compile-only GPU targets state CUDA 12.8 (`targets.GpuSpec.cuda`);
jax 0.12.0.1 captures them either way. Compiled for h100x1 on jax 0.10.2, batch 1, a prompt of
128 tokens + 128 new tokens (`python experiments/decode_graphs.py --configs=<preset>`; counts are
thunks of the dump, each once, a loop body's not multiplied by its iterations):

| preset | program | with WHILE | XLA's default set | memory analysis (bytes) |
|---|---|---|---|---|
| transformer_152m | step | 1 graph, 297 thunks in / 0 out | 1 graph, 297 thunks in / 0 out | arguments 313,285,736, temporaries 4,783,640: equal |
|  | generate | 1 graph, 627 thunks in / 0 out; loop inside (277 thunks) | 2 graphs, 626 thunks in / 1 out; loop host-driven, 2 launches per token | arguments 303,836,672, temporaries 246,649,360: equal |
| sisa_152m | step | 1 graph, 473 thunks in / 0 out | 1 graph, 473 thunks in / 0 out | arguments 315,803,432, temporaries 4,332,568: equal |
|  | generate | 1 graph, 1117 thunks in / 0 out; loop inside (374 thunks) | 2 graphs, 1116 thunks in / 1 out; loop host-driven, 2 launches per token | arguments 303,837,824, temporaries 242,910,832: equal |
| mamba2_152m | step | 1 graph, 566 thunks in / 0 out | 1 graph, 566 thunks in / 0 out | arguments 317,747,688, temporaries 4,873,720: equal |
|  | generate | 1 graph, 1814 thunks in / 0 out; loop inside (511 thunks) | 2 graphs, 1813 thunks in / 1 out; loop host-driven, 2 launches per token | arguments 305,248,992, temporaries 351,754,376: equal |
| mamba3_152m | step | 1 graph, 694 thunks in / 0 out | 1 graph, 694 thunks in / 0 out | arguments 317,966,984, temporaries 4,867,608: equal |
|  | generate | 1 graph, 2259 thunks in / 0 out; loop inside (641 thunks) | 2 graphs, 2258 thunks in / 1 out; loop host-driven, 2 launches per token | arguments 305,940,608, temporaries 262,396,912: equal |

The one-token step is one graph with or without the option: on a machine with CUDA >= 12.3,
XLA's default already captures all of it. What `WHILE` changes is the loop: with it the
generation loop (and the bench's jitted loop of steps) is inside the graph, so a token costs no
host work; without it the host drives every iteration (the condition's kernel, its predicate
copied to the host and waited for, then the body's graph launched). Memory analysis is the same
byte for byte: capture comes after buffer assignment.

**Needs a GPU** (`STEPS=2g bash experiments/device_check.sh`, not run yet): decode tokens/s
with and without at batch 1 and 32 per preset, the device memory the graphs take beyond XLA's
allocator (instantiated graphs live in the driver: the free bytes without minus with), and the
same capture read from this GPU's own compile (`--check` fails the step if the loop is not
captured). The graphs do not remove the kernels' own cost: inside a graph each kernel still
starts and ends on the device, so a step of ~300 small kernels stays bound by their number. The
H200's batch-1 Transformer (1,082 tok/s, docs/benchmarks.md: 0.92 ms a token, 3.2 us for each
of its ~285 kernels) was measured on CUDA 13 with XLA's default set, where the step's body was most likely one graph already (not
checked on that run): `WHILE` can remove the per-token host work of the loop, not the cost of
each kernel, which fewer kernels per step (fusion) cuts.
"""


def page(done: dict, names, rows=ROWS, length_rows=LENGTH_ROWS,
         length_names=LENGTH_PRESETS, census: bool = True) -> str:
  """The markdown page from the measured cells (missing ones say so)."""
  lines = [
      "# Hardware targets", "",
      "Generated by `python experiments/hardware_page.py` (attn_jax/bench/hardware_page.py) on "
      f"{datetime.date.today()} at commit {source_commit()} from cells compiled at "
      f"{measured_at(done)}, jax {jax.__version__}, host "
      f"{host.machine()} CPU: every preset's train step compiled for each target with the "
      "trainer's own setup on compile-only devices (`attn_jax.targets`); nothing was run. "
      "Memory is XLA's analysis per device (arguments + outputs - donated + temporaries) at "
      "the preset's own batch (bf16, 32 x 2048 tokens per micro-batch over the mesh); 'usable' "
      "is what the run may allocate (GPU: 75% by JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION; "
      "TPU v5e: the allocator's 15.75 GiB; v5p, v6e: the HBM), judged with 95% headroom. When "
      "the preset's micro-batch does not fit, the largest that does is named (the same tokens "
      "per step through train.grad_accum; what train.auto_microbatch picks). Kernels are the "
      "custom calls in the compiled step, collectives the ops in its text (an op inside the "
      "layer scan counts once); serial iterations are the step's while-loop iterations per "
      "step, nested loops multiplied (train/hlo_loops.py; XLA:GPU pays a host round trip for "
      "each; '-': a cell measured before they were recorded); '[T, T]?' marks a preset with an "
      "activation width equal to T (`aot.activation_widths`), whose [.., T, T]-shaped buffers may be [.., T, width] "
      "activations (Mamba 369M: d_inner 2048). Compile time is this CPU's, shared with other work: a rough "
      "figure. Reproduce one cell: `python experiments/train.py --config=configs/<preset>.py "
      "--compile_only=<target> --config.mesh.shape=<mesh>`.", ""]
  for row in rows:
    lines += [f"## {row.target}, mesh (data, fsdp, tensor) = {row.mesh}: {row.why}", "",
              "| preset | GiB / device | usable GiB | fits | kernels | collectives | serial "
              "iterations | compile s |",
              "|---|---|---|---|---|---|---|---|"]
    for name in names:
      d = done.get(_key(name, row))
      cells = _cell(d) if d else ["not measured yet"] + [""] * 6
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", _section_commits(done, [_key(n, row) for n in names]), ""]
  if length_rows:
    lines += _length_section(done, length_rows, length_names)
  if census:
    lines += _census_section(done) + _ssd_census_section(done)
  lines += [PALLAS_GPU.rstrip("\n"), "", COMMAND_BUFFERS.rstrip("\n"), ""]
  return "\n".join(lines)


def _gib_cell(d: dict | None) -> str:
  if not d:
    return "not measured yet"
  if "error" in d:
    return "error: " + d["error"]
  more = "> " if d.get("refused") else ""
  return f"{more}{d['gib']:.1f} ({more}{d['temp_gib']:.1f})"


def _growth(a: dict | None, b: dict | None) -> str:
  ok = a and b and "error" not in a and "error" not in b and not a.get("refused")
  return f"x{b['temp_gib'] / a['temp_gib']:.1f}" if ok and a["temp_gib"] > 0 else ""


def _length_section(done: dict, length_rows, length_names) -> list[str]:
  head = " | ".join(f"T {t}: GiB (temporaries)" for t in LENGTHS)
  lines = [
      "## Length scaling: one row of T tokens per device", "",
      f"The 152M attention presets at T = {', '.join(map(str, LENGTHS))} with one row per device "
      f"(so {LENGTHS[-1] // LENGTHS[0]}x the tokens from the first to the last): temporaries "
      f"linear in T grow x{LENGTHS[-1] // LENGTHS[0]}, a [T, T] score tensor would grow "
      f"x{(LENGTHS[-1] // LENGTHS[0]) ** 2}. Arguments (parameters, optimizer state) do not "
      "grow. '[T, T]' lists any such buffer found in the step at the longest length.", "",
      f"| preset | target | {head} | temporaries x | [T, T] at {LENGTHS[-1]} | kernels | serial "
      f"iterations at T {' / '.join(map(str, LENGTHS))} | compiled at |",
      "|---|---|" + "---|" * len(LENGTHS) + "---|---|---|---|---|"]
  for name in length_names:
    for row in length_rows:
      ds = [done.get(_key(name, row, t)) for t in LENGTHS]
      last = ds[-1] or {}
      lines.append(f"| {name} | {row.target} {row.mesh} | "
                   + " | ".join(_gib_cell(d) for d in ds)
                   + f" | {_growth(ds[0], ds[-1])} | {', '.join(last.get('tt', [])) or 'none'}"
                   f" | {_kernels(last) if last and 'error' not in last else ''}"
                   f" | {' / '.join(_serial(d) if d else '' for d in ds)}"
                   f" | {_row_commits(ds)} |")
  return lines + [""]


def _row_commits(ds) -> str:
  """The commits a row's cells were compiled at, in the row's order ('?': not recorded)."""
  seen = dict.fromkeys(d.get("commit", "?") for d in ds if d)
  return ", ".join(seen)


def _section_commits(done: dict, keys) -> str:
  """The line under a table naming the commits its cells were compiled at."""
  return f"Cells of this table compiled at {measured_at({k: done[k] for k in keys if k in done})}."
