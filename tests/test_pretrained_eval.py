"""The evaluator cross-check and the generation-speed bench on an imported checkpoint, at tiny
sizes: a random Llama built by transformers (saved as a Hugging Face folder, no download),
imported with `attn_jax.pretrained.load`; lm-eval's `hf` model scores the folder, our
evaluator the import, on the first documents of each task in tests/data
(`attn_jax.eval.crosscheck`); `attn_jax.eval.gen_speed` runs ours and transformers on it.

Skips without torch, transformers or lm-eval. Runs offline."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (dev extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (lmeval extra)")
pytest.importorskip("accelerate", reason="accelerate (needed by lm-eval's hf model) missing")

from attn_jax.data.tokenizer import HFTokenizer  # noqa: E402
from attn_jax.eval import crosscheck, gen_speed  # noqa: E402
from attn_jax.eval.run import ModelScorer  # noqa: E402
from attn_jax.pretrained import load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 128   # shorter than some LAMBADA passages in the tiny BPE: truncation is exercised
LIMIT = 5       # documents per task


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_home")
  with pytest.MonkeyPatch.context() as mp:
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root)}.items():
      mp.setenv(k, v)
    import datasets
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    yield root


@pytest.fixture(scope="module")
def hf_dir(tiny_bpe_path, tmp_path_factory):
  """A random LlamaForCausalLM (2 layers, GQA, untied) saved by transformers with the test BPE.
  initializer_range 0.2 (and norm gains around 1): log-likelihoods spread over nats, so a
  wrong position or token cannot hide in near-uniform predictions."""
  from tokenizers import Tokenizer
  path = tmp_path_factory.mktemp("tiny_llama")
  tok = Tokenizer.from_file(str(tiny_bpe_path))
  cfg = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      max_position_embeddings=MAX_LEN, rope_theta=500.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
  model.save_pretrained(str(path))
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>"
                                       ).save_pretrained(str(path))
  return path


@pytest.fixture(scope="module")
def imported(hf_dir):
  pre = load(str(hf_dir))
  return pre.model, HFTokenizer(str(hf_dir / "tokenizer.json"))


def test_crosscheck_matches_lm_eval_hf_on_every_document(hf_dir, imported, bench_data, offline,
                                                        tmp_path):
  model, tok = imported
  torch.set_num_threads(1)
  lm = crosscheck.hf_lm(hf_dir, batch_size=8, max_length=MAX_LEN)
  res = crosscheck.crosscheck(ModelScorer(model), tok, lm, bench_data,
                              crosscheck.DEFAULT_TASKS, limit=LIMIT, max_len=MAX_LEN,
                              batch_size=8, work_dir=tmp_path / "work")
  assert [r["task"] for r in res["rows"]] == list(crosscheck.DEFAULT_TASKS)
  for row in res["rows"]:
    name, docs = row["task"], res["docs"][row["task"]]
    assert row["docs"] == LIMIT == len(docs), name
    ours = np.array([ll for d in docs for ll in d["ll_ours"]])
    theirs = np.array([ll for d in docs for ll in d["ll_lm_eval"]])
    # the tolerance of the module (relative above one nat), per request
    assert np.all(np.abs(ours - theirs) <= crosscheck.TOLERANCE * np.maximum(1, np.abs(theirs))
                  ), (name, np.abs(ours - theirs).max())
    assert row["docs_differing"] == 0 and row["acc_equal"], row
    for metric, value in row["lm_eval"].items():
      want = pytest.approx(value, rel=1e-4) if metric == "perplexity" else value
      assert row["ours"][metric] == want, (name, metric)
  # not vacuous: the random model's choices are far apart
  arc = [ll for d in res["docs"]["arc_easy"] for ll in d["ll_lm_eval"]]
  assert np.std(arc) > 1.0
  paths = crosscheck.write(res, tmp_path / "out")
  assert json.loads(Path(paths["json"]).read_text())["rows"][0]["task"] == "lambada_openai"
  assert "| hellaswag | 5 |" in Path(paths["md"]).read_text()


def _fake(lls, greedy, requests, metrics):
  return {"lls": list(lls), "greedy": list(greedy), "requests": list(requests),
          "metrics": metrics}


def test_compare_task_flags_a_difference(bench_data):
  from attn_jax.eval import harness, tasks
  docs = tasks.load_task("arc_easy", bench_data / "arc" / "ARC-Easy-Test.jsonl")[:3]
  reqs = harness.doc_requests(docs)
  lls = -np.linspace(5.0, 20.0, len(reqs))
  metrics = {"acc": 0.0, "acc_norm": 0.0}
  same = crosscheck.compare_task("arc_easy", docs, _fake(lls, [False] * len(reqs), reqs, metrics),
                                 _fake(lls, [False] * len(reqs), reqs, metrics))
  assert same[0]["docs_differing"] == 0 and same[0]["max_abs_delta"] == 0
  off = lls.copy()
  off[-1] *= 1 + 3 * crosscheck.TOLERANCE   # one request of the last document, 3x the tolerance
  row, recs = crosscheck.compare_task("arc_easy", docs, _fake(off, [False] * len(reqs), reqs,
                                                               metrics),
                                      _fake(lls, [False] * len(reqs), reqs, metrics))
  assert row["docs_differing"] == 1 and [r["differs"] for r in recs] == [False, False, True]
  swapped = [reqs[1], reqs[0]] + reqs[2:]
  with pytest.raises(ValueError, match="arc_easy: requests differ at request 0"):
    crosscheck.compare_task("arc_easy", docs, _fake(lls, [False] * len(reqs), swapped, metrics),
                            _fake(lls, [False] * len(reqs), reqs, metrics))
  with pytest.raises(ValueError, match="tasks: unknown task 'mmlu'"):
    crosscheck.check_tasks(["mmlu"], bench_data)


def test_gen_speed_ours_and_transformers_same_greedy_tokens(hf_dir, imported, offline):
  model, _ = imported
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
  prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, 12).tolist()
  res = gen_speed.measure([gen_speed.ours_engine(model), gen_speed.transformers_engine(hf)],
                          prompt, new_tokens=6, repeats=2)
  assert res["agreement"] == {"attn_jax": 6, "transformers": 6}
  assert res["tokens"]["attn_jax"] == res["tokens"]["transformers"]
  # the reference's own greedy continuation, step by step without a cache
  ids = list(prompt)
  with torch.no_grad():
    for _ in range(6):
      ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
  assert res["tokens"]["attn_jax"] == ids[len(prompt):]
  for row in res["rows"]:
    assert len(row["prefill_s"]) == len(row["generate_s"]) == 2
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
  table = gen_speed.to_markdown(res)
  assert "| transformers |" in table and "6 / 6" in table
  with pytest.raises(ValueError, match="new_tokens must be at least 2"):
    gen_speed.measure([gen_speed.ours_engine(model)], prompt, new_tokens=1, repeats=1)


def test_transformers_twin_holds_the_model_s_weights(hf_dir, imported):
  """The in-memory reference of a bench on random weights (bench_pretrained --random): for an
  imported model, transformers' own load of the folder, logit for logit; for a tied model of
  attn_jax's, our logits (fp32, 1e-5 relative)."""
  from attn_jax.model import build_model
  from attn_jax.pretrained import PretrainedError
  from attn_jax.pretrained.llama import model_config
  from attn_jax.pretrained.loader import spec_of
  model, _ = imported
  ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 16))
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
  with torch.no_grad():
    want = ref.eval()(torch.tensor(ids)).logits
    assert torch.equal(gen_speed.transformers_twin(model)(torch.tensor(ids)).logits, want)
  tied_spec = dataclasses.replace(spec_of(model.cfg), tie_embeddings=True)
  tied = build_model(model_config(tied_spec).replace(init_std=0.2), seed=3)
  with torch.no_grad():
    got = gen_speed.transformers_twin(tied)(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(tied(jnp.asarray(ids)))[..., :got.shape[-1]]
  assert np.abs(got - ours).max() <= 1e-5 * np.abs(ours).max()
  with pytest.raises(PretrainedError, match="cannot export as Llama"):
    gen_speed.transformers_twin(build_model(model.cfg.replace(sink_tokens=2), seed=0))


def test_prefill_flops_and_the_matmul_ceiling(imported):
  """Prefill FLOPs per prompt token by hand (2 N, causal attention, the head once per prompt),
  and the ceiling table's arithmetic on given rates."""
  from attn_jax.model import count_params
  model, _ = imported
  cfg, T = model.cfg, 16
  n = count_params(cfg)
  attn = cfg.n_layers * 2 * 2 * cfg.n_heads * cfg.head_dim * (T + 1) / 2   # QK and PV
  want = 2 * n["non_embedding"] + attn + 2 * cfg.d_model * cfg.vocab_size / T
  assert gen_speed.prefill_flops_per_token(cfg, n, T) == pytest.approx(want, rel=1e-12)
  res = {"rows": [{"engine": "attn_jax", "backend": "xla", "prefill_tok_s": 500.0},
                  {"engine": "transformers", "backend": "torch", "prefill_tok_s": 400.0}]}
  table = gen_speed.ceiling_markdown(res, 2e8, {"xla": 200.0, "torch": 100.0})
  assert "| attn_jax | 100 | 200 | 50% | 1000 |" in table
  assert "| transformers | 80 | 100 | 80% | 500 |" in table
  rates = gen_speed.gemm_rates(8, 16, 8, chain=2, repeats=1)
  assert set(rates) == {"xla", "torch"} and min(rates.values()) > 0


@pytest.mark.slow
def test_bench_pretrained_script_tiny(hf_dir, offline, tmp_path):
  """experiments/bench_pretrained.py end to end on a run directory converted from the folder."""
  from attn_jax.pretrained.convert import convert
  from configs.base import get_config
  run = tmp_path / "run"
  convert(str(hf_dir), workdir=str(run), base_config=get_config())
  out = tmp_path / "speed.json"
  r = subprocess.run(
      [sys.executable, "experiments/bench_pretrained.py", f"--checkpoint={run}",
       f"--hf_dir={hf_dir}", "--prompt_len=16", "--new_tokens=4", "--repeats=1",
       f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "| attn_jax |" in r.stdout and "| transformers |" in r.stdout
  assert json.loads(out.read_text())["agreement"]["transformers"] == 4


@pytest.mark.parametrize("args, words", [
    ([], "give exactly one of --checkpoint and --random"),
    (["--random=gpt5"], "random: unknown checkpoint 'gpt5' \\(known: smollm2\\)"),
])
def test_bench_pretrained_needs_one_source(args, words):
  r = subprocess.run([sys.executable, "experiments/bench_pretrained.py", *args], cwd=ROOT,
                     capture_output=True, text=True, timeout=300, env=dict(os.environ))
  assert r.returncode != 0 and re.search(words, r.stderr + r.stdout), r.stderr[-2000:]
