"""attn_jax.kernel_choice: every implementation choice by the platform compiled for, logged
once; the only module (with the two-compiler kernel) that reads that platform."""

import logging
import pathlib
import re

import jax.numpy as jnp
import pytest

from attn_jax import command_buffers, kernel_choice as kc

PACKAGE = pathlib.Path(kc.__file__).resolve().parent
READS_PLATFORM = re.compile(r"kernel_choice\.target\(|\b_TARGET\b|jax\.default_backend\(\)")


def test_choices_by_platform():
  cpu_opts = {"xla_cpu_copy_insertion_use_region_analysis": True}
  table = {"cpu": ("blocked", "blocked", True, "blocked", cpu_opts),
           "gpu": ("cudnn", "xla", False, "flash", command_buffers.compiler_options("gpu")),
           "tpu": ("splash", "splash", False, "flash", {})}
  for plat, (bf16, fp32, remat, fox, opts) in table.items():
    with kc.use_platform(plat):
      assert kc.target() == plat
      assert kc.attention_impl("auto", jnp.bfloat16, 64) == bf16
      assert kc.attention_impl("auto", jnp.float32, 64) == fp32
      assert kc.attention_impl("einsum", jnp.bfloat16, 64) == "einsum"
      assert kc.remat_attention("auto", jnp.bfloat16, 64) == remat
      assert kc.parallel_time_sums() == (plat != "cpu")
      assert kc.forget_path(256, 4096) == fox
      assert kc.forget_path(8192, 4096) == "flash"
      assert kc.pallas_interpret("tpu") == (plat != "tpu")
      assert kc.stateful_compiler_options() == opts
  with kc.use_platform("cuda"):
    assert kc.attention_impl("auto", jnp.bfloat16, 264) == "xla"   # head too wide for cuDNN
  with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
    kc.attention_impl("flash", jnp.float32, 64)
  with pytest.raises(ValueError, match="unknown platform 'metal'"):
    kc.normalize("metal")


def test_decayed_kernel_by_platform_shapes_and_override(caplog):
  """auto on GPU / TPU when the shapes fit (`why_not` is asked with the platform); a misfit is
  one warning however often it is asked; the CPU only inside `kernels_on_cpu`."""
  asked = []
  fits = lambda plat: asked.append(plat)
  assert not kc.decayed_kernel("auto", fits, what="t")          # CPU
  with kc.kernels_on_cpu():
    assert kc.decayed_kernel("auto", fits, what="t")
  with kc.use_platform("gpu"):
    assert kc.decayed_kernel("auto", fits, what="t")
    assert not kc.decayed_kernel("xla", fits, what="t")
    with caplog.at_level(logging.WARNING, logger=kc.__name__):
      for _ in range(3):
        assert not kc.decayed_kernel("auto", lambda p: "a head dim of 12", what="odd-test")
  assert asked == ["cpu", "gpu"]
  lines = [r.getMessage() for r in caplog.records if "odd-test" in r.getMessage()]
  assert lines == ["odd-test: decayed-attention kernel not used on gpu (a head dim of 12); "
                   "blockwise path"]


def test_the_platform_is_read_by_kernel_choice_and_the_two_compiler_kernel_only():
  """No mixer or trunk module reads the platform (or the default backend) to choose an
  implementation: they ask kernel_choice. Reports that record the machine a process runs on
  (study records, benchmark headers) ask provenance.machine_info, the one run-facts reader."""
  allowed = {"kernel_choice.py", "kernels/decayed.py", "kernels/ssd_chunks.py", "provenance.py"}
  readers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if READS_PLATFORM.search(p.read_text())}
  assert readers <= allowed, sorted(readers - allowed)
  kernel_readers = {r for r in readers if "kernel_choice.target(" in (PACKAGE / r).read_text()
                    or r == "kernel_choice.py"}
  assert kernel_readers == {"kernel_choice.py", "kernels/decayed.py", "kernels/ssd_chunks.py"}
