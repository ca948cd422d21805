"""A training run's outputs: its metric rows, the writers they go to, and how those end.

`RunOutputs` opens them once the run knows the step it starts at: metrics.jsonl, TensorBoard and
W&B through one `MetricWriter` (a resumed run first drops the rows an interrupted run logged
after its checkpoint, they are logged again; a run from step 0 first moves an earlier run's
history aside, `workdir.rotate_history`), then, just before the first step, the console
progress bar and the throughput clock (`show_progress`: the set-up in between is not counted as
training time). A step's row is its metrics plus the throughput columns (tokens_per_sec,
tokens_seen, and mfu against the device's peak FLOP/s when it is known) and the loss monitor's
counters; `last` keeps every metric's latest value, the run's result.

The way out: after a normal end the writers are flushed and stay open for the final evaluation
(`close` then); with an exception in flight they are closed at once (each waits a bounded
time), and a writer's failure that is the exception in flight is not reported twice.
`write_failed` turns a failed metrics write into the error the run stops with, naming the
resume point: the latest committed checkpoint, once a save still in progress has ended."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
from tqdm import tqdm

from attn_jax.config import RunConfig
from attn_jax.train import flops as flops_lib, workdir as workdir_lib
from attn_jax.train.checkpoint import Checkpointer, CheckpointSaveError
from attn_jax.train.fitting import BatchGeometry
from attn_jax.train.loss_monitor import LossMonitor
from attn_jax.train.metrics import MetricWriter, flatten_metrics
from attn_jax.train.setup import Setup
from attn_jax.train.wandb_writer import add_wandb
from attn_jax.train.writers import WriteError


class RunOutputs:
  """The metric writers and progress bar of one run started (or resumed) at `start`."""

  def __init__(self, config: RunConfig, workdir: str, setup: Setup, geo: BatchGeometry, ckpt_dir: str,
               start: int):
    c, n = config, setup.n_params
    if start == 0 and jax.process_index() == 0:
      workdir_lib.rotate_history(workdir, ckpt_dir)
    self.writer = MetricWriter(workdir)
    if start:
      self.writer.truncate_after(start)
    add_wandb(self.writer, c, workdir, setup, c.to_json(), start=start)
    self.tokens = geo.tokens
    self.flops_per_tok = flops_lib.train_flops_per_token(setup.cfg, n, geo.seq_len)
    self.peak = flops_lib.peak_flops_per_device(override=c.train.peak_flops,
                                                dtype=c.model.dtype)  # fp32: the TF32 peak
    self.n_dev = jax.device_count()
    self.bar = None
    self.last: dict[str, Any] = {}
    self.t_log, self.step_log = time.perf_counter(), start

  def show_progress(self, config, start: int) -> None:
    """The progress bar (process 0, when asked for) and the throughput clock, started now."""
    c = config
    if c.train.progress_bar and jax.process_index() == 0:
      self.bar = tqdm(total=c.train.steps, initial=start, unit="step", dynamic_ncols=True)
    self.t_log, self.step_log = time.perf_counter(), start

  def stepped(self) -> None:
    """One more step dispatched."""
    if self.bar is not None:
      self.bar.update(1)

  def write(self, step: int, row: dict) -> None:
    """A row as it is (an evaluation's)."""
    self.writer.write(step, row)
    self.last.update(row)

  def step_row(self, step: int, m: dict, spike: bool, monitor: LossMonitor) -> None:
    """A train step's row: its metrics, the throughput since the last row and the monitor's
    counters."""
    now = time.perf_counter()
    tps = self.tokens * (step - self.step_log) / max(now - self.t_log, 1e-9)
    out = flatten_metrics(m)
    out.update(tokens_per_sec=tps, tokens_seen=step * self.tokens, loss_spike=float(spike),
               loss_spikes=monitor.loss_spikes,
               nonfinite_steps=monitor.nonfinite_steps)
    if self.peak:
      out["mfu"] = tps * self.flops_per_tok / (self.peak * self.n_dev)
    self.write(step, out)
    self.t_log, self.step_log = now, step
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{float(m['loss']):.4f}", acc=f"{out['accuracy']:.3f}",
                           tok_s=f"{tps:,.0f}")

  def close_on_exit(self, error: BaseException | None) -> None:
    """Flush the writers (normal end: `close` follows the final evaluation) or close them
    (each waits a bounded time); a writer's failure that is the error in flight is not
    reported twice; then the progress bar is closed."""
    if error is None:
      self.writer.flush()
    else:
      try:
        self.writer.close()
      except WriteError as e:
        if not isinstance(error, WriteError):
          logging.error("while stopping after %s: closing the metric writers failed: %s",
                        type(error).__name__, e)
    if self.bar is not None:
      self.bar.close()

  def close(self) -> None:
    self.writer.close()


def write_failed(e: WriteError, ckpt: Checkpointer) -> WriteError:
  """A failed write of the metrics writers, with the resume point named (a failed
  checkpoint save already names the steps kept)."""
  if isinstance(e, CheckpointSaveError):
    return e
  pending = ckpt.pending_step
  # A save still in progress decides the resume point: its end is awaited. Its failure: the
  # same disk, most likely.
  unfinished = ("" if ckpt.settle() is None else
                f" (step {pending}, which was being saved, is not: its save failed too)")
  latest = ckpt.latest_step()        # committed steps only, read from the disk
  kept = (f"the latest checkpoint, step {latest} in {ckpt.directory}, is kept: rerun "
          "the same command to resume from it" if latest is not None
          else f"there is no checkpoint yet in {ckpt.directory}")
  out = WriteError(f"{e}. The run stopped without saving again; {kept}{unfinished}")
  out.errno, out.__cause__ = e.errno, e
  return out
