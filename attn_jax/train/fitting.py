"""The batch geometry a run trains with: the config's micro-batch x grad_accum x length, or,
when its compiled step does not fit the device and `train.auto_microbatch` is on, the largest
micro-batch that does at the same tokens per step (`fit_memory`); then the step compiled for
it (`compile_for`)."""

from __future__ import annotations

import dataclasses
import logging
import time



from attn_jax import sharding as shd
from attn_jax.config import RunConfig
from attn_jax.train import memory
from attn_jax.train.setup import Setup, abstract_batch, compile_step, step_memory


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
  """One optimizer step's batch: `accum` micro-batches of `micro` rows of `seq_len` tokens, the
  global [accum, micro, seq_len] arrays the step takes.

  `Setup` does not depend on it (the step is traced per batch shape), so memory fitting can pick
  it after `build_setup`; the run's config is then rewritten to it (`apply`) before anything
  reads the config's batch: the data iterator, the held-out batches and the config saved with
  every checkpoint all see the batch the run trains on."""
  accum: int
  micro: int
  seq_len: int

  @classmethod
  def of(cls, config: RunConfig) -> "BatchGeometry":
    return cls(config.train.grad_accum, config.data.global_batch_size, config.data.seq_len)

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.accum, self.micro, self.seq_len)

  @property
  def tokens(self) -> int:
    """Tokens per optimizer step."""
    return self.accum * self.micro * self.seq_len

  def apply(self, config: RunConfig) -> RunConfig:
    """`config` itself when its batch is this one, else a copy with data.global_batch_size and
    train.grad_accum set to it."""
    if BatchGeometry.of(config) == self:
      return config
    return (config.replace_in("data", global_batch_size=self.micro)
            .replace_in("train", grad_accum=self.accum))


def fit_memory(setup: Setup, config: RunConfig) -> BatchGeometry:
  """The batch geometry to train with, after comparing the compiled step's memory with the
  device's (before the first step).

  Fits (or the backend reports no analysis): the config's own geometry. Does not fit: with
  `train.auto_microbatch`, the largest micro-batch that fits (same tokens per optimizer step
  through `train.grad_accum`), logged; else stop with a MemoryError whose one paragraph names
  the needed and available memory and the knobs. `train.device_memory_gb` (> 0) overrides the
  detected memory (e.g. to size a run for another device)."""
  t, geo = config.train, BatchGeometry.of(config)
  avail = int(t.device_memory_gb * 2**30) or None
  mem = step_memory(setup, geo.micro, geo.accum, geo.seq_len)
  if mem is None:   # the backend reports no analysis
    return geo
  fit = memory.check_fit(mem, available=avail, micro_batch=geo.micro, grad_accum=geo.accum,
                         remat=setup.cfg.remat)
  logging.info("%s", fit.message)
  if fit.fits:
    return geo
  if not t.auto_microbatch:
    raise MemoryError(fit.message)
  total = geo.micro * geo.accum
  micro, accum = memory.pick_micro_batch(
      lambda m: step_memory(setup, m, total // m, geo.seq_len), total, available=avail,
      multiple_of=shd.batch_shards(setup.mesh, setup.rules))
  logging.warning("train.auto_microbatch: micro-batch %d x grad_accum %d (was %d x %d) fits",
                  micro, accum, geo.micro, geo.accum)
  return dataclasses.replace(geo, micro=micro, accum=accum)


def compile_for(setup: Setup, geo: BatchGeometry):
  """The loop's step: `compile_step` for the run's batch, its compile time and memory logged."""
  t0 = time.perf_counter()
  compiled = compile_step(setup, abstract_batch(setup, *geo.shape))
  logging.info("train step compiled in %.1fs", time.perf_counter() - t0)
  try:
    logging.info("memory analysis: %s", compiled.memory_analysis())
  except Exception:  # not every backend reports it
    pass
  return compiled
