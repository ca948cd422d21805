"""attention/fox.py: Forgetting Attention against its explicit O(T^2) reference, exact and causal
at any length, decoding == the full forward, sharded == unsharded.

Errors are relative to the largest |value| of the reference (max|a - b| <= TOL * max|b|). The
forget gate is made strong (bias -> log f of several nats per token on some heads, down to -20
in the strong-forgetting tests, checked against the explicit reference in float64) and
q, k are boosted so that both the q.k term and the decay matter.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import kernel_choice
from attn_jax.attention import fox as F
from attn_jax.attention import score_bias as SB
from attn_jax.attention.cache import Ring, SinksRing
from attn_jax.attention.projection import sink_logit_of
from attn_jax.kernels import forget_xla as FX
from attn_jax.layers import time_cumsum
from attn_jax.model import Decoder, count_params
from attn_jax.model_config import ModelConfig
from configs import base
from tests.test_packing import one_row

TOL = 1e-5            # fp32, relative to the largest |value|; fixed once
PRO = dict(qk_norm=True, key_shift=True, value_shift=True, output_norm=True, output_gate=True)


def _cfg(mixer="fox", d_model=32, n_heads=4, n_kv_heads=0, n_layers=2, impl="einsum",
         dtype="float32", **opts):
  c = base.get_config()
  c.model.update(mixer=mixer, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                 n_layers=n_layers, d_ff=64, vocab_size=64, dtype=dtype, max_seq_len=65536,
                 attention_impl=impl)
  for k, v in opts.items():
    c.model[mixer][k] = v
  return ModelConfig.from_config(c.model)


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _positions(B, T):
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  chex.assert_trees_all_close(a, b, atol=tol * float(np.max(np.abs(b))), rtol=0.0)


def _boost(m, qk=4.0, gate=20.0):
  """Larger q.k, and a forget gate whose pre-activation spreads over ~[-4, 4] per token, with
  per-head biases from no forgetting (f ~ 1) to strong (log f ~ -3)."""
  m.proj.q.kernel[...] = m.proj.q.kernel[...] * qk
  m.proj.k.kernel[...] = m.proj.k.kernel[...] * qk
  m.fgate.kernel[...] = m.fgate.kernel[...] * gate
  H = m.fgate_bias.shape[-1]
  m.fgate_bias[...] = jnp.linspace(6.0, -3.0, H)
  return m


def _mixer(cfg, seed=0):
  return _boost(F.FoX(cfg, cfg.options_for("fox"), rngs=nnx.Rngs(params=seed)))


def _reference(m, x, pos=None):
  """The mixer's own features through the explicit reference, then its output stage."""
  q, k, v, loga, _ = m.features(x, pos, None)
  sink = sink_logit_of(m.opts, m.sink_logit, m.cfg.n_heads)
  y, _ = SB.forget_attention_reference(q, k, v, jnp.cumsum(loga, axis=1),
                                      scale=m.cfg.head_dim ** -0.5, sink_logit_H=sink)
  return m.proj.o(m.finish(y.astype(q.dtype), x))


# ---------------------------------------------------------------- the attention function

PATHS = ("blocked", "flash")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("T,block,H,K", [(37, 8, 2, 2), (64, 16, 4, 2), (5, 256, 2, 1)])
def test_forget_attention_matches_reference(T, block, H, K, sink, path):
  """Both paths (blocked: query blocks over all their keys; flash: diagonal blocks + past
  loops), T not a multiple of the block, GQA, with and without a sink column == explicit."""
  q, k, v = _normal(0, (2, T, H, 8)), _normal(1, (2, T, K, 8)), _normal(2, (2, T, K, 8))
  loga = -jnp.abs(_normal(3, (2, T, H))) * 2
  s = _normal(5, (H,)) if sink else None
  got = FX.forget_attention(q, k, v, loga, scale=8 ** -0.5, block=block, sink_logit_H=s,
                           path=path)
  want, _ = SB.forget_attention_reference(q, k, v, jnp.cumsum(loga, 1), scale=8 ** -0.5,
                                         sink_logit_H=s)
  _close(got, want)


def test_auto_path_is_blocked_up_to_its_length_then_flash():
  assert FX.choose_path("auto", FX.BLOCKED_MAX_LEN) == "blocked"
  assert FX.choose_path("auto", FX.BLOCKED_MAX_LEN + 256) == "flash"
  assert FX.choose_path("flash", 8) == "flash"
  for plat in ("gpu", "tpu"):   # accelerators: O(T) memory at every length
    with kernel_choice.use_platform(plat):
      assert FX.choose_path("auto", 256) == "flash"
      assert FX.choose_path("blocked", 256) == "blocked"
  with pytest.raises(ValueError, match="unknown path 'fast'"):
    FX.choose_path("fast", 8)


@pytest.mark.parametrize("path", PATHS)
def test_gradients_match_reference_and_finite_differences_float64(path):
  """d out / d (q, k, v, log f): blockwise == explicit reference, and both == float64 finite
  differences (check_grads)."""
  from jax.test_util import check_grads
  with jax.enable_x64(True):
    T, H = 11, 2
    args = (_normal(0, (1, T, H, 4), jnp.float64), _normal(1, (1, T, H, 4), jnp.float64),
            _normal(2, (1, T, H, 4), jnp.float64), -jnp.abs(_normal(3, (1, T, H), jnp.float64)))
    w = _normal(4, (1, T, H, 4), jnp.float64)
    blk = lambda q, k, v, la: jnp.sum(w * FX.forget_attention(q, k, v, la, scale=0.5, block=3,
                                                             path=path))
    ref = lambda q, k, v, la: jnp.sum(w * SB.forget_attention_reference(
        q, k, v, jnp.cumsum(la, 1), scale=0.5)[0])
    g_blk = jax.grad(blk, argnums=(0, 1, 2, 3))(*args)
    g_ref = jax.grad(ref, argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(g_blk, g_ref):
      np.testing.assert_allclose(a, b, atol=1e-12, rtol=1e-10)
    check_grads(jax.jit(blk), args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6, eps=1e-5)


def _strong_gates(seed, B, T, H):
  """log f under strong forgetting: per-head biases b_f = -8, -3, 0, 4 (cycled) plus a spread of
  5 nats, clipped at -20: gates from f ~ 1 to 20 nats per token, the strongest heads around
  8 per token, so a block of 256 decays by ~2000 nats and |g| reaches ~8 T."""
  z = np.resize([-8.0, -3.0, 0.0, 4.0], H) + 5.0 * np.random.default_rng(seed).standard_normal(
      (B, T, H))
  return jnp.asarray(np.maximum(-np.logaddexp(0.0, -z), -20.0), jnp.float32)


def _f64_reference(q, k, v, loga, idx, scale):
  """The explicit reference (`SB.forget_attention_reference`: g = cumsum(log f),
  s_ij = scale q_i.k_j + g_i - g_j for j <= i, softmax over j) in float64, rows idx; g is
  summed in float64 numpy."""
  f64 = lambda a: np.asarray(a, np.float64)
  with jax.enable_x64(True):
    out, _ = SB.forget_attention_reference(
        *(jnp.asarray(f64(a)) for a in (q, k, v)), jnp.asarray(np.cumsum(f64(loga), axis=1)),
        scale=scale, query_idx=idx)
    return np.asarray(out)


def _strong_forgetting(T, block, path, rows=None):
  """fp32 forget_attention vs the float64 explicit reference (inputs rounded to fp32 first) under
  strong forgetting; max |error| <= TOL * max |reference| over the checked rows (all, or
  every 7th plus both sides of every block boundary)."""
  q, k, v = _normal(0, (1, T, 4, 16)) * 2, _normal(1, (1, T, 2, 16)) * 2, _normal(2, (1, T, 2, 16))
  loga = _strong_gates(3, 1, T, 4)
  run = jax.jit(lambda *a: FX.forget_attention(*a, scale=0.25, block=block, path=path))
  out = run(q, k, v, loga)
  idx = np.arange(T) if rows is None else np.unique(np.concatenate(
      [np.arange(0, T, 7), np.arange(block - 2, T, block), np.arange(block, T, block)]))
  _close(np.asarray(out)[:, idx], _f64_reference(q, k, v, loga, idx, 0.25))
  return q, k, v, loga


@pytest.mark.parametrize("path", PATHS)
def test_strong_forgetting_across_block_boundaries(path):
  """log f down to -20 nats per token, 8 blocks of 128 (|g| ~ 8,000 nats): within TOL of the
  float64 explicit reference on every row; decay differences taken from two long fp32 prefix
  sums miss it by 2x here, and by 10x at 2K tokens."""
  _strong_forgetting(1024, 128, path)


@pytest.mark.parametrize("chunks", [(1024,), (512, 512)])
def test_cached_prefill_under_strong_forgetting(chunks):
  """The decoding path (`_cached`: a prompt into a KV cache, in one chunk or two) under the same
  strong forgetting: within TOL of the float64 explicit reference on every row. The pair decays
  among a chunk's own tokens and the per-key g_j - g_last it caches are both differences of
  long sums, taken from a compensated cumulative sum."""
  T = sum(chunks)
  cfg = _cfg(d_model=64, n_heads=4, n_kv_heads=2, dtype="float32")
  opts = cfg.options_for("fox")
  mixer = F.FoX(cfg, opts, rngs=nnx.Rngs(0))
  q, k, v = _normal(0, (1, T, 4, 16)) * 2, _normal(1, (1, T, 2, 16)) * 2, _normal(2, (1, T, 2, 16))
  loga = _strong_gates(3, 1, T, 4)
  kv = F.FoX.init_state(cfg, opts, 1, T, jnp.float32).cache
  run = jax.jit(lambda *a: mixer._cached(*a, None))
  outs, a = [], 0
  for n in chunks:
    part = slice(a, a + n)
    out, kv = run(q[:, part], k[:, part], v[:, part], loga[:, part],
                  jnp.arange(a, a + n, dtype=jnp.int32)[None], kv)
    outs.append(np.asarray(out))
    a += n
  _close(np.concatenate(outs, axis=1), _f64_reference(q, k, v, loga, np.arange(T), 0.25))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [4096, 8192])
def test_strong_forgetting_at_4k_and_8k(T, path):
  """The same at T 4096 / 8192 with the default block (|g| ~ 65,000 nats at 8K)."""
  _strong_forgetting(T, FX.DEFAULT_BLOCK, path, rows="sampled")


def _long(T, block=256, path="auto"):
  """One head forgets ~3 nats per token (|g| ~ 3 T), the other hardly (f ~ 0.999). fp32
  blockwise vs the float64 reference on 48 query rows; gradients finite."""
  q, k, v = (_normal(s, (1, T, 2, 8)) * 2 for s in range(3))
  loga = jnp.stack([-3.0 - jnp.abs(_normal(3, (1, T))), jnp.full((1, T), -1e-3)], -1)
  idx = np.unique(np.concatenate([np.arange(8), np.linspace(0, T - 1, 40).astype(int)]))

  def loss(q, k, v, la):
    return jnp.sum(FX.forget_attention(q, k, v, la, scale=8 ** -0.5, block=block,
                                      path=path)[:, idx])

  out = jax.jit(lambda *a: FX.forget_attention(*a, scale=8 ** -0.5, block=block, path=path))(
      q, k, v, loga)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, loga)
  assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
  _close(out[:, idx], _f64_reference(q, k, v, loga, idx, 8 ** -0.5))
  return out, grads


@pytest.mark.parametrize("path", PATHS)
def test_long_sequence_strong_forgetting_4k(path):
  _long(4096, block=256, path=path)


@pytest.mark.slow
def test_long_sequence_strong_forgetting_32k():
  _long(32768, block=512)


# ---------------------------------------------------------------- the mixer

@pytest.mark.parametrize("impl", ["einsum", "blocked", "xla"])
@pytest.mark.parametrize("opts", [dict(block_size=8), dict(block_size=4, rope=True, **PRO),
                                  dict(block_size=8, sink_logit="learned")])
def test_mixer_matches_reference_on_every_cpu_core(impl, opts):
  cfg = _cfg(impl=impl, **opts)
  m = _mixer(cfg)
  x = _normal(5, (2, 21, 32))
  got = m(x, positions_BT=_positions(2, 21))[0]
  _close(got, _reference(m, x, _positions(2, 21)))


def test_gqa_mixer_matches_reference():
  cfg = _cfg(n_kv_heads=2, block_size=8, **PRO)
  m = _mixer(cfg)
  x = _normal(5, (2, 19, 32))
  _close(m(x, positions_BT=None)[0], _reference(m, x))


@pytest.mark.parametrize("opts", [dict(), PRO])
def test_causal_by_gradient(opts):
  """d y_t / d x_s = 0 for s > t, and != 0 for s <= t (blockwise path across blocks)."""
  m = _mixer(_cfg(block_size=4, **opts))
  x = _normal(6, (1, 13, 32))
  t = 6
  g = jax.grad(lambda x: jnp.sum(m(x)[0][:, t]))(x)
  assert np.all(np.asarray(g[:, t + 1:]) == 0)
  assert np.all(np.abs(np.asarray(g[:, :t + 1])).sum(-1) > 0)


@nnx.jit
def _decode(model, tokens, state, start):
  B, T = tokens.shape
  pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
  return model.step(tokens, positions_BT=pos, state=state)


def _decode_all(model, tokens, chunks, capacity, policy=None):
  """Feed the stream in the given chunk lengths under a cache policy; concatenated logits."""
  cache, outs, t = model.init_state(tokens.shape[0], capacity, policy), [], 0
  for n in chunks:
    logits, cache = _decode(model, tokens[:, t:t + n], cache, jnp.asarray(t, jnp.int32))
    outs.append(logits)
    t += n
  return jnp.concatenate(outs, axis=1)


def _model(cfg):
  model = Decoder(cfg, rngs=nnx.Rngs(params=0))
  _boost(model.blocks.layers[0].mixer)      # the period's one layer (stacked over repeats)
  return model


@pytest.mark.parametrize("impl", ["einsum", "blocked", "xla"])
@pytest.mark.parametrize("opts,policy", [(dict(block_size=4), None),
                                         (dict(block_size=4, rope=True, **PRO), None),
                                         (dict(block_size=4, **PRO), Ring(16))])
def test_decode_matches_full_forward(impl, opts, policy):
  """Token by token, and prefill + chunks + steps, equal the full forward (a window as long as
  the stream evicts nothing)."""
  model = _model(_cfg(impl=impl, **opts))
  B, T = 2, 12
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 64, (B, T)), jnp.int32)
  full = nnx.jit(lambda m, t: m.logits_and_aux(t)[0])(model, tokens)
  _close(_decode_all(model, tokens, [1] * T, 16, policy), full)
  _close(_decode_all(model, tokens, [5, 3, 1, 1, 1, 1], 16, policy), full)


@nnx.jit
def _call(m, x, pos, state):
  return m(x, positions_BT=pos, state=state)


@pytest.mark.parametrize("sinks", [0, 2])
def test_ring_eviction_matches_windowed_reference(sinks):
  """A ring smaller than the stream: each query sees its last W tokens (plus the first n), with
  the true decay g_i - g_j over everything in between (evicted tokens included)."""
  W, T = 5, 14
  cfg = _cfg(n_layers=1)
  m = _mixer(cfg)
  x = _normal(7, (2, T, 32))
  policy = SinksRing(sinks, W) if sinks else Ring(W)
  state = F.FoX.init_state(cfg, m.opts, 2, 0, jnp.float32, policy=policy)
  outs, t = [], 0
  for n in (3, 1, 4, 1, 5):
    y, state, _ = _call(m, x[:, t:t + n], _positions(2, n) + t, state)
    outs.append(y)
    t += n
  q, k, v, loga, _ = m.features(x, None, None)
  g = jnp.cumsum(loga, axis=1)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  visible = (j <= i) & ((i - j < W) | (j < sinks))
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * cfg.head_dim ** -0.5
  s = s + g.transpose(0, 2, 1)[..., :, None] - g.transpose(0, 2, 1)[..., None, :]
  p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
  want = m.proj.o(jnp.einsum("bhij,bjhd->bihd", p, v))
  _close(jnp.concatenate(outs, axis=1), want)


def test_padding_leaves_the_state_unchanged():
  """Right-padded prompts of different lengths: each row equals its own unpadded run."""
  cfg = _cfg(n_layers=1, key_shift=True, value_shift=True)
  m = _mixer(cfg)
  x = _normal(8, (2, 9, 32))
  pos = jnp.asarray([list(range(9)), list(range(6)) + [-1] * 3], jnp.int32)
  st = F.FoX.init_state(cfg, m.opts, 2, 16, jnp.float32)
  y, st, _ = _call(m, x, pos, st)
  nxt = _normal(9, (2, 1, 32))
  y2, _, _ = _call(m, nxt, jnp.asarray([[9], [6]], jnp.int32), st)
  row = F.FoX.init_state(cfg, m.opts, 1, 16, jnp.float32)
  y1, row, _ = _call(m, x[1:, :6], _positions(1, 6), row)
  y12, _, _ = _call(m, nxt[1:], jnp.asarray([[6]], jnp.int32), row)
  _close(y[1:, :6], y1)
  _close(y2[1:], y12)


def test_batch_sharded_forward_equals_unsharded():
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attn_jax.sharding import make_mesh
  mesh = make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"))
  m = _mixer(_cfg(block_size=4, **PRO))
  x, pos = _normal(10, (8, 11, 32)), _positions(8, 11)
  want = m(x, positions_BT=pos)[0]
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  got = nnx.jit(lambda m_, x_, p_: m_(x_, positions_BT=p_)[0])(m, put(x), put(pos))
  _close(got, want)


# ---------------------------------------------------------------- parameters, config

@pytest.mark.parametrize("size,override", [("50m", ""), ("152m", ""), ("369m", ""),
                                           ("152m", "pro")])
def test_configs_match_the_transformer(size, override):
  """Within the rounding of d_ff to a multiple of 4 (at most 2 d_ff units: 6 d per layer)."""
  import importlib
  tc = importlib.import_module(f"configs.transformer_{size}").get_config().model
  fc = importlib.import_module(f"configs.fox_{size}").get_config(override).model
  assert fc.mixer == "fox" and fc.fox.output_gate == (override == "pro")
  diff = count_params(fc)["total"] - count_params(tc)["total"]
  assert abs(diff) <= tc.n_layers * 6 * tc.d_model


def test_extra_params_are_what_the_mixer_creates():
  cfg = _cfg(n_kv_heads=2, **PRO)
  plain = _cfg(mixer="attention", n_kv_heads=2)
  n = lambda c: count_params(c)["total"]
  assert n(cfg) - n(plain) == 2 * F.extra_params(32, 4, 2, cfg.options_for("fox"))


@pytest.mark.parametrize("field,value,msg", [
    ("block_size", -1, "block_size"), ("rope", 1, "rope"), ("path", "fast", "path"),
    ("forget_bias_init", float("nan"), "forget_bias_init")])
def test_validate_names_the_field(field, value, msg):
  with pytest.raises(ValueError, match=f"fox.{msg}"):
    _cfg().with_options("fox", **{field: value})


def test_rope_with_a_ring_cache_is_refused():
  cfg = _cfg(rope=True)
  with pytest.raises(ValueError, match="fox.rope"):
    F.FoX.init_state(cfg, cfg.options_for("fox"), 1, 8, jnp.float32, policy=Ring(4))


# ---------------------------------------------------------------- packed rows

@pytest.mark.parametrize("path", PATHS)
def test_packed_rows_match_reference_and_each_document_alone(path):
  """Segment ids (documents of 1, 6, 9, 5 tokens, blocks of 4: documents start inside
  blocks, one spans three): blockwise == the explicit reference (pairs of other documents
  masked, g restarted per document), each document == itself alone, forward and gradients;
  strong forgetting, so pairs across a restart carry large positive (masked) biases; a
  gradient never crosses a boundary (exact zeros)."""
  from attn_jax.layers import segment_starts
  docs, block = (1, 6, 9, 5), 4
  T = sum(docs)
  _, seg, spans = one_row(docs)
  q, k, v = _normal(0, (1, T, 4, 8)) * 2, _normal(1, (1, T, 2, 8)) * 2, _normal(2, (1, T, 2, 8))
  loga = -jnp.abs(_normal(3, (1, T, 4))) * 6
  w = _normal(4, (1, T, 4, 8))
  blk = lambda q, k, v, la, s=seg: FX.forget_attention(q, k, v, la, scale=8 ** -0.5, block=block,
                                                      segment_ids_BT=s, path=path)
  ref = lambda q, k, v, la: SB.forget_attention_reference(
      q, k, v, time_cumsum(la, segment_starts(seg)), scale=8 ** -0.5, segment_ids_BT=seg)[0]
  grads = lambda f, mask: jax.grad(lambda *a: jnp.sum(mask * w * f(*a)), argnums=(0, 1, 2, 3))
  args = (q, k, v, loga)

  @jax.jit
  def packed(*a):
    return blk(*a), ref(*a), grads(blk, 1.0)(*a), grads(ref, 1.0)(*a)

  out, want, g_blk, g_ref = packed(*args)
  _close(out, want)
  for a, b in zip(g_blk, g_ref):
    assert np.all(np.isfinite(a))
    _close(a, b)
  in_doc = jax.jit(lambda mask, *a: grads(blk, mask)(*a))
  for a, e in spans:
    alone = jax.jit(lambda *x: blk(*x, s=None))(q[:, a:e], k[:, a:e], v[:, a:e], loga[:, a:e])
    _close(out[:, a:e], alone)
    mask = jnp.zeros((1, T, 1, 1)).at[:, a:e].set(1.0)
    outside = np.ones(T, bool)
    outside[a:e] = False
    assert all(np.all(np.asarray(gi)[:, outside] == 0) for gi in in_doc(mask, *args)), (a, e)
