"""The host-side watch over a run's losses: non-finite steps (skipped or halting the run, as
`config.train.nonfinite` says) and loss spikes (`config.train.spike_window` / `spike_threshold`),
carried through checkpoints in their meta.

The halt rules: `halt_reason` says whether a non-finite step stops the run ("halt": the first
one; "skip": `nonfinite_max_consecutive` in a row), and `halt_message` is the error the run stops
with: the step, the last finite step, and the latest checkpoint from before it (none ever holds
non-finite values), with what to change."""

from __future__ import annotations

import logging

import numpy as np


class NonFiniteTrainingError(FloatingPointError):
  """Training stopped at a step whose loss, gradient or update was not finite."""


NONFINITE_MODES = ("skip", "halt")


class LossMonitor:
  """Host-side watch over every step's loss: non-finite steps and loss spikes.

  A spike is a finite loss above mean + k * max(std, 1e-3 * |mean|) of the previous `window`
  finite losses (k = `threshold`), once the window holds at least max(2, window // 4) of them;
  the floor on the std keeps a flat loss curve from flagging rounding noise. Every finite loss
  enters the window (a lasting level shift stops being flagged once the window has seen it).
  `state()` / `load()` carry the counters and window through a checkpoint's meta.
  """

  def __init__(self, window: int, threshold: float):
    self.window, self.threshold = int(window), float(threshold)
    self.losses: list[float] = []
    self.nonfinite_steps = 0
    self.loss_spikes = 0
    self.consecutive_nonfinite = 0
    self.last_finite_step: int | None = None

  def update(self, step: int, loss: float, nonfinite: bool) -> bool:
    """Records a step; returns whether its loss is a spike."""
    if nonfinite:
      self.nonfinite_steps += 1
      self.consecutive_nonfinite += 1
      return False
    self.consecutive_nonfinite = 0
    self.last_finite_step = step
    if not self.window:
      return False
    spike = False
    if len(self.losses) >= max(2, self.window // 4):
      hist = np.asarray(self.losses, np.float64)
      mean = float(hist.mean())
      std = max(float(hist.std()), 1e-3 * abs(mean))
      spike = loss > mean + self.threshold * std
    self.losses = (self.losses + [float(loss)])[-self.window:]
    self.loss_spikes += int(spike)
    return spike

  def state(self) -> dict:
    return {"losses": list(self.losses), "nonfinite_steps": self.nonfinite_steps,
            "loss_spikes": self.loss_spikes, "consecutive_nonfinite": self.consecutive_nonfinite,
            "last_finite_step": self.last_finite_step}

  def load(self, state: dict | None) -> None:
    if not state:
      return
    self.losses = [float(x) for x in state.get("losses", [])][-self.window:] if self.window else []
    self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
    self.loss_spikes = int(state.get("loss_spikes", 0))
    self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
    self.last_finite_step = state.get("last_finite_step")


def halt_reason(config, monitor: LossMonitor) -> str | None:
  """Why a non-finite step stops the run, or None when it is skipped."""
  t, consecutive = config.train, monitor.consecutive_nonfinite
  if t.nonfinite == "halt":
    return "stopping (config.train.nonfinite='halt')"
  if consecutive >= t.nonfinite_max_consecutive:
    return (f"{consecutive} non-finite steps in a row (config.train."
            f"nonfinite_max_consecutive={t.nonfinite_max_consecutive})")
  return None


def halt_message(ckpt, monitor: LossMonitor, step: int, loss: float, why: str) -> str:
  """The message of the NonFiniteTrainingError that stops the run at `step`, naming the resume
  point among the steps `ckpt` (a train/checkpoint.py Checkpointer) holds once its save in
  flight, if any, has been committed (the one from just before the event, usually)."""
  failed = ckpt.settle()
  if failed is not None:
    logging.error("%s", failed)
  saved = [s for s in ckpt.all_steps() if s < step]
  where = (f"the latest checkpoint (from before it) is step {max(saved)} in "
           f"{ckpt.directory}" if saved
           else f"there is no checkpoint yet in {ckpt.directory}")
  return (f"step {step}: the loss ({loss}), a gradient or the parameter update is not "
          f"finite; {why}. The update was not applied. The last finite step is "
          f"{monitor.last_finite_step}; {where} (no checkpoint ever holds non-finite "
          "values). Lower config.optim.lr / raise optim.warmup_steps, or set "
          "config.train.nonfinite='skip' to step over isolated events.")
