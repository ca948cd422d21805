"""Chunked SSD against the explicit recurrence (attn_jax/ssm/ssd.py), and the trapezoidal
(Mamba-3) form built on it."""

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.layers import segment_starts
from attn_jax.ssm import ssd
from attn_jax.ssm.mamba3 import (rotate_pairs, trapezoid_chunked, trapezoid_recurrent, wrap,
                                 wrapped_cumsum, _sequential_angles)

TOL = dict(atol=2e-5, rtol=2e-5)   # fp32, fixed once


def _inputs(key, B=2, T=37, H=4, P=8, G=2, N=16, decay_scale=3.0):
  k = jax.random.split(key, 5)
  x = jax.random.normal(k[0], (B, T, H, P))
  # log-decays spanning weak (~ -1e-3) to strong (~ -decay_scale * 5) per step
  a = -decay_scale * jnp.exp(jax.random.uniform(k[1], (B, T, H), minval=-7.0, maxval=1.6))
  b = jax.random.normal(k[2], (B, T, G, N)) / N ** 0.5
  c = jax.random.normal(k[3], (B, T, G, N))
  h0 = jax.random.normal(k[4], (B, H, P, N))
  return x, a, b, c, h0


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 64])
def test_chunked_equals_recurrence(chunk):
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(0))        # T = 37: not a multiple of 3, 8, 16
  y_ref, h_ref = ssd.ssd_recurrent(x, a, b, c, h0_BHPN=h0)
  y, h = ssd.ssd_chunked(x, a, b, c, chunk=chunk, h0_BHPN=h0)
  chex.assert_trees_all_close((y, h), (y_ref, h_ref), **TOL)


def test_chunked_equals_recurrence_strong_decay_and_gradients():
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(1), T=29, decay_scale=40.0)
  assert float(a.min()) < -100.0                           # exp(a) underflows to 0 in places
  w = jax.random.normal(jax.random.PRNGKey(2), x.shape)

  def loss(fn, *args):
    y, h = fn(*args)
    return jnp.sum(y * w) + jnp.sum(h)

  chunked = lambda *z: ssd.ssd_chunked(*z, chunk=8, h0_BHPN=h0)
  recurrent = lambda *z: ssd.ssd_recurrent(*z, h0_BHPN=h0)
  g = jax.grad(lambda *z: loss(chunked, *z), argnums=(0, 1, 2, 3))(x, a, b, c)
  g_ref = jax.grad(lambda *z: loss(recurrent, *z), argnums=(0, 1, 2, 3))(x, a, b, c)
  chex.assert_tree_all_finite(g)
  chex.assert_trees_all_close(chunked(x, a, b, c), recurrent(x, a, b, c), **TOL)
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_zero_decay_token_leaves_state_unchanged():
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(3), T=5)
  mask = jnp.array([1, 1, 0, 1, 0], bool)[None, :, None]    # dt = 0 at tokens 2 and 4
  x, a = x * mask[..., None], a * mask
  _, h_all = ssd.ssd_chunked(x, a, b, c, chunk=2, h0_BHPN=h0)
  _, h_valid = ssd.ssd_recurrent(x[:, [0, 1, 3]], a[:, [0, 1, 3]], b[:, [0, 1, 3]],
                                 c[:, [0, 1, 3]], h0_BHPN=h0)
  chex.assert_trees_all_close(h_all, h_valid, **TOL)


def test_segsum_exp_is_causal_and_at_most_one():
  a = -jnp.abs(jax.random.normal(jax.random.PRNGKey(4), (1, 2, 6, 3))) * 10
  L = ssd.segsum_exp(a)                                     # [1, 2, 3, 6, 6]
  upper = np.triu(np.ones((6, 6), bool), 1)
  assert np.all(np.asarray(L)[..., upper] == 0)
  assert np.all(np.asarray(L) <= 1.0)
  np.testing.assert_allclose(np.diagonal(np.asarray(L), axis1=-2, axis2=-1), 1.0)
  # L[t, s] = exp(a_{s+1} + ... + a_t)
  np.testing.assert_allclose(L[0, 1, 2, 4, 1], np.exp(np.sum(np.asarray(a)[0, 1, 2:5, 2])),
                             rtol=1e-5)


def test_no_overflow_at_32k_tokens():
  # Small width, 32K tokens; decays so weak that a whole-sequence cumsum reaches ~ -1e3..-1e4
  # (exp(-cumsum) of a naive form overflows fp32) mixed with strong ones.
  B, T, H, P, G, N = 1, 32768, 2, 4, 1, 4
  k = jax.random.split(jax.random.PRNGKey(5), 4)
  x = jax.random.normal(k[0], (B, T, H, P))
  a = jnp.stack([jnp.full((B, T), -0.05), -jax.random.uniform(k[1], (B, T), maxval=20.0)], -1)
  b = jax.random.normal(k[2], (B, T, G, N)) / 2
  c = jax.random.normal(k[3], (B, T, G, N)) / 2
  assert float(jnp.sum(a[..., 0])) < -1000.0
  y, h = jax.jit(lambda *z: ssd.ssd_chunked(*z, chunk=64))(x, a, b, c)
  chex.assert_tree_all_finite((y, h))
  y_ref, h_ref = jax.jit(ssd.ssd_recurrent)(x, a, b, c)
  chex.assert_trees_all_close((y, h), (y_ref, h_ref), **TOL)
  g = jax.jit(jax.grad(lambda a: jnp.sum(ssd.ssd_chunked(x, a, b, c, chunk=64)[0])))(a)
  chex.assert_tree_all_finite(g)


# ----------------------------------------------------------------------- document boundaries

# Two packed rows of 21 tokens. With chunk 4: row 0 has documents of length 1 (twice), one
# crossing a chunk boundary (tokens 1..6), one starting exactly at one (8) and crossing two;
# row 1 another layout. Chunk 1 puts every start on a boundary, chunk 8 crosses fewer.
PACKED = ((1, 6, 1, 9, 4), (5, 3, 12, 1))


def _docs():
  """(segment ids [2, 21], reset [2, 21] = layers.segment_starts, spans per row)."""
  seg, spans = [], []
  for docs in PACKED:
    seg.append(np.concatenate([np.full(n, d + 1) for d, n in enumerate(docs)]))
    ends = np.cumsum(docs)
    spans.append(list(zip(ends - np.asarray(docs), ends)))
  seg = jnp.asarray(np.stack(seg), jnp.int32)
  return seg, segment_starts(seg), spans


def _ssd_explicit(x, a, b, c, h):
  """The recurrence in numpy, one row: h = e^a h + x B^T, y = h C (groups repeated to heads)."""
  x, a, b, c, h = map(np.asarray, (x, a, b, c, h))
  J = x.shape[1] // b.shape[1]
  ys = []
  for t in range(x.shape[0]):
    bt, ct = np.repeat(b[t], J, axis=0), np.repeat(c[t], J, axis=0)   # [H, N]
    h = np.exp(a[t])[:, None, None] * h + x[t][:, :, None] * bt[:, None, :]
    ys.append(np.einsum("hpn,hn->hp", h, ct))
  return np.stack(ys), h


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_chunked_with_resets_equals_each_document_alone(chunk):
  """Resets: chunked == the recurrence with resets == each document run alone from a zero
  state (the first one from h0), outputs and final state."""
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(10), T=21)
  _, reset, spans = _docs()
  y, h = jax.jit(lambda *z: ssd.ssd_chunked(*z, chunk=chunk, h0_BHPN=h0, reset_BT=reset))(
      x, a, b, c)
  y_rec, h_rec = jax.jit(lambda *z: ssd.ssd_recurrent(*z, h0_BHPN=h0, reset_BT=reset))(
      x, a, b, c)
  chex.assert_trees_all_close((y, h), (y_rec, h_rec), **TOL)
  for r, row in enumerate(spans):
    for i, (s, e) in enumerate(row):
      start = np.asarray(h0[r]) if i == 0 else np.zeros(h0.shape[1:], np.float32)
      y_doc, h_doc = _ssd_explicit(x[r, s:e], a[r, s:e], b[r, s:e], c[r, s:e], start)
      chex.assert_trees_all_close(y[r, s:e], y_doc, **TOL)
    chex.assert_trees_all_close(h[r], h_doc, **TOL)


def test_chunked_with_resets_gradients_are_finite_and_exact():
  """Strong decay and resets (a = -inf inside): no NaN/inf in the gradients, equal to the
  recurrence's; a reset token's own log-decay reaches nothing (zero gradient, as the first
  token's of a fresh row)."""
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(11), T=21, decay_scale=40.0)
  _, reset, _ = _docs()
  w = jax.random.normal(jax.random.PRNGKey(12), x.shape)

  def loss(fn, *z):
    y, h = fn(*z)
    return jnp.sum(y * w) + jnp.sum(h)

  chunked = lambda *z: ssd.ssd_chunked(*z, chunk=4, h0_BHPN=h0, reset_BT=reset)
  recurrent = lambda *z: ssd.ssd_recurrent(*z, h0_BHPN=h0, reset_BT=reset)
  g = jax.jit(jax.grad(lambda *z: loss(chunked, *z), argnums=(0, 1, 2, 3)))(x, a, b, c)
  g_ref = jax.jit(jax.grad(lambda *z: loss(recurrent, *z), argnums=(0, 1, 2, 3)))(x, a, b, c)
  chex.assert_tree_all_finite(g)
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)
  assert np.all(np.asarray(g[1])[np.asarray(reset)] == 0.0)
  assert np.abs(np.asarray(g[1])[~np.asarray(reset)]).max() > 0


# ----------------------------------------------------------------------- Mamba-3's trapezoid

def _trap_inputs(key, B=2, T=23, H=3, P=4, N=8):
  k = jax.random.split(key, 9)
  dt = jax.nn.softplus(jax.random.normal(k[0], (B, T, H)))
  lam = jax.nn.sigmoid(jax.random.normal(k[1], (B, T, H)))
  a = -jnp.exp(jax.random.normal(k[2], (B, T, H))) * dt
  x = jax.random.normal(k[3], (B, T, H, P))
  kk = jax.random.normal(k[4], (B, T, H, N)) / N ** 0.5
  q = jax.random.normal(k[5], (B, T, H, N))
  carried = dict(h0_BHPN=jax.random.normal(k[6], (B, H, P, N)),
                 x0_BHP=jax.random.normal(k[7], (B, H, P)),
                 k0_BHN=jax.random.normal(k[8], (B, H, N)))
  return (x, a, lam * dt, (1 - lam) * dt, kk, q), carried


def _trap_explicit(x, a, gamma, betap, k, q, h0_BHPN, x0_BHP, k0_BHN):
  """h_t = alpha_t h_{t-1} + gamma_t x_t k_t^T + beta_t x_{t-1} k_{t-1}^T, numpy loop."""
  x, a, gamma, betap, k, q, h, xp, kp = map(np.asarray, (x, a, gamma, betap, k, q, h0_BHPN,
                                                         x0_BHP, k0_BHN))
  ys = []
  for t in range(x.shape[1]):
    al = np.exp(a[:, t])[..., None, None]
    h = (al * h + (betap[:, t, :, None, None] * al) * xp[..., :, None] * kp[..., None, :]
         + gamma[:, t, :, None, None] * x[:, t, :, :, None] * k[:, t, :, None, :])
    ys.append(np.einsum("bhpn,bhn->bhp", h, q[:, t]))
    xp, kp = x[:, t], k[:, t]
  return np.stack(ys, 1), h


@pytest.mark.parametrize("chunk", [1, 4, 7, 32])
def test_trapezoid_chunked_equals_recurrence(chunk):
  args, carried = _trap_inputs(jax.random.PRNGKey(6))
  y_np, h_np = _trap_explicit(*args, **carried)
  y_rec, h_rec = trapezoid_recurrent(*args, **carried)
  y, h = trapezoid_chunked(*args, chunk=chunk, **carried)
  chex.assert_trees_all_close((y_rec, h_rec), (y_np, h_np), **TOL)
  chex.assert_trees_all_close((y, h), (y_np, h_np), **TOL)


def test_trapezoid_with_resets_equals_each_document_alone():
  """Resets restart h and the previous-token term: chunked == recurrence == each document in
  numpy from zeros (the first one from the carried state)."""
  (x, a, g, bp, k, q), carried = _trap_inputs(jax.random.PRNGKey(13), T=21)
  _, reset, spans = _docs()
  args = (x, a, g, bp, k, q)
  y, h = jax.jit(lambda *z: trapezoid_chunked(*z, chunk=4, reset_BT=reset, **carried))(*args)
  y_rec, h_rec = jax.jit(lambda *z: trapezoid_recurrent(*z, reset_BT=reset, **carried))(*args)
  chex.assert_trees_all_close((y, h), (y_rec, h_rec), **TOL)
  for r, row in enumerate(spans):
    for i, (s, e) in enumerate(row):
      one = {n: v[r:r + 1] * (i == 0) for n, v in carried.items()}      # zeros after the first
      y_doc, h_doc = _trap_explicit(*(z[r:r + 1, s:e] for z in args), **one)
      chex.assert_trees_all_close(y[r:r + 1, s:e], y_doc, **TOL)
    chex.assert_trees_all_close(h[r:r + 1], h_doc, **TOL)


def test_wrapped_angles_restart_at_resets():
  """With resets the angles restart (phi = inc at a document's first token): chunked ==
  sequential == each document's own cumulative sum from 0 (the first from phi0)."""
  inc = jax.random.uniform(jax.random.PRNGKey(14), (2, 21, 3, 2), maxval=3.0)
  phi0 = jax.random.uniform(jax.random.PRNGKey(15), (2, 3, 2), maxval=6.0)
  _, reset, spans = _docs()
  circle = lambda p: (jnp.cos(p), jnp.sin(p))
  phi = jax.jit(lambda i: wrapped_cumsum(i, phi0, chunk=4, reset_BT=reset))(inc)
  seq = jax.jit(lambda i: _sequential_angles(i, phi0, reset))(inc)
  chex.assert_trees_all_close(circle(phi), circle(seq), atol=1e-5)
  for r, row in enumerate(spans):
    for i, (s, e) in enumerate(row):
      want = np.cumsum(np.asarray(inc[r, s:e]), axis=0) + (np.asarray(phi0[r]) if i == 0 else 0)
      chex.assert_trees_all_close(circle(phi[r, s:e]), circle(jnp.asarray(want)), atol=1e-5)


def test_wrapped_angles_match_sequential_and_stay_in_range():
  inc = jax.random.uniform(jax.random.PRNGKey(7), (2, 1000, 3, 4), maxval=3.0)
  phi0 = jax.random.uniform(jax.random.PRNGKey(8), (2, 3, 4), maxval=6.0)
  phi = wrapped_cumsum(inc, phi0, chunk=64)
  ref = _sequential_angles(inc, phi0)
  assert float(phi.min()) >= 0.0 and float(phi.max()) < 2 * np.pi
  # compare as points on the circle (values near 0 / 2 pi may wrap differently)
  chex.assert_trees_all_close((jnp.cos(phi), jnp.sin(phi)), (jnp.cos(ref), jnp.sin(ref)),
                              atol=1e-4)


def test_rotation_makes_scores_relative():
  """q_t . k_s after rotating by phi_t, phi_s depends only on phi_t - phi_s."""
  k = jax.random.split(jax.random.PRNGKey(9), 3)
  q, kk = jax.random.normal(k[0], (8,)), jax.random.normal(k[1], (8,))
  phi = jax.random.uniform(k[2], (2,), maxval=6.0)                 # R = 2 of N/2 = 4 pairs
  s1 = rotate_pairs(q, phi + 1.3) @ rotate_pairs(kk, phi)
  s2 = rotate_pairs(q, wrap(phi + 4.0 + 1.3)) @ rotate_pairs(kk, wrap(phi + 4.0))
  np.testing.assert_allclose(s1, s2, rtol=1e-5)
  np.testing.assert_allclose(rotate_pairs(q, phi)[4:], q[4:])      # unrotated tail


def test_flops_count_the_chunk_terms_and_the_state_passing_matmuls():
  """Per token: the intra-chunk and state terms are constant in T; the state passing adds
  `recurrence_macs`(C) + 1 P N per head per sequence: the strict triangle up to 64 chunks,
  ~C^1.5 past it."""
  kw = dict(n_heads=24, head_dim=64, d_state=64, n_groups=1, chunk=64)
  f1, f2 = ssd.ssd_flops_per_token(seq_len=2048, **kw), ssd.ssd_flops_per_token(seq_len=65536, **kw)
  # chunk 64: C B^T 64*32.5, (.)x 24*64*32.5, states and outputs 2*24*64*64
  per_token = 64 * 32.5 + 24 * 64 * 32.5 + 2 * 24 * 64 * 64
  passing = lambda T: 24 * 64 * 64 * (ssd.recurrence_macs(T // 64) + 1) / T
  assert f1 == pytest.approx(2 * (per_token + passing(2048)), rel=1e-12)
  assert f2 == pytest.approx(2 * (per_token + passing(65536)), rel=1e-12)
  assert ssd.recurrence_macs(64) == 64 * 63 / 2 and ssd.recurrence_macs(128) < 128 * 127 / 2
  assert passing(2048) / per_token < 0.12 and passing(65536) / per_token < 0.2


@pytest.mark.parametrize("n,h0", [(1, True), (7, False), (64, True), (65, True), (128, False),
                                  (1100, True)])
def test_chunk_state_passing_is_the_loop(n, h0):
  """`pass_chunk_states` (one segsum matmul, or blocks of ~sqrt(n) passed recursively) equals
  H_{c+1} = exp(z_c) H_c + S_c run chunk by chunk, the entering states and the final one, with
  strong decays, -inf restarts, a given or a zero initial state."""
  k = jax.random.split(jax.random.key(n), 4)
  z = -jax.random.exponential(k[0], (2, n, 3)) * 3.0
  z = jnp.where(jax.random.uniform(k[1], (2, n, 3)) < 0.05, -jnp.inf, z)
  S = jax.random.normal(k[2], (2, n, 3, 2, 4))
  h0 = jax.random.normal(k[3], (2, 3, 2, 4)) if h0 else None
  H, final = jax.jit(ssd.pass_chunk_states)(z, S, h0)
  zn, Sn = np.asarray(z, np.float64), np.asarray(S, np.float64)
  h = np.zeros_like(Sn[:, 0]) if h0 is None else np.asarray(h0, np.float64)
  want = np.empty_like(Sn)
  for c in range(n):
    want[:, c] = h
    h = np.exp(zn[:, c])[..., None, None] * h + Sn[:, c]
  scale = max(np.abs(want).max(), np.abs(h).max())
  np.testing.assert_allclose(np.asarray(H, np.float64), want, rtol=1e-5, atol=1e-5 * scale)
  np.testing.assert_allclose(np.asarray(final, np.float64), h, rtol=1e-5, atol=1e-5 * scale)




# ------------------------------------------------------------------ matmuls in the model dtype
TOL_BF16 = 2e-2   # relative L2 error: operands rounded to bf16's 8 bits, fp32 accumulation


def _rel(got, want):
  got, want = (np.asarray(z, np.float64) for z in (got, want))
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _bf16_inputs():
  x, a, b, c, h0 = _inputs(jax.random.PRNGKey(5), T=70)
  x, b, c = (z.astype(jnp.bfloat16) for z in (x, b, c))
  return x, a, b, c, h0


def _loss(dot_dtype, w):
  def loss(x, a, b, c, h0):
    y, h = ssd.ssd_chunked(x, a, b, c, chunk=16, h0_BHPN=h0, dot_dtype=dot_dtype)
    return jnp.sum(y * w) + jnp.sum(h)
  return loss


def test_bf16_matmuls_stay_within_bf16_rounding_of_fp32_forward_and_backward():
  """dot_dtype=bf16 (the model's compute dtype) against the fp32 chunked form on the same
  bf16 inputs: outputs, final state and every gradient within bf16 rounding. A wrong backward
  of the bf16 matmuls (their own rule, which takes the cotangent in bf16) would be off by O(1)."""
  args = _bf16_inputs()
  w = jax.random.normal(jax.random.PRNGKey(6), args[0].shape)
  want = ssd.ssd_chunked(*args[:4], chunk=16, h0_BHPN=args[4])
  got = ssd.ssd_chunked(*args[:4], chunk=16, h0_BHPN=args[4], dot_dtype=jnp.bfloat16)
  for g, r, name in zip(got, want, ("y", "final state")):
    assert g.dtype == jnp.float32
    assert _rel(g, r) < TOL_BF16, name
  g_want = jax.grad(_loss(None, w), argnums=range(5))(*args)
  g_got = jax.grad(_loss(jnp.bfloat16, w), argnums=range(5))(*args)
  for g, r, name in zip(g_got, g_want, ("x", "a", "b", "c", "h0")):
    assert g.dtype == r.dtype, name
    assert _rel(g, r) < TOL_BF16, name


def _dot_dtypes(fn, *args) -> list[tuple[str, ...]]:
  """The operand dtypes of every dot_general in fn's program (nested jaxprs included)."""
  found = []
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_bf16_chunked_form_leaves_only_the_state_passing_in_fp32():
  """With dot_dtype=bf16 every matmul of the forward and backward takes bf16 operands except
  the chunk-state passing's (fp32 states, as the authors keep them): the count of fp32 matmuls
  equals that of `pass_chunk_states`' own forward and backward at the same shapes."""
  args = _bf16_inputs()
  w = jnp.ones(args[0].shape)
  dots = _dot_dtypes(jax.grad(_loss(jnp.bfloat16, w), argnums=range(5)), *args)
  fp32 = [d for d in dots if "float32" in d]
  assert len(dots) > len(fp32) >= 1
  assert all(d == ("bfloat16", "bfloat16") for d in dots if "float32" not in d)
  B, T, H, P = args[0].shape
  N, C = args[2].shape[-1], -(-T // 16)
  z, S = jnp.zeros((B, C, H)), jnp.zeros((B, C, H, P, N))
  passing = lambda z, S, h0: sum(jnp.sum(o) for o in ssd.pass_chunk_states(z, S, h0))
  assert len(fp32) == len(_dot_dtypes(jax.grad(passing, argnums=(0, 1, 2)), z, S, args[4]))
