"""Device mesh, logical-axis sharding rules, activation constraints and per-host batch rows.

Parameters carry logical axis names (`nnx.Param(..., out_sharding=(...))`); the config maps
each logical name to a mesh axis, a tuple of mesh axes, or None (replicated):

    config.mesh.rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ...)

Data parallel, FSDP and tensor parallel are therefore config edits (mesh.shape).

Choices:
  * The mesh comes from `jax.make_mesh` (topology-aware device order on TPU/GPU; a failure there
    is an error, never a silent fallback to plain device order). Axis types are `Auto`
    (GSPMD propagation), as the step functions are written for.
  * A parameter dimension whose size does not divide its mesh axes is an ERROR naming the
    parameter path, the logical axis and the sizes: silently replicating e.g. the vocabulary
    would multiply its memory by the mesh size. Replication is only taken when the rule says so
    (rule value None) or the parameter matches an opt-in pattern (`replicate_indivisible`,
    fnmatch over the parameter path "embed/embedding" or the logical name). Mesh axes of size
    1 are dropped first, so small test models run on any data-parallel mesh.
  * Activations (`constrain`) are hints: a dimension that does not divide (e.g. batch 1 while
    decoding) is replicated instead of failing. Outside `use_rules(mesh, rules)` (the trainer
    enters it while tracing) `constrain` is the identity, so modules stay usable eagerly.
  * A host's rows of a global batch come from the batch sharding itself (which devices this
    process addresses and which rows they hold), not from `jax.process_index()`: with a
    topology-ordered mesh the two need not agree.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from attn_jax import distributed, kernel_choice

MeshAxes = str | tuple[str, ...] | None


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices=None) -> Mesh:
  """Mesh over all devices (or `devices`); one -1 entry in `shape` takes the rest."""
  given = devices
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(s) for s in shape]
  if len(shape) != len(axis_names):
    raise ValueError(f"config.mesh.shape {tuple(shape)} does not match config.mesh.axis_names "
                     f"{tuple(axis_names)}")
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
                     f"have {len(devices)}"
                     + (distributed.devices_hint(math.prod(shape)) if given is None else ""))
  return jax.make_mesh(tuple(shape), tuple(axis_names),
                       axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def pad_vocab(vocab_size: int, multiple: int = 128) -> int:
  """`vocab_size` rounded up to a multiple of `multiple` (shardable, MXU/tensor-core friendly)."""
  vocab_size, multiple = int(vocab_size), int(multiple)
  if vocab_size < 1 or multiple < 1:
    raise ValueError(f"pad_vocab needs positive sizes, got vocab_size={vocab_size}, "
                     f"multiple={multiple}")
  return -(-vocab_size // multiple) * multiple


# The trunk's logical axes (embedding, MLP, attention heads, stacked layers, norms) -> mesh
# axes. A mixer introducing an axis of its own declares its rule (`Mixer.axis_rules`).
TRUNK_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("state", None),
    ("layers", None),
    ("norm", None),
)


def rules_dict(rules: Sequence[tuple[str, MeshAxes]]) -> dict[str, MeshAxes]:
  return {name: (tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules}


def _flat(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in _flat(axes))


def _entry(flat: tuple[str, ...]):
  return None if not flat else (flat[0] if len(flat) == 1 else flat)


def _matches(patterns: Iterable[str], *names: str) -> bool:
  return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names if n)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, MeshAxes], *, path: str = "<array>",
                    replicate_indivisible: Sequence[str] = ()) -> P:
  """PartitionSpec for one parameter from its logical axis names.

  Raises ValueError naming `path` when a dimension does not divide its mesh axes, unless
  `path` or the logical name matches a pattern in `replicate_indivisible`.
  """
  if len(names) != len(shape):
    raise ValueError(f"{path}: {len(names)} logical axes {tuple(names)} for shape "
                     f"{tuple(shape)}")
  used: set[str] = set()
  out = []
  for name, dim in zip(names, shape):
    if name is not None and name not in rules:
      raise ValueError(f"config.mesh.rules: no rule for logical axis {name!r} (of {path})")
    flat = _flat(rules.get(name)) if name is not None else ()
    unknown = [a for a in flat if a not in mesh.shape]
    if unknown:
      raise ValueError(f"config.mesh.rules: logical axis {name!r} maps to mesh axes {unknown} "
                       f"not in the mesh {dict(mesh.shape)}")
    flat = tuple(a for a in flat if mesh.shape[a] > 1 and a not in used)
    if flat and dim % _axis_size(mesh, flat):
      if not _matches(replicate_indivisible, path, name):
        raise ValueError(
            f"{path}: dimension {name!r} of size {dim} is not divisible by mesh axes {flat} "
            f"(size {_axis_size(mesh, flat)}) of the mesh {dict(mesh.shape)}; pad it (e.g. "
            "sharding.pad_vocab), change config.mesh.shape/rules, or list it in "
            "config.mesh.replicate_indivisible")
      flat = ()
    used.update(flat)
    out.append(_entry(flat))
  return P(*out)


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
  """The logical axis names of a variable (flax stores `sharding_names` as `out_sharding`)."""
  meta = var.get_metadata()
  return tuple(meta.get("out_sharding") or meta.get("sharding_names") or ())


def path_str(path) -> str:
  """'blocks/mlp/gate/kernel' from a jax key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Mapping[str, MeshAxes], *,
                    replicate_indivisible: Sequence[str] = ()) -> Any:
  """NamedShardings (pure-dict tree) for an abstract nnx.State of variables with metadata."""
  def one(path, var):
    names = logical_axes(var)
    if not names:
      return NamedSharding(mesh, P())
    spec = logical_to_spec(names, var.shape, mesh, rules, path=path_str(path),
                           replicate_indivisible=replicate_indivisible)
    return NamedSharding(mesh, spec)

  specs = jax.tree_util.tree_map_with_path(
      one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(specs) if isinstance(specs, nnx.State) else specs


def batch_axes(rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
  """The mesh axes a batch is split over: the `batch` rule's value as a tuple (() = replicated)."""
  return _flat(rules.get("batch", None))


def batch_shards(mesh: Mesh, rules: Mapping[str, MeshAxes]) -> int:
  """Into how many shards the `batch` rule splits a batch's rows on `mesh`."""
  return _axis_size(mesh, batch_axes(rules))


def batch_sharding(mesh: Mesh, rules: Mapping[str, MeshAxes], ndim: int = 2,
                   batch_dim: int = 0) -> NamedSharding:
  """Rows (dimension `batch_dim` of `ndim`) over the `batch` rule's mesh axes, the rest
  replicated: the sharding of every training and evaluation batch."""
  spec = [None] * ndim
  spec[batch_dim] = rules.get("batch", None)
  return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# ------------------------------------------------------------------ activation constraints

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Mapping[str, MeshAxes]] | None] = (
    contextvars.ContextVar("attn_jax_sharding_rules", default=None))


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Mapping[str, MeshAxes] | Sequence[tuple[str, MeshAxes]]):
  """Within this block (while tracing), `constrain` applies `rules` on `mesh`.

  Also enters `kernel_choice.use_platform(mesh)` (kernel choices follow the mesh's devices, not
  the tracing process's backend) and `jax.set_mesh(mesh)`: the mesh is part of jit's
  trace-cache key, so a function traced here is not reused outside (and vice versa). Two
  different `rules` on one mesh share that key: trace each jitted function under one set of
  rules. A program built for a mesh carries this in its own trace instead (`traced_for`).
  """
  with jax.set_mesh(mesh), _rules_and_platform(mesh, rules):
    yield


def traced_for(mesh: Mesh, rules: Mapping[str, MeshAxes] | Sequence[tuple[str, MeshAxes]],
               fn: Callable) -> Callable:
  """`fn`, whose every trace runs under `rules` on `mesh` (`constrain`, `active`) and for the
  mesh's platform (`kernel_choice.use_platform`). Jitted, it is a program for that mesh: it
  picks the mesh's kernels however and wherever it is lowered (`setup.step_fn.lower(...)` in a
  notebook, outside any `use_rules`). `jax.set_mesh` is not entered (a trace cannot); nothing
  of ours reads the ambient mesh (`constrain` and the kernels' `shard_map` name theirs), but
  the trace runs under the mesh's abstract mesh (`use_abstract_mesh`, as `use_rules` has it):
  a Pallas GPU kernel's lowering (JAX >= 0.11) reads the GPU it compiles for from there, and
  off a GPU (compile-only devices, `targets.py`) finds none anywhere else."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with _rules_and_platform(mesh, rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced


@contextlib.contextmanager
def _rules_and_platform(mesh: Mesh, rules):
  if not isinstance(rules, Mapping):
    rules = rules_dict(rules)
  token = _ACTIVE.set((mesh, dict(rules)))
  try:
    with kernel_choice.use_platform(mesh):
      yield
  finally:
    _ACTIVE.reset(token)


def active() -> tuple[Mesh, Mapping[str, MeshAxes]] | None:
  """(mesh, rules) of the innermost `use_rules` block, or None outside one: what a caller that
  places its own computation (a `shard_map` around a kernel XLA cannot partition,
  kernels/splash.py) reads, so its specs follow the same rules as `constrain`."""
  return _ACTIVE.get()


def activation_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, MeshAxes]) -> P:
  """Like `logical_to_spec` but lenient: unknown names and non-dividing dims are replicated."""
  used: set[str] = set()
  out = []
  for name, dim in zip(names, shape):
    flat = _flat(rules.get(name)) if name is not None else ()
    flat = tuple(a for a in flat if mesh.shape.get(a, 1) > 1 and a not in used)
    if flat and dim % _axis_size(mesh, flat):
      flat = ()
    used.update(flat)
    out.append(_entry(flat))
  return P(*out)


def constrain(x: jax.Array, logical: Sequence[str | None], *, mesh: Mesh | None = None,
              rules: Mapping[str, MeshAxes] | None = None) -> jax.Array:
  """`with_sharding_constraint(x, rules(logical))`; the identity outside `use_rules(...)`
  (unless `mesh` and `rules` are passed explicitly)."""
  if mesh is None or rules is None:
    active = _ACTIVE.get()
    if active is None:
      return x
    mesh, rules = active
  if len(logical) != x.ndim:
    raise ValueError(f"constrain: {len(logical)} logical axes {tuple(logical)} for an array of "
                     f"shape {x.shape}")
  spec = activation_spec(logical, x.shape, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ------------------------------------------------------------------ per-host batch rows


def rows_for_devices(sharding: NamedSharding, global_shape: Sequence[int], devices,
                     batch_dim: int = 0) -> slice:
  """The contiguous rows (along `batch_dim`) of a global array held by `devices`."""
  index_map = sharding.devices_indices_map(tuple(global_shape))
  n = int(global_shape[batch_dim])
  covered = np.zeros(n, bool)
  for d in devices:
    covered[range(n)[index_map[d][batch_dim]]] = True
  rows = np.flatnonzero(covered)
  if rows.size == 0:
    raise ValueError(f"no rows of the global batch {tuple(global_shape)} on devices {devices}")
  start, stop = int(rows[0]), int(rows[-1]) + 1
  if rows.size != stop - start:
    raise ValueError(
        f"this host's devices hold non-contiguous rows {rows.tolist()} of the global batch "
        f"{tuple(global_shape)}; order the mesh so that each host's devices are contiguous "
        "along the batch axes")
  return slice(start, stop)


def host_batch_rows(sharding: NamedSharding, global_shape: Sequence[int],
                    batch_dim: int = 0) -> slice:
  """This process's rows of a global batch with `sharding`: what its data loader must read
  (`jax.make_array_from_process_local_data(sharding, local_rows, global_shape)`)."""
  me = jax.process_index()
  local = [d for d in sharding.device_set if d.process_index == me]
  return rows_for_devices(sharding, global_shape, local, batch_dim)
