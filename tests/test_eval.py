"""Tests for attn_jax.eval: loaders on the benchmark files (the excerpts in tests/data by
default, the full files under `-m full_data`), harness scoring (equal to an unbatched forward,
bounded compilations), chance and oracle accuracies, NIAH, MQAR, report."""

import gc
import json
import shutil
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.data.tokenizer import ByteTokenizer
from attn_jax.eval import harness, mqar, niah, result_tables, tasks

# documents per task: the full files (tests/data/SOURCES.md) and their excerpts in tests/data
# (the first 40 records; ARC-Easy's also holds its 11 questions with 3 or 5 choices)
FULL_COUNTS = {"lambada_openai": 5153, "arc_easy": 2376, "winogrande": 1267, "hellaswag": 1000,
               "arc_challenge": 1172}
SHIPPED_COUNTS = {"lambada_openai": 40, "arc_easy": 51, "winogrande": 40, "hellaswag": 40,
                  "arc_challenge": 19}
TASKS = ("lambada_openai", "arc_easy", "winogrande", "hellaswag")


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny causal model in plain jax, and an oracle that knows the gold sequences


def tiny_causal_lm(vocab: int, dim: int = 16, seed: int = 0, counter: list | None = None):
  """Random embedding -> causal cumulative mean -> linear head; float32 logits [B, L, V]."""
  k_emb, k_head = jax.random.split(jax.random.key(seed))
  emb = jax.random.normal(k_emb, (vocab, dim), jnp.float32)  # [V, D]
  head = jax.random.normal(k_head, (dim, vocab), jnp.float32)  # [D, V]

  def logits_fn(tokens):
    if counter is not None:
      counter.append(tokens.shape)  # runs once per trace
    x = emb[tokens]  # [B, L, D]
    steps = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.float32)  # [L]
    h = jnp.cumsum(x, axis=1) / steps[None, :, None]  # [B, L, D]
    return h @ head  # [B, L, V]

  emb64, head64 = np.asarray(emb, np.float64), np.asarray(head, np.float64)

  def reference(tokens_1d, rows=slice(None)):
    """The same model on one unpadded sequence, in float64 numpy: logits [L, V][rows]."""
    x = emb64[np.asarray(tokens_1d)]  # [L, D]
    h = np.cumsum(x, axis=0) / np.arange(1, len(tokens_1d) + 1)[:, None]  # [L, D]
    return h[rows] @ head64  # [len(rows), V]

  logits_fn.reference = reference
  return logits_fn


def oracle_lm(gold_seqs: list[list[int]], vocab: int, strength: float = 30.0):
  """Puts `strength` on the next token of any gold sequence the row's prefix matches."""
  width = max(len(s) for s in gold_seqs) + 1
  gold = np.full((len(gold_seqs), width), -1, np.int32)  # [N, W]
  for n, s in enumerate(gold_seqs):
    gold[n, :len(s)] = s
  gold = jnp.asarray(gold)

  def logits_fn(tokens):
    _, length = tokens.shape
    total = max(width, length + 1)
    padded = jnp.pad(gold, ((0, 0), (0, total - width)), constant_values=-1)  # [N, >=L+1]
    g, g_next = padded[:, :length], padded[:, 1:length + 1]  # [N, L] token t, token t+1
    eq = tokens[:, None, :] == g[None]  # [B, N, L]
    match = jnp.cumsum(~eq, axis=-1) == 0  # [B, N, L] prefix 0..t equal
    valid = match & (g_next[None] >= 0)  # [B, N, L]
    any_valid = valid.any(axis=1)  # [B, L]
    nxt = jnp.take_along_axis(jnp.broadcast_to(g_next[None], valid.shape),
                              jnp.argmax(valid, axis=1)[:, None], axis=1)[:, 0]  # [B, L]
    onehot = jax.nn.one_hot(jnp.maximum(nxt, 0), vocab, dtype=jnp.float32)  # [B, L, V]
    return jnp.where(any_valid[..., None], strength * onehot, 0.0)

  return logits_fn


def gold_sequences(docs, tokenizer):
  reqs = []
  for d in docs:
    if isinstance(d, tasks.LoglikelihoodDoc):
      reqs.append((d.context, d.continuation))
    else:
      reqs.append(d.requests[d.gold])
  return [c + k for c, k in harness.encode_pairs(reqs, tokenizer)]


@pytest.fixture(scope="module")
def paths(bench_data):
  return tasks.shared_data_paths(bench_data)


def _load_all(paths):
  return {name: tasks.load_task(name, paths[name]) for name in TASKS}


@pytest.fixture(scope="module")
def all_docs(paths):
  return _load_all(paths)


@pytest.fixture(scope="module")
def full_docs(full_data):
  return _load_all(tasks.shared_data_paths(full_data))


# ---------------------------------------------------------------------------------------------
# loaders


def _check_counts_and_layouts(root, docs, counts):
  for name in TASKS:
    assert len(docs[name]) == counts[name], name
  # both ARC layouts give identical docs; WinoGrande labels from the .lst agree with `answer`
  for level, name in (("Easy", "arc_easy"), ("Challenge", "arc_challenge")):
    official = tasks.load_arc(root / "arc" / f"ARC-{level}-Test.jsonl")
    assert len(official) == counts[name], name
    assert tasks.load_arc(root / "arc" / "hf_ai2_arc" / f"ARC-{level}-test.jsonl") == official
  assert official != docs["arc_easy"][:len(official)]   # Challenge is not Easy again
  wino = tasks.load_winogrande(root / "winogrande" / "dev.jsonl",
                               root / "winogrande" / "dev-labels.lst")
  assert wino == docs["winogrande"]
  assert {d.gold for d in wino} == {0, 1}


def test_counts_and_layouts_of_the_excerpts(bench_data, all_docs):
  _check_counts_and_layouts(bench_data, all_docs, SHIPPED_COUNTS)


def test_counts_and_layouts_of_the_full_files(full_data, full_docs):
  _check_counts_and_layouts(full_data, full_docs, FULL_COUNTS)


def test_harness_templates(all_docs):
  lam = all_docs["lambada_openai"][0]
  assert lam.continuation == " signs" and lam.context.endswith("I don't care about")
  hs = all_docs["hellaswag"][0]
  assert hs.requests[0][0] == ("Pole vault: Pole vault is a sport where you run with a pole "
                               "and stop and swing your body. A few women")
  assert hs.requests[3][1] == " are in the gym practicing to do this pole vault, trying to do "\
                              "their best." and hs.gold == 3
  assert tasks.hellaswag_preprocess(" How to x [title] Do y. [step] z  w ") == "How to x. Do y. z w"
  arc = all_docs["arc_easy"][0]
  assert arc.requests[0] == ("Question: Which statement best explains why photosynthesis is the "
                             "foundation of most food webs?\nAnswer:",
                             " Sunlight is the source of energy for nearly all ecosystems.")
  assert sum(len(d.requests) != 4 for d in all_docs["arc_easy"]) == 11  # 3- and 5-choice kept
  digit = tasks.arc_doc({"question": "q", "choices": {"text": ["a", "b", "c"],
                                                      "label": ["1", "2", "3"]},
                         "answerKey": "3"})
  assert digit.gold == 2 and digit.requests[2] == ("Question: q\nAnswer:", " c")
  wg = all_docs["winogrande"][0]
  assert wg.requests == (("Sarah was a much better surgeon than Maria so Sarah",
                          " always got the easier cases."),
                         ("Sarah was a much better surgeon than Maria so Maria",
                          " always got the easier cases.")) and wg.gold == 1


@pytest.mark.parametrize("name,corrupt", [
    ("lambada_openai", lambda rec: {"txt": rec["text"]}),
    ("hellaswag", lambda rec: {**rec, "label": 7}),
    ("arc_easy", lambda rec: {**rec, "answerKey": "Z"}),
    ("winogrande", lambda rec: {**rec, "sentence": rec["sentence"].replace("_", "")}),
    ("winogrande", None),  # a line that is not JSON
])
def test_malformed_line_reports_file_and_line(paths, tmp_path, name, corrupt):
  src = paths[name]
  dst = tmp_path / "copy.jsonl"
  shutil.copy(src, dst)
  lines = dst.read_text(encoding="utf-8").splitlines(keepends=True)
  bad = 7  # 1-based
  if corrupt is None:
    lines[bad - 1] = lines[bad - 1][: len(lines[bad - 1]) // 2] + "\n"
  else:
    lines[bad - 1] = json.dumps(corrupt(json.loads(lines[bad - 1]))) + "\n"
  dst.write_text("".join(lines), encoding="utf-8")
  with pytest.raises(ValueError, match=rf"^{dst}:{bad}: "):
    tasks.load_task(name, dst)
  # a blank line is an error too, not silently dropped
  dst.write_text("".join(lines[:3] + ["\n"] + lines[3:5]), encoding="utf-8")
  with pytest.raises(ValueError, match=rf"^{dst}:4: empty line"):
    tasks.load_task(name, dst)


# ---------------------------------------------------------------------------------------------
# harness


def test_encode_pairs_follows_harness(tiny_bpe):
  # trailing context whitespace moves into the continuation; the split follows the joint BPE
  assert harness.encode_pairs([("Hello world ", "again")], tiny_bpe) == \
      harness.encode_pairs([("Hello world", " again")], tiny_bpe)
  (ctx, cont), = harness.encode_pairs([("The cat", " sat down")], tiny_bpe)
  assert ctx + cont == tiny_bpe.encode("The cat sat down") and ctx == tiny_bpe.encode("The cat")
  assert harness.encode_pairs([("", " hi")], tiny_bpe) == [([tiny_bpe.eos_id],
                                                            tiny_bpe.encode(" hi"))]


def _reference_loglikelihood(reference, ctx, cont, max_len):
  """Unbatched, unpadded, float64: one forward of exactly the (truncated) request."""
  seq = (ctx + cont)[-(max_len + 1):]
  pos = np.arange(len(seq) - 1 - len(cont), len(seq) - 1)  # continuation positions
  logits = reference(seq[:-1], pos)  # [n_cont, V]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))  # [n_cont, V]
  tgt = np.asarray(seq[1:])[pos]
  return (float(logp[np.arange(len(pos)), tgt].sum()),
          bool(np.all(np.argmax(logp, axis=-1) == tgt)))


def test_batched_bucketed_equals_plain_forward(all_docs, tiny_bpe):
  docs = (all_docs["arc_easy"][:6] + all_docs["hellaswag"][:3] + all_docs["winogrande"][:3]
          + all_docs["lambada_openai"][:4])
  requests = harness.doc_requests(docs)
  model = tiny_causal_lm(tiny_bpe.vocab_size, dim=8)
  max_len = 64  # LAMBADA / HellaSwag requests get left-truncated
  got = harness.loglikelihood(requests, model, tiny_bpe, max_len=max_len, batch_size=5,
                              buckets=(16, 32, 64))
  pairs = harness.encode_pairs(requests, tiny_bpe)
  assert any(len(c) + len(k) > max_len + 1 for c, k in pairs)  # truncation is exercised
  for (ctx, cont), (ll, greedy) in zip(pairs, got):
    ref_ll, ref_greedy = _reference_loglikelihood(model.reference, ctx, cont, max_len)
    np.testing.assert_allclose(ll, ref_ll, rtol=1e-5, atol=1e-5)
    assert greedy == ref_greedy
  # order and batch size do not matter either (batch_tokens=96: 3, 3 and 1 rows per bucket)
  perm = np.random.default_rng(0).permutation(len(requests))
  again = harness.loglikelihood([requests[i] for i in perm], model, tiny_bpe,
                                max_len=max_len, batch_size=3, buckets=(16, 32, 64),
                                batch_tokens=96)
  np.testing.assert_allclose([again[j][0] for j in np.argsort(perm)], [g[0] for g in got],
                             rtol=1e-5, atol=1e-5)


def test_compilations_bounded_by_buckets():
  tok = ByteTokenizer()
  traces: list = []
  model = tiny_causal_lm(tok.vocab_size, counter=traces)
  rng = np.random.default_rng(0)
  requests = [("x" * int(n), " yz") for n in rng.integers(1, 120, size=40)]
  buckets = (32, 64, 128)
  harness.loglikelihood(requests, model, tok, max_len=128, batch_size=4, buckets=buckets)
  assert 1 < len(traces) <= len(buckets)
  assert {s[1] for s in traces} <= set(buckets) and {s[0] for s in traces} == {4}
  n = len(traces)
  harness.loglikelihood(requests[::-1][:17], model, tok, max_len=128, batch_size=4,
                        buckets=buckets)
  assert len(traces) == n  # cached: no recompilation on later calls
  # with a token budget the rows per batch depend on the bucket only: still one trace each
  traces.clear()
  model = tiny_causal_lm(tok.vocab_size, counter=traces)
  harness.loglikelihood(requests, model, tok, max_len=128, batch_size=8, buckets=buckets,
                        batch_tokens=256)
  assert sorted(traces) == [(2, 128), (4, 64), (8, 32)]
  # the compilation cache does not keep a logits_fn (and its parameters) alive
  alive = weakref.ref(model)
  del model
  gc.collect()
  assert alive() is None


def test_stderr_matches_harness_formula():
  x = [1, 0, 0, 1, 1, 0, 1]
  mu = sum(x) / len(x)
  expected = (sum((v - mu) ** 2 for v in x) / (len(x) - 1)) ** 0.5 / len(x) ** 0.5
  assert harness.mean_stderr(x) == pytest.approx(expected, rel=1e-12)


def test_random_model_scores_near_chance(full_docs):
  """On the full files: 1000 / 1267 documents put chance within a few points."""
  all_docs = full_docs
  tok = ByteTokenizer()
  model = tiny_causal_lm(tok.vocab_size, dim=16, seed=1)
  for name, chance in (("hellaswag", 0.25), ("winogrande", 0.5)):
    res = harness.evaluate_task(name, all_docs[name], model, tok, max_len=512, batch_size=32)
    n = res["n_docs"]
    se = (chance * (1 - chance) / n) ** 0.5
    for metric in tasks.get_task(name).metrics:
      assert abs(res[metric] - chance) < 4 * se, (name, metric, res[metric])
      assert res[f"{metric}_stderr"] == pytest.approx(se, rel=0.25)


def _prefix_free(doc, tokenizer):
  """False when one choice's token sequence is a prefix of another's (the oracle would tie)."""
  seqs = [c + k for c, k in harness.encode_pairs(list(doc.requests), tokenizer)]
  return not any(i != j and b[:len(a)] == a for i, a in enumerate(seqs)
                 for j, b in enumerate(seqs))


@pytest.mark.parametrize("name", ["arc_easy", "hellaswag", "winogrande", "lambada_openai"])
def test_oracle_scores_100_and_uses_gold_index(all_docs, name):
  tok = ByteTokenizer()
  docs = all_docs[name][:40]
  if name != "lambada_openai":
    docs = [d for d in docs if _prefix_free(d, tok)]
  gold = gold_sequences(docs, tok)
  pairs = harness.encode_pairs(harness.doc_requests(docs), tok)
  max_len = max(len(c) + len(k) for c, k in pairs)  # nothing gets truncated
  kw = dict(max_len=max_len, batch_size=32, buckets=(max_len,))  # one compile per oracle
  res = harness.evaluate_task(name, docs, oracle_lm(gold, tok.vocab_size), tok, **kw)
  for metric in tasks.get_task(name).metrics:
    if metric == "perplexity":
      assert res[metric] == pytest.approx(1.0, abs=1e-3)
    else:
      assert res[metric] == 1.0, metric
  if name == "lambada_openai":
    return
  # permute the answer index: the same oracle now scores 0, and an oracle for the permuted
  # answers scores 100% again, so the gold index really decides
  shifted = [d.with_gold((d.gold + 1) % len(d.requests)) for d in docs]
  res = harness.evaluate_task(name, shifted, oracle_lm(gold, tok.vocab_size), tok, **kw)
  assert res["acc"] == 0.0
  gold_shifted = gold_sequences(shifted, tok)
  res = harness.evaluate_task(name, shifted, oracle_lm(gold_shifted, tok.vocab_size), tok, **kw)
  assert res["acc"] == 1.0


def test_evaluate_and_report(paths, tmp_path):
  tok = ByteTokenizer()
  model = tiny_causal_lm(tok.vocab_size)
  out = harness.evaluate(["arc_easy", "winogrande", "lambada_openai"], model, tok, paths,
                         max_len=256, batch_size=16, limit=20)
  r = out["results"]
  assert r["arc_easy"]["n_docs"] == 20 and r["arc_easy"]["n_requests"] == 80
  assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "examples_per_s"} <= set(
      r["arc_easy"])
  assert r["lambada_openai"]["perplexity"] > 1.0 and r["lambada_openai"]["perplexity_stderr"] > 0
  files = result_tables.write_report(out, tmp_path)
  loaded = json.loads(open(files["json"]).read())
  assert loaded["results"]["winogrande"]["n_docs"] == 20
  md = open(files["markdown"]).read()
  assert "| arc_easy | 20 | acc_norm |" in md and "perplexity" in md
  # generated-task entries (a NIAH grid, MQAR counts) stay in the JSON, not the table
  out["results"]["niah"] = {"acc": 0.5, "grid": [[0.5]], "context_lengths": [64]}
  out["results"]["mqar"] = {"acc": 0.25, "example_acc": 0.0, "n_examples": 8, "n_positions": 64}
  md = result_tables.to_markdown(out)
  assert "| niah | – | acc | 0.5000 |" in md and "grid" not in md
  assert "| mqar | 8 | example_acc |" in md and "n_positions" not in md
  with pytest.raises(ValueError, match="no data path"):
    harness.evaluate(["hellaswag"], model, tok, {}, max_len=64, batch_size=4)


# ---------------------------------------------------------------------------------------------
# NIAH


def _niah_oracle_np(tokens):
  """Reads the needle's digits and emits them after the question (bytes tokenizer)."""
  tokens = np.asarray(tokens)
  out = np.zeros(tokens.shape + (257,), np.float32)  # [B, C, V]
  key, question = b"The secret number is ", niah.QUESTION.encode()
  for b in range(tokens.shape[0]):
    row = bytes(int(t) for t in tokens[b] if t < 256)
    i, q = row.find(key), row.find(question)
    if i < 0 or q < 0:
      continue
    answer = b" " + row[i + len(key):row.find(b".", i)] + b"."
    start = q + len(question)
    for k in range(len(answer)):
      if start + k - 1 < tokens.shape[1] and row[start:start + k] == answer[:k]:
        out[b, start + k - 1, answer[k]] = 10.0
  return out


def test_niah_oracle_and_random_model():
  tok = ByteTokenizer()

  def oracle(tokens):
    shape = jax.ShapeDtypeStruct(tokens.shape + (257,), jnp.float32)
    return jax.pure_callback(_niah_oracle_np, shape, tokens)

  kw = dict(context_lengths=(160, 320), depths=(0.0, 0.5, 1.0), samples_per_cell=2,
            batch_size=8, seed=3)
  res = niah.run_niah(oracle, tok, **kw)
  assert res.grid.shape == (2, 3) and res.accuracy == 1.0
  assert all(s["prompt_tokens"] + 6 <= s["context_length"] for s in res.samples)
  rand = niah.run_niah(tiny_causal_lm(tok.vocab_size), tok, **kw)
  assert rand.grid.shape == (2, 3) and rand.accuracy <= 0.2
  assert niah.answer_is_correct(" 4821.", 4821) and not niah.answer_is_correct(" 48219", 4821)
  assert not niah.answer_is_correct(" 482", 4821)


def test_niah_case_depth_and_length(tiny_bpe):
  for depth in (0.0, 0.3, 1.0):
    case = niah.build_case(tiny_bpe, 512, depth, 1234, seed=1)
    assert len(case.prompt_ids) <= 512 - case.max_new_tokens
    assert len(case.prompt_ids) > 512 - case.max_new_tokens - 40  # the haystack fills it
    assert abs(case.actual_depth - depth) < 0.1
    text = tiny_bpe.decode(case.prompt_ids)
    assert text.count("The secret number is 1234.") == 1 and text.endswith(niah.QUESTION)
  assert niah.build_case(tiny_bpe, 512, 0.0, 1234, seed=1).prompt_ids[:4] == \
      tuple(tiny_bpe.encode("The secret number is 1234."))[:4]


def test_plot_heatmap(tmp_path, capsys):
  grid = np.array([[1.0, 0.5], [0.0, 0.25]])
  path = tmp_path / "niah.png"
  try:
    import matplotlib  # noqa: F401
    has_mpl = True
  except ImportError:
    has_mpl = False
  ok = niah.plot_heatmap(grid, str(path), context_lengths=(64, 128), depths=(0.0, 1.0))
  assert ok == has_mpl and path.exists() == has_mpl
  if not has_mpl:
    assert "matplotlib is not installed" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# MQAR


def test_mqar_accuracy():
  vocab, length = 32, 24
  rng = np.random.default_rng(0)

  def copy_model(tokens):  # predicts the current token
    return 10.0 * jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)

  def examples(n, flip):
    for _ in range(n):
      x = rng.integers(0, vocab, size=length)
      w = np.zeros(length, np.float32)
      w[length // 2:] = 1.0  # 12 query positions
      y = x.copy()
      y[length // 2: length // 2 + flip] = (x[length // 2: length // 2 + flip] + 1) % vocab
      yield {"inputs": x, "targets": y, "weights": w}

  assert mqar.mqar_accuracy(copy_model, examples(10, 0), batch_size=4)["acc"] == 1.0
  res = mqar.mqar_accuracy(copy_model, examples(10, 3), batch_size=4)
  assert res["acc"] == pytest.approx(9 / 12) and res["example_acc"] == 0.0
  assert res["n_examples"] == 10 and res["n_positions"] == 120
  # batched [B, L] dicts are accepted too; wrong positions with weight 0 do not count
  batch = {"inputs": np.zeros((3, length), np.int32), "targets": np.ones((3, length), np.int32),
           "weights": np.zeros((3, length), np.float32)}
  batch["targets"][:, -1], batch["weights"][:, -1] = 0, 1.0
  assert mqar.mqar_accuracy(copy_model, [batch], batch_size=8)["acc"] == 1.0
  with pytest.raises(ValueError, match="missing keys"):
    mqar.mqar_accuracy(copy_model, [{"inputs": np.zeros(4)}])
