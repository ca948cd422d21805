"""What a signal test needs to be independent of the process that started pytest.

A test of what a signal does sets up the disposition it tests: a shell starts a background job
(`cmd &`) with SIGINT ignored, `nohup` ignores SIGHUP, and `PreemptionGuard` keeps an inherited
SIG_IGN on purpose, so a test that assumes the terminal's dispositions fails there. `handled`
installs them for the test and puts back whatever was there.

A signal sent to the process (`os.kill(os.getpid(), sig)`) may be taken by any thread that does
not block it, and JAX runs many; the Python handler then runs in the main thread at some later
bytecode, so the next line may not see its effect yet. `deliver` sends the signal to the main
thread itself (`pthread_kill`): the kernel delivers it before `pthread_kill` returns, and CPython
runs the handler before returning to the caller; from another thread it waits for the handler's
effect with a bound.
"""

import contextlib
import signal
import threading
import time

# A terminal's dispositions: Ctrl-C raises KeyboardInterrupt, the others end the process.
TERMINAL = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
            signal.SIGHUP: signal.SIG_DFL}


@contextlib.contextmanager
def handled(*signums: int, handler=None):
  """`signums` with `handler` (default: the terminal's disposition) inside; restored after."""
  previous = {s: signal.signal(s, TERMINAL[s] if handler is None else handler) for s in signums}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def deliver(signum: int, until=None, timeout: float = 30.0) -> None:
  """Sends `signum` to the main thread; with `until` (a callable), waits at most `timeout`
  seconds for it to become true (the handler's effect) and fails the test if it does not."""
  signal.pthread_kill(threading.main_thread().ident, signum)
  if until is None:
    return
  deadline = time.monotonic() + timeout
  while not until():
    if time.monotonic() > deadline:
      raise AssertionError(f"{signal.Signals(signum).name} delivered, but its handler's effect "
                           f"was not seen within {timeout:.0f} s")
    time.sleep(0.001)


def killed_run_config(steps: int, checkpoint_every: int) -> str:
  """The text of a config file for a tiny run that a test starts in a subprocess and kills:
  quickstart's MQAR at d_model 32, a row per step, a checkpoint every `checkpoint_every`."""
  return f"""
from configs import quickstart
def get_config():
  c = quickstart.get_config()
  c.model.update(d_model=32, n_heads=2, d_ff=64, n_layers=2, pattern=())
  c.data.update(seq_len=32, global_batch_size=8, mqar_num_pairs=4, mqar_num_queries=4)
  c.train.update(steps={steps}, log_every=1, progress_bar=False)
  c.checkpoint.every_steps = {checkpoint_every}
  c.eval.every_steps = 0
  c.optim.warmup_steps = 2
  return c
"""
