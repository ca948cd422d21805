"""Metric rows and their writers: one JSON object per line in <workdir>/metrics.jsonl and
TensorBoard event files in <workdir>/tb (writers.py: how each is written and how a failed or
stalled writer stops the run instead of blocking it; a new writer joins with
`MetricWriter.add`); the console progress bar (tqdm) is the trainer's. Only process 0 writes.

Resuming: rows logged after the restored checkpoint's step were computed by the interrupted run
and will be logged again by the resumed one; `MetricWriter.truncate_after(step)` drops them from
metrics.jsonl (atomic rewrite; a half-written last line from a crash is dropped too) and makes
TensorBoard discard them (`purge_step`), so every step appears once."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import jax
import numpy as np

from attn_jax import paths
from attn_jax.run_layout import RunLayout
from attn_jax.train import writers as writers_lib


def _scalar(v: Any) -> float | int:
  v = np.asarray(v)
  return v.item() if v.size == 1 else v.tolist()


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{'aux': {'lambda': [L]}} -> {'aux/lambda/layer_0': ..., 'aux/lambda/mean': ...}."""
  out: dict[str, Any] = {}
  for k, v in metrics.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten_metrics(v, key + "/"))
      continue
    arr = np.asarray(jax.device_get(v))
    if arr.ndim == 0:
      out[key] = arr.item()
    elif arr.ndim == 1:  # per-layer monitoring
      out[f"{key}/mean"] = float(arr.mean())
      for i, x in enumerate(arr.tolist()):
        out[f"{key}/layer_{i}"] = x
    else:
      out[key] = arr.tolist()
  return out


class MetricWriter:
  """Every metrics row of a run, handed to each of its writers (writers.py): metrics.jsonl in
  the calling thread, TensorBoard behind `Background`, and whatever `add` brings. A writer's
  failure is a WriteError raised by `write` or by `check` (polled every step)."""

  def __init__(self, workdir: str, *, enabled: bool | None = None, tensorboard: bool = True,
               stall_s: float = writers_lib.STALL_S):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    layout = RunLayout.of(workdir)
    self.path = paths.name(layout.metrics)
    self._tb_dir = paths.name(layout.tb) if tensorboard else None
    self._should_stop = lambda: False
    self.writers: list = []
    self._tb = None
    if self.enabled:
      layout.root.mkdir(parents=True, exist_ok=True)
      self.writers.append(writers_lib.JsonlWriter(self.path))
      if tensorboard:
        self._tb = self.add(writers_lib.Background(writers_lib.TensorBoardWriter(self._tb_dir),
                                                   stall_s=stall_s,
                                                   should_stop=self.should_stop))

  def add(self, writer):
    """Adds a writer (a `writers.Writer`, or one behind `writers.Background`); returns it."""
    if self.enabled:
      self.writers.append(writer)
    return writer

  def should_stop(self) -> bool:
    return self._should_stop()

  def stop_when(self, should_stop) -> None:
    """`should_stop()` true (a SIGTERM / SIGINT arrived): a writer that is not taking rows is
    no longer waited for (writers.Background)."""
    self._should_stop = should_stop

  def truncate_after(self, step: int) -> int:
    """Drops logged rows with step > `step` (call at resume with the restored step); returns
    how many rows were dropped."""
    if not self.enabled:
      return 0
    step = int(step)
    if self._tb is not None:  # TensorBoard hides the events >= step + 1 written before this
      self._tb.call("purge", step + 1)
    if not paths.run_path(self.path).is_file():
      return 0
    kept, dropped = [], 0
    for number, line, row_step in row_steps(self.path):
      if row_step is None:
        logging.warning("%s:%d: dropping an unreadable metrics row (interrupted write?)",
                        self.path, number)
        dropped += 1
      elif row_step > step:
        dropped += 1
      else:
        kept.append(line if line.endswith("\n") else line + "\n")
    try:
      self._rewrite(kept)
    except OSError as e:
      raise writers_lib.write_error("metrics.jsonl", self.path, step, e) from e
    if dropped:
      logging.warning("metrics: dropped %d row(s) after step %d from %s (logged by the previous "
                      "run after its last checkpoint; they are logged again)", dropped, step,
                      self.path)
    return dropped

  def _rewrite(self, lines: list[str]) -> None:
    """metrics.jsonl replaced by `lines` at once (locally a rename; an object is written
    whole); the jsonl writer starts from them."""
    target = paths.run_path(self.path)
    if paths.is_uri(target):
      target.write_text("".join(lines))
    else:
      tmp = target.parent / (target.name + ".tmp")
      tmp.write_text("".join(lines))
      tmp.replace(target)
    for w in self.writers:
      getattr(w, "reopen", lambda: None)()

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self.check()
    for w in self.writers:
      w.write(step, row)

  def check(self) -> None:
    """WriteError once a writer has failed (cheap: polled at every step boundary)."""
    for w in self.writers:
      getattr(w, "check", lambda: None)()

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def sync(self) -> None:
    """Waits (a bounded time) until every writer has taken every row so far; raises the
    failure of one that could not."""
    for w in self.writers:
      getattr(w, "sync", lambda: None)()

  def close(self) -> None:
    """Closes every writer (each waits a bounded time); the first failure is raised after all
    were closed."""
    first = None
    for w in self.writers:
      try:
        w.close()
      except writers_lib.WriteError as e:
        first = first or e
    self.writers = []
    if first is not None:
      raise first


def row_steps(path: str) -> list[tuple[int, str, int | None]]:
  """(line number, line, its "step" or None when unreadable) of each non-blank row of a
  metrics.jsonl (a row cut short by an interrupted write reads as None)."""
  rows = []
  with paths.run_path(path).open() as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        step = int(json.loads(line)["step"])
      except (ValueError, KeyError, TypeError):
        step = None
      rows.append((number, line, step))
  return rows


def read_metrics(workdir) -> list[dict]:
  with RunLayout.of(workdir).metrics.open() as f:
    return [json.loads(line) for line in f if line.strip()]
