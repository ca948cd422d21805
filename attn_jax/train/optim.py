"""AdamW with warmup + cosine, global-norm clipping, weight-decay exclusions and per-parameter
learning-rate multipliers (a mixer declares them in `optimizer_overrides`).

Weight decay applies to matrices only: a parameter is decayed iff it has >= 2 axes besides the
stacked `layers` axis (so norm scales and per-head scalars are not), and not if its mixer
overrides it (e.g. SISA's lambda_raw: no decay, lr x0.1).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from attn_jax.sharding import logical_axes


def lr_schedule(o: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  warmup = min(int(o.warmup_steps), max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def _param_groups(abstract_params: Any, overrides: Mapping[str, Mapping[str, Any]]):
  """(decay mask, lr multiplier) trees (pure dicts) from the abstract nnx Param state."""
  def decay(path, var):
    name = str(path[-1].key)
    if name in overrides and "weight_decay" in overrides[name]:
      return bool(overrides[name]["weight_decay"])
    names = logical_axes(var)
    return sum(1 for n in names if n != "layers") >= 2

  def mult(path, var):
    return float(overrides.get(str(path[-1].key), {}).get("lr_mult", 1.0))

  is_var = lambda x: isinstance(x, nnx.Variable)
  pure = lambda tree: nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
  return (pure(jax.tree_util.tree_map_with_path(decay, abstract_params, is_leaf=is_var)),
          pure(jax.tree_util.tree_map_with_path(mult, abstract_params, is_leaf=is_var)))


def scale_by_tree(multipliers: Any) -> optax.GradientTransformation:
  return optax.stateless(lambda updates, params=None: jax.tree.map(
      lambda u, m: u if m == 1.0 else u * jnp.asarray(m, u.dtype), updates, multipliers))


def make_optimizer(config: ml_collections.ConfigDict, abstract_params: Any,
                   overrides: Mapping[str, Mapping[str, Any]] | None = None):
  """Returns (optax transform, lr schedule). `abstract_params` is an nnx.State of Params."""
  o = config.optim
  decay_mask, lr_mult = _param_groups(abstract_params, overrides or {})
  sched = lr_schedule(o, config.train.steps)
  chain = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  chain += [
      optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
      optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
      scale_by_tree(lr_mult),
      optax.scale_by_learning_rate(sched),
  ]
  return optax.chain(*chain), sched
