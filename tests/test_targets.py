"""Compiled for the machines attn_jax is for: every registered mixer's programs compiled, on
this CPU, for 4 x H100 and a 4-chip TPU v5e slice (`attn_jax.targets`: compile-only devices,
the device compilers' own passes, the SPMD partitioner on that topology, the cuDNN / Mosaic
kernels and XLA's memory analysis; nothing runs).

Each case is the trainer's exact train step (`build_setup` over the target's devices, traced
under the mesh's rules, so `kernel_choice.target()` is the target's platform) on a 2-axis mesh,
data x fsdp and data x tensor, at a tiny width but a training length of T = 1024, and the
decode programs (chunked prefill + the one-token step). Asserted: it compiles; the
Transformer at bf16 calls cuDNN attention on H100 and the splash (Mosaic) kernel on TPU; no
mixer holds a [.., T, T] buffer in its train step. The docs' toy mixer (docs/mixers.md) goes
through `experiments/train.py --compile_only` on both targets.

A TPU compile takes tens of seconds on a CPU: the default suite holds the unit tests and the
H100 Transformer; the matrix is `ci_extra` (CI runs it on every commit; `pytest -m ci_extra
tests/test_targets.py`). Without the targets extra (`pip install -e '.[targets]'`) the
compiling tests skip with that reason.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import kernel_choice, targets
from attn_jax import sharding as shd
from attn_jax.kernels import dpa
from attn_jax.registry import available_mixers
from attn_jax.train import aot, memory
from configs import quickstart
from tests.test_trunk import set_tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU, TPU = "h100x4", "v5e-4"
SEQ_LEN = 1024
MESHES = {"data_fsdp": (2, 2, 1), "data_tensor": (2, 1, 2)}
PATTERNS = {m: (m,) for m in available_mixers()}
PATTERNS["hybrid_block"] = ("attention", "mamba2:nomlp")
KERNEL = {GPU: "cuDNN attention fwd", TPU: "Mosaic (Pallas TPU)"}
DECAYED = ("sisa", "fox", "alibi")                  # kernels/decayed.py's mixers
DECAYED_KERNEL = {GPU: "Triton (Pallas GPU)", TPU: "Mosaic (Pallas TPU)"}


@pytest.fixture(autouse=True)
def _no_persistent_cache():
  """Compile-only executables cannot be reloaded from the persistent cache (no client): keep
  them out of it."""
  with targets.no_persistent_cache():
    yield


def _need(name):
  if not targets.available(name):
    pytest.skip(f"compile target {name} unavailable here (pip install -e '.[targets]')")


def tiny_config(pattern, mesh_shape, seq_len=SEQ_LEN):
  """A bf16 model of width 64 (4 heads of 16), one layer per pattern entry, 4 rows of seq_len."""
  c = quickstart.get_config()
  c.model.update(d_model=64, n_heads=4, d_ff=128, n_layers=len(pattern), pattern=pattern,
                 max_seq_len=seq_len, dtype="bfloat16", vocab_size=256)
  set_tiny(c.model, {p.split(":")[0] for p in pattern})
  c.data.update(seq_len=seq_len, global_batch_size=4)
  c.train.grad_accum = 1
  c.mesh.shape = mesh_shape
  return c


# ------------------------------------------------------------------ units (no compiling)

def test_an_unknown_target_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"unknown compile target 'h100x3'; known: h100x1, .*v5e-8"):
    targets.get("h100x3")


def test_gpu_target_config_carries_the_device_facts():
  text = targets.H100.target_config()
  assert "core_count: 132" in text and "cuda_compute_capability { major: 9 minor: 0 }" in text
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
  usable, why = targets.get("h100x8").usable_bytes()
  assert usable == int(0.75 * targets.H100.memory_bytes) and "MEM_FRACTION" in why


def test_program_text_is_read_for_kernels_collectives_and_square_buffers():
  text = ('%a = (bf16[1,4,256,64]) custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax"\n'
          '%b = bf16[1,4,256,64] custom-call(%p), custom_call_target="__cudnn$fmhaSoftmaxBackward"\n'
          '%c = f32[8] all-reduce-start(f32[8] %x)\n%d = f32[8] all-reduce-done(%c)\n'
          '%e = f32[2,16] all-gather(f32[1,16] %y)\n%f = f32[4,12,1024,1024] fusion(%z)\n'
          '%g = f32[4,1024,512] fusion(%z)\n')
  assert aot.kernels_in(text) == {"cuDNN attention fwd": 1, "cuDNN attention bwd": 1}
  assert aot.collectives_in(text) == {"all-reduce": 1, "all-gather": 1}
  assert aot.square_buffers(text, 1024) == ["f32[4,12,1024,1024]"]
  assert aot.square_buffers(text, 512) == []
  tpu = ('%splash_mqa_fwd_residuals.1 = (f32[4,128,128]) custom-call(%a), '
         'custom_call_target="tpu_custom_call", metadata={}\n'
         '%splash_mqa_dkv.3.2 = (bf16[4,256,16]) custom-call(%b), custom_call_target="tpu_custom_call"\n'
         '%copy-start.67 = s8[1,2,2] custom-call(%c), custom_call_target="AllocateBuffer"\n'
         '%pallas_call.33 = (bf16[1,4]) custom-call(%d), custom_call_target="__gpu$xla.gpu.triton", '
         'metadata={op_name="jit(step)/shard_map/decayed_fwd/pallas_call" stack_frame_id=2}\n')
  assert aot.kernels_in(tpu) == {"Mosaic (Pallas TPU)": 2, "Triton (Pallas GPU)": 1,
                                 "Pallas kernels: decayed_fwd, splash_mqa_dkv, "
                                 "splash_mqa_fwd_residuals": 3}


def test_the_kernel_choice_follows_the_platform_compiled_for():
  assert kernel_choice.target() == "cpu"
  with kernel_choice.use_platform("tpu"):
    assert kernel_choice.attention_impl("auto", jnp.bfloat16, 64) == "splash"
    with kernel_choice.use_platform("cuda"):
      assert kernel_choice.attention_impl("auto", jnp.bfloat16, 64) == "cudnn"
      assert kernel_choice.attention_impl("auto", jnp.float32, 64) == "xla"
    assert kernel_choice.target() == "tpu"
  assert kernel_choice.attention_impl("auto", jnp.bfloat16, 64) == "blocked"
  with pytest.raises(ValueError, match="unknown platform 'metal'"):
    kernel_choice.normalize("metal")


def test_use_rules_sets_the_mesh_platform():
  _need(TPU)
  mesh = shd.make_mesh((4,), ("data",), targets.devices(TPU))
  with shd.use_rules(mesh, {"batch": "data"}):
    assert kernel_choice.target() == "tpu"
  assert kernel_choice.target() == "cpu"


def _script(*args):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, "experiments/train.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_compile_only_mistakes_are_one_line():
  r = _script("--config=configs/quickstart.py", "--compile_only=h100x3")
  lines = [x for x in r.stderr.splitlines() if x.strip()]
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert lines[0].startswith("error: unknown compile target 'h100x3'; known: h100x1")
  r = _script("--config=configs/quickstart.py", "--compile_only=h100x8,h100x3")   # a list:
  lines = [x for x in r.stderr.splitlines() if x.strip()]                # every name checked
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]        # before any compile
  assert lines[0].startswith("error: unknown compile target 'h100x3'; known: h100x1")
  _need(GPU)
  r = _script("--config=configs/quickstart.py", "--compile_only=h100x8",
              "--config.mesh.shape=(4,1,1)")
  lines = [x for x in r.stderr.splitlines() if x.strip()]
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert "config.mesh.shape (4, 1, 1) needs 4 devices, have 8" in lines[0]
  _need(TPU)   # libtpu off a TPU VM adds no lines of its own (targets._quiet_libtpu_off_tpu_vm)
  r = _script("--config=configs/quickstart.py", "--compile_only=v5e-4",
              "--config.mesh.shape=(8,1,1)")
  lines = [x for x in r.stderr.splitlines() if x.strip()]
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert "config.mesh.shape (8, 1, 1) needs 8 devices, have 4" in lines[0]


def test_a_length_equal_to_an_activation_width_is_flagged():
  """Mamba-2 369M's d_inner (32 heads x 64) is 2048 = T: its [B, T, d_inner] activations look
  like [.., T, T] to `square_buffers`, so the report marks such a preset."""
  import types
  setup = types.SimpleNamespace(abstract_state={
      "in_proj": jax.ShapeDtypeStruct((1024, 32, 64), jnp.float32),
      "mu": {"norm": jax.ShapeDtypeStruct((1024,), jnp.float32)}})
  widths = aot.activation_widths(setup)
  assert 2048 in widths and 1024 in widths and 4096 not in widths


def test_a_gpu_tiling_failure_is_compiled_again_without_triton_gemm():
  calls = []

  class Compiled:
    def as_text(self):
      return 'custom_call_target="__cublas$lt$matmul"'

    def memory_analysis(self):
      return None

  def compile(opts):
    calls.append(opts)
    if opts is None:
      raise jax.errors.JaxRuntimeError("INTERNAL: Couldn't find output tile sizes that satisfy")
    return Compiled()

  p = aot._program("train", "[1, 4, 31]", compile, 31)
  assert calls == [None, aot.NO_TRITON_GEMM] and p.options == aot.NO_TRITON_GEMM
  assert p.kernels == {"cuBLAS GEMM": 1}

  def other(opts):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
    aot._program("train", "[1, 4, 31]", other, 31)       # any other failure is reported


def test_cudnn_takes_even_lengths_only():
  assert dpa.cudnn_takes(32, 32) and not dpa.cudnn_takes(31, 31)
  assert not dpa.cudnn_takes(32, 33)


# ------------------------------------------------------------------ compiling

def test_a_compile_only_program_never_meets_the_persistent_cache(tmp_path):
  """Once a process has compiled with the persistent cache on (the suite's own cache, or a
  study's), a compile-only program inside `no_persistent_cache` neither reads nor writes it:
  no "PjRtCompiler must be constructed with a Client" warning; after the block, the process
  compiles through the cache again."""
  import warnings
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax.experimental.compilation_cache import compilation_cache
  _need(TPU)
  before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_enable_compilation_cache", True)   # this file's fixture turns it off
  compilation_cache.reset_cache()
  try:
    f = jax.jit(lambda x: jnp.tanh(x) * 3.0)
    f.lower(jnp.ones((8, 128))).compile()            # the process decides: the cache is used
    assert any(tmp_path.iterdir())
    mesh = Mesh(np.array(targets.devices(TPU)[:1]), ("x",))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    with warnings.catch_warnings(), targets.no_persistent_cache():
      warnings.simplefilter("error")
      for _ in range(2):                               # the second would be a cache hit
        jax.jit(lambda x: jnp.tanh(x) * 3.0).lower(x).compile()
    n = len(list(tmp_path.iterdir()))
    jax.jit(lambda x: jnp.sin(x) * 5.0).lower(jnp.ones((8, 128))).compile()
    assert len(list(tmp_path.iterdir())) == n + 1      # the cache is back for the CPU
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])
    compilation_cache.reset_cache()


def _report(pattern, target, mesh, programs):
  _need(target)
  return aot.compile_for_target(tiny_config(pattern, MESHES[mesh]), target,
                                programs=programs, search_fit=False)


def test_transformer_train_step_calls_cudnn_on_h100():
  r = _report(("attention",), GPU, "data_fsdp", ("train",))
  (train,) = r.programs
  assert train.kernels.get("cuDNN attention fwd") and train.kernels.get("cuDNN attention bwd")
  assert train.tt_buffers == [] and r.fit.fits


def test_a_setup_step_lowered_outside_any_context_compiles_the_targets_kernels():
  """`build_setup` over H100s, then `setup.step_fn.lower(...).compile()` as a notebook would,
  outside `use_rules`, any mesh and any platform block: the program carries its mesh's platform
  and abstract mesh (`sharding.traced_for`), so it holds cuDNN attention, not the CPU's blocked
  core, and FoX's Pallas GPU kernels, whose lowering (JAX >= 0.11) finds the H100 it compiles
  for only in the abstract mesh."""
  _need(GPU)
  from attn_jax.train import setup as setup_lib
  setup = setup_lib.build_setup(tiny_config(("attention", "fox"), MESHES["data_fsdp"]),
                              devices=targets.devices(GPU))
  assert kernel_choice.target() == "cpu"
  batch = setup_lib.abstract_batch(setup, 1, 4, SEQ_LEN)
  text = setup.step_fn.lower(setup.abstract_state, batch).compile().as_text()
  kernels = aot.kernels_in(text)
  assert kernels.get("cuDNN attention fwd") and kernels.get("cuDNN attention bwd"), kernels
  assert kernels.get(DECAYED_KERNEL[GPU], 0) >= 3, kernels     # FoX's forward and backward


@pytest.mark.slow
@pytest.mark.ci_extra
def test_a_step_the_tpu_compiler_refuses_for_memory_gets_a_micro_batch_that_fits():
  """XLA for TPU refuses a program larger than HBM while compiling (RESOURCE_EXHAUSTED): the
  report says so with the bytes it names and the search finds the largest micro-batch that
  compiles and fits (what train.auto_microbatch does on a real chip). 2048 rows x 2048 tokens
  of a 32768-word vocabulary need ~18 GiB of temporaries per v5e chip; 1024 rows fit."""
  _need(TPU)
  c = tiny_config(("attention",), MESHES["data_fsdp"], seq_len=2048)
  c.model.vocab_size = 32768
  c.data.global_batch_size = 2048
  r = aot.compile_for_target(c, TPU, programs=("train",))
  (train,) = r.programs
  assert isinstance(train.memory, memory.Refused) and train.needed > 15.75 * memory.GiB
  assert not r.fit.fits and r.fitting_batch == (1024, 2)
  text = aot.format_report(r)
  assert "refused by the compiler for memory" in text and "fits at micro-batch 1024" in text


def _matrix():
  out = []
  for name, pattern in PATTERNS.items():
    for target in (GPU, TPU):
      for mesh in MESHES:
        marks = (pytest.mark.slow, pytest.mark.ci_extra)
        out.append(pytest.param(pattern, target, mesh, id=f"{name}-{target}-{mesh}",
                                marks=marks))
  return out


@pytest.mark.parametrize("pattern,target,mesh", _matrix())
def test_every_mixer_compiles_for_gpu_and_tpu(pattern, target, mesh):
  programs = ("train", "decode") if mesh == "data_tensor" else ("train",)
  r = _report(pattern, target, mesh, programs)
  train = r.programs[0]
  assert train.tt_buffers == [], f"[.., T, T] buffers in the train step: {train.tt_buffers}"
  if "attention" in pattern:
    assert train.kernels.get(KERNEL[target]), f"no {KERNEL[target]} call: {train.kernels}"
  if pattern[0] in DECAYED and "decode" in programs:   # a prompt's first call: the kernel too
    prefill = next(p for p in r.programs if p.name == "prefill")
    assert prefill.kernels.get(DECAYED_KERNEL[target]), prefill.kernels
  assert {p.name for p in r.programs} == set(programs) | ({"prefill"} if "decode" in programs
                                                          else set())


def test_hardware_page_resumes_and_renders(tmp_path, monkeypatch):
  from attn_jax.bench import hardware_page as hp
  calls, version = [], {"a_152m": "1"}

  def fake(name, row, seq_len=None):
    calls.append((name, row.target, seq_len))
    if name == "broken_152m":
      return {"error": "ValueError: config.mesh.shape (2, 4, 2) needs 16 devices, have 8"}
    temp = 18.0 if seq_len is None else seq_len / 1024     # linear in T
    return {"gib": 20.5, "temp_gib": temp, "fits": False, "fit_micro": 16, "fit_accum": 2,
            "usable_gib": 15.75, "kernels": {"Mosaic (Pallas TPU)": 3, "cuBLAS GEMM": 9},
            "collectives": {"all-gather": 4}, "tt": [], "compile_s": 61.0, "params": 1}

  monkeypatch.setattr(hp, "measure", fake)
  monkeypatch.setattr(hp, "fingerprint", lambda name, row, seq_len=None: version.get(name, "0"))
  out = str(tmp_path / "cells.json")
  names, rows, lrows = ["a_152m", "broken_152m"], hp.ROWS[:2], hp.LENGTH_ROWS[:1]
  presets = {n: n for n in names}     # stand-ins for get_config: the fakes take the name
  todo = hp.cells(names, rows, lrows, ["a_152m"])
  done = hp.run(out, todo, presets, progress=lambda s: None)
  assert len(calls) == 4 + len(hp.LENGTHS) and len(done) == len(calls)
  hp.run(out, todo, presets, progress=lambda s: None)
  assert len(calls) == 4 + len(hp.LENGTHS)     # resumed: nothing measured twice
  version["a_152m"] = "2"                        # the preset changed: its cells again
  hp.run(out, todo, presets, progress=lambda s: None)
  assert len(calls) == 2 * (4 + len(hp.LENGTHS)) - 2
  n = len(calls)                                 # --fresh on one target: only its cells, the
  hp.run(out, hp.cells(names, rows[:1], [], []), presets, fresh=True,
         progress=lambda s: None)
  assert len(calls) == n + 2 and len(hp.jsonio.read(out)) == len(done)   # others kept
  text = hp.page(done, names, rows, lrows, ["a_152m"])
  from attn_jax.provenance import source_commit
  assert f"from cells compiled at {source_commit()} ({len(done)} cells)," in text
  assert hp.measured_at({"x": {}, "y": {"commit": "abc"}, "z": {"commit": "abc"}}) == (
      "abc (2 cells), an unrecorded commit (1 cell)")
  assert "| a_152m | 20.5 | 15.8 | at micro-batch 16 x 2 | Mosaic (Pallas TPU) x3 | all-gather x4" in text
  assert "| broken_152m | error |" in text and "not measured" not in text
  assert "not measured yet" in hp.page({}, names, rows, lrows, ["a_152m"])
  assert "a_152m" in text.split("## v5e-8")[1]
  growth = f"x{hp.LENGTHS[-1] / hp.LENGTHS[0]:.1f}"
  assert f"| a_152m | h100x8 (8, 1, 1) | 20.5 (2.0) | 20.5 (8.0) | 20.5 (32.0) | {growth} | none |" in text
  refused = dict(fake("a_152m", rows[1]), gib=27.0, refused=True, kernels={}, collectives={})
  assert hp._cell(refused)[:4] == ["> 27.0", "15.8", "at micro-batch 16 x 2",
                                   "unknown: the compiler refused the step for memory"]


def test_a_length_cell_is_one_row_of_t_tokens_per_device():
  from attn_jax.bench import hardware_page as hp
  from configs import sisa_152m
  c = hp._config(sisa_152m.get_config, (4, 1, 1), 32768)
  assert (c.data.seq_len, c.data.global_batch_size, c.train.grad_accum) == (32768, 4, 1)
  assert c.model.max_seq_len >= 32768
  row = hp.LENGTH_ROWS[0]
  f = sisa_152m.get_config
  assert hp.fingerprint(f, row, 2048) != hp.fingerprint(f, row, 8192)


def test_presets_are_the_152m_and_369m_configs():
  """The page's presets from every config file (as experiments/hardware_page.py loads them):
  the 152M / 369M models, 152M first, no study config."""
  import importlib
  from attn_jax.bench import hardware_page as hp
  every = {p.stem: importlib.import_module(f"configs.{p.stem}").get_config
           for p in (ROOT / "configs").glob("*.py") if not p.stem.startswith("_")}
  names = hp.preset_names(every)
  assert "sisa_152m" in names and "transformer_369m" in names and "quickstart" not in names
  assert "study_152m" not in names                                      # runs many presets
  assert names.index("transformer_152m") < names.index("alibi_369m")   # 152M first
