"""Checks for mixer `Options.validate` (and other typed options): one error format, naming the
config field, and the number tests every option needs (a bool is an int in Python, so an
integer option must reject True / False explicitly)."""

from __future__ import annotations

import math


def is_int(v, lo: int | None = None) -> bool:
  """An integer (not a bool), at least `lo`."""
  return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)


def is_number(v, lo: float | None = None) -> bool:
  """A finite real number (not a bool), at least `lo`."""
  return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (lo is None or v >= lo))


def field_check(where: str):
  """need(cond, field, msg): raise ValueError("<where>.<field>: <msg>") unless cond."""
  def need(cond: bool, field: str, msg: str) -> None:
    if not cond:
      raise ValueError(f"{where}.{field}: {msg}")
  return need
