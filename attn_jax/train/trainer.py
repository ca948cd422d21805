"""`train_and_evaluate(config, workdir)`: the whole training run, importable from a notebook.

Order of work (abstract first, nothing materialised unsharded), as `train_and_evaluate` reads:
  the `PreemptionGuard` (signals are the run's from its first line) -> `_checked_setup`:
  `setup.build_setup` (config.validate -> mesh -> abstract model/state -> shardings -> jitted
  init and step) and `validate_for_training` (the checks that need the setup, the data files
  included), before any file is written -> the workdir's locks (`_locked`) ->
  `fitting.fit_memory` (the batch geometry whose compiled step fits the device; the run's
  config is rewritten to it) -> `_Run` (checkpointer, data iterator) -> restore from the latest
  checkpoint (state, data position, loss monitor; `resume.py`, `loss_monitor.py`) or jitted
  init (out_shardings; a fresh start moves an earlier run's history aside,
  `workdir.rotate_history`) -> `fitting.compile_for` that geometry (explicit in/out shardings,
  state donated; memory analysis logged) -> loop ->
  `_Run.on_exit` (last row, data rewind, final save) -> final evaluation.

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
  * History: a resumed run drops the metric rows logged after its checkpoint (they are logged
    again); a run that starts at step 0 where an earlier run left metrics (all its checkpoints
    corrupt and set aside, or none ever written) moves them to metrics.jsonl.<k> / tb.<k>/ and
    says so, so no history is ever cut.
  * Signals before the first step: the guard is entered before the config is checked; a
    signal in the set-up ends the run at the next phase boundary (`StoppedBeforeTraining`: a
    result with `preempted` and `before_training`, the locks released, nothing saved), and at
    once in the phases that write nothing (the checks, the compiles: `early_signals.
    abandonable`) when the entry point installed `early_signals`.
  * Failed saves and writes: a background save that failed (a full disk) is noticed at the
    next step boundary (`Checkpointer.check_saves`) and stops the run with
    `CheckpointSaveError`; a metrics writer that failed or stalled (writers.py: never blocking
    the loop) stops it the same way with a `WriteError` (both are WriteErrors). No save is
    attempted after either, so the older checkpoints stay the resume point and no checkpoint
    is newer than the rows logged (the writers are synced before every save); a resumed run
    logs the lost rows again. Every resume point named is a committed step on disk (a save
    still in progress is awaited before the message names one).
  * Held-out evaluation batches are global arrays with the batch sharding, built from this
    host's rows (`make_array_from_process_local_data`), as the training batches.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections

from attn_jax import paths, sharding as shd
from attn_jax.config import config_to_json
from attn_jax.data import pipeline, text
from attn_jax.options import field_check
from attn_jax.train import (early_signals, fitting, flops as flops_lib, init_from, resume,
                            setup as setup_lib, workdir as workdir_lib)
from attn_jax.train.checkpoint import (Checkpointer, CheckpointSaveError, PreemptionGuard,
                                       check_writable)
from attn_jax.train.fitting import BatchGeometry
from attn_jax.train.loss_monitor import NONFINITE_MODES, LossMonitor, NonFiniteTrainingError
from attn_jax.train.metrics import MetricWriter, flatten_metrics
from attn_jax.train.profile import StepProfiler
from attn_jax.train.setup import EvalCallback, Setup, build_setup, make_heldout_batches
from attn_jax.train.wandb_writer import add_wandb, check_installed
from attn_jax.train.workdir import lock_tensorboard, lock_workdir
from attn_jax.train.writers import WriteError


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       eval_callbacks: Sequence[EvalCallback] = ()) -> dict[str, Any]:
  """Train (or resume) a model; returns the final metrics.

  Evaluation (held-out loss, then `eval_callbacks`) runs every `config.eval.every_steps` and
  at the end (every_steps 0: only at the end). `experiments/train.py` passes the benchmark
  tasks of `config.eval.tasks` as a callback (`attn_jax.eval.run.task_callback`).

  One run per workdir: a second run on the same workdir (or writing the same TensorBoard
  folder) stops at once (WorkdirLockedError naming the holder's pid). A run that starts at step
  0 in a workdir holding an earlier run's metrics moves them aside first (`workdir.rotate_history`).
  SIGTERM/SIGINT/SIGHUP stop at a step boundary with a checkpoint; the result then has
  `preempted` (the signal's name). A signal before the first step stops the run there: the
  result has `preempted`, `before_training` and `step` (the restored step, 0 for a new run).
  Every check of the config and its data runs before the workdir is made or locked.
  """
  workdir = paths.name(workdir)   # absolute when local; a gs:// URI kept as it is (paths.py)
  # Signals are the run's from here on: a stop before the first step ends it cleanly, the lock
  # released (early_signals.py: at once where nothing is written, else at the next phase).
  early_signals.stopped_when(early_signals.BEFORE_TRAINING)
  with PreemptionGuard() as guard:
    guard.then = f"stopping {early_signals.BEFORE_TRAINING}"
    try:
      with early_signals.abandonable():   # every check, before any file is written
        setup = _checked_setup(config)
      _stop_if_signalled(guard, 0)
      return _locked(config, workdir, eval_callbacks, setup, guard)
    except StoppedBeforeTraining as e:
      logging.warning("%s: stopped %s", e.signal_name, early_signals.BEFORE_TRAINING)
      return {"preempted": e.signal_name, "step": e.step, "before_training": True,
              "workdir": workdir,
              "checkpoint_dir": paths.name(paths.run_path(workdir) / "checkpoints")}


def _checked_setup(config: ml_collections.ConfigDict) -> "Setup":
  """Every check of the config (and of the data files and init_from run it names) that needs
  no workdir, and the abstract set-up they need: a refused run writes nothing."""
  init_from.check(config)       # config.train.init_from
  setup = build_setup(config)   # runs config.validate
  validate_for_training(config, setup)
  check_installed(config)       # config.metrics.wandb_project without wandb
  return setup


# The quickstart (MQAR, about 0.1M parameters) is meant to train on generated data; a model past
# this size on generated data is most likely a preset run without its data.* fields.
GENERATED_DATA_WARN_PARAMS = 1_000_000


def data_source(config) -> str:
  """One line naming what the run trains on."""
  d = config.data
  if str(d.source) == "synthetic":
    task = str(d.synthetic_task)
    what = (f"multi-query associative recall ({d.mqar_num_pairs} key-value pairs, "
            f"{d.mqar_num_queries} queries, keys and values from {d.mqar_vocab} tokens)"
            if task == "mqar" else "uniform random tokens (nothing to learn: a throughput run)")
    return (f"data: GENERATED {what}, made on the fly (data.source='synthetic', "
            f"data.synthetic_task={task!r})")
  return (f"data: data.source={str(d.source)!r} from data.paths={str(d.paths)!r}, tokenizer "
          f"{str(d.tokenizer)!r}")


def say_data_source(config, n_params: int) -> None:
  """Logs `data_source` first thing; a warning when a model larger than the quickstart trains
  on generated data."""
  logging.info("%s", data_source(config))
  if str(config.data.source) == "synthetic" and n_params > GENERATED_DATA_WARN_PARAMS:
    logging.warning(
        "this %.1fM-parameter model trains on GENERATED data (data.source='synthetic', the "
        "base config's default), not on text: for a language model pass "
        "--config.data.source=jsonl (or text, shards) --config.data.paths=... "
        "--config.data.tokenizer=...", n_params / 1e6)


def _locked(config, workdir: str, eval_callbacks, setup: "Setup",
            guard: PreemptionGuard) -> dict[str, Any]:
  """`_train_and_evaluate` holding the workdir's and TensorBoard's locks (released on the way
  out, and by a signal that ends the process before training: early_signals.on_abandon)."""
  locks = []

  def release():
    for held in reversed(locks):
      if held is not None:
        held.release()

  with early_signals.on_abandon(release):
    try:
      locks.append(lock_workdir(workdir))   # process 0 only; creates workdir, names it when
      paths.run_path(workdir).mkdir(parents=True, exist_ok=True)   # unusable
      locks.append(lock_tensorboard(workdir))   # tb/ reached by another run through a symlink
      check_writable(paths.run_path(workdir) / "checkpoints")   # not at the first save
      return _train_and_evaluate(config, workdir, eval_callbacks, setup, guard)
    finally:
      release()
      locks.clear()


class StoppedBeforeTraining(Exception):
  """A signal arrived before the first step (nothing to save): the run ends there."""

  def __init__(self, signal_name: str, step: int):
    super().__init__(f"stopped by {signal_name} before training started")
    self.signal_name, self.step = signal_name, step


def _stop_if_signalled(guard: PreemptionGuard, step: int) -> None:
  """Between the phases before the first step: StoppedBeforeTraining once a signal came. (On
  several processes the loop's first poll decides, so that every host stops at one step.)"""
  if guard.should_stop and jax.process_count() == 1:
    raise StoppedBeforeTraining(guard.signal_name or "signal", step)


def validate_for_training(config: ml_collections.ConfigDict, setup: Setup) -> None:
  """What a training run checks beyond `config.validate` (which `build_setup` ran): the
  non-finite and spike options, the vocabulary against the data's, and the global batch against
  the mesh's batch shards; every error names the config field.
  (Each host's rows come from the batch sharding, `sharding.host_batch_rows`: a host whose
  devices hold a replicated batch reads all of it, so no divisibility by the process count is
  required.)"""
  t = config.train
  need = field_check("config.train")
  need(t.nonfinite in NONFINITE_MODES, "nonfinite", f"{t.nonfinite!r} not in {NONFINITE_MODES}")
  need(int(t.nonfinite_max_consecutive) >= 1, "nonfinite_max_consecutive",
       f"must be >= 1, got {t.nonfinite_max_consecutive!r}")
  need(int(t.spike_window) >= 0 and int(t.spike_window) != 1, "spike_window",
       f"must be 0 (off) or >= 2, got {t.spike_window!r}")
  need(float(t.spike_threshold) > 0, "spike_threshold",
       f"must be > 0, got {t.spike_threshold!r}")
  if str(config.data.source) in text.TEXT_SOURCES:
    text.data_files(config.data)   # every file there (a folder: its files), named if missing
  vocab = pipeline.vocab_size_needed(config.data)
  if vocab > setup.cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={setup.cfg.vocab_size} is smaller than the data's "
                     f"vocabulary ({vocab}, from config.data.tokenizer/source)")
  gbs, shards = config.data.global_batch_size, shd.batch_shards(setup.mesh, setup.rules)
  if gbs % shards:
    raise ValueError(f"config.data.global_batch_size={gbs} is not divisible by the "
                     f"{shards} batch shards of the mesh {dict(setup.mesh.shape)}")


def _train_and_evaluate(config, workdir, eval_callbacks, setup: Setup,
                        guard: PreemptionGuard) -> dict[str, Any]:
  resume.check_resumable(workdir, setup, config)   # a changed model config: stop before compiling
  say_data_source(config, int(setup.n_params["total"]))   # the run's first line (a refused
                                                          # run logs nothing before its error)
  with early_signals.abandonable():
    geo = fitting.fit_memory(setup, config)          # before any data is read: may shrink the micro-batch
  _stop_if_signalled(guard, 0)
  config = geo.apply(config)                  # from here on the config holds the run's batch
  setup_lib.log_setup(setup)
  run = _Run(config, workdir, setup, geo)     # checkpointer, data iterator, loss monitor
  run.restore()                               # or a fresh init
  try:
    _stop_if_signalled(guard, run.start)
    with early_signals.abandonable():
      compiled = fitting.compile_for(setup, geo)
    _stop_if_signalled(guard, run.start)
  except BaseException:
    run.ckpt.close()
    raise
  guard.then = "stopping at the end of this step after a checkpoint"
  run.open_outputs(eval_callbacks)            # metrics file, evaluator, progress bar

  profiler = StepProfiler(config.train.get("profile_steps", ""), workdir, start=run.start,
                          last=config.train.steps)
  run.writer.stop_when(lambda: guard.should_stop)   # a stalled writer never delays a signal
  error: BaseException | None = None
  try:
    for step in range(run.start + 1, config.train.steps + 1):
      profiler.before(step, run.state)        # config.train.profile_steps (profile.py)
      run.train_step(compiled, step)          # logs the previous step's row
      if step % config.checkpoint.every_steps == 0:
        run.save(step)
      if config.eval.every_steps and step % config.eval.every_steps == 0:
        run.evaluate(step)
      run.ckpt.check_saves()   # a background save that failed (disk full) stops the run now,
      run.writer.check()       # and so does a metrics writer that failed (writers.py)
      if run.preempted_at(guard, step):   # SIGTERM/SIGINT/SIGHUP: stop here (saved on exit)
        break
    run.flush()
    if run.preempted is None:
      run.check_progress()     # a run whose every step was skipped as non-finite is an error
  except WriteError as e:
    error = run.write_failed(e)   # names the resume point
    raise error
  except BaseException as e:
    error = e
    raise
  finally:
    profiler.stop()           # a run that ended inside the window keeps its trace
    try:
      run.on_exit(error)      # last row, data rewind, final save: never in place of `error`
    finally:                  # (a signal during the final save waits for its commit)
      guard.__exit__(None, None, None)
      early_signals.stopped_when(early_signals.AFTER_TRAINING)
  if guard.should_stop and run.preempted is None and jax.process_count() == 1:
    run.preempted = guard.signal_name or "signal"   # came during the final save: no evaluation
  return run.result()         # final evaluation unless preempted


class _Run:
  """One training run from restore to exit: the train state and everything the loop carries
  between steps. The step's metrics are read one step late (`pending`, logged by `flush`), so
  step t+1 is dispatched before the host waits for step t."""

  def __init__(self, config, workdir: str, setup: Setup, geo: BatchGeometry):
    self.config, self.workdir, self.setup, self.geo = config, workdir, setup, geo
    self.ckpt = Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep,
                             allow_unverified=config.checkpoint.get("allow_unverified", False))
    rows = shd.host_batch_rows(setup.batch_sharding, geo.shape, batch_dim=1)
    self.data_it = pipeline.make_train_iterator(config.data, seed=config.seed, host_rows=rows)
    self.monitor = LossMonitor(config.train.spike_window, config.train.spike_threshold)
    self.state: Any = None
    self.start = self.last_saved = 0
    self.pending = None      # (step, metrics) of the step dispatched before the current one
    self.state_valid = True  # False while `state` may be donated to a step that has not returned
    self.data_pos = None     # iterator position before this step's micro-batches, until dispatched
    self.diverged = False    # stopped for non-finite values: nothing more is saved
    self.logged = 0          # steps this run has logged (read by `check_progress`)
    self.last_loss = float("nan")
    self.preempted: str | None = None
    self.last: dict[str, Any] = {}
    self.last_eval = -1
    self.writer = self.evaluator = self.bar = None

  def restore(self) -> None:
    """The latest checkpoint's state, data position and loss monitor, or a fresh state."""
    state = resume.restore(self.ckpt, self.setup, self.data_it, self.config)
    if state is None:
      # a fresh init, or config.train.init_from's parameters with a fresh optimizer state
      state = init_from.initial_state(self.config, self.setup, self.setup.init_fn())
      self.start = 0
    else:
      self.start = int(state["step"])
      meta = self.ckpt.restore_meta(self.ckpt.restored_step)
      self.monitor.load(meta.get("monitor"))
      resume.warn_config_changes(meta.get("config", {}), config_to_json(self.config), self.start)
      logging.info("resumed from %s at step %d", self.ckpt.directory, self.start)
    if self.monitor.last_finite_step is None:
      self.monitor.last_finite_step = self.start
    self.state, self.last_saved = state, self.start

  def open_outputs(self, eval_callbacks: Sequence[EvalCallback]) -> None:
    """Metrics file (a resumed run: rows an interrupted run logged after its last checkpoint
    dropped; a run from step 0: an earlier run's rows moved aside), the throughput constants,
    the evaluator and the progress bar."""
    c, n = self.config, self.setup.n_params
    if self.start == 0 and jax.process_index() == 0:
      workdir_lib.rotate_history(self.workdir, self.ckpt.directory)
    self.writer = MetricWriter(self.workdir)
    if self.start:
      self.writer.truncate_after(self.start)
    add_wandb(self.writer, c, self.workdir, self.setup, config_to_json(c), start=self.start)
    self.flops_per_tok = flops_lib.train_flops_per_token(self.setup.cfg, n, self.geo.seq_len)
    self.peak = flops_lib.peak_flops_per_device(override=c.train.peak_flops,
                                                dtype=c.model.dtype)  # fp32: the TF32 peak
    self.n_dev = jax.device_count()
    self.base_meta = {"config": config_to_json(c), "n_params": n}
    self.evaluator = setup_lib.Evaluator(self.setup, make_heldout_batches(c, self.setup), eval_callbacks)
    if c.train.progress_bar and jax.process_index() == 0:
      from tqdm import tqdm
      self.bar = tqdm(total=c.train.steps, initial=self.start, unit="step", dynamic_ncols=True)
    self.t_log, self.step_log = time.perf_counter(), self.start

  def train_step(self, compiled, step: int) -> None:
    """Dispatch `step` (its micro-batches pulled first), then log the step before it."""
    self.data_pos = self.data_it.get_state()
    batch = setup_lib.next_batch(self.data_it, self.geo.accum, self.setup.batch_sharding, self.geo.shape,
                        self.setup.batch_keys)
    self.state_valid = False
    self.state, metrics = compiled(self.state, batch)
    self.state_valid, self.data_pos = True, None
    self.flush()
    self.pending = (step, metrics)
    if self.bar is not None:
      self.bar.update(1)

  def flush(self) -> None:
    """Log the pending step; NonFiniteTrainingError when it stops the run."""
    if self.pending is not None:
      self._log(*self.pending)
      self.pending = None

  def save(self, step: int) -> None:
    self.flush()
    self.writer.sync()    # no checkpoint newer than the rows every writer has taken
    self._checkpoint(step)

  def _checkpoint(self, step: int) -> None:
    self.ckpt.save(step, self.state, self.data_it,
                   dict(self.base_meta, monitor=self.monitor.state()), force=True)
    self.last_saved = step

  def evaluate(self, step: int) -> None:
    ev = self.evaluator(self.state, step)
    self.writer.write(step, ev)
    self.last.update(ev)
    self.last_eval = step

  def preempted_at(self, guard: PreemptionGuard, step: int) -> bool:
    if not guard.poll(step):
      return False
    self.preempted = guard.signal_name or "signal"
    logging.warning("%s: stopping after step %d; rerun the same command to resume",
                    self.preempted, step)
    return True

  def _log(self, step: int, m: dict) -> None:
    """The monitor's verdict on `step` and its metrics row (every `log_every` steps, the last
    one, and every non-finite or spiking one); after writing the row of a step that stops the
    run, raises NonFiniteTrainingError."""
    t = self.config.train
    loss, nonfinite = float(m["loss"]), bool(float(m["nonfinite"]) > 0)
    spike = self.monitor.update(step, loss, nonfinite)
    self.logged, self.last_loss = self.logged + 1, loss
    halt = self._halt_reason() if nonfinite else None
    if nonfinite and halt is None:
      logging.warning("step %d: non-finite loss (%s), gradient or update; update skipped "
                      "(%d non-finite steps so far)", step, loss, self.monitor.nonfinite_steps)
    if spike:
      logging.warning("step %d: loss spike %.4f (above mean + %g std of the last %d losses; "
                      "%d spikes so far)", step, loss, self.monitor.threshold,
                      len(self.monitor.losses) - 1, self.monitor.loss_spikes)
    if step % t.log_every == 0 or step == t.steps or nonfinite or spike:
      self._write_row(step, m, spike)
    if halt is not None:
      self.diverged = True
      raise NonFiniteTrainingError(self._halt_message(step, loss, halt))

  def check_progress(self) -> None:
    """At the normal end of the run: NonFiniteTrainingError when every step this run trained
    was skipped as non-finite (a run shorter than `nonfinite_max_consecutive` would otherwise
    end with status 0 and a model that never trained)."""
    streak, n = self.monitor.consecutive_nonfinite, self.logged
    if n == 0 or streak < n:
      return
    self.diverged = True
    step = self.start + n
    raise NonFiniteTrainingError(self._halt_message(step, self.last_loss, (
        f"every one of the {n} steps this run trained (steps {self.start + 1}-{step}) was "
        f"non-finite and skipped, so it trained nothing (config.train.nonfinite_max_consecutive="
        f"{self.config.train.nonfinite_max_consecutive} halts longer streaks)")))

  def write_failed(self, e: WriteError) -> WriteError:
    """A failed write of the metrics writers, with the resume point named (a failed
    checkpoint save already names the steps kept)."""
    if isinstance(e, CheckpointSaveError):
      return e
    unfinished, pending = "", self.ckpt.pending_step
    try:   # a save still in progress decides the resume point: its end is awaited
      self.ckpt.wait()
    except CheckpointSaveError:   # the same disk, most likely
      unfinished = f" (step {pending}, which was being saved, is not: its save failed too)"
    latest = self.ckpt.latest_step()        # committed steps only, read from the disk
    kept = (f"the latest checkpoint, step {latest} in {self.ckpt.directory}, is kept: rerun "
            "the same command to resume from it" if latest is not None
            else f"there is no checkpoint yet in {self.ckpt.directory}")
    out = WriteError(f"{e}. The run stopped without saving again; {kept}{unfinished}")
    out.errno, out.__cause__ = e.errno, e
    return out

  def _halt_reason(self) -> str | None:
    """Why a non-finite step stops the run, or None when it is skipped."""
    t, consecutive = self.config.train, self.monitor.consecutive_nonfinite
    if t.nonfinite == "halt":
      return "stopping (config.train.nonfinite='halt')"
    if consecutive >= t.nonfinite_max_consecutive:
      return (f"{consecutive} non-finite steps in a row (config.train."
              f"nonfinite_max_consecutive={t.nonfinite_max_consecutive})")
    return None

  def _halt_message(self, step: int, loss: float, why: str) -> str:
    saved = [s for s in self.ckpt.all_steps() if s < step]
    where = (f"the latest checkpoint (from before it) is step {max(saved)} in "
             f"{self.ckpt.directory}" if saved
             else f"there is no checkpoint yet in {self.ckpt.directory}")
    return (f"step {step}: the loss ({loss}), a gradient or the parameter update is not "
            f"finite; {why}. The update was not applied. The last finite step is "
            f"{self.monitor.last_finite_step}; {where} (no checkpoint ever holds non-finite "
            "values). Lower config.optim.lr / raise optim.warmup_steps, or set "
            "config.train.nonfinite='skip' to step over isolated events.")

  def _write_row(self, step: int, m: dict, spike: bool) -> None:
    now = time.perf_counter()
    tps = self.geo.tokens * (step - self.step_log) / max(now - self.t_log, 1e-9)
    out = flatten_metrics(m)
    out.update(tokens_per_sec=tps, tokens_seen=step * self.geo.tokens, loss_spike=float(spike),
               loss_spikes=self.monitor.loss_spikes,
               nonfinite_steps=self.monitor.nonfinite_steps)
    if self.peak:
      out["mfu"] = tps * self.flops_per_tok / (self.peak * self.n_dev)
    self.writer.write(step, out)
    self.last.update(out)
    self.t_log, self.step_log = now, step
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{float(m['loss']):.4f}", acc=f"{out['accuracy']:.3f}",
                           tok_s=f"{tps:,.0f}")

  def on_exit(self, error: BaseException | None) -> None:
    """The way out (normal end, preemption or an exception): log the last dispatched step, put
    back the micro-batches of a step that was never dispatched, save the last step when it is
    newer than the last checkpoint, the state is not possibly donated and the run did not stop
    for non-finite values; close the checkpointer. With an exception in flight (`error`),
    anything failing here is logged and the original exception is what propagates."""
    attempt = lambda what, fn: _attempt(error, what, fn)
    wrote = isinstance(error, WriteError)   # a failed save or metrics write: the disk is full
    if self.pending is not None and self.state_valid and not self.diverged and not wrote:
      attempt("logging the last step", self._log_last)
    if self.data_pos is not None:  # stopped before this step was dispatched: rewind
      attempt("rewinding the data iterator", lambda: self.data_it.set_state(self.data_pos))
    if wrote or not self.state_valid:   # the resume point named below: committed steps only
      attempt("waiting for the save in progress", self.ckpt.wait)
    if wrote:   # a newer checkpoint than the rows logged would leave a hole in the history
      logging.error("not saving again after a failed write; the resume point is the latest "
                    "checkpoint in %s (step %s)", self.ckpt.directory, self.ckpt.latest_step())
    elif not self.state_valid:
      logging.error("not saving: the train step raised (%s) and its input state was donated "
                    "to it; the resume point is the latest checkpoint in %s (step %s)",
                    type(error).__name__ if error is not None else "?", self.ckpt.directory,
                    self.ckpt.latest_step())
    elif not self.diverged:
      attempt("the final checkpoint", self._final_save)
    attempt("closing the checkpointer", self.ckpt.close)
    self._close_writers(error)
    if self.bar is not None:
      self.bar.close()

  def _close_writers(self, error: BaseException | None) -> None:
    """Flush (normal end: `result` closes them after the final evaluation) or close them
    (each waits a bounded time); a writer's failure that is the error in flight is not
    reported twice."""
    if error is None:
      self.writer.flush()
      return
    try:
      self.writer.close()
    except WriteError as e:
      if not isinstance(error, WriteError):
        logging.error("while stopping after %s: closing the metric writers failed: %s",
                      type(error).__name__, e)

  def _log_last(self) -> None:
    """The last dispatched step's row, even when interrupted (a halt is logged, not raised)."""
    try:
      self.flush()
    except NonFiniteTrainingError as e:
      logging.error("%s", e)

  def _final_save(self) -> None:
    step = int(self.state["step"])
    if step > self.last_saved:  # interrupted or finished: never lose work
      try:
        self.writer.sync()   # as before every save: the rows first
      except WriteError as e:
        raise self.write_failed(e)
      self._checkpoint(step)

  def result(self) -> dict[str, Any]:
    """The final metrics: after a final evaluation, or as they stand when preempted."""
    step = int(self.state["step"])
    if self.preempted is not None:
      self.writer.close()
      return dict(self.last, workdir=self.workdir, checkpoint_dir=self.ckpt.directory,
                  preempted=self.preempted, step=step)
    if self.last_eval != step:
      self.evaluate(step)
    self.writer.close()
    return dict(self.last, workdir=self.workdir, checkpoint_dir=self.ckpt.directory)


def _attempt(error: BaseException | None, what: str, fn: Callable[[], Any]) -> None:
  """`fn()`; with `error` in flight a failure is logged instead of raised (the original error is
  the one that matters)."""
  try:
    fn()
  except Exception as e:
    if error is None:
      raise
    logging.error("while stopping after %s: %s failed: %s: %s", type(error).__name__, what,
                  type(e).__name__, e)
