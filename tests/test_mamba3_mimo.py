"""ssm/mamba3.py, MIMO (`mimo_rank`): chunked == the token-by-token recurrence (several chunk
sizes, lengths not divisible by the chunk, carried state), decoding == the full forward,
rank 1 == the SISO mixer."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.model_config import ModelConfig, validate_model
from attn_jax.ssm import mamba3 as M
from attn_jax.ssm.mamba3 import Mamba3

TOL = dict(atol=1e-5, rtol=1e-5)   # fp32, fixed once (as tests/test_mamba.py)

CFG = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=64, dtype="float32",
                  param_dtype="float32", init_std=0.2, attention_impl="einsum")


def _opts(**kw):
  base = dict(d_state=8, head_dim=8, n_groups=2, chunk_size=4, dt_min=0.05, dt_max=0.5,
              mimo_rank=2)
  return Mamba3.Options(**dict(base, **kw))


def _mixer(seed=0, **kw):
  m = Mamba3(CFG, _opts(**kw), rngs=nnx.Rngs(seed))
  if m.opts.mimo_rank:   # rank weights away from their constant init, so they matter
    for w, s in ((m.mimo_x, 1), (m.mimo_z, 2), (m.mimo_o, 3)):
      w[...] = w[...] * (1 + 0.5 * jax.random.normal(jax.random.PRNGKey(s), w.shape))
  return m


def _x(B, T, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, CFG.d_model))


def _pos(B, T, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))


@nnx.jit
def _run(m, x, pos, state):
  return m(x, positions_BT=pos, state=state)[:2]


@nnx.jit
def _ref(m, x, pos, state):
  return m.reference(x, positions_BT=pos, state=state)


@pytest.mark.parametrize("chunk", [1, 3, 4, 8])
def test_mimo_ssd_chunked_equals_recurrent(chunk):
  """The bare MIMO SSD (3 inputs, 2 outputs, an initial state), T = 13."""
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  B, T, H, P, N = 2, 13, 3, 4, 6
  u = jax.random.normal(ks[0], (B, T, H, 3, P))
  a = -jax.nn.softplus(jax.random.normal(ks[1], (B, T, H)))
  k = jax.random.normal(ks[2], (B, T, H, 3, N))
  q = jax.random.normal(ks[3], (B, T, H, 2, N))
  h0 = jax.random.normal(ks[4], (B, H, P, N))
  got = jax.jit(lambda *z: M.mimo_chunked(*z, chunk=chunk, h0_BHPN=h0))(u, a, k, q)
  want = jax.jit(lambda *z: M.mimo_recurrent(*z, h0_BHPN=h0))(u, a, k, q)
  chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize("chunk,rank", [(3, 2), (4, 4), (8, 1)])
def test_mixer_chunked_equals_recurrent_reference(chunk, rank):
  """Two calls of 10 tokens (not a multiple of the chunk) continuing one state: outputs and the
  final state equal the recurrence."""
  m = _mixer(chunk_size=chunk, mimo_rank=rank)
  B, T = 2, 20
  x, pos = _x(B, T, seed=7), _pos(B, T)
  st = Mamba3.init_state(CFG, m.opts, B, 0, jnp.float32)
  y1, s1 = _run(m, x[:, :10], pos[:, :10], st)
  r1, q1 = _ref(m, x[:, :10], pos[:, :10], st)
  y2, s2 = _run(m, x[:, 10:], pos[:, 10:], s1)
  r2, q2 = _ref(m, x[:, 10:], pos[:, 10:], q1)
  chex.assert_trees_all_close((y1, y2, s2), (r1, r2, q2), **TOL)


def test_packed_row_chunked_equals_reference_and_each_document_alone():
  """Documents (chunk 3: lengths 1, 5, 1, 6 = one crossing two chunk boundaries, one starting
  at token 6, exactly on one, and one of length 1 starting at 12): the chunked MIMO form equals
  the recurrence with resets, and each document's outputs those of the document alone."""
  m = _mixer(chunk_size=3, mimo_rank=2)
  docs = (1, 5, 1, 6)
  pos = jnp.asarray([np.concatenate([np.arange(n) for n in docs])], jnp.int32)
  seg = jnp.asarray([np.concatenate([np.full(n, i + 1) for i, n in enumerate(docs)])], jnp.int32)
  x = _x(1, pos.shape[1], seed=11)
  y = nnx.jit(lambda m, x: m(x, positions_BT=pos, segment_ids_BT=seg)[0])(m, x)
  ref = nnx.jit(lambda m, x: m.reference(x, positions_BT=pos, segment_ids_BT=seg)[0])(m, x)
  chex.assert_trees_all_close(y, ref, **TOL)
  starts = np.cumsum((0,) + docs)
  alone = np.full((len(docs), pos.shape[1]), -1)          # right-padded rows, doc first
  for i, n in enumerate(docs):
    alone[i, :n] = np.arange(n)
  x_alone = jnp.stack([jnp.roll(x[0], -int(s), axis=0) for s in starts[:-1]])
  y_alone = _run(m, x_alone, jnp.asarray(alone, jnp.int32), None)[0]
  for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
    chex.assert_trees_all_close(y[0, s:e], y_alone[i, :e - s], **TOL)


def test_decode_matches_full_forward():
  """Token by token and prefill + steps (with right padding in the prefill) == full forward."""
  m = _mixer()
  B, T = 2, 11
  x, pos = _x(B, T, seed=3), _pos(B, T)
  full = _run(m, x, pos, None)[0]
  st = Mamba3.init_state(CFG, m.opts, B, 0, jnp.float32)
  steps = []
  for t in range(T):
    y, st = _run(m, x[:, t:t + 1], pos[:, t:t + 1], st)
    steps.append(y)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, **TOL)
  # row 1's prompt is 2 tokens shorter: padded, then it continues from its own last token
  pre = jnp.asarray([list(range(6)), list(range(4)) + [-1, -1]], jnp.int32)
  st = Mamba3.init_state(CFG, m.opts, B, 0, jnp.float32)
  y_pre, st = _run(m, x[:, :6], pre, st)
  chex.assert_trees_all_close(y_pre[0], full[0, :6], **TOL)
  chex.assert_trees_all_close(y_pre[1, :4], full[1, :4], **TOL)
  x1 = jnp.stack([x[0, 6:7], x[1, 4:5]])
  y_next, _ = _run(m, x1, jnp.asarray([[6], [4]], jnp.int32), st)
  chex.assert_trees_all_close(y_next[:, 0], jnp.stack([full[0, 6], full[1, 4]]), **TOL)


def test_rank_one_equals_siso():
  """mimo_rank 1 with the SISO mixer's parameters (the rank weights at their init, 1) is the
  SISO mixer: outputs and decoding states."""
  siso = Mamba3(CFG, _opts(mimo_rank=0), rngs=nnx.Rngs(0))
  mimo = Mamba3(CFG, _opts(mimo_rank=1), rngs=nnx.Rngs(0))
  for name in ("in_proj", "out"):   # rank 1: B and C [G, 1, N], the same columns as [G, N]
    getattr(mimo, name).kernel[...] = getattr(siso, name).kernel[...]
  mimo.bc_bias[...] = siso.bc_bias[...][:, :, None]   # B's and C's biases, one column
  for name in ("head_scalars", "bc_norm"):            # dt_bias, D; B's and C's norm scales
    getattr(mimo, name)[...] = getattr(siso, name)[...]
  B, T = 2, 13
  x, pos = _x(B, T, seed=5), _pos(B, T)
  st0 = Mamba3.init_state(CFG, siso.opts, B, 0, jnp.float32)
  st1 = Mamba3.init_state(CFG, mimo.opts, B, 0, jnp.float32)
  y0, s0 = _run(siso, x, pos, st0)
  y1, s1 = _run(mimo, x, pos, st1)
  s1 = dict(s1, k=s1["k"][:, :, 0])
  chex.assert_trees_all_close((y1, s1), (y0, s0), **TOL)


def test_causal_by_gradient():
  m = _mixer(chunk_size=3)
  x = _x(1, 10, seed=2)
  g = nnx.jit(lambda m, x: jax.grad(lambda x: jnp.sum(m(x)[0][:, 5]))(x))(m, x)
  assert np.all(np.asarray(g[:, 6:]) == 0) and np.all(np.abs(np.asarray(g[:, :6])).sum(-1) > 0)


def test_validate_names_the_field():
  with pytest.raises(ValueError, match=r"config\.model\.mamba3\.mimo_rank"):
    validate_model(CFG.replace(mixer="mamba3", options=(("mamba3", _opts(mimo_rank=-1)),)))


def test_flops_grow_with_the_rank():
  f = [Mamba3.flops_per_token(CFG, _opts(mimo_rank=r), 256) for r in (1, 2, 4)]
  assert f[0] < f[1] < f[2]
