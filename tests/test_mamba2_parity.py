"""attn_jax/study/mamba2_minimal.py: the minimal plain-JAX Mamba-2 (sequential scan) is the same
function as attn_jax's Mamba-2 language model, in logits and in gradients, so any difference in
how they train comes from the initial parameters and the optimizer's groups; both train on
identical batches through the trainer's optax chain (attn_jax/study/mamba2_parity.py). Mamba-3: the chunked training form has
the gradient of its token-by-token recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.data import pipeline
from attn_jax.study import mamba2_minimal as mm
from attn_jax.study import mamba2_parity as mp
from configs import study_tiny

# Two layers (the stacked-parameter mapping), 4 heads of 4, two B/C groups.
TINY = {"d_model": 16, "expand": 1.0, "head_dim": 4, "d_state": 4, "d_ff": 32, "n_layers": 2}
TOL = {"rtol": 1e-4, "atol": 1e-6}      # fp32, chunked vs sequential accumulation order


def _config(seed=0, steps=4, groups=2, chunk=8):
  """chunk 8 over T = 31: four chunks (the last partial) and the scan between them (the study's
  chunk 32 >= T is the one-chunk case of the same code)."""
  c = mp.study_config(study_tiny.get_config(), seed, steps, batch=4, setting=TINY)
  c.model.mamba2.update(n_groups=groups, chunk_size=chunk)
  return c


def _loss(logits_fn, batch):
  return lambda p: mp.mean_nll(logits_fn)(p, batch)


@pytest.fixture(scope="module")
def setup():
  c = _config()
  ours_fn, ours_p, decay, mult = mp.build_ours(c)
  batch = {k: jnp.asarray(v[0]) for k, v in mp.train_batches(c, 1).items()}
  return c, ours_fn, ours_p, decay, batch


def test_minimal_model_is_the_same_function(setup):
  c, ours_fn, ours_p, _, batch = setup
  dims = mm.dims_of(c)
  mini_p = mm.to_minimal(ours_p, dims)
  got = jax.jit(lambda p, t: mm.minimal_logits(p, t, dims))(mini_p, batch["inputs"])
  want = jax.jit(ours_fn)(ours_p, batch["inputs"])
  np.testing.assert_allclose(got, want, **TOL)
  assert float(jnp.std(want)) > 1e-3             # not a trivially zero output


def test_minimal_gradient_equals_the_chunked_ssd_gradient(setup):
  c, ours_fn, ours_p, _, batch = setup
  dims = mm.dims_of(c)
  g_ours = mm.to_minimal(jax.jit(jax.grad(_loss(ours_fn, batch)))(ours_p), dims)
  g_mini = jax.jit(jax.grad(_loss(lambda p, t: mm.minimal_logits(p, t, dims), batch)))(
      mm.to_minimal(ours_p, dims))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_ours)[0],
                          jax.tree.leaves(g_mini)):
    scale = float(jnp.max(jnp.abs(b)))
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_decay_groups_and_parameter_count_agree(setup):
  """attn_jax's decay flags (from each parameter's kind), laid out as the minimal model's
  tensors, are the minimal model's "weights" groups; both count the same parameters."""
  c, _, ours_p, decay, _ = setup
  dims = mm.dims_of(c)
  flags_p = jax.tree.map(lambda d, p: jnp.full(p.shape, d, jnp.float32), decay, ours_p)
  mapped = mm.to_minimal(flags_p, dims)
  mini = mm.init_minimal(jax.random.key(0), dims, mm.RECIPES["torch"])
  mask = mm.minimal_decay_mask(mini, "weights")
  for (path, m), k in zip(jax.tree_util.tree_flatten_with_path(mapped)[0],
                          jax.tree.leaves(mask)):
    assert set(np.unique(np.asarray(m)).tolist()) == {float(k)}, jax.tree_util.keystr(path)
  assert sum(np.size(a) for a in jax.tree.leaves(mm.to_minimal(ours_p, dims))) == \
      sum(np.size(a) for a in jax.tree.leaves(mini))


def test_ours_recipe_draws_what_attn_jax_draws(setup):
  """RECIPES["ours"] describes attn_jax's init: each matrix's std within sampling error of
  attn_jax's own draw, the ones equal, the per-head / per-channel vectors inside the support of
  the stated law, for both draws."""
  c, _, ours_p, _, _ = setup
  dims = mm.dims_of(c)
  want = mm.to_minimal(ours_p, dims)
  got = mm.init_minimal(jax.random.key(1), dims, mm.RECIPES["ours"])
  sp_inv = lambda x: x + np.log(-np.expm1(-x))
  support = {"dt_bias": (sp_inv(1e-3), sp_inv(1e-1)), "a_log": (0.0, np.log(16.0)),
             "conv_b": (-0.5, 0.5)}               # d_conv 4: U(+-1/2)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    name = jax.tree_util.keystr(path)
    key = path[-1].key
    assert a.shape == b.shape, name
    if key in support:
      lo, hi = support[key]
      assert lo - 1e-5 <= min(a.min(), b.min()) and max(a.max(), b.max()) <= hi + 1e-5, name
    elif np.all(a == 1.0):                # norm scales, D
      np.testing.assert_array_equal(b, a, err_msg=name)
    else:                                 # matrices (>= 128 entries): the spread is the init
      assert a.size >= 128, name
      assert abs(b.std() / a.std() - 1) < 0.2, (name, a.std(), b.std())


def test_train_batches_are_the_trainers_batches():
  c = _config()
  got = mp.train_batches(c, 2)
  ds = pipeline.make_train_dataset(c.data, seed=int(c.seed))
  for i in range(2):
    for k in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(got[k][i], np.asarray(ds[i][k]), err_msg=f"{k}[{i}]")


def test_both_train_alike_from_the_same_start():
  """Two optimizer steps on identical batches: the same losses and held-out recall for
  attn_jax's model and the minimal model started from its mapped parameters."""
  c = _config(steps=2)
  batches = mp.train_batches(c, 2)
  evals = [{k: v[0] for k, v in batches.items()}]     # scored on the first batch
  runs = []
  for recipe in (None, "ours"):
    build = mp.build_ours(c) if recipe is None else mp.build_minimal(c, recipe)
    fn, p0, decay, mult = build
    p, rows = mp.train(c, fn, p0, decay, mult, batches, evals, every=2)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p),
                                                               jax.tree.leaves(p0)))
    assert moved > 1e-4                   # the optimizer did update
    runs.append((rows, p))
  (rows_o, p_o), (rows_m, p_m) = runs
  np.testing.assert_allclose(rows_o[0]["train_loss"], rows_m[0]["train_loss"], rtol=1e-5)
  assert rows_o[0]["recall"] == rows_m[0]["recall"]
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  jax.tree.map(chex_close, mm.to_minimal(p_o, mm.dims_of(c)), p_m)


def test_model_specs_resolve_or_name_the_problem():
  assert mp.resolve("ours") == ("ours", {})
  assert mp.resolve("ours/embed=normal1") == ("ours", {"embed": "normal1"})
  assert mp.resolve("minimal:ours") == "ours"
  r = mp.resolve("minimal:torch/embed=normal02+mlp=normal02_res")
  assert r == dict(mm.RECIPES["torch"], embed="normal02", mlp="normal02_res")
  for bad in ("theirs", "ours/mlp=fan_in", "minimal:nope", "minimal:torch/embed=huge", "minimal:torch/size=1"):
    with pytest.raises(ValueError, match="--models"):
      mp.resolve(bad)


def test_mamba3_chunked_gradient_equals_its_recurrence():
  """The gradient Mamba-3 trains with (chunked trapezoid, chunk 4 over 10 tokens) equals the
  gradient through its token-by-token recurrence (`Mamba3.reference`)."""
  from attn_jax.model_config import ModelConfig
  from attn_jax.registry import get_mixer
  cls = get_mixer("mamba3")
  cfg = ModelConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=64, dtype="float32",
                    param_dtype="float32")
  opts = cls.Options(d_state=8, head_dim=8, n_groups=2, chunk_size=4, dt_min=0.05, dt_max=0.5)
  m = cls(cfg, opts, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (2, 10, 32), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  w = jax.random.normal(jax.random.key(4), (2, 10, 32), jnp.float32)
  graphdef, params = nnx.split(m, nnx.Param)

  def loss(p, recurrent):
    mod = nnx.merge(graphdef, p)
    y = mod.reference(x, positions_BT=pos)[0] if recurrent else mod(x, positions_BT=pos)[0]
    return jnp.sum(y * w)

  g_chunk = jax.jit(jax.grad(lambda p: loss(p, False)))(params)
  g_rec = jax.jit(jax.grad(lambda p: loss(p, True)))(params)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(g_chunk))[0],
                          jax.tree.leaves(nnx.to_pure_dict(g_rec))):
    scale = float(jnp.max(jnp.abs(b)))
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale,
                               err_msg=jax.tree_util.keystr(path))
