"""Attention sinks: the per-head sink logit and softmax1 in the mixers (against the explicit
formulas, with gradients), option validation, and the decoder's learnable sink-token prefix."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import decode
from attn_jax.attention import sisa
from attn_jax.kernels import dense
from attn_jax.attention.mha import Attention
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig

TOL = 2e-5   # fp32, relative to the largest |value|; fixed once
D, H = 32, 4


def _close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
  assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"


def _cfg(**kw):
  base = dict(vocab_size=61, d_model=D, n_heads=H, d_ff=48, n_layers=1, max_seq_len=64,
              dtype="float32")
  base.update(kw)
  return ModelConfig(**base)


def _x(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("impl", ["einsum", "blocked", "xla"])
@pytest.mark.parametrize("kind", ["learned", "softmax1"])
def test_attention_sink_logit_equals_the_explicit_formula_with_gradients(impl, kind):
  cfg = _cfg(attention_impl=impl, init_std=0.3)
  opts = Attention.Options(sink_logit=kind)
  mixer = Attention(cfg, opts, rngs=nnx.Rngs(0))
  if kind == "learned":
    mixer.sink_logit[...] = _x(1, (H,))
  x = _x(2, (2, 9, D))
  graphdef, params = nnx.split(mixer)

  def ref(params, x):
    m = nnx.merge(graphdef, params)
    q, k, v = m.proj.rotated_qkv(x, dense.causal_positions(2, 9), cfg.rope_theta)
    sink = m.sink_logit[...] if kind == "learned" else jnp.zeros((H,))
    out = dense.attention_reference(q, k, v, scale=cfg.head_dim ** -0.5, sink_logit_H=sink)
    return m.proj.o(out)

  def run(params, x):
    return nnx.merge(graphdef, params)(x, positions_BT=None)[0]

  cot = _x(3, (2, 9, D))
  loss = lambda f: lambda p, x: jnp.sum(f(p, x) * cot)
  _close(run(params, x), ref(params, x))
  g_run = jax.grad(loss(run), argnums=(0, 1))(params, x)
  g_ref = jax.grad(loss(ref), argnums=(0, 1))(params, x)
  for a, b in zip(jax.tree.leaves(g_run), jax.tree.leaves(g_ref)):
    _close(a, b, 1e-4)
  if kind == "learned":   # the sink logit itself gets its gradient
    assert float(jnp.abs(g_run[0]["sink_logit"][...]).max()) > 0
  # and the sink changes the output (a query may attend to "nothing")
  plain = Attention(cfg, Attention.Options(), rngs=nnx.Rngs(0))
  assert not np.allclose(plain(x, positions_BT=None)[0], run(params, x), atol=1e-4)


@pytest.mark.parametrize("path", ["fast", "chunked"])
def test_sisa_sink_logit_equals_the_explicit_formula(path):
  cfg = _cfg(attention_impl="einsum", init_std=0.3)
  opts = sisa.SISA.Options(d_state=4, path=path, chunk_size=4, sink_logit="learned")
  mixer = sisa.SISA(cfg, opts, rngs=nnx.Rngs(0))
  mixer.sink_logit[...] = _x(4, (H,))
  x = _x(5, (2, 10, D))
  out = mixer(x, positions_BT=None)[0]
  q, k, v, c, b, loga, theta, lam = mixer.features(x, None)
  g, phi = sisa.decay_and_phase(loga, theta)
  ref, _ = sisa.sisa_attention_reference(q, k, v, c, b, g, phi, lam,
                                         sink_logit_H=mixer.sink_logit[...])
  _close(out, mixer.proj.o(ref.astype(jnp.float32)))


def test_sink_and_cache_options_are_validated_with_the_field_name():
  cfg = ModelConfig(vocab_size=61, d_model=D, n_heads=H, n_layers=1, dtype="float32")
  for mixer in ("attention", "sisa"):
    with pytest.raises(ValueError, match=rf"config\.model\.{mixer}\.sink_logit: .*not in"):
      cfg.replace(mixer=mixer).with_options(mixer, sink_logit="sometimes")
    with pytest.raises(TypeError):   # the cache policy is a decode-time choice, not an option
      cfg.replace(mixer=mixer).with_options(mixer, cache="window")
  from attn_jax.attention import cache as cache_lib
  for policy, msg in ((cache_lib.Ring(0), "window must be an integer >= 1"),
                      (cache_lib.SinksRing(-1, 4), "sinks must be an integer >= 0")):
    with pytest.raises(ValueError, match=msg):
      cache_lib.init_cache(policy, 1, 8, 1, 2, 2, jnp.float32)
  with pytest.raises(ValueError, match=r"config\.model\.sink_tokens: must be"):
    from attn_jax.model_config import validate_model
    validate_model(cfg.replace(sink_tokens=-1))


# ---------------------------------------------------------------- the sink-token prefix

def _sink_model(mixer="attention", n_sink=1, **opts):
  cfg = _cfg(mixer=mixer, n_layers=2, sink_tokens=n_sink, init_std=0.3)
  if opts:
    cfg = cfg.with_options(mixer, **opts)
  return build_model(cfg, seed=0)


def test_sink_tokens_are_prepended_and_dropped():
  """Logits equal the sink-free computation run on [sink rows ; embeddings] with the sink
  outputs dropped; the sink row reaches every output (gradient) and the prefix is causal."""
  model = _sink_model(n_sink=2)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 7)), jnp.int32)
  logits = model(tok)
  assert logits.shape == (2, 7, 61)
  x = jnp.take(model.embed[...], tok, axis=0)
  x = jnp.concatenate([jnp.broadcast_to(model.sink_embed[...], (2, 2, D)), x], axis=1)
  h, _ = model._layers(x, None, None, None, None, False)
  _close(logits, model.unembed(model.final_norm(h[:, 2:])))
  # the sink embedding influences every position; a later token never influences an earlier one
  g = nnx.grad(lambda m: jnp.sum(m(tok)[:, 0] ** 2))(model)
  assert float(jnp.abs(g["sink_embed"][...]).max()) > 0
  gx = jax.jacrev(lambda x: model._layers(x, None, None, None, None, False)[0][0, 3])(x)
  assert float(jnp.abs(gx[:, 0, 4:]).max()) == 0


@pytest.mark.parametrize("mixer", ["attention", "sisa"])
def test_sink_tokens_decode_step_by_step_and_ragged(mixer):
  extra = {"d_state": 4} if mixer == "sisa" else {}
  model = _sink_model(mixer, **extra)
  rng = np.random.default_rng(1)
  tok = jnp.asarray(rng.integers(0, 61, (2, 9)), jnp.int32)
  full = model(tok)
  step = nnx.jit(lambda m, t, p, s: m.step(t, positions_BT=p, state=s))
  state = model.init_state(2, 9)
  pre, state = step(model, tok[:, :4], jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4)),
                    state)
  outs = [pre]
  for t in range(4, 9):
    lg, state = step(model, tok[:, t:t + 1], jnp.full((2, 1), t, jnp.int32), state)
    outs.append(lg)
  _close(jnp.concatenate(outs, axis=1), full)
  # ragged prompts generate what each prompt generates alone (the sink token once per row)
  prompts = [tok[:1, :6], tok[1:, :3]]
  batch = jnp.concatenate([prompts[0], jnp.pad(prompts[1], ((0, 0), (0, 3)))])
  out = np.asarray(decode.generate(model, batch, lengths=[6, 3], max_new_tokens=4))
  for i, p in enumerate(prompts):
    alone = np.asarray(decode.generate(model, p, max_new_tokens=4))[0]
    np.testing.assert_array_equal(out[i, :len(alone)], alone)
