"""data.window_offset: training windows that start at a random token of the stream.

The reference for every window is the token stream itself (text.pack_documents, independent
of the sources' windowing) and, for document masks, test_packed_data's per-token reference.
"""

import json

import numpy as np
import pytest

from attn_jax.config import DataConfig, section_of, validate
from attn_jax.data import offsets, pipeline, shard_prep, text
from attn_jax.data.tokenizer import ByteTokenizer
from configs.base import get_config
from tests.test_packed_data import reference_fields

_RNG = np.random.default_rng(0)
# 60 documents of 1-24 random letters: every 16-token window occurs once in the stream.
DOCS = ["".join(_RNG.choice(list("abcdefghijklmnopqrstuvwxyz"), 1 + i % 24)) for i in range(60)]
SEQ = 16


def data_config(path, source="jsonl", **overrides):
  d = get_config().data
  d.update(source=source, paths=str(path), seq_len=SEQ, global_batch_size=4, read_threads=0,
           prefetch_batches=2, eval_fraction=0.1, tokenizer="bytes", shuffle=True,
           window_offset="random")
  d.update(**overrides)
  return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same documents as jsonl, text (one per line) and prepared token shards."""
  root = tmp_path_factory.mktemp("offsets")
  jsonl = root / "c.jsonl"
  jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
  txt = root / "c.txt"
  txt.write_text("".join(d + "\n" for d in DOCS), encoding="utf-8")
  shard_prep.prepare(str(jsonl), str(root / "shards"), workers=1, progress=False,
                     doc_boundaries=True)
  return {"jsonl": jsonl, "text": txt, "shards": root / "shards"}


def stream():
  return text.pack_documents(ByteTokenizer(), DOCS)


def take(it, n):
  return [next(it) for _ in range(n)]


def rows(batches, key="inputs"):
  return [r for b in batches for r in b[key]]


def start_of(row, tokens):
  """The stream offsets where `row` (inputs) occurs."""
  n = len(row)
  return [s for s in range(len(tokens) - n) if np.array_equal(tokens[s:s + n], row)]


def test_default_is_unchanged(corpus):
  """Field absent (an older config), "none" and the base default give the aligned batches."""
  assert get_config().data.window_offset == "none"
  none = data_config(corpus["jsonl"], window_offset="none")
  absent = data_config(corpus["jsonl"])
  del absent["window_offset"]
  a = take(pipeline.make_train_iterator(none, seed=3), 6)
  b = take(pipeline.make_train_iterator(section_of(DataConfig, "data", absent), seed=3), 6)
  tokens, _ = stream()
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert all(start_of(r, tokens)[0] % SEQ == 0 for r in rows(a))


def test_random_windows_are_stream_windows_inside_the_train_split(corpus):
  cfg = data_config(corpus["jsonl"], shuffle=False)
  tokens, _ = stream()
  num_train, _ = text.split_counts(len(tokens), cfg)
  count = num_train - 1                            # the last aligned window is not used
  batches = take(pipeline.make_train_iterator(cfg, seed=5), 3 * count // 4 + 1)  # > 2 epochs
  got = [(x, y) for b in batches for x, y in zip(b["inputs"], b["targets"])]
  starts = []
  for k, (x, y) in enumerate(got):
    i, epoch = k % count, k // count                # no shuffle: window k is index k % count
    s = i * SEQ + offsets.offset_of(5, epoch, i, SEQ)
    np.testing.assert_array_equal(x, tokens[s:s + SEQ])
    np.testing.assert_array_equal(y, tokens[s + 1:s + SEQ + 1])
    assert s + SEQ + 1 <= num_train * SEQ + 1       # never a held-out target
    starts.append(s)
  offs = np.asarray(starts) % SEQ
  assert len(set(offs.tolist())) > SEQ // 2         # offsets spread over [0, L)
  first, second = offs[:count], offs[count:2 * count]
  assert (first != second).mean() > 0.5             # drawn anew every epoch
  assert np.mean(offs == 0) < 0.5


def test_eval_split_stays_aligned(corpus):
  a = pipeline.make_eval_batches(data_config(corpus["jsonl"]), seed=0, num_batches=2,
                                 batch_size=2)
  b = pipeline.make_eval_batches(data_config(corpus["jsonl"], window_offset="none"), seed=0,
                                 num_batches=2, batch_size=2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])


@pytest.mark.parametrize("source", ["jsonl", "text", "shards"])
def test_every_packed_source_gives_the_same_random_windows(corpus, source):
  ref = take(pipeline.make_train_iterator(data_config(corpus["jsonl"]), seed=7), 5)
  got = take(pipeline.make_train_iterator(data_config(corpus[source], source=source), seed=7), 5)
  for x, y in zip(ref, got):
    assert set(x) == set(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  tokens, _ = stream()
  assert any(s % SEQ for r in rows(got) for s in start_of(r, tokens))


@pytest.mark.parametrize("source", ["jsonl", "shards"])
def test_resume_is_bit_identical_past_an_epoch(corpus, source):
  cfg = data_config(corpus[source], source=source, document_mask=True, read_threads=2)
  it = pipeline.make_train_iterator(cfg, seed=1)
  take(it, 9)                                      # past the first epoch (~31 windows)
  state = json.loads(json.dumps(pipeline.iterator_state(it)))
  expected = take(it, 5)
  resumed = pipeline.make_train_iterator(cfg, seed=1)
  pipeline.restore_iterator(resumed, state)
  for x, y in zip(expected, take(resumed, 5)):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_hosts_read_disjoint_blocks_of_the_global_batch(corpus):
  cfg = data_config(corpus["jsonl"])
  whole = take(pipeline.make_train_iterator(cfg, seed=2), 3)
  hosts = [take(pipeline.make_train_iterator(cfg, seed=2, process_index=h, process_count=2), 3)
           for h in range(2)]
  for step, batch in enumerate(whole):
    for k in batch:
      np.testing.assert_array_equal(
          np.concatenate([hosts[0][step][k], hosts[1][step][k]]), batch[k])


def test_packed_rows_carry_the_documents_of_the_moved_window(corpus):
  cfg = data_config(corpus["jsonl"], document_mask=True)
  tokens, ends = stream()
  batches = take(pipeline.make_train_iterator(cfg, seed=4), 6)
  moved = 0
  for x, seg, pos in zip(rows(batches), rows(batches, "segment_ids"), rows(batches, "positions")):
    (s,) = start_of(x, tokens)                       # the windows are unique in this stream
    moved += s % SEQ != 0
    want_seg, want_pos = reference_fields(ends, s, SEQ)
    np.testing.assert_array_equal(seg, want_seg)
    np.testing.assert_array_equal(pos, want_pos)
  assert moved > len(rows(batches)) // 2


def test_bad_settings_name_the_field(corpus, tmp_path):
  c = get_config()
  c.data.window_offset = "middle"
  with pytest.raises(ValueError, match=r"config\.data\.window_offset.*'middle'"):
    validate(c)
  c.data.window_offset = "random"                  # the base source is synthetic (MQAR)
  with pytest.raises(ValueError, match=r"config\.data\.window_offset.*synthetic"):
    validate(c)
  with pytest.raises(ValueError, match=r"data\.window_offset.*packed source"):
    pipeline.make_train_iterator(c.data, seed=0)
  short = tmp_path / "short.txt"
  short.write_text("x" * (SEQ + 5) + "\n")           # one window
  with pytest.raises(ValueError, match=r"window_offset='random'.*at least 2"):
    pipeline.make_train_iterator(data_config(short, source="text", eval_fraction=0.0), seed=0)


@pytest.mark.slow
def test_a_resumed_training_run_repeats_the_uninterrupted_one(tmp_path, monkeypatch):
  from attn_jax.train import trainer as trainer_lib
  from tests.test_train import losses, run_interrupted, tiny_config
  path = tmp_path / "c.txt"
  path.write_text("".join(d + "\n" for d in DOCS * 4), encoding="utf-8")
  c = tiny_config(steps=4, source="text", paths=str(path), tokenizer="bytes",
                  eval_fraction=0.1, window_offset="random")
  c.model.update(vocab_size=257, n_layers=1)
  full = trainer_lib.train_and_evaluate(c, str(tmp_path / "full"))
  run_interrupted(c, tmp_path / "resumed", monkeypatch, at_batch=3)
  resumed = trainer_lib.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert losses(tmp_path / "resumed") == losses(tmp_path / "full")
  assert resumed["eval/loss"] == full["eval/loss"]
