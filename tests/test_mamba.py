"""Mamba-2, Mamba-3 and head-fusion mixers: decoding state == full forward, chunked prefill,
padding, causality, constant state size, FLOPs, and parameter counts of the configs."""

import functools
import importlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.model import count_params
from attn_jax.model_config import ModelConfig, validate_model
from attn_jax.ssm import ssd
from attn_jax.ssm.hybrid_heads import HybridHeads
from attn_jax.ssm.mamba2 import Mamba2
from attn_jax.ssm.mamba3 import Mamba3

TOL = dict(atol=1e-5, rtol=1e-5)   # fp32, fixed once

CFG = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64, vocab_size=64,
                  dtype="float32", param_dtype="float32", init_std=0.2, attention_impl="einsum")
MIXERS = {
    "mamba2": (Mamba2, Mamba2.Options(d_state=8, head_dim=8, n_groups=2, chunk_size=4)),
    "mamba3": (Mamba3, Mamba3.Options(d_state=8, head_dim=8, n_groups=2, chunk_size=4,
                                      dt_min=0.05, dt_max=0.5)),
    "hybrid_heads": (HybridHeads, HybridHeads.Options(d_state=8, head_dim=8, chunk_size=4)),
}
CAPACITY = 16


@functools.cache
def _build(name):
  cls, opts = MIXERS[name]
  return cls, opts, cls(CFG, opts, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module", params=sorted(MIXERS))
def mixer(request):
  return _build(request.param)


def _x(B, T, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, CFG.d_model))


def _pos(B, T, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))


def _state(cls, opts, B):
  return cls.init_state(CFG, opts, B, CAPACITY, jnp.float32)


@nnx.jit
def run(m, x, positions, state=None):
  """The mixer call, jitted (eager NNX dispatch is slow on CPU): -> (y, state)."""
  return m(x, positions_BT=positions, state=state)[:2]


def test_decode_steps_equal_full_forward(mixer):
  cls, opts, m = mixer
  B, T = 2, 11
  x, pos = _x(B, T), _pos(B, T)
  y_full, st_none = run(m, x, pos)
  assert st_none is None
  st, ys = _state(cls, opts, B), []
  for t in range(T):
    y, st = run(m, x[:, t:t + 1], pos[:, t:t + 1], st)
    ys.append(y)
  chex.assert_trees_all_close(jnp.concatenate(ys, 1), y_full, **TOL)
  assert float(jnp.abs(y_full).mean()) > 1e-2          # outputs are not trivially ~0


def test_chunked_prefill_then_steps_equal_full_forward(mixer):
  cls, opts, m = mixer
  B, T, P = 2, 11, 5                                   # prefill 5 = 1 chunk of 4 + 1
  x, pos = _x(B, T, seed=2), _pos(B, T)
  y_full = run(m, x, pos)[0]
  y_pre, st = run(m, x[:, :P], pos[:, :P], _state(cls, opts, B))
  ys = [y_pre]
  y_mid, st = run(m, x[:, P:2 * P], pos[:, P:2 * P], st)           # a second prefill chunk
  ys.append(y_mid)
  for t in range(2 * P, T):
    y, st = run(m, x[:, t:t + 1], pos[:, t:t + 1], st)
    ys.append(y)
  chex.assert_trees_all_close(jnp.concatenate(ys, 1), y_full, **TOL)


def test_padding_leaves_state_unchanged(mixer):
  cls, opts, m = mixer
  T, n = 11, 5
  x = _x(2, T, seed=3)
  pos = _pos(2, T).at[1, n:].set(-1)                   # row 1: 5 tokens, then right padding
  two = lambda z: jnp.concatenate([z, z], 0)           # "alone" runs use row 1 twice (B = 2
  # keeps the shapes of the other tests, so nothing new is compiled)
  # Prefill with padding: row 1's outputs and state equal those of its 5 valid tokens alone,
  # and the full forward (no state) gives the same valid outputs.
  y_full = run(m, x, pos)[0]
  y_pre, st = run(m, x, pos, _state(cls, opts, 2))
  y_solo, st_solo = run(m, two(x[1:, :n]), _pos(2, n), _state(cls, opts, 2))
  chex.assert_trees_all_close(y_pre[1, :n], y_solo[0], **TOL)
  chex.assert_trees_all_close(y_full[1, :n], y_solo[0], **TOL)
  row = lambda tree, i: jax.tree.map(lambda s: s[i], tree)
  chex.assert_trees_all_close(row(st, 1), row(st_solo, 0), **TOL)
  # A step in which row 1 is padding leaves its state exactly as it was; the next valid step
  # continues as if the padding never happened.
  x_step = _x(2, 2, seed=4)
  _, st2 = run(m, x_step[:, :1], jnp.array([[T], [-1]], jnp.int32), st)
  chex.assert_trees_all_equal(row(st2, 1), row(st, 1))
  y_next, _ = run(m, x_step[:, 1:], jnp.array([[T + 1], [n]], jnp.int32), st2)
  y_next_solo, _ = run(m, two(x_step[1:, 1:]), _pos(2, 1, n), st_solo)
  chex.assert_trees_all_close(y_next[1], y_next_solo[0], **TOL)


# XLA:CPU (jaxlib 0.10.2) hands reductions and elementwise fusions to YNNPACK by default; on
# this AMD EPYC (AVX2, no AVX-512) executing the Mamba-2 mixer's jitted jacrev (the backward
# pass vmapped over its 9 * 32 cotangents: 7-D reduces such as f32[1,3,2,4,288,4,4] -> sum over
# dim 3) dies with SIGSEGV inside YNNPACK's transpose (slinky::fuse_contiguous_dims called from
# ynn make_transpose_impl, in a YnnFusionThunk). Only the YNN reduce / eltwise fusion kinds
# crash (`xla_cpu_experimental_ynn_fusion_type` = LIBRARY_FUSION_TYPE_REDUCE or ..._ELTWISE
# crash, ..._DOT alone runs), so this test's program keeps YNNPACK for dots only: a backend
# library choice, the maths and the assertions are unchanged.
_NO_YNN_TRANSPOSES = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def test_causal_by_gradient(mixer):
  _, _, m = mixer
  T = 9
  x = _x(1, T, seed=5)
  jacrev = jax.jit(jax.jacrev(lambda x: m(x, positions_BT=_pos(1, T))[0][0]))
  jac = jacrev.lower(x).compile(_NO_YNN_TRANSPOSES)(x)[:, :, 0]
  # jac: [T, D, T, D]
  norms = np.asarray(jnp.sqrt(jnp.sum(jac ** 2, axis=(1, 3))))                  # [t, s]
  future = np.triu(np.ones((T, T), bool), 1)
  assert np.all(norms[future] == 0.0)
  assert np.all(norms[~future] > 0.0)


# Packed rows (chunk_size 4): documents of length 1 (twice), one crossing a chunk boundary,
# one starting exactly at one (token 8) and crossing two more.
DOCS = (1, 6, 1, 9, 4)


def _packed(docs=DOCS):
  """(positions, segment ids) [1, T] of one packed row; positions of the documents alone as
  rows of the same length, right-padded (position -1: the padding changes no state, test
  above), and a last row of one plain stream 0..T-1."""
  T = sum(docs)
  pos = np.concatenate([np.arange(n) for n in docs])
  seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(docs)])
  alone = np.full((len(docs) + 1, T), -1)
  for i, n in enumerate(docs + (T,)):
    alone[i, :n] = np.arange(n)
  return tuple(jnp.asarray(z[None] if z.ndim == 1 else z, jnp.int32) for z in (pos, seg, alone))


@nnx.jit
def _packed_forward_and_grads(m, x, positions, segments, w):
  """(y, gradients of sum(y * w) w.r.t. the mixer's parameters) of a packed row."""
  def loss(m):
    y = m(x, positions_BT=positions, segment_ids_BT=segments)[0]
    return jnp.sum(y * w), y
  (_, y), g = nnx.value_and_grad(loss, has_aux=True)(m)
  return y, g


def test_packed_row_equals_each_document_alone(mixer):
  """Conv window, state (and for hybrid_heads the attention heads) restart per document: each
  document's outputs equal those of the document alone; parameter gradients are finite."""
  _, _, m = mixer
  pos, seg, alone_pos = _packed()
  T = pos.shape[1]
  x = _x(1, T, seed=8)
  y, grads = _packed_forward_and_grads(m, x, pos, seg, _x(1, T, seed=9))
  starts = np.cumsum((0,) + DOCS)
  x_alone = jnp.stack([jnp.roll(x[0], -int(s), axis=0) for s in starts])   # doc first; plain
  y_alone = run(m, x_alone, alone_pos)[0]
  for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
    chex.assert_trees_all_close(y[0, s:e], y_alone[i, :e - s], **TOL)
  chex.assert_tree_all_finite(grads)
  y_plain = y_alone[-1]                                # one stream: the documents mix
  assert float(jnp.max(jnp.abs(y_plain[1:] - y[0, 1:]))) > 1e-3


def test_packed_rows_refuse_a_decoding_state(mixer):
  cls, opts, m = mixer
  pos, seg, _ = _packed()
  with pytest.raises(ValueError, match="segment_ids_BT"):
    m(_x(1, pos.shape[1]), positions_BT=pos, segment_ids_BT=seg, state=_state(cls, opts, 1))


def _nbytes(tree):
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["mamba2", "mamba3"])
def test_ssm_state_size_is_constant_in_length(name):
  cls, opts = MIXERS[name]
  shapes = lambda cap: jax.eval_shape(lambda: cls.init_state(CFG, opts, 2, cap, jnp.bfloat16))
  small, huge = shapes(16), shapes(1 << 20)
  chex.assert_trees_all_equal_shapes_and_dtypes(small, huge)
  assert _nbytes(small) == _nbytes(huge)
  # Generate: the state after many steps has the initial shapes (measured, not declared).
  m = _build(name)[2]
  st0 = cls.init_state(CFG, opts, 2, 16, jnp.float32)
  st, x = st0, _x(2, 40, seed=6)
  for t in range(40):
    st = run(m, x[:, t:t + 1], _pos(2, 1, t), st)[1]
  chex.assert_trees_all_equal_shapes_and_dtypes(st, st0)
  assert _nbytes(st) == _nbytes(st0)


def test_hybrid_state_is_kv_cache_plus_constant_ssm_state():
  cls, opts = MIXERS["hybrid_heads"]
  kv16, ssm16 = cls.init_state(CFG, opts, 2, 16, jnp.float32)
  kv64, ssm64 = cls.init_state(CFG, opts, 2, 64, jnp.float32)
  chex.assert_trees_all_equal_shapes_and_dtypes(ssm16, ssm64)
  slots = lambda kv: {"k": kv.k, "v": kv.v, "pos": kv.pos}   # "ptr" is per row
  assert _nbytes(slots(kv64)) == 4 * _nbytes(slots(kv16))
  assert np.all(np.asarray(kv16.pos) == -1)


def test_mamba3_chunked_equals_recurrent_reference():
  cls, opts, m = _build("mamba3")
  B, T = 2, 20                                         # two calls of 10 = 2 chunks of 4 + 2
  x, pos = _x(B, T, seed=7), _pos(B, T)
  ref = nnx.jit(lambda m, x, p, s: m.reference(x, positions_BT=p, state=s))
  st = _state(cls, opts, B)
  y1, st1 = run(m, x[:, :10], pos[:, :10], st)
  r1, rs1 = ref(m, x[:, :10], pos[:, :10], st)
  y2, st2 = run(m, x[:, 10:], pos[:, 10:], st1)
  r2, rs2 = ref(m, x[:, 10:], pos[:, 10:], rs1)
  chex.assert_trees_all_close((y1, y2, st2), (r1, r2, rs2), **TOL)


def test_mamba3_packed_chunked_equals_recurrent_reference():
  """With documents, the chunked form (segmented angles, -inf decay, zeroed previous token)
  equals the token-by-token recurrence with explicit resets."""
  _, _, m = _build("mamba3")
  pos, seg, _ = _packed()
  x = _x(1, pos.shape[1], seed=10)
  y = nnx.jit(lambda m, x: m(x, positions_BT=pos, segment_ids_BT=seg)[0])(m, x)
  ref = nnx.jit(lambda m, x: m.reference(x, positions_BT=pos, segment_ids_BT=seg)[0])(m, x)
  chex.assert_trees_all_close(y, ref, **TOL)


def test_flops_per_token():
  m2, o2 = MIXERS["mamba2"]
  m3, o3 = MIXERS["mamba3"]
  hh, oh = MIXERS["hybrid_heads"]
  for cls, o in ((m2, o2), (m3, o3)):   # constant in T but for the chunk-state passing
    H = o.heads(CFG)
    rest = lambda T: (cls.flops_per_token(CFG, o, T)
                      - ssd.passing_flops_per_token(H * o.head_dim * o.d_state, o.chunk_size, T))
    assert rest(4096) == pytest.approx(rest(64), rel=1e-12) and rest(64) > 0
  # Mamba-3's scores are per head (G = H), so it does more than Mamba-2 with the same sizes.
  assert m3.flops_per_token(CFG, o3, 64) > m2.flops_per_token(CFG, o2, 64)
  attn = 4.0 * CFG.n_heads * CFG.head_dim * (2048 + 1) / 2
  assert hh.flops_per_token(CFG, oh, 2048) == attn + m2.flops_per_token(CFG, oh.mamba2(), 2048)


def _validate(name, opts):
  """The model's validation (`config.validate_model`, which `build_model` runs), for a
  one-mixer model with these options."""
  validate_model(CFG.replace(mixer=name, options=((name, opts),)))


def test_options_validation_names_the_field():
  with pytest.raises(ValueError, match=r"config\.model\.mamba2\.expand"):
    _validate("mamba2", Mamba2.Options(head_dim=48))
  with pytest.raises(ValueError, match=r"config\.model\.mamba3\.n_groups"):
    _validate("mamba3", Mamba3.Options(head_dim=8, n_groups=3))
  with pytest.raises(ValueError, match=r"config\.model\.hybrid_heads\.d_state"):
    _validate("hybrid_heads", HybridHeads.Options(d_state=0, head_dim=8))
  with pytest.raises(ValueError, match=r"config\.model\.mamba2\.d_conv"):
    _validate("mamba2", Mamba2.Options(d_conv=True))         # a bool is not an integer
  for name, cls in (("mamba2", Mamba2), ("mamba3", Mamba3), ("hybrid_heads", HybridHeads)):
    _validate(name, cls.Options(head_dim=8))


# ----------------------------------------------------------------------- parameter counts

TRANSFORMER = {"50m": 50_914_304, "152m": 151_878_144, "369m": 369_252_352}
MIXER_CLASSES = {"mamba2": Mamba2, "mamba3": Mamba3, "hybrid_heads": HybridHeads}


def _model_params(c) -> int:
  """The decoder's own count (pattern-aware, abstract shapes: nothing allocated)."""
  return count_params(c.model)["total"]


@pytest.mark.parametrize("name", [f"{k}_{s}" for k in ("mamba2", "mamba3") for s in TRANSFORMER]
                         + ["hybrid_block_152m", "hybrid_head_152m"])
def test_config_params_match_transformer_within_1pct(name):
  c = importlib.import_module(f"configs.{name}").get_config()
  n = _model_params(c)
  target = TRANSFORMER[name.rsplit("_", 1)[1]]
  assert abs(n / target - 1) < 0.01, (name, n, target)
  layers = {"50m": 14, "152m": (31 if "mamba2" in name else 30), "369m": (49 if "mamba2" in name
                                                                         else 48)}
  if not name.startswith("hybrid"):
    assert c.model.n_layers == layers[name.rsplit("_", 1)[1]]      # docs/papers.md §1.4


@pytest.mark.parametrize("name,opts", [
    ("mamba2", {}), ("mamba3", {}), ("mamba3", {"mimo_rank": 2}), ("hybrid_heads", {})])
def test_a_bf16_mixer_runs_its_ssd_matmuls_in_bf16(monkeypatch, name, opts):
  """In a bf16 model the chunked SSD's matmuls take bf16 operands (fp32 accumulation), as
  mamba_ssm's kernels feed their tensor-core dots: fp32 operands make them fp32 matmuls on a
  GPU. Every matmul the chunked form asks for (`ssd.einsum_in`) gets the model's dtype."""
  import dataclasses
  asked = []
  real = ssd.einsum_in
  monkeypatch.setattr(ssd, "einsum_in", lambda dtype, *a: asked.append(dtype) or real(dtype, *a))
  cls, base, _ = _build(name)
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  m = cls(cfg, dataclasses.replace(base, **opts), rngs=nnx.Rngs(0))
  jax.make_jaxpr(lambda x: m(x, positions_BT=_pos(2, 12))[0])(_x(2, 12).astype(jnp.bfloat16))
  assert asked and all(jnp.dtype(d) == jnp.bfloat16 for d in asked), asked
