"""kernels/entry.py, kernels/dense.py: `attend` (einsum and XLA paths) against the explicit
`attention_reference`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.kernels.dense import attention_reference
from attn_jax.kernels.entry import attend

TOL = 1e-5  # fp32, fixed once
BF16_TOL = 2e-2
IMPLS = ("einsum", "xla", "blocked")
# (n_heads H, n_kv_heads K, Dqk, Dv): MHA, GQA, MQA, Q/K wider than V (SISA-style state channels)
HEADS = {"mha": (4, 4, 8, 8), "gqa": (4, 2, 8, 8), "mqa": (4, 1, 8, 8), "wide_qk": (4, 2, 12, 8)}


def _normal(seed, shape):
  # numpy, not jax.random: compiling threefry for every new shape costs seconds on CPU.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(seed, B=2, T=6, S=6, H=4, K=4, Dqk=8, Dv=8):
  q_BTHD = _normal(seed, (B, T, H, Dqk))
  k_BSKD = _normal(seed + 1000, (B, S, K, Dqk))
  v_BSKE = _normal(seed + 2000, (B, S, K, Dv))
  return q_BTHD, k_BSKD, v_BSKE


def _close(a, b, msg=""):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL, err_msg=msg)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "impl"))
def _attend_and_reference(q, k, v, *, scale, causal=True, q_positions=None, kv_positions=None,
                          bias=None, impl):
  """(attend, attention_reference) in one compiled program (eager dispatch is slow on CPU)."""
  kw = dict(scale=scale, causal=causal, q_positions=q_positions, kv_positions=kv_positions,
            bias=bias)
  return attend(q, k, v, impl=impl, **kw), attention_reference(q, k, v, **kw)


# Each test runs both implementations inside one jitted program: one compile per test case
# (compiling costs about a second each on CPU; running these shapes costs nothing).


@pytest.mark.parametrize("heads", list(HEADS))
def test_attend_matches_reference(heads):
  """Causal, non-causal, and causal queries after a cached prefix (T < S, no positions)."""
  H, K, Dqk, Dv = HEADS[heads]
  q, k, v = _qkv(0, H=H, K=K, Dqk=Dqk, Dv=Dv)
  q_prefix = q[:, -3:]  # the last 3 positions of 6 keys

  @jax.jit
  def run(q, k, v, q_prefix):
    res = {}
    for impl in IMPLS:
      for name, qq, causal in (("causal", q, True), ("non_causal", q, False),
                               ("prefix", q_prefix, True)):
        kw = dict(scale=Dqk ** -0.5, causal=causal)
        res[impl, name] = (attend(qq, k, v, impl=impl, **kw), attention_reference(qq, k, v, **kw))
    return res

  res = run(q, k, v, q_prefix)
  for (impl, name), (out, ref) in res.items():
    assert out.dtype == jnp.float32 and out.shape == ref.shape, (impl, name)
    _close(out, ref, f"{impl} {name}")
  assert res["einsum", "causal"][0].shape == (2, 6, H, Dv)
  # Causal and non-causal really differ (the mask is not silently dropped or always applied).
  for impl in IMPLS:
    assert float(jnp.max(jnp.abs(res[impl, "causal"][0] - res[impl, "non_causal"][0]))) > 1e-3


@pytest.mark.parametrize("heads", list(HEADS))
def test_attend_positional_mask_with_empty_slots(heads):
  """A cache with empty slots (-1) and out-of-order positions; every query sees slot 0."""
  H, K, Dqk, Dv = HEADS[heads]
  q, k, v = _qkv(2, T=4, S=8, H=H, K=K, Dqk=Dqk, Dv=Dv)
  kv_pos_BS = jnp.array([[0, 1, -1, 2, 3, -1, 4, 5],
                         [0, 3, 1, 2, -1, -1, -1, 4]], jnp.int32)
  q_pos_BT = jnp.array([[2, 3, 4, 5],
                        [1, 2, 3, 4]], jnp.int32)
  empty = (kv_pos_BS < 0)[:, :, None, None]
  k2, v2 = jnp.where(empty, 100.0, k), jnp.where(empty, -100.0, v)

  @jax.jit
  def run(q, k, v, k2, v2, q_pos, kv_pos):
    res = {}
    for impl in IMPLS:
      for causal in (True, False):
        kw = dict(scale=Dqk ** -0.5, causal=causal, q_positions=q_pos, kv_positions=kv_pos)
        res[impl, causal] = (attend(q, k, v, impl=impl, **kw), attention_reference(q, k, v, **kw),
                             attend(q, k2, v2, impl=impl, **kw))
    return res

  for (impl, causal), (out, ref, out_other_empty) in run(q, k, v, k2, v2, q_pos_BT,
                                                         kv_pos_BS).items():
    msg = f"{impl} causal={causal}"
    _close(out, ref, msg)
    _close(out_other_empty, out, msg)  # empty slots are ignored: their k/v change nothing


@pytest.mark.parametrize("heads", ["mha", "gqa", "wide_qk"])
def test_attend_with_bias(heads):
  """A per-head [B, H, T, S] and a shared [1, 1, T, S] score bias, on top of the causal mask."""
  H, K, Dqk, Dv = HEADS[heads]
  q, k, v = _qkv(3, H=H, K=K, Dqk=Dqk, Dv=Dv)
  biases = {"per_head": _normal(4, (2, H, 6, 6)), "shared": _normal(5, (1, 1, 6, 6))}

  @jax.jit
  def run(q, k, v, biases):
    kw = dict(scale=Dqk ** -0.5)
    res = {}
    for impl in IMPLS:
      for name, b in biases.items():
        res[impl, name] = (attend(q, k, v, bias=b, impl=impl, **kw),
                           attention_reference(q, k, v, bias=b, **kw),
                           attend(q, k, v, impl=impl, **kw))
    return res

  for (impl, name), (out, ref, no_bias) in run(q, k, v, biases).items():
    _close(out, ref, f"{impl} {name}")
    assert float(jnp.max(jnp.abs(out - no_bias))) > 1e-3  # the bias is not silently dropped


@pytest.mark.parametrize("heads", ["mha", "gqa", "wide_qk"])
def test_attend_causal_by_gradient(heads):
  """d out_i / d (q_j, k_j, v_j) == 0 for every j > i (and != 0 where it must not vanish).

  Checked on the plain causal path and on the positional-mask path used in decoding.
  """
  H, K, Dqk, Dv = HEADS[heads]
  T = 6
  q, k, v = _qkv(5, T=T, S=T, H=H, K=K, Dqk=Dqk, Dv=Dv)
  pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))

  @jax.jit
  def influence(q, k, v):
    res = {}
    for impl in IMPLS:
      for name, pos in (("plain", None), ("positional", pos_BT)):
        f = functools.partial(attend, scale=Dqk ** -0.5, causal=True, impl=impl,
                              q_positions=pos, kv_positions=pos)
        jacs = jax.jacrev(f, argnums=(0, 1, 2))(q, k, v)
        # jac [B, T, H, Dv, B, S, K|H, D] -> influence of input position s on output position t
        res[impl, name] = [jnp.abs(j).sum(axis=(0, 2, 3, 4, 6, 7)) for j in jacs]
    return res

  future = np.triu(np.ones((T, T), bool), k=1)
  for key, infls in influence(q, k, v).items():
    infl_q, infl_k, infl_v = (np.asarray(a) for a in infls)
    for infl in (infl_q, infl_k, infl_v):
      assert np.all(infl[future] == 0.0), (key, infl)
    assert np.all(infl_v[~future] > 0.0), (key, infl_v)
    # out_0 sees one key, so softmax is constant 1 and d out_0 / d k_0 is 0 by the maths.
    assert np.all(infl_k[1:][~future[1:]] > 0.0), (key, infl_k)
    assert np.all(infl_q[~np.eye(T, dtype=bool)] == 0.0), (key, infl_q)  # out_i reads q_i only


@pytest.mark.parametrize("impl", IMPLS)
def test_attend_jit_equals_no_jit(impl):
  H, K, Dqk, Dv = HEADS["wide_qk"]
  q, k, v = _qkv(6, T=4, S=8, H=H, K=K, Dqk=Dqk, Dv=Dv)
  kv_pos = jnp.array([[0, 1, 2, -1, 3, 4, 5, 6]] * 2, jnp.int32)
  q_pos = jnp.array([[3, 4, 5, 6]] * 2, jnp.int32)
  bias = _normal(7, (2, H, 4, 8))
  f = functools.partial(attend, scale=0.25, causal=True, impl=impl)
  for kw in ({}, dict(q_positions=q_pos, kv_positions=kv_pos, bias=bias)):
    _close(jax.jit(f)(q, k, v, **kw), f(q, k, v, **kw))


def test_einsum_and_xla_paths_agree_in_bf16():
  q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(8, H=4, K=2))
  a, ref = _attend_and_reference(q, k, v, scale=0.3, impl="einsum")
  b, _ = _attend_and_reference(q, k, v, scale=0.3, impl="xla")
  assert a.dtype == b.dtype == jnp.bfloat16
  for out in (a, b):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=BF16_TOL,
                               rtol=BF16_TOL)


def test_attend_rejects_bad_shapes_and_impl():
  q, k, v = _qkv(9, H=4, K=4)
  with pytest.raises(ValueError, match="attention shapes do not fit"):
    attend(q, k[:, :, :3], v[:, :, :3], scale=1.0)  # 4 heads over 3 kv heads
  with pytest.raises(ValueError, match="attention shapes do not fit"):
    attend(q, k[..., :4], v, scale=1.0)  # Q and K head dims differ
  with pytest.raises(ValueError, match="unknown attention impl"):
    attend(q, k, v, scale=1.0, impl="flash")


# ------------------------------------------------------------------ blocked path, sinks, empty rows

def _vjp_all(f, args, cot):
  """(output, gradients of <output, cot> w.r.t. every arg) of f(*args)."""
  out, pull = jax.vjp(f, *args)
  return out, pull(cot)


@pytest.mark.parametrize("heads", ["mha", "gqa", "wide_qk"])
def test_blocked_matches_reference_with_gradients(heads):
  """Chunks of 3 rows over T = 7 (uneven last chunk): plain causal, positional with right
  padding (-1) under prefix_causal, a per-head bias, and a sink — values and gradients."""
  H, K, Dqk, Dv = HEADS[heads]
  T = 7
  q, k, v = _qkv(11, T=T, S=T, H=H, K=K, Dqk=Dqk, Dv=Dv)
  pos = jnp.array([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, -1, -1]], jnp.int32)
  bias = _normal(12, (2, H, T, T))
  sink = _normal(13, (H,))
  cot = _normal(14, (2, T, H, Dv))
  cases = {"plain": {}, "positions": dict(q_positions=pos, kv_positions=pos),
           "bias": dict(bias=bias), "sink": dict(sink_logit_H=sink),
           "all": dict(q_positions=pos, kv_positions=pos, bias=bias, sink_logit_H=sink)}

  @jax.jit
  def run(q, k, v):
    res = {}
    for name, kw in cases.items():
      names = [n for n in ("bias", "sink_logit_H") if n in kw]
      fixed = {n: x for n, x in kw.items() if n not in names}

      def fn(attn, q, k, v, *extra, names=names, fixed=fixed, **opts):
        return attn(q, k, v, scale=Dqk ** -0.5, **fixed, **dict(zip(names, extra)), **opts)
      args = (q, k, v) + tuple(kw[n] for n in names)
      blocked = functools.partial(fn, attend, impl="blocked", chunk=3, prefix_causal=True)
      res[name] = (_vjp_all(blocked, args, cot),
                   _vjp_all(functools.partial(fn, attention_reference), args, cot))
    return res

  for name, ((out, grads), (ref, ref_grads)) in run(q, k, v).items():
    _close(out, ref, f"blocked {name}")
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
      _close(g, rg, f"blocked {name} grad {i}")
    assert float(jnp.max(jnp.abs(grads[-1]))) > 1e-3, name  # every gradient really flows


@pytest.mark.parametrize("heads", ["gqa", "wide_qk"])  # MHA: in the blocked test above
def test_sink_matches_explicit_formula_on_every_impl(heads):
  """sink: extra softmax column with logit sink_h and value 0, dropped (reference formula);
  plain causal and positional masks, gradients w.r.t. q, k, v and the sink; sink = 0 is
  softmax1 and differs from no sink."""
  H, K, Dqk, Dv = HEADS[heads]
  T = 6
  q, k, v = _qkv(21, T=T, S=T, H=H, K=K, Dqk=Dqk, Dv=Dv)
  sink = _normal(22, (H,)) + 1.0
  pos = jnp.array([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, -1, -1]], jnp.int32)
  cot = _normal(23, (2, T, H, Dv))

  @jax.jit
  def run(q, k, v, sink):
    res = {}
    for impl in IMPLS:
      for name, kw in (("plain", {}), ("positions", dict(q_positions=pos, kv_positions=pos))):
        f = functools.partial(attend, scale=Dqk ** -0.5, impl=impl, chunk=4, **kw)
        r = functools.partial(attention_reference, scale=Dqk ** -0.5, **kw)
        res[impl, name] = (
            _vjp_all(lambda *a, f=f: f(*a[:3], sink_logit_H=a[3]), (q, k, v, sink), cot),
            _vjp_all(lambda *a, r=r: r(*a[:3], sink_logit_H=a[3]), (q, k, v, sink), cot),
            f(q, k, v, sink_logit_H=jnp.zeros((H,))), f(q, k, v))
    return res

  for (impl, name), ((out, g), (ref, rg), softmax1, plain) in run(q, k, v, sink).items():
    msg = f"{impl} {name}"
    _close(out, ref, msg)
    for i in range(4):
      _close(g[i], rg[i], f"{msg} grad {i}")
    assert float(jnp.max(jnp.abs(softmax1 - plain))) > 1e-3, msg
    # softmax1 = the explicit formula with sink 0: out * Z / (Z + 1) row-wise, here just > 0
    assert float(jnp.max(jnp.abs(out - plain))) > 1e-3, msg


def test_fully_masked_rows_are_zero_on_every_impl():
  """A query that sees no key (position -1, or all keys empty) returns exactly 0, with or
  without a sink, and its gradient does not poison the others (finite everywhere)."""
  H, K, Dqk, Dv = HEADS["gqa"]
  q, k, v = _qkv(31, T=4, S=6, H=H, K=K, Dqk=Dqk, Dv=Dv)
  q_pos = jnp.array([[-1, 0, 1, 2], [3, 4, 5, -1]], jnp.int32)
  kv_pos = jnp.array([[0, 1, 2, -1, -1, -1], [-1, -1, -1, -1, -1, -1]], jnp.int32)
  sink = _normal(32, (H,))

  @jax.jit
  def run(q, k, v):
    res = {}
    for impl in IMPLS:
      for s in (None, sink):
        kw = dict(scale=0.3, q_positions=q_pos, kv_positions=kv_pos, sink_logit_H=s)
        loss = lambda q, k, v, kw=kw, impl=impl: jnp.sum(attend(q, k, v, impl=impl, **kw) ** 2)
        res[impl, s is None] = (attend(q, k, v, impl=impl, **kw),
                                attention_reference(q, k, v, **kw),
                                jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    return res

  empty = np.array([[True, False, False, False], [True, True, True, True]])
  for (impl, no_sink), (out, ref, grads) in run(q, k, v).items():
    msg = f"{impl} sink={not no_sink}"
    _close(out, ref, msg)
    assert np.all(np.asarray(out)[empty] == 0.0), msg
    assert np.all(np.asarray(jnp.abs(out).sum(axis=(2, 3)))[~empty] > 0), msg
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g))), msg


def test_blocked_causal_by_gradient_with_small_chunks():
  """With chunks of 2 over T = 7 the output at t depends on inputs <= t only, and on all of
  them (the prefix each chunk reads is complete)."""
  T = 7
  q, k, v = _qkv(41, B=1, T=T, S=T, H=2, K=1, Dqk=4, Dv=4)
  f = functools.partial(attend, scale=0.5, impl="blocked", chunk=2)
  jac_v = jax.jit(jax.jacrev(f, argnums=2))(q, k, v)
  infl = np.asarray(jnp.abs(jac_v).sum(axis=(0, 2, 3, 4, 6, 7)))
  future = np.triu(np.ones((T, T), bool), k=1)
  assert np.all(infl[future] == 0.0) and np.all(infl[~future] > 0.0), infl


def test_auto_picks_blocked_on_cpu_and_rejects_unknown():
  from attn_jax.kernel_choice import attention_impl
  assert jax.default_backend() == "cpu"
  assert attention_impl("auto", jnp.float32, 64) == "blocked"
  assert attention_impl("einsum", jnp.float32, 64) == "einsum"
  with pytest.raises(ValueError, match="unknown attention impl"):
    attention_impl("flash", jnp.float32, 64)
  q, k, v = _qkv(9, H=4, K=4)
  with pytest.raises(ValueError, match="sink_logit_H must have shape"):
    attend(q, k, v, scale=1.0, sink_logit_H=jnp.zeros((3,)))


# ---------------------------------------------------------------- packed rows (segment ids)

def _packed(docs, B=2):
  """(positions [B, T], segment ids [B, T]) of rows packing documents of these lengths; row 1
  starts with 2 shared-prefix tokens (segment 0, every document reads them)."""
  pos = np.concatenate([np.arange(n) for n in docs])
  seg = np.concatenate([np.full(n, d + 1) for d, n in enumerate(docs)])
  seg = np.stack([seg, np.where(np.arange(len(seg)) < 2, 0, seg)])[:B]
  pos = np.stack([pos, np.where(np.arange(len(pos)) < 2, np.arange(len(pos)), pos + 2)])[:B]
  return jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window,sink", [(None, False), (3, True)])
def test_segments_match_reference_with_gradients_on_every_impl(impl, window, sink):
  """q/kv segment ids (documents of 1, 4 and 5 tokens; a shared prefix on row 1), with and
  without a window and a sink logit, blocked path with small chunks (`prefix_causal`):
  attend == attention_reference, values and d(q, k, v)."""
  q, k, v = _qkv(3, T=10, S=10, K=2)
  pos, seg = _packed((1, 4, 5))
  sink_H = _normal(9, (4,)) if sink else None
  kw = dict(scale=0.4, causal=True, q_positions=pos, kv_positions=pos, window=window,
            sink_logit_H=sink_H, q_segments=seg, kv_segments=seg)
  w = _normal(10, (2, 10, 4, 8))

  @jax.jit
  def both(q, k, v):
    ours = lambda *a: jnp.sum(w * attend(*a, impl=impl, prefix_causal=True, chunk=3, **kw))
    ref = lambda *a: jnp.sum(w * attention_reference(*a, **kw))
    return (attend(q, k, v, impl=impl, prefix_causal=True, chunk=3, **kw),
            attention_reference(q, k, v, **kw),
            jax.grad(ours, argnums=(0, 1, 2))(q, k, v), jax.grad(ref, argnums=(0, 1, 2))(q, k, v))

  got, want, g_got, g_want = both(q, k, v)
  _close(got, want)
  for a, b in zip(g_got, g_want):
    _close(a, b)
  # the documents really are separated: a key of document 1 moves no output of document 2
  plain = attention_reference(q, k, v, scale=0.4, q_positions=pos, kv_positions=pos,
                              window=window, sink_logit_H=sink_H)
  assert float(jnp.max(jnp.abs(plain - want))) > 1e-3


@pytest.mark.parametrize("G", [1, 2])
def test_sliding_window_through_the_kernels_own_window_equals_the_reference(G):
  """One causal stream with a window: the "xla" path (as "cudnn" on a GPU) takes
  dot_product_attention's local window instead of a [T, S] mask; same outputs and gradients."""
  from attn_jax.kernels.dense import attention_reference
  from attn_jax.kernels.entry import attend
  B, T, K, D, w = 2, 40, 2, 8, 7
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (B, T, K * G, D))
  k, v = (jax.random.normal(kk, (B, T, K, D)) for kk in ks[1:])

  def f(impl):
    return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v, scale=0.3, window=w, impl=impl)))

  def ref(q, k, v):
    return jnp.sum(jnp.sin(attention_reference(q, k, v, scale=0.3, window=w)))

  got, want = jax.value_and_grad(f("xla"), (0, 1, 2))(q, k, v), jax.value_and_grad(ref, (0, 1, 2))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(b))))
  text = jax.jit(lambda q, k, v: attend(q, k, v, scale=0.3, window=w, impl="xla")).lower(
      q, k, v).as_text()
  assert f"tensor<{B}x1x{T}x{T}xi1>" not in text   # no boolean [T, S] mask argument built
