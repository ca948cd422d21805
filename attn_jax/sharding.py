"""Device mesh and logical-axis sharding rules (all sharding decisions live here + the config).

Parameters carry logical axis names (`nnx.Param(..., out_sharding=(...))`); the config maps
each logical name to a mesh axis, a tuple of mesh axes, or None (replicated):

    config.mesh.rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ...)

Data parallel, FSDP and tensor parallel are therefore config edits (mesh.shape). A dimension
whose size is not divisible by its mesh axes falls back to replicated (logged once), so tiny
test models run on any mesh.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices=None) -> Mesh:
  """Mesh over all devices; one -1 entry in `shape` takes the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if shape.count(-1) > 1:
    raise ValueError(f"config.mesh.shape: at most one -1 allowed, got {tuple(shape)}")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"config.mesh.shape {tuple(shape)}: {len(devices)} devices are not "
                       f"divisible by {known}")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"config.mesh.shape {tuple(shape)} needs {math.prod(shape)} devices, "
                     f"have {len(devices)}")
  try:
    dev_array = jax.experimental.mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # non-TPU / odd shapes: plain reshape in device order
    dev_array = np.asarray(devices).reshape(shape)
  return Mesh(dev_array, tuple(axis_names))


def rules_dict(rules: Sequence[tuple[str, MeshAxes]]) -> dict[str, MeshAxes]:
  return {name: (tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules}


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


_warned: set = set()


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, MeshAxes]) -> P:
  """PartitionSpec for one array from its logical axis names."""
  used: set[str] = set()
  out = []
  for name, dim in zip(names, shape):
    axes = rules.get(name) if name is not None else None
    if name is not None and name not in rules:
      raise ValueError(f"config.mesh.rules: no rule for logical axis {name!r}")
    flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    flat = tuple(a for a in flat if mesh.shape.get(a, 1) > 1 and a not in used)
    if flat and dim % _axis_size(mesh, flat):
      key = (name, dim, flat)
      if key not in _warned:
        _warned.add(key)
        logging.info("axis %r of size %d is not divisible by mesh axes %s: replicated", name,
                     dim, flat)
      flat = ()
    used.update(flat)
    out.append(None if not flat else (flat[0] if len(flat) == 1 else flat))
  return P(*out)


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
  """The logical axis names of a variable (flax stores `sharding_names` as `out_sharding`)."""
  meta = var.get_metadata()
  return tuple(meta.get("out_sharding") or meta.get("sharding_names") or ())


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Mapping[str, MeshAxes]) -> Any:
  """NamedShardings (pure-dict tree) for an abstract nnx.State of variables with metadata."""
  def one(var):
    names = logical_axes(var)
    shape = var.shape
    if not names:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))

  specs = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(specs) if isinstance(specs, nnx.State) else specs


def batch_sharding(mesh: Mesh, rules: Mapping[str, MeshAxes], ndim: int = 2,
                   batch_dim: int = 0) -> NamedSharding:
  axes = rules.get("batch", None)
  spec = [None] * ndim
  spec[batch_dim] = axes
  return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
