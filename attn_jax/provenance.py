"""Where a published number came from: the commit of the code that computed it.

Pages generated from measurements (docs/hardware.md, docs/studies.md, the fine-tuning study)
name the commit they were produced at, so a reader can tell whether a figure predates a change.
"""

from __future__ import annotations

import os
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
