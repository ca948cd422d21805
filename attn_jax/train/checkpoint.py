"""Orbax checkpoints holding everything a run needs to continue bit-identically:

    <workdir>/checkpoints/<step>/state   params, non-trainable state, optimizer state, step, rng
    <workdir>/checkpoints/<step>/data    the grain iterator position (one JSON file per host)
    <workdir>/checkpoints/<step>/meta    the config that produced it (JSON), for evaluation

Restoring takes abstract arrays *with shardings*, so each host reads only its shards.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, workdir: str, *, max_to_keep: int = 3, save_interval_steps: int = 1):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._mngr = ocp.CheckpointManager(
        self.directory,
        item_names=("state", "data", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             save_interval_steps=save_interval_steps),
    )

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def save(self, step: int, state: Any, data_iter: Any = None, meta: dict | None = None, *,
           force: bool = False) -> bool:
    items = {"state": ocp.args.StandardSave(state),
             "meta": ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      import grain  # only with a data iterator: benchmarks import the trainer without it
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    saved = self._mngr.save(step, args=ocp.args.Composite(**items), force=force)
    return saved

  def restore(self, abstract_state: Any, data_iter: Any = None, step: int | None = None):
    """Returns the restored state (and restores `data_iter` in place), or None if no ckpt."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self._mngr.restore(step, args=ocp.args.Composite(**items))
    return out["state"]

  def restore_subtree(self, target: Any, step: int) -> Any:
    """Restore only the leaves of `target` (a sub-tree of the saved state, abstract arrays with
    shardings), e.g. the parameters without the optimizer state."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                     restore_args=ocp.checkpoint_utils.construct_restore_args(
                                         target))))
    return out["state"]

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def config_to_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def load_for_inference(workdir: str, step: int | None = None, *, devices=None):
  """(model, config, step) from a training run directory, for a notebook or the evaluator.

  The config is read from the checkpoint's `meta`; only the parameters (and non-trainable
  state) are restored — never the optimizer moments (2x the parameters) — sharded over a mesh
  of `devices` (default: all devices) by the config's logical-axis rules, each host reading
  only its shards.
  """
  import ml_collections
  from flax import nnx

  from attn_jax import sharding as shd
  from attn_jax.model import abstract_model

  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if not os.path.isdir(directory):  # checked first: the manager would create the folder
    raise FileNotFoundError(f"no checkpoint found under {directory} (is {workdir!r} a "
                            "training run directory?)")
  ckpt = Checkpointer(workdir)
  steps = sorted(ckpt.all_steps())
  if not steps:
    raise FileNotFoundError(f"no checkpoint found under {ckpt.directory}")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint for step {step} under {ckpt.directory} (have "
                            f"{steps})")
  config = ml_collections.ConfigDict(_tuples(ckpt.restore_meta(step)["config"]))
  mesh = shd.make_mesh(config.mesh.shape, config.mesh.axis_names, devices)
  rules = shd.rules_dict(config.mesh.rules)
  graphdef, abs_params, abs_rest = nnx.split(abstract_model(config.model), nnx.Param, ...)
  target = {}
  for name, abs_part in (("params", abs_params), ("rest", abs_rest)):
    shardings = shd.state_shardings(abs_part, mesh, rules)
    target[name] = abstract_with_shardings(nnx.to_pure_dict(abs_part), shardings)
  restored = ckpt.restore_subtree(target, step)
  ckpt.close()
  params, rest = nnx.State(abs_params), nnx.State(abs_rest)
  nnx.replace_by_pure_dict(params, restored["params"])
  nnx.replace_by_pure_dict(rest, restored["rest"])
  return nnx.merge(graphdef, params, rest), config, step


def _tuples(x):
  """JSON turns tuples into lists; configs hold tuples (config_flags can't override lists)."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x
