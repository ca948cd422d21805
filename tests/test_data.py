"""Tests for attn_jax.data: MQAR correctness, packing, per-host sharding, iterator checkpoints,
and the error messages for bad inputs. Tiny shapes; the whole file runs in seconds."""

import json
import time

import numpy as np
import pytest

from attn_jax.data import pipeline, synthetic, text
from attn_jax.data.tokenizer import ByteTokenizer, get_tokenizer
from configs.base import get_config


def data_config(**overrides):
  cfg = get_config().data
  cfg.update(seq_len=32, global_batch_size=8, read_threads=0, prefetch_batches=2,
             mqar_num_pairs=6, mqar_num_queries=3, mqar_vocab=16)
  cfg.update(**overrides)
  return cfg


def write_lines(path, lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


@pytest.fixture
def small_corpus(tmp_path):
  """A bytes-tokenized text corpus of 40 short documents (~1.2k tokens)."""
  documents = [f"document {i}: " + "abcdefghij"[: 1 + i % 10] * 3 for i in range(40)]
  path = write_lines(tmp_path / "corpus.txt", documents)
  return path, documents


def text_config(path, **overrides):
  return data_config(source="text", paths=path, tokenizer="bytes", **overrides)


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


# ------------------------------------------------------------------------------ MQAR


def mqar_examples(cfg, count, *, seed=0, split="train"):
  source = synthetic.SyntheticSource(cfg, seed=seed, split=split)
  return [source[i] for i in range(count)]


def test_mqar_weighted_targets_are_the_values_of_the_queried_keys():
  cfg = data_config()
  num_pairs, num_queries, vocab = 6, 3, 16
  for example in mqar_examples(cfg, 100):
    inputs, targets, weights = example["inputs"], example["targets"], example["weights"]
    assert inputs.shape == targets.shape == weights.shape == (cfg.seq_len,)
    assert inputs.dtype == targets.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(inputs[1:], targets[:-1])  # targets are the next token
    tokens = np.concatenate([inputs, targets[-1:]])
    assert tokens.min() >= 0 and tokens.max() < synthetic.mqar_vocab_size(cfg) == 3 * vocab

    keys, values = tokens[0 : 2 * num_pairs : 2], tokens[1 : 2 * num_pairs : 2]
    assert np.all(keys < vocab) and len(set(keys)) == num_pairs
    assert np.all((values >= vocab) & (values < 2 * vocab)) and len(set(values)) == num_pairs
    value_of_key = dict(zip(keys.tolist(), values.tolist()))

    answer_positions = np.flatnonzero(weights)
    assert set(np.unique(weights)) <= {0.0, 1.0} and len(answer_positions) == num_queries
    assert answer_positions.min() >= 2 * num_pairs  # queries come after all pairs
    queried_keys = inputs[answer_positions]
    assert len(set(queried_keys.tolist())) == num_queries  # distinct keys
    for position in answer_positions:
      assert targets[position] == value_of_key[int(inputs[position])]

    # Outside the pairs and the query/answer slots there is only noise from [2V, 3V).
    is_qa_slot = np.zeros(len(tokens), bool)
    is_qa_slot[answer_positions] = is_qa_slot[answer_positions + 1] = True
    tail = tokens[2 * num_pairs :][~is_qa_slot[2 * num_pairs :]]
    assert np.all(tail >= 2 * vocab)


def test_mqar_answer_is_not_predictable_from_local_context():
  cfg = data_config()
  # Fit the best "previous token -> next token" table on weighted positions of some examples;
  # on fresh examples it must be near chance, because the key -> value map is redrawn per
  # example.
  answers_after = {}
  for example in mqar_examples(cfg, 300):
    for p in np.flatnonzero(example["weights"]):
      answers_after.setdefault(int(example["inputs"][p]), []).append(int(example["targets"][p]))
  bigram = {k: np.bincount(v).argmax() for k, v in answers_after.items()}
  assert all(len(set(v)) > 1 for v in answers_after.values() if len(v) >= 5)

  hits = total = 0
  for example in mqar_examples(cfg, 300, seed=1):
    for p in np.flatnonzero(example["weights"]):
      hits += bigram.get(int(example["inputs"][p]), -1) == example["targets"][p]
      total += 1
  assert hits / total < 2 / cfg.mqar_num_pairs  # chance is 1/mqar_vocab = 0.06


def test_synthetic_is_deterministic_given_seed_and_index():
  cfg = data_config()
  source = synthetic.SyntheticSource(cfg, seed=3)
  assert_batches_equal([source[5], source[7]], [synthetic.SyntheticSource(cfg, seed=3)[i]
                                                for i in (5, 7)])
  other_seed = synthetic.SyntheticSource(cfg, seed=4)[5]
  eval_split = synthetic.SyntheticSource(cfg, seed=3, split="eval")[5]
  assert not np.array_equal(source[5]["inputs"], other_seed["inputs"])
  assert not np.array_equal(source[5]["inputs"], eval_split["inputs"])

  first = take(pipeline.make_train_iterator(cfg, seed=3), 3)
  again = take(pipeline.make_train_iterator(cfg, seed=3), 3)
  assert_batches_equal(first, again)


def test_random_task_tokens_and_weights():
  cfg = data_config(synthetic_task="random", random_vocab=50)
  batch = next(pipeline.make_train_iterator(cfg, seed=0))
  assert batch["inputs"].shape == (8, 32) and batch["inputs"].max() < 50
  np.testing.assert_array_equal(batch["weights"], np.ones((8, 32), np.float32))
  assert pipeline.vocab_size_needed(cfg) == 50


def test_mqar_bad_config_errors_name_the_field():
  with pytest.raises(ValueError, match=r"data.seq_len=8 is too short for MQAR"):
    synthetic.SyntheticSource(data_config(seq_len=8), seed=0)
  with pytest.raises(ValueError, match=r"data.mqar_num_queries must be in \[1, "):
    synthetic.SyntheticSource(data_config(mqar_num_queries=7), seed=0)
  with pytest.raises(ValueError, match=r"data.mqar_num_pairs=6 exceeds data.mqar_vocab=4"):
    synthetic.SyntheticSource(data_config(mqar_vocab=4), seed=0)
  with pytest.raises(ValueError, match=r"data.synthetic_task must be one of"):
    pipeline.make_train_iterator(data_config(synthetic_task="copy"), seed=0)
  with pytest.raises(ValueError, match=r"data.source must be one of"):
    pipeline.make_train_iterator(data_config(source="parquet"), seed=0)


def test_vocab_size_needed():
  assert pipeline.vocab_size_needed(data_config()) == 48
  assert pipeline.vocab_size_needed(data_config(source="text", tokenizer="bytes")) == 257


# ------------------------------------------------------------------------------ text


def test_packing_round_trips_to_documents_and_eos(small_corpus):
  path, documents = small_corpus
  cfg = text_config(path, eval_fraction=0.0)
  tokenizer = ByteTokenizer()
  expected_stream = [t for d in documents for t in tokenizer.encode(d) + [tokenizer.eos_id]]
  source = text.make_text_source(cfg)
  assert len(source) == (len(expected_stream) - 1) // cfg.seq_len

  inputs = np.concatenate([source[i]["inputs"] for i in range(len(source))])
  targets = np.concatenate([source[i]["targets"] for i in range(len(source))])
  np.testing.assert_array_equal(inputs, expected_stream[: len(inputs)])
  np.testing.assert_array_equal(targets, expected_stream[1 : len(inputs) + 1])
  # Split the packed inputs at EOS: the pieces decode back to the documents, in order.
  eos_positions = np.flatnonzero(inputs == tokenizer.eos_id)
  pieces = np.split(inputs, eos_positions + 1)[:-1]
  decoded = [tokenizer.decode(piece[:-1]) for piece in pieces]
  assert decoded == documents[: len(decoded)] and len(decoded) >= len(documents) - 2
  assert np.all(source[0]["weights"] == 1.0)


def test_jsonl_documents_from_text_field(tmp_path):
  records = [{"id": i, "body": f"record number {i} " * 3} for i in range(20)]
  path = write_lines(tmp_path / "corpus.jsonl", [json.dumps(r) for r in records] + [""])
  cfg = data_config(source="jsonl", paths=path, text_field="body", tokenizer="bytes",
                    eval_fraction=0.0)
  assert text.read_jsonl_documents(path, text_field="body") == [r["body"] for r in records]
  stream = text.load_token_stream(cfg)
  assert (stream == ByteTokenizer.eos_id).sum() == 20
  batch = next(pipeline.make_train_iterator(cfg, seed=0))
  assert batch["inputs"].shape == (8, 32) and batch["inputs"].dtype == np.int32


def test_text_document_modes(tmp_path):
  path = write_lines(tmp_path / "poem.txt", ["first line", "", "second line"])
  assert text.read_text_documents(path) == ["first line", "second line"]
  assert text.read_text_documents(path, text_document="file") == [
      "first line\n\nsecond line\n"]


def test_text_epochs_cover_the_train_split_and_reshuffle(small_corpus):
  path, _ = small_corpus
  cfg = text_config(path, global_batch_size=1)
  train = text.make_text_source(cfg)
  held_out = text.make_text_source(cfg, split="eval")
  assert len(held_out) == int(np.ceil(0.01 * (len(train) + len(held_out)))) == 1
  iterator = pipeline.make_train_iterator(cfg, seed=0)
  epochs = [[next(iterator)["inputs"][0].tobytes() for _ in range(len(train))]
            for _ in range(2)]
  train_sequences = sorted(train[i]["inputs"].tobytes() for i in range(len(train)))
  assert sorted(epochs[0]) == sorted(epochs[1]) == train_sequences  # each exactly once
  assert epochs[0] != epochs[1]  # a new order every epoch
  assert held_out[0]["inputs"].tobytes() not in train_sequences


def test_eval_batches_are_held_out_and_fixed(small_corpus):
  path, _ = small_corpus
  cfg = text_config(path, eval_fraction=0.25, global_batch_size=2)
  num_train = len(text.make_text_source(cfg))
  batches = pipeline.make_eval_batches(cfg, seed=0, num_batches=100)
  num_eval = len(text.make_text_source(cfg, split="eval"))
  assert len(batches) == num_eval // 2  # only the full batches there are
  stream = text.load_token_stream(cfg)
  first_eval_start = num_train * cfg.seq_len
  np.testing.assert_array_equal(batches[0]["inputs"][0],
                                stream[first_eval_start : first_eval_start + cfg.seq_len])
  assert_batches_equal(batches, pipeline.make_eval_batches(cfg, seed=0, num_batches=100))

  synthetic_cfg = data_config()
  synthetic_eval = pipeline.make_eval_batches(synthetic_cfg, seed=0, num_batches=2)
  assert len(synthetic_eval) == 2
  train_batch = next(pipeline.make_train_iterator(synthetic_cfg, seed=0))
  assert not np.array_equal(synthetic_eval[0]["inputs"], train_batch["inputs"])


def _check_text_with_tokenizer(corpus_path, tokenizer_path):
  """One document per non-blank line, each followed by EOS: the stream is exactly the
  tokenizer's encoding of the lines; returns (stream, tokenizer, config)."""
  cfg = data_config(source="text", paths=str(corpus_path), tokenizer=str(tokenizer_path),
                    seq_len=256)
  stream = text.load_token_stream(cfg)
  tokenizer = get_tokenizer(str(tokenizer_path))
  assert pipeline.vocab_size_needed(cfg) == tokenizer.vocab_size
  assert stream.max() < tokenizer.vocab_size
  first_eos = int(np.flatnonzero(stream == tokenizer.eos_id)[0])
  assert tokenizer.decode(stream[:first_eos]) == "First Citizen:"
  batch = next(pipeline.make_train_iterator(cfg, seed=0))
  assert batch["inputs"].shape == (8, 256)
  return stream, tokenizer, cfg


def test_tinyshakespeare_excerpt_with_a_bpe_tokenizer(bench_data, tiny_bpe_path):
  corpus = bench_data / "tinyshakespeare" / "input.txt"
  stream, tokenizer, _ = _check_text_with_tokenizer(corpus, tiny_bpe_path)
  lines = [ln for ln in corpus.read_text(encoding="utf-8").split("\n") if ln.strip()]
  want = [i for ln in lines for i in tokenizer.encode(ln) + [tokenizer.eos_id]]
  np.testing.assert_array_equal(stream, want)
  assert tokenizer.vocab_size == 1024


def test_tinyshakespeare_with_neox_tokenizer(full_data):
  """The whole file with the real NeoX tokenizer: its size, and the load time."""
  start = time.perf_counter()
  stream, tokenizer, _ = _check_text_with_tokenizer(
      full_data / "tinyshakespeare" / "input.txt",
      full_data / "tokenizer_neox" / "20B_tokenizer.json")
  assert time.perf_counter() - start < 15.0
  assert tokenizer.vocab_size == 50277 and 250_000 < len(stream) < 400_000


# ------------------------------------------------------------------------------ hosts


@pytest.mark.parametrize("source", ["synthetic", "text"])
@pytest.mark.parametrize("process_count", [2, 4])
def test_host_shards_are_disjoint_and_union_to_the_global_batch(small_corpus, source,
                                                                process_count):
  path, _ = small_corpus
  cfg = text_config(path) if source == "text" else data_config()
  single_host = take(pipeline.make_train_iterator(cfg, seed=5), 4)
  per_host = [take(pipeline.make_train_iterator(cfg, seed=5, process_index=h,
                                                process_count=process_count), 4)
              for h in range(process_count)]
  host_batch = cfg.global_batch_size // process_count
  for step, global_batch in enumerate(single_host):
    for key in global_batch:
      shards = [per_host[h][step][key] for h in range(process_count)]
      assert all(s.shape[0] == host_batch for s in shards)
      # Host h holds the contiguous block h of the global batch.
      np.testing.assert_array_equal(np.concatenate(shards), global_batch[key])
  if source == "synthetic":  # every example differs, so disjointness is checkable by value
    rows = [r.tobytes() for host in per_host for b in host for r in b["inputs"]]
    assert len(set(rows)) == len(rows)


def test_explicit_host_rows_read_exactly_those_rows_of_every_global_batch():
  cfg = data_config()
  single_host = take(pipeline.make_train_iterator(cfg, seed=5), 3)
  rows = slice(2, 7)  # e.g. what sharding.host_batch_rows gives for this host's devices
  host = take(pipeline.make_train_iterator(cfg, seed=5, host_rows=rows), 3)
  for global_batch, mine in zip(single_host, host):
    for key in global_batch:
      np.testing.assert_array_equal(mine[key], global_batch[key][rows])
  with pytest.raises(ValueError, match="host_rows"):
    pipeline.make_train_iterator(cfg, seed=5, host_rows=slice(4, 9))


def test_batch_size_must_divide_by_process_count():
  with pytest.raises(ValueError, match=r"data.global_batch_size=8 is not divisible by .* 3"):
    pipeline.make_train_iterator(data_config(), seed=0, process_index=0, process_count=3)
  with pytest.raises(ValueError, match=r"process_index=2, process_count=2"):
    pipeline.make_train_iterator(data_config(), seed=0, process_index=2, process_count=2)


# ------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_iterator_state_restore_resumes_exactly(small_corpus, source):
  path, _ = small_corpus
  cfg = text_config(path, read_threads=2, prefetch_batches=4) if source == "text" else (
      data_config(read_threads=2, prefetch_batches=4))
  iterator = pipeline.make_train_iterator(cfg, seed=1)
  take(iterator, 7)  # text: past the first epoch (36 sequences = 4.5 batches)
  state = json.loads(json.dumps(pipeline.iterator_state(iterator)))
  expected = take(iterator, 4)

  resumed = pipeline.make_train_iterator(cfg, seed=1)
  pipeline.restore_iterator(resumed, state)
  assert_batches_equal(take(resumed, 4), expected)


def test_iterator_orbax_checkpoint_round_trip(small_corpus, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  path, _ = small_corpus
  cfg = text_config(path)
  iterator = pipeline.make_train_iterator(cfg, seed=2)
  take(iterator, 3)
  with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
    manager.save(3, args=ocp.args.Composite(data_iter=pipeline.iterator_save_args(iterator)))
    manager.wait_until_finished()
  expected = take(iterator, 3)

  fresh = pipeline.make_train_iterator(cfg, seed=2)
  with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
    restored = manager.restore(
        3, args=ocp.args.Composite(data_iter=pipeline.iterator_restore_args(fresh)))
  assert restored.data_iter is fresh
  assert_batches_equal(take(fresh, 3), expected)


# ------------------------------------------------------------------------------ bad inputs


def test_missing_file_error_names_the_path(tmp_path):
  missing = str(tmp_path / "nope.txt")
  with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.txt"):
    pipeline.make_train_iterator(text_config(missing), seed=0)
  with pytest.raises(ValueError, match=r"data.paths is empty"):
    pipeline.make_train_iterator(text_config(""), seed=0)


def test_empty_file_error_names_the_path(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n  \n")
  with pytest.raises(ValueError, match=r"data file is empty: .*empty\.jsonl"):
    text.load_token_stream(data_config(source="jsonl", paths=str(empty)))


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "unterminated', r"bad\.jsonl:2: invalid JSON"),
    ('{"body": "no text field"}', r"bad\.jsonl:2: missing field 'text' \(data.text_field\)"),
    ('["a", "list"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"text": 17}', r"bad\.jsonl:2: field 'text' must be a string, got int"),
])
def test_malformed_jsonl_line_error_names_file_and_line(tmp_path, bad_line, message):
  path = write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', bad_line, '{"text": "ok"}'])
  with pytest.raises(ValueError, match=message):
    text.load_token_stream(data_config(source="jsonl", paths=path))


def test_corrupt_tokenizer_file_error_names_the_path(tmp_path):
  from attn_jax.data.tokenizer import get_tokenizer
  path = tmp_path / "tokenizer.json"
  path.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')   # truncated
  with pytest.raises(ValueError, match=r"tokenizer file .*tokenizer\.json.* not a valid"):
    get_tokenizer(str(path))


def test_too_few_tokens_error(tmp_path):
  path = write_lines(tmp_path / "short.txt", ["tiny"])  # 5 tokens with EOS
  with pytest.raises(ValueError, match=r"too few tokens .* do not fill one sequence of "
                                       r"data.seq_len \+ 1 = 33 tokens"):
    pipeline.make_train_iterator(text_config(path), seed=0)
  path = write_lines(tmp_path / "one_sequence.txt", ["x" * 40])  # exactly 1 sequence
  with pytest.raises(ValueError, match=r"too few tokens .* leaving none to train on"):
    pipeline.make_train_iterator(text_config(path), seed=0)
  next(pipeline.make_train_iterator(text_config(path, eval_fraction=0.0), seed=0))


@pytest.mark.parametrize("eos", ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"])
def test_hf_tokenizer_finds_the_eos_of_each_family(tmp_path, eos):
  from tokenizers import Tokenizer, models
  from attn_jax.data.tokenizer import HFTokenizer
  tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
  tok.add_special_tokens(["<pad>", eos])
  tok.save(str(tmp_path / "tok.json"))
  assert HFTokenizer(tmp_path / "tok.json").eos_id == tok.token_to_id(eos) == 3


def test_hf_tokenizer_takes_the_eos_its_tokenizer_config_declares(tmp_path):
  """A Hugging Face folder's tokenizer_config.json names the EOS (SmolLM2-Instruct: <|im_end|>,
  not the <|endoftext|> the name list finds first); an explicit eos_id overrides both."""
  from tokenizers import Tokenizer, models
  from attn_jax.data.tokenizer import HFTokenizer
  tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
  tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  assert HFTokenizer(tmp_path / "tokenizer.json").eos_id == 2   # no config: by name
  for declared in ("<|im_end|>", {"content": "<|im_end|>", "special": True}):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": declared}))
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_id == 3
  assert HFTokenizer(tmp_path / "tokenizer.json", eos_id=1).eos_id == 1
  assert HFTokenizer.wrap(tok, eos_id=3).eos_id == 3 and HFTokenizer.wrap(tok).eos_id == 2
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
  with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<\|eot\|>' is not "
                                       "in the tokenizer's vocabulary"):
    HFTokenizer(tmp_path / "tokenizer.json")
  with pytest.raises(ValueError, match=r"EOS id 9 is outside its vocabulary \(4 ids\)"):
    HFTokenizer(tmp_path / "tokenizer.json", eos_id=9)


def test_hf_tokenizer_without_eos_names_the_file(tmp_path):
  from tokenizers import Tokenizer, models
  from attn_jax.data.tokenizer import HFTokenizer
  Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tok.json"))
  with pytest.raises(ValueError, match="tok.json.*no EOS token"):
    HFTokenizer(tmp_path / "tok.json")
