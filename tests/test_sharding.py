"""Mesh construction, strict parameter sharding, activation constraints, per-host batch rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import mesh_utils as jax_mesh_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from attn_jax import sharding as shd

RULES = shd.rules_dict((("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"),
                        ("mlp", "tensor"), ("norm", None)))


def test_make_mesh_uses_the_topology_aware_device_order(monkeypatch):
  calls = []
  real = jax_mesh_utils.create_device_mesh

  def reversed_mesh(shape, devices=None, **kw):  # stands in for a TPU/GPU topology order
    calls.append(tuple(shape))
    return real(shape, list(devices)[::-1], **kw)

  monkeypatch.setattr(jax_mesh_utils, "create_device_mesh", reversed_mesh)
  mesh = shd.make_mesh((-1, 2, 1), ("data", "fsdp", "tensor"))
  assert calls == [(4, 2, 1)]
  assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()][::-1]
  assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}


def test_make_mesh_failure_surfaces(monkeypatch):
  def broken(*a, **k):
    raise RuntimeError("topology query failed")

  monkeypatch.setattr(jax_mesh_utils, "create_device_mesh", broken)
  with pytest.raises(RuntimeError, match="topology query failed"):
    shd.make_mesh((8,), ("data",))


def test_make_mesh_shape_errors_name_the_field():
  with pytest.raises(ValueError, match="config.mesh.shape"):
    shd.make_mesh((3, -1), ("a", "b"))
  with pytest.raises(ValueError, match="config.mesh.shape"):
    shd.make_mesh((-1, -1), ("a", "b"))
  with pytest.raises(ValueError, match="needs 4 devices, have 8"):
    shd.make_mesh((2, 2), ("a", "b"))


def test_pad_vocab():
  assert shd.pad_vocab(50277) == 50304
  assert shd.pad_vocab(257) == 384
  assert shd.pad_vocab(128) == 128
  assert shd.pad_vocab(10, multiple=8) == 16
  with pytest.raises(ValueError):
    shd.pad_vocab(0)


class _Tiny(nnx.Module):
  def __init__(self, vocab):
    self.embed = nnx.Param(jnp.zeros((vocab, 16)), out_sharding=("vocab", "embed"),
                           eager_sharding=False)
    self.norm = nnx.Param(jnp.ones((16,)), out_sharding=("norm",), eager_sharding=False)


def _abstract_params(vocab):
  model = nnx.eval_shape(lambda: _Tiny(vocab))
  return nnx.split(model, nnx.Param)[1]


def test_indivisible_parameter_dimension_is_an_error_naming_the_parameter():
  mesh = shd.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"))
  with pytest.raises(ValueError, match=r"embed: dimension 'vocab' of size 257 .* \('tensor',\)"):
    shd.state_shardings(_abstract_params(257), mesh, RULES)
  # Padded, it shards over the tensor axis.
  sh = shd.state_shardings(_abstract_params(shd.pad_vocab(257)), mesh, RULES)
  assert sh["embed"].spec == P("tensor", None)
  assert sh["norm"].spec == P(None)
  # Opt-in replication by parameter path or by logical axis name.
  for pattern in ("embed", "vocab"):
    sh = shd.state_shardings(_abstract_params(257), mesh, RULES, replicate_indivisible=(pattern,))
    assert sh["embed"].spec == P(None, None)


def test_rule_none_and_size_one_axes_replicate_without_error():
  mesh = shd.make_mesh((8, 1, 1), ("data", "fsdp", "tensor"))  # tensor/fsdp have size 1
  sh = shd.state_shardings(_abstract_params(257), mesh, RULES)
  assert sh["embed"].spec == P(None, None)
  rules = dict(RULES, vocab=None)
  mesh = shd.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"))
  assert shd.state_shardings(_abstract_params(257), mesh, rules)["embed"].spec == P(None, None)


def test_unknown_logical_axis_and_unknown_mesh_axis():
  mesh = shd.make_mesh((8,), ("data",))
  with pytest.raises(ValueError, match="no rule for logical axis 'heads' .*w"):
    shd.logical_to_spec(("heads",), (8,), mesh, RULES, path="w")
  with pytest.raises(ValueError, match=r"mesh axes \['fsdp'\]"):
    shd.logical_to_spec(("embed",), (8,), mesh, RULES, path="w")


def test_constrain_is_identity_outside_rules_and_shards_inside():
  x = jnp.arange(8 * 6.0).reshape(8, 6)
  assert shd.constrain(x, ("batch", "embed")) is x
  mesh = shd.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"))

  def f(x):
    return shd.constrain(x * 2, ("batch", "mlp")) + 1

  jf = jax.jit(f)
  with shd.use_rules(mesh, RULES):
    assert "sharding_constraint" in jf.lower(x).as_text()
    y = jf(x)
  assert "sharding_constraint" not in jf.lower(x).as_text()  # no stale trace reused outside
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2 + 1)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None)), 2)
  # Not divisible (batch 1 while decoding): replicated, not an error.
  with shd.use_rules(mesh, RULES):
    y1 = jax.jit(f)(x[:1])
  assert y1.sharding.is_fully_replicated
  with pytest.raises(ValueError, match="logical axes"):
    shd.constrain(x, ("batch",), mesh=mesh, rules=RULES)


def test_host_rows_follow_the_sharding_not_the_process_index():
  devices = jax.devices()
  batch_rules = {"batch": "data"}
  mesh = shd.make_mesh((8,), ("data",), devices=devices[::-1])  # a permuted device order
  sharding = NamedSharding(mesh, P(None, "data", None))
  shape = (2, 16, 4)  # [accum, global batch, L]
  # A "host" owning the last 4 devices holds the FIRST half of the batch in this mesh.
  assert shd.rows_for_devices(sharding, shape, devices[4:], batch_dim=1) == slice(0, 8)
  assert shd.rows_for_devices(sharding, shape, devices[:4], batch_dim=1) == slice(8, 16)
  # One process here: it holds every row.
  assert shd.host_batch_rows(sharding, shape, batch_dim=1) == slice(0, 16)
  # Rows assembled from per-"host" slices give the global array.
  global_x = np.arange(np.prod(shape)).reshape(shape)
  rows = shd.host_batch_rows(sharding, shape, batch_dim=1)
  arr = jax.make_array_from_process_local_data(sharding, global_x[:, rows], shape)
  np.testing.assert_array_equal(np.asarray(arr), global_x)
  # Interleaved ownership cannot be read as one slice: a clear error.
  with pytest.raises(ValueError, match="non-contiguous rows"):
    shd.rows_for_devices(sharding, shape, devices[::2], batch_dim=1)
  # Replicated batch: every host needs all rows.
  repl = shd.batch_sharding(mesh, {"batch": None}, ndim=3, batch_dim=1)
  assert shd.rows_for_devices(repl, shape, devices[:1], batch_dim=1) == slice(0, 16)
  del batch_rules


def test_batch_axes_and_shards_from_the_one_batch_rule():
  """Every batch (train [A, B, L], held-out [B, L]) and every divisibility check reads the batch
  split from `batch_axes` / `batch_shards`: a string, a tuple and None (replicated) rule."""
  mesh = shd.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"))
  for rule, axes, shards in ((("data", "fsdp"), ("data", "fsdp"), 8), ("fsdp", ("fsdp",), 4),
                             (None, (), 1), (("data", "tensor"), ("data", "tensor"), 2)):
    rules = {"batch": rule}
    assert shd.batch_axes(rules) == axes and shd.batch_shards(mesh, rules) == shards
    sh = shd.batch_sharding(mesh, rules, ndim=3, batch_dim=1)
    assert sh.spec == P(None, rule, None)
    # A [A, B, L] batch is cut into exactly `shards` distinct row blocks.
    blocks = {idx[1].indices(16) for idx in sh.devices_indices_map((2, 16, 4)).values()}
    assert len(blocks) == shards
  assert shd.batch_axes({}) == () and shd.batch_shards(mesh, {}) == 1
