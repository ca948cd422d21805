"""Sparse Sinkhorn attention: balancing invariants, exact block sorting, references, causality by
gradient, SortCut, padding, decoding, and no while loop in a step (each loop-free form against
the loop it replaced). All fp32, tolerances fixed once."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.kernels.dense import attention_reference
from attn_jax.attention.sinkhorn import (SinkhornAttention, SortPlan, _blocks, _harmonic,
                                         causal_prefix_problem, causal_sinkhorn_rows,
                                         causal_sort_row, greedy_permutation, sinkhorn_log,
                                         sinkhorn_attention_reference, sort_blocks)
from attn_jax.config import config_rules, validate
from attn_jax.model_config import ModelConfig
from tests.test_packing import one_row

Opts = SinkhornAttention.Options
CFG = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, dtype="float32",
                  attention_impl="xla")
ATOL = 1e-5


def make(opts, cfg=CFG, seed=0):
  return SinkhornAttention(cfg, opts, rngs=nnx.Rngs(seed))


def inputs(B=2, T=11, D=32, seed=1):
  x = jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)
  return x, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


# ---------------------------------------------------------------- balancing

def test_noncausal_sinkhorn_is_doubly_stochastic_with_padded_blocks():
  logits = jax.random.normal(jax.random.key(0), (2, 3, 6, 6)) / 0.75
  valid = jnp.array([[True] * 6, [True] * 4 + [False] * 2])      # row 1: 2 padded blocks
  mask = (valid[:, :, None] & valid[:, None, :])[:, None]
  z = jnp.zeros((2, 1, 6))
  want = jnp.broadcast_to(valid[:, None], (2, 3, 6))
  # Rows are exact after any number of iterations (the last step); after the reference 7 the
  # columns are only close (here within 1e-2), after 20 within 1e-3.
  P7 = jnp.exp(sinkhorn_log(logits, mask, z, z, n_iters=7))
  np.testing.assert_allclose(P7.sum(-1), want, atol=1e-5)
  np.testing.assert_allclose(P7.sum(-2), want, atol=1e-2)
  P = jnp.exp(sinkhorn_log(logits, mask, z, z, n_iters=20))
  np.testing.assert_allclose(P.sum(-1), want, atol=1e-5)
  np.testing.assert_allclose(P.sum(-2), want, atol=1e-3)
  assert float(jnp.abs(jnp.where(mask, 0.0, P)).max()) == 0.0


def test_causal_prefix_problems_balance_to_their_targets():
  # 50 iterations: the causal problem converges more slowly (its targets are uneven); at 7 the
  # rows are still exact and the columns approximate.
  n = 7
  logits = jax.random.normal(jax.random.key(1), (2, 3, n, n)) / 0.75
  h = _harmonic(n)
  rows = jnp.exp(causal_sinkhorn_rows(logits, n_iters=50))
  for i in range(n):
    mask, lr, lc = causal_prefix_problem(n, i)
    P = jnp.exp(sinkhorn_log(logits, mask, lr, lc, n_iters=50))
    assert float(jnp.abs(jnp.where(mask, 0.0, P)).max()) == 0.0     # strict lower triangle
    np.testing.assert_allclose(P.sum(-1)[..., 1:i + 1], 1.0, atol=1e-3)
    np.testing.assert_allclose(P.sum(-2)[..., :i], np.broadcast_to(h[i] - h[:i], (2, 3, i)),
                               atol=1e-3)
    np.testing.assert_allclose(rows[..., i, :], P[..., i, :], atol=1e-6)  # row i = prefix i
  assert float(jnp.abs(rows[..., 0, :]).max()) == 0.0               # block 0 has no past
  np.testing.assert_allclose(rows.sum(-1)[..., 1:], 1.0, atol=1e-5)
  np.testing.assert_allclose(rows[..., 1, 0], 1.0, atol=1e-6)        # block 1 can only take 0


def test_causal_balancing_uniform_logits_is_the_uniform_causal_matrix():
  # The limit of the balancing of equal logits is the uniform causal matrix (row i: 1/i each).
  rows = jnp.exp(causal_sinkhorn_rows(jnp.zeros((1, 1, 6, 6)), n_iters=50))[0, 0]
  want = np.tril(np.ones((6, 6)), -1) / np.maximum(np.arange(6), 1)[:, None]
  np.testing.assert_allclose(rows, want, atol=1e-5)


def test_causal_row_ignores_later_rows():
  n = 6
  logits = jax.random.normal(jax.random.key(2), (n, n))
  for i in range(1, n):
    jac = jax.jacrev(lambda lg: jnp.exp(causal_sort_row(lg, i, 7)))(logits)   # [n, n, n]
    assert float(jnp.abs(jac[:, i + 1:, :]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(jac[:, :, i:]).max(initial=0.0)) == 0.0


# ---------------------------------------------------------------- sorting

def test_blocks_are_contiguous():
  x = jnp.arange(10)[None]
  np.testing.assert_array_equal(_blocks(x, 3, 4, fill=-1)[0],
                                [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]])


def test_hard_permutation_moves_each_block_exactly_keys_and_values_apart():
  B, N, b, K, D = 2, 5, 3, 2, 4
  kb = jax.random.normal(jax.random.key(3), (B, N, b, K, D))
  vb = jax.random.normal(jax.random.key(4), (B, N, b, K, D))
  perm = np.stack([[np.random.RandomState(s + 2 * k).permutation(N) for k in range(K)]
                   for s in range(B)])                               # [B, K, N]
  valid = jnp.ones((B, N, b), bool)
  plans = [SortPlan(P=jax.nn.one_hot(perm, N)),
           SortPlan(idx=jnp.asarray(perm)[..., None], w=jnp.ones((B, K, N, 1)),
                    ok=jnp.ones((B, K, N, 1), bool))]
  for plan in plans:
    sk, sv, sval = sort_blocks(kb, vb, valid, plan)
    for bb in range(B):
      for k in range(K):
        for i in range(N):
          np.testing.assert_array_equal(sk[bb, i, :, k], kb[bb, perm[bb, k, i], :, k])
          np.testing.assert_array_equal(sv[bb, i, :, k], vb[bb, perm[bb, k, i], :, k])
    assert bool(sval.all())
    assert not np.allclose(sk, sv)


def test_greedy_permutation_is_a_permutation_and_follows_the_greedy_order():
  logp = jax.random.normal(jax.random.key(5), (3, 2, 6, 6))
  idx, ok = greedy_permutation(logp, jnp.ones((6, 6), bool))
  assert bool(ok.all())
  for a in range(3):
    for k in range(2):
      assert sorted(np.asarray(idx[a, k]).tolist()) == list(range(6))
      m = np.asarray(logp[a, k], np.float64).copy()      # numpy greedy
      want = np.zeros(6, int)
      for _ in range(6):
        r, c = np.unravel_index(np.argmax(m), m.shape)
        want[r] = c
        m[r, :] = -np.inf
        m[:, c] = -np.inf
      np.testing.assert_array_equal(idx[a, k], want)


# ---------------------------------------------------------------- the mixer vs references

MODES = [
    dict(block_size=4),
    dict(block_size=4, hard_inference=False),
    dict(block_size=4, n_sortcut=2),
    dict(block_size=4, causal=False),
    dict(block_size=4, causal=False, n_sortcut=2),
]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_core_matches_explicit_reference(mode, train):
  m = make(Opts(**mode))
  x, pos = inputs(T=11)
  pos = pos.at[1, 8:].set(-1)                 # row 1 right-padded: 8 valid tokens
  y, aux = m.core(x, pos, rng=jax.random.key(7), train=train)
  W = aux["plan"].source_weights(aux["n_blocks"])
  ref = sinkhorn_attention_reference(aux["q"], aux["k"], aux["v"], pos >= 0, W, block=4,
                                     scale=CFG.head_dim ** -0.5, causal=mode.get("causal", True))
  valid = np.asarray(pos >= 0)
  np.testing.assert_allclose(np.asarray(y)[valid], ref[valid], atol=ATOL)
  chex.assert_tree_all_finite(y)


def test_full_window_equals_full_attention():
  x, pos = inputs(T=10)

  def check(opts, causal):
    m = make(opts)
    _, aux = m.core(x, pos)
    ref = attention_reference(aux["q"], aux["k"], aux["v"], scale=CFG.head_dim ** -0.5,
                              causal=causal)
    for f in (lambda x_: m.core(x_, pos)[0], jax.jit(lambda x_: m.core(x_, pos)[0])):
      np.testing.assert_allclose(f(x), ref, atol=ATOL)

  # Causal SortCut keeping every past block (and the causal local block) = full causal attention.
  check(Opts(block_size=3, n_sortcut=4), True)
  # One block covering the sequence: the identity sort duplicates every key (same softmax).
  for hard in (True, False):
    check(Opts(block_size=16, causal=False, hard_inference=hard), False)
  check(Opts(block_size=16), True)


def test_padding_equals_truncation():
  for causal in (True, False):
    m = make(Opts(block_size=4, causal=causal))
    x, pos = inputs(B=1, T=13)
    pad = pos.at[:, 9:].set(-1)
    y_pad, _, _ = m(x, positions_BT=pad)
    y_cut, _, _ = m(x[:, :9], positions_BT=pos[:, :9])
    np.testing.assert_allclose(y_pad[:, :9], y_cut, atol=ATOL)


# ---------------------------------------------------------------- causality, gradients

def _future_leak(m, T, rng=None, train=False):
  x, pos = inputs(B=1, T=T, D=CFG.d_model)
  f = lambda x_: m(x_, positions_BT=pos, rng=rng, train=train)[0][0]
  jac = jax.jit(jax.jacrev(f))(x)[:, :, 0]                     # [T, D, T, D]
  g = jnp.abs(jac).sum(axis=(1, 3))                   # [t (out), s (in)]
  return float(jnp.triu(g, 1).max()), float(jnp.tril(g).max())


SLOW = pytest.mark.slow


@pytest.mark.parametrize("T,b,mode", [
    (13, 4, dict()), (13, 4, dict(n_sortcut=2)), (10, 3, dict()),
    pytest.param(10, 3, dict(n_sortcut=2), marks=SLOW), pytest.param(7, 8, dict(), marks=SLOW),
    pytest.param(12, 4, dict(), marks=SLOW), pytest.param(29, 5, dict(n_sortcut=3), marks=SLOW),
    pytest.param(13, 4, dict(hard_inference=False), marks=SLOW)])
def test_causal_by_gradient(T, b, mode):
  m = make(Opts(block_size=b, **mode))
  for train in (False, True):
    leak, past = _future_leak(m, T, rng=jax.random.key(3), train=train)
    assert leak < 1e-9 and past > 0


class _PoolsOwnBlock(SinkhornAttention):
  """The tempting bug: block i's sort decision from block i's own summary."""

  def sort_logits(self, sums, counts, rng, train, query_from_previous=None):
    return super().sort_logits(sums, counts, rng, train, query_from_previous=False)


def test_causality_test_catches_leaks():
  leak, _ = _future_leak(make(Opts(block_size=4, causal=False)), 8)
  assert leak > 1e-4
  leaky = _PoolsOwnBlock(CFG, Opts(block_size=3, hard_inference=False), rngs=nnx.Rngs(0))
  leak, _ = _future_leak(leaky, 9, rng=jax.random.key(3), train=True)   # 3 blocks
  assert leak > 1e-6


@pytest.mark.parametrize("mode", [dict(), dict(n_sortcut=2), dict(causal=False)])
def test_gradients_finite_at_low_temperature(mode):
  m = make(Opts(block_size=4, temperature=0.02, **mode))
  x, pos = inputs(T=16)
  graphdef, params = nnx.split(m, nnx.Param)

  def loss(p):
    y, _, _ = nnx.merge(graphdef, p)(x * 3.0, positions_BT=pos, rng=jax.random.key(0),
                                      train=True)
    return jnp.sum(y ** 2)

  g = jax.grad(loss)(params)
  chex.assert_tree_all_finite(g)
  sort_grad = sum(float(jnp.abs(l).sum()) for l in jax.tree.leaves(g["sort_u"]))
  assert sort_grad > 0          # the sorting network learns (SortCut: straight-through)


# ---------------------------------------------------------------- decoding

@pytest.mark.parametrize("mode", [dict(hard_inference=False), dict(), dict(n_sortcut=2)])
def test_decode_equals_full_forward(mode):
  opts = Opts(block_size=4, **mode)
  m = make(opts)
  T = 11
  x, pos = inputs(T=T)
  pos = pos.at[1, 9:].set(-1)                          # row 1 is a shorter prompt
  y_full, _, _ = m(x, positions_BT=pos)
  valid = np.asarray(pos >= 0)

  step = nnx.jit(lambda m_, x_, p_, s_: m_(x_, positions_BT=p_, state=s_))
  state = SinkhornAttention.init_state(CFG, opts, 2, 13, jnp.float32)
  ys = []
  for t in range(T):
    y, state, _ = step(m, x[:, t:t + 1], pos[:, t:t + 1], state)
    ys.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1))[valid],
                             np.asarray(y_full)[valid], atol=ATOL)

  if mode:
    return
  # Chunked prefill (chunks of max_chunk).
  c = SinkhornAttention.max_chunk(CFG, opts, 13)
  state = SinkhornAttention.init_state(CFG, opts, 2, 13, jnp.float32)
  ys = []
  for s in range(0, T, c):
    y, state, _ = step(m, x[:, s:s + c], pos[:, s:s + c], state)
    ys.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1))[valid],
                             np.asarray(y_full)[valid], atol=ATOL)

  # A padding token changes no state.
  _, after, _ = step(m, x[:, :1], jnp.full((2, 1), -1, jnp.int32), state)
  chex.assert_trees_all_equal(after, state)


@pytest.mark.parametrize("mode", [dict(), dict(n_sortcut=2)])
def test_a_fresh_state_takes_the_whole_prompt_in_one_full_forward(mode):
  """The first call into a fresh state (`cache.as_fresh`, a prefill's) runs the full forward on
  any length: its outputs equal the full forward, its state the one that block-sized chunks
  leave (cache, sums, counts), and decoding on from it equals the full forward."""
  from attn_jax.attention import cache as cache_lib
  opts = Opts(block_size=4, **mode)
  m = make(opts)
  T, P, b = 11, 9, opts.block_size
  x, pos = inputs(T=T)
  pos = pos.at[1, 7:].set(-1)                          # row 1 is a shorter stream
  y_full, _, _ = m(x, positions_BT=pos)
  valid = np.asarray(pos >= 0)
  step = nnx.jit(lambda m_, x_, p_, s_: m_(x_, positions_BT=p_, state=s_))
  empty = SinkhornAttention.init_state(CFG, opts, 2, 13, jnp.float32)
  assert SinkhornAttention.max_fresh_chunk(CFG, opts, 13) is None

  y_pre, state, _ = step(m, x[:, :P], pos[:, :P], cache_lib.as_fresh(empty))
  assert not state.cache.fresh
  np.testing.assert_allclose(np.asarray(y_pre)[valid[:, :P]],
                             np.asarray(y_full[:, :P])[valid[:, :P]], atol=ATOL)
  chunked = empty
  for s in range(0, P, b):
    _, chunked, _ = step(m, x[:, s:min(s + b, P)], pos[:, s:min(s + b, P)], chunked)
  chex.assert_trees_all_close(state, chunked, atol=ATOL)

  ys = []
  for t in range(P, T):
    y, state, _ = step(m, x[:, t:t + 1], pos[:, t:t + 1], state)
    ys.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1))[valid[:, P:]],
                             np.asarray(y_full[:, P:])[valid[:, P:]], atol=ATOL)


# ---------------------------------------------------------------- options

@pytest.mark.parametrize("field,value", [("block_size", 0), ("n_iters", 0), ("temperature", 0.0),
                                         ("n_sortcut", -1), ("causal", 1), ("sort_dim", 2.5)])
def test_options_validation_names_the_field(field, value):
  with pytest.raises(ValueError, match=rf"config\.model\.sinkhorn\.{field}:"):
    Opts(**{field: value}).validate(CFG, "config.model.sinkhorn")


def test_flops_sortcut_far_below_dense():
  o = Opts(block_size=128, n_sortcut=2)
  f2 = SinkhornAttention.flops_per_token(CFG, o, 16384)
  dense = 4.0 * CFG.n_heads * CFG.head_dim * (16384 + 1) / 2
  assert f2 < dense / 10


def test_configs_build_valid_options_rules_and_matched_parameters():
  from configs import sinkhorn_152m, sinkhorn_tiny, transformer_152m
  from attn_jax.attention.projection import QKVProjection

  for c in (sinkhorn_152m.get_config(), sinkhorn_152m.get_config("sortcut=2"),
            sinkhorn_tiny.get_config()):
    assert c.model.mixer == "sinkhorn"
    Opts(**c.model.sinkhorn.to_dict()).validate(CFG, "config.model.sinkhorn")
    rules = config_rules(validate(c))
    assert rules["sort_hidden"] is None and rules["sort_dim"] is None
  assert sinkhorn_152m.get_config("sortcut=2").model.sinkhorn.n_sortcut == 2

  c = sinkhorn_152m.get_config()
  t = transformer_152m.get_config()
  cfg = ModelConfig(d_model=c.model.d_model, n_heads=c.model.n_heads, n_layers=1)
  count = lambda f: sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(f), nnx.Param)))
  extra = (count(lambda: SinkhornAttention(cfg, Opts(**c.model.sinkhorn.to_dict()),
                                           rngs=nnx.Rngs(0)))
           - count(lambda: QKVProjection(cfg, rngs=nnx.Rngs(0))))
  assert extra == sinkhorn_152m.sinkhorn_extra_params(c)
  per_layer_diff = extra - 3 * c.model.d_model * (t.model.d_ff - c.model.d_ff)
  assert abs(per_layer_diff) <= 3 * c.model.d_model * 2     # d_ff rounded to a multiple of 4


def test_sharpness_monitor():
  logp = jnp.log(jnp.array([[[[0.0, 0.0], [1.0, 0.0]]]]))
  allowed = jnp.array([[False, False], [True, False]])
  assert float(SinkhornAttention.sharpness(logp, allowed)) == 1.0
  x, pos = inputs(T=12)
  _, _, aux = make(Opts(block_size=4))(x, positions_BT=pos)
  assert 1 / 2 - 1e-6 <= float(aux["sinkhorn_sharpness"]) <= 1.0


@pytest.mark.parametrize("mode", [dict(n_sortcut=2), dict(causal=False)])
def test_batch_sharded_forward_equals_unsharded(mode):
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attn_jax.sharding import make_mesh
  mesh = make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"))
  m = make(Opts(block_size=4, **mode))
  x, pos = inputs(B=8, T=11)
  want = m(x, positions_BT=pos)[0]
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  got = nnx.jit(lambda m_, x_, p_: m_(x_, positions_BT=p_)[0])(m, put(x), put(pos))
  np.testing.assert_allclose(got, want, atol=ATOL)


# ---------------------------------------------------------------- packed rows (docstring 10)

PACKED_MODES = [dict(hard_inference=False), dict(), dict(n_sortcut=2), dict(causal=False),
                dict(causal=False, n_sortcut=2)]


@pytest.mark.parametrize("mode", PACKED_MODES)
def test_block_aligned_documents_equal_each_document_alone(mode):
  """Documents starting at block boundaries (the last one ending inside a block): each one's
  output == the document alone, in every sorting mode (soft, hard, SortCut, non-causal)."""
  m = make(Opts(block_size=4, **mode))
  pos, seg, spans = one_row((8, 4, 12, 3))
  x, _ = inputs(B=1, T=pos.shape[1])
  run = jax.jit(lambda x_, p, s: m(x_, positions_BT=p, segment_ids_BT=s)[0])
  y = run(x, pos, seg)
  for a, e in spans:
    np.testing.assert_allclose(y[:, a:e], run(x[:, a:e], pos[:, a:e], None), atol=ATOL)


def _unaligned_alone(mode, docs, block):
  m = make(Opts(block_size=block, **mode))
  pos, seg, spans = one_row(docs)
  x, _ = inputs(B=1, T=pos.shape[1])
  run = jax.jit(lambda x_, p, s: m(x_, positions_BT=p, segment_ids_BT=s)[0])
  y = run(x, pos, seg)
  for a, e in spans:
    np.testing.assert_allclose(y[:, a:e], run(x[:, a:e], pos[:, a:e], None), atol=ATOL)


def test_unaligned_documents_equal_each_document_alone():
  """Documents at arbitrary offsets (starting inside blocks, one shorter than a block, one of
  length 1), soft sorting: each one's output == the document alone (the mixer moves them to
  block boundaries, sinkhorn.document_layout; without that the spanning ones differ by ~0.3)."""
  _unaligned_alone(PACKED_MODES[0], (1, 6, 9, 2, 5), 4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", PACKED_MODES[:3])
@pytest.mark.parametrize("docs,block", [((37, 64, 27), 16), ((1, 6, 9, 2, 5), 4)])
def test_unaligned_documents_alone_in_every_causal_mode(mode, docs, block):
  """The same in the causal modes (soft, hard, SortCut), also for 37 / 64 / 27 tokens in
  blocks of 16."""
  _unaligned_alone(mode, docs, block)


def test_document_layout_starts_long_documents_at_block_boundaries():
  """A document that does not fit in the rest of its block starts the next one; the others
  stay packed; every index is below 2 T."""
  from attn_jax.attention.sinkhorn import document_layout
  _, seg, spans = one_row((3, 2, 6, 1, 4, 4))
  dest = np.asarray(document_layout(seg, 4))[0]
  assert [int(dest[a]) for a, _ in spans] == [0, 4, 8, 14, 16, 20]
  assert all(np.all(np.diff(dest[a:e]) == 1) for a, e in spans)
  assert dest.max() < 2 * seg.shape[1]


@pytest.mark.parametrize("mode", PACKED_MODES[:2] + PACKED_MODES[3:4])
def test_spanning_blocks_attend_only_within_their_document(mode):
  """Documents starting inside blocks (one of length 1): d y_t / d x_s is exactly zero for s in
  another document (no attention weight, no sort decision crosses), and for s > t in causal
  modes; soft sorting in training with Gumbel noise too. Plain concatenation does leak."""
  m = make(Opts(block_size=4, **mode))
  pos, seg, _ = one_row((1, 6, 9, 5))
  T = pos.shape[1]
  x, _ = inputs(B=1, T=T)
  train = mode == PACKED_MODES[0]
  deps = {}
  for name, s in (("packed", seg), ("plain", None)):
    p = pos if s is not None else jnp.arange(T, dtype=jnp.int32)[None]
    f = lambda x_, p=p, s=s: m(x_, positions_BT=p, segment_ids_BT=s, rng=jax.random.key(3),
                               train=train)[0][0]
    deps[name] = np.asarray(jnp.abs(jax.jit(jax.jacrev(f))(x)[:, :, 0]).sum(axis=(1, 3)))
  sv = np.asarray(seg[0])
  allowed = sv[:, None] == sv[None, :]
  if mode.get("causal", True):
    allowed &= np.tril(np.ones((T, T), bool))
  assert deps["packed"][~allowed].max() == 0.0
  assert np.all(np.diag(deps["packed"]) > 0)
  assert deps["plain"][~allowed].max() > 1e-6


def test_document_mask_refuses_the_non_causal_mode():
  """Packed rows are exact in the causal mode only (docstring 10): config.validate says so in
  one line naming the field and the block size."""
  from attn_jax.config import validate
  from configs.base import get_config
  c = get_config()
  c.model.update(mixer="sinkhorn", max_seq_len=64)
  c.data.update(document_mask=True, seq_len=64)
  validate(c)
  c.model.sinkhorn.causal = False
  with pytest.raises(ValueError, match=r"^config\.data\.document_mask: sinkhorn\.causal=False "
                                       r"keeps the packed blocks of block_size=64, [^\n]*$"):
    validate(c)


def _layout_loop(seg, b):
  """document_layout as the plain left-to-right cursor loop (numpy), for the equivalence test."""
  out = np.zeros_like(seg)
  for r, row in enumerate(seg):
    p, t = 0, 0
    while t < len(row):
      n = 1
      while t + n < len(row) and row[t + n] == row[t]:
        n += 1
      if p % b and p % b + n > b:
        p += b - p % b
      out[r, t:t + n] = p + np.arange(n)
      p, t = p + n, t + n
  return out


@pytest.mark.parametrize("b", [1, 4, 7, 16])
def test_document_layout_equals_the_cursor_loop(b):
  """document_layout (an associative scan) == a plain numpy cursor loop on random packings
  (documents of 1 to 3 b tokens, rows of 1 and of many documents)."""
  from attn_jax.attention.sinkhorn import document_layout
  rng = np.random.default_rng(b)
  lens = [rng.integers(1, 3 * b + 1, size=200) for _ in range(3)]
  seg = np.stack([np.repeat(np.arange(200), l)[:200] for l in lens] + [np.zeros(200, int)])
  got = np.asarray(document_layout(jnp.asarray(seg, jnp.int32), b))
  np.testing.assert_array_equal(got, _layout_loop(seg, b))


# ---------------------------------------------------------------- no loops over T

def _greedy_one_at_a_time(logp_BKNN, mask_BKNN):
  """The greedy rule one entry per step, a `fori_loop` over the N blocks (greedy_permutation as
  it was before its rounds): the reference `greedy_permutation` must equal."""
  n = logp_BKNN.shape[-1]
  lead = logp_BKNN.shape[:-2]
  mask = jnp.broadcast_to(mask_BKNN, logp_BKNN.shape)

  def body(_, carry):
    idx, row_free, col_free = carry
    s = jnp.where(mask & row_free[..., :, None] & col_free[..., None, :], logp_BKNN, -jnp.inf)
    flat = s.reshape(lead + (n * n,))
    best = jnp.argmax(flat, axis=-1)
    ok = jnp.max(flat, axis=-1) > -jnp.inf
    r, c = best // n, best % n
    hit_r = (jnp.arange(n) == r[..., None]) & ok[..., None]
    hit_c = (jnp.arange(n) == c[..., None]) & ok[..., None]
    return (jnp.where(hit_r, c[..., None], idx), row_free & ~hit_r, col_free & ~hit_c)

  row = logp_BKNN[..., 0]
  init = (jnp.full_like(row, -1, jnp.int32), jnp.ones_like(row, bool), jnp.ones_like(row, bool))
  idx, _, _ = jax.lax.fori_loop(0, n, body, init)
  return jnp.maximum(idx, 0), idx >= 0


def _greedy_cases():
  """(name, logp [B, K, n, n], mask): random, many ties, -inf inside the mask, padded blocks,
  documents (block-diagonal, more rows than columns), empty rows, n above GREEDY_ROUNDS."""
  rng = np.random.default_rng(0)
  cases = []
  for n in (1, 2, 7, 33, 64):
    cases.append((f"random{n}", rng.normal(size=(3, 2, n, n)), np.ones((n, n), bool)))
  ties = rng.integers(0, 3, size=(4, 2, 9, 9)).astype(float)
  cases.append(("ties", ties, np.ones((9, 9), bool)))
  holes = rng.normal(size=(2, 2, 8, 8))
  holes[rng.random(holes.shape) < 0.3] = -np.inf
  cases.append(("-inf entries", holes, np.ones((8, 8), bool)))
  valid = np.array([[1] * 10, [1] * 6 + [0] * 4], bool)
  cases.append(("padded blocks", rng.normal(size=(2, 3, 10, 10)),
                (valid[:, :, None] & valid[:, None, :])[:, None]))
  owner = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
  pure = np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1], bool)
  docs = (owner[:, None] == owner[None, :]) & pure[None, :]
  cases.append(("documents", rng.normal(size=(2, 2, 10, 10)), docs))
  cases.append(("empty rows", rng.normal(size=(2, 2, 6, 6)), np.tril(np.ones((6, 6), bool), -1)))
  return cases


@pytest.mark.parametrize("name,logp,mask", _greedy_cases(), ids=lambda c: c
                         if isinstance(c, str) else "")
def test_greedy_rounds_equal_the_greedy_loop(name, logp, mask):
  """greedy_permutation (rounds of locally best entries) == the one-entry-per-step loop, on
  random matrices up to N = 64 (> GREEDY_ROUNDS), ties, -inf entries, padded blocks, packed
  documents and rows with nothing allowed."""
  logp, mask = jnp.asarray(logp, jnp.float32), jnp.asarray(mask)
  idx, ok = greedy_permutation(logp, mask)
  want_idx, want_ok = _greedy_one_at_a_time(logp, mask)
  np.testing.assert_array_equal(ok, want_ok)
  np.testing.assert_array_equal(np.where(want_ok, idx, -1), np.where(want_ok, want_idx, -1))


def test_greedy_past_its_rounds_keeps_every_pick_and_the_rest_take_their_best_free_column():
  """A chain the greedy rule takes one entry per round (row k + 1's best column is row k's,
  taken one round before): N = 40 rounds. GREEDY_ROUNDS = 32 rounds take the first 32 picks
  exactly; each later row then takes its largest column still free, which two rows may share
  (rows 32 and 33 both take column 32); with `rounds=40` the result is the greedy rule's."""
  from attn_jax.attention.sinkhorn import GREEDY_ROUNDS
  n = 40
  logp = np.full((n, n), -50.0)
  w = 1000.0 - np.arange(2 * n)                 # strictly decreasing along the chain
  for k in range(n):
    logp[k, k] = w[2 * k]                       # r_k -> c_k, taken in round k + 1
    if k + 1 < n:
      logp[k + 1, k] = w[2 * k + 1]             # r_{k+1}'s best column is c_k
  logp = jnp.asarray(logp[None, None], jnp.float32)
  mask = jnp.ones((n, n), bool)
  want, _ = _greedy_one_at_a_time(logp, mask)
  np.testing.assert_array_equal(want[0, 0], np.arange(n))
  idx, ok = greedy_permutation(logp, mask)
  assert GREEDY_ROUNDS == 32 and bool(ok.all())
  np.testing.assert_array_equal(idx[0, 0], list(range(33)) + list(range(32, n - 1)))
  one_round, _ = greedy_permutation(logp, mask, rounds=1)
  np.testing.assert_array_equal(one_round[0, 0], [0, 1] + list(range(1, n - 1)))
  np.testing.assert_array_equal(greedy_permutation(logp, mask, rounds=n)[0], want)


def test_causal_rows_equal_each_prefix_problem_with_gradients():
  """causal_sinkhorn_rows (all prefix problems at once, in scaling form, with a hand-written
  backward) == each problem's full matrix through sinkhorn_log (autodiff), values and
  gradients, plain and with packed-row document starts."""
  n, it = 7, 7
  logits = jax.random.normal(jax.random.key(4), (2, 3, n, n)) / 0.75
  weights = jax.random.normal(jax.random.key(5), (2, 3, n, n))
  starts = jnp.array([[0, 0, 0, 3, 3, 3, 3], [0, 0, 2, 2, 2, 5, 5]], jnp.int32)

  def one_by_one(lg, st):
    rows = []
    for i in range(n):
      if st is None:
        mask, lr, lc = causal_prefix_problem(n, i)
      else:
        mask, lr, lc = causal_prefix_problem(n, i, st[:, i])
      rows.append(sinkhorn_log(lg, mask, lr, lc, it)[..., i, :])
    return jnp.stack(rows, -2)

  for st in (None, starts):
    got = jnp.exp(causal_sinkhorn_rows(logits, it, st))
    want = jnp.exp(one_by_one(logits, st))
    np.testing.assert_allclose(got, want, atol=1e-6)
    loss = lambda f: lambda lg: jnp.sum(weights * jnp.exp(f(lg)))
    g = jax.grad(loss(lambda lg: causal_sinkhorn_rows(lg, it, st)))(logits)
    g_want = jax.grad(loss(lambda lg: one_by_one(lg, st)))(logits)
    np.testing.assert_allclose(g, g_want, atol=ATOL)


LOOP_MODES = [dict(), dict(n_sortcut=2), dict(causal=False), dict(causal=False, n_sortcut=2)]


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_no_while_loop_in_train_or_eval_forward(mode):
  """The mixer's train step (gradient, Gumbel noise) and eval forward (hard sorting: the
  greedy permutation in non-causal mode), causal packed rows too (document_layout), contain no
  while loop at 16 or 64 blocks: XLA:GPU pays a host round trip per iteration, and none of
  these loops had a fixed count (the causal rows' map and the greedy loop ran N times, the
  layout's scan T times). Lowered for the GPU: on the CPU, XLA rolls threefry's rounds (the
  Gumbel noise) into a loop of 5."""
  m = make(Opts(block_size=4, **mode))
  graphdef, params = nnx.split(m, nnx.Param)

  def train(p, x, pos, seg):
    f = lambda p_: jnp.sum(nnx.merge(graphdef, p_)(x, positions_BT=pos, segment_ids_BT=seg,
                                                   rng=jax.random.key(0), train=True)[0] ** 2)
    return jax.grad(f)(p)

  def evaluate(p, x, pos, seg):
    return nnx.merge(graphdef, p)(x, positions_BT=pos, segment_ids_BT=seg)[0]

  for T in (64, 256):
    x, pos = inputs(B=2, T=T)
    seg = jnp.broadcast_to(jnp.arange(T) // 37, (2, T)).astype(jnp.int32)
    pos_seg = (jnp.arange(T) % 37)[None].astype(jnp.int32) + 0 * pos
    runs = [(None, pos)] + ([(seg, pos_seg)] if mode.get("causal", True) else [])
    for s, p_ in runs:
      for f in (train, evaluate):
        text = jax.jit(f).trace(params, x, p_, s).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.while" not in text, (f.__name__, T, s is not None)


def test_document_layout_edge_cases_equal_the_cursor_loop():
  """document_layout (an associative scan of residue tables) == the cursor loop on edge cases:
  two tokens, every token its own document, documents of exactly b and b + 1 tokens, an id
  that comes back after another document (a new document), T not a multiple of b."""
  from attn_jax.attention.sinkhorn import document_layout
  rows = {4: [[7, 7], [0] * 9, list(range(9)), [1] * 4 + [2] * 5 + [3] * 3 + [1] * 2,
              [5, 6, 6, 6, 6, 6, 5, 5, 5, 8, 8, 8, 8]],
          1: [[0, 1, 1, 2], [3, 3, 3]],
          5: [[1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]]}
  for b, segs in rows.items():
    for seg in segs:
      seg = np.asarray([seg])
      got = np.asarray(document_layout(jnp.asarray(seg, jnp.int32), b))
      np.testing.assert_array_equal(got, _layout_loop(seg, b), err_msg=f"b={b} {seg}")



@pytest.mark.slow
def test_causal_rows_store_no_cubic_mask_on_tpu():
  """The gradient of all causal sort rows (n = 512 blocks), compiled for one TPU v5e chip,
  needs less than n^3 / 8 bytes of temporaries: the prefix problems' mask is on the [n, n] and
  [M, n] operands, so XLA:TPU stores no [M, n, n] boolean (with the shared boolean mask it
  stored one per direction: 137.8 MiB here, against 5.7 MiB without)."""
  from jax.sharding import SingleDeviceSharding

  from attn_jax import targets
  from attn_jax.attention.sinkhorn import causal_sinkhorn_rows
  if not targets.available("v5e-4"):
    pytest.skip("the TPU compile target needs libtpu (pip install -e '.[targets]')")
  n = 512
  L = jax.ShapeDtypeStruct((1, 2, n, n), jnp.float32,
                           sharding=SingleDeviceSharding(targets.devices("v5e-4")[0]))
  grad = jax.jit(jax.grad(lambda L: jnp.sum(jnp.exp(causal_sinkhorn_rows(L, 3)))))
  with targets.no_persistent_cache():
    temp = grad.lower(L).compile().memory_analysis().temp_size_in_bytes
  assert temp < n ** 3 / 8, f"{temp / 2 ** 20:.1f} MiB of temporaries"
