"""End to end: train a tiny model, evaluate its checkpoint through the library call and the
CLI; in-training evaluation of generated tasks lands in metrics.jsonl."""

import json
import os
import subprocess
import sys

import pytest

from attn_jax.eval.run import evaluate_checkpoint, parse_tasks
from attn_jax.train import trainer as trainer_lib
from attn_jax.train.metrics import read_metrics
from configs import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(steps=4):
  c = quickstart.get_config()
  c.model.update(pattern=(), d_model=32, n_heads=2, d_ff=64, n_layers=1, vocab_size=257,
                 max_seq_len=512)
  c.data.update(source="synthetic", synthetic_task="mqar", seq_len=64, global_batch_size=8,
                mqar_num_pairs=4, mqar_num_queries=4)
  c.train.update(steps=steps, log_every=2, progress_bar=False)
  c.eval.update(every_steps=2, tasks="mqar", batch_size=8)
  return c


def test_in_training_eval_and_checkpoint_eval(tmp_path, bench_data):
  c = tiny()
  # a benchmark task too: the harness on the trainer's (8-way data-parallel) state
  c.eval.update(tasks="mqar,arc_easy", data_dir=str(bench_data), limit=8, max_len=128)
  c.data.tokenizer = "bytes"
  from attn_jax.eval.run import task_callback
  trainer_lib.train_and_evaluate(c, str(tmp_path), eval_callbacks=[task_callback(c)])
  recs = read_metrics(str(tmp_path))
  evs = [r for r in recs if "eval/mqar/acc" in r]
  assert [r["step"] for r in evs][:2] == [2, 4]
  assert 0.0 <= evs[-1]["eval/mqar/acc"] <= 1.0
  assert all(r["eval/arc_easy/n_docs"] == 8 and 0.0 <= r["eval/arc_easy/acc_norm"] <= 1.0
             for r in evs)

  out = evaluate_checkpoint(str(tmp_path), "arc_easy,winogrande,mqar", limit=12,
                            data_dir=str(bench_data), max_len=128)
  res = out["results"]
  assert res["arc_easy"]["n_docs"] == 12 and res["winogrande"]["n_docs"] == 12
  assert "acc_norm" in res["arc_easy"] and "acc_stderr" in res["winogrande"]
  assert os.path.isfile(out["paths"]["json"]) and os.path.isfile(out["paths"]["markdown"])
  assert json.load(open(out["paths"]["json"]))["config"]["step"] == 4

  with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3 .*have \[4\]"):
    evaluate_checkpoint(str(tmp_path), "mqar", step=3)
  missing = tmp_path / "not_a_run"
  with pytest.raises(FileNotFoundError, match="not_a_run"):
    evaluate_checkpoint(str(missing), "mqar")
  assert not missing.exists()  # nothing created on the way

  r = subprocess.run([sys.executable, "experiments/eval.py", f"--checkpoint={tmp_path}",
                      "--tasks=winogrande", "--limit=8", f"--data_dir={bench_data}",
                      "--max_len=128"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "winogrande" in r.stdout


def test_bad_task_names_and_missing_data(tmp_path):
  with pytest.raises(ValueError, match="unknown eval task 'hellaswagg'"):
    parse_tasks("hellaswagg")
  assert parse_tasks("lambada, arc_e,niah") == ["lambada_openai", "arc_easy", "niah"]
  c = tiny()
  c.eval.tasks = "nope"
  from attn_jax.eval.run import task_callback
  with pytest.raises(ValueError, match="unknown eval task 'nope'"):
    task_callback(c)   # built by the entry point before training starts
  from attn_jax.eval.run import run_tasks
  c.data.tokenizer = "bytes"
  c.eval.data_dir = ""
  with pytest.raises(ValueError, match=r"\['arc_easy'\] need data files: set "
                     r"config.eval.data_dir"):
    run_tasks(lambda tokens: None, c, ["arc_easy"])


def test_head_on_selected_rows_equals_full_logits(bench_data):
  """ModelScorer's hidden/head path (LM head on continuation rows only) gives the same
  per-example log-likelihoods and greedy flags as scoring from the full logits."""
  import numpy as np
  from attn_jax.data.tokenizer import ByteTokenizer
  from attn_jax.eval import harness, tasks
  from attn_jax.eval.run import ModelScorer
  from attn_jax.model import build_model
  from attn_jax.model_config import ModelConfig

  model = build_model(ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                  max_seq_len=256, dtype="float32"))
  docs = tasks.load_arc(bench_data / "arc" / "ARC-Easy-Test.jsonl")[:10]
  reqs = harness.doc_requests(docs)
  scorer = ModelScorer(model)
  plain = lambda toks: scorer(toks)  # a plain callable: full-logits path
  tok = ByteTokenizer()
  fast = harness.loglikelihood(reqs, scorer, tok, max_len=256, batch_size=8)
  slow = harness.loglikelihood(reqs, plain, tok, max_len=256, batch_size=8)
  np.testing.assert_allclose([f[0] for f in fast], [s[0] for s in slow], rtol=1e-5, atol=1e-5)
  assert [f[1] for f in fast] == [s[1] for s in slow]


def test_scorer_set_state_reuses_compilations(bench_data):
  """New parameters through `set_state` (as at each in-training evaluation) give exactly the
  scores of a scorer built on the new model, and compile nothing new."""
  import numpy as np
  from flax import nnx
  from attn_jax.data.tokenizer import ByteTokenizer
  from attn_jax.eval import harness, tasks
  from attn_jax.eval.run import ModelScorer
  from attn_jax.model import build_model
  from attn_jax.model_config import ModelConfig

  # untied: a tied random model predicts its own input token, whatever the seed
  cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                    max_seq_len=128, dtype="float32", tie_embeddings=False)
  a, b = build_model(cfg, seed=0), build_model(cfg, seed=1)
  reqs = harness.doc_requests(tasks.load_arc(bench_data / "arc" / "ARC-Easy-Test.jsonl")[:4])
  tok = ByteTokenizer()
  score = lambda s: harness.loglikelihood(reqs, s, tok, max_len=128, batch_size=4)
  graphdef, params, rest = nnx.split(a, nnx.Param, ...)
  scorer = ModelScorer(graphdef=graphdef, state=(params, rest))
  got_a = score(scorer)
  forward, _ = harness._jitted_forward(scorer)
  sizes = (forward._cache_size(), harness._score_rows._cache_size())
  _, params_b, rest_b = nnx.split(b, nnx.Param, ...)
  got_b = score(scorer.set_state(params_b, rest_b))
  assert (forward._cache_size(), harness._score_rows._cache_size()) == sizes
  assert got_b == score(ModelScorer(b))
  assert got_a == score(ModelScorer(a)) and got_a != got_b
  # the generated-task evaluators take the state as an argument too (no stale constants)
  from attn_jax.eval import mqar
  inputs = np.random.default_rng(0).integers(0, 257, (4, 32))
  # targets = model a's own greedy predictions: a scores 100%, b (or a stale a) does not
  ex = [{"inputs": inputs, "targets": np.asarray(ModelScorer(a)(inputs).argmax(-1)),
         "weights": np.ones((4, 32), np.float32)}]
  scorer.set_state(params, rest)
  assert mqar.mqar_accuracy(scorer, ex, batch_size=4)["acc"] == 1.0
  scorer.set_state(params_b, rest_b)
  got = mqar.mqar_accuracy(scorer, ex, batch_size=4)
  assert got == mqar.mqar_accuracy(ModelScorer(b), ex, batch_size=4) and got["acc"] < 0.5


def test_bench_eval_script_runs(bench_data):
  r = subprocess.run([sys.executable, "experiments/bench_eval.py", f"--data_dir={bench_data}",
                      "--tasks=arc_easy,winogrande", "--limit=8", "--passes=1", "--max_len=128",
                      "--batch_size=8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [l for l in r.stdout.splitlines() if l.startswith("| arc_easy") or
          l.startswith("| winogrande")]
  assert len(rows) == 2 and rows[0].split("|")[2].strip() == "8"
