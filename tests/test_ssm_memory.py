"""Train-step memory of the SSM mixers (mamba2.py's docstring, "Rematerialisation"): a full
forward keeps only its in-projection outputs for the backward pass, so the SSD's fp32 chunk
internals are never held across layers and a stack of Mamba-2 layers needs no more activation
memory than a Transformer of the same width and depth."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
# `saved_residuals` is what `jax.ad_checkpoint.print_saved_residuals` prints, as data.
from jax._src.ad_checkpoint import saved_residuals

from attn_jax import model as model_lib
from attn_jax.layers import causal_positions
from attn_jax.model_config import ModelConfig
from attn_jax.ssm.hybrid_heads import HybridHeads
from attn_jax.ssm.mamba2 import IN_PROJ, Mamba2
from attn_jax.ssm.mamba3 import Mamba3

CFG = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=64, dtype="bfloat16",
                  attention_impl="xla")
B, T = 2, 16


def _in_width(layer) -> int:
  """The fused in-projection's output width: z, x, B, C, dt (+ A, lambda, theta) side by side
  (`mamba2.fused_projection`)."""
  return sum(math.prod(lin.out_shape) for lin in layer.in_projections())


def _layer(cls):
  return cls(CFG, cls.tiny(), rngs=nnx.Rngs(0))


def _kept(fn, layer):
  """(aval, why) of every float the backward pass of sum(fn(layer, x)) keeps that is not an
  argument (parameters, x). (Integer positions a layer makes are left out.)"""
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, CFG.d_model), jnp.bfloat16)

  def loss(state, x):
    return jnp.sum(fn(nnx.merge(graphdef, state), x).astype(jnp.float32))
  return [(a, why) for a, why in saved_residuals(loss, state, x)
          if not why.startswith("from the argument") and jnp.issubdtype(a.dtype, jnp.floating)]


def _full_forward(m, x):
  return m(x, positions_BT=None)[0]


def _named(kept):
  return [a for a, why in kept if f"named '{IN_PROJ}'" in why]


@pytest.mark.parametrize("name,cls", [("mamba2", Mamba2), ("mamba3", Mamba3)])
def test_full_forward_keeps_only_the_in_projections(name, cls):
  """Every float a full forward keeps for the backward is an in-projection output, in bf16."""
  layer = _layer(cls)
  kept = _kept(_full_forward, layer)
  assert kept and all(f"named '{IN_PROJ}'" in why for _, why in kept), kept
  assert [a.shape for a, _ in kept] == [(B, T, _in_width(layer))], (name, kept)   # one matmul's
  assert all(a.dtype == jnp.bfloat16 for a, _ in kept), kept


def test_hybrid_heads_keep_the_attention_branch_and_the_in_projections():
  """The head-fusion layer keeps what its attention branch alone keeps plus the SSM branch's
  in-projection output (its five projections as one), nothing of the SSD."""
  layer = _layer(HybridHeads)
  kept = _kept(_full_forward, layer)

  def attention_branch(m, x):
    return m._attention(x, causal_positions(B, T), None, plain=True)[0]
  attn = _kept(attention_branch, layer)
  assert [a.shape for a in _named(kept)] == [(B, T, _in_width(layer.ssm))]
  assert sorted(str(a) for a, _ in kept) == sorted(
      [str(a) for a, _ in attn] + [str(a) for a in _named(kept)]), (kept, attn)


def _stack_temporaries(pattern: tuple[str, ...], n_layers: int) -> int:
  """Compiled temporaries of the gradient of a small Decoder (d 128, bf16, batch 2 x 128;
  abstract shapes: nothing runs)."""
  cfg = ModelConfig(d_model=128, n_heads=2, n_layers=n_layers, d_ff=512, vocab_size=256,
                    max_seq_len=128, pattern=pattern)
  graphdef, state = nnx.split(model_lib.abstract_model(cfg))

  def loss(state, tokens):
    return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)
  tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
  return jax.jit(jax.grad(loss)).lower(state, tokens).compile().memory_analysis(
      ).temp_size_in_bytes


def test_mamba2_stack_needs_no_more_than_a_transformer():
  """The 152M configs' proportions at small width: 10 Mamba-2 blocks (no MLP) against 4
  Transformer layers (31 vs 12 at 152M). Keeping the SSD internals made the Mamba-2 stack's
  temporaries 3.5x the Transformer's here (as at 152M, batch 4 x 2048); now ~0.7x."""
  transformer = _stack_temporaries((), 4)
  mamba2 = _stack_temporaries(("mamba2:nomlp",), 10)
  assert mamba2 <= 1.5 * transformer, (mamba2, transformer)
