"""Markdown helpers shared by the study reports (report.py, sinks.py): a value's spread over
seeds and a table."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def spread(values: Sequence[float | None], scale: float = 1.0, digits: int = 1,
           minmax: bool = True) -> str:
  """'mean ± std (min–max)' of the non-None values, times `scale`; the value alone for one
  seed (no spread to show); '-' if none."""
  x = np.asarray([v for v in values if v is not None], np.float64) * scale
  if x.size == 0:
    return "-"
  if x.size == 1:
    return f"{x[0]:.{digits}f}"
  std = float(x.std(ddof=1)) if x.size > 1 else 0.0
  s = f"{x.mean():.{digits}f} ± {std:.{digits}f}"
  if minmax and x.size > 1:
    s += f" ({x.min():.{digits}f}–{x.max():.{digits}f})"
  return s


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)
