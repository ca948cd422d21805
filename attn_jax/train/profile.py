"""A jax.profiler trace of chosen training steps (`config.train.profile_steps`, e.g. "20:25").

The trace starts just before step `first` is dispatched and stops once step `stop - 1` has
finished on the device (the loop dispatches a step before the host waits for the previous one,
so stopping waits for the state that step returns): steps first to stop - 1, compile and
start-up excluded when `first` is past them. Written to `<workdir>/profile/plugins/profile/
<time>/`: `<host>.xplane.pb` (TensorBoard's profile plugin: `tensorboard --logdir
<workdir>/profile`) and `perfetto_trace.json.gz` (open in ui.perfetto.dev), one per process
on every backend (CPU, GPU, TPU); docs/guide.md says how to read them.

A run that ends (or stops on a signal or an error) inside the window stops the trace on its
way out, so the steps it ran are kept; a run resumed inside the window traces the rest of it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import jax

from attn_jax import paths
from attn_jax.config import profile_steps, profile_window_problem
from attn_jax.run_layout import RunLayout

class StepProfiler:
  """`before(step, state)` at the top of every step; `stop()` on the way out."""

  def __init__(self, spec: str, workdir: str, *, start: int = 0, last: int | None = None):
    """`start`: the step the run resumes from (0: a fresh run); `last`: its last step. A
    window that a resumed run has passed already is said at start (`profile_window_problem`;
    config.validate says the rest)."""
    self.window = profile_steps(spec)
    self.directory = paths.name(RunLayout.of(workdir).profile)
    self._local: str | None = None   # where the profiler writes before an upload
    self.active = self.done = False
    if start and last is not None:   # a fresh run's window was checked by config.validate
      problem = profile_window_problem(spec, last, start=start)
      if problem and problem != profile_window_problem(spec, last):
        logging.warning("%s", problem)

  def before(self, step: int, state) -> None:
    """Starts the trace at the window's first step (or the first step of a run resumed inside
    it); ends it at its stop step, once `state` (the last traced step's output) is ready."""
    if self.window is None or self.done:
      return
    first, stop = self.window
    if not self.active and first <= step < stop:
      # The profiler writes local files only: on object storage it traces into a temporary
      # folder that `stop` uploads into the workdir and deletes.
      self._local = None if paths.is_local(self.directory) else tempfile.mkdtemp(
          prefix="attn_jax_profile")
      jax.profiler.start_trace(self._local or self.directory, create_perfetto_trace=True)
      self.active = True
      logging.info("profiling steps %d to %d into %s", step, stop - 1, self.directory)
    elif self.active and step >= stop:
      self.stop(state)

  def stop(self, state=None) -> None:
    """Ends the trace (once the device has finished `state`, when given)."""
    if not self.active:
      return
    self.active, self.done = False, True
    try:
      if state is not None:
        jax.block_until_ready(state)
    finally:
      jax.profiler.stop_trace()
      if self._local is not None:
        _upload(self._local, self.directory)
        shutil.rmtree(self._local, ignore_errors=True)
        self._local = None
      logging.info("profile written to %s", self.directory)


def _upload(local: str, target: str) -> None:
  """Copies the files under `local` to the same names under `target` (object storage)."""
  for root, _, names in os.walk(local):
    for n in names:
      src = os.path.join(root, n)
      dst = paths.run_path(target) / os.path.relpath(src, local)
      dst.parent.mkdir(parents=True, exist_ok=True)
      dst.write_bytes(open(src, "rb").read())
