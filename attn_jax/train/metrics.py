"""Metric sinks: one JSON object per line in <workdir>/metrics.jsonl, TensorBoard event files
(tensorboardX) in <workdir>/tb, and a console progress bar (tqdm). Only process 0 writes.

Resuming: rows logged after the restored checkpoint's step were computed by the interrupted run
and will be logged again by the resumed one; `MetricWriter.truncate_after(step)` drops them from
metrics.jsonl (atomic rewrite; a half-written last line from a crash is dropped too) and makes
TensorBoard discard them (`purge_step`), so every step appears once."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Mapping

import jax
import numpy as np


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
  def __init__(self, workdir: str, *, enabled: bool | None = None, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    self._tb_dir = os.path.join(workdir, "tb") if tensorboard else None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(self._tb_dir)

  def truncate_after(self, step: int) -> int:
    """Drops logged rows with step > `step` (call at resume with the restored step); returns
    how many rows were dropped."""
    if not self.enabled:
      return 0
    step = int(step)
    if self._tb is not None:  # TensorBoard hides events >= purge_step written before this
      from tensorboardX import SummaryWriter
      self._tb.close()
      self._tb = SummaryWriter(self._tb_dir, purge_step=step + 1)
    if not os.path.isfile(self.path):
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
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)
    if dropped:
      logging.warning("metrics: dropped %d row(s) after step %d from %s (logged by the previous "
                      "run after its last checkpoint; they are logged again)", dropped, step,
                      self.path)
    return dropped

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    flat = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    # JSON has no NaN/Inf: write them as strings so every line stays valid JSON.
    clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in flat.items()}
    try:
      with open(self.path, "a") as f:
        f.write(json.dumps(clean) + "\n")
    except OSError as e:  # e.g. a full disk: name the file
      raise OSError(e.errno, f"cannot append step {step} to {self.path}: {e.strerror}") from e
    if self._tb_alive():
      for k, v in flat.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)

  def _tb_alive(self) -> bool:
    """False once tensorboardX's writer thread has died (e.g. a write failed on a full disk):
    putting more events in its bounded queue would block the training loop for good, so
    TensorBoard logging stops there with an error (metrics.jsonl goes on, or fails loudly)."""
    if self._tb is None:
      return False
    writers = (getattr(self._tb, "all_writers", None) or {}).values()
    workers = [getattr(getattr(w, "event_writer", None), "_worker", None) for w in writers]
    if any(w is not None and not w.is_alive() for w in workers):
      self._tb_failed("its writer thread died")
      return False
    return True

  def _tb_failed(self, why: str) -> None:
    logging.error("TensorBoard logging to %s stops: %s (disk full or unwritable?); "
                  "metrics.jsonl is unaffected", self._tb_dir, why)
    self._tb = None

  def _tb_call(self, method: str) -> None:
    if self._tb_alive():
      try:
        getattr(self._tb, method)()
      except OSError as e:
        self._tb_failed(f"{type(e).__name__}: {e}")

  def flush(self) -> None:
    self._tb_call("flush")

  def close(self) -> None:
    self._tb_call("close")


def row_steps(path: str) -> list[tuple[int, str, int | None]]:
  """(line number, line, its "step" or None when unreadable) of each non-blank row of a
  metrics.jsonl (a row cut short by an interrupted write reads as None)."""
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        step = int(json.loads(line)["step"])
      except (ValueError, KeyError, TypeError):
        step = None
      rows.append((number, line, step))
  return rows


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
