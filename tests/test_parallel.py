"""Data, fully-sharded and tensor parallelism on the simulated 8-device CPU mesh (conftest.py).

For every registered mixer and each mesh (DP, FSDP, TP, FSDP x TP, given only through
config.mesh.shape with the base config's rules): two train steps give the losses and parameters
of the single-device run, every parameter (and its Adam moments) carries the sharding its rule
says, with that shard shape, and under FSDP each device holds 1/8 of the parameters and
optimizer state plus a small replicated remainder (norm scales, step counters).

The default run covers every mesh for attention (and the FSDP memory bound); the other
mixers' (mixer, mesh) pairs are marked slow (`pytest -m slow tests/test_parallel.py`).
"""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from attn_jax import sharding as shd
from attn_jax.config import config_rules, validate
from attn_jax.model import abstract_model
from attn_jax.registry import available_mixers
from attn_jax.train import setup as setup_lib
from tests.test_train import PARAM_ATOL, _batch, tiny_config
from tests.test_trunk import set_tiny

AXES = ("data", "fsdp", "tensor")
MESHES = {"dp": (8, 1, 1), "fsdp": (1, 8, 1), "tp": (1, 1, 8), "fsdp_tp": (1, 4, 2)}
MIXERS = [m for m in available_mixers() if not m.startswith("_")]
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4   # with PARAM_ATOL: the tolerance of test_train.test_sharded_equals_unsharded
REPLICATED_SLACK = 8 * 1024   # bytes: norm scales, per-head scalars, Adam counts, step, rng


def config(mixer, mesh_shape=(-1, 1, 1)):
  """A 1-layer model with 8 heads of 4 (so heads, kv_heads, d_ff, the padded vocabulary and
  the SSM heads divide a tensor axis of 8), tiny mixer options."""
  c = tiny_config()
  c.model.update(mixer=mixer, n_heads=8, n_layers=1)
  set_tiny(c.model, [mixer])
  if mixer == "hybrid_heads":
    c.model[mixer].ssm_heads = 8   # its default expand=1 gives 32 / head_dim 8 = 4 SSM heads
  c.mesh.shape = mesh_shape
  c.mesh.axis_names = AXES
  return c


@functools.lru_cache(maxsize=None)
def two_steps(mixer, mesh_name):
  """(losses of steps 1 and 2, state after them, setup) on the mesh (None: one device)."""
  shape = MESHES.get(mesh_name, (1, 1, 1))
  c = config(mixer, shape)
  devices = jax.devices()[:1] if mesh_name is None else jax.devices()
  setup = setup_lib.build_setup(c, devices=devices)
  batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in _batch(c).items()}
  state = setup.init_fn()
  state, m1 = setup.step_fn(state, batch)
  state, m2 = setup.step_fn(state, batch)
  return (float(m1["loss"]), float(m2["loss"])), state, setup


def expected_axes(names, shape, mesh_shape, rules):
  """Reference: per dimension, the mesh axes (of size > 1) its logical name's rule gives."""
  sizes = dict(zip(AXES, mesh_shape))
  out = []
  for name, dim in zip(names, shape):
    axes = rules.get(name) if name is not None else None
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    axes = tuple(a for a in axes if sizes[a] > 1)
    assert dim % math.prod(sizes[a] for a in axes) == 0, (names, shape)
    out.append(axes)
  return out


def spec_axes(spec, ndim):
  entries = list(spec) + [None] * (ndim - len(spec))
  return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]


def logical_names(mixer):
  _, params, _ = nnx.split(abstract_model(config(mixer).model), nnx.Param, ...)
  return nnx.to_pure_dict(jax.tree.map(shd.logical_axes, params,
                                       is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _cases():
  out = []
  for mixer in MIXERS:
    for mesh in MESHES:
      fast = mixer == "attention"   # the rest are slow to compile (the SSMs' most)
      out.append(pytest.param(mixer, mesh, id=f"{mixer}-{mesh}",
                              marks=() if fast else pytest.mark.slow))
  return out


@pytest.mark.parametrize("mixer,mesh", _cases())
def test_parallel_run_equals_single_device_and_follows_the_rules(mixer, mesh):
  assert jax.device_count() == 8
  (l1, l2), ref, _ = two_steps(mixer, None)
  (m1, m2), state, setup = two_steps(mixer, mesh)
  np.testing.assert_allclose([m1, m2], [l1, l2], rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL),
               jax.device_get(state["params"]), jax.device_get(ref["params"]))

  names = logical_names(mixer)
  rules = config_rules(validate(config(mixer)))
  mu = state["opt_state"][1].mu   # clip, adam, ...: Adam's moments mirror the parameters

  def check(path, arr, names_, moment):
    where = f"{jax.tree_util.keystr(path)} {names_}"
    want = expected_axes(names_, arr.shape, MESHES[mesh], rules)
    assert spec_axes(arr.sharding.spec, arr.ndim) == want, where
    shard = tuple(d // math.prod(setup.mesh.shape[a] for a in axes)
                  for d, axes in zip(arr.shape, want))
    assert arr.addressable_shards[0].data.shape == shard, where
    assert moment.sharding.is_equivalent_to(arr.sharding, arr.ndim), where

  jax.tree_util.tree_map_with_path(check, state["params"], names, mu,
                                   is_leaf=lambda x: isinstance(x, tuple))


def _bytes_on(device, tree):
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def test_fsdp_each_device_holds_an_eighth_of_params_and_optimizer_state():
  _, state, setup = two_steps("attention", "fsdp")
  held = {k: state[k] for k in ("params", "opt_state")}
  total = sum(x.nbytes for x in jax.tree.leaves(held))
  for d in jax.devices():
    assert _bytes_on(d, held) <= total / 8 + REPLICATED_SLACK, (d, _bytes_on(d, held), total)
  # the same from the compiled step: its arguments (state + batch) per device
  c = config("attention", MESHES["fsdp"])
  L = c.data.seq_len
  abs_batch = {k: jax.ShapeDtypeStruct((1, c.data.global_batch_size, L), np.int32 if k !=
                                       "weights" else np.float32, sharding=setup.batch_sharding)
               for k in ("inputs", "targets", "weights")}
  mem = setup.step_fn.lower(setup.abstract_state, abs_batch).compile().memory_analysis()
  assert mem is not None   # the CPU backend reports it
  state_total = sum(x.nbytes for x in jax.tree.leaves(state))
  batch_bytes = 3 * c.data.global_batch_size * L * 4
  assert 0 < mem.argument_size_in_bytes <= (state_total + batch_bytes) / 8 + REPLICATED_SLACK


def test_heads_that_do_not_divide_the_tensor_axis_are_a_clear_error():
  c = config("hybrid_heads", MESHES["tp"])
  c.model.hybrid_heads.ssm_heads = 4
  with pytest.raises(ValueError, match=r"mixer/ssm/.*'heads' of size 4 is not divisible by "
                     r"mesh axes \('tensor',\) \(size 8\)"):
    setup_lib.build_setup(c)
