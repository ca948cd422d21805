"""One way for every entry point (experiments/*.py) to fail: a single line, then exit.

    if __name__ == "__main__":
      cli.run(main)                      # instead of absl.app.run(main)

A mistake of the user's (a bad config field, a missing or unreadable file, a bad data line, a
busy workdir, an unusable checkpoint, a full disk) ends in one line on stderr,
`error: <message naming the field / file / line>`, and exit status 2 (3 for a run that diverged
or does not fit in memory), not a 30-line traceback whose last line is the message. `--debug`
(or ATTN_JAX_DEBUG=1) re-raises instead, with the traceback.

Which errors count as the user's (the rule, not a list of messages):
  * the project's own exception types (config, data, checkpoint, workdir errors), wherever they
    are raised;
  * ValueError / OSError / ImportError raised by the project's own code (the innermost frame of
    the traceback is in attn_jax/, experiments/ or configs/), which is where every check with a
    message naming the field or file lives; a ValueError from deep inside JAX or a library is a
    bug to report, and keeps its traceback.

Leaving: after the message the process ends at once (`os._exit`, once stdout, stderr and the log
handlers are flushed). A normal interpreter exit would run orbax's finalizers and wait for its
background threads (an asynchronous save that already failed on a full disk keeps writing),
which keeps the process alive for a long time and prints unrelated "cannot schedule new futures
after shutdown" / "Event loop is closed" tracebacks under the one line that matters.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from absl import app, flags

DEBUG_ENV = "ATTN_JAX_DEBUG"
USER_ERROR, DIVERGED = 2, 3

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("attn_jax", "experiments",
                                                                  "configs"))

if "debug" not in flags.FLAGS:
  flags.DEFINE_bool("debug", False, f"Show the traceback of an error (also: {DEBUG_ENV}=1).")


def _project_types() -> tuple[type, ...]:
  """The project's own error types (imported lazily: the entry points start fast)."""
  from attn_jax.config_flags import ConfigFieldError
  from attn_jax.data.shards import DataError
  from attn_jax.train.checkpoint import CheckpointError, CheckpointSaveError
  from attn_jax.train.workdir import WorkdirLockedError
  return (ConfigFieldError, DataError, CheckpointError, CheckpointSaveError,
          WorkdirLockedError)


def _raised_in_project(e: BaseException) -> bool:
  tb, last = e.__traceback__, None
  while tb is not None:
    last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
  return last is not None and os.path.abspath(last).startswith(_PROJECT_DIRS)


def exit_status(e: BaseException) -> int | None:
  """The exit status for a user-facing error, or None for a bug (show the traceback)."""
  if isinstance(e, (MemoryError, FloatingPointError)) and _raised_in_project(e):
    return DIVERGED   # does not fit / diverged: one paragraph naming the knobs
  if isinstance(e, _project_types()):
    return USER_ERROR
  if isinstance(e, (ValueError, OSError, ImportError)) and _raised_in_project(e):
    return USER_ERROR
  return None


def debug_requested() -> bool:
  env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
  return env or (flags.FLAGS.is_parsed() and flags.FLAGS.debug)


def one_line(e: BaseException) -> str:
  return "error: " + " ".join(str(e).split()) + f" (--debug or {DEBUG_ENV}=1: traceback)"


def leave(status: int) -> None:
  """Exit with `status` now, without the interpreter's exit-time work (see the docstring)."""
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)


def guarded(main: Callable) -> Callable:
  """`main` with the project's errors turned into one line and an exit status."""

  def wrapped(argv):
    try:
      return main(argv)
    except KeyboardInterrupt:
      if debug_requested():
        raise
      print("interrupted", file=sys.stderr)
      leave(130)
    except Exception as e:  # noqa: BLE001 - sorted by `exit_status`
      status = exit_status(e)
      if status is None or debug_requested():
        raise
      print(one_line(e), file=sys.stderr)
      leave(status)

  return wrapped


def run(main: Callable, **kwargs) -> None:
  """`absl.app.run(main, **kwargs)` with `guarded` error handling."""
  app.run(guarded(main), **kwargs)
