"""SIGTERM / SIGINT / SIGHUP from a training process's first second, not only from its first step.

`experiments/train.py` calls `install()` before JAX starts. Until then, and outside the
trainer's `PreemptionGuard` (which the trainer enters as soon as `train_and_evaluate` is
called, before the config is checked), a signal took its default action: SIGTERM killed the
process silently, with its workdir lock left behind, and a Ctrl-C during a compile waited for
the compile to end.

  * Outside any `PreemptionGuard` (flag parsing, JAX's start; after the training loop and its
    final save: the final evaluation) a signal ends the process at once, cleanly: the
    registered clean-ups (`on_abandon`: the workdir and TensorBoard locks released), the
    one-line stop message on stdout (`stopped_line`) and the exit status of the signal (128 +
    its number).
  * Inside a guard, the guard's handler takes the signal (the training loop polls it at step
    boundaries; the trainer checks it between its set-up phases, `trainer.py`), except in an
    `abandonable()` section (building the model, compiling: nothing written yet, nothing to
    save), where the process also ends at once as above.
  * "At once" includes a main thread inside a long C++ call (an XLA compile, minutes for a
    large model), where no Python signal handler runs until the call returns: the C-level
    handler writes the signal's number to `signal.set_wakeup_fd`, and a watcher thread woken by
    it does the ending. A lock held while it does so keeps the main thread from leaving an
    abandonable section (and writing anything) meanwhile.
  * SIGINT and SIGHUP that the parent ignored (`nohup`, a background job `cmd &`) stay ignored,
    as in `PreemptionGuard`.

Without `install()` (a notebook, the tests calling the library) none of this runs: the guard
alone records the signal and the trainer stops at its next phase boundary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KEEP_IGNORED = (signal.SIGINT, signal.SIGHUP)
BEFORE_TRAINING = "before training started (nothing to save)"
AFTER_TRAINING = "after its training steps (their checkpoints are saved)"


class StoppedBySignal(Exception):
  """A run that a signal ended where no step boundary came (e.g. during a save that did not
  end within the grace after the signal, train/checkpoint.py). Entry points print its message
  as it is, without `error:`, and exit 128 + the signal (attn_jax/cli.py)."""

  signal_name: str = "SIGTERM"

  @property
  def exit_status(self) -> int:
    try:
      return 128 + int(signal.Signals[str(self.signal_name)])
    except KeyError:
      return 128 + int(signal.SIGTERM)


class _State:
  def __init__(self):
    self.installed = False
    self.guards = 0                  # PreemptionGuards active: they take the signals
    self.sections: list[str] = []    # the abandonable sections entered (what each stops)
    self.cleanups: list[Callable[[], None]] = []
    self.when = BEFORE_TRAINING      # what a stop outside the sections means (`stopped_when`)
    self.lock = threading.RLock()    # held from the decision to end until the process ends


_state = _State()


def stopped_line(name: str, when: str = BEFORE_TRAINING) -> str:
  """The one line a run stopped by a signal prints (experiments/train.py prints it too)."""
  return f"stopped by {name} {when}; rerun the same command to resume"


def install() -> bool:
  """The handlers and the watcher (main thread only; idempotent). Returns whether installed."""
  if _state.installed:
    return True
  if threading.current_thread() is not threading.main_thread():
    return False
  for sig in SIGNALS:
    if sig in KEEP_IGNORED and signal.getsignal(sig) is signal.SIG_IGN:
      continue   # nohup / a background job: the parent asked for these to be ignored
    signal.signal(sig, _handle)
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  threading.Thread(target=_watch, args=(read_fd,), name="attn_jax-signals", daemon=True).start()
  _state.installed = True
  return True


def stopped_when(when: str) -> None:
  """What a stop outside any abandonable section means from now on (its stop message); the
  trainer says AFTER_TRAINING once its loop and final save are done."""
  with _state.lock:
    _state.when = when


def guard_entered() -> None:
  with _state.lock:
    _state.guards += 1


def guard_exited() -> None:
  with _state.lock:
    _state.guards = max(0, _state.guards - 1)


@contextlib.contextmanager
def abandonable(when: str = BEFORE_TRAINING) -> Iterator[None]:
  """A section that a signal may end at once (nothing written in it, nothing to save); `when`
  completes the stop message."""
  with _state.lock:
    _state.sections.append(when)
  try:
    yield
  finally:
    with _state.lock:   # waits, never to return, if the watcher is ending the process
      _state.sections.pop()


@contextlib.contextmanager
def on_abandon(cleanup: Callable[[], None]) -> Iterator[None]:
  """`cleanup()` runs before the process ends on a signal inside this block."""
  with _state.lock:
    _state.cleanups.append(cleanup)
  try:
    yield
  finally:
    with _state.lock:
      _state.cleanups.remove(cleanup)


def _abandonable() -> bool:
  return _state.guards == 0 or bool(_state.sections)


def _handle(signum, frame) -> None:
  """The Python-level handler outside a guard (a guard's handler replaces it inside one)."""
  del frame
  _end_if_abandonable(signum)


def _watch(read_fd: int) -> None:
  ours = {int(s) for s in SIGNALS}
  while True:
    try:
      data = os.read(read_fd, 64)
    except OSError:
      return
    if not data:
      return
    for signum in data:
      if signum in ours:
        _end_if_abandonable(signum)


def _end_if_abandonable(signum: int) -> None:
  _state.lock.acquire()
  if not _abandonable():
    _state.lock.release()
    return
  # From here the lock is never released: the process ends.
  when = _state.sections[-1] if _state.sections else _state.when
  for cleanup in reversed(_state.cleanups):
    try:
      cleanup()
    except Exception:  # noqa: BLE001 - ending anyway; the kernel drops the locks
      pass
  _write_line(stopped_line(signal.Signals(signum).name, when))
  os._exit(128 + int(signum))


def end_after(seconds: float, signum: int, line: Callable[[], str]) -> threading.Timer | None:
  """The backstop of a stop signal inside a guard (entry points only: None without `install`):
  a daemon timer that, unless cancelled, ends the process `seconds` from now as a signal
  outside a guard does (the `on_abandon` clean-ups, then `line()` and exit 128 + `signum`),
  whatever the main thread is blocked in (a library call that waits without an end). The
  trainer arms it past the bounded waits it should never be needed behind."""
  if not _state.installed:
    return None

  def fire():
    _state.lock.acquire(timeout=1.0)   # the watcher may be ending the process already
    for cleanup in reversed(list(_state.cleanups)):
      try:
        cleanup()
      except Exception:  # noqa: BLE001 - ending anyway
        pass
    try:
      text = line()
    except Exception:  # noqa: BLE001
      text = stopped_line(signal.Signals(signum).name, "(the run did not end in time)")
    _write_line(text)
    os._exit(128 + int(signum))

  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.name = "attn_jax-signal-backstop"
  timer.start()
  return timer


def _flush() -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass


def _write_line(line: str) -> None:
  """`line` on stdout after what is buffered there. From the watcher thread the flush is given
  a second (the main thread may hold the stream's lock, blocked in a write) and the line goes
  to the file descriptor itself, so that the process ends whatever the main thread holds."""
  if threading.current_thread() is threading.main_thread():
    _flush()
    print(line, flush=True)
    return
  flusher = threading.Thread(target=_flush, daemon=True)
  flusher.start()
  flusher.join(1.0)
  try:
    os.write(sys.__stdout__.fileno(), (line + "\n").encode())
  except (OSError, ValueError, AttributeError):
    pass
