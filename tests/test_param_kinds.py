"""Weight decay by parameter kind, through the trainer's optimizer, for every registered mixer.

Each mixer (iterated from the registry, so a new one is covered without editing this file) is
built in a small model by `setup.build_setup`; every parameter is set to 1 and the optimizer
applies one update with zero gradients. Adam's part of that update is 0 (first and second
moments 0), so a parameter moves iff `add_decayed_weights` decays it. The decayed set is then
checked against names the reference recipes exempt (biases, norm scales, A_log, D, dt_bias,
SISA's lambda, sink logits and tokens), independently of the kinds the modules declared, and
every projection kernel must be decayed.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attn_jax import registry
from attn_jax.layers import param
from attn_jax.mixer import REGISTERED
from attn_jax.train.optim import param_groups
from attn_jax.train.setup import build_setup
from configs import quickstart

NOT_DECAYED = {"bias", "dt_bias", "A_log", "D", "scale", "lambda_raw", "norm_scale", "b_bias",
               "c_bias", "b_norm", "c_norm", "attn_norm", "decay_bias", "sink_logit",
               "sink_embed", "head_scalars"}


def _mixers():
  registry.get_mixer("attention")   # imports every mixer module (registration)
  return sorted(REGISTERED)


def _config(mixer):
  c = quickstart.get_config()
  c.model.update(d_model=32, n_heads=2, d_ff=64, n_layers=1, pattern=(), mixer=mixer,
                 sink_tokens=1, dtype="float32")
  c.data.update(seq_len=32, global_batch_size=8, mqar_num_pairs=4, mqar_num_queries=4)
  c.optim.update(warmup_steps=0, weight_decay=0.5, lr=1.0, clip_norm=1.0)
  for name in ("mamba2", "mamba3", "hybrid_heads"):
    c.model[name].update(head_dim=16, d_state=8)
  return c


def _leaves(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, prefix + (str(k),))
  else:
    yield prefix, tree


@pytest.mark.parametrize("mixer", _mixers())
def test_decay_follows_kind_for_every_mixer(mixer):
  setup = build_setup(_config(mixer), devices=jax.devices()[:1])
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), setup.abstract_state["params"])
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = setup.tx.update(zeros, setup.tx.init(params), params)
  moved = {path: bool(jnp.any(u != 0)) for path, u in _leaves(jax.device_get(updates))}
  names = {path[-1] for path in moved}
  assert "kernel" in names and "scale" in names, sorted(names)   # the check has something
  for path, decayed in moved.items():
    where = "/".join(path)
    if path[-1] in NOT_DECAYED or path[-1].endswith(("_bias", "_norm", "_log")):
      assert not decayed, f"{mixer}: {where} is weight-decayed"
    if path[-1] == "kernel":
      assert decayed, f"{mixer}: {where} (a projection/conv kernel) is not weight-decayed"
  assert moved[("embed",)] is True


def test_parameter_without_kind_is_an_error():
  class Bare(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((2, 2)))

  _, params = nnx.split(Bare(), nnx.Param)
  with pytest.raises(ValueError, match="parameter w: kind None"):
    param_groups(params)
  with pytest.raises(ValueError, match="parameter kind 'matrix'"):
    param(nnx.Rngs(0), nnx.initializers.ones, (2,), ("embed",), kind="matrix")
