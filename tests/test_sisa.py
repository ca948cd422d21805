"""attention/sisa.py: SISA against its explicit O(L^2) reference, exact and causal at any length.

Errors are measured relative to the largest |value| of the reference (max|a - b| <= TOL * max|b|),
so entries near zero do not dominate. The SISA term is boosted (`_boost`) so that it is O(1)
next to q.k: at init_std 0.02 it would be ~1e-2 and a wrong decay would go unnoticed.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import kernel_choice
from attn_jax.attention import sisa as S
from attn_jax.attention.mha import Attention
from attn_jax.kernels import sisa_xla
from attn_jax.kernels.dense import attention_reference
from attn_jax.model import Decoder, count_params
from attn_jax.model_config import ModelConfig, validate_model
from configs import base
from tests.test_packing import one_row

TOL = 1e-5            # fp32, relative to the largest |value|; fixed once
HALF_LIFE_10 = math.log(math.expm1(math.log(2) / 10))   # decay bias: -log a = ln2/10 (~ -2.63)


def _cfg(d_model=32, n_heads=2, n_layers=2, dtype="float32", mixer="sisa", **sisa):
  c = base.get_config()
  c.model.update(mixer=mixer, d_model=d_model, n_heads=n_heads, n_layers=n_layers, d_ff=64,
                 vocab_size=64, dtype=dtype, max_seq_len=65536)
  c.model.sisa.d_state = 8
  for k, v in sisa.items():
    c.model.sisa[k] = v
  return ModelConfig.from_config(c.model)


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _positions(B, T):
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _boost(m, bc=6.0, qk=4.0, phase=20.0):
  """Scale W_B, W_C (SISA term O(1)), W_q, W_k and W_theta (phases turn ~1 rad per token)."""
  for lin, f in ((m.b_proj, bc), (m.c_proj, bc), (m.proj.q, qk), (m.proj.k, qk),
                 (m.phase_proj, phase)):
    lin.kernel[...] = lin.kernel[...] * f
  return m


def _mixer(cfg, seed=0):
  return _boost(S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(params=seed)))


def _close(a, b, tol=TOL):
  """max|a - b| <= tol * max|b| (chex, with the tolerance scaled by the reference's size)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  chex.assert_trees_all_close(a, b, atol=tol * float(np.max(np.abs(b))), rtol=0.0)


@nnx.jit
def _run(m, x, pos):
  y, _, aux = m(x, positions_BT=pos)
  return y, aux


@nnx.jit
def _reference(m, x, pos, query_idx):
  q, k, v, c, b, loga, theta, lam = m.features(x, pos)
  g, phi = S.decay_and_phase(loga, theta)
  out, _ = S.sisa_attention_reference(q, k, v, c, b, g, phi, lam, query_idx=query_idx)
  return m.proj.o(out)


@nnx.jit
def _clamped_reference(m, x, pos):
  """The authors' method: c = (max g + min g)/2 over the sequence, g - c clamped to [-11, 11]."""
  q, k, v, c, b, loga, theta, lam = m.features(x, pos)
  g, phi = S.decay_and_phase(loga, theta)
  gc = jnp.clip(g - (g.max(1, keepdims=True) + g.min(1, keepdims=True)) / 2, -11.0, 11.0)
  dh = q.shape[-1]
  qs = (lam * math.sqrt(dh) * jnp.exp(gc))[..., None] * S.rotate_pairs(c, phi)
  ks = jnp.exp(-gc)[..., None] * S.rotate_pairs(b, phi)
  out = attention_reference(jnp.concatenate([q, qs], -1), jnp.concatenate([k, ks], -1), v,
                            scale=dh ** -0.5)
  return m.proj.o(out)


# ---------------------------------------------------------------- against the reference

@pytest.mark.parametrize("path,extra", [
    ("fast", {}),
    ("chunked", {"chunk_size": 8}),
    ("chunked", {"chunk_size": 7}),          # ragged last chunk
    ("auto", {}),
    ("fast", {"use_decay": False}),
    ("fast", {"use_phase": False}),
    ("chunked", {"chunk_size": 8, "use_phase": False, "learn_lambda": False}),
])
def test_matches_reference_short(path, extra):
  T = 24
  m = _mixer(_cfg(path=path, decay_bias_init=-1.0, **extra))
  x, pos = _normal(1, (2, T, 32)), _positions(2, T)
  y, aux = _run(m, x, pos)
  _close(y, _reference(m, x, pos, jnp.arange(T)))
  assert float(aux["chunked"]) == (path == "chunked")
  if not extra.get("use_decay", True):
    assert float(aux["decay_range"]) == 0.0 and math.isinf(float(aux["half_life"]))


def test_long_fast_decay_matches_reference_where_clamping_fails():
  """2048 tokens at a half-life of ~10 tokens: decay range ~140 nats >> fast_max_range (60)
  and >> the 22 nats the clamp-based reference code can represent."""
  T = 2048
  m = _mixer(_cfg(d_model=16, n_heads=2, decay_bias_init=HALF_LIFE_10))
  x, pos = _normal(2, (1, T, 16)), _positions(1, T)
  y, aux = _run(m, x, pos)
  assert float(aux["chunked"]) == 1.0 and float(aux["decay_range"]) > 100
  assert 8 < float(aux["half_life"]) < 12
  idx = np.r_[0:8, 1000:1008, T - 16:T]
  ref = _reference(m, x, pos, jnp.asarray(idx))
  _close(y[:, idx], ref)
  # The clamp-based method is wrong on every row but the first (per-row relative error; the
  # early rows too, since its offset c reads the future).
  ref, clamped = np.asarray(ref), np.asarray(_clamped_reference(m, x, pos)[:, idx])
  err = np.abs(clamped - ref).max(-1) / np.abs(ref).max(-1)            # [1, rows]
  assert np.mean(err[:, 1:]) > 0.05, f"clamp-based method unexpectedly close: {err}"


def test_bf16_long_is_finite_with_gradients():
  T = 4096
  m = _mixer(_cfg(d_model=16, n_heads=2, dtype="bfloat16", decay_bias_init=HALF_LIFE_10,
                  path="chunked", chunk_size=1024))
  x, pos = _normal(3, (1, T, 16), jnp.bfloat16), _positions(1, T)

  @nnx.jit
  def loss_and_grads(m, x):
    def loss(m, x):
      y, _, aux = m(x, positions_BT=pos)
      return jnp.mean(jnp.square(y.astype(jnp.float32))), aux
    return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)

  (val, aux), (gm, gx) = loss_and_grads(m, x)
  assert float(aux["decay_range"]) > 200
  leaves = [val, gx] + jax.tree.leaves(nnx.state(gm))
  assert all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in leaves)
  assert float(jnp.max(jnp.abs(nnx.state(gm)["lambda_raw"][...]))) > 0


# ---------------------------------------------------------------- causality

@pytest.mark.parametrize("path", ["fast", "chunked"])
def test_causal_by_gradient(path):
  """d out_i / d x_j == 0 exactly for j > i (and != 0 for some j <= i)."""
  T = 12
  m = _mixer(_cfg(path=path, chunk_size=4, decay_bias_init=-1.0))
  graphdef, state = nnx.split(m)
  pos = _positions(1, T)
  jac = jax.jit(jax.jacrev(lambda x: nnx.merge(graphdef, state)(x, positions_BT=pos)[0]))(
      _normal(4, (1, T, 32)))
  j = np.abs(np.asarray(jac[0, :, :, 0, :, :])).max(axis=(1, 3))  # [T out, T in]
  assert np.all(j[np.triu_indices(T, 1)] == 0.0)
  assert np.all(np.diag(j) > 0) and np.all(j[np.tril_indices(T, -1)] > 0)


@pytest.mark.parametrize("variant", ["path_switch", "chunked"])
def test_prefix_consistency(variant):
  """Logits of the first 8 tokens do not depend on the tokens after them — also when the longer
  sequence crosses fast_max_range and takes the chunked path while the prefix takes the fast one."""
  if variant == "path_switch":  # -log a ~ softplus(0.5) ~ 0.97 nats/token: 8 tokens < 12 < 16
    cfg = _cfg(decay_bias_init=0.5, fast_max_range=12.0)
  else:
    cfg = _cfg(path="chunked", chunk_size=4, decay_bias_init=-1.0)
  model = Decoder(cfg, rngs=nnx.Rngs(params=0))
  _boost(model.blocks.layers[0].mixer)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 16)), jnp.int32)
  fwd = nnx.jit(lambda m, t: m.logits_and_aux(t))
  full, aux_full = fwd(model, tokens)
  pre, aux_pre = fwd(model, tokens[:, :8])
  _close(full[:, :8], pre)
  if variant == "path_switch":
    assert np.all(np.asarray(aux_full["chunked"]) == 1)
    assert np.all(np.asarray(aux_pre["chunked"]) == 0)


# ---------------------------------------------------------------- decoding

@nnx.jit
def _decode(m, tokens, state, start):
  B, T = tokens.shape
  pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
  return m.step(tokens, positions_BT=pos, state=state)


@pytest.mark.parametrize("variant", ["fast", "chunked"])
def test_decode_matches_full_forward(variant):
  """Token-by-token decoding and prefill + steps equal the full forward of the Decoder."""
  if variant == "fast":
    cfg = _cfg(decay_bias_init=-1.0)
  else:  # full forward takes the chunked path (range ~ 12 x 0.97 nats > 5)
    cfg = _cfg(decay_bias_init=0.5, fast_max_range=5.0, chunk_size=4)
  model = Decoder(cfg, rngs=nnx.Rngs(params=0))
  _boost(model.blocks.layers[0].mixer)
  B, T, n_pre = 2, 12, 5
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 64, (B, T)), jnp.int32)
  full, aux = nnx.jit(lambda m, t: m.logits_and_aux(t))(model, tokens)
  assert np.all(np.asarray(aux["chunked"]) == (variant == "chunked"))

  cache = model.init_state(B, 16)
  steps = []
  for t in range(T):
    logits, cache = _decode(model, tokens[:, t:t + 1], cache, jnp.asarray(t, jnp.int32))
    steps.append(logits)
  _close(jnp.concatenate(steps, axis=1), full)

  cache = model.init_state(B, 16)
  pre, cache = _decode(model, tokens[:, :n_pre], cache, jnp.asarray(0, jnp.int32))
  outs = [pre]
  for t in range(n_pre, T):
    logits, cache = _decode(model, tokens[:, t:t + 1], cache, jnp.asarray(t, jnp.int32))
    outs.append(logits)
  _close(jnp.concatenate(outs, axis=1), full)


@pytest.mark.parametrize("path", ["auto", "fast"])
def test_decode_exact_at_long_range(path):
  """Prefill 480 tokens into the cache, then 32 one-token steps: equal to the explicit reference
  with a decay range of ~120 nats (beyond the fast path; every step stays exact). The path of
  the full forward is irrelevant to the cache path; "fast" is only forced where it is valid."""
  T, n_pre = 512, 480
  bias = math.log(math.expm1(0.23)) if path == "auto" else HALF_LIFE_10 - 3.0
  m = _mixer(_cfg(d_model=16, n_heads=2, decay_bias_init=bias, path=path))
  x, pos = _normal(12, (1, T, 16)), _positions(1, T)
  cache = S.SISA.init_state(m.cfg, m.opts, 1, T, jnp.float32)

  @nnx.jit
  def run(m, x, pos, cache, index):
    del index  # the state knows where it is; positions say where the tokens are
    y, cache, aux = m(x, positions_BT=pos, state=cache)
    return y, cache, aux

  outs = []
  y, cache, _ = run(m, x[:, :n_pre], pos[:, :n_pre], cache, jnp.asarray(0, jnp.int32))
  outs.append(y)
  for t in range(n_pre, T):
    y, cache, aux = run(m, x[:, t:t + 1], pos[:, t:t + 1], cache, jnp.asarray(t, jnp.int32))
    outs.append(y)
  if path == "auto":
    assert float(aux["decay_range"]) > 100
  idx = np.r_[0:4, n_pre - 4:T]
  _close(jnp.concatenate(outs, axis=1)[:, idx], _reference(m, x, pos, jnp.asarray(idx)))
  _close(jnp.concatenate(outs, axis=1), _run(m, x, pos)[0])


# ---------------------------------------------------------------- lambda

def test_lambda_zero_is_exactly_attention():
  """lambda = softplus(-1e4) = 0: SISA is the baseline attention with the same q/k/v/o weights
  (the state channels of Q^ are exactly zero), whatever B, C, decay and phase are."""
  cfg = _cfg(learn_lambda=False, lambda_init=-1e4, decay_bias_init=-1.0)
  m = _mixer(cfg)
  attn = Attention(cfg.replace(mixer="attention"), Attention.Options(), rngs=nnx.Rngs(params=1))
  nnx.update(attn.proj, nnx.state(m.proj))
  x, pos = _normal(7, (2, 16, 32)), _positions(2, 16)
  y, aux = _run(m, x, pos)
  y_attn = nnx.jit(lambda a, x: a(x, positions_BT=pos)[0])(attn, x)
  assert float(aux["lambda"]) == 0.0
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_attn))


@pytest.mark.parametrize("learn", [True, False])
def test_learn_lambda_switch(learn):
  m = _mixer(_cfg(learn_lambda=learn, decay_bias_init=-1.0, path="fast"))
  x, pos = _normal(8, (1, 8, 32)), _positions(1, 8)
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.square(m(x, positions_BT=pos)[0]))))(m)
  g = np.asarray(nnx.state(grads)["lambda_raw"][...])
  assert np.all(g != 0) if learn else np.all(g == 0)
  meta = m.lambda_raw.get_metadata()   # the optimizer's treatment travels with the parameter
  assert meta["lr_mult"] == 0.1 and meta["kind"] == "scalar"   # kind "scalar": not decayed


# ---------------------------------------------------------------- gradients in float64

def _attend64(q, k, v, *, scale, causal=True, q_positions=None, kv_positions=None, bias=None,
              impl="auto", sink_logit_H=None):
  """Plain float64 attention (entry.attend computes in fp32) for the finite-difference check."""
  del impl
  assert sink_logit_H is None
  B, T, H, _ = q.shape
  S_ = k.shape[1]
  qp = q_positions if q_positions is not None else _positions(B, T) + (S_ - T)
  kp = kv_positions if kv_positions is not None else _positions(B, S_)
  s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
  if bias is not None:
    s = s + bias
  mask = (kp[:, None, None, :] <= qp[:, None, :, None]) | (not causal)
  p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", p, v)


def _rope64(x, cos, sin):
  d2 = x.shape[-1] // 2
  x1, x2 = x[..., :d2], x[..., d2:]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _angles64(positions, dim, theta):
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float64) / dim))
  ang = positions.astype(jnp.float64)[..., None] * inv_freq
  return jnp.cos(ang), jnp.sin(ang)


@pytest.mark.parametrize("path", ["fast", "chunked"])
def test_gradients_match_finite_differences_float64(monkeypatch, path):
  from jax.test_util import check_grads
  monkeypatch.setattr(S, "attend", _attend64)     # fp64 stand-ins for the fp32 shared helpers
  from attn_jax.attention import projection
  monkeypatch.setattr(projection, "apply_rope", _rope64)
  monkeypatch.setattr(projection, "rope_angles", _angles64)
  with jax.enable_x64(True):
    opts = dict(base.get_config().model.sisa.to_dict(), d_state=4, path=path, chunk_size=3,
                decay_bias_init=0.0)
    cfg = ModelConfig(mixer="sisa", d_model=8, n_heads=2, n_layers=1, d_ff=16, vocab_size=16,
                      dtype="float64", param_dtype="float64",
                      options=(("sisa", S.SISA.Options(**opts)),))
    m = _boost(S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(params=0)), bc=4.0, qk=4.0, phase=10.0)
    graphdef, state = nnx.split(m)
    T = 7
    x, pos = _normal(9, (1, T, 8), jnp.float64), _positions(1, T)
    w = _normal(10, (1, T, 8), jnp.float64)

    def f(state, x):
      y, _, aux = nnx.merge(graphdef, state)(x, positions_BT=pos)
      return jnp.sum(y * w)

    assert float(nnx.merge(graphdef, state)(x, positions_BT=pos)[2]["decay_range"]) > 3
    check_grads(jax.jit(f), (state, x), order=1, modes=("rev",), atol=1e-6, rtol=1e-6, eps=1e-5)


# ---------------------------------------------------------------- parameters, hooks, config

@pytest.mark.parametrize("size,d_ff_32", [("50m", 1832), ("152m", 2748), ("369m", 2512)])
def test_param_count_matches_transformer(size, d_ff_32):
  import importlib
  sisa_mod = importlib.import_module(f"configs.sisa_{size}")
  trans = importlib.import_module(f"configs.transformer_{size}").get_config().model
  n_t = count_params(trans)
  assert sisa_mod.get_config().model.d_ff == d_ff_32   # docs/papers.md §1.3, d_s = 32
  for d_state in (16, 32, 64, 128):
    for arg in (str(d_state), f"d_state={d_state}"):
      m = sisa_mod.get_config(arg).model
      assert m.sisa.d_state == d_state and m.mixer == "sisa"
    n_s = count_params(m)
    assert abs(n_s["total"] - n_t["total"]) <= 1e-3 * n_t["total"], (d_state, n_s, n_t)
    extra = S.sisa_extra_params(m.d_model, m.n_heads, d_state) * m.n_layers
    assert n_s["mixer"] - n_t["mixer"] == extra


def test_hooks():
  cfg = _cfg(d_model=64, n_heads=4)
  L = 1000
  opts = cfg.options_for("sisa")
  assert S.SISA.flops_per_token(cfg, opts, L) == pytest.approx(
      Attention.flops_per_token(cfg, Attention.Options(), L) + 2 * 4 * 8 * (L + 1) / 2)
  state = S.SISA.init_state(cfg, opts, 3, 20, jnp.bfloat16)
  kv = state.cache
  assert kv.k.shape == (3, 4, 20, 16) and kv.kx.shape == (3, 4, 20, 8)   # R(Phi) B: head-major
  assert kv.kx.dtype == jnp.bfloat16 and kv.extra.g.dtype == jnp.float32
  assert kv.extra.g.shape == (3, 20, 4)
  assert state.g.shape == (3, 4) and state.phi.shape == (3, 4, 4)


@pytest.mark.parametrize("field,value", [
    ("d_state", 7), ("d_state", 0), ("d_state", 8.0), ("chunk_size", -1), ("path", "bogus"),
    ("fast_max_range", 100.0), ("use_phase", 1), ("lambda_init", float("nan")),
    ("decay_bias_init", None), ("n_kv_heads", 1),
])
def test_validate_names_the_field(field, value):
  opts = base.get_config().model.sisa.to_dict()
  kw = {}
  if field == "n_kv_heads":
    kw["n_kv_heads"], name = value, "config.model.n_kv_heads"
  else:
    opts[field], name = value, f"config.model.sisa.{field}"
  cfg = ModelConfig(mixer="sisa", d_model=32, n_heads=2,
                    options=(("sisa", S.SISA.Options(**opts)),), **kw)
  with pytest.raises(ValueError, match=name.replace(".", r"\.")):
    validate_model(cfg)
  validate_model(cfg.replace(n_kv_heads=0, options=(("sisa", S.SISA.Options()),)))


# ---------------------------------------------------------------- long (slow)

@pytest.mark.slow
def test_32k_tokens_single_head_exact_and_bf16_finite():
  """32K tokens, half-life ~10 tokens: decay range ~2,300 nats; exact against the reference."""
  T = 32768
  m = _mixer(_cfg(d_model=8, n_heads=1, d_state=4, decay_bias_init=HALF_LIFE_10))
  x, pos = _normal(11, (1, T, 8)), _positions(1, T)
  y, aux = _run(m, x, pos)
  assert float(aux["chunked"]) == 1.0 and float(aux["decay_range"]) > 2000
  idx = np.r_[0:4, 16384:16388, T - 8:T]
  _close(y[:, idx], _reference(m, x, pos, jnp.asarray(idx)))
  mb = _mixer(_cfg(d_model=8, n_heads=1, d_state=4, dtype="bfloat16",
                   decay_bias_init=HALF_LIFE_10))
  yb, _ = _run(mb, x.astype(jnp.bfloat16), pos)
  assert bool(jnp.all(jnp.isfinite(yb.astype(jnp.float32))))


# ---------------------------------------------------------------- with and without jit

class SISAVariantsTest(chex.TestCase):
  """The mixer's paths against the explicit reference, traced (jit) and eager (no jit)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_paths_match_reference(self):
    for path in ("fast", "chunked"):
      m = _mixer(_cfg(path=path, chunk_size=5, decay_bias_init=-1.0))
      graphdef, state = nnx.split(m)
      x, pos = _normal(21, (1, 11, 32)), _positions(1, 11)
      run = self.variant(lambda st, x: nnx.merge(graphdef, st)(x, positions_BT=pos)[0])
      y = run(state, x)
      chex.assert_shape(y, (1, 11, 32))
      chex.assert_tree_all_finite(y)
      _close(y, _reference(m, x, pos, jnp.arange(11)))


# ---------------------------------------------------------------- phase precision (slow)

def _rotate64(x, phi):
  """R(Phi) x in float64 (numpy): interleaved pairs rotated by the angles."""
  x0, x1 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = x0 * np.cos(phi) - x1 * np.sin(phi)
  out[..., 1::2] = x0 * np.sin(phi) + x1 * np.cos(phi)
  return out


def _float64_reference(m, x, idx):
  """The mixer's output at query rows `idx`, everything after the per-token features in numpy
  float64: g and Phi summed in float64 from the mixer's log a and theta (independent of its
  cumulative sums), the rotations from those angles, the softmax and W_o."""
  q, k, v, c, b, loga, theta, lam = (np.asarray(a, np.float64)
                                     for a in nnx.jit(lambda m, x: m.features(x, None))(m, x))
  g, phi = np.cumsum(loga, axis=1), np.cumsum(theta, axis=1)
  rc, rb = _rotate64(c, phi), _rotate64(b, phi)
  dh = q.shape[-1]
  s = np.einsum("bihd,bjhd->bhij", q[:, idx], k) / math.sqrt(dh)
  dec = np.exp(np.minimum(g[:, idx].transpose(0, 2, 1)[..., None]
                          - g.transpose(0, 2, 1)[:, :, None, :], 0.0))
  s = s + lam[None, :, None, None] * dec * np.einsum("bihs,bjhs->bhij", rc[:, idx], rb)
  s = np.where(idx[:, None] >= np.arange(k.shape[1])[None, :], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhij,bjhd->bihd", p, v)
  return np.einsum("bihd,hde->bie", out, np.asarray(m.proj.o.kernel[...], np.float64))


_REFERENCE_32K = {}


def _float64_reference_all_rows(m, x, rows=512):
  """`_float64_reference` on every row, in slices of `rows` queries (memory), computed once:
  the three paths share the features (the path option changes none of them)."""
  key = int(x.shape[1])
  if key not in _REFERENCE_32K:
    T = x.shape[1]
    _REFERENCE_32K[key] = np.concatenate(
        [_float64_reference(m, x, np.arange(a, min(a + rows, T))) for a in range(0, T, rows)],
        axis=1)
  return _REFERENCE_32K[key]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fast", "chunked", "decode", "fast_parallel_sums"])
def test_phase_precision_32k_against_float64(path, monkeypatch):
  """32K tokens, slow decay (~0.03 nats per 100 tokens) and phase_init_std 0.3 on inputs with a
  mean, so Phi drifts to thousands of radians: every one of the 32,768 output rows is within
  TOL of a float64 reference, the norm being max |error| / max |reference| over the whole
  output (the running phase is wrapped mod 2 pi, so its fp32 angle never grows).
  `fast_parallel_sums`: g and Phi as the GPU / TPU parallel prefixes (no loop over T)."""
  if path == "fast_parallel_sums":
    monkeypatch.setattr(kernel_choice, "FORCE_PARALLEL_TIME_SUMS", True)
    path = "fast"
  T = 32768
  m = _boost(S.SISA(*(lambda c: (c, c.options_for("sisa")))(_cfg(
      d_model=8, n_heads=1, d_state=4, decay_bias_init=-8.0, phase_init_std=0.3,
      path="chunked" if path == "chunked" else "fast")), rngs=nnx.Rngs(params=3)), bc=20.0,
      phase=1.0)
  x = _normal(13, (1, T, 8)) + 1.0
  if path == "decode":   # prefill in chunks, then one-token steps over the last 4 tokens
    cache = S.SISA.init_state(m.cfg, m.opts, 1, T, jnp.float32)
    run = nnx.jit(lambda m, x, p, st: m(x, positions_BT=p, state=st)[:2])
    pos, ys = _positions(1, T), []
    for a, e in [(a, min(a + 4096, T - 4)) for a in range(0, T - 4, 4096)] + [
        (t, t + 1) for t in range(T - 4, T)]:
      y, cache = run(m, x[:, a:e], pos[:, a:e], cache)
      ys.append(y)
    y = jnp.concatenate(ys, axis=1)
  else:
    y, aux = _run(m, x, None)
    assert float(aux["chunked"]) == (path == "chunked")
  phi_end = np.abs(np.sum(np.asarray(nnx.jit(lambda m, x: m.features(x, None))(m, x)[6],
                                     np.float64), axis=1)).max()
  assert phi_end > 1000, phi_end
  _close(y, _float64_reference_all_rows(m, x))


def _angle_error(phi, ref64):
  """max circular distance |phi - ref| mod 2 pi, in radians."""
  d = np.asarray(phi, np.float64) - ref64
  return float(np.max(np.abs(d - 2 * np.pi * np.round(d / (2 * np.pi)))))


def test_parallel_phase_sum_is_the_wrapped_sum_to_float64_at_32k(monkeypatch):
  """Phi's parallel prefix (the GPU / TPU form: the combine adds and wraps, log2 T levels, no
  loop; the angle a double-float) at 32K tokens drifting to ~30,000 radians: within 1e-6 rad
  of the float64 sum mod 2 pi (its last rounding), its values in [0, 2 pi] to that rounding,
  and no worse than the token-by-token scan (CPU form)."""
  T = 32768
  theta = np.asarray(_normal(3, (1, T, 2, 2)) * 0.3 + 0.9, np.float32)
  ref = np.mod(np.cumsum(theta.astype(np.float64), axis=1), 2 * np.pi)
  forms = {}
  for parallel in (True, False):
    monkeypatch.setattr(kernel_choice, "FORCE_PARALLEL_TIME_SUMS", parallel)
    forms[parallel] = np.asarray(jax.jit(lambda t: S.phase_cumsum(t))(jnp.asarray(theta)))
  assert np.abs(np.sum(theta.astype(np.float64), axis=1)).max() > 25000
  err_par, err_seq = _angle_error(forms[True], ref), _angle_error(forms[False], ref)
  assert err_par <= 1e-6 and err_par <= err_seq, (err_par, err_seq)
  assert forms[True].min() >= -1e-6 and forms[True].max() <= 2 * np.pi + 1e-6


def test_parallel_sums_restart_like_the_scan_with_equal_gradients(monkeypatch):
  """Packed rows: g and Phi from the parallel prefixes restart at every document start like
  the scan form (values and d/d(log a, theta) of a readout of cos Phi and g)."""
  T = 37
  starts = np.zeros((2, T), bool)
  starts[0, [5, 6, 20]] = True
  starts[1, [1, 36]] = True
  loga = -jnp.abs(_normal(1, (2, T, 3)))
  theta = _normal(2, (2, T, 3, 2)) * 2.0
  w1, w2 = _normal(3, (2, T, 3)), _normal(4, (2, T, 3, 2))

  def both(parallel):
    monkeypatch.setattr(kernel_choice, "FORCE_PARALLEL_TIME_SUMS", parallel)
    f = lambda la, th: S.decay_and_phase(la, th, jnp.asarray(starts))
    readout = lambda la, th: (lambda g, p: jnp.sum(w1 * g) + jnp.sum(w2 * jnp.cos(p)))(*f(la, th))
    return jax.jit(f)(loga, theta), jax.jit(jax.grad(readout, argnums=(0, 1)))(loga, theta)

  (vals_p, grads_p), (vals_s, grads_s) = both(True), both(False)
  for a, b in zip(vals_p + grads_p, vals_s + grads_s):
    np.testing.assert_allclose(np.cos(a) if a.ndim == 4 else a, np.cos(b) if b.ndim == 4 else b,
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- packed rows

DOCS = (1, 6, 9, 5)   # one of length 1; with chunk_size 4, documents start mid-block


@pytest.mark.parametrize("path,decay_bias,route", [
    ("fast", -1.0, "blocked"),
    ("chunked", 12.0, "blockwise"),      # ~12 nats per token: e^{+100} across a restart
    ("chunked", 12.0, "fused_chunks"),   # the cuDNN route's chunking (masked einsum past)
    ("fast", -1.0, "parallel_sums"),     # g and Phi as the GPU / TPU parallel prefixes
])
def test_packed_rows_match_reference_and_each_document_alone(monkeypatch, path, decay_bias,
                                                             route):
  """Segment ids: every path == the explicit reference (g, Phi restarted per document, pairs
  of other documents masked), each document == itself alone; d out / d x is finite (a masked
  pair's decay exponent across a restart is > 0, ~100 nats on the chunked rows) and exactly
  zero outside the output's document."""
  if route == "fused_chunks":   # what a cuDNN core picks (its past parts then run on CPU)
    monkeypatch.setattr(sisa_xla, "chunked", sisa_xla.fused_chunks)
  if route == "parallel_sums":
    monkeypatch.setattr(kernel_choice, "FORCE_PARALLEL_TIME_SUMS", True)
  m = _mixer(_cfg(path=path, chunk_size=4, decay_bias_init=decay_bias))
  pos, seg, spans = one_row(DOCS)
  T = pos.shape[1]
  x = _normal(5, (1, T, 32))

  def run(x, p, s):
    return m(x, positions_BT=p, segment_ids_BT=s)[0]

  def reference(x):
    q, k, v, c, b, loga, theta, lam = m.features(x, pos)
    g, phi = S.decay_and_phase(loga, theta, S.segment_starts(seg))
    out, _ = S.sisa_attention_reference(q, k, v, c, b, g, phi, lam, segment_ids_BT=seg)
    return m.proj.o(out)

  w = _normal(6, (1, T, 32))

  @jax.jit
  def packed(x, mask):   # outputs, and d sum(mask w y) / dx of ours and of the reference
    loss = lambda f: lambda x: jnp.sum(mask * w * f(x))
    return (run(x, pos, seg), reference(x), jax.grad(loss(lambda x: run(x, pos, seg)))(x),
            jax.grad(loss(reference))(x))

  alone = jax.jit(lambda x, p: run(x, p, None))
  for a, e in spans:
    mask = jnp.zeros((1, T, 1)).at[:, a:e].set(1.0)
    y, y_ref, g, g_ref = packed(x, mask)
    _close(y, y_ref)
    _close(y[:, a:e], alone(x[:, a:e], pos[:, a:e]))
    assert np.all(np.isfinite(g))
    _close(g, g_ref)
    outside = np.ones(T, bool)
    outside[a:e] = False
    assert np.all(np.asarray(g)[:, outside] == 0), (a, e)
