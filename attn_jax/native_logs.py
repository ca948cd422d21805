"""Drop the start-up chatter native libraries write to the process's stderr.

With the compile-only targets installed (`pip install -e '.[targets]'`), loading JAX's CUDA
plugin on a machine without a GPU writes INFO lines from C++ straight to file descriptor 2
("Could not find cuda drivers on your machine", "All log messages before absl::InitializeLog()
is called are written to STDERR"), and creating a TPU topology without a TPU writes warnings
about TPU_ACCELERATOR_TYPE. They are not errors and no Python logging filter sees them, but
they break the entry points' promise that a mistake is one line on stderr.

`filtered()` runs a block with fd 2 redirected to a temporary file, then writes back every line
that is not one of the known start-up lines (`NOISE`): anything else, a real error included,
still reaches stderr, only later (when the block ends).

The TPU runtime writes its warnings when JAX first creates its backends, which happens later,
outside any block. On a machine that exposes no accelerator device at all (`accelerators()`
finds no NVIDIA, AMD or TPU device node) and where JAX_PLATFORMS is unset, JAX would end on the
CPU anyway after trying each plugin; there `start_jax_quietly` sets JAX_PLATFORMS=cpu, which
skips those attempts (the compile-only targets still load: they need only the plugins).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from typing import Iterator

NOISE = tuple(re.compile(p) for p in (
    r"All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers",
    r"TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|TPU_SKIP_MDS_QUERY|TPU_HOST_BOUNDS",
    r"Failed to get TPU metadata|GetTpuMetadata|tpu_metadata|Source Location Trace",
    r"libtpu_init_utils\.cc|=== Source Location Trace: ===",
))


def is_noise(line: str) -> bool:
  return any(p.search(line) for p in NOISE)


@contextlib.contextmanager
def filtered() -> Iterator[None]:
  """Within the block, native writes to fd 2 are held; known start-up lines are dropped after
  it (module docstring). A no-op where fd 2 cannot be duplicated."""
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):
    yield
    return
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      try:
        sys.stderr.flush()
      except (OSError, ValueError):
        pass
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      kept = [ln for ln in tmp.read().decode(errors="replace").splitlines()
              if ln.strip() and not is_noise(ln)]
      if kept:
        sys.stderr.write("\n".join(kept) + "\n")
        sys.stderr.flush()


CUDA_UNLOADABLE = ("Unable to load CUDA", "Error loading CUDA libraries")
CUDA_NOTE = ("JAX's CUDA plugin is installed but CUDA cannot be loaded on this machine (no "
             "driver or runtime): JAX runs without the GPU (ATTN_JAX_DEBUG=1 shows the traceback)")


NVIDIA_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia")
TPU_NODES = ("/dev/accel0", "/dev/vfio/vfio")       # v2-v5e: accel, v5p and later: vfio
DEVICE_NODES = NVIDIA_NODES + ("/dev/kfd",) + TPU_NODES   # NVIDIA, AMD (ROCm), TPU


def accelerators(exists=os.path.exists, nodes=DEVICE_NODES) -> list[str]:
  """The accelerator device nodes of `nodes` this machine exposes."""
  return [p for p in nodes if exists(p)]


def has_tpu_device(exists=os.path.exists) -> bool:
  """Whether the kernel exposes a TPU chip (this is a TPU VM)."""
  return bool(accelerators(exists, nodes=TPU_NODES))


def has_nvidia_device() -> bool:
  """Whether the kernel exposes an NVIDIA GPU (a driver loaded), whatever CUDA's state."""
  return bool(accelerators(nodes=NVIDIA_NODES))


class CudaPluginNote(logging.Filter):
  """JAX logs a CUDA plugin that cannot load CUDA as a 20-line traceback. On a machine with no
  NVIDIA device (the compile-only targets extra on a laptop or CPU server) there is no GPU to
  lose: the record is dropped. With a device, CUDA is broken and the GPU unused: the record
  becomes `CUDA_NOTE`, one line. Any other plugin error passes unchanged."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    chain = []
    while exc is not None and len(chain) < 8:
      chain.append(str(exc))
      exc = exc.__cause__ or exc.__context__
    if str(record.msg).startswith("Jax plugin configuration error") and any(
        m in c for c in chain for m in CUDA_UNLOADABLE):
      if not has_nvidia_device():
        return False
      record.msg, record.args, record.exc_info, record.exc_text = CUDA_NOTE, (), None, None
    return True


def cpu_only_default(environ=os.environ, exists=os.path.exists) -> bool:
  """Set JAX_PLATFORMS=cpu when it is unset and no accelerator exists; whether it was set."""
  if environ.get("JAX_PLATFORMS") or accelerators(exists):
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  return True


def start_jax_quietly() -> None:
  """Import JAX and register its PJRT plugins now, with their start-up chatter filtered
  (importing JAX loads the CUDA plugin's libraries; JAX registers plugins lazily on first
  backend use). Registration creates no device client, so `jax.distributed.initialize` may
  still come after. The registration uses JAX's private hook where this JAX has it."""
  cpu_only_default()
  bridge, note = logging.getLogger("jax._src.xla_bridge"), CudaPluginNote()
  bridge.addFilter(note)
  try:
    with filtered():
      import jax  # noqa: F401
      try:
        from jax._src import xla_bridge as xb
      except ImportError:
        return
      register = getattr(xb, "_discover_and_register_pjrt_plugins", None)
      if register is not None and not getattr(xb, "_plugins_registered", True):
        register()
  finally:
    bridge.removeFilter(note)
