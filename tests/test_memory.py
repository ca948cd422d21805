"""train/memory.py: needed bytes, the fit message, and the micro-batch picker (fake analyses)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from attn_jax.train import memory

GiB = memory.GiB


@dataclasses.dataclass
class FakeMem:
  """Stands in for XLA's CompiledMemoryStats (the fields memory.py reads)."""
  argument_size_in_bytes: int = 0
  output_size_in_bytes: int = 0
  alias_size_in_bytes: int = 0
  temp_size_in_bytes: int = 0
  generated_code_size_in_bytes: int = 0
  peak_memory_in_bytes: int = 0


def step_memory(micro_batch: int) -> FakeMem:
  """2 GiB of donated state in and out, 1 GiB of activations per sequence."""
  return FakeMem(argument_size_in_bytes=2 * GiB + micro_batch * 1024,
                 output_size_in_bytes=2 * GiB, alias_size_in_bytes=2 * GiB,
                 temp_size_in_bytes=micro_batch * GiB, generated_code_size_in_bytes=1024)


def test_needed_bytes_counts_donation_and_peak():
  m = step_memory(4)
  assert memory.needed_bytes(m) == 2 * GiB + 4 * 1024 + 4 * GiB + 1024
  assert memory.needed_bytes(dataclasses.replace(m, peak_memory_in_bytes=100 * GiB)) == 100 * GiB


def test_fit_message_names_sizes_and_knobs():
  fit = memory.check_fit(step_memory(8), available=8 * GiB, source="test device",
                         micro_batch=8, grad_accum=1, remat="none")
  assert not fit.fits and fit.needed > 10 * GiB and fit.available == 8 * GiB
  msg = fit.message
  assert "10.00 GiB" in msg and "8.00 GiB" in msg and "test device" in msg
  for knob in ("data.global_batch_size=8", "train.grad_accum=1", "model.remat='none'",
               "train.auto_microbatch", "model.remat='full'"):
    assert knob in msg, knob
  ok = memory.check_fit(step_memory(2), available=8 * GiB, source="test device")
  assert ok.fits and "it fits" in ok.message and "does not fit" not in ok.message


def test_headroom_is_applied():
  need = memory.needed_bytes(step_memory(4))
  assert memory.check_fit(step_memory(4), available=need, headroom=1.0).fits
  assert not memory.check_fit(step_memory(4), available=need, headroom=0.9).fits


def test_pick_micro_batch_largest_that_fits_with_few_compiles():
  calls = []

  def analyze(m):
    calls.append(m)
    return step_memory(m)

  # 2 GiB state + m GiB: with 11 GiB x 0.95 = 10.45 GiB, m = 8 fits (10 GiB), 16 does not.
  micro, accum = memory.pick_micro_batch(analyze, 64, available=11 * GiB)
  assert (micro, accum) == (8, 8)
  assert len(set(calls)) <= 4  # binary search over the 7 divisors of 64, not all of them
  # Shards: the micro-batch must be a multiple of 3 and divide 48 -> 6 (8 is not allowed).
  assert memory.pick_micro_batch(analyze, 48, available=11 * GiB, multiple_of=3) == (6, 8)
  # Everything fits: no accumulation.
  assert memory.pick_micro_batch(analyze, 4, available=100 * GiB) == (4, 1)


def test_pick_micro_batch_raises_with_message_when_nothing_fits():
  with pytest.raises(ValueError, match="even micro-batch 1 does not fit.*train.grad_accum"):
    memory.pick_micro_batch(step_memory, 16, available=2 * GiB)
  with pytest.raises(ValueError, match="no micro-batch divides"):
    memory.pick_micro_batch(step_memory, 10, available=100 * GiB, multiple_of=4)


TPU_REFUSAL = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
               "temporaries (26.99G) exceeds available HBM (15.75G).\nmore detail")


def test_a_compiler_refusal_for_memory_is_a_step_that_does_not_fit():
  """XLA for TPU refuses a program larger than HBM while compiling: the fit check and the
  micro-batch search read that as 'does not fit' (with the bytes it names), not as a crash."""
  r = memory.refusal(RuntimeError(TPU_REFUSAL))
  assert r.temp_size_in_bytes == int(26.99 * GiB) and r.reason.endswith("(15.75G).")
  assert memory.refusal(RuntimeError("RESOURCE_EXHAUSTED: out of host memory")) is None
  fit = memory.check_fit(r, available=100 * GiB, source="v5e")   # never fits, whatever is free
  assert not fit.fits and "refused the train step for memory: more than 26.99 GiB" in fit.message

  def analyze(m):   # the compiler refuses every micro-batch above 8 (step_memory's 10 GiB)
    def compile_fn():
      if m > 8:
        raise RuntimeError(TPU_REFUSAL)
      return type("Compiled", (), {"memory_analysis": lambda self: step_memory(m)})()
    return memory.analysis_or_refusal(compile_fn)

  assert memory.pick_micro_batch(analyze, 64, available=100 * GiB) == (8, 8)
  with pytest.raises(ValueError, match="a bug"):
    memory.analysis_or_refusal(lambda: (_ for _ in ()).throw(ValueError("a bug")))


def test_real_compiled_analysis_and_cpu_available(tmp_path):
  """A real compiled program's analysis goes through; on CPU availability is MemAvailable."""
  mem = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64))).compile().memory_analysis()
  assert memory.needed_bytes(mem) >= 64 * 64 * 4
  avail, source = memory.available_bytes(jax.devices("cpu")[0])
  assert avail > 0 and "MemAvailable" in source
  fake = tmp_path / "meminfo"
  fake.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  512 kB\n")
  assert memory._meminfo_available(str(fake)) == 512 * 1024
