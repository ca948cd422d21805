"""Pre-tokenised token shards: prepare -> index -> windows equal the in-memory packing; bad data
gives file:line errors or counted skips; corrupt shards are detected; no data read at build."""

import json
import os
import pickle

import numpy as np
import pytest

from attn_jax.data import doc_reader, formats, pipeline, shard_prep, shards, text
from attn_jax.data.tokenizer import ByteTokenizer
from configs.base import get_config


def data_config(**overrides):
  cfg = get_config().data
  cfg.update(seq_len=16, global_batch_size=4, read_threads=0, prefetch_batches=2,
             eval_fraction=0.1, tokenizer="bytes")
  cfg.update(**overrides)
  return cfg


DOCS_A = [f"alpha {i} " + "xy" * (i % 5) for i in range(30)]
DOCS_B = [f"beta {i} é" for i in range(20)]


@pytest.fixture
def corpus(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  with open(src / "a.jsonl", "w") as f:
    for d in DOCS_A:
      f.write(json.dumps({"text": d, "id": 1}) + "\n")
    f.write("\n")   # blank lines are not documents
  (src / "b.txt").write_text("".join(d + "\n" for d in DOCS_B), encoding="utf-8")
  return src


def reference_stream(docs):
  return text.tokenize_documents(ByteTokenizer(), docs)


def test_prepare_stream_equals_the_in_memory_packing(corpus, tmp_path):
  out = shard_prep.prepare(str(corpus), str(tmp_path / "out"), workers=1, progress=False,
                           doc_boundaries=True)
  assert out["dtype"] == "uint16" and out["total_docs"] == 50
  stream = shards.TokenShards(str(tmp_path / "out"))
  want = reference_stream(DOCS_A + DOCS_B)   # files in sorted order: a.jsonl, b.txt
  assert stream.num_tokens == len(want) == out["total_tokens"]
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens), want)
  ends = np.load(tmp_path / "out" / "shard_00000.docs.npy")
  assert len(ends) == len(DOCS_A) and (want[ends - 1] == ByteTokenizer.eos_id).all()


def test_shard_batches_equal_jsonl_batches(corpus, tmp_path):
  """Same documents through `jsonl` (tokenised in memory) and `shards`: identical batches,
  shuffle and eval split included; windows span shard boundaries (shards of ~30 tokens)."""
  src = tmp_path / "many"
  src.mkdir()
  for i, d in enumerate(DOCS_A):
    (src / f"{i:03d}.jsonl").write_text(json.dumps({"text": d}) + "\n")
  shard_prep.prepare(str(src), str(tmp_path / "out"), workers=2, progress=False)
  paths = ",".join(str(src / f"{i:03d}.jsonl") for i in range(len(DOCS_A)))
  ref_cfg = data_config(source="jsonl", paths=paths)
  cfg = data_config(source="shards", paths=str(tmp_path / "out"))
  ref = pipeline.make_train_iterator(ref_cfg, seed=3)
  it = pipeline.make_train_iterator(cfg, seed=3)
  for _ in range(12):  # past one epoch
    a, b = next(ref), next(it)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
      assert a[k].dtype == b[k].dtype
  ev_ref = pipeline.make_eval_batches(ref_cfg, seed=0, num_batches=2, batch_size=2)
  ev = pipeline.make_eval_batches(cfg, seed=0, num_batches=2, batch_size=2)
  for a, b in zip(ev_ref, ev):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert pipeline.vocab_size_needed(cfg) == 257


def test_resume_and_host_rows(corpus, tmp_path):
  shard_prep.prepare(str(corpus), str(tmp_path / "out"), workers=1, progress=False)
  cfg = data_config(source="shards", paths=str(tmp_path / "out"))
  it = pipeline.make_train_iterator(cfg, seed=1)
  [next(it) for _ in range(5)]
  state = json.loads(json.dumps(pipeline.iterator_state(it)))
  expected = [next(it) for _ in range(3)]
  resumed = pipeline.make_train_iterator(cfg, seed=1)
  pipeline.restore_iterator(resumed, state)
  for a in expected:
    np.testing.assert_array_equal(next(resumed)["inputs"], a["inputs"])
  full = next(pipeline.make_train_iterator(cfg, seed=1))
  hosts = [next(pipeline.make_train_iterator(cfg, seed=1, process_index=h, process_count=2))
           for h in range(2)]
  np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in hosts]), full["inputs"])


def test_large_vocabulary_uses_uint32(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {f"w{i}": i for i in range(70000)}
  vocab["<|endoftext|>"] = 70000
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|endoftext|>"])
  tok_path = str(tmp_path / "tok.json")
  tok.save(tok_path)
  (tmp_path / "in.txt").write_text("w69999 w5\nw65536 w1 w2\n")
  out = shard_prep.prepare(str(tmp_path / "in.txt"), str(tmp_path / "out"), tokenizer=tok_path,
                           workers=1, progress=False)
  assert out["dtype"] == "uint32"
  stream = shards.TokenShards(str(tmp_path / "out"))
  np.testing.assert_array_equal(stream.read(0, 7), [69999, 5, 70000, 65536, 1, 2, 70000])
  assert shard_prep.token_dtype(65536) == np.uint16 and shard_prep.token_dtype(65537) == np.uint32
  # Training with another tokenizer than the shards were made with is an error.
  with pytest.raises(ValueError, match="data.tokenizer='bytes' is not the tokenizer"):
    shards.make_shard_source(data_config(source="shards", paths=str(tmp_path / "out"),
                                         seq_len=2, eval_fraction=0.0))


def test_parquet_input(tmp_path):
  pa = pytest.importorskip("pyarrow")  # in the dev extra
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": DOCS_B, "n": list(range(20))}), tmp_path / "d.parquet")
  shard_prep.prepare(str(tmp_path / "d.parquet"), str(tmp_path / "out"), workers=1, progress=False)
  stream = shards.TokenShards(str(tmp_path / "out"))
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens), reference_stream(DOCS_B))
  (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(doc_reader.DataError, match="bad.parquet: not a readable Parquet file"):
    shard_prep.prepare(str(tmp_path / "bad.parquet"), str(tmp_path / "o2"), workers=1,
                       progress=False)


def test_zstd_input(tmp_path):
  zstandard = pytest.importorskip("zstandard")  # in the dev extra
  raw = "".join(json.dumps({"text": d}) + "\n" for d in DOCS_A).encode()
  (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
  shard_prep.prepare(str(tmp_path / "a.jsonl.zst"), str(tmp_path / "out"), workers=1,
                     progress=False)
  stream = shards.TokenShards(str(tmp_path / "out"))
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens), reference_stream(DOCS_A))
  (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
  with pytest.raises(doc_reader.DataError, match="bad.jsonl.zst: corrupt zstd"):
    shard_prep.prepare(str(tmp_path / "bad.jsonl.zst"), str(tmp_path / "o2"), workers=1,
                       progress=False)


def _bad_corpus(tmp_path):
  src = tmp_path / "bad"
  src.mkdir()
  (src / "a.jsonl").write_bytes(b'{"text": "good"}\n{"text": "bad \xff byte"}\n{"text": 3}\n'
                                b'{not json\n{"text": "fine"}\n')
  (src / "empty.txt").write_bytes(b"")
  return src


def test_bad_data_errors_name_file_and_line(tmp_path):
  src = _bad_corpus(tmp_path)
  with pytest.raises(doc_reader.DataError, match=r"a\.jsonl:2: not valid UTF-8"):
    shard_prep.prepare(str(src / "a.jsonl"), str(tmp_path / "o"), workers=1, progress=False)
  with pytest.raises(doc_reader.DataError, match=r"empty\.txt: empty file"):
    shard_prep.prepare(str(src / "empty.txt"), str(tmp_path / "o"), workers=1, progress=False)


def test_bad_data_skip_mode_counts_and_lists(tmp_path):
  src = _bad_corpus(tmp_path)
  out = shard_prep.prepare(str(src), str(tmp_path / "o"), workers=1, progress=False,
                           on_error="skip")
  assert out["total_docs"] == 2 and out["skipped_records"] == 4
  assert out["skipped_files"] == [str(src / "empty.txt")]
  listed = "\n".join(out["skipped_examples"])
  for where in ("a.jsonl:2: not valid UTF-8", "a.jsonl:3: field 'text' is a int",
                "a.jsonl:4: invalid JSON", "empty.txt: empty file"):
    assert where in listed
  stream = shards.TokenShards(str(tmp_path / "o"))
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens),
                                reference_stream(["good", "fine"]))


def test_corrupt_shards_are_detected(corpus, tmp_path):
  out_dir = tmp_path / "out"
  shard_prep.prepare(str(corpus), str(out_dir), workers=1, progress=False)
  assert shards.verify_shards(str(out_dir)) == []
  shard = out_dir / "shard_00001.bin"
  data = bytearray(shard.read_bytes())
  data[10] ^= 0xFF
  shard.write_bytes(bytes(data))             # flipped bytes: size unchanged, hash differs
  assert any("shard_00001.bin: sha256" in p for p in shards.verify_shards(str(out_dir)))
  shard.write_bytes(bytes(data[:-3]))        # truncated: detected when opening, O(1)
  with pytest.raises(ValueError, match="corrupt token shard .*shard_00001.bin"):
    shards.TokenShards(str(out_dir))
  shard.unlink()
  with pytest.raises(FileNotFoundError, match="token shard missing: .*shard_00001.bin"):
    shards.TokenShards(str(out_dir))
  (out_dir / "index.json").unlink()          # e.g. preparation interrupted
  with pytest.raises(FileNotFoundError, match="no index.json"):
    shards.TokenShards(str(out_dir))
  with pytest.raises(FileExistsError):
    shard_prep.prepare(str(corpus), str(tmp_path / "o2"), workers=1, progress=False)
    shard_prep.prepare(str(corpus), str(tmp_path / "o2"), workers=1, progress=False)


def test_building_the_source_reads_no_token_data(corpus, tmp_path, monkeypatch):
  shard_prep.prepare(str(corpus), str(tmp_path / "out"), workers=1, progress=False)
  opened = []
  real = np.memmap
  monkeypatch.setattr(shards.np, "memmap", lambda *a, **k: opened.append(a) or real(*a, **k))
  source = shards.make_shard_source(data_config(source="shards", paths=str(tmp_path / "out")))
  assert opened == []
  assert len(pickle.dumps(source)) < 4096    # grain workers get paths, not data
  source[len(source) - 1]
  assert len(opened) >= 1


# ------------------------------------------------------------------ record streams (Hugging Face)

RECORDS = ([{"text": d, "id": i} for i, d in enumerate(DOCS_A)]
           + [{"text": "", "id": -1}]   # an empty document is not a document (as in JSONL)
           + [{"text": d, "id": 100 + i} for i, d in enumerate(DOCS_B)])


def _write_jsonl(path, records):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def _shard_files(out):
  index = json.loads((out / formats.INDEX).read_text())
  return index, [(out / s["file"]).read_bytes() for s in index["shards"]]


def _assert_same_shards(got, want):
  (gi, gb), (wi, wb) = _shard_files(got), _shard_files(want)
  assert gb == wb and len(gb) == len(wi["shards"])   # byte-identical shards, same order
  for key in ("dtype", "tokenizer", "total_tokens", "total_docs"):
    assert gi[key] == wi[key], key
  for g, w in zip(gi["shards"], wi["shards"]):   # "bytes"/"source" describe the input
    assert (g["file"], g["tokens"], g["docs"], g["sha256"]) == (
        w["file"], w["tokens"], w["docs"], w["sha256"])


def _loader(records, calls):
  """A stand-in for `shard_prep.hf_records`: records from memory, arguments recorded."""
  def load(name, *, split, config, data_files):
    calls.append((name, split, config, data_files))
    return iter(records)
  return load


def test_records_give_the_shards_of_the_same_jsonl(tmp_path):
  """A record stream (what --hf_dataset streams) and the same records as JSONL: identical
  shards; with docs_per_shard=k, the shards of k-record JSONL files, tokenised in 2 workers."""
  _write_jsonl(tmp_path / "all.jsonl", RECORDS)
  shard_prep.prepare(str(tmp_path / "all.jsonl"), str(tmp_path / "from_jsonl"), workers=1,
                     progress=False, doc_boundaries=True)
  calls = []
  out = shard_prep.prepare_hf("org/corpus", str(tmp_path / "from_hf"), split="train", config="en",
                              load=_loader(RECORDS, calls), workers=1, progress=False,
                              doc_boundaries=True)
  assert calls == [("org/corpus", "train", "en", None)]
  assert out["shards"][0]["source"] == "hf:org/corpus/en[train] records 1-51"
  _assert_same_shards(tmp_path / "from_hf", tmp_path / "from_jsonl")
  np.testing.assert_array_equal(np.load(tmp_path / "from_hf" / "shard_00000.docs.npy"),
                                np.load(tmp_path / "from_jsonl" / "shard_00000.docs.npy"))
  stream = shards.TokenShards(str(tmp_path / "from_hf"))
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens),
                                reference_stream(DOCS_A + DOCS_B))

  docs = [r for r in RECORDS if r["text"]]
  parts = tmp_path / "parts"
  parts.mkdir()
  for k in range(0, len(docs), 12):
    _write_jsonl(parts / f"{k:03d}.jsonl", docs[k:k + 12])
  shard_prep.prepare(str(parts), str(tmp_path / "parts_out"), workers=1, progress=False)
  out = shard_prep.prepare_records(iter(docs), str(tmp_path / "chunked"), source="mem",
                                   docs_per_shard=12, workers=2, progress=False)
  assert len(out["shards"]) == 5 and out["total_docs"] == 50
  _assert_same_shards(tmp_path / "chunked", tmp_path / "parts_out")


def test_bad_records_name_the_record(tmp_path):
  bad = [{"text": "good"}, {"content": "x"}, {"text": 3}, "not a dict", {"text": "fine"}]
  with pytest.raises(doc_reader.DataError, match=r"hf:d\[train\]:record 2: no field 'text'"):
    shard_prep.prepare_hf("d", str(tmp_path / "o"), load=_loader(bad, []), workers=1,
                          progress=False)
  out = shard_prep.prepare_hf("d", str(tmp_path / "o2"), load=_loader(bad, []), workers=1,
                              progress=False, on_error="skip")
  assert out["total_docs"] == 2 and out["skipped_records"] == 3
  assert "hf:d[train]:record 3: field 'text' is a int, not a string" in out["skipped_examples"]
  stream = shards.TokenShards(str(tmp_path / "o2"))
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens),
                                reference_stream(["good", "fine"]))
  with pytest.raises(doc_reader.DataError, match=r"no usable documents in hf:d\[train\]"):
    shard_prep.prepare_hf("d", str(tmp_path / "o3"), load=_loader([{"text": ""}], []), workers=1,
                          progress=False)
  with pytest.raises(ValueError, match="docs_per_shard must be >= 1"):
    shard_prep.prepare_records([], str(tmp_path / "o4"), source="s", docs_per_shard=0)


def test_hf_records_without_datasets_names_the_extra(monkeypatch):
  import sys
  monkeypatch.setitem(sys.modules, "datasets", None)   # import datasets -> ImportError
  with pytest.raises(ImportError, match=r'--hf_dataset needs .*pip install "attn_jax\[hf\]"'):
    shard_prep.hf_records("org/corpus")


def test_prepare_data_cli_streams_a_local_hf_json_dataset(tmp_path):
  """experiments/prepare_data.py --hf_dataset=json --hf_data_files=<local JSONL>: the real
  `datasets.load_dataset(..., streaming=True)` wrapper, same shards as --input."""
  pytest.importorskip("datasets")
  import subprocess
  import sys
  _write_jsonl(tmp_path / "all.jsonl", RECORDS)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.join(root, "experiments", "prepare_data.py")
  env = dict(os.environ, PYTHONPATH=root, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")

  def cli(*args):
    return subprocess.run([sys.executable, script, "--workers=1", *args], env=env,
                          capture_output=True, text=True, timeout=300)

  r = cli(f"--input={tmp_path / 'all.jsonl'}", f"--output={tmp_path / 'a'}")
  assert r.returncode == 0, r.stderr[-2000:]
  r = cli("--hf_dataset=json", f"--hf_data_files={tmp_path / 'all.jsonl'}",
          f"--output={tmp_path / 'b'}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "50 documents" in r.stdout
  _assert_same_shards(tmp_path / "b", tmp_path / "a")
  r = cli(f"--input={tmp_path / 'all.jsonl'}", "--hf_dataset=json", f"--output={tmp_path / 'c'}")
  assert r.returncode == 2 and "exactly one of --input and --hf_dataset" in r.stderr
