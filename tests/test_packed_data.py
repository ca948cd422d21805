"""data.document_mask: every packed source emits per-token document ids and positions.

The reference below is written per token from the documents' end offsets, independently of
attn_jax.data.documents: the EOS ending document k is the BOS of document k + 1, so a token's
document is the number of document-ending EOS tokens at or before it; its position counts from
its document's BOS, or from the window start for a document cut by it.
"""

import json
import logging

import ml_collections
import numpy as np
import pytest

from attn_jax.config import validate
from attn_jax.data import doc_reader, documents, pipeline, shard_prep, synthetic, text
from attn_jax.data.tokenizer import ByteTokenizer
from configs.base import get_config

EOS = ByteTokenizer.eos_id
# Lengths 1 (twice: a document of length 1 inside the stream), 3, 7, ...; seq_len 8 cuts many.
DOCS = ["a", "bcd", "efghijk", "l", "mnopqrstuvwx", "yz", "ABCDEFGHIJKLMNOPQRS", "T", "UVWXY",
        "Z0123"] * 3
SEQ = 8


def data_config(**overrides):
  d = get_config().data
  d.update(seq_len=SEQ, global_batch_size=4, read_threads=0, prefetch_batches=2,
           eval_fraction=0.1, tokenizer="bytes", shuffle=False, document_mask=True)
  d.update(**overrides)
  return d


def write_jsonl(path, docs):
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
  return str(path)


def reference_fields(ends, first, length):
  """(segment ids, positions) of inputs stream[first : first + length], token by token."""
  eos_at = [e - 1 for e in ends]
  seg, pos = [], []
  for p in range(first, first + length):
    doc = sum(1 for q in eos_at if q <= p)          # the EOS itself opens the next document
    doc_first = max([q for q in eos_at if q <= p], default=0)
    seg.append(doc - sum(1 for q in eos_at if q <= first) + 1)
    pos.append(p - max(doc_first, first))
  return np.asarray(seg), np.asarray(pos)


def test_text_windows_match_the_reference_and_keep_every_target_in_its_document(tmp_path):
  path = str(tmp_path / "c.txt")
  with open(path, "w") as f:
    f.write("".join(d + "\n" for d in DOCS))
  cfg = data_config(source="text", paths=path, eval_fraction=0.0)
  tokens, ends = text.pack_documents(ByteTokenizer(), DOCS)
  src = pipeline.make_source(cfg, seed=0)
  assert len(src) == (len(tokens) - 1) // SEQ
  for i in range(len(src)):
    ex = src[i]
    seg, pos = reference_fields(ends, i * SEQ, SEQ)
    np.testing.assert_array_equal(ex["segment_ids"], seg)
    np.testing.assert_array_equal(ex["positions"], pos)
    assert ex["segment_ids"].dtype == ex["positions"].dtype == np.int32
    # EOS as BOS: an EOS input opens a document at position 0 and is the target of the token
    # before it, which is still in the previous document.
    new = np.flatnonzero(np.diff(ex["segment_ids"])) + 1
    np.testing.assert_array_equal(new, np.flatnonzero(ex["inputs"][1:] == EOS) + 1)
    assert (ex["positions"][new] == 0).all() and (ex["targets"][new - 1] == EOS).all()


def test_each_document_is_its_own_row_eos_first(tmp_path):
  """Whole documents of a window are exactly [EOS, t_1..t_n] -> [t_1..t_n, EOS] (length 1
  included); the stream's first document has no BOS."""
  docs = ["bcdefg", "a", "hijklmnop", "qrstu"]
  tokens, ends = text.pack_documents(ByteTokenizer(), docs)
  src = text.PackedSequences(tokens, seq_len=len(tokens) - 1, first=0, count=1, doc_ends=ends)
  ex = src[0]
  rows = []
  for s in np.unique(ex["segment_ids"]):
    m = ex["segment_ids"] == s
    rows.append((ex["inputs"][m].tolist(), ex["targets"][m].tolist(), ex["positions"][m]))
  ids = lambda s: list(s.encode())
  assert rows[0][:2] == (ids("bcdefg"), ids("cdefg") + [EOS])
  for (x, y, p), d in zip(rows[1:], docs[1:]):
    assert x == [EOS] + ids(d) and y == ids(d) + [EOS]
    np.testing.assert_array_equal(p, np.arange(len(d) + 1))
  assert rows[1][0] == [EOS, ord("a")] and rows[1][1] == [ord("a"), EOS]


def test_jsonl_equals_text_and_switch_off_adds_no_keys(tmp_path):
  path = str(tmp_path / "c.txt")
  with open(path, "w") as f:
    f.write("".join(d + "\n" for d in DOCS))
  a = pipeline.make_source(data_config(source="text", paths=path), seed=0)
  b = pipeline.make_source(data_config(source="jsonl", paths=write_jsonl(tmp_path / "c.jsonl",
                                                                         DOCS)), seed=0)
  for i in (0, 5, len(a) - 1):
    for k in documents.batch_keys(data_config()):
      np.testing.assert_array_equal(a[i][k], b[i][k])
  off = pipeline.make_source(data_config(source="text", paths=path, document_mask=False), seed=0)
  assert set(off[0]) == {"inputs", "targets", "weights"}
  assert documents.batch_keys(data_config(document_mask=False)) == ("inputs", "targets",
                                                                    "weights")


def _shard_corpus(tmp_path, name, doc_boundaries):
  src = tmp_path / f"src_{name}"
  src.mkdir()
  for i in range(0, len(DOCS), 4):   # several shards: windows span shard boundaries
    write_jsonl(src / f"{i:03d}.jsonl", DOCS[i:i + 4])
  out = tmp_path / name
  shard_prep.prepare(str(src), str(out), workers=1, progress=False, doc_boundaries=doc_boundaries)
  return out


def test_shards_with_and_without_boundary_files_equal_jsonl(tmp_path, caplog):
  ref_cfg = data_config(source="jsonl", paths=write_jsonl(tmp_path / "all.jsonl", DOCS))
  with_ends = _shard_corpus(tmp_path, "ends", True)      # prepare's default
  assert (with_ends / "shard_00000.docs.npy").is_file()
  without = _shard_corpus(tmp_path, "eos", False)
  assert not (without / "shard_00000.docs.npy").exists()
  ref = pipeline.make_train_iterator(ref_cfg, seed=2)
  with caplog.at_level(logging.WARNING):
    its = [pipeline.make_train_iterator(data_config(source="shards", paths=str(p)), seed=2)
           for p in (with_ends, without)]
  warned = [r.getMessage() for r in caplog.records if "boundary file" in r.getMessage()]
  assert len(warned) == 1 and str(without) in warned[0]   # only the fallback warns
  for _ in range(8):
    want = next(ref)
    assert set(want) == set(documents.batch_keys(ref_cfg))
    for it in its:
      got = next(it)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_boundary_files_are_read_and_checked(tmp_path):
  out = _shard_corpus(tmp_path, "ends", True)
  ends = np.load(out / "shard_00000.docs.npy")
  np.save(out / "shard_00000.docs.npy", ends[:-1])   # one document fewer than the index says
  src = pipeline.make_source(data_config(source="shards", paths=str(out)), seed=0)
  with pytest.raises(doc_reader.DataError, match="shard_00000.docs.npy"):
    src[0]


def test_synthetic_rows_are_one_document():
  for task in ("mqar", "random"):
    cfg = data_config(source="synthetic", synthetic_task=task, seq_len=31, mqar_num_pairs=4,
                      mqar_num_queries=2, mqar_vocab=16)
    ex = synthetic.SyntheticSource(cfg, seed=0)[3]
    np.testing.assert_array_equal(ex["segment_ids"], np.ones(31))
    np.testing.assert_array_equal(ex["positions"], np.arange(31))
    plain = synthetic.SyntheticSource(data_config(**{**cfg, "document_mask": False}), seed=0)[3]
    np.testing.assert_array_equal(plain["inputs"], ex["inputs"])
    assert "segment_ids" not in plain


def test_iterator_resume_with_the_switch_on(tmp_path):
  cfg = data_config(source="jsonl", paths=write_jsonl(tmp_path / "c.jsonl", DOCS), shuffle=True)
  it = pipeline.make_train_iterator(cfg, seed=1)
  next(it), next(it)
  state = json.loads(json.dumps(pipeline.iterator_state(it)))   # as a checkpoint stores it
  resumed = pipeline.make_train_iterator(cfg, seed=1)
  pipeline.restore_iterator(resumed, state)
  for a, b in zip([next(it) for _ in range(3)], [next(resumed) for _ in range(3)]):
    assert set(a) == set(b) == set(documents.batch_keys(cfg))
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_document_fields_rejects_bad_starts():
  with pytest.raises(ValueError, match="increasing"):
    documents.document_fields(np.asarray([3, 2]), 8)
  with pytest.raises(ValueError, match="document_mask"):
    documents.document_mask(ml_collections.ConfigDict({"document_mask": 1}))


def _config(**model):
  c = get_config()
  c.model.update(**model)
  c.data.update(document_mask=True, seq_len=64)
  c.model.max_seq_len = 64
  return c


def test_sink_tokens_with_document_mask_need_shared_prefix_readers():
  validate(_config(sink_tokens=1))              # attention reads the shared prefix
  validate(_config(pattern=("attention", "mamba2:nomlp"), n_layers=2))   # no sinks: fine
  with pytest.raises(ValueError, match=r"config\.data\.document_mask: .*sink_tokens=1.*mamba2"):
    validate(_config(sink_tokens=1, pattern=("attention", "mamba2:nomlp"), n_layers=2))
  c = _config(sink_tokens=1, pattern=("attention", "mamba2:nomlp"), n_layers=2)
  del c.data["document_mask"]                   # a config from before the switch: off
  run = validate(c)
  assert "segment_ids" not in pipeline.make_source(run.data, seed=0)[0]
