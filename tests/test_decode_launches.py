"""Kernel launches of the one-token decode step on an H100 (compile only, batch 1), and no
per-step parameter cast in the generation loop.

The decode step runs its layers unrolled (`Decoder._decode_layers`), so its launches are
a + b * n_layers: `b` per layer and `a` for the embedding, the head and the rest. Both are read
from two compiles of the mixer's preset at one and two periods of its layer pattern (the
152M widths, so XLA's fusion choices are those of the real model) and the step is held to at
most 12 launches per layer + 16 at the preset's own depth (`LIMIT`).
Mixers that do not meet it yet are expected failures (strict: one that starts meeting it
fails until it is listed as meeting it), each with its figures and what it lacks.
"""

from __future__ import annotations

import importlib
import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attn_jax import decode, targets
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig, validate_model
from attn_jax.train import aot, hlo_loops

TARGET = "h100x1"
PROMPT = 16
PRESETS = {"attention": "transformer_152m", "alibi": "alibi_152m", "fox": "fox_152m",
           "sisa": "sisa_152m", "sinkhorn": "sinkhorn_152m", "mamba2": "mamba2_152m",
           "mamba3": "mamba3_152m", "hybrid_heads": "hybrid_head_152m",
           "hybrid_block": "hybrid_block_152m"}


def LIMIT(n_layers: int) -> int:
  return 12 * n_layers + 16


def _preset(name: str, n_periods: int):
  c = importlib.import_module(f"configs.{name}").get_config()
  period = len(c.model.pattern) or 1
  c.model.n_layers = period * n_periods
  c.data.update(seq_len=PROMPT, global_batch_size=1)
  c.train.grad_accum = 1
  return c, period


def decode_launches(name: str) -> tuple[float, float, int]:
  """(launches per layer, the rest, the preset's depth) of the preset's one-token decode step
  compiled for an H100 at batch 1."""
  if not targets.available(TARGET):
    pytest.skip(f"compile target {TARGET} unavailable here (pip install -e '.[targets]')")
  depth = importlib.import_module(f"configs.{name}").get_config().model.n_layers
  counts = []
  for n in (1, 2):
    c, period = _preset(name, n)
    r = aot.compile_for_target(c, TARGET, programs=("decode",), search_fit=False)
    counts.append(next(p for p in r.programs if p.name == "decode").launches)
  per_layer = (counts[1] - counts[0]) / period
  return per_layer, counts[0] - per_layer * period, depth


def _check(mixer: str) -> None:
  per_layer, rest, depth = decode_launches(PRESETS[mixer])
  total = rest + per_layer * depth
  print(f"\n{mixer}: {per_layer:g} launches per layer + {rest:g} = {total:g} at {depth} layers "
        f"(limit {LIMIT(depth)})")
  assert total <= LIMIT(depth), (f"{mixer}: {per_layer:g} per layer + {rest:g} = {total:g} "
                                 f"launches at {depth} layers > 12 * {depth} + 16")


def _over(mixer: str, why: str):
  return pytest.param(mixer, marks=pytest.mark.xfail(strict=True, reason=why), id=mixer)


def test_the_transformers_decode_step_launches_at_most_12_per_layer_plus_16():
  """The default suite's case (two compiles of the 152M widths, ~40 s on a loaded 2-core
  machine): 12 per layer + 6 = 150 at 12 layers, the RoPE, cache write and attention of a
  layer one kernel (`kernels/decode_attend.py`)."""
  _check("attention")


@pytest.mark.slow
@pytest.mark.parametrize("mixer", [
    _over("alibi", "21 per layer + 4 = 256: the score-bias softmax is 3 kernels, the shift of s_j 1"),
    _over("fox", "22 per layer + 4 = 268: its forget gate is a matmul of its own, the biased softmax 3 kernels"),
    _over("sisa", "26 per layer + 14 = 326: its widened [cache ; new] scores and state-term projections"),
    _over("sinkhorn", "43 per layer + 13 = 529: the per-token causal balancing (unrolled iterations)"),
    "mamba2",          # 11 per layer + 4 = 345 at 31 layers (one conv window, out-major out)
    _over("mamba3", "15 per layer + 4 = 454 at 30 layers: the carried angle / k / x copied (3), "
          "the rotation's two slice kernels, the angle window's select"),
    _over("hybrid_heads", "24 per layer + 6 = 294: the SSM heads' decode ops"),
    "hybrid_block",    # passes since the Mamba-2 layers' 11
])
def test_every_mixers_decode_step_launches_at_most_12_per_layer_plus_16(mixer):
  """Every other mixer's preset: two compiles each, 20-60 s."""
  _check(mixer)


# ------------------------------------------------------------------ no per-step parameter cast

_WHILE_RE = re.compile(r"^\s+(?:ROOT )?%[\w.-]+ = \((.*?)\) while\(", re.M)
_ARRAY_RE = re.compile(r"\b(\w+)\[([\d,]*)\]")


def loop_state(text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every element of every while loop's state in a compiled program: what the
  loop carries from step to step, the parameters it reads included."""
  return [(m.group(1), _squeezed(int(d) for d in m.group(2).split(",") if d))
          for w in _WHILE_RE.finditer(text) for m in _ARRAY_RE.finditer(w.group(1))]


def _squeezed(dims) -> tuple[int, ...]:
  """Dims without the size-1 ones (XLA may carry a layer's slice as [1, ...])."""
  return tuple(d for d in dims if d != 1)


def _weight_shapes(model) -> set[tuple[int, ...]]:
  """The shapes of the model's matrices (>= 2 dims), stacked over the repeats and one repeat's
  slice, each also as the 2-D matrix a matmul reads."""
  out = set()
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    s = tuple(v[...].shape)
    for t in (s, s[1:]):
      if len(t) >= 2:
        out.update({t, (t[0], math.prod(t[1:])), (math.prod(t[:-1]), t[-1])})
  return {_squeezed(t) for t in out}


def _compiled_loop(fn, *args) -> str:
  """`fn` jitted and compiled for the H100 on the arguments' shapes."""
  if not targets.available(TARGET):
    pytest.skip(f"compile target {TARGET} unavailable here (pip install -e '.[targets]')")
  dev = targets.devices(TARGET)[0]
  sh = jax.sharding.SingleDeviceSharding(dev)
  spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=sh)
  with targets.no_persistent_cache():
    return jax.jit(fn).lower(*jax.tree.map(spec, args)).compile().as_text()


def test_the_generation_loop_casts_no_parameter_per_step():
  """`decode.generate`'s loop (prefill, then a `while` over steps) on a bf16 model with fp32
  parameters: every weight matrix the loop carries is bf16 (`for_decoding` cast it once, before
  the loop; a step reads 2 bytes a weight, no fp32 copy). The control: the same loop over the
  uncast model carries its fp32 matrices and casts them in every step, which the check sees.
  (The converts inside the body are no measure: XLA shares fused computations between the
  prefill and the loop, and a matmul's fusion widens its bf16 operand in the kernel.)"""
  cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, d_ff=384,
                    max_seq_len=64, dtype="bfloat16", param_dtype="float32")
  validate_model(cfg)
  model = build_model(cfg)
  weights = _weight_shapes(model) | _weight_shapes(model.for_decoding())
  graphdef, state = nnx.split(model)
  prompt = jnp.zeros((1, 8), jnp.int32)

  def generate(state, prompt_BT):
    return decode._generate_jit(
        graphdef, state, prompt_BT, jnp.ones((1,), jnp.int32) * 8, jax.random.key(0),
        jnp.float32(0), jnp.int32(-1), jnp.int32(0), max_new_tokens=4, cache_len=16,
        greedy=True, top_k=0, policy=None)

  def uncast(state, prompt_BT):   # the control: steps on the fp32 parameters
    m = nnx.merge(graphdef, state)
    _, st = decode.prefill(m, prompt_BT, capacity=16)

    def body(i, carry):
      logits_BV, st = decode.decode_step(m, carry[0], jnp.full((1,), 8, jnp.int32) + i, carry[1])
      return jnp.argmax(logits_BV, -1).astype(jnp.int32), st
    n = jnp.int32(4) + prompt_BT[0, 0]   # a count the compiler does not know
    return jax.lax.fori_loop(0, n, body, (prompt_BT[:, 0], st))

  carried = loop_state(_compiled_loop(generate, state, prompt))
  matrices = [(dt, d) for dt, d in carried if d in weights]
  assert len(matrices) >= 2 * 4 + 1, carried   # 4 matrices a layer, the embedding
  assert all(dt == "bf16" for dt, _ in matrices), f"fp32 weights in the decoding loop: {matrices}"
  control = [(dt, d) for dt, d in loop_state(_compiled_loop(uncast, state, prompt))
             if d in weights]
  assert any(dt == "f32" for dt, _ in control), control
