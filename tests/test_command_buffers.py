"""command_buffers.py: the decoding programs' XLA:GPU command-buffer options and the dump reader;
train/decode_graphs.py: a tiny model's one-token step and generation loop compiled for a
compile-only H100 with and without them, read from the thunk dump."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attn_jax import command_buffers as cb, decode, kernel_choice, targets
from attn_jax.model_config import ModelConfig, validate_model

# A thunk sequence after the thunk passes as XLA:GPU writes it (jax 0.10.2, a fori_loop of a
# matmul with tanh + sin, WHILE enabled, min graph size 1): one command buffer holding
# everything, the loop inside it.
CAPTURED = """\
000: kCommandBuffer [source | sink] 
    001: kCopy         [source       | next=004 (3)] kCopy
    002: kCopy         [source       | next=003 (1)] kCopy
    003: kCustomKernel [prev=002 (1) | next=004 (1)] loop_select_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    004: kWhile        [prev=003 (1) | sink        ]       
condition:
        005: kCustomKernel [source | sink] wrapped_compare grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        006: kCustomKernel [source       | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        007: kCustomKernel [source       | next=008 (1)] gemm_fusion_dot_general_1 grid: [4, 1, 1] threads: [64, 1, 1]  shared_memory: 1024 bytes
        008: kCustomKernel [prev=007 (1) | sink        ] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""
# The same without WHILE: the loop driven by the host, its body one command buffer, its
# condition's kernel launched alone (below the minimum graph size).
HOST_DRIVEN = """\
000: kCommandBuffer [source       | next=004 (1)] 
    001: kCopy         [source       | sink        ] kCopy
    002: kCopy         [source       | next=003 (1)] kCopy
    003: kCustomKernel [prev=002 (1) | sink        ] loop_select_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
004: kWhile         [prev=000 (1) | sink        ]   
condition:
    005: kCustomKernel [source | sink] wrapped_compare grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink] 
        006: kCustomKernel [source       | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        007: kCustomKernel [source       | next=008 (1)] gemm_fusion_dot_general_1 grid: [4, 1, 1] threads: [64, 1, 1]  shared_memory: 1024 bytes
        008: kCustomKernel [prev=007 (1) | sink        ] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""
META = 'thunk_metadata {\n  thunk_info {\n    profile_annotation: "while.5"\n    thunk_id: 4\n  }\n}\n'


# ------------------------------------------------------------------ units (no compiling)

def test_the_reader_nests_thunks_by_indentation_and_counts_what_is_captured():
  top = cb.read_thunks(CAPTURED)
  assert [t.kind for t in top] == ["kCommandBuffer"]
  (loop,) = [t for t in top[0].children if t.kind == "kWhile"]
  assert loop.regions == ["condition", "body", "body", "body"]
  assert [c.name for c in loop.children] == ["wrapped_compare", "loop_add_fusion_1",
                                             "gemm_fusion_dot_general_1", "loop_add_fusion"]
  c = cb.capture_of(top, cb.read_names(META))
  assert (c.command_buffers, c.inside, c.outside, c.host_launches) == (1, 7, 0, 1)
  assert c.by_kind == {"kCopy": (2, 0), "kCustomKernel": (5, 0)}
  assert c.loops == (cb.Loop("while.5", True, 4, 0, 0),)

  h = cb.capture_of(cb.read_thunks(HOST_DRIVEN), cb.read_names(META))
  assert (h.command_buffers, h.inside, h.outside, h.host_launches) == (2, 6, 1, 1)
  # per iteration: the condition's kernel, then the body's command buffer
  assert h.loops == (cb.Loop("while.5", False, 3, 1, 2),)
  assert "host-driven, 2 host launches per iteration" in h.summary()


def test_options_are_gpu_only_a_full_list_and_switched_off_by_env_or_context(monkeypatch):
  monkeypatch.delenv(cb.ENV, raising=False)
  assert cb.compiler_options("cpu") == {} and cb.compiler_options("tpu") == {}
  names = cb.compiler_options("gpu")[cb.FLAG].split(",")
  assert names[-1] == "WHILE" and set(cb.COMMON_DEFAULT) <= set(names)
  assert all(not n.startswith(("+", "-")) for n in names)   # per program: no "+WHILE" form
  with cb.use(False):
    assert cb.compiler_options("gpu") == {}
  for off in ("0", "off", "False"):
    monkeypatch.setenv(cb.ENV, off)
    assert cb.compiler_options("gpu") == {}
    with cb.use(True):
      assert cb.compiler_options("gpu") != {}
  monkeypatch.setenv(cb.ENV, "maybe")
  with pytest.raises(ValueError, match=cb.ENV):
    cb.enabled()
  monkeypatch.delenv(cb.ENV)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")   # the process's choice
  assert cb.compiler_options("gpu") == {}


def test_decoding_programs_take_the_options_for_the_platform_they_are_traced_for(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  options = kernel_choice.stateful_compiler_options   # decode.jit_stateful's and generate's
  with kernel_choice.use_platform("gpu"), cb.use(True):
    assert options()[cb.FLAG].endswith(",WHILE")
  with kernel_choice.use_platform("gpu"), cb.use(False):
    assert cb.FLAG not in options()
  for plat in ("cpu", "tpu"):
    with kernel_choice.use_platform(plat), cb.use(True):
      assert cb.FLAG not in options()


def test_the_h100_target_states_a_cuda_driver_and_runtime():
  text = targets.H100.target_config()
  assert 'driver_version: "12.8.0"' in text and 'runtime_version: "12.8.0"' in text


# ------------------------------------------------------------------ compiled for an H100

def _h100():
  if not targets.available("h100x1"):
    pytest.skip("compile target h100x1 unavailable here (pip install -e '.[targets]')")
  return targets.devices("h100x1")[0]


# XLA makes a command buffer of at least 5 consecutive thunks by default; the toy loop has
# fewer, so its tests lower the minimum (the decoding programs below keep the default)
MIN_SIZE_1 = {"xla_gpu_graph_min_graph_size": 1}


def _loop_program(x_BD, w_DD):
  """A loop of data-dependent trip count (a while loop, as generation's): 3 kernels in its body,
  1 in its condition, 3 thunks before it."""
  def body(_, x):
    return jnp.tanh(x @ w_DD) + jnp.sin(x)
  return jax.lax.fori_loop(0, (x_BD[0, 0] > 0).astype(jnp.int32) * 10, body, x_BD)


def _compile_loop(device, on: bool, options=MIN_SIZE_1) -> cb.Compiled:
  sh = NamedSharding(Mesh(np.array([device]), ("x",)), P())
  args = (jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=sh),
          jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=sh))
  with kernel_choice.use_platform(device), cb.use(on):
    jitted = decode.jit_stateful(_loop_program)   # the decoding programs' own jit
  return cb.compile_with_dump(lambda: jitted.lower(*args), options)


def test_with_the_options_a_while_loop_is_inside_a_command_buffer_on_h100():
  """Through `decode.jit_stateful` (graph size 1): on, the loop is captured with its condition
  and body; off (XLA's default set), the host drives it. The set XLA applied is read back from the dump:
  with the options, this line's default plus WHILE. Memory analysis is unchanged (capture
  comes after buffer assignment). ~5 s."""
  device = _h100()
  on, off = _compile_loop(device, True), _compile_loop(device, False)
  assert set(off.commands) == set(cb.default_commands()), \
      f"XLA's default on this line changed: {off.commands} (update command_buffers.COMMON_DEFAULT)"
  assert on.commands == cb.decode_commands()
  assert [lp.captured for lp in on.capture.loops] == [True]
  assert on.capture.outside == 0 and on.capture.host_launches == 1
  assert [lp.captured for lp in off.capture.loops] == [False]
  assert off.capture.loops[0].per_iteration >= 1
  assert on.memory == off.memory


@pytest.mark.skipif(jax.__version_info__ >= (0, 11),
                    reason="jax >= 0.11's XLA captures while loops on a device stating no CUDA "
                           "version; the gate tested here is jax 0.10.2's")
def test_jax_0_10_captures_no_while_loop_for_a_device_older_than_cuda_12_3():
  """Why `targets.GpuSpec.cuda` exists: the same H100 stating CUDA 12.2 gets kernels and copies
  captured, never the loop (XLA drops WHILE below 12.3). ~5 s."""
  import dataclasses
  from jax.experimental import topologies
  _h100()
  old = dataclasses.replace(targets.H100, cuda=(12, 2, 0))
  topo = topologies.get_topology_desc(platform="cuda", topology_name="1x1x1", topology="1x1x1",
                                      target_config=old.target_config())
  got = _compile_loop(topo.devices[0], True)
  assert "WHILE" in got.commands   # asked for, and dropped by the pass
  assert got.capture.command_buffers >= 1 and [lp.captured for lp in got.capture.loops] == [False]


def _tiny_cfg() -> ModelConfig:
  cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=64,
                    dtype="bfloat16", param_dtype="float32")
  validate_model(cfg)
  return cfg


@pytest.mark.slow
def test_decode_step_and_generation_loop_run_as_command_buffers_on_h100():
  """A one-layer bf16 Transformer: its one-token step is one command buffer with every kernel
  inside, with the options and without (XLA's default captures kernels, copies and library
  calls: nothing in a step needs WHILE); its generation program (`decode.generate`: prefill +
  the while loop of steps) is one command buffer with the loop inside only with them, and
  without them the loop is host-driven. Memory analysis equal. 30-60 s on a shared 2-core CPU
  (four compiles), so slow; CI runs it (tests/ci_extra.txt)."""
  from attn_jax.train import decode_graphs
  _h100()
  step, gen = decode_graphs.capture_report(_tiny_cfg(), "h100x1", prompt=4, new_tokens=4)
  assert step.program == "step" and gen.program == "generate"
  for c in (step.on, step.off):
    assert c.capture.command_buffers == 1 and c.capture.outside == 0
    assert c.capture.inside >= 10 and c.capture.host_launches == 1 and not c.capture.loops
  assert gen.on.capture.host_launches == 1 and gen.on.capture.outside == 0
  (loop,) = gen.on.capture.loops
  assert loop.captured and loop.inside >= step.on.capture.inside
  (loop,) = gen.off.capture.loops
  assert not loop.captured and loop.per_iteration >= 1
  assert step.on.memory == step.off.memory and gen.on.memory == gen.off.memory


def test_the_hardware_page_holds_the_command_buffer_section_it_generates():
  import pathlib
  from attn_jax.bench import hardware_page as hp
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "hardware.md").read_text()
  assert hp.COMMAND_BUFFERS.rstrip("\n") in page
  assert "| transformer_152m | step |" in hp.COMMAND_BUFFERS
