"""Where a published number came from: the commit of the code that computed it, and the
machine it ran on.

Pages generated from measurements (docs/hardware.md, docs/studies.md, the fine-tuning study)
name the commit they were produced at, so a reader can tell whether a figure predates a change.
`machine_info` is the one place a report reads the backend it ran on (kernel choices read the
target platform through `kernel_choice`, which may differ: compile-only runs trace on a CPU).
"""

from __future__ import annotations

import os
import platform
import subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ("attn_jax", "configs", "experiments")   # what computes a number (docs/ does not)


def source_commit() -> str:
  """The short commit of the checkout attn_jax is imported from, "+modified" when its tracked
  code (`CODE`) differs from it; "unknown" outside a git checkout (an installed wheel)."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
  try:
    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
  except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
    return "unknown"
  return commit + ("+modified" if dirty else "")


def machine_info() -> dict:
  """The commit, Python, JAX and the devices this process runs on (study records, benchmark
  headers): `backend` is JAX's default backend ("cpu", "gpu", "tpu")."""
  import jax   # the commit alone is asked for without importing JAX (docs generators)
  dev = jax.devices()
  return {"commit": source_commit(), "platform": platform.platform(),
          "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(), "devices": len(dev),
          "device_kind": dev[0].device_kind, "cpu_count": os.cpu_count(),
          "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else None}
