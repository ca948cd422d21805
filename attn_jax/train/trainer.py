"""`train_and_evaluate(config, workdir)`: the whole training run, importable from a notebook.

Order of work (abstract first, nothing materialised unsharded):
  validate config -> mesh -> abstract model/state -> shardings -> jitted init (out_shardings)
  or restore from the latest checkpoint -> data iterator (restored position) -> AOT-compiled
  step (explicit in/out shardings, state donated; memory analysis logged) -> loop.

Loop hygiene: step t+1 is dispatched before the metrics of step t are read; a NaN/Inf loss stops
the run loudly; a checkpoint is written every `checkpoint.every_steps`, at the end, and when the
run is interrupted, so work is never lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from attn_jax import sharding as shd
from attn_jax.config import ModelConfig, validate
from attn_jax.model import build_model, count_params
from attn_jax.train import flops as flops_lib
from attn_jax.train.checkpoint import (Checkpointer, NonFiniteStateError, PreemptionGuard,
                                       abstract_with_shardings, config_to_json)
from attn_jax.train.metrics import MetricWriter, flatten_metrics
from attn_jax.train.workdir import lock_workdir
from attn_jax.train.optim import make_optimizer
from attn_jax.train.step import make_eval_step, make_train_step


@dataclasses.dataclass
class Setup:
  """Everything built before the loop; also what tests and benchmarks reuse."""
  cfg: ModelConfig
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


def build_setup(config: ml_collections.ConfigDict, *, devices=None) -> Setup:
  cfg = validate(config)
  mesh = shd.make_mesh(config.mesh.shape, config.mesh.axis_names, devices)
  rules = shd.rules_dict(config.mesh.rules)
  abs_model = nnx.eval_shape(lambda: build_model(cfg, seed=config.seed))
  graphdef, abs_params, abs_rest = nnx.split(abs_model, nnx.Param, ...)
  tx, sched = make_optimizer(config, abs_params)   # per-parameter treatment from metadata

  replicate = tuple(config.mesh.get("replicate_indivisible", ()))
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
  batch_axes = rules.get("batch")
  batch_sh = NamedSharding(mesh, P(None, batch_axes, None))
  step = make_train_step(graphdef, tx, sched)
  step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl),
                    donate_argnums=(0,))
  init_fn = jax.jit(init, out_shardings=state_sh)
  return Setup(cfg, mesh, rules, graphdef, tx, sched, state_sh,
               abstract_with_shardings(abstract, state_sh), init_fn, step_fn, batch_sh,
               count_params(cfg))


def _check_batch(config, mesh, rules) -> int:
  """Per-host micro-batch size; errors name the config field."""
  n_proc = jax.process_count()
  gbs = config.data.global_batch_size
  axes = rules.get("batch")
  axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
  shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  if gbs % shards:
    raise ValueError(f"config.data.global_batch_size={gbs} is not divisible by the "
                     f"{shards} batch shards of the mesh {dict(mesh.shape)}")
  if gbs % n_proc:
    raise ValueError(f"config.data.global_batch_size={gbs} is not divisible by the "
                     f"{n_proc} processes")
  return gbs // n_proc


def _next_batch(it, accum: int, batch_sh, global_shape) -> dict:
  """Pull `accum` host micro-batches (this host's rows), stack to [A, B_host, L], build global
  [A, B, L] arrays."""
  mbs = [next(it) for _ in range(accum)]
  local = {k: np.stack([mb[k] for mb in mbs]) for k in ("inputs", "targets", "weights")}
  return {k: jax.make_array_from_process_local_data(batch_sh, v, global_shape)
          for k, v in local.items()}


EvalCallback = Callable[[dict, int], dict]
"""`callback(state, step) -> {metric: value}`, run at every evaluation (see `train_and_evaluate`);
`state` is the train state dict (params, rest, opt_state, step, rng). Benchmark tasks come in this
way (`attn_jax.eval.run.task_callback`), so the trainer never imports the evaluator."""


class _Evaluator:
  """Periodic evaluation during training: held-out loss/accuracy, then the callbacks. Built
  once, so every evaluation after the first reuses its compilations (the state is an argument
  of the jitted functions)."""

  def __init__(self, setup: Setup, heldout, callbacks: Sequence[EvalCallback]):
    self._heldout = heldout
    self._mesh, self._rules = setup.mesh, setup.rules
    self._step = jax.jit(make_eval_step(setup.graphdef))
    self._callbacks = tuple(callbacks)

  def heldout(self, state) -> dict[str, float]:
    """Loss/accuracy on held-out batches (weighted tokens only), summed exactly over batches."""
    nll = w = hits = 0.0
    for b in self._heldout:
      n, ww, h = self._step(state["params"], state["rest"],
                            {k: jnp.asarray(v) for k, v in b.items()})
      nll, w, hits = nll + float(n), w + float(ww), hits + float(h)
    w = max(w, 1.0)
    return {"eval/loss": nll / w, "eval/accuracy": hits / w, "eval/weighted_tokens": w}

  def __call__(self, state, step: int) -> dict[str, float]:
    with shd.use_rules(self._mesh, self._rules):  # traced like the train step
      out = self.heldout(state)
      for cb in self._callbacks:
        out.update(cb(state, step))
    return out


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       eval_callbacks: Sequence[EvalCallback] = ()) -> dict[str, Any]:
  """Train (or resume) a model; returns the final metrics.

  Evaluation (held-out loss, then `eval_callbacks`) runs every `config.eval.every_steps` and
  at the end (every_steps 0: only at the end). `experiments/train.py` passes the benchmark
  tasks of `config.eval.tasks` as a callback (`attn_jax.eval.run.task_callback`).

  One run per workdir: a second run on the same workdir stops at once (WorkdirLockedError
  naming the holder's pid). SIGTERM/SIGINT stop at a step boundary with a checkpoint; the
  result then has `preempted` (the signal's name).
  """
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  lock = lock_workdir(workdir)  # process 0 only
  try:
    return _train_and_evaluate(config, workdir, eval_callbacks)
  finally:
    if lock is not None:
      lock.release()


def _train_and_evaluate(config, workdir, eval_callbacks) -> dict[str, Any]:
  from attn_jax.data import pipeline

  setup = build_setup(config)
  cfg = setup.cfg
  need = pipeline.vocab_size_needed(config.data)
  if need > cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={cfg.vocab_size} is smaller than the data's "
                     f"vocabulary ({need}, from config.data.tokenizer/source)")
  _check_batch(config, setup.mesh, setup.rules)
  logging.info("devices: %s; mesh %s", jax.devices(), dict(setup.mesh.shape))
  n = setup.n_params
  logging.info("parameters: total %s, non-embedding %s, mixer %s, mlp %s", f"{n['total']:,}",
               f"{n['non_embedding']:,}", f"{n['mixer']:,}", f"{n['mlp']:,}")

  ckpt = Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep)
  accum, L = config.train.grad_accum, config.data.seq_len
  global_shape = (accum, config.data.global_batch_size, L)
  host_rows = shd.host_batch_rows(setup.batch_sharding, global_shape, batch_dim=1)
  data_it = pipeline.make_train_iterator(config.data, seed=config.seed, host_rows=host_rows)
  state = ckpt.restore(setup.abstract_state, data_it)
  if state is None:
    state = setup.init_fn()
    start = 0
  else:
    start = int(state["step"])
    logging.info("resumed from %s at step %d", ckpt.directory, start)

  abs_batch = {k: jax.ShapeDtypeStruct(global_shape,
                                       jnp.float32 if k == "weights" else jnp.int32,
                                       sharding=setup.batch_sharding)
               for k in ("inputs", "targets", "weights")}
  t0 = time.perf_counter()
  with shd.use_rules(setup.mesh, setup.rules):  # shd.constrain(...) inside the model
    compiled = setup.step_fn.lower(setup.abstract_state, abs_batch).compile()
  logging.info("train step compiled in %.1fs", time.perf_counter() - t0)
  try:
    logging.info("memory analysis: %s", compiled.memory_analysis())
  except Exception:  # not every backend reports it
    pass

  writer = MetricWriter(workdir)
  writer.truncate_after(start)  # rows an interrupted run logged after its last checkpoint
  tokens_per_step = accum * config.data.global_batch_size * L
  flops_per_tok = flops_lib.train_flops_per_token(cfg, n, L)
  peak = flops_lib.peak_flops_per_device(override=config.train.peak_flops)
  n_dev = jax.device_count()
  meta = {"config": config_to_json(config), "n_params": n}
  evaluator = _Evaluator(setup, pipeline.make_eval_batches(
      config.data, seed=config.seed, num_batches=4), eval_callbacks)

  bar = None
  if config.train.progress_bar and jax.process_index() == 0:
    from tqdm import tqdm
    bar = tqdm(total=config.train.steps, initial=start, unit="step", dynamic_ncols=True)

  last_saved = start
  pending = None          # (step, metrics) of the step dispatched before the current one
  t_log, step_log = time.perf_counter(), start
  last: dict[str, Any] = {}
  diverged = False
  last_eval = -1

  def flush(pending_metrics):
    nonlocal t_log, step_log, last, diverged
    step_no, m = pending_metrics
    loss = float(m["loss"])
    if not np.isfinite(loss) and config.train.halt_on_nan:
      diverged = True
      raise FloatingPointError(f"loss is {loss} at step {step_no}; stopping. The last good "
                               f"checkpoint is in {ckpt.directory}")
    if step_no % config.train.log_every == 0 or step_no == config.train.steps:
      now = time.perf_counter()
      dt = max(now - t_log, 1e-9)
      tps = tokens_per_step * (step_no - step_log) / dt
      out = flatten_metrics(m)
      out["tokens_per_sec"] = tps
      out["tokens_seen"] = step_no * tokens_per_step
      if peak:
        out["mfu"] = tps * flops_per_tok / (peak * n_dev)
      writer.write(step_no, out)
      last.update(out)
      t_log, step_log = now, step_no
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{out['accuracy']:.3f}",
                        tok_s=f"{tps:,.0f}")

  guard = PreemptionGuard().__enter__()
  preempted = None
  try:
    for step_no in range(start + 1, config.train.steps + 1):
      batch = _next_batch(data_it, accum, setup.batch_sharding, global_shape)
      state, metrics = compiled(state, batch)
      if pending is not None:
        flush(pending)
      pending = (step_no, metrics)
      if bar is not None:
        bar.update(1)
      if step_no % config.checkpoint.every_steps == 0:
        flush(pending)
        pending = None
        ckpt.save(step_no, state, data_it, meta, force=True)
        last_saved = step_no
      if config.eval.every_steps and step_no % config.eval.every_steps == 0:
        ev = evaluator(state, step_no)
        writer.write(step_no, ev)
        last.update(ev)
        last_eval = step_no
      if guard.poll(step_no):  # SIGTERM/SIGINT: stop at this step boundary (saved below)
        preempted = guard.signal_name or "signal"
        logging.warning("%s: stopping after step %d; rerun the same command to resume",
                        preempted, step_no)
        break
    if pending is not None:
      flush(pending)
      pending = None
  finally:
    if pending is not None and not diverged:
      try:  # log the last dispatched step even when interrupted
        flush(pending)
      except FloatingPointError:
        pass
    guard.__exit__(None, None, None)
    done = int(state["step"])
    if done > last_saved and not diverged:  # interrupted or finished: never lose work
      try:
        ckpt.save(done, state, data_it, meta, force=True)
      except NonFiniteStateError as e:  # halt_on_nan=False runs: never save NaNs
        logging.error("%s", e)
    ckpt.close()
    writer.flush()
    if bar is not None:
      bar.close()

  if preempted is not None:
    writer.close()
    return dict(last, workdir=workdir, checkpoint_dir=ckpt.directory, preempted=preempted,
                step=int(state["step"]))
  if last_eval != int(state["step"]):
    ev = evaluator(state, int(state["step"]))
    writer.write(int(state["step"]), ev)
    last.update(ev)
  writer.close()
  last["workdir"] = workdir
  last["checkpoint_dir"] = ckpt.directory
  return last
