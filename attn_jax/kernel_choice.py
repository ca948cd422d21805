"""Which implementation each part of a program runs: chosen here, from the platform the program
is compiled for ("cpu", "gpu" or "tpu"), the shapes and the options, and nowhere else.

The platform. Kernel choices depend on the machine that will *run* the program, which is not
always the machine that traces it: compiling for a TPU slice or 8 x H100 from a CPU host
(`attn_jax.targets`, `experiments/train.py --compile_only=...`) traces on a process whose
`jax.default_backend()` is "cpu". So no choice reads the default backend; `target()` is

  1. the platform of the innermost `use_platform(...)` block (`sharding.use_rules(mesh, ...)`
     and `sharding.traced_for(mesh, ...)`, which every program the trainer builds for a mesh
     traces under, open one for the mesh's devices), else
  2. the process's default backend (eager use in a notebook: the program runs where it is
     traced).

It is read at trace time. A program built for a mesh (`setup.Setup.step_fn`) enters its
mesh's platform inside its own trace, so it compiles that target's kernels wherever and
however it is lowered. Only this module and the kernels that lower for two compilers
(`kernels/decayed.py`, `kernels/ssd_chunks.py`: Triton on a GPU, Mosaic on a TPU) read
`target()`. The kernels room's entry points (`kernels/entry.py` for attention,
`ssd_chunks.chunked_ssd` for the Mamba mixers' SSD) ask the functions below which core to call;
mixers hand them their features and name no core (a few platform facts that are not a core,
such as `parallel_time_sums`, they ask directly).

The choices (each distinct outcome is logged once, at INFO):

  attention_impl     `attention_impl="auto"` -> "cudnn" on a GPU for bf16 / fp16 heads of at
                     most 256 channels, a multiple of 8 (cuDNN's flash attention), else "xla";
                     "splash" on a TPU; "blocked" on a CPU (`experiments/bench_attention.py`).
  remat_attention    whether a call rematerialises its attention core: the cores that keep
                     the [T, S] probabilities for the backward ("einsum", "blocked", "xla") are
                     recomputed instead (on a CPU faster as well as smaller); fused kernels
                     (cuDNN, splash) keep O(T) residuals and are not.
  parallel_time_sums running sums over time as parallel programs (GPU, TPU: XLA:GPU pays a
                     host round trip for every while-loop iteration, so a loop over T tokens
                     is a slow step) or a `lax.scan` (CPU, where an iteration is cheap and
                     `jnp.cumsum` lowers to an O(T^2) reduce_window).
  forget_path        FoX's "auto": "blocked" on a CPU up to a length, else "flash".
  decayed_kernel     whether a decayed call takes `kernels/decayed.py` (auto, on GPU /
                     TPU, shapes it takes; a misfit is logged once per reason, as a warning).
  ssd_kernel         whether a Mamba mixer's chunked SSD takes `kernels/ssd_chunks.py` (GPU /
                     TPU, shapes it takes; a misfit is logged once per reason, as a warning).
  decode_kernel      whether a one-token step of a KV cache takes `kernels/decode_attend.py`
                     (its RoPE, cache write and attention in one launch: GPU, or
                     `kernels_on_cpu`; a misfit is logged once per reason).
  pallas_interpret   whether a Pallas kernel written for one backend runs in the interpreter
                     (any other platform: tests on a CPU).
  stateful_compiler_options  XLA options for steps that update a decoding state in place (and
                     on a GPU run as CUDA graphs, their loops too: `command_buffers`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from attn_jax import command_buffers

log = logging.getLogger(__name__)

PLATFORMS = ("cpu", "gpu", "tpu")
ATTENTION_IMPLS = ("auto", "einsum", "blocked", "xla", "cudnn", "splash")
REMAT_CORE_IMPLS = ("einsum", "blocked", "xla")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attn_jax_target_platform", default=None)
_KERNELS_ON_CPU: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "attn_jax_kernels_on_cpu", default=False)
_LOGGED: set[str] = set()

# None: by platform (`parallel_time_sums`); True / False forces one form (tests run the GPU/TPU
# form on a CPU and the CPU form anywhere).
FORCE_PARALLEL_TIME_SUMS: bool | None = None


# ------------------------------------------------------------------ the platform

def normalize(name: str) -> str:
  """"cuda" / "rocm" / "gpu" -> "gpu"; "tpu"; "cpu". Anything else is an error naming it."""
  try:
    return _ALIASES[str(name).lower()]
  except KeyError:
    raise ValueError(f"unknown platform {name!r} (one of {', '.join(PLATFORMS)}, or cuda / "
                     "rocm)") from None


def of_devices(devices: Any) -> str:
  """The platform of a mesh (`mesh.devices`), a device list or one device."""
  flat = getattr(devices, "devices", devices)          # a Mesh -> its device array
  flat = getattr(flat, "flat", flat)                    # numpy array -> iterator
  first = flat if hasattr(flat, "platform") else next(iter(flat))
  return normalize(first.platform)


@contextlib.contextmanager
def use_platform(target_: Any) -> Iterator[str]:
  """Within this block `target()` is `target_`'s platform: a name ("tpu", "cuda", ...), a
  device, a device list or a mesh."""
  name = normalize(target_) if isinstance(target_, str) else of_devices(target_)
  token = _TARGET.set(name)
  try:
    yield name
  finally:
    _TARGET.reset(token)


def target() -> str:
  """The platform the program being traced is for (module docstring)."""
  name = _TARGET.get()
  return name if name is not None else normalize(jax.default_backend())


def _note(line: str, level: int = logging.INFO) -> None:
  if line not in _LOGGED:
    _LOGGED.add(line)
    log.log(level, line)


# ------------------------------------------------------------------ the choices

def attention_impl(impl: str, q_dtype, dqk: int, plat: str | None = None) -> str:
  """The attention core `impl` runs as ("auto" resolved on `plat`, default `target()`)."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r} ({' | '.join(ATTENTION_IMPLS)})")
  if impl != "auto":
    return impl
  plat = target() if plat is None else normalize(plat)
  if plat == "gpu":
    fused = jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) and dqk <= 256 and dqk % 8 == 0
    out = "cudnn" if fused else "xla"
  else:
    out = "splash" if plat == "tpu" else "blocked"
  _note(f"attention core: auto -> {out} on {plat} ({jnp.dtype(q_dtype).name}, q.k width {dqk})")
  return out


def remat_attention(impl: str, q_dtype, dqk: int) -> bool:
  """Whether the core `impl` resolves to keeps [T, S] probabilities for its backward, so a
  mixer rematerialises it (module docstring)."""
  return attention_impl(impl, q_dtype, dqk) in REMAT_CORE_IMPLS


def parallel_time_sums() -> bool:
  """Running sums over time as parallel programs (GPU, TPU) or a `lax.scan` (CPU)."""
  if FORCE_PARALLEL_TIME_SUMS is not None:
    return FORCE_PARALLEL_TIME_SUMS
  return target() != "cpu"


def forget_path(T: int, blocked_max_len: int) -> str:
  """FoX's "auto" path: "blocked" on a CPU for T <= blocked_max_len, else "flash"."""
  return "blocked" if target() == "cpu" and T <= blocked_max_len else "flash"


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
  """Within this block `decayed_kernel` says yes on a CPU too (the kernel then runs in the
  Pallas interpreter): tests of the mixers' kernel branch without a GPU or TPU."""
  token = _KERNELS_ON_CPU.set(True)
  try:
    yield
  finally:
    _KERNELS_ON_CPU.reset(token)


def decayed_kernel(impl: str, why_not: Callable[[str], str | None], *, what: str) -> bool:
  """Whether `what` (a mixer) runs its full forward on the decayed-attention kernel:
  `impl == "auto"`, a GPU or TPU (or `kernels_on_cpu`), and `why_not(platform)` None (the
  kernel's `unsupported` for these shapes). A misfit is logged once per reason."""
  plat = target()
  if impl != "auto" or (plat == "cpu" and not _KERNELS_ON_CPU.get()):
    return False
  why = why_not(plat)
  if why is not None:
    _note(f"{what}: decayed-attention kernel not used on {plat} ({why}); blockwise path",
          logging.WARNING)
    return False
  _note(f"{what}: decayed-attention kernel on {plat}")
  return True


def _kernel_or_xla(why_not: Callable[[str], str | None], what: str, kernel: str, xla: str,
                   platforms: tuple[str, ...]) -> bool:
  """Whether `what` runs on its kernel (named `kernel` in the log): a platform in `platforms`
  (or a CPU under `kernels_on_cpu`) and `why_not(platform)` None. A misfit is logged once per
  reason, naming the XLA path (`xla`) taken instead."""
  plat = target()
  if plat not in platforms and not (plat == "cpu" and _KERNELS_ON_CPU.get()):
    return False
  why = why_not(plat)
  if why is not None:
    _note(f"{what}: {kernel} not used on {plat} ({why}); {xla}", logging.WARNING)
    return False
  _note(f"{what}: {kernel} on {plat}")
  return True


def ssd_kernel(why_not: Callable[[str], str | None], *, what: str) -> bool:
  """Whether `what` (a mixer) runs its chunked SSD on `kernels/ssd_chunks.py`: a GPU or TPU
  (or `kernels_on_cpu`) and `why_not(platform)` None (the kernel's `unsupported` for these
  shapes). A misfit is logged once per reason; the mixer then keeps `ssd.ssd_chunked`."""
  return _kernel_or_xla(why_not, what, "SSD kernel", "XLA chunked SSD", ("gpu", "tpu"))


def decode_kernel(why_not: Callable[[str], str | None], *, what: str) -> bool:
  """Whether `what` (a cache's one-token step) runs on `kernels/decode_attend.py`: a GPU (or
  `kernels_on_cpu`) and `why_not(platform)` None. A misfit is logged once per reason."""
  return _kernel_or_xla(why_not, what, "decode kernel", "XLA path", ("gpu",))


def pallas_interpret(backend: str) -> bool:
  """Whether a Pallas kernel written for `backend` ("tpu", "gpu") runs in the interpreter:
  on any other platform."""
  return target() != normalize(backend)


def stateful_compiler_options() -> dict:
  """XLA options for compiling a step that reads a decoding state and updates it (every
  decoding program: `decode.jit_stateful`, `decode.generate`): on a CPU, copy insertion with
  region analysis (off there by default, for compile time). Without it XLA copies every KV
  buffer that is read before its in-place write (twice over for a batch of one); with it the
  write happens in place (`experiments/bench_stream.py`). On a GPU, XLA command buffers that
  hold while loops too (`command_buffers.compiler_options`: the step and the generation loop as
  CUDA graphs; off with ATTN_JAX_DECODE_COMMAND_BUFFERS=0). TPU: none."""
  plat = target()
  if plat == "cpu":
    return {"xla_cpu_copy_insertion_use_region_analysis": True}
  return command_buffers.compiler_options(plat)
