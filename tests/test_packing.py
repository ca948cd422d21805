"""Packed rows: every mixer makes a document boundary exact.

A row packing documents of lengths DOCS (one of length 1; one longer than the chunk / block /
window sizes of each mixer's `tiny()` options, so it crosses a chunk boundary of the chunked
scans, and none aligned to a block boundary but the first) must give, for each document, the logits, loss and parameter gradients of that document
run alone in a row of its own (all documents alone form one right-padded batch, so each
pattern compiles three programs whatever the documents' lengths); without segment ids (plain
concatenation) they must differ, so the test can fail. Causality by gradient is checked with segment ids: an output depends on an
input only if the input is earlier (or the same token) *and in the same document*.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.registry import available_mixers
from tests.test_trunk import TOL, _cfg, _close, _model, _tokens

DOCS = ((1, 6, 9, 5), (12, 9))     # two packed rows of 21 tokens
T = 21


def _patterns():
  return ([(n,) for n in available_mixers()]
          + [("attention", "mamba2:nomlp"), ("attention", "sisa", "sliding_window:nomlp")])


PATTERNS = [pytest.param(p, id="+".join(p)) for p in _patterns()]


def packed_layout(docs_per_row) -> tuple[jax.Array, jax.Array]:
  """(positions [B, T], segment ids [B, T]) of rows packing documents of these lengths."""
  pos, seg = [], []
  for docs in docs_per_row:
    assert sum(docs) == T
    pos.append(np.concatenate([np.arange(n) for n in docs]))
    seg.append(np.concatenate([np.full(n, d + 1) for d, n in enumerate(docs)]))
  return jnp.asarray(np.stack(pos), jnp.int32), jnp.asarray(np.stack(seg), jnp.int32)


def one_row(docs):
  """(positions [1, T], segment ids [1, T], [(start, end)] per document) of one row packing
  documents of these lengths (T = their sum; the mixers' own packed tests use it)."""
  pos = np.concatenate([np.arange(n) for n in docs])
  seg = np.concatenate([np.full(n, d + 1) for d, n in enumerate(docs)])
  return (jnp.asarray(pos[None], jnp.int32), jnp.asarray(seg[None], jnp.int32), _spans(docs))


def _spans(docs):
  starts = np.cumsum((0,) + tuple(docs))
  return list(zip(starts[:-1], starts[1:]))


def _pcfg(pattern, **kw):
  """The test config of `pattern` (tests/test_trunk._cfg: each mixer's `tiny()` options)."""
  return _cfg(pattern, n_layers=len(pattern), max_seq_len=32, **kw)


def _alone_rows(tokens, docs_per_row, width=T):
  """Every document alone at the start of a row of its own, right-padded to `width` (position
  -1): (tokens [N, width], positions [N, width], [(row, start, end)] of each document in the
  packed rows). One batch of every document compiles once, whatever the documents' lengths."""
  toks, pos, where = [], [], []
  for r, docs in enumerate(docs_per_row):
    for a, e in _spans(docs):
      toks.append(np.pad(np.asarray(tokens[r, a:e]), (0, width - (e - a))))
      pos.append(np.concatenate([np.arange(e - a), np.full(width - (e - a), -1)]))
      where.append((r, a, e))
  return jnp.asarray(np.stack(toks), jnp.int32), jnp.asarray(np.stack(pos), jnp.int32), where


def _nll_sum(model, tokens, targets, positions, segments):
  logits = model(tokens, positions_BT=positions, segment_ids_BT=segments)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)
  return jnp.sum(jnp.where(positions >= 0, nll[..., 0], 0.0)), logits


@nnx.jit
def _loss_grads_logits(model, tokens, targets, positions, segments):
  (loss, logits), grads = nnx.value_and_grad(_nll_sum, has_aux=True)(
      model, tokens, targets, positions, segments)
  return loss, grads, logits


@nnx.jit
def _plain_logits(model, tokens):
  return model(tokens)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_packed_rows_equal_each_document_alone(pattern):
  """Logits, summed loss and parameter gradients of packed rows equal those of every document
  alone in a row of its own; plain concatenation (no segment ids) differs."""
  model = _model(_pcfg(pattern), seed=3)
  docs_per_row = DOCS
  tokens = _tokens(4, (len(docs_per_row), T))
  targets = _tokens(5, (len(docs_per_row), T))
  positions, segments = packed_layout(docs_per_row)
  loss, grads, packed = _loss_grads_logits(model, tokens, targets, positions, segments)
  alone_tokens, alone_pos, where = _alone_rows(tokens, docs_per_row)
  alone_targets = _alone_rows(targets, docs_per_row)[0]
  want_loss, want_grads, alone = _loss_grads_logits(model, alone_tokens, alone_targets,
                                                    alone_pos, None)
  plain = _plain_logits(model, tokens)
  differs = 0.0
  for i, (r, a, e) in enumerate(where):
    _close(packed[r, a:e], alone[i, :e - a])
    scale = float(np.max(np.abs(np.asarray(alone[i, :e - a]))))
    differs = max(differs, float(np.max(np.abs(np.asarray(plain[r, a:e] - alone[i, :e - a]))))
                  / scale)
  assert differs > 100 * TOL, "plain concatenation matched the documents alone: the test is void"
  _close(loss, want_loss)
  noise = None
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree.leaves(want_grads)):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want), initial=0.0)
    if err <= TOL * np.max(np.abs(want), initial=0.0):
      continue
    noise = _gradient_noise(model, tokens, targets, want_grads) if noise is None else noise
    name = jax.tree_util.keystr(path)
    assert err <= NOISE_FACTOR * noise[name], (name, err, noise[name])


# TOL relative to a leaf's own largest gradient assumes float32 rounding errors scale with that
# leaf. Not so for a gradient that is a small difference of large terms: Sinkhorn's sort network
# (sort_r, sort_u, sortnet) is reached through 2 x n_iters log-space normalisations, whose
# backward is a projection (g - p * sum g), so its largest entry is ~1e-3 of the model's other
# gradients while its rounding error is of their size (~1e-6 absolute on 2 cores, jax 0.10.2 and
# 0.12). Such a leaf is held to the rounding noise of the computation itself, sampled by a second
# float32 evaluation of the same documents alone (padded to another width, so other block counts
# and reductions): packed vs alone measured at 0.3-2.0 x that sample on every leaf, both JAX lines.
NOISE_FACTOR = 4
NOISE_WIDTH = 27          # > T, another number of blocks for every mixer's tiny block sizes


def _gradient_noise(model, tokens, targets, want_grads):
  """{leaf path: max |alone at NOISE_WIDTH - alone at T|}: the float32 noise of each gradient."""
  toks, pos, _ = _alone_rows(tokens, DOCS, NOISE_WIDTH)
  tgts = _alone_rows(targets, DOCS, NOISE_WIDTH)[0]
  other = _loss_grads_logits(model, toks, tgts, pos, None)[1]
  return {jax.tree_util.keystr(path): float(np.max(np.abs(np.asarray(a, np.float64)
                                                          - np.asarray(b, np.float64))))
          for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(other),
                                  jax.tree.leaves(want_grads))}


def _mixer(pattern):
  """The first layer's mixer, its parameters without the decoder's stacked repeat axis (a
  leading axis of 1 would broadcast silently through some paths and break others)."""
  graphdef, state = nnx.split(_model(_pcfg(pattern), seed=8).blocks.layers[0].mixer)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if len(p.values[0]) == 1])
def test_causality_by_gradient_stays_inside_each_document(pattern):
  """d y[t] / d x[s] is nonzero only for s <= t in t's document (exact zeros elsewhere)."""
  name = pattern[0]
  mixer = _mixer(pattern)
  graphdef, state = nnx.split(mixer)
  positions, segments = packed_layout(DOCS[:1])
  x = jnp.asarray(np.random.default_rng(9).standard_normal((1, T, 32)), jnp.float32)

  def outputs(x_TD):   # [T]: each output token's sum over channels
    m = nnx.merge(graphdef, state)
    y, _, _ = m(x_TD[None], positions_BT=positions, segment_ids_BT=segments)
    return jnp.sum(y[0], axis=-1)

  g_TTD = np.asarray(jax.jit(jax.jacrev(outputs))(x[0]))   # d out[t] / d x[s], every t at once
  seg = np.asarray(segments[0])
  for t in range(T):
    allowed = (np.arange(T) <= t) & (seg == seg[t])
    leak = np.abs(g_TTD[t][~allowed]).max() if (~allowed).any() else 0.0
    assert leak == 0.0, f"{name}: output {t} depends on an input outside its document"
    assert np.abs(g_TTD[t, t]).max() > 0, f"{name}: output {t} ignores its own input"


def test_sink_tokens_are_every_documents_shared_prefix():
  """Learned sink tokens in a packed row: each document reads them exactly as it would alone."""
  cfg = _cfg(("attention",), n_layers=2, max_seq_len=32, sink_tokens=2)
  model = _model(cfg, seed=11)
  tokens = _tokens(12, (len(DOCS), T))
  positions, segments = packed_layout(DOCS)
  _, _, packed = _loss_grads_logits(model, tokens, tokens, positions, segments)
  alone_tokens, alone_pos, where = _alone_rows(tokens, DOCS)
  _, _, alone = _loss_grads_logits(model, alone_tokens, alone_tokens, alone_pos, None)
  for i, (r, a, e) in enumerate(where):
    _close(packed[r, a:e], alone[i, :e - a])


def test_packed_rows_need_positions_of_the_tokens_shape():
  cfg = _cfg(("attention",), n_layers=1, max_seq_len=32)
  model = _model(cfg)
  tokens = _tokens(1, (2, T))
  _, segments = packed_layout(DOCS)
  with pytest.raises(ValueError, match="positions_BT"):
    model(tokens, segment_ids_BT=segments)
