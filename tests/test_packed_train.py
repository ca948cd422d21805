"""data.document_mask through the trainer: a packed batch's loss and gradients (the train step's
own loss function) equal those of its documents run alone; sharded == unsharded with segment
ids; a resumed run with the switch on repeats the uninterrupted one.

Attention-only models: the other mixers' boundary handling is tests/test_packing.py's subject.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.data import pipeline, text
from attn_jax.data.tokenizer import ByteTokenizer
from attn_jax.train import setup as setup_lib, trainer as trainer_lib
from attn_jax.train.step import make_loss_fn
from tests.test_train import PARAM_ATOL, losses, run_interrupted, tiny_config
from tests.test_trunk import TOL, _cfg, _close, _model

# Lengths 6, 1, 9, 5, 3, 12, 1, 4 (two of length 1); rows of 16 cut documents at row starts.
DOCS = ["bcdefg", "a", "hijklmnop", "qrstu", "vwx", "ABCDEFGHIJKL", "M", "NOPQ"]
ROW = 16


def packed_batch():
  tokens, ends = text.pack_documents(ByteTokenizer(), DOCS)
  src = text.PackedSequences(tokens, seq_len=ROW, first=0, count=(len(tokens) - 1) // ROW,
                             doc_ends=ends)
  rows = [src[i] for i in range(len(src))]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def alone_batch(packed):
  """Every document of the packed rows in a row of its own (right-padded with weight 0: the
  model is causal, so padding after a document changes nothing before it)."""
  docs = []
  for r in range(packed["inputs"].shape[0]):
    seg = packed["segment_ids"][r]
    for s in np.unique(seg):
      m = seg == s
      docs.append((packed["inputs"][r][m], packed["targets"][r][m]))
  n = len(docs)
  out = {"inputs": np.zeros((n, ROW), np.int32), "targets": np.zeros((n, ROW), np.int32),
         "weights": np.zeros((n, ROW), np.float32)}
  for i, (x, y) in enumerate(docs):
    out["inputs"][i, :len(x)], out["targets"][i, :len(y)], out["weights"][i, :len(x)] = x, y, 1.0
  return out, [len(x) for x, _ in docs]


@pytest.mark.parametrize("sink_tokens", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_packed_loss_and_gradients_equal_each_document_alone(sink_tokens):
  model = _model(_cfg(("attention",), n_layers=1, vocab_size=257, max_seq_len=2 * ROW,
                      sink_tokens=sink_tokens), seed=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_fn = make_loss_fn(graphdef)

  @jax.jit
  def nll_and_grads(params, batch):
    batch = jax.tree.map(jnp.asarray, batch)
    return jax.value_and_grad(lambda p: loss_fn(p, rest, batch, 1.0)[0])(params)

  packed = packed_batch()
  alone, lengths = alone_batch(packed)
  # several documents per row, "a" (length 1: the row [EOS, a]) among them
  assert len(lengths) > 2 * packed["inputs"].shape[0]
  assert any(list(r[:n]) == [ByteTokenizer.eos_id, ord("a")]
             for r, n in zip(alone["inputs"], lengths))
  nll_p, g_p = nll_and_grads(params, packed)
  nll_a, g_a = nll_and_grads(params, alone)
  _close(nll_p, nll_a)
  jax.tree.map(_close, g_p, g_a)
  # Plain concatenation (no segment keys) reads across documents: different loss. (Padded
  # with weight-0 rows to the alone batch's shape: one compilation for both.)
  pad = lambda a: np.concatenate([a, np.zeros((len(lengths) - len(a),) + a.shape[1:], a.dtype)])
  plain = {k: pad(packed[k]) for k in ("inputs", "targets", "weights")}
  nll_plain, _ = nll_and_grads(params, plain)
  assert abs(float(nll_plain) - float(nll_a)) > 100 * TOL * abs(float(nll_a))


def text_config(tmp_path, steps=6):
  path = tmp_path / "corpus.txt"
  path.write_text("".join(d * (1 + i % 3) + "\n" for i, d in enumerate(DOCS * 24)))
  c = tiny_config(steps=steps, source="text", paths=str(path), tokenizer="bytes",
                  document_mask=True, eval_fraction=0.15)
  c.model.update(vocab_size=257, n_layers=1)
  return c


def _two_steps(c, devices):
  """Two train steps on the first batch, assembled as the trainer does (`_next_batch`)."""
  setup = setup_lib.build_setup(c, devices=devices)
  it = pipeline.make_train_iterator(c.data, seed=0)
  b = setup_lib.next_batch(it, 1, setup.batch_sharding, (1, 8, c.data.seq_len),
                              setup.batch_keys)
  assert set(b) == {"inputs", "targets", "weights", "segment_ids", "positions"}
  assert int(b["segment_ids"].max()) >= 3               # several documents per row
  state = setup.init_fn()
  state, _ = setup.step_fn(state, b)
  state, m = setup.step_fn(state, b)
  return float(m["loss"]), jax.device_get(state["params"])


def test_sharded_equals_unsharded_with_segment_ids(tmp_path):
  assert jax.device_count() == 8
  c = text_config(tmp_path)
  loss1, p1 = _two_steps(c, jax.devices()[:1])
  c.mesh.shape = (2, 4, 1)                              # data x fsdp over 8 devices
  loss8, p8 = _two_steps(c, jax.devices())
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=PARAM_ATOL), p8, p1)


@pytest.mark.slow
def test_resume_with_document_mask_repeats_the_run(tmp_path, monkeypatch):
  c = text_config(tmp_path, steps=4)
  full = trainer_lib.train_and_evaluate(c, str(tmp_path / "full"))
  assert np.isfinite(full["eval/loss"])       # held-out windows packed the same way
  run_interrupted(c, tmp_path / "resumed", monkeypatch, at_batch=3)
  resumed = trainer_lib.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert losses(tmp_path / "resumed") == losses(tmp_path / "full")
  assert resumed["eval/loss"] == full["eval/loss"]


@pytest.mark.slow
def test_checkpoint_from_before_the_switch_resumes_and_loads(tmp_path):
  """A run whose saved config has no data.document_mask (older code): resuming with today's
  config (the field present, off) continues it, and the evaluator's loader reads it."""
  from attn_jax.train.checkpoint import load_for_inference
  old = tiny_config(steps=2)
  del old.data["document_mask"]
  trainer_lib.train_and_evaluate(old, str(tmp_path))
  new = tiny_config(steps=3)
  assert new.data.document_mask is False
  trainer_lib.train_and_evaluate(new, str(tmp_path))
  assert [s for s, _ in losses(tmp_path)] == [1, 2, 3]
  _, config, step = load_for_inference(str(tmp_path))
  assert step == 3 and config.data.document_mask is False
