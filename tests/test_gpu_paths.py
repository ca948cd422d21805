"""GPU-only paths: the cuDNN attention core (what `impl="auto"` picks for bf16 on a GPU) and SISA
on top of it, against the explicit fp32 references.

Skipped unless JAX's default backend is a GPU: run them with
  JAX_PLATFORMS=cuda python -m pytest -q tests/test_gpu_paths.py
(`experiments/device_check.sh` does, with the other numerics tests and the throughput bench).
ATTN_JAX_GPU_TESTS_IMPL=xla runs the same checks on another backend through the XLA core, which
exercises the tests themselves (not cuDNN) on a CPU-only machine.

Errors are relative to the largest |value| of the reference; bf16 tolerances are fixed once.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.attention import sisa as S
from attn_jax.kernel_choice import attention_impl
from attn_jax.kernels.dense import attention_reference
from attn_jax.kernels.entry import attend
from attn_jax.model_config import ModelConfig
from configs import base

IMPL = os.environ.get("ATTN_JAX_GPU_TESTS_IMPL", "cudnn")
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" and "ATTN_JAX_GPU_TESTS_IMPL" not in os.environ,
    reason="GPU-only paths: run with JAX_PLATFORMS=cuda on a GPU machine")

OUT_TOL = 2e-2   # bf16 inputs, fp32 accumulation: outputs
GRAD_TOL = 5e-2  # gradients (bf16 backward)
# (H, K, Dqk, Dv): MHA, GQA, SISA-style Q/K wider than V
LAYOUTS = {"mha": (8, 8, 64, 64), "gqa": (8, 2, 64, 64), "wide_qk": (4, 4, 80, 64)}


def _normal(seed, shape, dtype=jnp.bfloat16):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_auto_picks_cudnn_for_bf16():
  if jax.default_backend() != "gpu":
    pytest.skip("auto's choice is platform-specific")
  assert attention_impl("auto", jnp.bfloat16, 64) == "cudnn"
  assert attention_impl("auto", jnp.float32, 64) == "xla"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attend_bf16_matches_reference_with_gradients(layout):
  H, K, Dqk, Dv = LAYOUTS[layout]
  B, T = 2, 256
  q, k, v = _normal(0, (B, T, H, Dqk)), _normal(1, (B, T, K, Dqk)), _normal(2, (B, T, K, Dv))
  dout = _normal(3, (B, T, H, Dv), jnp.float32)
  scale = Dqk ** -0.5

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout)

  ours = lambda q, k, v: attend(q, k, v, scale=scale, causal=True, impl=IMPL)
  ref = lambda q, k, v: attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                            v.astype(jnp.float32), scale=scale, causal=True)
  out = jax.jit(ours)(q, k, v)
  want = jax.jit(ref)(q, k, v)
  assert out.dtype == jnp.bfloat16 and out.shape == (B, T, H, Dv)
  assert _rel_err(out, want) <= OUT_TOL
  g = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
  for name, a, b in zip("qkv", g, g_ref):
    assert _rel_err(a, b) <= GRAD_TOL, f"d{name}"


def test_attend_bf16_with_positions_and_bias():
  """Queries after a cached prefix (explicit positions, empty cache slots) plus an additive
  bias: the masked path cached decoding and SISA's chunked path use."""
  B, T, S_, H, D = 2, 16, 128, 4, 64
  q, k, v = _normal(0, (B, T, H, D)), _normal(1, (B, S_, H, D)), _normal(2, (B, S_, H, D))
  bias = _normal(3, (B, H, T, S_))
  qpos = jnp.broadcast_to(jnp.arange(96, 96 + T, dtype=jnp.int32), (B, T))
  kpos = jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32), (B, S_))  # keys after a query: masked
  kw = dict(scale=D ** -0.5, causal=True, q_positions=qpos, kv_positions=kpos)
  out = jax.jit(lambda q, k, v, b: attend(q, k, v, bias=b, impl=IMPL, **kw))(q, k, v, bias)
  f32 = lambda a: a.astype(jnp.float32)
  want = attention_reference(f32(q), f32(k), f32(v), bias=f32(bias), **kw)
  assert _rel_err(out, want) <= OUT_TOL


def test_attend_bf16_packed_rows_with_gradients():
  """Packed rows (segment ids, positions restarting per document, a shared prefix of segment
  0): cuDNN takes the segments through its mask; outputs and gradients vs the fp32 reference."""
  B, T, H, D = 2, 256, 4, 64
  q, k, v = _normal(0, (B, T, H, D)), _normal(1, (B, T, H, D)), _normal(2, (B, T, H, D))
  dout = _normal(3, (B, T, H, D), jnp.float32)
  lens = ((2, 1, 60, 130, 63), (2, 127, 127))   # 2 shared-prefix tokens, then documents
  seg = jnp.asarray([np.repeat(np.arange(len(l)), l) for l in lens], jnp.int32)
  pos = jnp.asarray([np.concatenate([np.arange(n) + (0 if d == 0 else 2) for d, n in
                                     enumerate(l)]) for l in lens], jnp.int32)
  kw = dict(scale=D ** -0.5, causal=True, q_positions=pos, kv_positions=pos, q_segments=seg,
            kv_segments=seg)
  f32 = lambda a: a.astype(jnp.float32)
  ours = lambda q, k, v: attend(q, k, v, impl=IMPL, prefix_causal=True, **kw)
  ref = lambda q, k, v: attention_reference(f32(q), f32(k), f32(v), **kw)
  assert _rel_err(jax.jit(ours)(q, k, v), ref(q, k, v)) <= OUT_TOL
  loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dout)
  g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", g, g_ref):
    assert _rel_err(a, b) <= GRAD_TOL, f"d{name}"


def _sisa(path: str, decay_bias: float):
  c = base.get_config()
  c.model.update(mixer="sisa", d_model=128, n_heads=2, n_layers=2, d_ff=256, vocab_size=64,
                 dtype="bfloat16", max_seq_len=4096, attention_impl="auto" if IMPL == "cudnn"
                 else IMPL)
  c.model.sisa.update(d_state=16, path=path, chunk_size=64,
                       decay_bias_init=decay_bias)
  cfg = ModelConfig.from_config(c.model)
  m = S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(params=0))
  for lin, f in ((m.b_proj, 6.0), (m.c_proj, 6.0), (m.phase_proj, 20.0)):  # SISA term O(1)
    lin.kernel[...] = lin.kernel[...] * f
  return m


# decay bias -2.63: half-life ~10 tokens, decay range ~18 nats over 256 tokens (within the fast
# path's 60); -1.0: half-life ~2 tokens, range ~84 nats (only the chunked path is exact).
@pytest.mark.parametrize("path,decay_bias,chunked", [
    ("fast", -2.63, False), ("auto", -2.63, False), ("chunked", -1.0, True), ("auto", -1.0, True)])
def test_sisa_bf16_matches_reference(path, decay_bias, chunked):
  m = _sisa(path, decay_bias)
  B, T = 2, 256
  x = _normal(4, (B, T, 128))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  @nnx.jit
  def run(m, x):
    y, _, aux = m(x, positions_BT=pos)
    return y, aux["chunked"]

  @nnx.jit
  def reference(m, x):
    q, k, v, c, b, loga, theta, lam = m.features(x, pos)
    f32 = lambda a: a.astype(jnp.float32)
    g, phi = S.decay_and_phase(f32(loga), f32(theta))
    out, _ = S.sisa_attention_reference(f32(q), f32(k), f32(v), f32(c), f32(b), g, phi,
                                        f32(lam))
    return m.proj.o(out.astype(x.dtype))

  y, took_chunked = run(m, x)
  assert bool(took_chunked) == chunked
  assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
  assert _rel_err(y, reference(m, x)) <= OUT_TOL


def test_split_fused_route_bf16_with_gradients():
  """kernels/lse_merge.py's fused route (past keys, no bias): cuDNN's output and lse, with the
  custom VJP that restores the lse gradient cuDNN's own rule drops, combined with a biased part."""
  from attn_jax.kernels import lse_merge
  B, T, S_, H, D = 2, 64, 192, 4, 80
  q, k, v = _normal(20, (B, T, H, D)), _normal(21, (B, S_, H, D)), _normal(22, (B, S_, H, 64))
  cut = 128
  bias = jnp.where(jnp.arange(T)[:, None] >= jnp.arange(S_ - cut)[None, :], 0.3, 0.0)
  mask = jnp.arange(T)[:, None] >= jnp.arange(S_ - cut)[None, :]
  dout = _normal(23, (B, T, H, 64), jnp.float32)

  def ours(q, k, v):
    parts = [lse_merge.partial_attention(q, k[:, :cut], v[:, :cut], scale=D ** -0.5, impl=IMPL),
             lse_merge.partial_attention(q, k[:, cut:], v[:, cut:], scale=D ** -0.5, bias=bias,
                                     mask=mask)]
    return lse_merge.combine(parts)

  def ref(q, k, v):
    f = lambda a: a.astype(jnp.float32)
    full = jnp.concatenate([jnp.zeros((T, cut)), bias], axis=1)[None, None]
    m = jnp.concatenate([jnp.ones((T, cut), bool), mask], axis=1)
    s = jnp.einsum("bthd,bshd->bhts", f(q), f(k)) * D ** -0.5 + full
    s = jnp.where(m, s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), f(v))

  assert _rel_err(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v)) <= OUT_TOL
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * dout)
  g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
  for name, a, b in zip("qkv", g, g_ref):
    assert _rel_err(a, b) <= GRAD_TOL, f"d{name}"
