"""Object storage that cannot be used, said in one line before anything waits on it.

A `gs://` path goes through gcsfs (epath's backend for the small files) and tensorstore (the
arrays). When the storage cannot be reached, gcsfs retries each request six times with
exponential back-off (about half a minute per request, each failure logged with a traceback)
and looks for credentials on the GCE metadata server first, so a run without network used to
print ~60 lines over ~50 s before its error; a missing gcsfs was a traceback from inside fsspec
in the entry points that read a run. `check(path, what)` says either in one line at once:

  * the scheme's fsspec implementation must import (`require_backend`: gcsfs for `gs://`,
    the project's `gcs` extra);
  * the storage's endpoint must accept a TCP connection within `CONNECT_S` (`check_reachable`:
    the address gcsfs itself would use: `STORAGE_EMULATOR_HOST`, fsspec's `gs.endpoint_url`,
    else storage.googleapis.com:443). That is the network, not the credentials or the bucket:
    those are the first real request's to judge, and its error names them.

A local path passes both. `StorageError` is an OSError raised by the project, so the entry
points print it as their one `error:` line with exit status 2 (attn_jax/cli.py).

Storage that stops answering. gcsfs sends its requests without a timeout (it passes
`requests_timeout=None` to aiohttp, which turns off aiohttp's own) and fsspec's `sync()` waits
for them without one, so a request that a server accepts and never answers waits for good, and
so does whatever waits on it: orbax's commit of a save (its manifest is listed and written
through gcsfs), and the run's close waiting for that commit. That is how a `gs://` run hung at its
end (reproduced with a fake-gcs-server whose log went to a pipe nobody read: it
stops answering once the pipe is full). The run's own waits end it instead
(train/checkpoint.py, "No wait without an end"; workdir.ObjectLock.release within 5 s).

fsspec's IO loop (`keep_io_loop_awake`). Every gcsfs call from a thread runs on one asyncio
loop in fsspec's "fsspecIO" thread, through `fsspec.asyn.sync`, which waits without a deadline.
An asyncio loop only wakes from its `select` for I/O, a due timer, or a callback handed over
with `call_soon_threadsafe`; a callback added with plain `call_soon` from another thread lies in
its queue unseen until something else wakes it. gcsfs does that: the finalizer of a
GCSFileSystem (`close_session`, run by the garbage collector in whichever thread triggers it)
calls `loop.create_task(session.close())` on the IO loop from that thread (seen in a run with
`BaseEventLoop.call_soon` wrapped to log callers from foreign threads); aiohttp's response
finalizers can likewise complete futures of that loop from the collecting thread. Work queued
that way waits for the next wake-up, and a thread in `sync()` waiting on it waits with it, for
good when no other request wakes the loop. A timer that re-arms itself every `HEARTBEAT_S`
bounds that: the loop never sleeps longer, so such a callback runs within that time.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

from attn_jax import bounded, paths

CONNECT_S = 5.0   # a storage endpoint that accepts no connection in this time is unreachable
HEARTBEAT_S = 0.5   # the longest fsspec's IO loop sleeps (`keep_io_loop_awake`)
_awake: set[int] = set()   # id() of the IO loops given a heartbeat

# The package that gives each scheme its fsspec file system (what to install).
BACKENDS = {"gs": ("gcsfs", "pip install 'attn_jax[gcs]' (or pip install gcsfs)"),
            "gcs": ("gcsfs", "pip install 'attn_jax[gcs]' (or pip install gcsfs)"),
            "s3": ("s3fs", "pip install s3fs")}


class StorageError(OSError):
  """Object storage that cannot be used (no backend package, no network)."""


def scheme(path: paths.PathLike) -> str:
  return os.fspath(path).split("://", 1)[0].lower() if paths.is_uri(path) else ""


def require_backend(path: paths.PathLike, what: str) -> None:
  """StorageError when the package serving `path`'s scheme is not installed."""
  package, install = BACKENDS.get(scheme(path), (None, ""))
  if package is None:
    return
  try:
    __import__(package)
  except ImportError as e:
    raise StorageError(f"{what} {paths.name(path)} is on object storage, which needs the "
                       f"{package} package ({type(e).__name__}: {e}): {install}") from None


def endpoint(path: paths.PathLike) -> tuple[str, int] | None:
  """(host, port) that requests for `path` go to, or None when not known (local, a scheme
  other than gs://)."""
  if scheme(path) not in ("gs", "gcs"):
    return None
  import fsspec.config
  url = (fsspec.config.conf.get("gs", {}).get("endpoint_url")
         or fsspec.config.conf.get("gcs", {}).get("endpoint_url"))
  if not url:
    try:
      from gcsfs.core import _location   # STORAGE_EMULATOR_HOST, else the public endpoint
      url = _location()
    except (ImportError, AttributeError):
      url = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
  if "://" not in url:
    url = "http://" + url
  parsed = urllib.parse.urlsplit(url)
  if not parsed.hostname:
    return None
  return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def check_reachable(path: paths.PathLike, what: str, seconds: float = CONNECT_S) -> None:
  """StorageError when `path`'s storage endpoint accepts no TCP connection within `seconds`
  (its name does not resolve, nothing answers, the connection is refused)."""
  where = endpoint(path)
  if where is None:
    return
  host, port = where
  try:   # bounded as a whole: the name lookup has no timeout of its own (a DNS server that
    bounded.call(lambda: socket.create_connection((host, port), timeout=seconds).close(),
                 seconds, f"connecting to {host}:{port}")   # does not answer)
  except OSError as e:
    why = (f"no answer within {seconds:g} s" if isinstance(e, TimeoutError)
           else f"{type(e).__name__}: {e.strerror or e}")
    raise StorageError(f"{what} {paths.name(path)} cannot be reached: its storage endpoint "
                       f"{host}:{port} accepts no connection ({why}); check the network (or "
                       "STORAGE_EMULATOR_HOST)") from None


def keep_io_loop_awake() -> None:
  """A timer on fsspec's IO loop that re-arms itself every `HEARTBEAT_S` (idempotent per loop;
  see the module docstring)."""
  import fsspec.asyn
  loop = fsspec.asyn.get_loop()
  if id(loop) in _awake:
    return
  _awake.add(id(loop))

  def beat():
    if not loop.is_closed():
      loop.call_later(HEARTBEAT_S, beat)

  loop.call_soon_threadsafe(beat)


def check(path: paths.PathLike, what: str) -> None:
  """`require_backend` and `check_reachable`, then `keep_io_loop_awake`: nothing for a local
  path."""
  if paths.is_local(path):
    return
  require_backend(path, what)
  check_reachable(path, what)
  keep_io_loop_awake()


def describe(e: BaseException, limit: int = 300) -> str:
  """A storage call's exception in one line (its type and first `limit` characters)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"
