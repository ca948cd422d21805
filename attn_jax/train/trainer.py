"""`train_and_evaluate(config, workdir)`: the whole training run, importable from a notebook.

Order of work (abstract first, nothing materialised unsharded):
  validate config -> mesh -> abstract model/state -> shardings -> jitted init (out_shardings)
  or restore from the latest checkpoint -> data iterator (restored position) -> AOT-compiled
  step (explicit in/out shardings, state donated; memory analysis logged) -> loop.

Loop hygiene: step t+1 is dispatched before the metrics of step t are read; a checkpoint is
written every `checkpoint.every_steps`, at the end, and when the run is interrupted, so work is
never lost.

Reliability (the choices):
  * Non-finite steps: the step itself drops an update whose loss, gradients or new parameters
    are not finite (train/step.py), so NaN/Inf never reach the parameters or a checkpoint.
    `config.train.nonfinite="skip"` counts such steps (`nonfinite_steps` in the metrics, a
    warning each) and goes on, halting after `nonfinite_max_consecutive` in a row; "halt" stops
    at the first one with a message naming the last finite step and the latest checkpoint.
  * Loss spikes: a finite loss above mean + `spike_threshold` * std of the last `spike_window`
    finite losses is a spike (`loss_spike` on that step's row, `loss_spikes` counted, a
    warning). The counters and the window are saved in each checkpoint's meta, so a resumed
    run flags the same steps as an uninterrupted one.
  * Data position == model state: the iterator position is read before the step's micro-batches
    are pulled; if the run stops before that step was dispatched (an interrupt in the middle of
    gradient accumulation), the iterator goes back there before the final save, so the resumed
    run reads exactly the micro-batches the saved state has not seen.
  * Donated buffers: the step donates its input state. If the step raises, the state it was
    given may be gone: nothing is saved from it (the latest checkpoint stays the resume point)
    and the original error propagates; an error while saving on the way out is logged, never
    raised in place of the original one.
  * Resuming: a checkpoint whose arrays do not fit this config's model is an error naming the
    changed config fields and the stored vs requested shapes, and nothing is moved (it is the
    user's mistake, not corruption); a resume with other compatible settings (more steps, a new
    lr) goes on with a warning listing them, and saying when the LR schedule changed with them.
  * Failed saves: a background save that failed (a full disk) is noticed at the next step
    boundary (`Checkpointer.check_saves`) and stops the run with `CheckpointSaveError`; no
    second save is attempted on the way out, and the older checkpoints stay the resume point.
  * Held-out evaluation batches are global arrays with the batch sharding, built from this
    host's rows (`make_array_from_process_local_data`), as the training batches.
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
from attn_jax.data.documents import batch_keys
from attn_jax.model import build_model, count_params
from attn_jax.train import flops as flops_lib
from attn_jax.train.checkpoint import (Checkpointer, CheckpointMismatchError,
                                       CheckpointSaveError, PreemptionGuard,
                                       abstract_with_shardings, config_to_json)
from attn_jax.train.metrics import MetricWriter, flatten_metrics
from attn_jax.train.workdir import lock_workdir
from attn_jax.train.optim import make_optimizer
from attn_jax.train.step import make_eval_step, make_train_step


BASE_KEYS = ("inputs", "targets", "weights")


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
  batch_keys: tuple[str, ...] = BASE_KEYS   # the batch dict's keys (data.document_mask adds two)


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
               count_params(cfg), batch_keys(config.data))


def _check_batch(config, mesh, rules) -> None:
  """The global batch splits evenly over the mesh's batch shards; errors name the config field.
  (Each host's rows come from the batch sharding, `sharding.host_batch_rows`: a host whose
  devices hold a replicated batch reads all of it, so no divisibility by the process count is
  required.)"""
  gbs = config.data.global_batch_size
  axes = rules.get("batch")
  axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
  shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  if gbs % shards:
    raise ValueError(f"config.data.global_batch_size={gbs} is not divisible by the "
                     f"{shards} batch shards of the mesh {dict(mesh.shape)}")


def _next_batch(it, accum: int, batch_sh, global_shape, keys=BASE_KEYS) -> dict:
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
  return NamedSharding(setup.mesh, P(setup.rules.get("batch"), None))


def make_heldout_batches(config: ml_collections.ConfigDict, setup: Setup,
                         num_batches: int = 4) -> list[dict]:
  """Held-out batches as global [B, L] arrays with `eval_batch_sharding`; each host reads only
  the rows its devices hold (right on several hosts, not only on one)."""
  from attn_jax.data import pipeline
  sh = eval_batch_sharding(setup)
  shape = (config.data.global_batch_size, config.data.seq_len)
  rows = shd.host_batch_rows(sh, shape, batch_dim=0)
  local = pipeline.make_eval_batches(config.data, seed=config.seed, num_batches=num_batches,
                                     host_rows=rows)
  return [{k: jax.make_array_from_process_local_data(sh, np.asarray(v), shape)
           for k, v in b.items()} for b in local]


class _Evaluator:
  """Periodic evaluation during training: held-out loss/accuracy, then the callbacks. Built
  once, so every evaluation after the first reuses its compilations (the state is an argument
  of the jitted functions)."""

  def __init__(self, setup: Setup, heldout, callbacks: Sequence[EvalCallback]):
    self._heldout = heldout   # global arrays (make_heldout_batches)
    self._mesh, self._rules = setup.mesh, setup.rules
    self._step = jax.jit(make_eval_step(setup.graphdef))
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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       eval_callbacks: Sequence[EvalCallback] = ()) -> dict[str, Any]:
  """Train (or resume) a model; returns the final metrics.

  Evaluation (held-out loss, then `eval_callbacks`) runs every `config.eval.every_steps` and
  at the end (every_steps 0: only at the end). `experiments/train.py` passes the benchmark
  tasks of `config.eval.tasks` as a callback (`attn_jax.eval.run.task_callback`).

  One run per workdir: a second run on the same workdir stops at once (WorkdirLockedError
  naming the holder's pid). SIGTERM/SIGINT/SIGHUP stop at a step boundary with a checkpoint;
  the result then has `preempted` (the signal's name).
  """
  workdir = os.path.abspath(workdir)
  lock = lock_workdir(workdir)  # process 0 only; creates workdir, names it when unusable
  os.makedirs(workdir, exist_ok=True)
  try:
    return _train_and_evaluate(config, workdir, eval_callbacks)
  finally:
    if lock is not None:
      lock.release()


class NonFiniteTrainingError(FloatingPointError):
  """Training stopped at a step whose loss, gradient or update was not finite."""


NONFINITE_MODES = ("skip", "halt")


def _check_train(config) -> None:
  t = config.train
  if t.nonfinite not in NONFINITE_MODES:
    raise ValueError(f"config.train.nonfinite: {t.nonfinite!r} not in {NONFINITE_MODES}")
  if int(t.nonfinite_max_consecutive) < 1:
    raise ValueError(f"config.train.nonfinite_max_consecutive: must be >= 1, got "
                     f"{t.nonfinite_max_consecutive!r}")
  if int(t.spike_window) < 0 or int(t.spike_window) == 1:
    raise ValueError(f"config.train.spike_window: must be 0 (off) or >= 2, got "
                     f"{t.spike_window!r}")
  if not float(t.spike_threshold) > 0:
    raise ValueError(f"config.train.spike_threshold: must be > 0, got {t.spike_threshold!r}")


class LossMonitor:
  """Host-side watch over every step's loss: non-finite steps and loss spikes.

  A spike is a finite loss above mean + k * max(std, 1e-3 * |mean|) of the previous `window`
  finite losses (k = `threshold`), once the window holds at least max(2, window // 4) of them;
  the floor on the std keeps a flat loss curve from flagging rounding noise. Every finite loss
  enters the window (a lasting level shift stops being flagged once the window has seen it).
  `state()` / `load()` carry the counters and window through a checkpoint's meta.
  """

  def __init__(self, window: int, threshold: float):
    self.window, self.threshold = int(window), float(threshold)
    self.losses: list[float] = []
    self.nonfinite_steps = 0
    self.loss_spikes = 0
    self.consecutive_nonfinite = 0
    self.last_finite_step: int | None = None

  def update(self, step: int, loss: float, nonfinite: bool) -> bool:
    """Records a step; returns whether its loss is a spike."""
    if nonfinite:
      self.nonfinite_steps += 1
      self.consecutive_nonfinite += 1
      return False
    self.consecutive_nonfinite = 0
    self.last_finite_step = step
    if not self.window:
      return False
    spike = False
    if len(self.losses) >= max(2, self.window // 4):
      hist = np.asarray(self.losses, np.float64)
      mean = float(hist.mean())
      std = max(float(hist.std()), 1e-3 * abs(mean))
      spike = loss > mean + self.threshold * std
    self.losses = (self.losses + [float(loss)])[-self.window:]
    self.loss_spikes += int(spike)
    return spike

  def state(self) -> dict:
    return {"losses": list(self.losses), "nonfinite_steps": self.nonfinite_steps,
            "loss_spikes": self.loss_spikes, "consecutive_nonfinite": self.consecutive_nonfinite,
            "last_finite_step": self.last_finite_step}

  def load(self, state: dict | None) -> None:
    if not state:
      return
    self.losses = [float(x) for x in state.get("losses", [])][-self.window:] if self.window else []
    self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
    self.loss_spikes = int(state.get("loss_spikes", 0))
    self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
    self.last_finite_step = state.get("last_finite_step")


def compile_step(setup: Setup, batch: dict):
  """The train step compiled for `batch` (arrays or ShapeDtypeStructs) as the trainer compiles
  it: traced inside the mesh's logical-axis rules, so the model's activation constraints
  apply. Benchmarks and memory reports use this, not a bare `step_fn.lower`."""
  with shd.use_rules(setup.mesh, setup.rules):
    return setup.step_fn.lower(setup.abstract_state, batch).compile()


def abstract_batch(setup: Setup, accum: int, micro_batch: int, seq_len: int) -> dict:
  """The train step's [accum, micro_batch, seq_len] batch as sharded ShapeDtypeStructs."""
  return {k: jax.ShapeDtypeStruct((accum, micro_batch, seq_len),
                                  jnp.float32 if k == "weights" else jnp.int32,
                                  sharding=setup.batch_sharding)
          for k in setup.batch_keys}


def step_memory(setup: Setup, micro_batch: int, accum: int, seq_len: int):
  """Compiled memory analysis of the train step for `accum` micro-batches of `micro_batch`
  rows (abstract shapes: nothing runs, nothing is allocated)."""
  return compile_step(setup, abstract_batch(setup, accum, micro_batch, seq_len)
                      ).memory_analysis()


def _fit_memory(setup: Setup, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Compare the compiled step's memory with the device's before the first step.

  Does not fit: with `train.auto_microbatch`, pick the largest micro-batch that fits (same
  tokens per optimizer step through `train.grad_accum`) and log it; else stop with a
  MemoryError whose one paragraph names the needed and available memory and the knobs.
  `train.device_memory_gb` (> 0) overrides the detected memory (e.g. to size a run for
  another device)."""
  from attn_jax.train import memory
  t, d = config.train, config.data
  avail = int(t.get("device_memory_gb", 0.0) * 2**30) or None
  mem = step_memory(setup, d.global_batch_size, t.grad_accum, d.seq_len)
  if mem is None:   # the backend reports no analysis
    return config
  fit = memory.check_fit(mem, available=avail, micro_batch=d.global_batch_size,
                         grad_accum=t.grad_accum, remat=setup.cfg.remat)
  logging.info("%s", fit.message)
  if fit.fits:
    return config
  if not t.get("auto_microbatch", False):
    raise MemoryError(fit.message)
  total = d.global_batch_size * t.grad_accum
  micro, accum = memory.pick_micro_batch(
      lambda m: step_memory(setup, m, total // m, d.seq_len), total, available=avail,
      multiple_of=int(np.prod([setup.mesh.shape[a] for a in _batch_axes(setup.rules)])))
  logging.warning("train.auto_microbatch: micro-batch %d x grad_accum %d (was %d x %d) fits",
                  micro, accum, d.global_batch_size, t.grad_accum)
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.global_batch_size, config.train.grad_accum = micro, accum
  return config


def _batch_axes(rules) -> tuple[str, ...]:
  axes = rules.get("batch")
  return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def _flat_config(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat_config(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_changes(saved: dict, now: dict) -> list[str]:
  """"field: saved -> now" for every config field that differs (JSON forms of two configs)."""
  a, b = _flat_config(saved), _flat_config(now)
  return [f"config.{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}"
          for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


_SCHEDULE_FIELDS = ("config.train.steps", "config.optim.lr", "config.optim.warmup_steps",
                    "config.optim.min_lr_ratio")


def _restore(ckpt: Checkpointer, setup: Setup, data_it, config):
  """The latest usable checkpoint (or None); a state that does not match this config's model is
  an error naming the differing arrays and config fields, with every checkpoint left as it was.
  On any error the checkpointer is closed before it propagates (no orbax work left at exit)."""
  try:
    return _restore_or_explain(ckpt, setup, data_it, config)
  except BaseException:
    try:
      ckpt.close()
    except Exception as e:  # the restore error is the one that matters
      logging.error("closing the checkpointer after a failed restore: %s", e)
    raise


def _restore_or_explain(ckpt: Checkpointer, setup: Setup, data_it, config):
  try:
    return ckpt.restore(setup.abstract_state, data_it)
  except CheckpointMismatchError as e:
    try:
      saved = ckpt.restore_meta(e.step).get("config", {})
      changes = config_changes(saved, config_to_json(config))
    except Exception:  # the saved config is unreadable: the arrays alone must do
      changes = []
    if not changes:
      raise
    raise CheckpointMismatchError(
        f"checkpoint step {e.step} in {ckpt.directory} was saved with another config: "
        f"{', '.join(changes[:8])}. Nothing was moved or changed: resume with the saved config, "
        f"or use another --workdir for the new one. Stored vs requested arrays: "
        f"{'; '.join(e.differences)}", step=e.step, differences=e.differences) from None


def _warn_config_changes(saved: dict, now: dict, step: int) -> None:
  """Resuming with a changed config is allowed (e.g. more steps) but never silent."""
  changes = config_changes(saved, now) if saved else []
  if not changes:
    return
  logging.warning("resuming at step %d with a config that differs from the checkpoint's: %s",
                  step, "; ".join(changes[:12]))
  if any(c.split(":")[0] in _SCHEDULE_FIELDS for c in changes):
    logging.warning("the learning-rate schedule (warm-up + cosine over config.train.steps) "
                    "changed with it: from step %d on the run follows the new schedule, not "
                    "the one it started with", step)


def _train_and_evaluate(config, workdir, eval_callbacks) -> dict[str, Any]:
  from attn_jax.data import pipeline

  setup = build_setup(config)
  cfg = setup.cfg
  _check_train(config)
  need = pipeline.vocab_size_needed(config.data)
  if need > cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={cfg.vocab_size} is smaller than the data's "
                     f"vocabulary ({need}, from config.data.tokenizer/source)")
  _check_batch(config, setup.mesh, setup.rules)
  config = _fit_memory(setup, config)   # before any data is read: may change the micro-batch
  logging.info("devices: %s; mesh %s", jax.devices(), dict(setup.mesh.shape))
  n = setup.n_params
  logging.info("parameters: total %s, non-embedding %s, mixer %s, mlp %s", f"{n['total']:,}",
               f"{n['non_embedding']:,}", f"{n['mixer']:,}", f"{n['mlp']:,}")

  ckpt = Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep)
  accum, L = config.train.grad_accum, config.data.seq_len
  global_shape = (accum, config.data.global_batch_size, L)
  host_rows = shd.host_batch_rows(setup.batch_sharding, global_shape, batch_dim=1)
  data_it = pipeline.make_train_iterator(config.data, seed=config.seed, host_rows=host_rows)
  monitor = LossMonitor(config.train.spike_window, config.train.spike_threshold)
  state = _restore(ckpt, setup, data_it, config)
  if state is None:
    state = setup.init_fn()
    start = 0
  else:
    start = int(state["step"])
    saved_meta = ckpt.restore_meta(ckpt.restored_step)
    monitor.load(saved_meta.get("monitor"))
    _warn_config_changes(saved_meta.get("config", {}), config_to_json(config), start)
    logging.info("resumed from %s at step %d", ckpt.directory, start)
  if monitor.last_finite_step is None:
    monitor.last_finite_step = start

  t0 = time.perf_counter()
  compiled = compile_step(setup, abstract_batch(setup, *global_shape))
  logging.info("train step compiled in %.1fs", time.perf_counter() - t0)
  try:
    logging.info("memory analysis: %s", compiled.memory_analysis())
  except Exception:  # not every backend reports it
    pass

  writer = MetricWriter(workdir)
  writer.truncate_after(start)  # rows an interrupted run logged after its last checkpoint
  tokens_per_step = accum * config.data.global_batch_size * L
  flops_per_tok = flops_lib.train_flops_per_token(cfg, n, L)
  peak = flops_lib.peak_flops_per_device(override=config.train.peak_flops,
                                         dtype=config.model.dtype)  # fp32: the TF32 peak
  n_dev = jax.device_count()
  base_meta = {"config": config_to_json(config), "n_params": n}
  evaluator = _Evaluator(setup, make_heldout_batches(config, setup), eval_callbacks)

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

  def halt_message(step_no, loss, why):
    saved = [s for s in ckpt.all_steps() if s < step_no]
    where = (f"the latest checkpoint (from before it) is step {max(saved)} in {ckpt.directory}"
             if saved else f"there is no checkpoint yet in {ckpt.directory}")
    return (f"step {step_no}: the loss ({loss}), a gradient or the parameter update is not "
            f"finite; {why}. The update was not applied. The last finite step is "
            f"{monitor.last_finite_step}; {where} (no checkpoint ever holds non-finite values). "
            "Lower config.optim.lr / raise optim.warmup_steps, or set "
            "config.train.nonfinite='skip' to step over isolated events.")

  def flush(pending_metrics):
    nonlocal t_log, step_log, diverged
    step_no, m = pending_metrics
    loss = float(m["loss"])
    nonfinite = bool(float(m["nonfinite"]) > 0)
    spike = monitor.update(step_no, loss, nonfinite)
    halt = None
    if nonfinite:
      if config.train.nonfinite == "halt":
        halt = "stopping (config.train.nonfinite='halt')"
      elif monitor.consecutive_nonfinite >= config.train.nonfinite_max_consecutive:
        halt = (f"{monitor.consecutive_nonfinite} non-finite steps in a row (config.train."
                f"nonfinite_max_consecutive={config.train.nonfinite_max_consecutive})")
      else:
        logging.warning("step %d: non-finite loss (%s), gradient or update; update skipped "
                        "(%d non-finite steps so far)", step_no, loss, monitor.nonfinite_steps)
    if spike:
      logging.warning("step %d: loss spike %.4f (above mean + %g std of the last %d losses; "
                      "%d spikes so far)", step_no, loss, monitor.threshold,
                      len(monitor.losses) - 1, monitor.loss_spikes)
    if (step_no % config.train.log_every == 0 or step_no == config.train.steps or nonfinite
        or spike):
      now = time.perf_counter()
      dt = max(now - t_log, 1e-9)
      tps = tokens_per_step * (step_no - step_log) / dt
      out = flatten_metrics(m)
      out["tokens_per_sec"] = tps
      out["tokens_seen"] = step_no * tokens_per_step
      out["loss_spike"] = float(spike)
      out["loss_spikes"] = monitor.loss_spikes
      out["nonfinite_steps"] = monitor.nonfinite_steps
      if peak:
        out["mfu"] = tps * flops_per_tok / (peak * n_dev)
      writer.write(step_no, out)
      last.update(out)
      t_log, step_log = now, step_no
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{out['accuracy']:.3f}",
                        tok_s=f"{tps:,.0f}")
    if halt is not None:   # after logging the row of the step that stops the run
      diverged = True
      raise NonFiniteTrainingError(halt_message(step_no, loss, halt))

  def save(step_no):
    ckpt.save(step_no, state, data_it, dict(base_meta, monitor=monitor.state()), force=True)

  guard = PreemptionGuard().__enter__()
  preempted = None
  error: BaseException | None = None
  state_valid = True   # False while `state` may be donated to a step that has not returned
  data_pos = None      # iterator position before this step's micro-batches, until dispatched
  try:
    for step_no in range(start + 1, config.train.steps + 1):
      data_pos = data_it.get_state()
      batch = _next_batch(data_it, accum, setup.batch_sharding, global_shape,
                          setup.batch_keys)
      state_valid = False
      state, metrics = compiled(state, batch)
      state_valid, data_pos = True, None
      if pending is not None:
        flush(pending)
      pending = (step_no, metrics)
      if bar is not None:
        bar.update(1)
      if step_no % config.checkpoint.every_steps == 0:
        flush(pending)
        pending = None
        save(step_no)
        last_saved = step_no
      if config.eval.every_steps and step_no % config.eval.every_steps == 0:
        ev = evaluator(state, step_no)
        writer.write(step_no, ev)
        last.update(ev)
        last_eval = step_no
      ckpt.check_saves()   # a background save that failed (disk full) stops the run now
      if guard.poll(step_no):  # SIGTERM/SIGINT/SIGHUP: stop at this step boundary (saved below)
        preempted = guard.signal_name or "signal"
        logging.warning("%s: stopping after step %d; rerun the same command to resume",
                        preempted, step_no)
        break
    if pending is not None:
      flush(pending)
      pending = None
  except BaseException as e:
    error = e
    raise
  finally:
    guard.__exit__(None, None, None)
    _on_exit(error=error, flush=flush, pending=pending, state_valid=state_valid,
             data_it=data_it, data_pos=data_pos, diverged=lambda: diverged,
             done=lambda: int(state["step"]), last_saved=last_saved, save=save, ckpt=ckpt)
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


def _on_exit(*, error, flush, pending, state_valid, data_it, data_pos, diverged, done,
             last_saved, save, ckpt) -> None:
  """The final save of `_train_and_evaluate` (normal end, preemption or an exception).

  Saves the last step when it is newer than the last checkpoint, the state is not possibly
  donated, and the run did not stop for non-finite values. With an exception in flight
  (`error`), anything failing here is logged and the original exception is what propagates.
  """
  def attempt(what, fn):
    try:
      fn()
    except Exception as e:
      if error is None:
        raise
      logging.error("while stopping after %s: %s failed: %s: %s", type(error).__name__, what,
                    type(e).__name__, e)

  if pending is not None and state_valid and not diverged():
    def log_last():  # the last dispatched step, even when interrupted
      try:
        flush(pending)
      except NonFiniteTrainingError as e:
        logging.error("%s", e)
    attempt("logging the last step", log_last)
  if data_pos is not None:  # stopped before this step was dispatched: its micro-batches go back
    attempt("rewinding the data iterator", lambda: data_it.set_state(data_pos))
  if isinstance(error, CheckpointSaveError):
    logging.error("not saving again after a failed save; the resume point is the latest "
                  "checkpoint in %s (step %s)", ckpt.directory, ckpt.latest_step())
  elif not state_valid:
    logging.error("not saving: the train step raised (%s) and its input state was donated to "
                  "it; the resume point is the latest checkpoint in %s (step %s)",
                  type(error).__name__ if error is not None else "?", ckpt.directory,
                  ckpt.latest_step())
  elif not diverged():
    def final_save():
      step = done()
      if step > last_saved:  # interrupted or finished: never lose work
        save(step)
    attempt("the final checkpoint", final_save)
  attempt("closing the checkpointer", ckpt.close)
