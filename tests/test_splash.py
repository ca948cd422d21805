"""The splash path of `entry.attend` (kernels/splash.py): its numerics (the kernel itself, run
in the Pallas interpreter on CPU) under a `shard_map` over a simulated 8-device mesh, the specs
the logical rules give it, which calls take it and which fall back (and why), and the
compiled program for a TPU v5e-4 slice (a Mosaic call, no [T, T] buffer), where the plugin is
installed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from attn_jax import sharding as shd
from attn_jax import targets
from attn_jax.kernels import dense, entry, splash

RULES = shd.rules_dict(shd.TRUNK_RULES)


def _packed(B, T, cut=(50, 90), pad_row=2, pad_from=120):
  """Segment ids (documents from 1) and positions restarting per document; one row padded."""
  seg = np.ones((B, T), np.int32)
  for i, c in enumerate(cut):
    seg[:, c:] = i + 2
  seg[1, 70:] = 7                       # a row with another layout
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    start = 0
    for t in range(T):
      if t and seg[b, t] != seg[b, t - 1]:
        start = t
      pos[b, t] = t - start
  pos[pad_row, pad_from:] = -1
  return jnp.asarray(seg), jnp.asarray(pos)


def _inputs(B=4, T=128, H=4, K=2, D=24, E=16, seed=0):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  return f(B, T, H, D), f(B, T, K, D), f(B, T, K, E), f(H)


def _mesh(shape):
  return shd.make_mesh(shape, ("data", "fsdp", "tensor"))


def test_sharded_splash_matches_the_reference():
  """The kernel (interpreted) under shard_map on data 2 x fsdp 2 x tensor 2: packed rows,
  padding, sinks, grouped kv heads and V narrower than Q/K; output and gradients against the
  explicit fp32 reference."""
  q, k, v, sink = _inputs()
  seg, pos = _packed(q.shape[0], q.shape[1])
  kw = dict(scale=q.shape[-1] ** -0.5, sink_logit_H=sink, q_positions=pos, kv_positions=pos,
            q_segments=seg, kv_segments=seg)
  ours = lambda q, k, v: entry.attend(q, k, v, impl="splash", prefix_causal=True,
                                     shared_prefix=False, **kw)
  ref = lambda q, k, v: dense.attention_reference(q, k, v, **kw)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  with shd.use_rules(_mesh((2, 2, 2)), RULES):
    out = jax.jit(ours)(q, k, v)
    grads = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(out, ref(q, k, v), atol=2e-6)
  for g, want in zip(grads, jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, want, atol=1e-5)


@pytest.mark.parametrize("window", [5, 130, 256], ids=["inside-a-block", "across-blocks",
                                                       "whole-row"])
def test_splash_window_matches_the_reference(window):
  """The kernel's local mask (interpreted): a sliding window of w keys, the query included,
  with sinks, grouped kv heads and documents (segment ids without positions, so the indices
  are the positions), against the explicit fp32 reference; output and gradients. T 256 is two
  of the kernel's 128 blocks: w 5 lies inside the diagonal blocks, w 130 reaches into the
  block before, w 256 is the causal mask."""
  q, k, v, sink = _inputs(B=1, T=256, H=2, K=1, D=16, E=8, seed=1)
  seg = jnp.ones(q.shape[:2], jnp.int32).at[:, 200:].set(2)
  kw = dict(scale=q.shape[-1] ** -0.5, sink_logit_H=sink, window=window, q_segments=seg,
            kv_segments=seg)
  ours = lambda q, k, v: entry.attend(q, k, v, impl="splash", shared_prefix=False, **kw)
  ref = lambda q, k, v: dense.attention_reference(q, k, v, **kw)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  assert "pallas_call" in str(jax.make_jaxpr(ours)(q, k, v))    # the kernel, no fallback
  out = jax.jit(ours)(q, k, v)
  grads = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(out, ref(q, k, v), atol=2e-6)
  for g, want in zip(grads, jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, want, atol=1e-5)


def test_shard_specs_follow_the_rules():
  mesh = _mesh((2, 2, 2))
  # rows over data x fsdp, query and kv heads over tensor
  qs, ks, ss, ids = splash.shard_specs((8, 128, 4, 16), (8, 128, 2, 16), mesh, RULES)
  assert (qs, ks, ss, ids) == (P(("data", "fsdp"), None, "tensor", None),
                               P(("data", "fsdp"), None, "tensor", None), P("tensor"),
                               P(("data", "fsdp"), None))
  # one kv head: it cannot split over tensor, so neither do the query heads
  qs, ks, ss, _ = splash.shard_specs((8, 128, 4, 16), (8, 128, 1, 16), mesh, RULES)
  assert qs[2] is None and ks[2] is None and ss == P(None)
  # kv heads replicated by the rules: query heads too (head h reads kv head h // G)
  qs, ks, _, _ = splash.shard_specs((8, 128, 4, 16), (8, 128, 2, 16), mesh,
                                    dict(RULES, kv_heads=None))
  assert qs[2] is None and ks[2] is None
  # a batch the axes do not divide is replicated (as `constrain` does)
  qs, _, _, ids = splash.shard_specs((3, 128, 4, 16), (3, 128, 2, 16), mesh, RULES)
  assert qs[0] is None and ids == P(None, None)


def test_each_device_gets_its_rows_and_heads():
  """A stand-in kernel (the explicit reference, which runs anywhere) under the wrapper: it sees
  a quarter of the rows and half of the heads, and the joined result is the unsharded one."""
  q, k, v, sink = _inputs(B=8)
  seen = []

  def stand_in(q, k, v, sink_H, q_ids, kv_ids):
    seen.append((q.shape, k.shape, sink_H.shape, q_ids.shape))
    return dense.attention_reference(q, k, v, scale=0.3, sink_logit_H=sink_H,
                                    q_segments=q_ids, kv_segments=kv_ids)

  seg = jnp.ones(q.shape[:2], jnp.int32).at[:, 64:].set(2)
  with shd.use_rules(_mesh((2, 2, 2)), RULES):
    out = jax.jit(lambda *a: splash.sharded(stand_in, *a))(q, k, v, sink, seg, seg)
  assert seen == [((2, 128, 2, 24), (2, 128, 1, 24), (2,), (2, 128))]
  want = dense.attention_reference(q, k, v, scale=0.3, sink_logit_H=sink, q_segments=seg,
                                  kv_segments=seg)
  np.testing.assert_allclose(out, want, atol=1e-6)


def test_which_calls_take_splash(monkeypatch):
  """Packed rows take the kernel unless the row may hold a shared prefix (segment 0: not an
  equality of ids); each fallback has a reason."""
  asked = []
  monkeypatch.setattr(splash, "splash_attention",
                      lambda *a, **kw: asked.append(kw) or jnp.zeros_like(a[0]))
  q, k, v, _ = _inputs(B=2, D=16, E=16)
  seg, pos = _packed(2, 128, pad_row=0)
  packed = dict(q_positions=pos, kv_positions=pos, q_segments=seg, kv_segments=seg,
                prefix_causal=True)
  entry.attend(q, k, v, scale=1.0, impl="splash", shared_prefix=False, **packed)
  assert len(asked) == 1 and asked[0]["q_ids"] is not None
  entry.attend(q, k, v, scale=1.0, impl="splash", **packed)           # may hold segment 0
  entry.attend(q, k, v, scale=1.0, impl="splash", window=8, **dict(packed, q_segments=None,
                                                                     kv_segments=None))
  entry.attend(q[:, :100], k[:, :100], v[:, :100], scale=1.0, impl="splash")
  assert len(asked) == 1
  entry.attend(q, k, v, scale=1.0, impl="splash", window=8)   # one stream: the kernel's band
  assert len(asked) == 2 and asked[1]["window"] == 8 and asked[1]["q_ids"] is None
  base = dict(causal=True, T=128, S=128, bias=None, window=None, one_stream=True,
              segmented=True, shared_prefix=True)
  assert "band of indices" in splash.splash_problem(**dict(base, window=8, positioned=True,
                                                           shared_prefix=False))
  assert splash.splash_problem(**dict(base, window=8, shared_prefix=False)) is None
  assert "shared prefix" in splash.splash_problem(**base)
  assert splash.splash_problem(**dict(base, shared_prefix=False)) is None
  assert "multiple of 128" in splash.splash_problem(**dict(base, T=100, S=100))
  assert "prefix_causal" in splash.splash_problem(**dict(base, one_stream=False))


def test_segment_ids_of_padding():
  seg, pos = _packed(4, 128)
  q_ids, kv_ids = splash.segment_ids(pos, pos, seg, seg)
  pad = np.asarray(pos) < 0
  assert np.all(np.asarray(q_ids)[pad] == splash.PAD_SEGMENT)
  assert np.array_equal(np.asarray(q_ids)[~pad], np.asarray(seg)[~pad])
  q_ids, kv_ids = splash.segment_ids(pos, pos, None, None)     # padding only
  assert set(np.unique(np.asarray(kv_ids))) == {0, splash.PAD_SEGMENT}
  assert splash.segment_ids(None, None, None, None) == (None, None)


@pytest.mark.parametrize("mesh_shape", [
    (2, 1, 2), pytest.param((1, 2, 2), marks=pytest.mark.slow)], ids=["data-tensor", "fsdp-tensor"])
def test_compiles_for_a_tpu_slice(mesh_shape):
  """On 4 TPU v5e chips (compile-only), a 2-axis mesh: the step of a packed, sink-logit,
  widened-Q/K (SISA-like, 96 / 64) attention has Mosaic calls and no [T, T] buffer."""
  if not targets.available("v5e-4"):
    pytest.skip("the TPU compile target needs libtpu (pip install -e '.[targets]')")
  T = 1024
  mesh = shd.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), devices=targets.devices("v5e-4"))
  bf = jnp.bfloat16
  q = jax.ShapeDtypeStruct((4, T, 4, 96), bf)
  k = jax.ShapeDtypeStruct((4, T, 2, 96), bf)
  v = jax.ShapeDtypeStruct((4, T, 2, 64), bf)
  sink = jax.ShapeDtypeStruct((4,), jnp.float32)
  seg = jax.ShapeDtypeStruct((4, T), jnp.int32)

  def loss(q, k, v, sink, seg):
    out = entry.attend(q, k, v, scale=0.1, sink_logit_H=sink, q_positions=seg, kv_positions=seg,
                      q_segments=seg, kv_segments=seg, prefix_causal=True, shared_prefix=False)
    return jnp.sum(out.astype(jnp.float32))

  with shd.use_rules(mesh, RULES), targets.no_persistent_cache():
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(q, k, v, sink, seg).compile().as_text()
  assert "tpu_custom_call" in text
  assert not re.search(rf"\[(?:\d+,)*{T},{T}\]", text)


@pytest.mark.parametrize("remat_chunked", [True, False], ids=["as_shipped", "without_remat"])
def test_sisa_on_splash_keeps_no_block_residuals(remat_chunked, monkeypatch):
  """SISA's path auto with the splash core (TPU when the decayed kernel is not taken): the
  cond of the fast (splash) and chunked (blockwise) branches keeps no [.., c, c] block
  probabilities for the backward; without the chunked branch's remat it would (the check can
  fail)."""
  from flax import nnx

  from attn_jax.attention import sisa as S
  from attn_jax.model_config import ModelConfig
  from configs import base
  c = base.get_config()
  c.model.update(mixer="sisa", d_model=64, n_heads=2, n_layers=1, d_ff=64, vocab_size=64,
                 dtype="float32", attention_impl="splash")
  c.model.sisa.update(d_state=8, chunk_size=128)
  cfg = ModelConfig.from_config(c.model)
  if not remat_chunked:
    monkeypatch.setattr(S.jax, "checkpoint", lambda f, **kw: f)
  graphdef, params = nnx.split(S.SISA(cfg, cfg.options_for("sisa"), rngs=nnx.Rngs(params=0)))

  def forward(params, x):
    return nnx.merge(graphdef, params)(x, positions_BT=None)[0]

  x = jax.ShapeDtypeStruct((2, 256, 64), jnp.float32)
  res = jax.eval_shape(lambda p, x: jax.tree.leaves(jax.vjp(forward, p, x)[1]), params, x)
  blocks = [r.shape for r in res if jnp.issubdtype(r.dtype, jnp.floating)
            and r.shape[-2:] == (128, 128)]
  assert (blocks == []) == remat_chunked, blocks


@pytest.mark.slow
@pytest.mark.parametrize("mixer,program", [("sliding_window", "train"), ("attention", "prefill")])
def test_long_steps_on_a_tpu_keep_memory_linear_in_t(mixer, program):
  """The tiny models at T 32768 on a TPU v5e-4 slice (compile-only): sliding_window's train
  step (splash's window band) and the Transformer's prefill (a fresh cache's attention on
  splash, `cache._fresh_attention`) need under 2 GiB of temporaries per chip, and a Mosaic
  call. With the XLA dense cores they were refused for memory (65.23 and 17.10 GiB)."""
  if not targets.available("v5e-4"):
    pytest.skip("the TPU compile target needs libtpu (pip install -e '.[targets]')")
  from attn_jax.train import aot
  from tests.test_hlo_loops import _config
  r = aot.compile_for_target(_config(mixer, 32768), "v5e-4",
                             programs=("train",) if program == "train" else ("decode",),
                             search_fit=False)
  p = next(p for p in r.programs if p.name == program)
  assert p.loops is not None, f"{mixer} {program} refused: {p.needed / 2 ** 30:.2f} GiB"
  assert p.memory.temp_size_in_bytes < 2 * 2 ** 30, p.memory.temp_size_in_bytes / 2 ** 30
  assert p.kernels.get("Mosaic (Pallas TPU)"), p.kernels
