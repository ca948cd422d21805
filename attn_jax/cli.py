"""One way for every entry point (experiments/*.py) to fail: a single line, then exit.

    if __name__ == "__main__":
      cli.run(main)                      # instead of absl.app.run(main)

A mistake of the user's (a bad config field, a missing or unreadable file, a bad data line, a
busy workdir, an unusable checkpoint, a full disk) ends in one line on stderr,
`error: <message naming the field / file / line>`, and exit status 2 (3 for a run that diverged
or does not fit in memory), not a 30-line traceback whose last line is the message. A run that a
signal stopped where no step boundary came (`early_signals.StoppedBySignal`: a save abandoned
after the signal's grace) prints its message as it is and exits 128 + the signal. `--debug`
(or ATTN_JAX_DEBUG=1) re-raises instead, with the traceback.

Which errors count as the user's (the rule, not a list of messages):
  * the project's own exception types (config, data, checkpoint, workdir, output-folder
    errors), wherever they are raised;
  * ValueError / OSError / ImportError raised by the project's own code (the innermost frame of
    the traceback is in attn_jax/, experiments/ or configs/), which is where every check with a
    message naming the field or file lives; a ValueError from deep inside JAX or a library is a
    bug to report, and keeps its traceback.

Leaving: after the message the process ends at once (`os._exit`, once stdout, stderr and the log
handlers are flushed). A normal interpreter exit would run orbax's finalizers and wait for its
background threads (an asynchronous save that already failed on a full disk keeps writing),
which keeps the process alive for a long time and prints unrelated "cannot schedule new futures
after shutdown" / "Event loop is closed" tracebacks under the one line that matters.

Library noise (`quiet_libraries`, installed by `guarded` unless --debug): the INFO records of
orbax, grain, etils, tensorstore, fsspec, gcsfs and JAX's internals are dropped, and so is
everything orbax and gcsfs log below CRITICAL (gcsfs logs each retry of an object-storage
request with its traceback; the failure reaches the user as the project's error naming the
path). Every orbax failure reaches the user through the project's own exception raised from it (CheckpointSaveError, CheckpointError: the step, the cause, what was kept),
while orbax's background threads log that same failure three or four times with tracebacks
(a full disk: ~400 lines before the one that says so). Likewise tensorstore reporting the end
of a read into an orbax event loop that has already closed (a restore that stopped part-way)
goes through `sys.unraisablehook` as "RuntimeError: Event loop is closed" tracebacks, and the
read coroutines of such a restore report their error again when they are collected, and
asyncio logs the tasks around its tensorstore reads as "Task exception was never retrieved":
those are dropped, every other unraisable exception and asyncio report is shown as before.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from absl import app, flags

from attn_jax import native_logs
from attn_jax.train.early_signals import StoppedBySignal

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
  from attn_jax.data.doc_reader import DataError
  from attn_jax.outputs import OutputError
  from attn_jax.storage import StorageError
  from attn_jax.train.checkpoint import CheckpointError, CheckpointSaveError
  from attn_jax.train.workdir import WorkdirLockedError
  return (ConfigFieldError, DataError, CheckpointError, CheckpointSaveError,
          WorkdirLockedError, OutputError, StorageError)


def _innermost_file(e: BaseException) -> str | None:
  tb, last = e.__traceback__, None
  while tb is not None:
    last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
  return None if last is None else os.path.abspath(last)


def _raised_in_project(e: BaseException) -> bool:
  last = _innermost_file(e)
  return last is not None and last.startswith(_PROJECT_DIRS)


def _missing_storage_backend(e: BaseException) -> bool:
  """fsspec's "Please install gcsfs to access Google Storage" (a `gs://` path without the
  package): an ImportError raised by fsspec's registry, wherever the path was first used."""
  last = _innermost_file(e) or ""
  return isinstance(e, ImportError) and last.replace(os.sep, "/").endswith("fsspec/registry.py")


def exit_status(e: BaseException) -> int | None:
  """The exit status for a user-facing error, or None for a bug (show the traceback)."""
  if isinstance(e, StoppedBySignal):
    return e.exit_status   # 128 + the signal: the run was stopped, its message says where
  if isinstance(e, (MemoryError, FloatingPointError)) and _raised_in_project(e):
    return DIVERGED   # does not fit / diverged: one paragraph naming the knobs
  if isinstance(e, _project_types()):
    return USER_ERROR
  if isinstance(e, (ValueError, OSError, ImportError)) and _raised_in_project(e):
    return USER_ERROR
  if _missing_storage_backend(e):
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


_LIBRARIES = ("orbax", "grain", "jax/_src", "etils", "tensorstore", "fsspec", "gcsfs")
# Libraries whose records below CRITICAL are dropped: each failure of theirs reaches the user as
# the project's own exception raised from it (orbax: every save and restore; gcsfs: every
# object-storage call, whose retries log a traceback per attempt, ~60 lines for no network).
_SILENCED = ("/orbax/", "/gcsfs/")


class QuietLibraries(logging.Filter):
  """Drops the libraries' INFO records and orbax's records below CRITICAL (see the docstring);
  the project's records and every other warning pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    if _tensorstore_task_report(record):
      return False
    path = record.pathname.replace(os.sep, "/")
    if any(name in path for name in _SILENCED):
      return record.levelno >= logging.CRITICAL
    return record.levelno >= logging.WARNING or not any(n in path for n in _LIBRARIES)


def _tensorstore_task_report(record: logging.LogRecord) -> bool:
  """asyncio's report of a collected task whose tensorstore read failed (a restore that stopped
  part-way; the project has reported that failure, naming the step)."""
  e = record.exc_info[1] if record.exc_info else None
  return record.name == "asyncio" and e is not None and "tensorstore_spec" in str(e)


def _orbax_leftover(unraisable) -> bool:
  """What a restore that stopped part-way leaves behind: tensorstore's completion callback
  finding an orbax event loop already closed, or one of orbax's read coroutines collected with
  its read error (the error the project has already reported, naming the step)."""
  e, obj = unraisable.exc_value, unraisable.object
  if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
    return True
  code = getattr(obj, "cr_code", None)
  return code is not None and "/orbax/" in code.co_filename.replace(os.sep, "/")


def quiet_libraries() -> None:
  """Installs `QuietLibraries` on the log handlers (absl's included) and the unraisable-hook
  filter; idempotent."""
  from absl import logging as absl_logging
  handlers = list(logging.getLogger().handlers)
  absl = absl_logging.get_absl_handler()
  if absl not in handlers:
    handlers.append(absl)
  for h in handlers:
    if not any(isinstance(f, QuietLibraries) for f in h.filters):
      h.addFilter(QuietLibraries())
  previous = sys.unraisablehook
  if getattr(previous, "_attn_jax_quiet", False):
    return

  def hook(unraisable):
    if not _orbax_leftover(unraisable):
      previous(unraisable)

  hook._attn_jax_quiet = True
  sys.unraisablehook = hook


def guarded(main: Callable) -> Callable:
  """`main` with the project's errors turned into one line and an exit status, and the
  libraries' log noise dropped (`quiet_libraries`) unless --debug."""

  def wrapped(argv):
    if not debug_requested():
      quiet_libraries()
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
      print(one_line(e) if status < 128 else " ".join(str(e).split()), file=sys.stderr)
      leave(status)

  return wrapped


def run(main: Callable, **kwargs) -> None:
  """`absl.app.run(main, **kwargs)` with `guarded` error handling; a bad flag value is one line
  and exit status 2 too (`config_flags.parse_flags`, unless `flags_parser` is given)."""
  if "flags_parser" not in kwargs:
    from attn_jax.config_flags import parse_flags  # cli stays light: entry points import it first
    kwargs["flags_parser"] = parse_flags
  app.run(guarded(main), **kwargs)


# Entry points import this module before anything that imports JAX: JAX and its plugins start
# here, their native start-up lines filtered (`native_logs`), unless ATTN_JAX_DEBUG is set.
if os.environ.get(DEBUG_ENV, "").strip().lower() in ("", "0", "false", "no"):
  native_logs.start_jax_quietly()
