"""The sink logit ("learned") and softmax1 in the sliding_window and sinkhorn mixers.

Each is checked against an explicit formula written here, independent of entry.attend: the
softmax over [scores ; s_h] (s_h the learned per-head logit, or 0 for softmax1) with the extra
column dropped, i.e. a virtual key of value zero. Outputs and gradients (inputs, every parameter,
and d/d s_h) on each attention implementation that runs on CPU; causality by gradient; decoding
through the whole model equals its full forward; option validation names the field.

For Sinkhorn the reference takes the sort plan (which blocks a query block reads, with which
weights) from the mixer's own `core` (sorting is tested in test_sinkhorn.py) and recomputes the
attention from q, k, v and the plan: sorted slots sum_j W_ij K_j, the local block, masks, the
sink column. Gradients flow through the plan too (soft sorting).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import decode
from attn_jax.attention.sinkhorn import (SinkhornAttention, _blocks,
                                         sinkhorn_attention_reference)
from attn_jax.attention.window import SlidingWindowAttention
from attn_jax.model_config import ModelConfig
from tests.test_trunk import _cfg as _trunk_cfg
from tests.test_trunk import _close as _trunk_close
from tests.test_trunk import _decode, _full, _model, _tokens

TOL = 2e-5        # fp32 outputs, relative to the largest |value|; fixed once
GRAD_TOL = 1e-4   # fp32 gradients, relative to the largest |gradient| of each leaf
D, H, KV = 32, 4, 2
IMPLS = ["einsum", "blocked", "xla"]
KINDS = ["learned", "softmax1"]


def _close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  chex.assert_trees_all_close(a, b, atol=tol * max(float(np.max(np.abs(b))), 1e-30), rtol=0.0)


def _cfg(impl):
  return ModelConfig(vocab_size=61, d_model=D, n_heads=H, n_kv_heads=KV, n_layers=1,
                     max_seq_len=64, dtype="float32", attention_impl=impl, init_std=0.3)


def _x(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _positions(B, T, n_valid_last):
  """arange(T) per row; the last row right-padded (-1) after `n_valid_last` tokens."""
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
  pos[-1, n_valid_last:] = -1
  return jnp.asarray(pos)


def _sink_of(mixer, kind):
  return mixer.sink_logit[...] if kind == "learned" else jnp.zeros((H,), jnp.float32)


def softmax_with_sink_column(s, visible, sink_H):
  """p = softmax over [s ; sink_h] with the last column dropped; scores s [B, H, ..., S], masked
  by `visible`. The sink column is always visible, so a query that sees no key gets p = 0."""
  s = jnp.where(visible, s.astype(jnp.float32), -jnp.inf)
  col = jnp.broadcast_to(sink_H.reshape((1, -1) + (1,) * (s.ndim - 2)), s.shape[:-1] + (1,))
  return jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)[..., :-1]


def _set_sink(mixer, kind, seed):
  if kind == "learned":  # away from its zero initialisation, so each head's sink differs
    mixer.sink_logit[...] = _x(seed, (H,))
  else:
    assert mixer.sink_logit is None


def _check_output_and_gradients(mixer, run, ref, x, kind, cot_shape):
  """run/ref: (params, x) -> output. Outputs and all gradients agree; the sink matters."""
  graphdef, params = nnx.split(mixer)
  merge = lambda p: nnx.merge(graphdef, p)
  _close(run(merge(params), x), ref(merge(params), x))
  cot = _x(99, cot_shape)
  loss = lambda f: lambda p, x_: jnp.sum(f(merge(p), x_) * cot)
  g_run = jax.grad(loss(run), argnums=(0, 1))(params, x)
  g_ref = jax.grad(loss(ref), argnums=(0, 1))(params, x)
  chex.assert_trees_all_equal_structs(g_run, g_ref)
  for a, b in zip(jax.tree.leaves(g_run), jax.tree.leaves(g_ref)):
    _close(a, b, GRAD_TOL)
  chex.assert_tree_all_finite(g_run)
  if kind == "learned":   # the sink logit itself is trained
    assert float(jnp.abs(g_run[0]["sink_logit"][...]).min()) > 0


# ---------------------------------------------------------------- sliding window

def _window_ref(m, x, pos, kind):
  """Explicit windowed causal attention with the sink column (GQA by repeating kv heads)."""
  cfg, w = m.cfg, m.opts.window
  q, k, v = m.proj.rotated_qkv(x, pos, cfg.rope_theta)
  g = cfg.n_heads // cfg.kv_heads
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
  qp, kp = pos[:, None, :, None], pos[:, None, None, :]
  visible = (kp >= 0) & (kp <= qp) & (qp - kp < w)
  p = softmax_with_sink_column(s, visible, _sink_of(m, kind))
  return m.proj.o(jnp.einsum("bhts,bshd->bthd", p, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_sliding_window_sink_equals_the_explicit_formula_with_gradients(impl, kind):
  opts = SlidingWindowAttention.Options(window=4, sink_logit=kind)
  m = SlidingWindowAttention(_cfg(impl), opts, rngs=nnx.Rngs(0))
  _set_sink(m, kind, 1)
  B, T = 2, 9
  x = _x(2, (B, T, D))
  for pos in (None, _positions(B, T, 6)):   # plain full forward, and a right-padded row
    ref_pos = pos if pos is not None else _positions(B, T, T)
    run = lambda mm, x_: mm(x_, positions_BT=pos)[0]
    ref = lambda mm, x_: _window_ref(mm, x_, ref_pos, kind)
    _check_output_and_gradients(m, run, ref, x, kind, (B, T, D))
  # the sink changes the output (a query may attend to "nothing")
  plain = SlidingWindowAttention(_cfg(impl), SlidingWindowAttention.Options(window=4),
                                 rngs=nnx.Rngs(0))
  assert not np.allclose(plain(x, positions_BT=None)[0], m(x, positions_BT=None)[0], atol=1e-4)


# ---------------------------------------------------------------- sinkhorn

def _sinkhorn_ref(m, x, pos, kind, rng, train):
  """Block attention of `m` recomputed explicitly from q, k, v and the mixer's sort plan."""
  cfg, o = m.cfg, m.opts
  b = o.block_size
  _, aux = m.core(x, pos, rng, train)         # q, k, v (RoPE'd, padding zeroed) and the plan
  n = aux["n_blocks"]
  B, T = x.shape[:2]
  g = cfg.n_heads // cfg.kv_heads
  W = aux["plan"].source_weights(n)                                 # [B, K, N, m, N]
  kb, vb = _blocks(aux["k"], n, b), _blocks(aux["v"], n, b)         # [B, N, b, K, D]
  pb = _blocks(pos, n, b, fill=-1)                                  # [B, N, b]
  sk = jnp.einsum("bkirn,bnskd->bkirsd", W, kb)                     # sorted slots
  sv = jnp.einsum("bkirn,bnskd->bkirsd", W, vb)
  s_ok = jnp.einsum("bkirn,bns->bkirs", (W != 0).astype(jnp.float32),
                    (pb >= 0).astype(jnp.float32)) > 0
  mb = sk.shape[3] * b
  keys = jnp.concatenate([sk.reshape(B, -1, n, mb, sk.shape[-1]),
                          jnp.moveaxis(kb, 3, 1)], axis=3)          # [B, K, N, mb + b, D]
  vals = jnp.concatenate([sv.reshape(B, -1, n, mb, sv.shape[-1]), jnp.moveaxis(vb, 3, 1)], 3)
  keys, vals = jnp.repeat(keys, g, axis=1), jnp.repeat(vals, g, axis=1)
  qb = jnp.moveaxis(_blocks(aux["q"], n, b), 3, 1)                  # [B, H, N, b, D]
  s = jnp.einsum("bhnqd,bhnsd->bhnqs", qb, keys) * cfg.head_dim ** -0.5
  q_ok = (pb >= 0)[:, None, :, :, None]
  kp, qp = pb[:, None, :, None, :], pb[:, None, :, :, None]
  local_ok = (kp >= 0) & ((kp <= qp) if o.causal else True)
  sorted_ok = jnp.repeat(s_ok.reshape(B, -1, n, mb), g, axis=1)[:, :, :, None, :]
  visible = q_ok & jnp.concatenate([jnp.broadcast_to(sorted_ok, s.shape[:-1] + (mb,)),
                                    jnp.broadcast_to(local_ok, s.shape[:-1] + (b,))], -1)
  p = softmax_with_sink_column(s, visible, _sink_of(m, kind))
  y = jnp.einsum("bhnqs,bhnsd->bnqhd", p, vals).reshape(B, n * b, cfg.n_heads, -1)[:, :T]
  return m.proj.o(y)


SINKHORN_MODES = {   # name: (options, train)
    "soft": (dict(), True),                      # soft sort (Gumbel noise, training)
    "hard": (dict(), False),                     # hard sort at inference
    "sortcut": (dict(n_sortcut=2), True),        # top-2 gathered blocks
    "noncausal": (dict(causal=False), True),
}
# Every impl on the soft sort; the other modes (same block_attend call, other plans and masks)
# on one impl each; softmax1 (the learned path with a constant logit) on two.
SINKHORN_CASES = ([("soft", impl, "learned") for impl in IMPLS]
                  + [("hard", "einsum", "learned"), ("sortcut", "blocked", "learned"),
                     ("noncausal", "xla", "learned"), ("soft", "xla", "softmax1"),
                     ("sortcut", "einsum", "softmax1")])


@pytest.mark.parametrize("mode,impl,kind", SINKHORN_CASES)
def test_sinkhorn_sink_equals_the_explicit_formula_with_gradients(mode, impl, kind):
  extra, train = SINKHORN_MODES[mode]
  opts = SinkhornAttention.Options(block_size=4, sink_logit=kind, **extra)
  m = SinkhornAttention(_cfg(impl), opts, rngs=nnx.Rngs(0))
  _set_sink(m, kind, 3)
  B, T = 2, 11
  x, pos, rng = _x(4, (B, T, D)), _positions(B, T, 8), jax.random.key(5)
  run = lambda mm, x_: mm(x_, positions_BT=pos, rng=rng, train=train)[0]
  ref = lambda mm, x_: _sinkhorn_ref(mm, x_, pos, kind, rng, train)
  _check_output_and_gradients(m, run, ref, x, kind, (B, T, D))
  # padding queries return zeros, and the sink changes the valid ones
  y = run(m, x)
  assert float(jnp.abs(y[1, 8:]).max()) == 0.0
  plain = SinkhornAttention(_cfg(impl), SinkhornAttention.Options(block_size=4, **extra),
                            rngs=nnx.Rngs(0))
  y_plain = plain(x, positions_BT=pos, rng=rng, train=train)[0]
  assert not np.allclose(y_plain[0], y[0], atol=1e-4)


def test_sinkhorn_reference_with_sink_matches_the_numpy_loop_reference():
  """The vectorised reference above against the module's fp64 loop reference (with sink)."""
  opts = SinkhornAttention.Options(block_size=4, sink_logit="learned")
  m = SinkhornAttention(_cfg("einsum"), opts, rngs=nnx.Rngs(0))
  _set_sink(m, "learned", 6)
  x, pos, rng = _x(7, (2, 11, D)), _positions(2, 11, 8), jax.random.key(8)
  y, aux = m.core(x, pos, rng, train=True)
  want = sinkhorn_attention_reference(aux["q"], aux["k"], aux["v"], pos >= 0,
                                      aux["plan"].source_weights(aux["n_blocks"]), block=4,
                                      scale=m.cfg.head_dim ** -0.5, causal=True,
                                      sink_logit_H=m.sink_logit[...])
  _close(y, want)
  _close(_sinkhorn_ref(m, x, pos, "learned", rng, True), m.proj.o(jnp.asarray(want, jnp.float32)))


# ---------------------------------------------------------------- causality, decoding, options

@pytest.mark.parametrize("name", ["sliding_window", "sinkhorn"])
def test_causal_by_gradient_with_a_learned_sink(name):
  if name == "sliding_window":
    m = SlidingWindowAttention(_cfg("blocked"), SlidingWindowAttention.Options(
        window=3, sink_logit="learned"), rngs=nnx.Rngs(0))
  else:
    m = SinkhornAttention(_cfg("blocked"), SinkhornAttention.Options(
        block_size=3, sink_logit="learned", hard_inference=False), rngs=nnx.Rngs(0))
  _set_sink(m, "learned", 9)
  T = 10
  x = _x(10, (1, T, D))
  f = lambda x_: m(x_, positions_BT=None, rng=jax.random.key(1), train=True)[0][0]
  g = jnp.abs(jax.jit(jax.jacrev(f))(x)[:, :, 0]).sum(axis=(1, 3))   # [t out, s in]
  assert float(jnp.triu(g, 1).max()) == 0.0
  assert float(jnp.min(jnp.diag(g))) > 0
  if name == "sliding_window":   # and nothing from outside the window of 3
    assert float(jnp.tril(g, -3).max()) == 0.0


@pytest.mark.parametrize("name", ["sliding_window", "sinkhorn"])
@pytest.mark.parametrize("kind", KINDS)
def test_model_decodes_like_its_full_forward_with_a_sink(name, kind):
  """build_model + step by step (and a prefill chunk of max_chunk) == the full forward."""
  cfg = _trunk_cfg((name,), n_layers=2).with_options(name, sink_logit=kind)
  model = _model(cfg)
  sinks = [v for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
           if "sink_logit" in jax.tree_util.keystr(path)]
  assert len(sinks) == (1 if kind == "learned" else 0)   # one stacked [layers, H] logit
  if sinks:   # _model drew it at random (std 0.3)
    assert float(jnp.abs(sinks[0]).min()) > 0
  B, T = 2, 9
  tok = _tokens(1, (B, T))
  full = _full(model, tok)
  chunk = decode.mixer_limits(cfg, 16)[0]
  for first in (1, chunk):
    _trunk_close(_decode(model, tok, first), full)


@pytest.mark.parametrize("name", ["sliding_window", "sinkhorn"])
def test_sink_logit_is_validated_with_the_field_name_and_takes_no_cache_options(name):
  cfg = ModelConfig(vocab_size=61, d_model=D, n_heads=H, n_layers=1, dtype="float32")
  with pytest.raises(ValueError, match=rf"config\.model\.{name}\.sink_logit: .*not in"):
    cfg.replace(mixer=name).with_options(name, sink_logit="sometimes")
  # the ring / block buffer is the mixer's own state: no streaming-cache options to set
  with pytest.raises(TypeError):
    cfg.replace(mixer=name).with_options(name, cache="window")
  from configs import base
  assert base.get_config().model[name].sink_logit == "none"
