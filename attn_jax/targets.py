"""Named hardware targets, and compile-only devices for them on any machine.

XLA compiles for a GPU or TPU it does not have: `jax.experimental.topologies` describes a
topology (TPU through libtpu; NVIDIA GPUs through the jax-cuda12 plugin plus a
`GpuTargetConfigProto` naming the device's facts) and yields devices that programs can be
lowered and compiled for, with the device compiler's own passes, the SPMD partitioner on that
topology, the kernels it picks (cuDNN, Pallas/Mosaic) and a memory analysis, but never run.
Both plugins load under `JAX_PLATFORMS=cpu`: the process keeps computing on its CPU, the
target's devices are for compiling only (`pip install -e '.[targets]'`: jax 0.10.2's plugins on
Python 3.11, jax 0.12's on 3.12+, pyproject.toml).

Trace for a target under a mesh of its devices (`sharding.use_rules`, or a program built by
`sharding.traced_for`), not only with shardings on them: from JAX 0.11 the Pallas Triton
lowering reads the GPU it compiles for (compute capability) from the abstract mesh in context,
and off a GPU finds none anywhere else ("No supported GPU devices found"); JAX 0.10 assumed
compute capability 9.0 wherever no GPU was attached.

A target is data: name -> platform, device kind, memory per device, topology. Nothing else in
the package knows the list; `experiments/train.py --compile_only=<name>` builds the config's
mesh over `devices(name)` and reuses the trainer's own `build_setup` (`train/aot.py`).

Memory a run may use per device (`Target.usable_bytes`):
- GPU: JAX preallocates `XLA_PYTHON_CLIENT_MEM_FRACTION` of the device (0.75 by default) and
  the allocator never goes past it; the environment variable is read where it is set.
- TPU: the allocator's limit (`bytes_limit`) as a TPU VM reports it where we know it (v5e:
  15.75 GiB of 16), else the HBM per device.

TPU names follow Cloud TPU's: v5e-8 / v6e-8 are 8 chips (one device each); v5p-N counts
TensorCores, 2 per chip, and a v5p chip is one (megacore) device: v5p-8 = 4 devices. A name
must cover whole hosts (4 or 8 chips per host), so the smallest TPU targets are v5e-4 / v6e-4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

from attn_jax.native_logs import has_tpu_device

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA's GPU compiler needs to know of an NVIDIA device (a `GpuTargetConfigProto`),
  from the vendor's data sheet: compute capability, SM count, memory size and bandwidth,
  shared memory and clock; and the CUDA driver and runtime versions a machine running it
  reports (`cuda`), which XLA gates features on: jax 0.10.2's XLA captures while loops,
  conditionals and library calls in command buffers only for CUDA >= 12.3
  (`attn_jax.command_buffers`), and a device stating no version is taken as older."""
  description: str          # the device kind JAX reports
  compute_capability: tuple[int, int]
  sm_count: int
  memory_bytes: int          # total device memory, as CUDA reports it
  memory_bandwidth: int      # bytes / s
  l2_cache_bytes: int
  clock_ghz: float
  shared_memory_per_sm: int = 233472
  shared_memory_per_block_optin: int = 232448
  dnn_version: tuple[int, int, int] = (9, 10, 0)
  cuda: tuple[int, int, int] = (12, 8, 0)   # driver = runtime, a current machine's

  def target_config(self) -> str:
    """The text-format `GpuTargetConfigProto` of this device."""
    major, minor = self.compute_capability
    dnn = self.dnn_version
    cuda = ".".join(map(str, self.cuda))
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {self.shared_memory_per_sm}",
        "  threads_per_core_limit: 2048", f"  core_count: {self.sm_count}",
        "  fpus_per_core: 128", "  block_dim_limit_x: 2147483647",
        "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {self.memory_bandwidth}",
        f"  l2_cache_size: {self.l2_cache_bytes}", f"  clock_rate_ghz: {self.clock_ghz}",
        f"  device_memory_size: {self.memory_bytes}",
        f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        f'  driver_version: "{cuda}"', f'  runtime_version: "{cuda}"', "}", 'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
        f'device_description_str: "{self.description}"', ""])


H100 = GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_942_979_072, 3_352_320_000_000,
               52_428_800, 1.98)
H200 = GpuSpec("NVIDIA H200 141GB HBM3e", (9, 0), 132, 151_397_597_184, 4_800_000_000_000,
               52_428_800, 1.98)


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str              # "gpu" | "tpu"
  topology: str              # TPU "v5e:2x4"; GPU "slices x hosts x devices per host"
  memory_bytes: int          # per device
  allocator_limit: int | None = None   # TPU: the allocator's limit where known
  gpu: GpuSpec | None = None
  note: str = ""

  @property
  def n_devices(self) -> int:
    return len(devices(self.name))

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in devices(self.name)})

  def usable_bytes(self) -> tuple[int, str]:
    """(bytes a run may use per device, where the figure comes from): module docstring."""
    if self.platform == "gpu":
      frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
      return int(frac * self.memory_bytes), (
          f"{frac:.0%} of {self.memory_bytes / GiB:.1f} GiB: XLA_PYTHON_CLIENT_MEM_FRACTION")
    if self.allocator_limit:
      return self.allocator_limit, f"allocator limit of {self.memory_bytes / GiB:.0f} GiB HBM"
    return self.memory_bytes, "HBM per device"


def _gpu(name: str, spec: GpuSpec, hosts: int, per_host: int) -> Target:
  return Target(name, "gpu", f"1x{hosts}x{per_host}", spec.memory_bytes, gpu=spec)


def _tpu(name: str, topology: str, hbm_gib: float, limit_gib: float | None = None) -> Target:
  limit = int(limit_gib * GiB) if limit_gib else None
  return Target(name, "tpu", topology, int(hbm_gib * GiB), limit)


TARGETS: dict[str, Target] = {t.name: t for t in (
    _gpu("h100x1", H100, 1, 1), _gpu("h100x2", H100, 1, 2), _gpu("h100x4", H100, 1, 4),
    _gpu("h100x8", H100, 1, 8),
    _gpu("2x8xh100", H100, 2, 8), _gpu("h200x8", H200, 1, 8),
    _tpu("v5e-4", "v5e:2x2", 16, 15.75), _tpu("v5e-8", "v5e:2x4", 16, 15.75),
    _tpu("v5e-16", "v5e:4x4", 16, 15.75),
    _tpu("v5p-8", "v5p:2x2x1", 95), _tpu("v5p-32", "v5p:2x2x4", 95),
    _tpu("v6e-4", "v6e:2x2", 32), _tpu("v6e-8", "v6e:2x4", 32),
)}


def get(name: str) -> Target:
  """The target called `name`; an unknown name is one line listing the known ones."""
  if name not in TARGETS:
    raise ValueError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}")
  return TARGETS[name]


def _plugin_missing(platform: str, e: BaseException) -> RuntimeError:
  what = "jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cudnn-cu12" if platform == "gpu" else "libtpu"
  return RuntimeError(f"compiling for a {platform.upper()} target needs {what} at jax's "
                      f"version (pip install -e '.[targets]'): {type(e).__name__}: {e}")


def _quiet_libtpu_off_tpu_vm(t: Target, environ=os.environ, exists=os.path.exists) -> None:
  """Off a TPU VM, libtpu finds no host metadata, fills TPU_WORKER_HOSTNAMES and
  TPU_ACCELERATOR_TYPE with warning text, then logs errors parsing it (harmless: the topology
  name says the chips). A compile-only topology gets plain values instead: this host, and the
  target's Cloud TPU type (v5e's is "v5litepod"). A TPU VM's own values are never touched."""
  if has_tpu_device(exists):
    return
  generation, _, count = t.name.partition("-")
  environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  environ.setdefault("TPU_ACCELERATOR_TYPE",
                     f"{'v5litepod' if generation == 'v5e' else generation}-{count}")


@functools.cache
def devices(name: str) -> tuple[Any, ...]:
  """The compile-only devices of target `name` (cached: a topology is made once per process)."""
  from jax.experimental import topologies
  t = get(name)
  try:
    if t.platform == "tpu":
      # Compiling never touches a chip: let several processes (pytest workers) load libtpu.
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      _quiet_libtpu_off_tpu_vm(t)
      topo = topologies.get_topology_desc(platform="tpu", topology_name=t.topology)
    else:
      topo = topologies.get_topology_desc(platform="cuda", topology_name=t.topology,
                                          topology=t.topology,
                                          target_config=t.gpu.target_config())
  except Exception as e:   # a plugin absent or at another version
    raise _plugin_missing(t.platform, e) from e
  return tuple(topo.devices)


@contextlib.contextmanager
def no_persistent_cache():
  """JAX's persistent compilation cache off inside the block. A compile-only device has no
  client to serialise an executable with or reload one from (the cache's read warns "PjRtCompiler
  must be constructed with a Client"), and a compile timed for a report must be a compile, not
  a cache read. JAX decides once per process whether the cache is used, at its first compile:
  `reset_cache` makes it decide again on entry (off) and on exit (as configured)."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def available(name: str) -> bool:
  """Whether target `name` can be compiled for here (its plugin loads)."""
  try:
    devices(name)
    return True
  except RuntimeError:
    return False
