"""The embedded default (configs/quickstart.py): its config is valid, its data is a genuine
key->value lookup task (checked without a model), and the newcomer's example printer
(attn_jax.eval.mqar.describe_examples, attn_jax.eval.run.explain_checkpoint) reports what a model answers.
The full quickstart run is under the slow marker."""

import collections
import re

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.config import validate
from attn_jax.data import pipeline, synthetic
from attn_jax.eval import mqar
from attn_jax.eval.run import explain_checkpoint
from attn_jax.model import build_model
from configs import quickstart


def _source(split, **data_overrides):
  c = quickstart.get_config()
  c.data.update(**data_overrides)
  return synthetic.SyntheticSource(c.data, seed=c.seed, split=split)


def _pairs(example, num_pairs):
  x = example["inputs"]
  return dict(zip(x[0:2 * num_pairs:2].tolist(), x[1:2 * num_pairs:2].tolist()))


def test_config_is_valid_and_holds_the_data_vocabulary():
  c = quickstart.get_config()
  cfg = validate(c).model
  assert cfg.vocab_size >= pipeline.vocab_size_needed(c.data)
  assert c.data.source == "synthetic" and c.data.synthetic_task == "mqar"
  synthetic.check_mqar_config(c.data)
  assert c.data.seq_len <= cfg.max_seq_len


def test_every_answer_is_the_value_paired_with_the_asked_key():
  c = quickstart.get_config().data
  n = c.mqar_num_pairs
  src = _source("eval")
  for i in range(200):
    e = src[i]
    pairs = _pairs(e, n)
    assert len(pairs) == n  # distinct keys
    (pos,) = np.nonzero(e["weights"])
    assert len(pos) == c.mqar_num_queries
    for t in pos:
      assert e["targets"][t] == pairs[int(e["inputs"][t])]


def test_queries_follow_the_pairs_back_to_back_without_noise():
  """The layout the config's docstring states: N pairs, then the N keys asked again in a
  random order, each followed by its value, filling the sequence (no noise tokens)."""
  c = quickstart.get_config().data
  n, v = c.mqar_num_pairs, c.mqar_vocab
  assert c.mqar_num_queries == n and c.seq_len == 4 * n - 1
  src = _source("eval")
  orders = set()
  for i in range(200):
    e = src[i]
    tokens = np.concatenate([e["inputs"], e["targets"][-1:]])
    assert tokens.max() < 2 * v  # keys and values only
    pairs = _pairs(e, n)
    asked = tokens[2 * n::2]
    assert sorted(asked.tolist()) == sorted(pairs)  # every key asked once
    assert [pairs[int(k)] for k in asked] == tokens[2 * n + 1::2].tolist()
    np.testing.assert_array_equal(np.flatnonzero(e["weights"]), np.arange(2 * n, 4 * n - 1, 2))
    orders.add(tuple(list(pairs).index(int(k)) for k in asked))  # the pairs' permutation
  assert len(orders) > 150  # the query order is random, not the pairs' order


def test_answers_are_not_predictable_without_reading_the_pairs():
  """Table predictors fitted on 2,000 training sequences (answer from the asked key, from the
  position, or from both) score at chance on held-out sequences; reading the pairs scores 1."""
  c = quickstart.get_config().data
  n = c.mqar_num_pairs
  train, held = _source("train"), _source("eval")

  def rows(src, count):
    for i in range(count):
      e = src[i]
      for t in np.nonzero(e["weights"])[0]:
        yield int(e["inputs"][t]), int(t), int(e["targets"][t]), e

  tables = {f: collections.defaultdict(collections.Counter) for f in ("key", "pos", "both")}
  for key, t, answer, _ in rows(train, 2000):
    for f, feat in (("key", key), ("pos", t), ("both", (key, t))):
      tables[f][feat][answer] += 1
  hits = collections.Counter()
  total = 0
  for key, t, answer, e in rows(held, 500):
    total += 1
    for f, feat in (("key", key), ("pos", t), ("both", (key, t))):
      guess = tables[f][feat].most_common(1)[0][0] if tables[f][feat] else -1
      hits[f] += guess == answer
    hits["lookup"] += _pairs(e, n)[key] == answer
  assert hits["lookup"] == total
  # Answers are uniform over the V value ids given key or position: chance is 1/V (3.1% for
  # V = 32); 8% is > 6 standard errors above it at 4,000 answers.
  for f in ("key", "pos", "both"):
    assert hits[f] / total < 0.08, (f, hits[f] / total)


def test_train_and_eval_streams_differ():
  train, held = _source("train"), _source("eval")
  assert not any(np.array_equal(train[i]["inputs"], held[i]["inputs"]) for i in range(50))


def test_guess_baselines_match_a_simulated_guesser():
  c = quickstart.get_config().data
  n, m, v = c.mqar_num_pairs, c.mqar_num_queries, c.mqar_vocab
  base = mqar.guess_baselines(n, m, v)
  assert base["among_pairs"] == pytest.approx(1 / n)
  assert base["any_value"] == pytest.approx(1 / v)
  if n == m:
    assert base["among_unasked"] == pytest.approx(sum(1 / k for k in range(1, n + 1)) / n)
  # Monte Carlo: guess uniformly among the sequence's values not asked yet.
  rng = np.random.default_rng(0)
  src, hits, total = _source("eval"), 0, 0
  for i in range(1500):
    e = src[i]
    left = set(_pairs(e, n).values())
    for t in np.nonzero(e["weights"])[0]:
      hits += rng.choice(sorted(left)) == e["targets"][t]
      left.discard(int(e["targets"][t]))
      total += 1
  assert hits / total == pytest.approx(base["among_unasked"], abs=0.02)


def _oracle_logits(mqar_vocab, vocab):
  """A model-free solver: at each position, one-hot on the value that followed the current
  token earlier in the sequence (the lookup), else on token 0."""
  def logits(tokens_BL):
    tokens_BL = np.asarray(tokens_BL)
    out = np.zeros(tokens_BL.shape + (vocab,), np.float32)
    for b, row in enumerate(tokens_BL):
      seen = {}
      for t, tok in enumerate(row.tolist()):
        out[b, t, seen.get(tok, 0)] = 1.0
        if t + 1 < len(row) and tok < mqar_vocab:
          seen.setdefault(tok, int(row[t + 1]))
    return jnp.asarray(out)
  return logits


def _batch(n=3):
  src = _source("eval")
  es = [src[i] for i in range(n)]
  return {k: np.stack([e[k] for e in es]) for k in ("inputs", "targets", "weights")}


LINE = re.compile(r"^pairs: (?:\S+->\d+ ?)+; asked \S+, model said \S+ \((?:right|wrong: \d+)\)")


def test_describe_examples_reports_an_oracle_as_right_with_the_listed_pair():
  c = quickstart.get_config()
  n, v = c.data.mqar_num_pairs, c.data.mqar_vocab
  batch = _batch()
  lines = mqar.describe_examples(_oracle_logits(v, 3 * v), batch, num_pairs=n, mqar_vocab=v,
                                 max_examples=3, max_queries=4)
  assert len(lines) == 3
  for line in lines:
    assert LINE.match(line), line
    pairs = dict(p.split("->") for p in line.split(";")[0][len("pairs: "):].split())
    assert len(pairs) == n
    asked = re.findall(r"asked (\S+), model said (\S+) \((right|wrong: \d+)\)", line)
    assert len(asked) == 4
    for key, said, verdict in asked:
      assert verdict == "right" and pairs[key] == said


def test_describe_examples_runs_a_tiny_model_and_marks_wrong_answers():
  c = quickstart.get_config()
  c.model.update(d_model=16, n_layers=2, n_heads=2, d_ff=32)
  n, v = c.data.mqar_num_pairs, c.data.mqar_vocab
  model = build_model(validate(c).model, seed=0)
  batch = _batch(2)
  lines = mqar.describe_examples(lambda t: model(jnp.asarray(t)), batch, num_pairs=n,
                                 mqar_vocab=v, max_examples=2, max_queries=8)
  assert len(lines) == 2
  for b, line in enumerate(lines):
    assert LINE.match(line), line
    pred = np.asarray(jnp.argmax(model(jnp.asarray(batch["inputs"][b:b + 1])), -1))[0]
    pos = np.nonzero(batch["weights"][b])[0]
    verdicts = re.findall(r"\((right|wrong: \d+)\)", line)
    assert [vd == "right" for vd in verdicts] == [bool(pred[t] == batch["targets"][b, t])
                                                  for t in pos]


@pytest.mark.slow
def test_quickstart_run_learns_the_lookup_and_explains_itself(tmp_path):
  """The real default run (a few CPU minutes): >= 90% held-out answer accuracy (the no-lookup
  ceilings are 1/N = 12.5% and H_N/N = 34%), and explain_checkpoint prints the same figure on
  fresh held-out sequences, the summary and three examples."""
  from attn_jax.train.trainer import train_and_evaluate
  c = quickstart.get_config()
  c.train.progress_bar = False
  result = train_and_evaluate(c, str(tmp_path))
  base = mqar.guess_baselines(c.data.mqar_num_pairs, c.data.mqar_num_queries,
                              c.data.mqar_vocab)
  assert base["among_unasked"] < 0.35
  assert result["eval/accuracy"] >= 0.9
  lines = explain_checkpoint(str(tmp_path))
  assert lines[0].startswith(f"After {c.train.steps} steps")
  said = re.search(r"answers (\d+\.\d)% of the (\d+) questions right", lines[0])
  assert said and float(said.group(1)) >= 90.0 and int(said.group(2)) >= 1000, lines[0]
  assert sum(1 for s in lines if LINE.match(s.strip())) == 3
