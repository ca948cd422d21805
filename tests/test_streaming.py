"""Streaming caches (docs/papers.md §3.2): StreamingLLM equals dense attention while nothing is
evicted and equals its explicit definition (first sinks + last window, positions inside the
cache) once it evicts, for attention and SISA; fixed-size state, one compiled step; the
scoring loop, re-computation baseline and its errors."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import decode, kernel_choice, streaming
from attn_jax.attention import cache as cache_lib
from attn_jax.attention import sisa
from attn_jax.attention.projection import rope
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig
from attn_jax.streaming import StreamPolicy

TOL = 2e-5   # fp32, relative to the largest |value|; fixed once
V, D, H = 61, 32, 4
SHAKESPEARE = pathlib.Path(__file__).resolve().parent / "data" / "tinyshakespeare" / "input.txt"


def _close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
  assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"


def _model(mixer="attention", n_layers=2, **kw):
  cfg = ModelConfig(vocab_size=V, d_model=D, n_heads=H, d_ff=48, n_layers=n_layers,
                    max_seq_len=64, dtype="float32", mixer=mixer, init_std=0.3, **kw)
  if mixer == "sisa":
    cfg = cfg.with_options("sisa", d_state=4)
  return build_model(cfg, seed=0)


def _tokens(seed, n):
  return np.random.default_rng(seed).integers(0, V, n).astype(np.int32)


_step = nnx.jit(lambda m, t, p, s: m.step(t, positions_BT=p, state=s))


def _stream_logits(model, tokens, chunk, policy=None):
  """Feed [1, N] through model.step in chunks under a cache policy -> logits [N, V]."""
  state = model.init_state(1, len(tokens), policy)
  outs = []
  for a in range(0, len(tokens), chunk):
    t = tokens[a:a + chunk]
    pos = jnp.arange(a, a + len(t), dtype=jnp.int32)[None]
    lg, state = _step(model, jnp.asarray(t)[None], pos, state)
    outs.append(lg[0])
  return jnp.concatenate(outs)


def test_kv_cache_sinks_ring_slots():
  st = cache_lib.init_cache(cache_lib.SinksRing(2, 3), 1, 0, 1, 1, 1, jnp.float32)
  for t in range(9):   # 2 sinks + a ring of 3: tokens 0, 1 stay; then the last 3
    x = jnp.full((1, 1, 1, 1), float(t))
    st = st.write(x, x, jnp.full((1, 1), t, jnp.int32))
  assert st.pos[0].tolist() == [0, 1, 8, 6, 7]
  # padding anywhere in a chunk: valid tokens still take consecutive stream slots
  st = cache_lib.init_cache(cache_lib.LINEAR, 1, 4, 1, 1, 1, jnp.float32)
  x = jnp.zeros((1, 3, 1, 1))
  st = st.write(x, x, jnp.asarray([[-1, 0, 1]]))
  assert st.pos[0].tolist() == [0, 1, -1, -1] and int(st.ptr[0]) == 2


@pytest.mark.parametrize("mixer", ["attention", "sisa"])
def test_streaming_with_room_for_everything_equals_dense(mixer):
  model = _model(mixer)
  tok = _tokens(0, 14)
  full = model(jnp.asarray(tok)[None])[0]
  for cache, sinks, window in (("streaming", 4, 10), ("window", 0, 14)):
    pol = StreamPolicy(cache, window=window, sinks=sinks).cache
    _close(_stream_logits(model, tok, 1, pol), full)
    _close(_stream_logits(model, tok, 5, pol), full)


def _reference_streaming_attention(mixer, x_TD, n, W):
  """Explicit StreamingLLM for one attention layer: query t sees keys {0..n-1} and its last W
  tokens; visible keys oldest first at positions 0, 1, ..., the query at their count."""
  cfg = mixer.cfg
  q, k, v = mixer.proj.q(x_TD[None]), mixer.proj.k(x_TD[None]), mixer.proj.v(x_TD[None])
  outs = []
  for t in range(x_TD.shape[0]):
    keep = sorted(set(range(min(n, t + 1))) | set(range(max(0, t - W + 1), t + 1)))
    idx = jnp.asarray(keep)
    pk = jnp.arange(len(keep))[None]
    kk = rope(k[:, idx], pk, cfg.rope_theta)
    qq = rope(q[:, t:t + 1], pk[:, -1:], cfg.rope_theta)
    s = jnp.einsum("bthd,bshd->bhts", qq, kk) * cfg.head_dim ** -0.5
    outs.append(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v[:, idx]))
  return mixer.proj.o(jnp.concatenate(outs, axis=1))[0]


def test_streaming_attention_equals_its_definition_after_eviction():
  """A 1-layer model past its cache: token by token and in chunks, each output equals the
  explicit StreamingLLM attention; "window" equals a fresh forward over the last W tokens.
  30 tokens: the ring's RoPE frame moves twice (cache.py: once its lag passes W)."""
  model = _model("attention", n_layers=1)
  n, W, N = 3, 5, 30
  tok = _tokens(1, N)
  graphdef, st = nnx.split(model.blocks)
  blk = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], st)).layers[0]
  x = blk.mixer_norm(jnp.take(model.embed[...], jnp.asarray(tok), axis=0))
  ref = _reference_streaming_attention(blk.mixer, x, n, W)
  ring = blk.mixer
  for chunk in (1, 4):
    state = ring.init_state(ring.cfg, ring.opts, 1, 1, jnp.float32,
                            StreamPolicy("streaming", window=W, sinks=n).cache)
    outs = []
    for a in range(0, N, chunk):
      pos = jnp.arange(a, min(a + chunk, N), dtype=jnp.int32)[None]
      y, state, _ = ring(x[None, a:a + chunk], positions_BT=pos, state=state)
      outs.append(y[0])
    _close(jnp.concatenate(outs), ref)
  # window: the model's logits = a fresh forward over the last W tokens
  lw = _stream_logits(model, tok, 1, StreamPolicy("window", window=W).cache)
  for t in (W, 11, N - 1):
    _close(lw[t], model(jnp.asarray(tok[t - W + 1:t + 1])[None])[0, -1])


def test_sisa_streaming_keeps_decay_and_phase_and_reassigns_rope():
  """SISA StreamingLLM, one layer, past its cache: the explicit score per query t over the kept
  keys j: RoPE part at positions inside the cache, SISA part lambda e^{g_t - g_j}
  C_t^T R(Phi_j - Phi_t) B_j with g, Phi summed over the WHOLE stream (evicted tokens too)."""
  model = _model("sisa", n_layers=1)
  n, W, N = 2, 4, 13
  graphdef, st = nnx.split(model.blocks)
  blk = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], st)).layers[0]
  mixer = blk.mixer
  tok = _tokens(2, N)
  x = blk.mixer_norm(jnp.take(model.embed[...], jnp.asarray(tok), axis=0))[None]
  q, k, v, c, b, loga, theta, lam = mixer.features(x, None, rotate=False)
  g, phi = sisa.decay_and_phase(loga, theta)
  cfg = mixer.cfg
  outs = []
  for t in range(N):
    keep = jnp.asarray(sorted(set(range(min(n, t + 1))) | set(range(max(0, t - W + 1), t + 1))))
    pk = jnp.arange(len(keep))[None]
    qq = rope(q[:, t:t + 1], pk[:, -1:], cfg.rope_theta)
    kk = rope(k[:, keep], pk, cfg.rope_theta)
    # reference over the kept keys, query last: pass g/phi/C/B of [kept ; query]
    # (the reference's causal mask on the kept list is exact since the query is last)
    o, _ = sisa.sisa_attention_reference(
        jnp.concatenate([kk[:, :-1], qq], 1), kk, v[:, keep], c[:, keep], b[:, keep],
        g[:, keep], phi[:, keep], lam, query_idx=jnp.asarray([len(keep) - 1]))
    outs.append(o[0, 0])
  ref = mixer.proj.o(jnp.stack(outs)[None])[0]
  ring = mixer
  for chunk in (1, 3):
    state = ring.init_state(ring.cfg, ring.opts, 1, 1, jnp.float32,
                            StreamPolicy("streaming", window=W, sinks=n).cache)
    ys = []
    for a in range(0, N, chunk):
      pos = jnp.arange(a, min(a + chunk, N), dtype=jnp.int32)[None]
      y, state, _ = ring(x[:, a:a + chunk], positions_BT=pos, state=state)
      ys.append(y[0])
    _close(jnp.concatenate(ys), ref)


def test_scoring_loop_fixed_state_one_trace_and_policies():
  model = _model("attention")
  N = 40
  tok = _tokens(3, N)
  full = model(jnp.asarray(tok)[None])
  logp = jax.nn.log_softmax(full[0, :-1], -1)
  dense_ref = -np.take_along_axis(np.asarray(logp), tok[1:, None], -1)[:, 0]
  _close(streaming.score_stream(model, tok, StreamPolicy("dense"), chunk=8, progress=False),
         dense_ref)
  _close(streaming.score_stream(model, tok, StreamPolicy("streaming", window=40, sinks=4), chunk=7,
                                progress=False), dense_ref)
  # recompute: loss i from a fresh forward over the last W tokens, the window sliding
  W = 6
  rec = streaming.score_stream(model, tok, StreamPolicy("recompute", window=W), batch=4,
                               progress=False)
  for i in (0, 4, W, 20, N - 2):
    lg = model(jnp.asarray(tok[max(0, i - W + 1):i + 1])[None])[0, -1]
    _close(rec[i], -jax.nn.log_softmax(lg)[tok[i + 1]])
  # a fixed-size state and a single trace of the chunk step, however long the stream
  sc = streaming.CachedScorer(model, StreamPolicy("streaming", window=6, sinks=2), chunk=4,
                              trace_limit=1)
  sizes = set()
  for a in range(0, 30, 4):
    sc.score(tok[a:a + 3], tok[a + 1:a + 4])       # 3 < chunk: padded, same shape
    sizes.add(sc.cache_bytes)
  assert len(sizes) == 1 and sc.position == 24
  # generation with the streaming cache: any length in constant memory, == step by step
  gen = streaming.greedy_continuation(model, tok[:5], StreamPolicy("streaming", window=6,
                                                                  sinks=2), max_new_tokens=12)
  lg = _stream_logits(model, gen[:-1], 1, StreamPolicy("streaming", window=6, sinks=2).cache)
  np.testing.assert_array_equal(np.argmax(np.asarray(lg[4:]), -1), gen[5:])
  rec_gen = streaming.greedy_continuation(model, tok[:5], StreamPolicy("recompute", window=6),
                                          max_new_tokens=3)
  for i in range(5, 8):
    ctx = jnp.asarray(rec_gen[max(0, i - 6):i])[None]
    assert int(jnp.argmax(model(ctx)[0, -1])) == rec_gen[i]


def test_clear_errors(tmp_path):
  model = _model("attention")
  with pytest.raises(ValueError, match="empty"):
    streaming.score_stream(model, np.zeros(1, np.int32), StreamPolicy("dense"))
  with pytest.raises(ValueError, match="larger than the model holds"):
    streaming.check_policy(model.cfg, StreamPolicy("streaming", window=100, sinks=4))
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError, match="empty"):
    streaming.read_stream(str(tmp_path / "empty.txt"))
  from attn_jax.eval import stream_run   # what experiments/stream.py calls
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    stream_run.run(str(tmp_path / "nope"), str(tmp_path / "empty.txt"))


def test_read_stream_on_a_public_text():
  """The last 1% of the tinyshakespeare excerpt (tests/data): its bytes."""
  raw = np.frombuffer(SHAKESPEARE.read_bytes(), np.uint8)
  tok = streaming.read_stream(str(SHAKESPEARE), tail=0.01)
  assert len(tok) > 100
  np.testing.assert_array_equal(tok, raw[int(len(raw) * (1 - 0.01)):])


def test_one_model_decodes_under_every_policy():
  """One model (attention, SISA, sliding window and Sinkhorn layers), never rebuilt: under every
  cache policy with room for the whole stream, stepping equals the full forward and greedy
  generation equals the linear cache's; once a ring evicts, its state keeps its size."""
  cfg = ModelConfig(vocab_size=V, d_model=D, n_heads=H, d_ff=48, n_layers=4, max_seq_len=64,
                    dtype="float32", init_std=0.3,
                    pattern=("attention", "sisa", "sliding_window", "sinkhorn"))
  cfg = cfg.with_options("sisa", d_state=4).with_options("sliding_window", window=3)
  cfg = cfg.with_options("sinkhorn", block_size=4)
  model = build_model(cfg, seed=0)
  tok = _tokens(4, 16)
  full = model(jnp.asarray(tok)[None])[0]
  prompt = jnp.asarray(tok[:5])[None]
  linear = np.asarray(decode.generate(model, prompt, max_new_tokens=6))
  for policy in (None, cache_lib.LINEAR, cache_lib.Ring(16), cache_lib.SinksRing(2, 14)):
    _close(_stream_logits(model, tok, 1, policy), full)
    _close(_stream_logits(model, tok, 3, policy), full)    # chunk <= the window
    np.testing.assert_array_equal(
        np.asarray(decode.generate(model, prompt, max_new_tokens=6, policy=policy)), linear)
  for policy in (cache_lib.Ring(4), cache_lib.SinksRing(2, 4)):   # evicting: fixed size
    st = model.init_state(1, 16, policy)
    before = streaming.state_bytes(st)
    for t in range(10):
      _, st = _step(model, jnp.asarray(tok[t:t + 1])[None], jnp.full((1, 1), t, jnp.int32), st)
    assert streaming.state_bytes(st) == before
    assert np.asarray(decode.generate(model, prompt, max_new_tokens=6, policy=policy,
                                      cache_len=16)).shape == (1, 11)


@pytest.mark.parametrize("mixer", ["attention", "sisa"])
def test_one_token_step_updates_the_cache_in_place(mixer):
  """The compiled one-token streaming step (batch 1, donated state, `decode.jit_stateful`)
  copies no KV buffer except through the ring's frame move (a `lax.cond` over each layer's
  keys): the state is read where it lies and written in place. Without the options XLA copied
  each buffer several times per call."""
  model = _model(mixer)
  graphdef, params = nnx.split(model)
  state = model.init_state(1, 1, cache_lib.SinksRing(2, 14))
  fn = lambda p, t, pos, s: nnx.merge(graphdef, p).step(t, positions_BT=pos, state=s)
  one = jnp.zeros((1, 1), jnp.int32)

  def kv_copies(jitted):
    text = jitted.lower(params, one, one, state).compile().as_text()
    kv = f"[1,{H},16,{D // H}]"          # a layer's k or v: [B, K, S, Dh]
    return sum(" copy(" in line and kv in line for line in text.splitlines())
  if kernel_choice.stateful_compiler_options():
    assert kv_copies(jax.jit(fn, donate_argnums=(3,))) > 2 * model.cfg.n_layers
  assert kv_copies(decode.jit_stateful(fn, donate_argnums=(3,))) <= model.cfg.n_layers
