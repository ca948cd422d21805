"""attn_jax/kernels/decayed.py: the decayed flash-attention kernel (Pallas, interpret mode on
CPU) against the float64 explicit references, forward and every gradient.

Errors are relative to the largest |value| of the reference (max|a - b| <= TOL * max|b|), per
output and per gradient. References run in float64 on the kernel's own (fp32) inputs, except
FoX's, which sums its g in float64 from log f (the kernel gets fp32's double-word cumulative
sum): the FoX test therefore also checks that a pair's decay keeps its own precision at -20
nats per token. Tiles of 64 (or 32) rows over T = 200 (not a multiple), so every test crosses
several tiles, skips tiles above the diagonal and visits partial ones.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import kernel_choice, targets
from attn_jax import sharding as shd
from attn_jax.attention import score_bias as SB
from attn_jax.attention import sisa as S
from attn_jax.attention.alibi import alibi_slopes
from attn_jax.kernels import decayed as K
from attn_jax.kernels import forget_xla as FX
from attn_jax.kernels.dense import attention_reference

TOL = 1e-5            # fp32, relative to the largest |value|; fixed once
TOL_BF16 = 2e-2       # bf16 inputs: q, k, v and the probabilities p rounded to 8 bits


def _close(a, b, tol=TOL, what=""):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), what
  err = float(np.max(np.abs(a - b)))
  assert err <= tol * float(np.max(np.abs(b))), f"{what}: {err} vs {tol} * {np.max(np.abs(b))}"


def _normal(rng, shape, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _segments(lengths_per_row):
  """[B, T] document ids 1, 2, ... of rows packed with documents of the given lengths."""
  return jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths_per_row]),
                     jnp.int32)


def _starts(seg_BT):
  s = np.asarray(seg_BT)
  return np.concatenate([np.ones((s.shape[0], 1), bool), s[:, 1:] != s[:, :-1]], axis=1)


def _seg_cumsum(x_BTH, starts_BT):
  """Cumulative sum over time restarting at every document start (numpy, x's dtype)."""
  x = np.asarray(x_BTH)
  out = np.zeros_like(x)
  acc = np.zeros_like(x[:, 0])
  for t in range(x.shape[1]):
    acc = np.where(starts_BT[:, t, None], 0, acc) + x[:, t]
    out[:, t] = acc
  return out


def _check(kernel_fn, ref_fn, args32, names, seed=0, tol=TOL):
  """Forward and the gradient of sum(out * w) for each argument, kernel (fp32) vs reference
  (float64 on the same values)."""
  shape = jax.eval_shape(kernel_fn, *args32).shape
  w = np.random.default_rng(seed + 100).standard_normal(shape)
  argnums = tuple(range(len(args32)))

  def loss(fn, w):
    def f(*a):
      out = fn(*a)
      return jnp.sum(out * w), out
    return jax.jit(jax.grad(f, argnums, has_aux=True))

  grads, out = loss(kernel_fn, jnp.asarray(w, jnp.float32))(*args32)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args32]
    ref_grads, ref = loss(ref_fn, jnp.asarray(w))(*args64)
    ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
  _close(out, ref, tol, "forward")
  for name, g, r in zip(names, grads, ref_grads):
    _close(g, r, tol, f"d {name}")


# ---------------------------------------------------------------- SISA

def test_sisa_matches_float64_reference():
  """Packed unaligned documents (g restarts in each), a sink, decay ranges from ~2 nats (head
  0) to thousands (head 1, log a down to -40 per token), lambda from c's scale."""
  rng = np.random.default_rng(0)
  B, T, H, D, ds = 2, 200, 2, 16, 8
  seg = _segments([[37, 90, 73], [200]])
  rate = np.array([0.02, 40.0])
  loga = -rng.uniform(0, 1, (B, T, H)) * rate
  g = jnp.asarray(_seg_cumsum(loga, _starts(seg)), jnp.float32)
  args = (_normal(rng, (B, T, H, D), 2.0), _normal(rng, (B, T, H, D), 2.0),
          _normal(rng, (B, T, H, D)), _normal(rng, (B, T, H, ds)), _normal(rng, (B, T, H, ds)),
          g, jnp.asarray([0.7, 1.3], jnp.float32), _normal(rng, (H,)))

  def kernel(q, k, v, c, b, g, lam, sink):
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, c_BTHS=lam[:, None] * c,
                               b_BTHS=b, segment_ids_BT=seg, sink_logit_H=sink, block_q=64,
                               block_k=64)

  def ref(q, k, v, c, b, g, lam, sink):
    return S.sisa_attention_reference(q, k, v, c, b, g, None, lam, sink_logit_H=sink,
                                      segment_ids_BT=seg)[0]

  assert -float(jnp.min(g)) > 1000
  _check(kernel, ref, args, ("q", "k", "v", "c", "b", "g", "lambda", "sink"))


# ---------------------------------------------------------------- FoX

def test_fox_matches_float64_reference_under_strong_forgetting():
  """GQA (4 query heads on 2 kv heads), packed documents, a sink, log f from ~0 to -20 nats per
  token. The kernel's g is fp32's double-word cumulative sum of log f (forget_xla.cumsum2); the
  reference sums log f in float64. Gradients reach log f through each."""
  rng = np.random.default_rng(1)
  B, T, H, KH, D = 2, 200, 4, 2, 16
  seg = _segments([[120, 80], [5, 150, 45]])
  starts = jnp.asarray(_starts(seg))
  rate = np.array([0.01, 1.0, 8.0, 20.0])
  args = (_normal(rng, (B, T, H, D), 2.0), _normal(rng, (B, T, KH, D), 2.0),
          _normal(rng, (B, T, KH, D)),
          jnp.asarray(-rng.uniform(0, 1, (B, T, H)) * rate, jnp.float32), _normal(rng, (H,)))

  def kernel(q, k, v, loga, sink):
    hi, lo = FX.cumsum2(loga, starts)
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=hi, g_lo_BTH=lo, fox=True,
                               segment_ids_BT=seg, sink_logit_H=sink, block_q=64, block_k=32)

  def ref(q, k, v, loga, sink):
    g = _seg_cumsum_jnp(loga, starts)
    return SB.forget_attention_reference(q, k, v, g, scale=D ** -0.5, sink_logit_H=sink,
                                        segment_ids_BT=seg)[0]

  _check(kernel, ref, args, ("q", "k", "v", "log f", "sink"), seed=1)


def _seg_cumsum_jnp(x_BTH, starts_BT):
  """Differentiable segmented cumulative sum (the reference's, in x's dtype)."""
  def step(acc, xs):
    x, s = xs
    acc = jnp.where(s[:, None], 0.0, acc) + x
    return acc, acc
  _, out = jax.lax.scan(step, jnp.zeros_like(x_BTH[:, 0]),
                        (x_BTH.transpose(1, 0, 2), starts_BT.T))
  return out.transpose(1, 0, 2)


# ---------------------------------------------------------------- ALiBi

def test_alibi_with_window_and_padding_matches_float64_reference():
  """ALiBi as FoX with g = -slope * t, a sliding window of 50 tokens, right-padded rows
  (positions -1, whose queries see nothing and return zeros), a sink, against the positional
  reference with the explicit bias -m_h (i - j)."""
  rng = np.random.default_rng(2)
  B, T, H, D, W = 2, 200, 4, 16, 50
  valid = np.arange(T)[None, :] < np.array([[200], [157]])
  pos = jnp.asarray(np.where(valid, np.arange(T)[None, :], -1), jnp.int32)
  slopes = jnp.asarray(alibi_slopes(H), jnp.float32)
  g = -jnp.asarray(np.maximum(np.asarray(pos), 0), jnp.float32)[..., None] * slopes
  args = (_normal(rng, (B, T, H, D), 2.0), _normal(rng, (B, T, H, D), 2.0),
          _normal(rng, (B, T, H, D)), _normal(rng, (H,)))

  def kernel(q, k, v, sink):
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, fox=True, window=W,
                               positions_BT=pos, sink_logit_H=sink, block_q=32, block_k=32)

  def ref(q, k, v, sink):
    gg = jnp.asarray(np.asarray(g), q.dtype).transpose(0, 2, 1)
    bias = gg[..., :, None] - gg[..., None, :]
    return attention_reference(q, k, v, scale=D ** -0.5, q_positions=pos, kv_positions=pos,
                               bias=bias, sink_logit_H=sink, window=W)

  _check(kernel, ref, args, ("q", "k", "v", "sink"), seed=2)
  out = kernel(*args)
  assert float(jnp.max(jnp.abs(out[1, 157:]))) == 0.0   # padding queries: zeros


# ---------------------------------------------------------------- both terms, every mask

def test_every_term_and_mask_matches_float64_reference():
  """The FoX and SISA terms together, GQA, a window, padding, a shared prefix (segment 0,
  visible to every document) and two documents, no sink; g decreasing over the whole row.
  Reference: the positional attention reference with the explicit float64 bias."""
  rng = np.random.default_rng(3)
  B, T, H, KH, D, ds, W = 1, 200, 4, 2, 16, 4, 90
  seg = jnp.asarray(np.concatenate([np.zeros(8), np.ones(100), 2 * np.ones(92)])[None],
                    jnp.int32)
  pos = jnp.asarray(np.where(np.arange(T) < 190, np.arange(T), -1)[None], jnp.int32)
  args = (_normal(rng, (B, T, H, D), 2.0), _normal(rng, (B, T, KH, D), 2.0),
          _normal(rng, (B, T, KH, D)), _normal(rng, (B, T, H, ds)),
          _normal(rng, (B, T, H, ds)),
          jnp.asarray(np.cumsum(-rng.uniform(0, 0.3, (B, T, H)), axis=1), jnp.float32))

  def kernel(q, k, v, c, b, g):
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, c_BTHS=c, b_BTHS=b,
                               fox=True, window=W, positions_BT=pos, segment_ids_BT=seg,
                               block_q=32, block_k=64)

  def ref(q, k, v, c, b, g):
    gH = g.transpose(0, 2, 1)
    dg = gH[..., :, None] - gH[..., None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))
    bias = dg + jnp.exp(jnp.where(causal, dg, -jnp.inf)) * jnp.einsum("bihs,bjhs->bhij", c, b)
    return attention_reference(q, k, v, scale=D ** -0.5, q_positions=pos, kv_positions=pos,
                               bias=bias, window=W, q_segments=seg, kv_segments=seg)

  _check(kernel, ref, args, ("q", "k", "v", "c", "b", "g"), seed=3)


def test_plain_attention_bf16():
  """No decay (the plain core), bf16 q, k, v: within bf16 rounding of the float64 reference
  on the same (rounded) inputs; the output keeps q's dtype."""
  rng = np.random.default_rng(4)
  B, T, H, D = 1, 200, 2, 32
  q, k, v = (_normal(rng, (B, T, H, D), 2.0).astype(jnp.bfloat16) for _ in range(3))
  out = K.decayed_attention(q, k, v, scale=D ** -0.5, block_q=64, block_k=64)
  assert out.dtype == jnp.bfloat16
  with jax.enable_x64(True):
    f64 = lambda a: jnp.asarray(np.asarray(a.astype(jnp.float32)), jnp.float64)
    ref = np.asarray(attention_reference(f64(q), f64(k), f64(v), scale=D ** -0.5))
  _close(out.astype(jnp.float32), ref, TOL_BF16, "bf16 forward")


# ---------------------------------------------------------------- inputs it cannot take

def test_unsupported_names_why():
  ok = K.unsupported((1, 256, 4, 128), (1, 256, 4, 128), (1, 256, 4, 128), plat="tpu")
  assert ok is None
  assert "T == S" in K.unsupported((1, 8, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64), plat="tpu")
  assert "block_k" in K.unsupported((1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64),
                                    block_k=96, plat="tpu")
  assert "head dim is 48" in K.unsupported((1, 256, 4, 48), (1, 256, 4, 48), (1, 256, 4, 48),
                                           plat="gpu")
  assert K.unsupported((1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64), plat="gpu") is None


# ---------------------------------------------------------------- compiled for the targets

def _compiled_text(target: str, T: int = 256, D: int = 128, ds: int = 32, sisa: bool = True):
  """The SISA + FoX kernel's (FoX's alone: sisa False) fwd + bwd (bf16 q, k, v) compiled for a
  target's first device."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = targets.devices(target)
  B, H = 1, 2
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sds((B, T, H, D), bf), sds((B, T, H, D), bf), sds((B, T, H, D), bf),
          sds((B, T, H), f32), sds((B, T, H, ds), f32), sds((B, T, H, ds), f32), sds((H,), f32))

  def loss(q, k, v, g, c, b, sink):
    o = K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, c_BTHS=c if sisa else None,
                            b_BTHS=b if sisa else None, fox=True, sink_logit_H=sink)
    return jnp.sum(o.astype(f32) ** 2)

  mesh = Mesh(np.array(devs[:1]), ("x",))
  # Under the target's mesh (`use_rules`: its platform for the kernel choice, and `jax.set_mesh`,
  # where JAX >= 0.11's Pallas GPU lowering finds the GPU it compiles for).
  with shd.use_rules(mesh, {}), targets.no_persistent_cache():
    f = jax.jit(jax.grad(loss, argnums=tuple(range(7))), in_shardings=NamedSharding(mesh, P()))
    compiled = f.lower(*args).compile()
  return compiled.as_text(), compiled.memory_analysis()


TARGET_CALLS = [("v5e-4", "tpu_custom_call"), ("h100x1", "triton")]


@pytest.mark.parametrize("target,call", TARGET_CALLS)
def test_kernel_compiles_for_target(target, call):
  """Forward and both backward kernels are custom calls of the target's Pallas backend (Mosaic
  on TPU, Triton on H100), at T 256."""
  if not targets.available(target):
    pytest.skip(f"no compiler plugin for {target}")
  text, _ = _compiled_text(target)
  assert text.count(call) >= 3, text[:2000]


def test_fox_full_form_compiles_for_tpu():
  """FoX alone on TPU: the grid driver's branch between the full form (per-key bias) and the
  partial form compiles with Mosaic (fwd and both backward kernels), at T 512."""
  if not targets.available("v5e-4"):
    pytest.skip("no compiler plugin for v5e-4")
  text, _ = _compiled_text("v5e-4", T=512, sisa=False)
  assert text.count("tpu_custom_call") >= 3, text[:2000]


@pytest.mark.parametrize("head_dim", sorted(K.GPU_TUNING))
def test_every_gpu_tuning_compiles_for_h100(head_dim):
  """Each head dim's Triton choice (`GPU_TUNING`: its tiles, warps, stages) compiles, forward
  and both backward kernels, for an H100 (shared memory: a tile too large fails here)."""
  if not targets.available("h100x1"):
    pytest.skip("no compiler plugin for h100x1")
  text, _ = _compiled_text("h100x1", D=head_dim)
  assert text.count("triton") >= 3, text[:2000]


@pytest.mark.slow
@pytest.mark.parametrize("target,call", TARGET_CALLS)
def test_kernel_memory_is_linear_in_T(target, call):
  """No [T, T] buffer: at T 8192 the compiled program's temporaries stay far below one fp32
  [T, T] score matrix (256 MiB)."""
  if not targets.available(target):
    pytest.skip(f"no compiler plugin for {target}")
  T = 8192
  text, mem = _compiled_text(target, T=T)
  assert text.count(call) >= 3
  assert mem.temp_size_in_bytes < T * T * 4 / 8, mem


# ---------------------------------------------------------------- the mixers' kernel branch

def _param_grads(m, x, seg, w):
  """(output, d sum(out * w) / d every parameter) of a mixer's full forward."""
  from flax import nnx
  graphdef, state = nnx.split(m)

  def loss(state):
    out = nnx.merge(graphdef, state)(x, segment_ids_BT=seg)[0]
    return jnp.sum(out * w), out

  grads, out = jax.grad(loss, has_aux=True)(state)
  return out, grads


def _same_as_blockwise(m, x, seg):
  """The mixer's forward and parameter gradients through the kernel (`decayed.on_cpu`) equal
  its CPU blockwise paths' (each within TOL of the other's largest |value|)."""
  w = jnp.asarray(np.random.default_rng(7).standard_normal(x.shape), jnp.float32)
  program = lambda: str(jax.make_jaxpr(lambda x: m(x, segment_ids_BT=seg)[0])(x))
  assert "pallas_call" not in program()
  with kernel_choice.kernels_on_cpu():
    assert "pallas_call" in program()
  out_b, grads_b = _param_grads(m, x, seg, w)
  with kernel_choice.kernels_on_cpu():
    out_k, grads_k = _param_grads(m, x, seg, w)
  _close(out_k, out_b, what="output")
  flat_k = jax.tree_util.tree_leaves_with_path(grads_k)
  flat_b = dict(jax.tree_util.tree_leaves_with_path(grads_b))
  for path, g in flat_k:
    _close(g, flat_b[path], what=f"d {jax.tree_util.keystr(path)}")
  return flat_k


def test_sisa_mixer_takes_the_kernel():
  """SISA (boosted B, C, phase; a learned sink; packed rows) through the kernel equals its
  blockwise paths, parameters' gradients included (lambda and the sink logit among them)."""
  from tests.test_sisa import _cfg, _mixer
  cfg = _cfg(n_heads=2, sink_logit="learned")
  m = _mixer(cfg)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 150, cfg.d_model)), jnp.float32)
  seg = _segments([[40, 110], [150]])
  names = [jax.tree_util.keystr(p) for p, _ in _same_as_blockwise(m, x, seg)]
  assert any("lambda_raw" in n for n in names) and any("sink_logit" in n for n in names)


def test_a_bf16_sisa_gives_the_kernel_its_factors_in_bf16():
  """In a bf16 model the kernel's c and b (lambda R C, R B) come in q's dtype, as the widened
  Q/K of the method: fp32 factors would make every tile's c.b products fp32 matmuls at full
  precision (what made SISA's H200 step 0.27x the Transformer's); g stays fp32."""
  from tests.test_sisa import _cfg, _mixer
  m = _mixer(_cfg(n_heads=2, dtype="bfloat16"))
  x = jnp.ones((1, 64, m.cfg.d_model), jnp.bfloat16)
  with kernel_choice.kernels_on_cpu():
    jaxpr = jax.make_jaxpr(lambda x: m(x)[0])(x)
  (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
  floats = [(v.aval.dtype, v.aval.ndim) for v in call.invars
            if jnp.issubdtype(v.aval.dtype, jnp.floating)]
  assert [d for d, n in floats if n == 4] == [jnp.bfloat16] * 5, floats   # q, k, v, c, b
  assert [d for d, n in floats if n == 3] == [jnp.float32], floats        # g


@pytest.mark.parametrize("mixer", ["fox", pytest.param("alibi", marks=pytest.mark.slow)])
def test_fox_and_alibi_mixers_take_the_kernel(mixer):
  """FoX (strong forgetting, GQA) and ALiBi (a learned sink), packed rows: through the kernel
  equal to their blockwise paths (ALiBi slow: the same branch of `ScoreBiasAttention`)."""
  from tests.test_fox import _cfg, _mixer
  from attn_jax.attention.alibi import ALiBi
  from flax import nnx
  if mixer == "fox":
    cfg = _cfg(impl="auto", n_heads=4, n_kv_heads=2)
    m = _mixer(cfg)
  else:
    cfg = _cfg(mixer="alibi", impl="auto", sink_logit="learned")
    m = ALiBi(cfg, cfg.options_for("alibi"), rngs=nnx.Rngs(params=0))
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 150, cfg.d_model)), jnp.float32)
  _same_as_blockwise(m, x, _segments([[40, 110], [7, 143]]))


def test_cpu_keeps_blockwise_and_misfits_are_logged(caplog):
  """On CPU (no `on_cpu`) the mixers keep their blockwise paths; a shape the kernel cannot take
  on the target is one logged line naming why."""
  from attn_jax import kernel_choice
  with kernel_choice.use_platform("cpu"):   # also where the suite runs on a GPU (device_check.sh)
    assert not K.use_kernel("auto", (1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64), what="x")
  with kernel_choice.use_platform("gpu"):
    assert K.use_kernel("auto", (1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64), what="x")
    assert not K.use_kernel("einsum", (1, 256, 4, 64), (1, 256, 4, 64), (1, 256, 4, 64),
                            what="x")
    with caplog.at_level("WARNING"):
      for _ in range(2):
        assert not K.use_kernel("auto", (1, 256, 4, 40), (1, 256, 4, 40), (1, 256, 4, 40),
                                what="sisa-test")
  lines = [r.getMessage() for r in caplog.records if "sisa-test" in r.getMessage()]
  assert len(lines) == 1 and "head dim is 40" in lines[0], lines


# ---------------------------------------------------------------- long sequences (slow)

@pytest.mark.slow
@pytest.mark.parametrize("T", [4096, 8192])
def test_sisa_and_fox_long_sequences_match_float64_reference(T):
  """T 4096 / 8192 in tiles of 128, SISA (decay range ~10^4 nats on one head) and FoX (log f to
  -20 nats per token, double-word g), one packed row with a sink: the forward on every row and
  the gradients of q, k, v, c, b, g (SISA) / q, k, v, log f (FoX) within TOL of float64, the
  reference evaluated in slices of query rows."""
  rng = np.random.default_rng(8)
  B, H, D, ds = 1, 2, 32, 8
  seg = _segments([[T // 3, T - T // 3]])
  starts = jnp.asarray(_starts(seg))
  q, k, v = (_normal(rng, (B, T, H, D), 2.0) for _ in range(3))
  c, b = (_normal(rng, (B, T, H, ds)) for _ in range(2))
  loga = jnp.asarray(-rng.uniform(0, 1, (B, T, H)) * np.array([0.01, 20.0]), jnp.float32)
  sink = _normal(rng, (H,))
  w = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
  g = jnp.asarray(_seg_cumsum(np.asarray(loga), _starts(seg)), jnp.float32)

  def sisa(q, k, v, c, b, g):
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, c_BTHS=c, b_BTHS=b,
                               segment_ids_BT=seg, sink_logit_H=sink, block_q=128, block_k=128)

  def fox(q, k, v, loga):
    hi, lo = FX.cumsum2(loga, starts)
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=hi, g_lo_BTH=lo, fox=True,
                               segment_ids_BT=seg, sink_logit_H=sink, block_q=128, block_k=128)

  def sisa_ref(q, k, v, c, b, g, idx):
    return S.sisa_attention_reference(q, k, v, c, b, g, None, jnp.ones((H,), q.dtype),
                                      query_idx=idx, sink_logit_H=sink.astype(q.dtype),
                                      segment_ids_BT=seg)[0]

  def fox_ref(q, k, v, loga, idx):
    return SB.forget_attention_reference(q, k, v, _seg_cumsum_jnp(loga, starts), scale=D ** -0.5,
                                        sink_logit_H=sink.astype(q.dtype), query_idx=idx,
                                        segment_ids_BT=seg)[0]

  for kernel, ref, args in ((sisa, sisa_ref, (q, k, v, c, b, g)), (fox, fox_ref, (q, k, v, loga))):
    n = len(args)
    out, vjp = jax.vjp(kernel, *args)
    grads = vjp(w)
    with jax.enable_x64(True):
      a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
      w64 = jnp.asarray(np.asarray(w), jnp.float64)
      ref_out, ref_grads = [], [0.0] * n
      for a in range(0, T, 1024):
        idx = jnp.arange(a, min(a + 1024, T))
        o, f = jax.vjp(lambda *xs: ref(*xs, idx), *a64)
        ref_out.append(np.asarray(o))
        ref_grads = [r + np.asarray(d) for r, d in zip(ref_grads, f(w64[:, idx]))]
    _close(out, np.concatenate(ref_out, axis=1), what=f"{kernel.__name__} forward")
    for i in range(n):
      _close(grads[i], ref_grads[i], what=f"{kernel.__name__} grad {i}")


def test_sharded_over_batch_and_heads_equals_one_device():
  """Under `sharding.use_rules` on 8 simulated devices (data 2 x tensor 4 x fsdp 1) the kernel
  runs in a shard_map (rows over data, heads over tensor) and equals the unsharded call,
  forward and gradients."""
  from attn_jax import sharding
  if jax.device_count() < 8:   # the suite's CPU has 8 simulated devices; one GPU has 1
    pytest.skip(f"needs 8 devices, have {jax.device_count()}")
  rng = np.random.default_rng(9)
  B, T, H, D, ds = 2, 100, 4, 16, 4
  seg = _segments([[30, 70], [100]])
  args = (_normal(rng, (B, T, H, D)), _normal(rng, (B, T, H, D)), _normal(rng, (B, T, H, D)),
          _normal(rng, (B, T, H, ds)), _normal(rng, (B, T, H, ds)),
          jnp.asarray(np.cumsum(-rng.uniform(0, 2, (B, T, H)), axis=1), jnp.float32),
          _normal(rng, (H,)))

  def loss(q, k, v, c, b, g, sink):
    o = K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, c_BTHS=c, b_BTHS=b, fox=True,
                            segment_ids_BT=seg, sink_logit_H=sink, block_q=32, block_k=32)
    return jnp.sum(o * jnp.arange(D, dtype=o.dtype)), o

  f = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))
  (_, out), grads = f(*args)
  mesh = sharding.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"))
  with sharding.use_rules(mesh, sharding.TRUNK_RULES), kernel_choice.kernels_on_cpu():
    assert "shard_map" in str(jax.make_jaxpr(f)(*args))
    (_, out_s), grads_s = f(*args)
  _close(out_s, out, what="sharded forward")
  for i, (a, b) in enumerate(zip(grads_s, grads)):
    _close(a, b, what=f"sharded grad {i}")


# ---------------------------------------------------------------- prefill through the kernel

def _prefill(model, tokens, lengths, capacity):
  from attn_jax import decode
  return decode.prefill(model, tokens, lengths, capacity=capacity)


@pytest.mark.parametrize("pattern", [("sisa",), ("fox", "alibi:nomlp")])
def test_prefill_takes_the_kernel_and_leaves_the_same_state(pattern):
  """A prompt's first call into empty dense caches (`KVCache.fresh`) computes its outputs with
  the full forward's kernel: no [T, T] scores. Ragged prompts (one padded row) give the cached
  path's last-token logits and the same state, and the next decode step agrees."""
  from attn_jax import decode
  from tests.test_trunk import _cfg, _model, _tokens
  model = _model(_cfg(pattern, n_layers=len(pattern)), seed=3)
  tokens, lengths = _tokens(4, (2, 40)), jnp.asarray([40, 23], jnp.int32)
  jaxpr = lambda: str(jax.make_jaxpr(lambda t, n: _prefill(model, t, n, 48))(tokens, lengths))
  assert "pallas_call" not in jaxpr()
  with kernel_choice.kernels_on_cpu():
    assert "pallas_call" in jaxpr()
    last_k, state_k = _prefill(model, tokens, lengths, 48)
  last_c, state_c = _prefill(model, tokens, lengths, 48)
  _close(last_k, last_c, what="last-token logits")
  flat_c = dict(jax.tree_util.tree_leaves_with_path(state_c))
  for path, leaf in jax.tree_util.tree_leaves_with_path(state_k):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      _close(leaf, flat_c[path], what=f"state {jax.tree_util.keystr(path)}")
    else:
      np.testing.assert_array_equal(leaf, flat_c[path])
  step = lambda s: decode.decode_step(model, tokens[:, 5], lengths, s)[0]
  _close(step(state_k), step(state_c), what="next step's logits")


# ---------------------------------------------------------------- the TPU grid driver

@pytest.mark.parametrize("terms", ["sisa", "fox+window"])
def test_grid_driver_equals_loop_driver(terms):
  """The TPU driver (the other side's tiles on grid axis 3, the carry in VMEM scratch, tiles
  outside the visible range clamped and skipped) gives the loop driver's output and every
  gradient (the loop driver is checked against float64 above): GQA, two packed documents, a
  sink, T not a multiple of the tile. Run here in the Pallas interpreter."""
  rng = np.random.default_rng(11)
  B, T, H, Kh, D, ds = 1, 300, 4, 2, 16, 8
  q, w = _normal(rng, (B, T, H, D)), _normal(rng, (B, T, H, D))
  k, v = _normal(rng, (B, T, Kh, D)), _normal(rng, (B, T, Kh, D))
  c, b = _normal(rng, (B, T, H, ds)), _normal(rng, (B, T, H, ds))
  g = jnp.cumsum(-jnp.abs(_normal(rng, (B, T, H))) * 0.3, axis=1)
  seg = _segments([[120, 180]])
  sink = _normal(rng, (H,))
  kw = (dict(c_BTHS=c, b_BTHS=b) if terms == "sisa" else dict(fox=True, window=50))

  def loss(grid, q, k, v, g):
    out = K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, segment_ids_BT=seg,
                              sink_logit_H=sink, block_q=128, block_k=128, tile_grid=grid, **kw)
    return jnp.sum(out * w)

  grid_jaxpr = str(jax.make_jaxpr(functools.partial(loss, True))(q, k, v, g))
  assert "grid=(1, 4, 3, 3)" in grid_jaxpr
  ref = jax.value_and_grad(functools.partial(loss, False), argnums=(0, 1, 2, 3))(q, k, v, g)
  got = jax.value_and_grad(functools.partial(loss, True), argnums=(0, 1, 2, 3))(q, k, v, g)
  for name, a, r in zip(("loss", "dq", "dk", "dv", "dg"), jax.tree.leaves(got),
                        jax.tree.leaves(ref)):
    _close(a, r, what=name)


# ---------------------------------------------------------------- tile classes (interpret mode)

def _decayed_reference(q, k, v, c, b, g, *, scale, fox, sisa, pos, seg, window):
  """Explicit float64 decayed attention (the kernel's definition, module docstring): logit
  scale q.k + [fox] (g_i - g_j) + [sisa] exp(g_i - g_j) c.b on visible pairs, the SISA factor 0
  on a visible pair with g_i > g_j (a shared-prefix key read across a document start); a row
  that sees nothing returns zeros."""
  B, T, H, D = q.shape
  G = H // k.shape[2]
  k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  pi, pj = pos[:, None, :, None], pos[:, None, None, :]
  si, sj = seg[:, None, :, None], seg[:, None, None, :]
  vis = (pj >= 0) & ((sj == si) | (sj == 0)) & (pj <= pi)
  if window is not None:
    vis = vis & (pi - pj < window)
  gH = g.transpose(0, 2, 1)
  dg = gH[..., :, None] - gH[..., None, :]
  if fox:
    s = s + dg
  if sisa:
    e = jnp.exp(jnp.where(vis & (dg <= 0), dg, -jnp.inf))
    s = s + e * jnp.einsum("bihs,bjhs->bhij", c, b)
  s = jnp.where(vis, s, -jnp.inf)
  seen = jnp.any(vis, axis=-1, keepdims=True)
  p = jnp.where(vis, jax.nn.softmax(jnp.where(seen, s, 0.0), axis=-1), 0.0)
  return jnp.einsum("bhij,bjhd->bihd", p, v)


def _classes_of(kw, T, bq, bk, g, pos, seg, sisa):
  """The kernel's tile classes (`decayed._classes`) of a call's fwd tiling, [B, H, nq, nk]."""
  H = g.shape[-1]
  spec = K.Spec(1.0, kw["fox"], sisa, False, True, kw["window"], bq, bk, 1, True)
  x = K._pad(spec, jnp.zeros((1, T, H, 16)), jnp.zeros((1, T, H, 16)),
             jnp.zeros((1, T, H, 16)), g, None, None, None, pos, seg)
  return np.asarray(K._classes(spec, x, bq, bk))


TILE_SCENARIOS = {
    # one document, causal: skipped tiles above the diagonal, full ones below, partial on it
    "causal": dict(lengths=None, prefix=0, window=None, pad=0),
    # two packed documents: tiles meeting the boundary partial, the later document's queries
    # against the earlier document's keys empty
    "documents": dict(lengths=[70, 122], prefix=0, window=None, pad=0),
    # a window: tiles W or more behind empty, its edge partial; right padding partial
    "window": dict(lengths=None, prefix=0, window=80, pad=23),
    # a shared prefix (segment 0) read by a document whose g restarts: every pair of those
    # tiles is visible (full for FoX) but g_i > g_j there, so SISA takes the fallback
    "prefix": dict(lengths=[64, 128], prefix=1, window=None, pad=0),
}


@pytest.mark.parametrize("terms", ["sisa", "fox"])
@pytest.mark.parametrize("scenario", sorted(TILE_SCENARIOS))
def test_every_tile_class_matches_float64_reference(scenario, terms):
  """Each tile class the schedule makes (empty: never visited; full: no mask, FoX's per-key
  bias / SISA's factored decay; SISA's masked factored tiles (the diagonal within a span);
  partial: masked, per-element decay; document boundaries; SISA's fallback on fully visible
  tiles whose decay does not factor, and on diagonal tiles of a long span) forward and backward
  against the explicit float64 reference, T 192 in tiles of 32 (interpret mode). The scenario
  is checked to produce the classes it is named for."""
  sc = TILE_SCENARIOS[scenario]
  rng = np.random.default_rng(12)
  B, T, H, D, ds, bq, bk = 1, 192, 2, 16, 8, 32, 32
  if sc["lengths"] is None:
    seg = jnp.ones((B, T), jnp.int32)
  else:
    seg = _segments([sc["lengths"]]) - sc["prefix"]          # prefix: document 1 -> segment 0
  valid = np.arange(T) < T - sc["pad"]
  starts = _starts(seg)
  pos_np = np.zeros((B, T), np.int64)
  for t in range(T):                        # positions restart in every document
    pos_np[:, t] = 0 if t == 0 or starts[0, t] else pos_np[:, t - 1] + 1
  if sc["prefix"]:                          # a document after the prefix continues its positions
    pos_np = np.arange(T)[None]
  pos = jnp.asarray(np.where(valid, pos_np, -1), jnp.int32)
  loga = -rng.uniform(0, 1, (B, T, H)) * np.array([0.05, 3.0])
  g = jnp.asarray(_seg_cumsum(loga, starts), jnp.float32)
  sisa, fox = terms == "sisa", terms == "fox"
  kw = dict(fox=fox, window=sc["window"])
  cls = _classes_of(kw, T, bq, bk, g, pos, seg, sisa)
  want = {K.FULL, K.PARTIAL, K.EMPTY} if fox else {K.FULL, K.MASKED_FACTORED, K.EMPTY}
  if sisa and scenario != "causal":
    want.add(K.PARTIAL)       # document boundaries, padding, the prefix's fallback
  assert want <= set(np.unique(cls)), (scenario, np.unique(cls))
  if sisa:                    # head 1's diagonal tiles span more than FACTOR_SPAN somewhere
    assert K.PARTIAL in set(np.unique(cls[0, 1][np.arange(T // bq), np.arange(T // bk)]))
  if scenario == "prefix":
    fox_cls = _classes_of(dict(kw, fox=True), T, bq, bk, g, pos, seg, False)
    prefix_pairs = (slice(None), slice(None), slice(2, None), slice(0, 2))
    assert np.all(fox_cls[prefix_pairs] == K.FULL)                  # visible everywhere
    if sisa:   # the fallback where some pair has g_i > g_j (the document's start), else full
      gq = np.asarray(g)[0].reshape(-1, bq, H).max(1).T               # [H, nq]
      gk = np.asarray(g)[0].reshape(-1, bk, H).min(1).T
      want = np.where(gq[:, 2:, None] <= gk[:, None, :2], K.FULL, K.PARTIAL)
      assert np.any(want == K.PARTIAL)
      np.testing.assert_array_equal(cls[0][:, 2:, :2], want)
  args = (_normal(rng, (B, T, H, D), 2.0), _normal(rng, (B, T, H, D), 2.0),
          _normal(rng, (B, T, H, D)), _normal(rng, (B, T, H, ds)), _normal(rng, (B, T, H, ds)),
          g)

  def kernel(q, k, v, c, b, g):
    sis = dict(c_BTHS=c, b_BTHS=b) if sisa else {}
    return K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, positions_BT=pos,
                               segment_ids_BT=seg, block_q=bq, block_k=bk, **kw, **sis)

  def ref(q, k, v, c, b, g):
    return _decayed_reference(q, k, v, c, b, g, scale=D ** -0.5, sisa=sisa,
                              pos=jnp.asarray(pos), seg=jnp.asarray(seg), **kw)

  names = ("q", "k", "v", "c", "b", "g")
  if sisa:
    _check(kernel, ref, args, names, seed=12)
  else:
    _check(lambda q, k, v, g: kernel(q, k, v, None, None, g),
           lambda q, k, v, g: ref(q, k, v, None, None, g),
           args[:3] + args[5:], ("q", "k", "v", "g"), seed=12)


def test_tile_visits_count_the_schedule_and_tuning_files_round_trip(tmp_path):
  """`tile_visits` (what a census weighs each loop by): at T 2048 with the head-dim-64 choice
  (fwd / dq 128 x 64, dkv 64 x 128) a causal row visits the 272 tiles of the lower triangle in
  each pass, the 32 meeting the diagonal masked (SISA: factored, FoX: partial); a tuning file
  keeps the dkv pass's tiles."""
  tune = K.GPU_TUNING[64]
  assert tune.dkv_tile[1] >= 64 and all(w % 4 == 0 for w in tune.warps)   # wgmma's M, warps
  sisa = K.tile_visits(2048, 64, sisa=True)
  fox = K.tile_visits(2048, 64, fox=True)
  for name in K.PASSES:
    assert sisa[name] == (240, 32, 0), (name, sisa[name])
    assert fox[name] == (240, 0, 32), (name, fox[name])
  path = str(tmp_path / "tuning.json")
  K.write_tuning(path, {64: tune, 128: K.GpuTuning()})
  assert K.read_tuning(path) == {64: tune, 128: K.GpuTuning()}


@pytest.mark.parametrize("terms", ["fox", "sisa"])
def test_grid_driver_full_form_equals_loop_driver(terms):
  """FoX / SISA on the TPU driver with FULL pairs (one document, T a multiple of the tiles):
  the grid step's branch to the full form (frames from the loaded tiles; SISA's decay a
  rank-one product) gives the loop driver's output and gradients (interpret mode)."""
  rng = np.random.default_rng(13)
  B, T, H, D, ds = 1, 384, 2, 16, 8
  q, k, v, w = (_normal(rng, (B, T, H, D)) for _ in range(4))
  c, b = (_normal(rng, (B, T, H, ds)) for _ in range(2))
  g = jnp.cumsum(-jnp.abs(_normal(rng, (B, T, H))) * 0.5, axis=1)
  cls = _classes_of(dict(fox=terms == "fox", window=None), T, 128, 128, g,
                    jnp.arange(T)[None], jnp.ones((B, T), jnp.int32), terms == "sisa")
  assert np.sum(cls == K.FULL) == 2 * 3                       # (1, 0), (2, 0), (2, 1) per head
  kw = dict(fox=True) if terms == "fox" else dict(c_BTHS=c, b_BTHS=b)

  def loss(grid, q, k, v, g):
    out = K.decayed_attention(q, k, v, scale=D ** -0.5, g_BTH=g, block_q=128, block_k=128,
                              tile_grid=grid, **kw)
    return jnp.sum(out * w)

  ref = jax.value_and_grad(functools.partial(loss, False), argnums=(0, 1, 2, 3))(q, k, v, g)
  got = jax.value_and_grad(functools.partial(loss, True), argnums=(0, 1, 2, 3))(q, k, v, g)
  for name, a, r in zip(("loss", "dq", "dk", "dv", "dg"), jax.tree.leaves(got),
                        jax.tree.leaves(ref)):
    _close(a, r, what=name)
