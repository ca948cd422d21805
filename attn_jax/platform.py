"""The platform a program is compiled for: "cpu", "gpu" or "tpu".

Kernel choices (`attention.core.choose_impl`, the cumulative sums of `layers.time_cumsum`, XLA
options of `decode`) depend on the machine that will *run* the program, which is not always the
machine that traces it: compiling for a TPU slice or 8 x H100 from a CPU host
(`attn_jax.targets`, `experiments/train.py --compile_only=...`) traces on a process whose
`jax.default_backend()` is "cpu". So nothing that chooses a kernel reads the default backend;
it reads `current()`:

  1. the platform of the innermost `use_platform(...)` block (`sharding.use_rules(mesh, ...)`,
     entered by the trainer, evaluator and decoder while tracing, opens one for its mesh's
     devices), else
  2. the process's default backend (eager use in a notebook: the program runs where it is
     traced).

The value is read at trace time. A jitted function traced under one platform is cached by jit
together with its mesh (`jax.set_mesh` is part of the cache key), so compiling the same
function for another target re-traces it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attn_jax_target_platform", default=None)


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
def use_platform(target: Any) -> Iterator[str]:
  """Within this block `current()` is `target`'s platform: a name ("tpu", "cuda", ...), a
  device, a device list or a mesh."""
  name = normalize(target) if isinstance(target, str) else of_devices(target)
  token = _CURRENT.set(name)
  try:
    yield name
  finally:
    _CURRENT.reset(token)


def current() -> str:
  """The platform the program being traced is for (module docstring)."""
  name = _CURRENT.get()
  return name if name is not None else normalize(jax.default_backend())
