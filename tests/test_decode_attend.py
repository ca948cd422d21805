"""`kernels/decode_attend.py` (one token's RoPE, cache write and attention in one Pallas kernel)
in the Pallas interpreter on a CPU, against the XLA path of `cache.cached_attention` it
replaces on a GPU: the same output, cache, positions and pointer."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import decode, kernel_choice
from attn_jax.attention import cache as cache_lib
from attn_jax.kernels import decode_attend
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig, validate_model

THETA = 10000.0


def _cache(dtype, B=2, H=4, K=2, D=32, S=20, lengths=(7, 5), seed=0):
  """A Linear cache holding `lengths[b]` tokens in row b (written by the XLA path)."""
  ks = jax.random.split(jax.random.key(seed), 3)
  T0 = max(lengths)
  pos = jnp.array([list(range(n)) + [-1] * (T0 - n) for n in lengths], jnp.int32)
  q, k, v = (jax.random.normal(kk, (B, T0, n, D), dtype) for kk, n in zip(ks, (H, K, K)))
  cache = cache_lib.init_cache(cache_lib.LINEAR, B, S, K, D, D, dtype)
  return cache_lib.cached_attention(cache, q, k, v, pos, theta=THETA, scale=D ** -0.5)[1]


def _token(dtype, B=2, H=4, K=2, D=32, seed=1):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (B, 1, n, D), dtype) for kk, n in zip(ks, (H, K, K)))


def _both(cache, q, k, v, pos_BT):
  """(XLA path, kernel path) of one `cached_attention` step."""
  D = q.shape[-1]
  run = lambda: cache_lib.cached_attention(cache, q, k, v, pos_BT, theta=THETA, scale=D ** -0.5)
  ref = jax.jit(run)()
  with kernel_choice.kernels_on_cpu():
    got = jax.jit(run)()
  return ref, got


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("positions", [(7, 5), (7, -1)], ids=["both-rows", "padding-row"])
def test_the_kernel_step_equals_the_xla_path(dtype, atol, positions):
  """Rows of different lengths, G = 2 query heads per kv head, S = 20 slots in blocks of 16
  (a masked tail), a padding row (written nowhere, zeros out): the output agrees to fp32
  reassociation (fp32) or one bf16 rounding of the probabilities (bf16: the XLA path rounds
  them to bf16 before the value product, the kernel does not); the cache, positions and
  pointer are the XLA path's exactly."""
  cache = _cache(dtype)
  pos = jnp.array([[p] for p in positions], jnp.int32)
  (o_ref, c_ref), (o, c) = _both(cache, *_token(dtype), pos)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                             atol=atol, rtol=atol)
  for name in ("k", "v"):   # RoPE'd key in the cache's dtype: at most one ulp apart
    np.testing.assert_allclose(np.asarray(getattr(c, name), np.float32),
                               np.asarray(getattr(c_ref, name), np.float32), rtol=1e-6,
                               atol=1e-6)
  chex.assert_trees_all_equal((c.pos, c.ptr), (c_ref.pos, c_ref.ptr))
  if positions[1] < 0:
    assert not np.any(np.asarray(o[1], np.float32)), "a padding query's output is zeros"


def test_block_size_and_grid_change_nothing():
  """One block (block_s >= S) and many (block_s = 4) give the same output (fp32) on the
  kernel's own interface, the fused [B, K, G + 2, D] input."""
  cache = _cache(jnp.float32)
  q, k, v = _token(jnp.float32)
  B, _, H, D = q.shape
  qkv = jnp.concatenate([q[:, 0].reshape(B, 2, H // 2, D), k[:, 0, :, None], v[:, 0, :, None]],
                        axis=2)
  pos = jnp.array([7, 5], jnp.int32)
  cos, sin = (jnp.cos(pos[:, None] * 0.1 * jnp.arange(D // 2)),
              jnp.sin(pos[:, None] * 0.1 * jnp.arange(D // 2)))
  run = lambda bs: decode_attend.decode_attend(qkv, cos, sin, cache.k, cache.v, cache.pos,
                                               cache.ptr + 1, pos, scale=D ** -0.5, block_s=bs,
                                               interpret=True)
  a, b = run(4), run(64)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_equal(a[1:], b[1:])


def test_a_models_decode_steps_on_the_kernel_equal_the_xla_path():
  """A 2-layer GQA Transformer: prefill, then three one-token steps, on the XLA path and with
  the kernel (the decoding copy: fused q/k/v read as one buffer; the original: joined), fp32:
  the same logits and states."""
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                    max_seq_len=32, dtype="float32", param_dtype="float32")
  validate_model(cfg)
  model = build_model(cfg)
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 64)

  def run(m):
    _, st = decode.prefill(m, tokens[:, :6], capacity=16)
    out = []
    for i in range(3):
      logits, st = decode.decode_step(m, tokens[:, 6 + i], jnp.full((2,), 6 + i, jnp.int32), st)
      out.append(logits)
    return out, st

  for m in (model, model.for_decoding()):
    ref = run(m)
    with kernel_choice.kernels_on_cpu():
      got = run(m)
    chex.assert_trees_all_close(got, ref, atol=2e-5, rtol=2e-5)


def test_the_choice():
  """The kernel on a GPU (or inside `kernels_on_cpu`), not on a CPU or TPU; shapes it does
  not take (a head_dim that is no power of two) keep the XLA path."""
  ok = lambda plat: None
  with kernel_choice.use_platform("gpu"):
    assert kernel_choice.decode_kernel(ok, what="t")
  with kernel_choice.use_platform("tpu"):
    assert not kernel_choice.decode_kernel(ok, what="t")
  with kernel_choice.use_platform("cpu"):
    assert not kernel_choice.decode_kernel(ok, what="t")
    with kernel_choice.kernels_on_cpu():
      assert kernel_choice.decode_kernel(ok, what="t")
  k = jnp.zeros((1, 2, 8, 24))
  assert "power of two" in decode_attend.unsupported(4, k, k, "gpu")
  assert "multiple" in decode_attend.unsupported(3, jnp.zeros((1, 2, 8, 32)),
                                                 jnp.zeros((1, 2, 8, 32)), "gpu")
  assert decode_attend.unsupported(4, jnp.zeros((1, 2, 8, 64)), jnp.zeros((1, 2, 8, 64)),
                                   "gpu") is None
