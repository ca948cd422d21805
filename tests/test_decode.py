"""decode.py: cached decoding equals the full forward; generate (greedy, top-k, EOS) without retracing."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import decode
from attn_jax.model import abstract_model
from attn_jax.model_config import ModelConfig, validate_model

TOL = 1e-5  # fp32, fixed once
VOCAB = 97
KV_HEADS = {"mha": 0, "gqa": 2}  # n_kv_heads (0 = n_heads = 4)
# One prompt shape and length for all generate calls, so the tests share compiled programs.
B, T, N_NEW = 2, 5, 8
L = T + N_NEW


def _tiny_config(n_kv_heads=0) -> ModelConfig:
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                    d_ff=64, max_seq_len=64, dtype="float32", param_dtype="float32")
  validate_model(cfg)
  return cfg


def _numpy_init_model(cfg: ModelConfig, seed: int = 0, std: float = 0.2):
  """The Decoder with parameters drawn by numpy from its abstract shapes.

  Decoding equivalence does not depend on the initialiser, and compiling threefry for every
  parameter shape costs seconds per shape on CPU; norm scales stay near 1.
  """
  graphdef, state = nnx.split(abstract_model(cfg))
  rng = np.random.default_rng(seed)

  def fill(path, a):
    noise = rng.standard_normal(a.shape) * std
    base = 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0  # RMSNorm scales
    return jnp.asarray(base + noise, a.dtype)

  state = jax.tree_util.tree_map_with_path(fill, state)
  return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=None)
def _model(kind: str):
  return _numpy_init_model(_tiny_config(KV_HEADS[kind]))


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def _full_logits(model, tokens_BT):
  graphdef, state = nnx.split(model)
  return _full_forward(graphdef, state, tokens_BT)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(graphdef, state, tokens_BT):
  return nnx.merge(graphdef, state)(tokens_BT)


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", list(KV_HEADS))
def test_token_by_token_matches_full_forward(kind):
  """One jitted decode step (fixed-shape state) reproduces every full-forward logit, and is
  traced once however long the text grows."""
  model = _model(kind)
  tokens = _tokens(0, (B, L))
  full_BLV = _full_logits(model, tokens)
  graphdef, state = nnx.split(model)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, token_B, dstate, pos_B):
    return decode.decode_step(nnx.merge(graphdef, state), token_B, pos_B, dstate)

  dstate = model.init_state(B, L)
  for i in range(L):
    logits_BV, dstate = step(state, tokens[:, i], dstate, jnp.full((B,), i, jnp.int32))
    _close(logits_BV, full_BLV[:, i])


@pytest.mark.parametrize("kind", list(KV_HEADS))
def test_prefill_then_steps_matches_full_forward(kind):
  """prefill(prompt) + decode steps == full forward, also with a state longer than needed."""
  model = _model(kind)
  P = L - 3
  tokens = _tokens(1, (B, L))
  full_BLV = _full_logits(model, tokens)
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    model = nnx.merge(graphdef, state)
    last_BV, dstate = decode.prefill(model, tokens[:, :P], capacity=L + 7)  # slack slots
    logits = [last_BV]
    for i in range(P, L):  # unrolled: positions P .. L-1
      logits_BV, dstate = decode.decode_step(model, tokens[:, i], jnp.full((B,), i, jnp.int32),
                                             dstate)
      logits.append(logits_BV)
    return jnp.stack(logits, axis=1)

  _close(run(state, tokens), full_BLV[:, P - 1:])


def test_prefill_rejects_a_prompt_longer_than_the_state():
  with pytest.raises(ValueError, match="exceeds what the decoding state holds"):
    decode.prefill(_model("mha"), _tokens(2, (1, 8)), capacity=4)


def _greedy_by_hand(model, prompt_BT, n_new):
  """Argmax decoding with full forwards (no cache): the reference for `generate`.

  Runs at one fixed length (padded with zeros) so it compiles once; the logits at position t
  do not depend on the padding after t because the model is causal (tests/test_model.py).
  """
  T = prompt_BT.shape[1]
  seq = np.zeros((prompt_BT.shape[0], T + n_new), np.int32)
  seq[:, :T] = np.asarray(prompt_BT)
  for t in range(T, T + n_new):
    logits_BLV = _full_logits(model, jnp.asarray(seq))
    seq[:, t] = np.asarray(jnp.argmax(logits_BLV[:, t - 1], axis=-1))
  return seq


@pytest.mark.parametrize("kind", list(KV_HEADS))
def test_generate_greedy_is_deterministic_and_matches_full_forward_argmax(kind):
  model = _model(kind)
  prompt = _tokens(3, (B, T))
  out = decode.generate(model, prompt, max_new_tokens=N_NEW)
  assert out.shape == (B, L) and out.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(out[:, :T]), np.asarray(prompt))
  np.testing.assert_array_equal(np.asarray(decode.generate(model, prompt, max_new_tokens=N_NEW)),
                                np.asarray(out))
  np.testing.assert_array_equal(np.asarray(out), _greedy_by_hand(model, prompt, N_NEW))
  # The continuation is not degenerate (the test would be weak if every step repeated a token).
  assert len(np.unique(np.asarray(out[:, T:]))) > 3


def test_generate_does_not_retrace(monkeypatch):
  """One trace of the decode step per generation shape, however many tokens are produced;
  new values (prompt, EOS id, temperature, key, lengths) never retrace."""
  model = _model("mha")
  prompt = _tokens(4, (B, T + 3))  # a shape no other test uses, so the first call traces
  n_new = 16
  chex.clear_trace_counter()
  monkeypatch.setattr(decode, "decode_step", chex.assert_max_traces(decode.decode_step, n=1))
  decode.generate(model, prompt, max_new_tokens=n_new)
  decode.generate(model, _tokens(5, (B, T + 3)), max_new_tokens=n_new)
  decode.generate(model, prompt, max_new_tokens=n_new, eos_id=3)
  decode.generate(model, prompt, max_new_tokens=n_new, lengths=[T + 3, 2])
  # Sampling is another program (greedy is static): its step may trace once more, no more.
  chex.clear_trace_counter()
  monkeypatch.setattr(decode, "decode_step", chex.assert_max_traces(
      decode.decode_step.__wrapped__, n=1))
  decode.generate(model, prompt, max_new_tokens=n_new, temperature=0.7, rng=jax.random.key(0))
  decode.generate(model, prompt, max_new_tokens=n_new, temperature=1.3, rng=jax.random.key(1))


def test_top_k_1_sampling_equals_greedy():
  model = _model("mha")
  prompt = _tokens(6, (B, T))
  greedy = decode.generate(model, prompt, max_new_tokens=N_NEW)
  for seed, temperature in ((0, 0.5), (1, 2.0)):
    sampled = decode.generate(model, prompt, max_new_tokens=N_NEW, temperature=temperature,
                              top_k=1, rng=jax.random.key(seed))
    np.testing.assert_array_equal(np.asarray(sampled), np.asarray(greedy))


def test_sampling_depends_only_on_the_key():
  model = _model("mha")
  prompt = _tokens(7, (B, T))
  kw = dict(max_new_tokens=N_NEW, temperature=1.0)
  a = decode.generate(model, prompt, rng=jax.random.key(0), **kw)
  b = decode.generate(model, prompt, rng=jax.random.key(0), **kw)
  c = decode.generate(model, prompt, rng=jax.random.key(1), **kw)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(c))
  assert int(a.min()) >= 0 and int(a.max()) < VOCAB


def test_sample_logits_top_k_keeps_only_the_k_largest():
  logits_BV = jnp.asarray(np.random.default_rng(8).standard_normal((1, VOCAB)), jnp.float32)
  top3 = set(np.argsort(-np.asarray(logits_BV[0]))[:3].tolist())
  keys = jax.random.split(jax.random.key(0), 400)
  draws = jax.vmap(lambda k: decode.sample_logits(logits_BV, k, temperature=5.0, top_k=3))(keys)
  assert set(np.asarray(draws).ravel().tolist()) == top3  # all 3, nothing else
  greedy = decode.sample_logits(logits_BV, None, temperature=0.0)
  assert int(greedy[0]) == int(np.argmax(np.asarray(logits_BV[0])))


def test_generate_eos_pads_finished_sequences():
  """After EOS a sequence emits only pad (= EOS by default); the others are untouched."""
  model = _model("mha")
  prompt = _tokens(9, (B, T))
  kw = dict(max_new_tokens=N_NEW, temperature=1.0, rng=jax.random.key(3))
  free = np.asarray(decode.generate(model, prompt, **kw))
  eos = int(free[0, T + 3])  # the 4th new token of row 0
  first = [next((t for t in range(T, L) if free[b, t] == eos), None) for b in range(B)]
  for pad_id in (None, VOCAB):  # default (= EOS), and an id outside the vocabulary
    out = np.asarray(decode.generate(model, prompt, eos_id=eos, pad_id=pad_id, **kw))
    for b in range(B):
      stop = first[b]
      if stop is None:  # never emitted EOS: identical to the run without eos_id
        np.testing.assert_array_equal(out[b], free[b])
        continue
      np.testing.assert_array_equal(out[b, :stop + 1], free[b, :stop + 1])
      assert np.all(out[b, stop + 1:] == (eos if pad_id is None else pad_id))


def test_generate_cache_len():
  model = _model("mha")
  prompt = _tokens(10, (B, T))
  ref = decode.generate(model, prompt, max_new_tokens=N_NEW)
  # The minimum (the last token is never fed back), and slack: same tokens.
  out = decode.generate(model, prompt, max_new_tokens=N_NEW, cache_len=L - 1)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  with pytest.raises(ValueError, match=f"cache_len={L - 2} is too small"):
    decode.generate(model, prompt, max_new_tokens=N_NEW, cache_len=L - 2)


def test_generate_rejects_bad_arguments():
  model = _model("mha")
  prompt = _tokens(11, (B, T))
  with pytest.raises(ValueError, match="needs an `rng` key"):
    decode.generate(model, prompt, max_new_tokens=4, temperature=1.0)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    decode.generate(model, prompt, max_new_tokens=4, temperature=-1.0, rng=jax.random.key(0))
  with pytest.raises(ValueError, match="max_new_tokens >= 1"):
    decode.generate(model, prompt, max_new_tokens=0)
  with pytest.raises(ValueError, match=r"\[batch, length\]"):
    decode.generate(model, prompt[0], max_new_tokens=4)
  with pytest.raises(ValueError, match="eos_id must be a token id"):
    decode.generate(model, prompt, max_new_tokens=4, eos_id=-1)
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 5\]"):
    decode.generate(model, prompt, max_new_tokens=4, lengths=[0, 5])
  with pytest.raises(ValueError, match=r"lengths must have shape \(2,\)"):
    decode.generate(model, prompt, max_new_tokens=4, lengths=[5])


def _window_model():
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                    max_seq_len=64, dtype="float32", param_dtype="float32",
                    pattern=("sliding_window", "attention"))
  cfg = cfg.with_options("sliding_window", window=2)
  validate_model(cfg)
  return _numpy_init_model(cfg)


def test_chunked_prefill_of_ragged_prompts_matches_full_forward():
  """A window-2 ring takes 2 tokens per stateful call: an 11-token prompt is prefilled as a
  first chunk, a scan over 4 more and a remainder of 1; rows of lengths 11 and 6 get the full
  forward's logits at their own last token."""
  model = _window_model()
  tokens = _tokens(5, (2, 11))
  lengths = jnp.asarray([11, 6], jnp.int32)
  last_BV, _ = jax.jit(lambda t, n: decode.prefill(model, t, n, capacity=16))(tokens, lengths)
  _close(last_BV[0], _full_logits(model, tokens)[0, 10])
  _close(last_BV[1], _full_logits(model, tokens[1:, :6])[0, 5])


def test_prefill_program_does_not_grow_with_the_prompt():
  """The traced prefill has as many equations for a 64-token prompt as for a 16-token one
  (whole chunks run in one scan): compile time and memory stay flat in the prompt length."""
  model = _window_model()
  size = lambda T: len(jax.make_jaxpr(
      lambda t: decode.prefill(model, t, capacity=T))(jnp.zeros((2, T), jnp.int32)).eqns)
  assert size(16) == size(64)


def test_a_sinkhorn_prefill_is_one_full_forward_without_a_loop():
  """Sinkhorn takes 4 tokens per stateful call (its block) but its first call into a fresh
  state runs the full forward (`max_fresh_chunk` None): a ragged 11-token prompt's prefill has no
  scan or while loop and its rows get the full forward's logits at their own last token."""
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                    max_seq_len=64, dtype="float32", param_dtype="float32", pattern=("sinkhorn",))
  cfg = cfg.with_options("sinkhorn", block_size=4, sortnet_width=16, sort_dim=8)
  validate_model(cfg)
  model = _numpy_init_model(cfg)
  tokens = _tokens(6, (2, 11))
  lengths = jnp.asarray([11, 6], jnp.int32)
  prefill = lambda t, n: decode.prefill(model, t, n, capacity=16)
  text = str(jax.make_jaxpr(prefill)(tokens, lengths))
  assert "scan" not in text and "while" not in text
  last_BV, _ = jax.jit(prefill)(tokens, lengths)
  _close(last_BV[0], _full_logits(model, tokens)[0, 10])
  _close(last_BV[1], _full_logits(model, tokens[1:, :6])[0, 5])


def test_the_decoding_copy_holds_bf16_weights_and_gives_identical_steps():
  """`for_decoding` of a bf16 model on fp32 parameters stores every Linear kernel and the
  embedding in bf16 (norms stay fp32; the original is untouched), q/k/v and gate/up fused
  into one kernel each, and its prefill and steps equal the original's bit for bit: it makes
  the same casts, once, and the same dot products."""
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                    max_seq_len=64, dtype="bfloat16", param_dtype="float32")
  validate_model(cfg)
  model = _numpy_init_model(cfg)
  copy = model.for_decoding()
  dtypes = {"/".join(map(str, p)): v[...].dtype for p, v in nnx.to_flat_state(nnx.state(copy))}
  kernels = sorted(k.split("/", 3)[-1] for k in dtypes if k.endswith(("kernel", "gate_up")))
  assert kernels == ["mixer/proj/o/kernel", "mixer/proj/qkv_kernel", "mlp/down/kernel",
                     "mlp/gate_up"], kernels   # stacked over the 2 layers
  assert all(dtypes[k] == jnp.bfloat16 for k in dtypes if k.endswith(("kernel", "gate_up")))
  assert dtypes["blocks/layers/0/mixer/proj/qkv_kernel"] == jnp.bfloat16
  assert dtypes["embed"] == jnp.bfloat16 and dtypes["final_norm/scale"] == jnp.float32
  assert model.embed[...].dtype == jnp.float32

  def run(m, tokens):
    last_BV, state = decode.prefill(m, tokens[:, :T], capacity=L)
    logits_BV, _ = decode.decode_step(m, tokens[:, T], jnp.full((B,), T, jnp.int32), state)
    return last_BV, logits_BV

  tokens = _tokens(7, (B, L))
  chex.assert_trees_all_equal(jax.jit(run)(copy, tokens), jax.jit(run)(model, tokens))
  # Idempotent: `generate` calls it on whatever model it is given, a decoding copy included.
  again = copy.for_decoding()
  chex.assert_trees_all_equal(nnx.state(again), nnx.state(copy))
  chex.assert_trees_all_equal(
      decode.generate(copy, tokens[:, :T], max_new_tokens=2),
      decode.generate(model, tokens[:, :T], max_new_tokens=2))


def test_layer_params_made_once_give_the_same_steps():
  """`Decoder.layer_params` (the stacked block parameters split per repeat, made once for a
  decoding loop) gives exactly the steps of the default per-call slices; a wrong count is a
  clear error."""
  model = _model("gqa")
  lp = model.layer_params()
  assert len(lp) == model.cfg.n_repeats == 2
  tok = _tokens(3, (B, T))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  step = nnx.jit(lambda m, t, p, s, lp: m.step(t, positions_BT=p, state=s, layer_params=lp))
  a, sa = step(model, tok, pos, model.init_state(B, L), None)
  b, sb = step(model, tok, pos, model.init_state(B, L), lp)
  chex.assert_trees_all_equal((a, sa), (b, sb))
  with pytest.raises(ValueError, match="layer_params holds one entry per repeat"):
    model.step(tok, positions_BT=pos, state=model.init_state(B, L), layer_params=lp[:1])
  with pytest.raises(ValueError, match="one entry per layer"):
    model.step(tok, positions_BT=pos, state=model.init_state(B, L)[:1])


@pytest.mark.parametrize("policy", ["linear", "ring", "sinks_ring"])
def test_empty_cache_chunk_scores_only_its_own_keys(policy):
  """attend_cache on a cache with no valid slot takes the path that scores the chunk's own keys
  only (it never reads the empty slots); with every option it takes (a bias over
  [cache ; new], a widening's bias_new, a sink logit, padding, a window) it equals the path
  over all S + T columns (float64)."""
  from attn_jax.attention import cache as C
  pol = {"linear": C.Linear(), "ring": C.Ring(6), "sinks_ring": C.SinksRing(2, 6)}[policy]
  Bq, Tq, H, K, D, cap = 2, 5, 4, 2, 8, 16
  rng = np.random.default_rng(0)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float64)
  with jax.enable_x64():
    cache = C.init_cache(pol, Bq, cap, K, D, D, jnp.float64, kx_dim=3)
    S = cache.pos.shape[1]
    q, k, v = arr(Bq, Tq, H, D), arr(Bq, Tq, K, D), arr(Bq, Tq, K, D)
    pos = jnp.asarray([[0, 1, 2, 3, 4], [-1, 0, 1, 2, 3]], jnp.int32)   # row 1 left-padded
    kw = dict(scale=D ** -0.5, bias=arr(Bq, H, Tq, S + Tq), sink_logit_H=arr(H),
              widen=C.Widening(q=arr(Bq, Tq, H, 3), bias_new=arr(Bq, H, Tq, Tq)), window=4)
    # NaN in the empty slots' values: only a path that never reads them stays finite
    got = C.attend_cache(cache.replace(v=jnp.full_like(cache.v, jnp.nan)), q, k, v, pos, **kw)
    spans = [w for w in (pol.window, kw["window"]) if w is not None]
    want = C._attend(cache, q, k, v, pos, kw["scale"], None, kw["widen"], kw["bias"],
                     kw["sink_logit_H"], min(spans), cached=True)
    valid = np.asarray(pos >= 0)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=1e-12,
                               atol=1e-12)
    # one valid slot: the full path (the cached key is visible)
    written = cache.write(arr(Bq, 1, K, D), arr(Bq, 1, K, D), jnp.zeros((Bq, 1), jnp.int32))
    later = pos + 1
    got = C.attend_cache(written, q, k, v, later, **kw)
    want = C._attend(written, q, k, v, later, kw["scale"], None, kw["widen"], kw["bias"],
                     kw["sink_logit_H"], min(spans), cached=True)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("impl", ["blocked", "einsum", "splash"])
def test_a_fresh_linear_call_attends_on_the_kernels_rooms_core(impl, monkeypatch):
  """A prompt's first call into a fresh `Linear` cache (`KVCache.fresh`) goes to
  `entry.attend` with the mixer's core, and equals the dense path over all S + T columns of
  the empty cache (`_attend(cached=True)`) on every valid query, with padding (a left-padded
  row), a sink logit and a window: float64 for the XLA cores, float32 for splash (the
  interpreted kernel; T 128, its block). The cache it returns is the one `attend_cache`'s path
  writes."""
  from attn_jax.attention import cache as C
  from attn_jax.kernels import entry
  calls = []
  real = entry.attend
  monkeypatch.setattr(entry, "attend", lambda *a, **kw: calls.append(kw["impl"]) or real(*a, **kw))
  x64 = impl != "splash"
  dt = jnp.float64 if x64 else jnp.float32
  Bq, Tq, H, K, D, cap = 2, (9 if x64 else 128), 4, 2, 8, 160
  rng = np.random.default_rng(1)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
  with jax.enable_x64(x64):
    fresh = C.as_fresh(C.init_cache(C.Linear(), Bq, cap, K, D, D, dt))
    S = fresh.pos.shape[1]
    q, k, v = arr(Bq, Tq, H, D), arr(Bq, Tq, K, D), arr(Bq, Tq, K, D)
    pos = jnp.stack([jnp.arange(Tq), jnp.arange(Tq) - 3]).astype(jnp.int32)   # row 1: 3 pads
    pos = jnp.maximum(pos, -1)
    sink = arr(H)
    for window in (None, 5):
      calls.clear()
      got, cache = C.cached_attention(fresh, q, k, v, pos, theta=1e4, scale=D ** -0.5,
                                      sink_logit_H=sink, window=window, impl=impl)
      assert calls == [impl]
      qr, kr = C.rope(q, pos, 1e4), C.rope(k, pos, 1e4)   # Linear: keys at stream positions
      want = C._attend(fresh.replace(fresh=False), qr, kr, v, pos, D ** -0.5, None, None, None,
                       sink, window, cached=True)
      valid = np.asarray(pos >= 0)
      tol = 1e-12 if x64 else 2e-6
      np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=tol,
                                 atol=tol)
      dense = C.cached_attention(fresh.replace(fresh=False), q, k, v, pos, theta=1e4,
                                 scale=D ** -0.5, sink_logit_H=sink, window=window)[1]
      chex.assert_trees_all_equal(cache, dense.replace(fresh=False))
