"""Will the compiled train step fit in device memory, what to change if not, and the largest
micro-batch that fits (`train.auto_microbatch`).

Needed bytes of one compiled step, from XLA's `compiled.memory_analysis()`:

    needed = arguments + outputs - aliased (donated inputs reused as outputs) + temporaries
             + generated code

or the analysis' `peak_memory_in_bytes` where the backend reports a larger one. Available
bytes: `device.memory_stats()["bytes_limit"]` on GPU/TPU (what the allocator may use); on CPU
the machine's `MemAvailable` from /proc/meminfo (RAM not in use now, page cache included).
A step fits when needed <= `headroom` x available (default 0.95: fragmentation, buffers
outside the step such as the prefetched batches).

A compiler may refuse a program for memory before any analysis exists: XLA for TPU checks the
program against the chip's HBM while compiling and raises RESOURCE_EXHAUSTED ("Ran out of
memory on HBM, the total memory required for HLO temporaries (26.99G) exceeds available HBM
(15.75G)"). `analysis_or_refusal` turns that error into a `Refused` analysis holding the bytes it
names (a lower bound of the need) so that a fit check or the micro-batch search goes on: a
refused step never fits.

Knobs named in the message (config fields): `data.global_batch_size` is the micro-batch (the
sequences of one forward/backward, summed over hosts), `train.grad_accum` the number of
micro-batches per optimizer step (tokens per update = micro-batch x accumulation x seq_len),
`model.remat` the rematerialisation policy of a block (none | dots | full), and
`train.auto_microbatch`, which calls `pick_micro_batch` below: the largest micro-batch that
divides the global batch (and is a multiple of the data-parallel shards) and fits, with the
accumulation raised to keep the same global batch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax

from attn_jax.registry import get_mixer

GiB = 1024 ** 3


def needed_bytes(mem: Any) -> int:
  """Bytes one execution of a compiled program needs (see module docstring)."""
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
           + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
  return int(max(total, getattr(mem, "peak_memory_in_bytes", 0) or 0))


@dataclasses.dataclass(frozen=True)
class Refused:
  """Stands in for `memory_analysis()` of a program the compiler refused for memory (module
  docstring): `temp_size_in_bytes` is what the error names, `reason` its first line."""
  temp_size_in_bytes: int
  reason: str
  argument_size_in_bytes: int = 0
  output_size_in_bytes: int = 0
  alias_size_in_bytes: int = 0
  generated_code_size_in_bytes: int = 0


_REFUSAL_RE = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory")
_NAMED_BYTES_RE = re.compile(r"(?:HLO temporaries \(|Used )([\d.]+)([KMGT]?)")
_UNIT = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def refusal(error: BaseException) -> Refused | None:
  """The `Refused` analysis of a compiler's out-of-memory error; None for any other error."""
  text = str(error)
  if not _REFUSAL_RE.search(text):
    return None
  m = _NAMED_BYTES_RE.search(text)
  named = int(float(m.group(1)) * _UNIT[m.group(2)]) if m else 0
  first = text[_REFUSAL_RE.search(text).start():].splitlines()[0]
  return Refused(named, first[:300])


def analysis_or_refusal(compile_fn: Callable[[], Any]) -> Any:
  """`compile_fn().memory_analysis()`, or the `Refused` analysis when the compiler refuses the
  program for memory (other errors propagate)."""
  try:
    return compile_fn().memory_analysis()
  except Exception as e:   # noqa: BLE001 - only a refusal for memory is absorbed
    refused = refusal(e)
    if refused is None:
      raise
    return refused


def fits_in(mem: Any, available: int, headroom: float = 0.95) -> bool:
  """needed <= headroom x available, and never for a refused program."""
  return not isinstance(mem, Refused) and needed_bytes(mem) <= headroom * available


def _meminfo_available(path: str = "/proc/meminfo") -> int:
  with open(path) as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024  # kB
  raise RuntimeError(f"no MemAvailable line in {path}")


def available_bytes(device=None) -> tuple[int, str]:
  """(bytes the step may use on `device`, where that figure comes from)."""
  device = device or jax.local_devices()[0]
  stats = None
  if device.platform != "cpu":
    try:
      stats = device.memory_stats()
    except Exception:  # a backend without allocator statistics
      stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"{device.device_kind} bytes_limit"
  return _meminfo_available(), "MemAvailable in /proc/meminfo"


@dataclasses.dataclass(frozen=True)
class Fit:
  fits: bool
  needed: int
  available: int
  source: str
  message: str


def _gib(n: int) -> str:
  return f"{n / GiB:.2f} GiB"


def fit_message(mem: Any, available: int, source: str, *, micro_batch: int | None = None,
                grad_accum: int | None = None, remat: str | None = None,
                headroom: float = 0.95) -> str:
  """One paragraph: needed vs available memory, the breakdown, and the knobs to turn."""
  need = needed_bytes(mem)
  ok = fits_in(mem, available, headroom)
  head = (f"The compiler refused the train step for memory: more than {_gib(need)} per device "
          f"({mem.reason}); available: {_gib(available)} ({source}, {headroom:.0%} usable)"
          if isinstance(mem, Refused) else f"The compiled train step needs {_gib(need)} per device (arguments "
          f"{_gib(mem.argument_size_in_bytes)} + outputs {_gib(mem.output_size_in_bytes)} - "
          f"donated {_gib(mem.alias_size_in_bytes)} + temporaries {_gib(mem.temp_size_in_bytes)}"
          f" + code {_gib(mem.generated_code_size_in_bytes)}); available: {_gib(available)} "
          f"({source}, {headroom:.0%} usable)")
  if ok:
    return head + f": it fits ({need / available:.0%} of the device)."
  now = []
  if micro_batch is not None:
    now.append(f"data.global_batch_size={micro_batch}")
  if grad_accum is not None:
    now.append(f"train.grad_accum={grad_accum}")
  if remat is not None:
    now.append(f"model.remat={remat!r}")
  now_s = f" (now {', '.join(now)})" if now else ""
  return (head + f": it does not fit{now_s}. Temporaries (activations) scale with the "
          "micro-batch: lower data.global_batch_size (the micro-batch) and raise "
          "train.grad_accum by the same factor to keep the tokens per optimizer step, or set "
          "train.auto_microbatch=True to pick the largest micro-batch that fits; "
          "model.remat='full' (or 'dots') trades recomputation for activation memory.")


def check_fit(mem: Any, *, device=None, available: int | None = None, source: str = "given",
              headroom: float = 0.95, **knobs) -> Fit:
  """Fit of a compiled step's memory analysis on `device` (or against `available` bytes)."""
  if available is None:
    available, source = available_bytes(device)
  need = needed_bytes(mem)
  return Fit(fits_in(mem, available, headroom), need, available, source,
             fit_message(mem, available, source, headroom=headroom, **knobs))


def micro_batch_candidates(global_batch: int, multiple_of: int = 1) -> list[int]:
  """Divisors of `global_batch` that are multiples of `multiple_of`, largest first."""
  return [m for m in range(global_batch, 0, -1)
          if global_batch % m == 0 and m % multiple_of == 0]


def pick_micro_batch(analyze: Callable[[int], Any], global_batch: int, *,
                     available: int | None = None, device=None, multiple_of: int = 1,
                     headroom: float = 0.95) -> tuple[int, int]:
  """(micro_batch, grad_accum) with micro_batch x grad_accum = global_batch: the largest
  micro-batch whose compiled step fits. `analyze(m)` returns the memory analysis of the step
  compiled for micro-batch m (e.g. `jit(step).lower(abstract state, batch of m).compile()
  .memory_analysis()`). Memory grows with m, so a binary search over the candidates compiles
  O(log #candidates) steps. Raises ValueError (with the fit message) if none fits."""
  if available is None:
    available, _ = available_bytes(device)
  cands = micro_batch_candidates(global_batch, multiple_of)
  if not cands:
    raise ValueError(f"no micro-batch divides the global batch {global_batch} into multiples "
                     f"of the {multiple_of} data-parallel shards")
  cache = {}

  def fits(m):
    if m not in cache:
      cache[m] = fits_in(analyze(m), available, headroom)
    return cache[m]

  lo, hi = 0, len(cands) - 1  # cands descending: find the first index that fits
  if not fits(cands[hi]):
    smallest = cands[hi]
    msg = fit_message(analyze(smallest), available, "given" if device is None else "device",
                      micro_batch=smallest, grad_accum=global_batch // smallest,
                      headroom=headroom)
    raise ValueError(f"even micro-batch {smallest} does not fit. {msg}")
  while lo < hi:
    mid = (lo + hi) // 2
    if fits(cands[mid]):
      hi = mid
    else:
      lo = mid + 1
  return cands[lo], global_batch // cands[lo]


def mixer_memory(cfg, mixer: str, batch: int, seq_len: int) -> Any:
  """XLA's compiled memory analysis of one mixer layer's forward + backward (loss = sum of
  squares of its output) on abstract [batch, seq_len, d_model] inputs: nothing is allocated.
  Compares mixers' own memory, e.g. SISA's chunked path against plain attention."""
  import jax.numpy as jnp
  from flax import nnx


  cls = get_mixer(mixer)
  layer = nnx.eval_shape(lambda: cls(cfg, cfg.options_for(mixer), rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, positions_BT=None)[0].astype(jnp.float32) ** 2)

  x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
  return jax.jit(jax.grad(loss)).lower(state, x).compile().memory_analysis()
