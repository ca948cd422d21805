"""Rotten data never trains silently: a token shard whose bytes changed
after it was verified, with its size and mtime kept (bit rot, `cp -p` / `rsync -a` of a bad
copy), is caught at the next start (data.verify_mb); a token id outside the vocabulary is an
error naming the shard and offset as the window is read, in the reader and through a training
run (which used to end with status 0, every loss NaN); and a run whose every step is skipped as
non-finite ends with NonFiniteTrainingError, not a result."""

import json
import os

import numpy as np
import pytest

from attn_jax.data import doc_reader, pipeline, shard_checks, shard_prep, shards
from attn_jax.train import loss_monitor, setup as setup_lib, trainer as trainer_lib
from tests.test_shards import data_config
from tests.test_train import tiny_config


@pytest.fixture
def prepared(tmp_path, monkeypatch):
  """Three shards (~1.2 KB each) of byte tokens, verified once; the verification cache private
  to the test."""
  monkeypatch.setenv("ATTN_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(shard_checks, "_VERIFIED_HERE", {}, raising=False)
  src = tmp_path / "src"
  src.mkdir()
  for i in range(3):
    (src / f"d{i}.txt").write_text("\n".join(f"document {i} {j} " * 6 for j in range(12)))
  out = tmp_path / "out"
  shard_prep.prepare(str(src), str(out), workers=1, progress=False)
  shards.TokenShards(str(out))
  return out


def new_start(monkeypatch):
  """What a new process starts from: the on-disk verification cache only."""
  monkeypatch.setattr(shard_checks, "_VERIFIED_HERE", {}, raising=False)


def rot(path, offset_tokens, value):
  """Writes token `value` at `offset_tokens` of shard `path` keeping its size and mtime (what
  bit rot or a copy that kept the mtime leaves); returns the old token."""
  st = os.stat(path)
  data = np.fromfile(path, np.uint16)
  old = int(data[offset_tokens])
  data[offset_tokens] = value
  data.tofile(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.path.getsize(path) == st.st_size
  return old


def test_a_shard_changed_with_its_mtime_kept_is_caught_at_the_next_start(prepared,
                                                                          monkeypatch):
  old = rot(prepared / "shard_00001.bin", 100, ord("Z"))
  assert old != ord("Z")   # a valid id: only the hash can tell
  new_start(monkeypatch)
  with pytest.raises(doc_reader.DataError, match=r"corrupt token shard .*shard_00001\.bin: its "
                     "sha256 differs"):
    shards.TokenShards(str(prepared))


_SHA256 = shard_checks._sha256_file


def _hashed(monkeypatch):
  """The names of the shards hashed from now on (until the next call)."""
  seen = []
  monkeypatch.setattr(shard_checks, "_sha256_file", lambda p: seen.append(os.path.basename(p))
                      or _SHA256(p))
  return seen


def test_verify_mb_rehashes_a_rotating_sample_of_a_larger_corpus(prepared, monkeypatch):
  size = max(os.path.getsize(prepared / f"shard_0000{i}.bin") for i in range(3))
  one = size * 1.5 / 2**20   # one shard's worth per start
  rounds = []
  for _ in range(3):
    new_start(monkeypatch)
    seen = _hashed(monkeypatch)
    shards.TokenShards(str(prepared), verify_mb=one)
    rounds.append(seen)
  assert [len(r) for r in rounds] == [1, 1, 1], rounds
  assert sorted(sum(rounds, [])) == [f"shard_0000{i}.bin" for i in range(3)]   # all in turn
  for mb, count in ((shard_checks.VERIFY_MB, 3), (-1, 3), (0, 0)):   # default: all of a small one
    new_start(monkeypatch)
    seen = _hashed(monkeypatch)
    shards.TokenShards(str(prepared), verify_mb=mb)
    assert len(seen) == count, (mb, seen)
  new_start(monkeypatch)
  shards.TokenShards(str(prepared))
  seen = _hashed(monkeypatch)
  shards.TokenShards(str(prepared))   # again in the same process (the eval split): not hashed
  assert seen == []


def test_a_bad_verify_mb_names_the_field(prepared):
  with pytest.raises(ValueError, match=r"config.data.verify_mb: must be a number of MB >= 0, "
                     r"or -1 .* got -5"):
    shards.make_shard_source(data_config(source="shards", paths=str(prepared), verify_mb=-5))


def test_an_id_outside_the_vocabulary_names_the_shard_and_offset(prepared, monkeypatch):
  rot(prepared / "shard_00002.bin", 37, 60000)
  new_start(monkeypatch)
  stream = shards.TokenShards(str(prepared), verify_mb=0)   # not re-hashed at this start
  first = stream.starts[2]
  stream.read(0, first)   # the shards before it read fine
  with pytest.raises(doc_reader.DataError, match=(
      r"corrupt token shard .*shard_00002\.bin: token id 60000 at token offset 37 \(byte 74\) "
      r"is outside the vocabulary \(vocab_size 257 in index.json\)")):
    stream.read(first + 30, first + 40)
  cfg = data_config(source="shards", paths=str(prepared), verify_mb=0, shuffle=False,
                    read_threads=2, eval_fraction=0.0)
  it = pipeline.make_train_iterator(cfg, seed=0)
  with pytest.raises(doc_reader.DataError, match=r"shard_00002\.bin: token id 60000"):
    for _ in range(200):   # through grain's read threads, as training reads
      next(it)


def test_a_run_on_a_shard_with_an_id_outside_the_vocabulary_stops_naming_it(prepared,
                                                                           monkeypatch,
                                                                           tmp_path):
  """Before the fix such a run ended with status 0, every loss NaN and "update skipped"."""
  rot(prepared / "shard_00000.bin", 5, 65000)
  new_start(monkeypatch)
  c = tiny_config(steps=4, source="shards", paths=str(prepared), tokenizer="bytes",
                  eval_fraction=0.1, verify_mb=0)
  c.model.vocab_size = 257
  c.data.update(shuffle=False, read_threads=0)
  with pytest.raises(doc_reader.DataError, match=r"shard_00000\.bin: token id 65000 at token "
                     r"offset 5 "):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "run"))


def test_a_run_whose_every_step_is_skipped_ends_in_an_error(tmp_path, monkeypatch):
  """Every batch's weights NaN: every step non-finite and skipped. With fewer steps than
  train.nonfinite_max_consecutive (10) the run used to return a result (status 0)."""
  real = setup_lib.next_batch

  def nan_weights(*a, **k):
    b = real(*a, **k)
    b["weights"] = b["weights"] * np.nan
    return b

  monkeypatch.setattr(setup_lib, "next_batch", nan_weights)
  c = tiny_config(steps=4)
  c.checkpoint.every_steps = 2
  with pytest.raises(loss_monitor.NonFiniteTrainingError, match=(
      r"step 4: .*every one of the 4 steps this run trained \(steps 1-4\) was non-finite and "
      r"skipped.*nonfinite_max_consecutive=10.* The last finite step is 0; the latest "
      r"checkpoint \(from before it\) is step 2")):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "run"))
  rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["nonfinite_steps"] for r in rows] == [1, 2, 3, 4]
