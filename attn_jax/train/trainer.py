"""`train_and_evaluate(config, workdir)`: the whole training run, importable from a notebook.

Order of work (abstract first, nothing materialised unsharded), as `train_and_evaluate` reads:
  the `PreemptionGuard` (signals are the run's from its first line) ->
  `preflight.checked_setup`: `setup.build_setup` (config.validate -> mesh -> abstract
  model/state -> shardings -> jitted init and step) and `preflight.validate_for_training` (the
  checks that need the setup, the data files included), before any file is written -> the
  workdir's locks (`_locked`) -> `fitting.fit_memory` (the batch geometry whose compiled step
  fits the device; the run's config is rewritten to it) -> `_Run` (checkpointer, data
  iterator) -> restore from the latest checkpoint (state, data position, loss monitor;
  `resume.py`, `loss_monitor.py`) or jitted init -> `fitting.compile_for` that geometry
  (explicit in/out shardings, state donated; memory analysis logged) -> the metric writers
  (`run_outputs.RunOutputs`; a fresh start moves an earlier run's history aside,
  `workdir.rotate_history`) -> loop -> `_Run.on_exit` (last row, data rewind, final save) ->
  final evaluation.

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
from typing import Any, Callable, Sequence

import jax
import ml_collections

from attn_jax import paths, sharding as shd, storage
from attn_jax.config import RunConfig
from attn_jax.data import pipeline
from attn_jax.field_checks import is_number
from attn_jax.run_layout import RunLayout
from attn_jax.train import early_signals, fitting, init_from, preflight, resume, setup as setup_lib
from attn_jax.train.checkpoint import (SIGNAL_GRACE_S, Checkpointer, CheckpointStalledError,
                                       PreemptionGuard, check_writable)
from attn_jax.train.fitting import BatchGeometry
from attn_jax.train.loss_monitor import (LossMonitor, NonFiniteTrainingError, halt_message,
                                         halt_reason)
from attn_jax.train.profile import StepProfiler
from attn_jax.train.run_outputs import RunOutputs, write_failed
from attn_jax.train.setup import EvalCallback, Evaluator, Setup, make_heldout_batches
from attn_jax.train.workdir import lock_tensorboard, lock_workdir
from attn_jax.train.writers import WriteError


def train_and_evaluate(config: ml_collections.ConfigDict | RunConfig, workdir: str, *,
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
  Every check of the config and its data runs before the workdir is made or locked. `config`:
  a ConfigDict (validated here, once) or the typed `RunConfig` an entry point already made;
  everything below reads the typed one (`Setup.run`).
  """
  workdir = paths.name(workdir)   # absolute when local; a gs:// URI kept as it is (paths.py)
  storage.check(workdir, "--workdir")   # object storage without its package or network: one
                                        # line now, not after the set-up and a minute of retries
  # Signals are the run's from here on: a stop before the first step ends it cleanly, the lock
  # released (early_signals.py: at once where nothing is written, else at the next phase).
  early_signals.stopped_when(early_signals.BEFORE_TRAINING)
  with PreemptionGuard() as guard:
    guard.then = f"stopping {early_signals.BEFORE_TRAINING}"
    # A signal's backstop (entry points): past the save's grace, the lock release and the
    # writers' close, the process ends whatever it waits in (early_signals.end_after). The
    # grace as given (validated with the rest below; a bad one falls back to the default).
    grace = getattr(config.checkpoint, "signal_grace_s", SIGNAL_GRACE_S)
    guard.backstop_s = (grace if is_number(grace) and grace > 0 else SIGNAL_GRACE_S) + \
        BACKSTOP_MARGIN_S
    try:
      with early_signals.abandonable():   # every check, before any file is written
        setup = preflight.checked_setup(config)
      _stop_if_signalled(guard, 0)
      return _locked(setup.run, workdir, eval_callbacks, setup, guard)
    except StoppedBeforeTraining as e:
      logging.warning("%s: stopped %s", e.signal_name, early_signals.BEFORE_TRAINING)
      return {"preempted": e.signal_name, "step": e.step, "before_training": True,
              "workdir": workdir,
              "checkpoint_dir": paths.name(RunLayout.of(workdir).checkpoints)}
    finally:
      guard.disarm()   # ended by itself (its locks released): no backstop needed


def _locked(config: RunConfig, workdir: str, eval_callbacks, setup: "Setup",
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
      RunLayout.of(workdir).root.mkdir(parents=True, exist_ok=True)   # unusable
      locks.append(lock_tensorboard(workdir))   # tb/ reached by another run through a symlink
      check_writable(RunLayout.of(workdir).checkpoints)   # not at the first save
      return _train_and_evaluate(config, workdir, eval_callbacks, setup, guard)
    finally:
      release()
      locks.clear()


BACKSTOP_MARGIN_S = 10.0   # after checkpoint.signal_grace_s: the writers' close (5 s) and the
                          # lock release (object storage: 5 s)


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


def _train_and_evaluate(config: RunConfig, workdir, eval_callbacks, setup: Setup,
                        guard: PreemptionGuard) -> dict[str, Any]:
  resume.check_resumable(workdir, setup, config)   # a changed model config: stop before compiling
  preflight.say_data_source(config, int(setup.n_params["total"]))   # the run's first line (a
                                                  # refused run logs nothing before its error)
  with early_signals.abandonable():
    geo = fitting.fit_memory(setup, config)   # before any data is read: may shrink the micro-batch
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
    guard.then = "stopping at the end of this step after a checkpoint"
    run.open_outputs(eval_callbacks)          # metrics file, evaluator, progress bar
  except BaseException as e:   # e.g. the held-out batches cannot be built: nothing left open
    if run.out is not None:
      run.out.close_on_exit(e)
    run.ckpt.close()
    raise

  profiler = StepProfiler(config.train.profile_steps, workdir, start=run.start,
                          last=config.train.steps)
  run.out.writer.stop_when(lambda: guard.should_stop)   # a stalled writer never delays a signal
  run.ckpt.stop_when(guard)   # nor does a save: abandoned signal_grace_s after it (checkpoint.py)
  guard.backstop_line = lambda: (
      f"stopped by {guard.signal_name or 'a signal'}: the run did not end within "
      f"{guard.backstop_s:g} s of the signal; {run.ckpt.resume_point()}")
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
      run.out.writer.check()   # and so does a metrics writer that failed (writers.py)
      if run.preempted_at(guard, step):   # SIGTERM/SIGINT/SIGHUP: stop here (saved on exit)
        break
    run.flush()
    if run.preempted is None:
      run.check_progress()     # a run whose every step was skipped as non-finite is an error
  except WriteError as e:
    error = write_failed(e, run.ckpt)   # names the resume point
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

  def __init__(self, config: RunConfig, workdir: str, setup: Setup, geo: BatchGeometry):
    self.config, self.workdir, self.setup, self.geo = config, workdir, setup, geo
    c = config.checkpoint
    self.ckpt = Checkpointer(workdir, max_to_keep=c.max_to_keep,
                             allow_unverified=c.allow_unverified,
                             save_timeout_s=c.save_timeout_s, signal_grace_s=c.signal_grace_s)
    rows = shd.host_batch_rows(setup.batch_sharding, geo.shape, batch_dim=1)
    self.data_it = pipeline.make_train_iterator(config.data, seed=config.seed, host_rows=rows)
    self.monitor = LossMonitor(config.train.spike_window, config.train.spike_threshold)
    self.base_meta = {"config": config.to_json(), "n_params": setup.n_params}
    self.state: Any = None
    self.start = self.last_saved = 0
    self.pending = None      # (step, metrics) of the step dispatched before the current one
    self.state_valid = True  # False while `state` may be donated to a step that has not returned
    self.data_pos = None     # iterator position before this step's micro-batches, until dispatched
    self.diverged = False    # stopped for non-finite values: nothing more is saved
    self.logged = 0          # steps this run has logged (read by `check_progress`)
    self.last_loss = float("nan")
    self.preempted: str | None = None
    self.last_eval = -1
    self.out: RunOutputs | None = None
    self.evaluator = None

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
      resume.warn_config_changes(meta.get("config", {}), self.config.to_json(), self.start)
      logging.info("resumed from %s at step %d", self.ckpt.directory, self.start)
    if self.monitor.last_finite_step is None:
      self.monitor.last_finite_step = self.start
    self.state, self.last_saved = state, self.start

  def open_outputs(self, eval_callbacks: Sequence[EvalCallback]) -> None:
    """The metric writers (run_outputs.py), the evaluator, then the progress bar."""
    self.out = RunOutputs(self.config, self.workdir, self.setup, self.geo, self.ckpt.directory,
                          self.start)
    self.evaluator = Evaluator(self.setup, make_heldout_batches(self.config, self.setup),
                               eval_callbacks)
    self.out.show_progress(self.config, self.start)

  def train_step(self, compiled, step: int) -> None:
    """Dispatch `step` (its micro-batches pulled first), then log the step before it."""
    self.data_pos = self.data_it.get_state()
    batch = setup_lib.next_batch(self.data_it, self.geo.accum, self.setup.batch_sharding,
                                 self.geo.shape, self.setup.batch_keys)
    self.state_valid = False
    self.state, metrics = compiled(self.state, batch)
    self.state_valid, self.data_pos = True, None
    self.flush()
    self.pending = (step, metrics)
    self.out.stepped()

  def flush(self) -> None:
    """Log the pending step; NonFiniteTrainingError when it stops the run."""
    if self.pending is not None:
      self._log(*self.pending)
      self.pending = None

  def save(self, step: int) -> None:
    self.flush()
    self.out.writer.sync()    # no checkpoint newer than the rows every writer has taken
    self._checkpoint(step)

  def _checkpoint(self, step: int) -> None:
    self.ckpt.save(step, self.state, self.data_it,
                   dict(self.base_meta, monitor=self.monitor.state()), force=True)
    self.last_saved = step

  def evaluate(self, step: int) -> None:
    self.out.write(step, self.evaluator(self.state, step))
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
    halt = halt_reason(self.config, self.monitor) if nonfinite else None
    if nonfinite and halt is None:
      logging.warning("step %d: non-finite loss (%s), gradient or update; update skipped "
                      "(%d non-finite steps so far)", step, loss, self.monitor.nonfinite_steps)
    if spike:
      logging.warning("step %d: loss spike %.4f (above mean + %g std of the last %d losses; "
                      "%d spikes so far)", step, loss, self.monitor.threshold,
                      len(self.monitor.losses) - 1, self.monitor.loss_spikes)
    if step % t.log_every == 0 or step == t.steps or nonfinite or spike:
      self.out.step_row(step, m, spike, self.monitor)
    if halt is not None:
      self.diverged = True
      raise NonFiniteTrainingError(halt_message(self.ckpt, self.monitor, step, loss, halt))

  def check_progress(self) -> None:
    """At the normal end of the run: NonFiniteTrainingError when every step this run trained
    was skipped as non-finite (a run shorter than `nonfinite_max_consecutive` would otherwise
    end with status 0 and a model that never trained)."""
    streak, n = self.monitor.consecutive_nonfinite, self.logged
    if n == 0 or streak < n:
      return
    self.diverged = True
    step = self.start + n
    raise NonFiniteTrainingError(halt_message(self.ckpt, self.monitor, step, self.last_loss, (
        f"every one of the {n} steps this run trained (steps {self.start + 1}-{step}) was "
        f"non-finite and skipped, so it trained nothing (config.train.nonfinite_max_consecutive="
        f"{self.config.train.nonfinite_max_consecutive} halts longer streaks)")))

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
    if isinstance(error, CheckpointStalledError):
      pass   # its message names the resume point, known without asking the storage again
    elif wrote:   # a newer checkpoint than the rows logged would leave a hole in the history
      logging.error("not saving again after a failed write; the resume point is the latest "
                    "checkpoint in %s (step %s)", self.ckpt.directory, self.ckpt.resume_step())
    elif not self.state_valid:
      logging.error("not saving: the train step raised (%s) and its input state was donated "
                    "to it; the resume point is the latest checkpoint in %s (step %s)",
                    type(error).__name__ if error is not None else "?", self.ckpt.directory,
                    self.ckpt.resume_step())
    last = [("closing the checkpointer", self.ckpt.close)]
    if not (wrote or not self.state_valid or self.diverged):
      last.insert(0, ("the final checkpoint", self._final_save))
    stalled = None   # a save abandoned here (a stall, a signal's grace spent): the run's end,
    for what, fn in last:   # after the rest is closed
      try:
        attempt(what, fn)
      except CheckpointStalledError as e:
        stalled = stalled or e
    self.out.close_on_exit(error or stalled)
    if stalled is not None:
      raise stalled

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
        self.out.writer.sync()   # as before every save: the rows first
      except WriteError as e:
        raise write_failed(e, self.ckpt)
      self._checkpoint(step)

  def result(self) -> dict[str, Any]:
    """The final metrics: after a final evaluation, or as they stand when preempted."""
    step = int(self.state["step"])
    if self.preempted is not None:
      self.out.close()
      return dict(self.out.last, workdir=self.workdir, checkpoint_dir=self.ckpt.directory,
                  preempted=self.preempted, step=step)
    if self.last_eval != step:
      self.evaluate(step)
    self.out.close()
    return dict(self.out.last, workdir=self.workdir, checkpoint_dir=self.ckpt.directory)


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
