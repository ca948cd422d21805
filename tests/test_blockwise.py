"""kernels/blockwise.py: past-block attention (query block I over key blocks J < I) equals an
explicit masked softmax, values and gradients (through out *and* lse), for the plain dot
score and a score with a shared parameter and per-pair reference (SISA's form)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.kernels import blockwise
from attn_jax.kernels.masks import NEG_INF

TOL = 2e-5  # fp32, fixed once


def _reference(scores_BHTS, v_BSKE, block):
  """Explicit form: softmax over keys in earlier blocks; rows with none get (0, NEG_INF)."""
  B, H, T, S = scores_BHTS.shape
  qb = jnp.arange(T)[:, None] // block
  kb = jnp.arange(S)[None, :] // block
  seen = kb < qb
  s = jnp.where(seen, scores_BHTS, -jnp.inf)
  m = jnp.max(jnp.where(seen, scores_BHTS, NEG_INF), axis=-1, keepdims=True)
  e = jnp.where(seen, jnp.exp(s - m), 0.0)
  z = jnp.sum(e, -1, keepdims=True)
  has = z > 0
  p = e / jnp.where(has, z, 1.0)
  K = v_BSKE.shape[2]
  o = jnp.einsum("bkgts,bske->btkge", p.reshape(B, K, H // K, T, S), v_BSKE)
  lse = jnp.where(has, m + jnp.log(jnp.where(has, z, 1.0)), NEG_INF)[..., 0]
  return o.reshape(B, T, H, -1), lse.transpose(0, 2, 1)


def _data(B=2, T=12, H=4, K=2, D=8, E=6, seed=0):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return f(B, T, H, D), f(B, T, H, D), f(B, T, K, E), f(B, T, H, E), f(B, T, H)


def _objective(fn, *args, gout, glse):
  out, lse = fn(*args)
  # lse of block-0 rows is the constant NEG_INF: weight 0 there keeps the sums finite
  live = lse > NEG_INF / 2
  return jnp.sum(out * gout) + jnp.sum(jnp.where(live, lse, 0.0) * glse)


@pytest.mark.parametrize("block", [1, 3, 4, 12])
def test_dot_scores_equal_masked_softmax_values_and_gradients(block):
  q, k, v, gout, glse = _data()
  scale = 0.37
  kk = jnp.repeat(k, 1, axis=2)

  def ours(q, k, v):
    return blockwise.past_blocks(blockwise.dot_scores(scale), (), q, k, v, block=block)

  def ref(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    return _reference(s, v, block)

  got, want = jax.jit(ours)(q, kk, v), ref(q, kk, v)
  chex.assert_trees_all_close(got, want, rtol=TOL, atol=TOL)
  g1 = jax.grad(functools.partial(_objective, ours, gout=gout, glse=glse), argnums=(0, 1, 2))(
      q, kk, v)
  g2 = jax.grad(functools.partial(_objective, ref, gout=gout, glse=glse), argnums=(0, 1, 2))(
      q, kk, v)
  chex.assert_trees_all_close(g1, g2, rtol=TOL, atol=TOL)


def _decay_scores(shared, qa, ka):
  """A SISA-like pair score: scale q.k + w (e^{g_i - r} c_i).(e^{r - g_j} b_j), r = the key
  block's last g (per pair), w a shared learned weight."""
  (w,) = shared
  q, c, gq = qa
  k, b, gk = ka
  r = gk[:, -1]                                                        # [B, H]
  qf = jnp.exp(gq - r[:, None]) * w
  kf = jnp.exp(r[:, None] - gk)
  qh = jnp.concatenate([q, qf[..., None] * c], -1)
  kh = jnp.concatenate([k, kf[..., None] * b], -1)
  return jnp.einsum("bthd,bshd->bhts", qh, kh) * 0.3


def test_pair_score_with_shared_parameter_and_reference_gradients():
  B, T, H, D, N, blk = 2, 16, 2, 4, 3, 4
  r = np.random.default_rng(1)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q, k, c, b = f(B, T, H, D), f(B, T, H, D), f(B, T, H, N), f(B, T, H, N)
  g = -jnp.cumsum(jnp.abs(f(B, T, H)), axis=1)                         # decreasing, as SISA's
  v, gout, glse, w = f(B, T, H, 5), f(B, T, H, 5), f(B, T, H), jnp.float32(0.8)

  def ours(w, q, c, g, k, b, v):
    return blockwise.past_blocks(_decay_scores, (w,), (q, c, g), (k, b, g), v, block=blk)

  def ref(w, q, c, g, k, b, v):
    dec = jnp.exp(g.transpose(0, 2, 1)[..., :, None] - g.transpose(0, 2, 1)[..., None, :])
    s = 0.3 * (jnp.einsum("bthd,bshd->bhts", q, k)
               + w * dec * jnp.einsum("bthn,bshn->bhts", c, b))
    return _reference(s, v, blk)

  args = (w, q, c, g, k, b, v)
  chex.assert_trees_all_close(jax.jit(ours)(*args), ref(*args), rtol=TOL, atol=TOL)
  grad = lambda fn: jax.grad(functools.partial(_objective, fn, gout=gout, glse=glse),
                             argnums=tuple(range(7)))(*args)
  chex.assert_trees_all_close(grad(ours), grad(ref), rtol=TOL, atol=TOL)


def test_memory_is_linear_in_length():
  """Compiled fwd+bwd temporaries at a fixed block: doubling T about doubles them (a [T, T]
  score would quadruple them)."""
  def temp(T):
    q = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    v = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)

    def loss(q, k, v):
      out, lse = blockwise.past_blocks(blockwise.dot_scores(0.25), (), q, k, v, block=64)
      return jnp.sum(out) + jnp.sum(jnp.where(lse > NEG_INF / 2, lse, 0.0))
    c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, v).compile()
    return c.memory_analysis().temp_size_in_bytes
  t1, t2, t4 = temp(1024), temp(2048), temp(4096)
  assert t2 / t1 < 2.3 and t4 / t2 < 2.3, (t1, t2, t4)


def test_bad_lengths_and_block_pair_shapes_error():
  q = jnp.zeros((1, 10, 2, 4))
  with pytest.raises(ValueError, match="not a multiple of the block 4"):
    blockwise.past_blocks(blockwise.dot_scores(1.0), (), q, q, q, block=4)
  with pytest.raises(ValueError, match="same length"):
    blockwise.past_blocks(blockwise.dot_scores(1.0), (), q, q[:, :8], q, block=2)
  for bad in ((1, 2, 5, 5), (2, 2, 2, 2), (1, 3, 2, 2)):   # wrong batch, blocks, heads
    with pytest.raises(ValueError, match=r"block-pair term needs shape \[B, H, N, N\] = "
                                          r"\(1, 2, 2, 2\)"):
      blockwise.past_blocks(blockwise.dot_scores(1.0), (), q[:, :8], q[:, :8], q[:, :8], block=4,
                        block_bias_BHNN=jnp.zeros(bad))


def test_segments_mask_other_documents_values_and_gradients():
  """segment_ids_BT: pairs of different documents get p = 0; rows whose document has no key in
  an earlier block get (0, NEG_INF); values and gradients == the explicit form masked by
  document (documents of 1, 6, 2 and 3 tokens: one inside a block, ones spanning blocks)."""
  q, k, v, gout, glse = _data()
  seg = jnp.asarray(np.repeat(np.arange(1, 5), (1, 6, 2, 3))[None].repeat(2, 0), jnp.int32)
  seg = seg.at[1].set(1)                                     # row 1: one document
  scale, block = 0.37, 3

  def ours(q, k, v):
    return blockwise.past_blocks(blockwise.dot_scores(scale), (), q, k, v, block=block,
                             segment_ids_BT=seg)

  def ref(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    same = (seg[:, :, None] == seg[:, None, :])[:, None]
    return _reference(jnp.where(same, s, -jnp.inf), v, block)

  got, want = jax.jit(ours)(q, k, v), ref(q, k, v)
  chex.assert_trees_all_close(got, want, rtol=TOL, atol=TOL)
  # token 7 opens document 3 inside block 2: no key of its document in an earlier block
  assert np.all(np.asarray(got[1])[0, 7] == NEG_INF) and np.all(np.asarray(got[0])[0, 7] == 0)
  assert np.all(np.asarray(got[1])[0, 6] > NEG_INF / 2)   # token 6 (document 2) has some
  g1 = jax.jit(jax.grad(functools.partial(_objective, ours, gout=gout, glse=glse),
                        argnums=(0, 1, 2)))(q, k, v)
  g2 = jax.grad(functools.partial(_objective, ref, gout=gout, glse=glse), argnums=(0, 1, 2))(
      q, k, v)
  chex.assert_trees_all_close(g1, g2, rtol=TOL, atol=TOL)
