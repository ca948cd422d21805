"""Results tables for `harness.evaluate` output: JSON (everything) and Markdown (one row per
task and metric, value ± standard error, throughput), in the spirit of the harness's table."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from attn_jax import paths

_NON_METRICS = {"n_docs", "n_requests", "seconds", "examples_per_s", "requests_per_s",
                "n_examples", "n_positions"}


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "tolist"):  # numpy scalars and arrays
    return _jsonable(x.tolist())
  if isinstance(x, float) and not math.isfinite(x):
    return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
  return x


def metric_rows(results: dict) -> list[dict]:
  """[{task, metric, value, stderr, n_docs, examples_per_s}] from evaluate()'s output."""
  per_task = results.get("results", results)
  rows = []
  for task, metrics in per_task.items():
    for name, value in metrics.items():
      if (name in _NON_METRICS or name.endswith("_stderr") or isinstance(value, bool)
          or not isinstance(value, (int, float))):  # e.g. a NIAH grid stays in the JSON only
        continue
      rows.append(dict(task=task, metric=name, value=value,
                       stderr=metrics.get(f"{name}_stderr"),
                       n_docs=metrics.get("n_docs", metrics.get("n_examples")),
                       examples_per_s=metrics.get("examples_per_s")))
  return rows


def _fmt(x: Any, digits: int = 4) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if isinstance(x, float):
    return f"{x:.{digits}g}" if abs(x) >= 1e5 else f"{x:.{digits}f}"
  return str(x)


def to_markdown(results: dict) -> str:
  lines = ["| Task | n | Metric | Value | ± Stderr | examples/s |",
           "|---|---:|---|---:|---:|---:|"]
  for r in metric_rows(results):
    lines.append(f"| {r['task']} | {_fmt(r['n_docs'])} | {r['metric']} | {_fmt(r['value'])} | "
                 f"{_fmt(r['stderr'])} | {_fmt(r['examples_per_s'], 1)} |")
  for task, metrics in results.get("results", results).items():
    for note in (metrics.get("notes", ()) if isinstance(metrics, dict) else ()):
      lines.append(f"\n{task}: {note}")   # e.g. NIAH cells beyond max_seq_len: n/a
  config = results.get("config")
  if config:
    lines.append("")
    lines.append("config: " + ", ".join(f"{k}={v}" for k, v in config.items()))
  return "\n".join(lines) + "\n"


def write_json(results: dict, path: str | os.PathLike) -> None:
  with paths.open_for_write(path) as f:
    json.dump(_jsonable(results), f, indent=2, sort_keys=True)
    f.write("\n")


def write_markdown(results: dict, path: str | os.PathLike) -> None:
  with paths.open_for_write(path) as f:
    f.write(to_markdown(results))


def write_report(results: dict, out_dir: str | os.PathLike, stem: str = "eval") -> dict[str, str]:
  """Writes `<stem>.json` and `<stem>.md` under out_dir; returns their paths."""
  root = paths.run_path(out_dir)
  written = {"json": paths.name(root / f"{stem}.json"),
             "markdown": paths.name(root / f"{stem}.md")}
  write_json(results, written["json"])
  write_markdown(results, written["markdown"])
  return written
