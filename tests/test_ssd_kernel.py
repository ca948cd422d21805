"""attn_jax/kernels/ssd_chunks.py: the fused chunked SSD (Pallas, interpret mode on CPU) against
the XLA chunked SSD (`ssd.ssd_chunked`, the same rounding steps) and the float64 explicit
recurrence (`ssd.ssd_recurrent`), forward and every gradient (x, a, B, C, the initial state),
with packed documents (`reset_BT`), several chunks and a partial last one; and its compile for
the targets.

Errors are relative to the largest |value| of the reference (max|a - b| <= tol * max|b|), per
output and per gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import kernel_choice, sharding as shd, targets
from attn_jax.kernels import ssd_chunks as K
from attn_jax.ssm import ssd

TOL = 2e-5            # fp32 against the float64 recurrence / the fp32 XLA form; fixed once
TOL_BF16 = 2e-2       # bf16 matmul operands against the XLA form with the same dot_dtype
NAMES = ("x", "a", "B", "C", "h0")


def _close(a, b, tol, what):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), what
  err = float(np.max(np.abs(a - b)))
  assert err <= tol * float(np.max(np.abs(b))), f"{what}: {err} vs {tol} * {np.max(np.abs(b))}"


def _inputs(seed, B=2, T=40, H=4, P=16, G=2, N=16, dtype=jnp.float32):
  """T 40 in chunks of 16 (two whole, one partial); log-decays from ~ -1e-2 to ~ -5 per step;
  row 0 holds documents starting at 13, row 1 at 16 (a chunk's first token) and 30."""
  rng = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  x = n(B, T, H, P).astype(dtype)
  a = -jnp.exp(jnp.asarray(rng.uniform(-5.0, 1.6, (B, T, H)), jnp.float32))
  b = (n(B, T, G, N) / 4).astype(dtype)
  c = n(B, T, G, N).astype(dtype)
  h0 = n(B, H, P, N)
  reset = np.zeros((B, T), bool)
  reset[0, 13] = True
  reset[1:, 16] = reset[1:, 30] = True
  return (x, a, b, c, h0), jnp.asarray(reset)


def _grads(fn, args, reset, w, wh):
  """(y, h) and the gradients of sum(y w) + sum(h wh) for every argument."""
  def loss(*z):
    y, h = fn(*z, reset)
    return jnp.sum(y * w) + jnp.sum(h * wh), (y, h)
  grads, out = jax.jit(jax.grad(loss, tuple(range(len(args))), has_aux=True))(*args)
  return out, grads


def _weights(seed, args):
  rng = np.random.default_rng(seed + 7)
  x, h0 = args[0], args[4]
  return (jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
          jnp.asarray(rng.standard_normal(h0.shape), jnp.float32))


def _kernel(dot_dtype=None):
  return lambda x, a, b, c, h0, r: K.ssd_kernel(x, a, b, c, chunk=16, h0_BHPN=h0, reset_BT=r,
                                                dot_dtype=dot_dtype, interpret=True)


def test_fp32_matches_xla_chunked_and_float64_recurrence():
  args, reset = _inputs(0)
  w, wh = _weights(0, args)
  (y, h), g = _grads(_kernel(), args, reset, w, wh)
  xla = lambda x, a, b, c, h0, r: ssd.ssd_chunked(x, a, b, c, chunk=16, h0_BHPN=h0, reset_BT=r)
  (y_x, h_x), g_x = _grads(xla, args, reset, w, wh)
  with jax.enable_x64(True):
    f64 = lambda z: jnp.asarray(np.asarray(z), jnp.float64)
    rec = lambda x, a, b, c, h0, r: ssd.ssd_recurrent(x, a, b, c, h0_BHPN=h0, reset_BT=r)
    (y_r, h_r), g_r = _grads(rec, [f64(z) for z in args], reset, f64(w), f64(wh))
    y_r, h_r, g_r = np.asarray(y_r), np.asarray(h_r), [np.asarray(z) for z in g_r]
  for ref, label in (((y_x, h_x, g_x), "xla"), ((y_r, h_r, g_r), "float64 recurrence")):
    _close(y, ref[0], TOL, f"y vs {label}")
    _close(h, ref[1], TOL, f"final state vs {label}")
    for name, gk, gr in zip(NAMES, g, ref[2]):
      if name == "a":   # the recurrence's a at a start reaches nothing; the chunked forms' too
        gk, gr = np.where(np.asarray(reset)[..., None], 0.0, gk), gr
      _close(gk, gr, TOL, f"d {name} vs {label}")


def test_bf16_matches_xla_chunked_with_bf16_dots():
  """bf16 x, B, C and bf16 matmul operands (the mixers' setting) against the XLA form with the
  same `dot_dtype`: the same roundings, so agreement well inside bf16's resolution."""
  args, reset = _inputs(1, dtype=jnp.bfloat16)
  w, wh = _weights(1, args)
  (y, h), g = _grads(_kernel(jnp.bfloat16), args, reset, w, wh)
  xla = lambda x, a, b, c, h0, r: ssd.ssd_chunked(x, a, b, c, chunk=16, h0_BHPN=h0, reset_BT=r,
                                                  dot_dtype=jnp.bfloat16)
  (y_x, h_x), g_x = _grads(xla, args, reset, w, wh)
  _close(y, y_x, TOL_BF16, "y")
  _close(h, h_x, TOL_BF16, "final state")
  for name, gk, gx in zip(NAMES, g, g_x):
    assert gk.dtype == gx.dtype, name
    _close(gk, gx, TOL_BF16, f"d {name}")


def test_a_start_blocks_everything_before_it():
  """A document's output and final state do not depend on what precedes its start: changing
  the first document of row 0 (tokens < 13) leaves y from 13 on and the final state alone,
  values and to the last bit of their float precision (the decay across a start is exactly 0)."""
  args, reset = _inputs(2, B=1, T=40)
  x, a, b, c, h0 = args
  run = jax.jit(_kernel())
  y1, h1 = run(x, a, b, c, h0, reset)
  x2 = x.at[:, :13].multiply(-3.0)
  b2 = b.at[:, :13].add(1.0)
  y2, h2 = run(x2, a, b2, c, 5.0 * h0, reset)
  np.testing.assert_array_equal(np.asarray(y1[:, 13:]), np.asarray(y2[:, 13:]))
  np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))
  assert not np.allclose(np.asarray(y1[:, :13]), np.asarray(y2[:, :13]))


def test_unsupported_names_why():
  assert K.unsupported((1, 64, 2, 64), (1, 64, 1, 64), 64, plat="gpu") is None
  assert "head_dim" in K.unsupported((1, 64, 2, 24), (1, 64, 1, 64), 64, plat="gpu")
  assert "chunk" in K.unsupported((1, 64, 2, 64), (1, 64, 1, 64), 48, plat="gpu")
  assert K.unsupported((1, 64, 2, 64), (1, 64, 1, 64), 48, plat="cpu") is None
  assert "shared memory" in K.unsupported((1, 512, 2, 64), (1, 512, 1, 64), 256, plat="gpu")


# ---------------------------------------------------------------- compiled for the targets

def _compiled_text(target: str, T: int = 256, H: int = 4, P: int = 64, N: int = 64, G: int = 1,
                   chunk: int = 64):
  """The kernel's fwd + bwd (bf16 x, B, C, bf16 dots, packed documents) compiled for a
  target's first device."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
  devs = targets.devices(target)
  B = 2
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sds((B, T, H, P), bf), sds((B, T, H), f32), sds((B, T, G, N), bf),
          sds((B, T, G, N), bf), sds((B, T), jnp.bool_))

  def loss(x, a, b, c, reset):
    y, h = K.ssd_kernel(x, a, b, c, chunk=chunk, reset_BT=reset, dot_dtype=bf)
    return jnp.sum(y ** 2) + jnp.sum(h)

  mesh = Mesh(np.array(devs[:1]), ("x",))
  # Under the target's mesh (`use_rules`: its platform for the kernel choice, and the mesh in
  # context, which Pallas Triton's lowering reads the GPU from on jax >= 0.11)
  with shd.use_rules(mesh, {}), targets.no_persistent_cache():
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), in_shardings=NamedSharding(mesh, Ps()))
    compiled = f.lower(*args).compile()
  return compiled.as_text()


TARGET_CALLS = [("h100x1", "__gpu$xla.gpu.triton"), ("v5e-4", "tpu_custom_call")]


@pytest.mark.parametrize("target,call", TARGET_CALLS)
def test_kernels_compile_for_target(target, call):
  """All four kernels (states, scan; dstates, dchunk: the backward reads the forward's states,
  no recompute) are custom calls of the target's Pallas backend (Triton on H100: shared memory and registers at chunk 64,
  head dim 64, d_state 64 fit; Mosaic on TPU)."""
  if not targets.available(target):
    pytest.skip(f"no compiler plugin for {target}")
  text = _compiled_text(target)
  for name in K.PASSES:
    assert f"ssd_{name}" in text, (name, text[:3000])
  assert text.count(call) >= 4, text[:3000]


# ---------------------------------------------------------------- the mixers' kernel branch

@pytest.mark.parametrize("name", ["mamba2", "hybrid_heads", "mamba3", "mamba3-mimo"])
def test_mixer_takes_the_kernel_and_matches_xla(name):
  """A Mamba-2 mixer's full forward (the hybrid's SSM heads, `Mamba2.ssm_heads`, Mamba-3's
  SISO trapezoid with its rotated B, C, and Mamba-3 MIMO of rank 2 alike) on a packed row
  takes the kernel where `kernel_choice.ssd_kernel` says so (`kernels_on_cpu`) and equals the
  XLA path, output and every parameter's gradient."""
  import dataclasses
  from flax import nnx
  from tests.test_mamba import CFG, _build, _packed
  cls, opts, m = _build(name.split("-")[0])
  if name.endswith("mimo"):
    m = cls(CFG, dataclasses.replace(opts, mimo_rank=2), rngs=nnx.Rngs(0))
  pos, seg, _ = _packed()
  x = jnp.asarray(np.random.default_rng(3).standard_normal(pos.shape + (32,)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.float32)
  graphdef, state = nnx.split(m)

  def run():   # a fresh jit per call: the kernel choice is read at trace time
    def loss(state):
      y = nnx.merge(graphdef, state)(x, positions_BT=pos, segment_ids_BT=seg)[0]
      return jnp.sum(y * w), y
    program = str(jax.make_jaxpr(loss)(state))
    grads, y = jax.jit(jax.grad(loss, has_aux=True))(state)
    return "pallas_call" in program, y, grads

  took, y_x, g_x = run()
  assert not took
  with kernel_choice.kernels_on_cpu():
    took, y_k, g_k = run()
  assert took
  _close(y_k, y_x, TOL, "output")
  flat_x = dict(jax.tree_util.tree_leaves_with_path(g_x))
  for path, g in jax.tree_util.tree_leaves_with_path(g_k):
    _close(g, flat_x[path], TOL, f"d {jax.tree_util.keystr(path)}")


def test_second_input_matches_xla_chunked():
  """`extra = (x2, B2)` (Mamba-3's trapezoid): forward and every gradient (x2 and B2 included)
  equal `ssd_chunked(extra=)`'s, fp32, packed documents, with one group per head (G = H, as
  Mamba-3 passes its rotated B, C)."""
  (x, a, b, c, h0), reset = _inputs(3, G=4)
  rng = np.random.default_rng(9)
  x2 = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  b2 = jnp.asarray(rng.standard_normal(b.shape) / 4, jnp.float32)
  args = (x, a, b, c, h0, x2, b2)
  w, wh = _weights(3, args)

  def run(fn):
    return lambda x, a, b, c, h0, x2, b2, r: fn(x, a, b, c, chunk=16, h0_BHPN=h0, extra=(x2, b2),
                                                reset_BT=r)
  (y, h), g = _grads(run(lambda *z, **k: K.ssd_kernel(*z, interpret=True, **k)), args, reset,
                     w, wh)
  (y_x, h_x), g_x = _grads(run(ssd.ssd_chunked), args, reset, w, wh)
  _close(y, y_x, TOL, "y")
  _close(h, h_x, TOL, "final state")
  for name, gk, gx in zip(NAMES + ("x2", "B2"), g, g_x):
    _close(gk, gx, TOL, f"d {name}")


def test_sharded_over_batch_equals_one_device():
  """Under `sharding.use_rules` on simulated devices (data 2 x tensor 4) the kernels run in a
  shard_map (rows over data; heads whole) and equal the unsharded call, forward and
  gradients."""
  from attn_jax import sharding
  if jax.device_count() < 8:   # the suite's CPU has 8 simulated devices
    pytest.skip(f"needs 8 devices, have {jax.device_count()}")
  args, reset = _inputs(4)
  w, wh = _weights(4, args)
  kernel = lambda x, a, b, c, h0, r: K.ssd_kernel(x, a, b, c, chunk=16, h0_BHPN=h0, reset_BT=r,
                                                  interpret=True)
  (y, h), g = _grads(kernel, args, reset, w, wh)
  mesh = sharding.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"))
  with sharding.use_rules(mesh, sharding.TRUNK_RULES):
    assert "shard_map" in str(jax.make_jaxpr(kernel)(*args, reset))
    (y_s, h_s), g_s = _grads(kernel, args, reset, w, wh)
  _close(y_s, y, 1e-6, "sharded y")
  _close(h_s, h, 1e-6, "sharded final state")
  for name, a, b in zip(NAMES, g_s, g):
    _close(a, b, 1e-6, f"sharded d {name}")


# ---------------------------------------------------------------- Mamba-3 MIMO

def _mimo_inputs(seed, B=2, T=40, H=2, I=4, O=2, P=16, N=16, dtype=jnp.float32):
  """Rank 2 (I = 2r input columns, O = r outputs), T 40 in chunks of 8 (five), the documents
  and decays of `_inputs`."""
  (x, a, b, c, h0), reset = _inputs(seed, B=B, T=T, H=H, P=P, G=H, N=N)
  rng = np.random.default_rng(seed + 11)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  u, k, q = n(B, T, H, I, P), n(B, T, H, I, N) / 4, n(B, T, H, O, N)
  return (u.astype(dtype), a, k.astype(dtype), q.astype(dtype), h0), reset


def _mimo(fn, chunk=8, **kw):
  return lambda u, a, k, q, h0, r: fn(u, a, k, q, chunk=chunk, h0_BHPN=h0, reset_BT=r, **kw)


def test_mimo_matches_mimo_chunked_and_float64_recurrence():
  """`mimo_kernel` (the input columns as input rows, the output columns as output rows of the
  same kernels) against Mamba-3's XLA `mimo_chunked` and the float64 `mimo_recurrent`: output,
  final state and every gradient (u, a, k, q, h0), packed documents, several chunks and a
  partial last one."""
  from attn_jax.ssm import mamba3
  args, reset = _mimo_inputs(5)
  w = jnp.asarray(np.random.default_rng(6).standard_normal(args[0].shape[:3] + (2, 16)),
                  jnp.float32)
  wh = _weights(5, args)[1]
  (y, h), g = _grads(_mimo(lambda *z, **k: K.mimo_kernel(*z, interpret=True, **k)), args,
                     reset, w, wh)
  (y_x, h_x), g_x = _grads(_mimo(mamba3.mimo_chunked), args, reset, w, wh)
  with jax.enable_x64(True):
    f64 = lambda z: jnp.asarray(np.asarray(z), jnp.float64)
    rec = lambda u, a, k, q, h0, r: mamba3.mimo_recurrent(u, a, k, q, h0_BHPN=h0, reset_BT=r)
    (y_r, h_r), g_r = _grads(rec, [f64(z) for z in args], reset, f64(w), f64(wh))
    y_r, h_r, g_r = np.asarray(y_r), np.asarray(h_r), [np.asarray(z) for z in g_r]
  for ref, label in (((y_x, h_x, g_x), "xla mimo_chunked"), ((y_r, h_r, g_r), "float64")):
    _close(y, ref[0], TOL, f"y vs {label}")
    _close(h, ref[1], TOL, f"final state vs {label}")
    for name, gk, gr in zip(("u", "a", "k", "q", "h0"), g, ref[2]):
      if name == "a":
        gk, gr = np.where(np.asarray(reset)[..., None], 0.0, gk), gr
      _close(gk, gr, TOL, f"d {name} vs {label}")


def test_mimo_bf16_matches_mimo_chunked_with_bf16_dots():
  from attn_jax.ssm import mamba3
  args, reset = _mimo_inputs(7, dtype=jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(8).standard_normal(args[0].shape[:3] + (2, 16)),
                  jnp.float32)
  wh = _weights(7, args)[1]
  bf = dict(dot_dtype=jnp.bfloat16)
  (y, h), g = _grads(_mimo(lambda *z, **k: K.mimo_kernel(*z, interpret=True, **k), **bf),
                     args, reset, w, wh)
  (y_x, h_x), g_x = _grads(_mimo(mamba3.mimo_chunked, **bf), args, reset, w, wh)
  _close(y, y_x, TOL_BF16, "y")
  _close(h, h_x, TOL_BF16, "final state")
  for name, gk, gx in zip(("u", "a", "k", "q", "h0"), g, g_x):
    assert gk.dtype == gx.dtype, name
    _close(gk, gx, TOL_BF16, f"d {name}")


@pytest.mark.parametrize("name", ["mamba2", "mamba3", "mamba3-mimo"])
def test_decode_steps_equal_the_kernels_full_forward(name):
  """Decoding (one token a step from the carried state, the XLA recurrence) equals the full
  forward through the kernels (`kernels_on_cpu`, interpret mode): the kernels' final states
  and outputs are the recurrence's, as `tests/test_mamba.py` checks for the XLA SSD."""
  import dataclasses
  from flax import nnx
  from tests.test_mamba import CFG, TOL as MIXER_TOL, _build, _pos, _state, _x
  cls, opts, m = _build(name.split("-")[0])
  if name.endswith("mimo"):
    opts = dataclasses.replace(opts, mimo_rank=2)
    m = cls(CFG, opts, rngs=nnx.Rngs(0))
  B, T = 2, 11
  x, pos = _x(B, T), _pos(B, T)
  graphdef, state = nnx.split(m)
  full = lambda st, x, p: nnx.merge(graphdef, st)(x, positions_BT=p)[0]
  with kernel_choice.kernels_on_cpu():
    assert "pallas_call" in str(jax.make_jaxpr(full)(state, x, pos))
    y_full = jax.jit(full)(state, x, pos)
  step = jax.jit(lambda st, x, p, s: nnx.merge(graphdef, st)(x, positions_BT=p, state=s)[:2])
  st, ys = _state(cls, opts, B), []
  for t in range(T):
    y, st = step(state, x[:, t:t + 1], pos[:, t:t + 1], st)
    ys.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1)), np.asarray(y_full),
                             **MIXER_TOL)
