"""A run's setup for a device mesh, built once from its config: the typed model config, the
mesh and its logical-axis rules, the abstract model and state with their shardings, the
optimizer, and the jitted init, train step and held-out eval step (traced under the mesh's
rules and platform, `sharding.traced_for`, so they compile the mesh's kernels wherever they are
lowered); plus the batches fed to them and the ahead-of-time compile of the step."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from attn_jax import sharding as shd
from attn_jax.config import RunConfig, as_run, config_rules
from attn_jax.data import pipeline
from attn_jax.data.documents import batch_keys
from attn_jax.model import build_model, count_params
from attn_jax.model_config import ModelConfig
from attn_jax.train import (init_from, memory)
from attn_jax.train.checkpoint import (abstract_with_shardings)
from attn_jax.train.optim import make_optimizer
from attn_jax.train.step import make_eval_step, make_train_step

BASE_KEYS = ("inputs", "targets", "weights")


@dataclasses.dataclass
class Setup:
  """Everything built before the loop; also what tests and benchmarks reuse."""
  cfg: ModelConfig      # run.model
  mesh: Any
  rules: dict
  graphdef: Any
  tx: optax.GradientTransformation
  lr_schedule: Any
  state_shardings: Any
  abstract_state: Any
  init_fn: Any          # jitted () -> state, sharded
  step_fn: Any          # jitted (state, batch[A, B, L]) -> (state, metrics)
  batch_sharding: Any   # for [A, B, L] arrays
  n_params: dict
  batch_keys: tuple[str, ...] = BASE_KEYS   # the batch dict's keys (data.document_mask adds two)
  run: RunConfig = RunConfig()   # the typed run config everything below the setup reads


def build_setup(config: ml_collections.ConfigDict | RunConfig, *, devices=None) -> Setup:
  """The setup of `config` (a ConfigDict is validated here, once; a RunConfig is used as is)."""
  config = as_run(config)
  cfg = config.model
  mesh = shd.make_mesh(config.mesh.shape, config.mesh.axis_names, devices)
  rules = config_rules(config)
  abs_model = nnx.eval_shape(lambda: build_model(cfg, seed=config.seed))
  graphdef, abs_params, abs_rest = nnx.split(abs_model, nnx.Param, ...)
  # per-parameter treatment from metadata; config.train.trainable may freeze some (init_from.py)
  tx, sched = make_optimizer(config, abs_params, *init_from.optimizer_groups(config, abs_params))

  replicate = config.mesh.replicate_indivisible
  param_sh = shd.state_shardings(abs_params, mesh, rules, replicate_indivisible=replicate)
  rest_sh = shd.state_shardings(abs_rest, mesh, rules, replicate_indivisible=replicate)
  repl = shd.replicated(mesh)

  def init():
    model = build_model(cfg, seed=config.seed)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    return {"params": params, "rest": rest, "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(
                jax.random.key(config.seed + 1))}

  abstract = jax.eval_shape(init)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], param_sh,
                                 transform_non_params=lambda _: repl)
  state_sh = {"params": param_sh, "rest": rest_sh, "opt_state": opt_sh, "step": repl,
              "rng": repl}
  batch_sh = shd.batch_sharding(mesh, rules, ndim=3, batch_dim=1)   # [A, B, L]
  # Programs for this mesh: traced under its rules and platform wherever they are lowered.
  step = shd.traced_for(mesh, rules, make_train_step(graphdef, tx, sched))
  step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl),
                    donate_argnums=(0,))
  init_fn = jax.jit(init, out_shardings=state_sh)
  return Setup(cfg, mesh, rules, graphdef, tx, sched, state_sh,
               abstract_with_shardings(abstract, state_sh), init_fn, step_fn, batch_sh,
               count_params(cfg, abs_model), batch_keys(config.data), config)


def next_batch(it, accum: int, batch_sh, global_shape, keys=BASE_KEYS) -> dict:
  """Pull `accum` host micro-batches (this host's rows), stack to [A, B_host, L], build global
  [A, B, L] arrays of `keys` (`Setup.batch_keys`)."""
  mbs = [next(it) for _ in range(accum)]
  local = {k: np.stack([mb[k] for mb in mbs]) for k in keys}
  return {k: jax.make_array_from_process_local_data(batch_sh, v, global_shape)
          for k, v in local.items()}


EvalCallback = Callable[[dict, int], dict]
"""`callback(state, step) -> {metric: value}`, run at every evaluation (see `train_and_evaluate`);
`state` is the train state dict (params, rest, opt_state, step, rng). Benchmark tasks come in this
way (`attn_jax.eval.run.task_callback`), so the trainer never imports the evaluator."""


def eval_batch_sharding(setup: Setup) -> NamedSharding:
  """The sharding of a held-out [B, L] batch: rows over the `batch` rule's mesh axes."""
  return shd.batch_sharding(setup.mesh, setup.rules)


def make_heldout_batches(config: RunConfig, setup: Setup,
                         num_batches: int = 4) -> list[dict]:
  """Held-out batches as global [B, L] arrays with `eval_batch_sharding`; each host reads only
  the rows its devices hold (right on several hosts, not only on one)."""
  sh = eval_batch_sharding(setup)
  shape = (config.data.global_batch_size, config.data.seq_len)
  rows = shd.host_batch_rows(sh, shape, batch_dim=0)
  local = pipeline.make_eval_batches(config.data, seed=config.seed, num_batches=num_batches,
                                     host_rows=rows)
  return [{k: jax.make_array_from_process_local_data(sh, np.asarray(v), shape)
           for k, v in b.items()} for b in local]


class Evaluator:
  """Periodic evaluation during training: held-out loss/accuracy, then the callbacks. Built
  once, so every evaluation after the first reuses its compilations (the state is an argument
  of the jitted functions)."""

  def __init__(self, setup: Setup, heldout, callbacks: Sequence[EvalCallback]):
    self._heldout = heldout   # global arrays (make_heldout_batches)
    self._mesh, self._rules = setup.mesh, setup.rules
    self._step = jax.jit(shd.traced_for(setup.mesh, setup.rules, make_eval_step(setup.graphdef)))
    self._callbacks = tuple(callbacks)

  def heldout(self, state) -> dict[str, float]:
    """Loss/accuracy on held-out batches (weighted tokens only), summed exactly over batches."""
    nll = w = hits = 0.0
    for b in self._heldout:
      n, ww, h = self._step(state["params"], state["rest"], b)
      nll, w, hits = nll + float(n), w + float(ww), hits + float(h)
    w = max(w, 1.0)
    return {"eval/loss": nll / w, "eval/accuracy": hits / w, "eval/weighted_tokens": w}

  def __call__(self, state, step: int) -> dict[str, float]:
    with shd.use_rules(self._mesh, self._rules):  # traced like the train step
      out = self.heldout(state)
      for cb in self._callbacks:
        out.update(cb(state, step))
    return out


def compile_step(setup: Setup, batch: dict, compiler_options: dict | None = None):
  """The train step compiled for `batch` (arrays or ShapeDtypeStructs) as the trainer compiles
  it: traced inside the mesh's logical-axis rules, so the model's activation constraints
  apply. Benchmarks and memory reports use this, not a bare `step_fn.lower`.
  `compiler_options`: XLA options for this compile only (train/aot.py's fallback)."""
  with shd.use_rules(setup.mesh, setup.rules):
    return setup.step_fn.lower(setup.abstract_state, batch).compile(compiler_options)


def abstract_batch(setup: Setup, accum: int, micro_batch: int, seq_len: int) -> dict:
  """The train step's [accum, micro_batch, seq_len] batch as sharded ShapeDtypeStructs."""
  return {k: jax.ShapeDtypeStruct((accum, micro_batch, seq_len),
                                  jnp.float32 if k == "weights" else jnp.int32,
                                  sharding=setup.batch_sharding)
          for k in setup.batch_keys}


def step_memory(setup: Setup, micro_batch: int, accum: int, seq_len: int,
                compiler_options: dict | None = None):
  """Compiled memory analysis of the train step for `accum` micro-batches of `micro_batch`
  rows (abstract shapes: nothing runs, nothing is allocated); a `memory.Refused` one when the
  compiler refuses the step for memory (TPU)."""
  batch = abstract_batch(setup, accum, micro_batch, seq_len)
  return memory.analysis_or_refusal(lambda: compile_step(setup, batch, compiler_options))


def log_setup(setup: Setup) -> None:
  n = setup.n_params
  logging.info("devices: %s; mesh %s", jax.devices(), dict(setup.mesh.shape))
  logging.info("parameters: total %s, non-embedding %s, mixer %s, mlp %s", f"{n['total']:,}",
               f"{n['non_embedding']:,}", f"{n['mixer']:,}", f"{n['mlp']:,}")
