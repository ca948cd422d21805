"""train/loss.py: blockwise cross-entropy equals the plain [B, T, V] form, values and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.train import hlo_loops
from attn_jax.train.loss import chunk_len, cross_entropy, cross_entropy_from_hidden

TOL = 1e-5  # fp32, fixed once (relative; sums of ~20 terms)
B, T, D, V = 2, 7, 8, 37


def _problem(seed=0):
  r = np.random.default_rng(seed)
  h = jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)
  w = jnp.asarray(r.standard_normal((D, V)), jnp.float32)
  y = r.integers(0, V, (B, T))
  logits = np.einsum("btd,dv->btv", np.asarray(h), np.asarray(w))
  y[:, ::2] = logits.argmax(-1)[:, ::2]  # some hits, so the accuracy count is exercised
  wt = jnp.asarray((r.random((B, T)) < 0.8) * r.uniform(0.5, 2.0, (B, T)), jnp.float32)
  return h, w, jnp.asarray(y, jnp.int32), wt


def _plain(h, w, y, wt):
  return cross_entropy(jnp.einsum("btd,dv->btv", h, w), y, wt)


# (chunk, vocab_chunk): uneven sequence chunks (T = 7 in 3s), one chunk, vocab blocks that do
# and do not divide V = 37.
SPLITS = [(3, None), (64, None), (2, 10), (5, 37), (7, 8)]


@pytest.mark.parametrize("mode", ["fused", "remat"])
def test_blockwise_equals_plain_values_and_gradients(mode):
  h, w, y, wt = _problem()

  def objective(f, h, w, wt):  # a loss that uses the NLL and the weight sum with cotangents
    nll, wsum, hits = f(h, w, y, wt)
    return 1.7 * nll + 0.3 * wsum + 0.0 * hits

  @jax.jit
  def run(h, w, wt):
    res = {"plain": (_plain(h, w, y, wt),
                     jax.grad(functools.partial(objective, _plain), argnums=(0, 1, 2))(h, w, wt))}
    for c, vc in SPLITS:
      f = functools.partial(cross_entropy_from_hidden, chunk=c, vocab_chunk=vc, mode=mode)
      res[f"{c}:{vc}"] = (f(h, w, y, wt),
                    jax.grad(functools.partial(objective, f), argnums=(0, 1, 2))(h, w, wt))
    return res

  res = run(h, w, wt)
  ref_vals, ref_grads = res.pop("plain")
  assert float(ref_vals[2]) > 0  # hits exist
  for key, (vals, grads) in res.items():
    chex.assert_trees_all_close(vals, ref_vals, rtol=TOL, atol=TOL, custom_message=str(key))
    chex.assert_trees_all_close(grads, ref_grads, rtol=TOL, atol=TOL, custom_message=str(key))


def test_bf16_hidden_states_and_jit_equals_no_jit():
  h, w, y, wt = _problem(1)
  f = functools.partial(cross_entropy_from_hidden, chunk=4, vocab_chunk=16)
  chex.assert_trees_all_close(jax.jit(f)(h, w, y, wt), f(h, w, y, wt), rtol=TOL, atol=TOL)
  hb = h.astype(jnp.bfloat16)
  plain = cross_entropy(jnp.einsum("btd,dv->btv", hb, w.astype(jnp.bfloat16),
                                   preferred_element_type=jnp.float32), y, wt)
  got = f(hb, w, y, wt)
  chex.assert_trees_all_close(got, plain, rtol=1e-4, atol=1e-4)
  g = jax.grad(lambda h: f(h, w, y, wt)[0])(hb)
  assert g.dtype == jnp.bfloat16 and g.shape == hb.shape
  chex.assert_tree_all_finite(g)


def test_no_full_logits_in_the_backward():
  """The compiled gradient keeps no [B*T, V]-sized fp32 buffer: temporaries of the blockwise
  form stay far below the plain form's at a vocabulary where [N, V] dominates."""
  n_tok, d, vocab = 512, 16, 8192
  h = jax.ShapeDtypeStruct((1, n_tok, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
  y = jax.ShapeDtypeStruct((1, n_tok), jnp.int32)
  wt = jax.ShapeDtypeStruct((1, n_tok), jnp.float32)

  def temp(f):
    g = jax.jit(jax.grad(lambda h, w, y, wt: f(h, w, y, wt)[0], argnums=(0, 1)))
    return g.lower(h, w, y, wt).compile().memory_analysis().temp_size_in_bytes

  full = n_tok * vocab * 4
  plain = temp(_plain)
  for mode in ("fused", "remat"):
    blockwise = temp(functools.partial(cross_entropy_from_hidden, chunk=64, mode=mode))
    assert plain >= full, plain
    assert blockwise < full / 2, (mode, blockwise, full)


@pytest.mark.parametrize("mode", ["fused", "remat"])
def test_chunks_grow_past_max_chunks_with_the_same_values_and_gradients(mode):
  """T = 7 with chunk 1 and max_chunks 3 runs 3 chunks of 3 positions (not 7 of 1): the values
  and gradients are the plain form's."""
  assert chunk_len(7, 1, 3) == 3 and chunk_len(7, 4, 3) == 4 and chunk_len(7, 64, 16) == 7
  h, w, y, wt = _problem(2)
  f = functools.partial(cross_entropy_from_hidden, chunk=1, max_chunks=3, mode=mode)
  grad = lambda f: jax.grad(lambda h, w: f(h, w, y, wt)[0], argnums=(0, 1))(h, w)
  chex.assert_trees_all_close(f(h, w, y, wt), _plain(h, w, y, wt), rtol=TOL, atol=TOL)
  chex.assert_trees_all_close(grad(f), grad(_plain), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mode", ["fused", "remat"])
def test_the_chunk_scan_runs_at_most_max_chunks_iterations_at_any_length(mode):
  """The compiled gradient's loops (train/hlo_loops.py, compiled for this CPU on abstract
  shapes): T / 128 iterations up to T 2048, then 16 at every length (32768 here)."""
  def iterations(T):
    h = jax.ShapeDtypeStruct((2, T, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    y = jax.ShapeDtypeStruct((2, T), jnp.int32)
    wt = jax.ShapeDtypeStruct((2, T), jnp.float32)
    f = lambda h, w, y, wt: cross_entropy_from_hidden(h, w, y, wt, mode=mode)[0]
    text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, w, y, wt).compile().as_text()
    r = hlo_loops.read(text)
    assert r.unknown_loops == 0
    return r.serial_iterations

  # one loop over the chunks (fused: its backward has none; remat: the gradient's only, the
  # forward's sums being unused)
  assert [iterations(T) for T in (512, 2048, 8192, 32768)] == [4, 16, 16, 16]


def test_rejects_bad_options():
  h, w, y, wt = _problem()
  with pytest.raises(ValueError, match="mode"):
    cross_entropy_from_hidden(h, w, y, wt, mode="dense")
  with pytest.raises(ValueError, match="chunk"):
    cross_entropy_from_hidden(h, w, y, wt, chunk=0)
  with pytest.raises(ValueError, match="max_chunks"):
    cross_entropy_from_hidden(h, w, y, wt, max_chunks=0)


def test_batch_sharded_hidden_states_give_the_same_loss_and_gradients():
  """Data parallel: h, targets and weights sharded over 8 devices on the batch axis (the scan
  runs over sequence chunks, so each chunk keeps the batch sharding) equal the unsharded run."""
  devices = np.array(jax.devices()[:8])
  if len(devices) < 8:
    pytest.skip("needs the 8 simulated CPU devices of conftest")
  r = np.random.default_rng(3)
  h = jnp.asarray(r.standard_normal((8, 6, D)), jnp.float32)
  w = jnp.asarray(r.standard_normal((D, V)), jnp.float32)
  y = jnp.asarray(r.integers(0, V, (8, 6)), jnp.int32)
  wt = jnp.ones((8, 6), jnp.float32)
  mesh = jax.sharding.Mesh(devices, ("data",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  f = jax.jit(jax.value_and_grad(
      lambda h, w: cross_entropy_from_hidden(h, w, y, wt, chunk=4)[0], argnums=(0, 1)))
  ref = f(h, w)
  got = f(jax.device_put(h, sh), w)
  chex.assert_trees_all_close(got, ref, rtol=TOL, atol=TOL)
  assert got[1][0].sharding.is_equivalent_to(sh, 3)  # dh keeps the batch sharding


@pytest.mark.parametrize("mode", ["fused", "remat"])
def test_hit_is_the_target_holding_the_row_maximum_on_every_split(mode):
  """The accuracy rule: a hit is a target whose logit is the row's maximum. Rows built with an
  exact tie for the maximum (the target second of the tied columns: a hit here, where argmax
  would take the first index), a unique maximum on the target (hit) and elsewhere (miss), on
  the full-vocabulary path and across vocab blocks (the tie split between two blocks)."""
  V_ = 12
  w = jnp.eye(V_, dtype=jnp.float32)            # D = V: the logits are the hidden states
  z = np.zeros((1, 4, V_), np.float32)
  z[0, 0, [3, 9]] = 5.0                         # tie at 3 and 9 (blocks of 6 split them)
  z[0, 1, 4] = 2.0                              # unique max at 4
  z[0, 2, 7] = 1.0                              # unique max at 7
  z[0, 3, 1] = -1.0                             # max 0 shared by 11 columns, target 1 below
  y = jnp.asarray([[9, 4, 2, 1]], jnp.int32)
  expect = np.array([1, 1, 0, 0], np.float32)   # per position
  for c, vc in ((4, None), (1, None), (4, 6), (2, 5)):
    for pos in range(4):
      wt = jnp.asarray(np.eye(4, dtype=np.float32)[pos][None])
      hits = cross_entropy_from_hidden(jnp.asarray(z), w, y, wt, chunk=c, vocab_chunk=vc,
                                       mode=mode)[2]
      assert float(hits) == expect[pos], (c, vc, pos)
