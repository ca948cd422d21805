"""Compile a config's programs for a hardware target it is not running on, and report them.

`compile_for_target(config, "v5e-8")` builds the config's mesh over the target's compile-only
devices (`attn_jax.targets`) and compiles, with the trainer's own `build_setup`, the programs a
run executes:

  train    the train step, exactly as the trainer compiles it (`setup.compile_step`), for the
           config's batch geometry [grad_accum, global_batch_size, seq_len];
  eval     the held-out step (`step.make_eval_step`) on one [global_batch_size, seq_len] batch;
  prefill  `decode.prefill` of a [global_batch_size, seq_len] prompt into states of capacity
           seq_len + DECODE_NEW;
  decode   `decode.decode_step`: one token per row against those states.

Nothing is allocated or run. For each program the report gives XLA's memory analysis per device
(`train/memory.py`: arguments + outputs - donated + temporaries + code), the compile time, the
kernels (custom calls: cuDNN attention, Mosaic/Pallas, Triton, cuBLAS), the collectives and
any [.., T, T] buffer at the training length T. Kernels and collectives are counted as they
appear in the compiled program text: an op inside a loop body (the scan over layers, the
micro-batch loop) counts once, not once per iteration. Counted per execution instead
(`train/hlo_loops.py`): the serial iterations of the program's while loops (nested loops
multiply; XLA:GPU pays a host round trip per iteration) with the code each loop comes
from, the conditionals run, and the kernel launches (fusions, custom calls, collectives, copies
at the top level of the entry and of the loop bodies, times their loops' iterations).
On a GPU target whose train step runs Pallas (Triton) kernels, `--compile_only` adds the kernel
census (`train/kernel_census.py`): per (query, key) element of each decayed-attention pass's
inner loop, its instructions, MUFU ex2 and MMA kinds, with its tiles, warps and shared memory,
JAX's own Pallas `mha` beside it.
The train step's fit is judged against the target's usable memory (`Target.usable_bytes`) with
`memory.check_fit`'s headroom; when it does not fit, the largest micro-batch that does
(`memory.pick_micro_batch`, what `train.auto_microbatch` would pick) is searched for and named. A program the compiler refuses for memory (XLA for TPU checks HBM
while compiling) is reported as refused, with the bytes the compiler named
(`memory.Refused`), and counts as not fitting.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attn_jax import decode, native_logs, sharding as shd, targets as targets_lib
from attn_jax.train import hlo_loops, kernel_census, memory, setup as setup_lib
from attn_jax.train.step import make_eval_step

DECODE_NEW = 128   # decoding capacity beyond the prompt

# custom-call target (regex) -> the name the report gives it
KERNELS = (
    (r"__cudnn\$fmha\w*Backward", "cuDNN attention bwd"),
    (r"__cudnn\$fmha\w*", "cuDNN attention fwd"),
    (r"tpu_custom_call", "Mosaic (Pallas TPU)"),
    (r"__gpu\$xla\.gpu\.triton", "Triton (Pallas GPU)"),
    (r"__cublas\$lt\$matmul\w*|__cublas\$gemm", "cuBLAS GEMM"),
)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_CALL_RE = re.compile(r'custom_call_target="([^"]+)"')
# a Pallas kernel's instruction (`%splash_mqa_fwd_residuals.1 = ... custom-call(...),
# custom_call_target="tpu_custom_call", ... op_name=".../splash_mqa_fwd_residuals/pallas_call"`):
# its name is the op_name's component before "pallas_call" (GPU names the instruction
# "pallas_call"), else the instruction's own without its number
_PALLAS_TARGET_RE = re.compile(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)"')
_OP_NAME_RE = re.compile(r'op_name="[^"]*/([\w.-]+)/pallas_call"')
_INSTRUCTION_RE = re.compile(r'%([A-Za-z_][\w-]*?)(?:\.\d+)* = ')


@dataclasses.dataclass
class Program:
  """One compiled program: its memory analysis, compile time and what is inside."""
  name: str
  shape: str
  compile_s: float
  memory: Any
  kernels: dict[str, int]
  collectives: dict[str, int]
  tt_buffers: list[str]
  options: dict = dataclasses.field(default_factory=dict)   # XLA options it needed (_program)
  loops: hlo_loops.Loops | None = None   # per execution (hlo_loops.read); None: not compiled

  @property
  def needed(self) -> int:
    return memory.needed_bytes(self.memory)

  @property
  def serial_iterations(self) -> int | None:
    """Iterations of the program's while loops per execution (loops of known count)."""
    return None if self.loops is None else self.loops.serial_iterations

  @property
  def while_loops(self) -> int | None:
    return None if self.loops is None else len(self.loops.loops)

  @property
  def unknown_loops(self) -> int | None:
    return None if self.loops is None else self.loops.unknown_loops

  @property
  def launches(self) -> int | None:
    """Kernel launches per execution (hlo_loops: None when unknown)."""
    return None if self.loops is None else self.loops.launches


def kernels_in(text: str) -> dict[str, int]:
  """The kernels (custom calls of the KERNELS families) of a compiled program, by name."""
  out: collections.Counter = collections.Counter()
  for target in _CALL_RE.findall(text):
    name = next((n for pat, n in KERNELS if re.fullmatch(pat, target)), None)
    if name is not None:    # the compilers' own helper calls (TPU buffer/gather ops) are not kernels
      out[name] += 1
  names = sorted({_pallas_name(line) for line in text.splitlines()
                  if _PALLAS_TARGET_RE.search(line)})
  if names:
    out[f"Pallas kernels: {', '.join(names)}"] = len(names)
  return dict(out)


def _pallas_name(line: str) -> str:
  m = _OP_NAME_RE.search(line) or _INSTRUCTION_RE.search(line)
  return m.group(1) if m else "unnamed"


def collectives_in(text: str) -> dict[str, int]:
  """Collective ops of a compiled program (async pairs counted once, at their start)."""
  out = {}
  for op in COLLECTIVES:
    n = len(re.findall(rf"\s{op}(?:-start)?\(", text))
    if n:
      out[op] = n
  return out


def square_buffers(text: str, T: int) -> list[str]:
  """Shapes in the program whose last two dimensions are both T (a materialised [.., T, T])."""
  pat = re.compile(rf"\b(?:f32|bf16|f16|pred|s32|f64)\[(?:\d+,)*{T},{T}\]")
  return sorted(set(pat.findall(text)))


# With no GPU to autotune on, XLA's GPU compiler tiles Triton GEMM fusions by fixed rules and,
# for some shapes (the rows of an odd-length batch: [32 x 31, 64] @ [64, 64] in the quickstart),
# finds no tiling. Such a program is compiled again with Triton GEMM fusions off (cuBLAS for
# every matmul) and the report says so; whether a machine with the GPU, which autotunes, meets
# the same failure is not known here (if it does: XLA_FLAGS=--xla_gpu_enable_triton_gemm=false).
GPU_TILING_FAILURE = "Couldn't find output tile sizes"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def _compile_with_fallback(compile: Callable[[dict | None], Any]) -> tuple[Any, dict]:
  """(`compile(None)`, {}), or (`compile(NO_TRITON_GEMM)`, its options) after a GPU tiling
  failure."""
  try:
    return compile(None), {}
  except jax.errors.JaxRuntimeError as e:
    if GPU_TILING_FAILURE not in str(e):
      raise
    return compile(dict(NO_TRITON_GEMM)), dict(NO_TRITON_GEMM)


def _program(name: str, shape: str, compile: Callable[[dict | None], Any], T: int) -> Program:
  """The compiled program's report (`_compile_with_fallback`); a refusal for memory gives a
  Program whose memory is the `memory.Refused` analysis and whose contents are unknown."""
  t0 = time.perf_counter()
  try:
    with targets_lib.no_persistent_cache():
      compiled, options = _compile_with_fallback(compile)
  except jax.errors.JaxRuntimeError as e:
    refused = memory.refusal(e)
    if refused is None:
      raise
    return Program(name, shape, time.perf_counter() - t0, refused, {}, {}, [])
  dt = time.perf_counter() - t0
  text = compiled.as_text()
  return Program(name, shape, dt, compiled.memory_analysis(), kernels_in(text),
                 collectives_in(text), square_buffers(text, T), options, hlo_loops.read(text))


def _geometry(config) -> tuple[int, int, int]:
  return (config.train.grad_accum, config.data.global_batch_size, config.data.seq_len)


def compile_train(setup: setup_lib.Setup, accum: int, micro: int, seq_len: int) -> Program:
  batch = setup_lib.abstract_batch(setup, accum, micro, seq_len)
  return _program("train", f"[{accum}, {micro}, {seq_len}]",
                  lambda opts: setup_lib.compile_step(setup, batch, opts), seq_len)


def compile_eval(setup: setup_lib.Setup, batch: int, seq_len: int) -> Program:
  step = jax.jit(make_eval_step(setup.graphdef))
  sh = setup_lib.eval_batch_sharding(setup)
  b = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.float32 if k == "weights" else jnp.int32,
                               sharding=sh) for k in setup.batch_keys}
  st = setup.abstract_state

  def run(opts):
    with shd.use_rules(setup.mesh, setup.rules):
      return step.lower(st["params"], st["rest"], b).compile(opts)
  return _program("eval", f"[{batch}, {seq_len}]", run, seq_len)


def _decoding_state(setup: setup_lib.Setup) -> tuple[Any, dict]:
  """(graphdef, {"params", "rest"}) of the abstract model's `for_decoding` copy (pure dicts, as
  the trainer's state; its fused kernels change the tree), sharded by the same rules."""
  graphdef, st = setup.graphdef, setup.abstract_state
  out = {}

  def cast(params, rest):
    g, p, r = nnx.split(nnx.merge(graphdef, params, rest).for_decoding(), nnx.Param, ...)
    out["graphdef"] = g
    return p, r

  replicate = setup.run.mesh.replicate_indivisible
  new = jax.eval_shape(cast, st["params"], st["rest"])
  shard = lambda s: shd.state_shardings(s, setup.mesh, setup.rules,
                                        replicate_indivisible=replicate)
  keep = lambda n, sh: jax.ShapeDtypeStruct(n.shape, n.dtype, sharding=sh)
  return out["graphdef"], {k: jax.tree.map(keep, nnx.to_pure_dict(n), shard(n))
                           for k, n in zip(("params", "rest"), new)}


def compile_decode(setup: setup_lib.Setup, batch: int, prompt: int) -> tuple[Program, Program]:
  """`decode.prefill` of [batch, prompt] tokens, then one `decode.decode_step`, as
  `decode.generate` runs them: on the `Decoder.for_decoding` parameters, with the per-layer
  parameters (`Decoder.layer_params`) made once outside the step. The step takes the state as
  the compiled prefill lays it out; when the prefill is refused for memory, as the compiled
  `init_state` lays out a state of the same capacity (the same arrays: the step is still
  compiled and reported)."""
  graphdef, st = _decoding_state(setup)
  capacity = prompt + DECODE_NEW
  tok_sh = shd.batch_sharding(setup.mesh, setup.rules)
  model = lambda params, rest: nnx.merge(graphdef, params, rest)

  def prefill(params, rest, prompt_BT):
    return decode.prefill(model(params, rest), prompt_BT, capacity=capacity)

  def step(params, rest, layer_params, token_B, pos_B, state):
    return decode.decode_step(model(params, rest), token_B, pos_B, state, layer_params)

  prompt_BT = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=tok_sh)
  one_sh = shd.batch_sharding(setup.mesh, setup.rules, ndim=1)
  token_B = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=one_sh)
  holder = {}

  def outputs_of(c, f, *args):
    """`f`'s abstract outputs with the shardings compiled program `c` gives them."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        jax.eval_shape(f, *args), c.output_shardings)

  def laid_out(f):
    """f(params, rest)'s abstract outputs as its compiled program lays them out."""
    with shd.use_rules(setup.mesh, setup.rules):
      return outputs_of(jax.jit(f).lower(st["params"], st["rest"]).compile(), f,
                        st["params"], st["rest"])

  def run_prefill(opts):
    with shd.use_rules(setup.mesh, setup.rules):
      c = decode.jit_stateful(prefill).lower(st["params"], st["rest"], prompt_BT).compile(opts)
    holder["state"] = outputs_of(c, prefill, st["params"], st["rest"], prompt_BT)[1]
    return c

  def run_step(opts):
    layers = laid_out(lambda p, r: model(p, r).layer_params())
    state = holder["state"] if "state" in holder else laid_out(
        lambda p, r: model(p, r).init_state(batch, capacity))
    with shd.use_rules(setup.mesh, setup.rules):
      return decode.jit_stateful(step, donate_argnums=(5,)).lower(
          st["params"], st["rest"], layers, token_B, token_B, state).compile(opts)

  pre = _program("prefill", f"[{batch}, {prompt}] -> capacity {capacity}", run_prefill, prompt)
  one = _program("decode", f"[{batch}, 1] at capacity {capacity}", run_step, prompt)
  return pre, one


@dataclasses.dataclass
class Report:
  config_name: str
  target: targets_lib.Target
  mesh: dict
  n_params: int
  programs: list[Program]
  fit: memory.Fit
  fitting_batch: tuple[int, int] | None    # (micro, accum) that fits, when the config's does not
  fit_error: str = ""
  t_is_a_width: bool = False   # T is also an activation width: a [.., T, T] shape may be an
                               # activation [.., T, width] (`activation_widths`)


def activation_widths(setup: setup_lib.Setup) -> set[int]:
  """The widths an activation may have: every dimension of a parameter and every product of
  two adjacent ones (heads x head_dim flattened). When the training length T is one of them
  (Mamba-2 369M: d_inner = 32 x 64 = 2048), a buffer [.., T, T] may be [.., T, width]:
  `square_buffers` cannot tell them apart and the report says so."""
  out = set()
  for leaf in jax.tree.leaves(setup.abstract_state):
    shape = [int(d) for d in getattr(leaf, "shape", ())]
    out.update(shape)
    out.update(a * b for a, b in zip(shape, shape[1:]))
  return out


def _fitting_batch(setup, accum: int, micro: int, seq_len: int, available: int,
                   options: dict):
  """(micro, accum) of the largest micro-batch that fits; (None, why) if even the smallest
  does not. `options`: the XLA options the train program needed."""
  total = micro * accum
  try:
    return memory.pick_micro_batch(
        lambda m: setup_lib.step_memory(setup, m, total // m, seq_len, options or None), total,
        available=available, multiple_of=shd.batch_shards(setup.mesh, setup.rules)), ""
  except ValueError as e:
    return None, str(e)


def compile_for_target(config: ml_collections.ConfigDict, target_name: str, *,
                       config_name: str = "", programs=("train", "eval", "decode"),
                       search_fit: bool = True) -> Report:
  """Compile `programs` of `config` for `target_name` (module docstring). A mesh that does not
  fit the target's devices is an error naming config.mesh.shape."""
  target = targets_lib.get(target_name)
  devs = targets_lib.devices(target_name)
  setup = setup_lib.build_setup(config, devices=devs)
  accum, micro, T = _geometry(config)
  progs = []
  if "train" in programs:
    progs.append(compile_train(setup, accum, micro, T))
  if "eval" in programs:
    progs.append(compile_eval(setup, micro, T))
  if "decode" in programs:
    progs.extend(compile_decode(setup, micro, T))
  avail, source = target.usable_bytes()
  train = next((p for p in progs if p.name == "train"), None)
  fit = fitting = None
  why = ""
  if train is not None:
    fit = memory.check_fit(train.memory, available=avail, source=f"{target.name}: {source}",
                           micro_batch=micro, grad_accum=accum, remat=setup.cfg.remat)
    if not fit.fits and search_fit:
      fitting, why = _fitting_batch(setup, accum, micro, T, avail, train.options)
  return Report(config_name, target, dict(setup.mesh.shape), setup.n_params["total"], progs,
                fit, fitting, why, T in activation_widths(setup))


def _gib(n: int) -> str:
  return f"{n / memory.GiB:.2f} GiB"


def format_report(r: Report) -> str:
  """The report as lines a person reads (experiments/train.py --compile_only prints it)."""
  t = r.target
  lines = [f"{r.config_name or 'config'} compiled for {t.name}: {len(targets_lib.devices(t.name))}"
           f" x {targets_lib.devices(t.name)[0].device_kind} ({t.hosts} host(s)), mesh {r.mesh}, "
           f"{r.n_params:,} parameters; nothing was run."]
  for p in r.programs:
    m = p.memory
    if isinstance(m, memory.Refused):
      lines.append(f"  {p.name:8s} {p.shape}: refused by the compiler for memory, more than "
                   f"{_gib(p.needed)} per device ({m.reason}); after {p.compile_s:.1f} s")
      continue
    lines.append(
        f"  {p.name:8s} {p.shape}: {_gib(p.needed)} per device (arguments "
        f"{_gib(m.argument_size_in_bytes)}, outputs {_gib(m.output_size_in_bytes)}, donated "
        f"{_gib(m.alias_size_in_bytes)}, temporaries {_gib(m.temp_size_in_bytes)}); compiled "
        f"in {p.compile_s:.1f} s")
    kern = ", ".join(f"{k} x{n}" for k, n in sorted(p.kernels.items())) or "none"
    coll = ", ".join(f"{k} x{n}" for k, n in p.collectives.items()) or "none"
    lines.append(f"           kernels: {kern}; collectives: {coll}")
    if p.loops is not None:
      lines.append(f"           {hlo_loops.summary(p.loops)}")
    if p.options:
      lines.append(f"           compiled with {p.options}: XLA found no tiling for a Triton "
                   "GEMM fusion without a GPU to autotune on (train/aot.py)")
    if p.tt_buffers and p.name in ("train", "eval"):
      maybe = (" (T is also an activation width here: these may be [.., T, width] "
               "activations)" if r.t_is_a_width else "")
      lines.append(f"           [.., T, T] buffers{maybe}: {', '.join(p.tt_buffers[:4])}")
  if r.fit is not None:
    lines.append("fit: " + r.fit.message)
    if r.fitting_batch:
      micro, accum = r.fitting_batch
      lines.append(f"fits at micro-batch {micro} x grad_accum {accum} (same tokens per step): "
                   f"--config.data.global_batch_size={micro} --config.train.grad_accum={accum}"
                   " (or --config.train.auto_microbatch=True)")
    elif r.fit_error:
      lines.append("no micro-batch fits: " + r.fit_error.split(". ")[0])
  return "\n".join(lines)


def fits_somewhere(r: Report) -> bool:
  """The train step fits the target at the config's batch or at a smaller micro-batch."""
  return r.fit is not None and (r.fit.fits or r.fitting_batch is not None)


def compile_only_main(config: ml_collections.ConfigDict, target_names: str,
                      config_name: str = "") -> int:
  """`experiments/train.py --compile_only=<target>[,<target>...]`: print each target's report
  in turn; exit status 0 when the train step fits every target (at the config's batch or a
  smaller micro-batch it names), 3 when it fits at none on some target. The targets' devices
  exist for compiling only, so the process computes on its CPU (experiments/train.py sets
  JAX_PLATFORMS=cpu before JAX starts)."""
  names = [n.strip() for n in target_names.split(",") if n.strip()]
  for name in names:
    targets_lib.get(name)                 # an unknown name: one line listing the known ones
  status = 0
  for i, name in enumerate(names):
    with native_logs.filtered():          # libtpu's start-up warnings
      targets_lib.devices(name)
    report = compile_for_target(config, name, config_name=config_name)
    print(("\n" if i else "") + format_report(report))
    if runs_pallas_gpu_kernels(report):
      print(census_report(config, name, ssd=runs_ssd_kernels(report)))
    status = status if fits_somewhere(report) else 3
  return status


def runs_pallas_gpu_kernels(r: Report) -> bool:
  """Whether a program of the report runs Pallas kernels through Triton (a GPU target)."""
  return any(p.kernels.get("Triton (Pallas GPU)") for p in r.programs)


def runs_ssd_kernels(r: Report) -> bool:
  """Whether a program of the report runs the fused SSD kernels (`kernels/ssd_chunks.py`)."""
  return any("ssd_" in k for p in r.programs for k in p.kernels if k.startswith("Pallas"))


def census_report(config: ml_collections.ConfigDict, target_name: str, ssd: bool = False) -> str:
  """The kernel census (`train/kernel_census.py`) at the config's head dim and dtype: every
  pass of the decayed-attention kernel as each mixer calls it, and JAX's own Pallas `mha`,
  compiled for the target's first device, at the config's seq_len rounded up to a multiple of
  128 (JAX's `mha` tiles). The counts are per (query, key) element: the loops' code hardly
  changes with the length, the share of tiles each loop visits does (the tiles meeting the
  diagonal, which the masked loops visit, are 32 of a pass's 272 at T 2048 and head dim 64, 4
  of 6 at T 256: there the decayed kernel's sums read higher). `ssd`: the fused SSD kernels'
  census too (`kernel_census.ssd_census`), for a step that runs them."""
  m = config.model
  T = -(-config.data.seq_len // 128) * 128
  head_dim = m.d_model // m.n_heads
  passes = kernel_census.census(target_name, seq_len=T, head_dim=head_dim,
                                dtype=jnp.dtype(m.dtype))
  dtype = jnp.dtype(m.dtype).name
  out = kernel_census.format_census(
      passes, f" ({target_name}, T {T}, head dim {head_dim}, {dtype})")
  if ssd:   # the SSD kernels as each Mamba mixer calls them (`ssd_census`: head dim, d_state 64)
    ps = kernel_census.ssd_census(target_name, seq_len=T, dtype=jnp.dtype(m.dtype))
    ratio = kernel_census.per_64_macs(ps)
    out += "\n" + kernel_census.format_census(
        ps, f" (SSD, {target_name}, T {T}, head dim 64, d_state 64, {dtype})",
        kernel_census.SSD_UNIT)
    out += "\n" + "\n".join(f"  {v:8s} {r:.2f} instructions per 64 tensor-core multiply-adds"
                             for v, r in ratio.items())
  return out
