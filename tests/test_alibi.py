"""attention/alibi.py: the paper's slopes, the explicit formula -m_h (i - j) on every CPU core,
decoding == the full forward, parameter count == the Transformer's."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.attention.alibi import ALiBi, alibi_slopes
from attn_jax.attention.cache import SinksRing
from attn_jax.model import Decoder, count_params
from attn_jax.model_config import ModelConfig
from configs import base

TOL = 1e-5            # fp32, relative to the largest |value|; fixed once


def _cfg(n_heads=4, impl="einsum", n_layers=2, **opts):
  c = base.get_config()
  c.model.update(mixer="alibi", d_model=8 * n_heads, n_heads=n_heads, n_layers=n_layers, d_ff=64,
                 vocab_size=64, dtype="float32", attention_impl=impl)
  for k, v in opts.items():
    c.model.alibi[k] = v
  return ModelConfig.from_config(c.model)


def _close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  chex.assert_trees_all_close(a, b, atol=tol * float(np.max(np.abs(b))), rtol=0.0)


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("H,want", [
    (8, [2.0 ** -i for i in range(1, 9)]),
    (4, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]),
    # not a power of two: the 4 slopes of 4 heads, then slopes 1 and 3 of 8 heads
    (6, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]),
    (12, [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5,
                                             2.0 ** -3.5])])
def test_slopes_are_the_papers(H, want):
  np.testing.assert_allclose(alibi_slopes(H), want, rtol=1e-15)


def _explicit(m, x):
  """softmax(q.k / sqrt(d) - m_h (i - j)) over j <= i, from integer positions."""
  p = m.proj
  q, k, v = p.q(x), p.k(x), p.v(x)
  T, H = x.shape[1], m.cfg.n_heads
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  bias = -alibi_slopes(H)[:, None, None] * (i - j)[None]                        # [H, T, T]
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * m.cfg.head_dim ** -0.5 + bias
  pr = jax.nn.softmax(jnp.where(j <= i, s, -jnp.inf), axis=-1)
  return p.o(jnp.einsum("bhij,bjhd->bihd", pr, v))


@pytest.mark.parametrize("impl", ["einsum", "blocked", "xla"])
@pytest.mark.parametrize("H", [4, 6])
def test_equals_the_explicit_formula(impl, H):
  cfg = _cfg(n_heads=H, impl=impl, block_size=8)
  m = ALiBi(cfg, cfg.options_for("alibi"), rngs=nnx.Rngs(params=0))
  m.proj.q.kernel[...] *= 4.0
  m.proj.k.kernel[...] *= 4.0
  x = _normal(1, (2, 29, 8 * H))
  pos = jnp.broadcast_to(jnp.arange(29, dtype=jnp.int32), (2, 29))
  _close(m(x, positions_BT=pos)[0], _explicit(m, x))


@nnx.jit
def _decode(model, tokens, state, start):
  B, T = tokens.shape
  pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
  return model.step(tokens, positions_BT=pos, state=state)


@pytest.mark.parametrize("impl", ["einsum", "blocked", "xla"])
@pytest.mark.parametrize("policy", [None, SinksRing(2, 14)])
def test_decode_matches_full_forward(impl, policy):
  model = Decoder(_cfg(impl=impl, block_size=4), rngs=nnx.Rngs(params=0))
  B, T = 2, 12
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 64, (B, T)), jnp.int32)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  for chunks in ([1] * T, [5, 4, 1, 1, 1]):
    cache, outs, t = model.init_state(B, 16, policy), [], 0
    for n in chunks:
      logits, cache = _decode(model, tokens[:, t:t + n], cache, jnp.asarray(t, jnp.int32))
      outs.append(logits)
      t += n
    _close(jnp.concatenate(outs, axis=1), full)


@pytest.mark.parametrize("size", ["50m", "152m", "369m"])
def test_configs_have_the_transformers_parameter_count(size):
  import importlib
  t = importlib.import_module(f"configs.transformer_{size}").get_config().model
  a = importlib.import_module(f"configs.alibi_{size}").get_config().model
  assert a.mixer == "alibi"
  assert count_params(a)["total"] == count_params(t)["total"]
