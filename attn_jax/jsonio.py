"""JSON files that a crash never leaves half-written: `write` dumps to a temporary file beside
the target and renames it over the target (atomic on POSIX), so a reader sees the old file or
the new one, never a torn one. Studies, the hardware page and data indexes resume from these
files, so a torn write would lose work."""

from __future__ import annotations

import json
import os
from typing import Any


def read(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def write(obj: Any, path: str, *, indent: int | None = 1, sort_keys: bool = False) -> None:
  """json.dump(obj) to `path` atomically (indented for reading by default). The temporary name
  carries the pid, so two processes writing one path never share it."""
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=indent, sort_keys=sort_keys)
  os.replace(tmp, path)


def flatten(tree: dict, sep: str, prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": x}} -> {"a<sep>b": x}: a nested dict (a config's JSON form, a parameter
  tree) keyed by its paths."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
    else:
      out[f"{prefix}{k}"] = v
  return out
