"""The lm-evaluation-harness adapter (attn_jax.eval.lm_eval_adapter), and a cross-check of our
own evaluator against lm-eval: lm-eval's OWN task definitions (its YAML, templates and
preprocessing, only the dataset pointed at the local files), run through `simple_evaluate` with
the adapter, must give the same requests, per-request log-likelihoods, greedy flags and metrics
as `tasks.load_task` + `harness.doc_requests` + `harness.loglikelihood` on the same documents:
the excerpts in tests/data with a BPE trained on them (conftest.tiny_bpe) by default, every
document of the full files under `-m full_data`.

Skips without lm-eval (`pip install -e '.[lmeval]'`). Runs offline."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness not installed (pip install -e '.[lmeval]')")

from lm_eval.api.instance import Instance  # noqa: E402

from attn_jax import decode  # noqa: E402
from attn_jax.eval import crosscheck, harness, tasks  # noqa: E402
from attn_jax.eval import lm_eval_adapter  # noqa: E402
from attn_jax.eval.crosscheck import TASK_FILES  # noqa: E402
from attn_jax.eval.lm_eval_adapter import AttnJaxLM  # noqa: E402
from attn_jax.model import build_model  # noqa: E402
from configs import quickstart  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 256
LIMIT = 12  # documents per task in the cross-check
LL_ATOL = 1e-4  # float32 log-likelihoods: same model, possibly different batch composition
# A sum of n float32 token log-probabilities (a rolling window) drifts with n: a padded batch's
# GEMMs round otherwise than the unpadded forward (jax 0.10.2 on this CPU: logits up to 1.2e-5
# apart, ~2e-6 nats per token, 1.07e-4 over the 55 tokens below), so its bound is per token.
LL_TOKEN_ATOL = 1e-5

CROSS_CHECK = ("arc_easy", "hellaswag", "winogrande", "lambada_openai")


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tok(tiny_bpe):
  """A byte-level BPE: lm-eval's TemplateLM and our harness must split requests alike."""
  return tiny_bpe


@pytest.fixture(scope="module")
def tiny_model(tok):
  """A random 2-layer quickstart Transformer with the tokenizer's vocabulary (rounded up to 128).
  Untied, init_std 0.2: log-likelihoods spread over tens of nats, so a tokenization or
  template difference cannot hide in near-uniform predictions."""
  c = quickstart.get_config()
  c.model.update(pattern=(), vocab_size=-(-tok.vocab_size // 128) * 128, max_seq_len=MAX_LEN,
                 tie_embeddings=False, init_std=0.2, dtype="float32")
  return build_model(c.model, seed=0)


@pytest.fixture(scope="module")
def lm(tiny_model, tok):
  return AttnJaxLM.from_model(tiny_model, tok, max_len=MAX_LEN, batch_size=16)


@pytest.fixture(scope="module")
def offline_hf(tmp_path_factory):
  """Hugging Face libraries offline, their caches under a temporary folder."""
  root = tmp_path_factory.mktemp("hf")
  with pytest.MonkeyPatch.context() as mp:
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(root),
                 "HF_DATASETS_CACHE": str(root / "datasets")}.items():
      mp.setenv(k, v)
    import datasets  # after the environment: its config reads it on first import
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)  # in case it was imported before
    yield root


def _task_manager(data, folder, cache):
  """lm-eval's own task YAML for every task of TASK_FILES, datasets read from `data`
  (`crosscheck.lm_eval_task_manager`, the evaluator cross-check's own)."""
  return crosscheck.lm_eval_task_manager(data, list(TASK_FILES), folder, cache)


@pytest.fixture(scope="module")
def task_manager(bench_data, offline_hf):
  """lm-eval's task definitions on the excerpts in tests/data."""
  return _task_manager(bench_data, offline_hf / "tasks", offline_hf / "datasets")


def _own_docs(data, name, limit=None):
  docs = tasks.load_task(name, data / TASK_FILES[name][2])
  return docs if limit is None else docs[:limit]


def _first_difference(ours, theirs):
  for k, (a, b) in enumerate(zip(ours, theirs)):
    if a != b:
      return f"request {k}:\n  ours:   {a!r}\n  lm-eval: {b!r}"
  return f"{len(ours)} requests (ours) vs {len(theirs)} (lm-eval)"


# ---------------------------------------------------------------------------------------------
# the cross-check


def test_lm_eval_tasks_match_own_harness(lm, tok, task_manager, bench_data):
  out = lm_eval.simple_evaluate(model=lm, tasks=list(CROSS_CHECK), task_manager=task_manager,
                                limit=LIMIT, log_samples=True, bootstrap_iters=0)
  for name in CROSS_CHECK:
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(LIMIT)), name
    theirs_req = [tuple(a) for s in samples for a in s["arguments"]]
    theirs = [tuple(r[0]) for s in samples for r in s["resps"]]

    docs = _own_docs(bench_data, name, LIMIT)
    ours_req = harness.doc_requests(docs)
    assert ours_req == theirs_req, \
        f"{name}: template differs, {_first_difference(ours_req, theirs_req)}"
    ours = harness.loglikelihood(ours_req, lm.scorer, tok, max_len=lm.max_length,
                                 batch_size=lm.batch_size)
    np.testing.assert_allclose([o[0] for o in ours], [t[0] for t in theirs], rtol=0,
                               atol=LL_ATOL, err_msg=name)
    assert [o[1] for o in ours] == [bool(t[1]) for t in theirs], name

    # metrics: lm-eval's aggregation of its results == our evaluate_task
    mine = harness.evaluate_task(name, docs, lm.scorer, tok, max_len=lm.max_length,
                                 batch_size=lm.batch_size, bootstrap_iters=2)
    res = out["results"][name]
    for metric in tasks.get_task(name).metrics:
      if metric == "perplexity":
        assert mine[metric] == pytest.approx(res[f"{metric},none"], rel=1e-4), name
      else:
        assert mine[metric] == res[f"{metric},none"], (name, metric)
  # the random model must not make the comparison vacuous: spread-out log-likelihoods
  lls = [r[0][0] for s in out["samples"]["arc_easy"] for r in s["resps"]]
  assert np.std(lls) > 1.0


@pytest.mark.parametrize("data", ["excerpts", pytest.param("full", marks=pytest.mark.full_data)])
def test_templates_tokens_and_gold_agree_on_every_document(lm, tok, task_manager, bench_data,
                                                           offline_hf, monkeypatch, request,
                                                           data):
  """No model: lm-eval's requests (strings), its TemplateLM tokenization and its gold indices
  against ours, on every document of the five tasks: the excerpts, or (full_data) the full
  files, mostly LAMBADA's Jinja templates there."""
  if data == "full":
    root = request.getfixturevalue("full_data")
    task_manager = _task_manager(root, offline_hf / "tasks_full", offline_hf / "datasets_full")
  else:
    root = bench_data
  loaded = task_manager.load(list(TASK_FILES))["tasks"]
  for name in TASK_FILES:
    task = loaded[name]
    task.build_all_requests(limit=None, rank=0, world_size=1)
    inst = sorted(task.instances, key=lambda i: (i.doc_id, i.idx))
    docs = _own_docs(root, name)
    ours_req = harness.doc_requests(docs)
    theirs_req = [tuple(i.args) for i in inst]
    assert ours_req == theirs_req, f"{name}: {_first_difference(ours_req, theirs_req)}"
    # lm-eval's TemplateLM tokenization (through the adapter) == harness.encode_pairs
    captured = []
    with monkeypatch.context() as mp:
      mp.setattr(lm, "_loglikelihood_tokens", lambda reqs, **kw: captured.extend(reqs) or [])
      lm.loglikelihood(inst, disable_tqdm=True)
    theirs_tok = [(list(c), list(k)) for _, c, k in captured]
    assert harness.encode_pairs(ours_req, tok) == theirs_tok, name
    if name == "lambada_openai":
      continue
    first = [i for i in inst if i.idx == 0]
    if name == "winogrande":  # partial scoring: doc_to_text gives the answer index
      gold = [task.doc_to_text(i.doc) for i in first]
    else:
      gold = [task.doc_to_target(i.doc) for i in first]
    assert [d.gold for d in docs] == gold, name


# ---------------------------------------------------------------------------------------------
# generate_until, loglikelihood_rolling, is_greedy


def _greedy_reference(model, ids, n, copies=1):
  """Greedy continuation of `ids` by attn_jax.decode (`copies` rows: the adapter batches equal
  prompts, so the same shape compiles once)."""
  out = decode.generate(model, np.asarray([ids] * copies, np.int32), max_new_tokens=n)
  return np.asarray(out)[0, len(ids):].tolist()


def test_generate_until_is_greedy_decode_and_honours_stop(lm, tiny_model, tok):
  context = "The capital of France is"
  n = 12
  ref_ids = _greedy_reference(tiny_model, tok.encode(context), n, copies=3)
  if tok.eos_id in ref_ids:
    ref_ids = ref_ids[:ref_ids.index(tok.eos_id)]
  full = tok.decode(ref_ids)
  # a stop string that occurs inside the greedy continuation (the text of its 5th token)
  stop = next(s for s in (tok.decode(ref_ids[k:k + 1]) for k in range(4, len(ref_ids)))
              if s.strip())
  reqs = [Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": n}), 0),
          Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": n,
                                                    "do_sample": False, "temperature": 0.0}), 0),
          Instance("generate_until", {}, (context, {"until": "\u2603", "max_gen_toks": n}), 0)]
  got = lm.generate_until(reqs)
  assert got[0] == full and got[2] == full  # n new tokens (not the default 256)
  assert got[1] == full[:full.index(stop)] and len(got[1]) < len(full)

  # the greedy continuation is greedy for loglikelihood too; one changed token is not
  ctx_ids = tok.encode(context)
  changed = ref_ids[:-1] + [(ref_ids[-1] + 1) % tok.vocab_size]
  (ll, greedy), (_, greedy2) = lm._loglikelihood_tokens(
      [(None, ctx_ids, ref_ids), (None, ctx_ids, changed)])
  assert greedy and not greedy2
  assert ll == pytest.approx(_plain_logprob(tiny_model, ctx_ids + ref_ids, len(ctx_ids)),
                             abs=1e-4)

  for bad in ({"do_sample": True}, {"temperature": 0.7}, {"num_beams": 4},
              {"repetition_penalty": 1.1}):
    with pytest.raises(ValueError, match="greedy decoding only"):
      lm.generate_until([Instance("generate_until", {}, (context, {"until": [], **bad}), 0)])


def _plain_logprob(model, ids, start):
  """sum_{t >= start} log p(ids[t] | ids[:t]), from one plain full-logits forward (float64)."""
  logits = np.asarray(model(np.asarray([ids[:-1]], np.int32))[0], np.float64)  # [L-1, V]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  t = np.arange(start, len(ids))
  return float(logp[t - 1, np.asarray(ids)[t]].sum())


def test_loglikelihood_rolling_equals_plain_forward(lm, tiny_model, tok):
  text = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
          "it was the age of foolishness, it was the epoch of belief.")
  ids = tok.encode(text)
  assert 30 < len(ids) < MAX_LEN
  req = Instance("loglikelihood_rolling", {}, (text,), 0)
  # one window: every token conditioned on EOS + all earlier tokens
  (got,) = lm.loglikelihood_rolling([req])
  atol = LL_TOKEN_ATOL * len(ids)
  assert got == pytest.approx(_plain_logprob(tiny_model, [tok.eos_id] + ids, 1), abs=atol)
  # windows of 16 inputs: tokens [lo, hi) are scored once each, the forward seeing only the 16
  # tokens before hi (of EOS + text); the last, partial window still gets a full 16 of context
  small = AttnJaxLM.from_model(tiny_model, tok, max_len=16, batch_size=4)
  assert len(small.rolling_windows(text)) == -(-len(ids) // 16) and len(ids) % 16
  seq, ref = [tok.eos_id] + ids, 0.0
  for lo in range(0, len(ids), 16):
    hi = min(lo + 16, len(ids))
    window = seq[max(0, hi - 16):hi + 1]  # 16 inputs + the last target
    ref += _plain_logprob(tiny_model, window, len(window) - (hi - lo))
  got_small, got_again = small.loglikelihood_rolling([req, req])
  # The same request twice in one batch: equal to the same bound (rows of a batch are not
  # bitwise identical on the CPU's blocked attention path: 1.5e-5 nats apart here).
  assert got_small == pytest.approx(ref, abs=atol) and got_again == pytest.approx(got_small,
                                                                                  abs=atol)
  assert got_small != pytest.approx(got, abs=1e-2)  # shorter contexts do change the score


# ---------------------------------------------------------------------------------------------
# registration, CLI, optional import


def test_registered_and_cli_hands_argv_to_lm_eval(monkeypatch):
  from lm_eval.api.registry import get_model

  assert get_model("attn_jax") is AttnJaxLM and lm_eval_adapter.register() is AttnJaxLM
  assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models stay reachable
  import lm_eval.__main__ as lm_main

  seen = []
  monkeypatch.setattr(lm_main, "cli_evaluate", lambda: seen.append(list(sys.argv)))
  lm_eval_adapter.main(["--model_args", "checkpoint=runs/x", "--tasks", "arc_easy"])
  lm_eval_adapter.main(["run", "--model", "hf", "--tasks", "arc_easy"])
  lm_eval_adapter.main(["ls", "tasks"])
  assert seen == [["attn-jax-lm-eval", "--model_args", "checkpoint=runs/x", "--tasks",
                   "arc_easy", "--model", "attn_jax"],
                  ["attn-jax-lm-eval", "run", "--model", "hf", "--tasks", "arc_easy"],
                  ["attn-jax-lm-eval", "ls", "tasks"]]
  with pytest.raises(ValueError, match="checkpoint=DIR"):
    AttnJaxLM()
  with pytest.raises(TypeError, match="unknown model_args"):
    AttnJaxLM(checkpoint="x", pretrained="gpt2")


def test_attn_jax_does_not_need_lm_eval():
  code = (
      "import sys\n"
      "import attn_jax, attn_jax.eval.run, attn_jax.eval.harness\n"
      "assert 'lm_eval' not in sys.modules\n"
      "sys.modules['lm_eval'] = None  # as if not installed\n"
      "try:\n"
      "  import attn_jax.eval.lm_eval_adapter\n"
      "except ImportError as e:\n"
      "  assert 'pip install lm-eval' in str(e), e\n"
      "else:\n"
      "  raise SystemExit('imported without lm_eval')\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_cli_on_a_checkpoint(tmp_path, tok, task_manager, bench_data, offline_hf):
  """Train a tiny run whose config names a tokenizers JSON file, then evaluate its checkpoint with
  `python -m attn_jax.eval.lm_eval_adapter` (model_args checkpoint=..., tokenizer from the
  training config) on lm-eval's arc_easy (tests/data), and compare with our evaluator."""
  from attn_jax.eval.run import evaluate_checkpoint
  from attn_jax.train import trainer as trainer_lib

  c = quickstart.get_config()
  c.model.update(pattern=(), d_model=32, n_heads=2, d_ff=64, n_layers=1, max_seq_len=128,
                 vocab_size=-(-tok.vocab_size // 128) * 128)
  c.data.update(source="synthetic", synthetic_task="mqar", seq_len=64, global_batch_size=8,
                mqar_num_pairs=4, mqar_num_queries=4, tokenizer=str(tok.path))
  c.train.update(steps=2, log_every=1, progress_bar=False)
  c.eval.update(every_steps=0, tasks="")
  run = tmp_path / "run"
  trainer_lib.train_and_evaluate(c, str(run))
  out = tmp_path / "out"
  r = subprocess.run(
      [sys.executable, "-m", "attn_jax.eval.lm_eval_adapter", "--model_args",
       f"checkpoint={run},max_len=64", "--tasks", "arc_easy", "--limit", "8",
       "--batch_size", "8", "--include_path", str(offline_hf / "tasks"),
       "--output_path", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "arc_easy" in r.stdout
  import json

  (result_file,) = list(out.rglob("results*.json"))
  res = json.loads(result_file.read_text())["results"]["arc_easy"]
  mine = evaluate_checkpoint(str(run), "arc_easy", limit=8, data_dir=str(bench_data),
                             max_len=64, batch_size=8, out_dir=str(tmp_path / "own"))
  assert mine["results"]["arc_easy"]["acc"] == res["acc,none"]
  assert mine["results"]["arc_easy"]["acc_norm"] == res["acc_norm,none"]
