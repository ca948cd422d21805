"""AdamW with warmup + cosine, global-norm clipping, weight-decay exclusions and per-parameter
learning-rate multipliers.

A parameter's treatment is metadata set where it is created (`layers.param(..., kind=,
lr_mult=)`, e.g. SISA's lambda_raw: kind "scalar", lr x0.1); the optimizer reads it and knows no
parameter names. Weight decay is the rule of the parameter's kind (`layers.PARAM_KINDS`: weights
and embeddings decayed; biases, norm scales, per-head scalars and learned inputs not); nothing
is inferred from shapes, and a parameter without a declared kind is an error. lr multiplier
default 1.

`trainable` (a tree of bools, `train/init_from.trainable_mask`; None = all train): a frozen
parameter's gradient is zeroed before clipping (so the clip norm is the trained parameters')
and it gets no weight decay, so its Adam moments stay 0 and its update is exactly 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attn_jax.config import OptimConfig, RunConfig
from attn_jax.layers import PARAM_KINDS


def lr_schedule(o: OptimConfig, total_steps: int) -> optax.Schedule:
  warmup = min(int(o.warmup_steps), max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def param_groups(abstract_params: Any):
  """(decay mask, lr multiplier) trees (pure dicts) from an nnx State of Params' metadata."""
  def decay(path, var):
    kind = var.get_metadata().get("kind")
    if kind not in PARAM_KINDS:
      name = "/".join(str(getattr(k, "key", k)) for k in path)
      raise ValueError(f"parameter {name}: kind {kind!r} is not one of {sorted(PARAM_KINDS)}; "
                       "declare it where the parameter is created (layers.param(..., kind=))")
    return PARAM_KINDS[kind]

  def mult(var):
    return float(var.get_metadata().get("lr_mult", 1.0))

  is_var = lambda x: isinstance(x, nnx.Variable)
  pure = lambda tree: nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
  return (pure(jax.tree_util.tree_map_with_path(decay, abstract_params, is_leaf=is_var)),
          pure(jax.tree.map(mult, abstract_params, is_leaf=is_var)))


def scale_by_tree(multipliers: Any) -> optax.GradientTransformation:
  return optax.stateless(lambda updates, params=None: jax.tree.map(
      lambda u, m: u if m == 1.0 else u * jnp.asarray(m, u.dtype), updates, multipliers))


def make_optimizer(config: RunConfig, abstract_params: Any,
                   trainable: Any = None, lr_scale: Any = None):
  """Returns (optax transform, lr schedule). `abstract_params` is an nnx.State of Params;
  `trainable`, `lr_scale` (a tree multiplying the lr multipliers; None = 1): see the module
  docstring and train/init_from.py."""
  decay_mask, lr_mult = param_groups(abstract_params)
  if lr_scale is not None:
    lr_mult = jax.tree.map(lambda a, b: float(a) * float(b), lr_mult, lr_scale)
  return optimizer_from_groups(config, decay_mask, lr_mult, trainable=trainable)


def optimizer_from_groups(config: RunConfig, decay_mask: Any, lr_mult: Any,
                          trainable: Any = None):
  """`make_optimizer`'s chain from explicit (decay mask, lr multiplier) trees, for parameters
  that are not nnx Params (a plain-JAX model trained with the same optimizer)."""
  o = config.optim
  sched = lr_schedule(o, config.train.steps)
  chain = []
  if trainable is not None:
    chain.append(optax.masked(optax.set_to_zero(), jax.tree.map(lambda t: not t, trainable)))
    decay_mask = jax.tree.map(lambda d, t: bool(d and t), decay_mask, trainable)
  chain += [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  chain += [
      optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
      optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
      scale_by_tree(lr_mult),
      optax.scale_by_learning_rate(sched),
  ]
  return optax.chain(*chain), sched
