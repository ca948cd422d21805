"""A call that may block on storage, given an end: `call(fn, seconds, what)`.

Some calls cannot be given a timeout of their own: an epath / fsspec call on object storage
whose server stopped answering (a stalled bucket, a network gone mid-request) waits inside
fsspec's `sync()`, which has no deadline unless the caller passes one, and epath passes none.
A run that must end within a scheduler's grace period (releasing its lock, naming its resume
point) cannot wait there. `call` runs `fn` in a daemon thread and waits at most `seconds` for
it; on time out it raises `TimeoutError` naming `what`, and the thread is left behind (a daemon:
it never keeps the process alive, and the process is about to end in every caller).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def call(fn: Callable[[], T], seconds: float, what: str) -> T:
  """`fn()`, or TimeoutError when it has not returned within `seconds`; its exception is
  re-raised here."""
  out: dict = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      out["error"] = e

  worker = threading.Thread(target=run, name=f"attn_jax bounded: {what}"[:60], daemon=True)
  worker.start()
  worker.join(seconds)
  if worker.is_alive():
    raise TimeoutError(f"{what} did not finish within {seconds:g} s")
  if "error" in out:
    raise out["error"]
  return out["value"]
