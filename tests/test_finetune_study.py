"""The fine-tuning study (attn_jax/study/finetune.py, configs/study_finetune.py) end to end at
a tiny budget on a tiny random Llama: conversion into every variant, the lr sweep, the second
seed for the control and the best variant, stream scores under both caches (FoX with RoPE has
no ring cache: recorded with the reason), results.json, the table and the plot; a rerun of
the same command does nothing again; a finished run is stale only when a value changed."""

import json
import os

import numpy as np
import pytest

from conftest import TEST_DATA, train_tiny_bpe
from configs import base

pytest.importorskip("safetensors", reason="safetensors is not installed (pretrained extra)")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  from attn_jax.model import build_model
  from attn_jax.pretrained import export_hf
  from attn_jax.pretrained import hf as hf_lib
  from attn_jax.pretrained.llama import model_config
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  tok = train_tiny_bpe(text, vocab_size=300)
  path = str(tmp_path_factory.mktemp("llama") / "hf")
  cfg = model_config(hf_lib.spec_from_config(
      {"model_type": "llama", "vocab_size": tok.get_vocab_size(), "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 256}, "test"))
  export_hf(build_model(cfg.replace(init_std=0.1), seed=5), path, tokenizer=tok)
  return path


def tiny_study(src: str, data: str):
  from configs.study_finetune import get_config
  c = get_config()
  c.data.update(paths=data, seq_len=32, global_batch_size=8, read_threads=0, prefetch_batches=0)
  c.train.update(steps=2, log_every=1, progress_bar=False)
  c.optim.update(warmup_steps=0)
  c.checkpoint.every_steps = 2
  c.eval.batch_size = 8
  s = c.study
  s.src = src
  s.lrs = (1e-3, 3e-3)
  s.stream_tokens, s.stream_cache, s.stream_chunk, s.stream_bin = 100, 32, 16, 16
  return c


def test_finetune_study_tiny(llama_dir, tmp_path):
  from attn_jax.study import finetune
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  data = tmp_path / "train.txt"
  data.write_text(text[:20000], encoding="utf-8")
  c = tiny_study(llama_dir, str(data))
  wd = str(tmp_path / "study")
  res = finetune.run_study(c, wd, base_config=base.get_config(), log=lambda m: None)
  assert res["meta"]["complete"]
  assert list(res["variants"]) == ["control", "sink_logit", "sisa", "fox"]
  assert len(res["sweep"]) == 8 and len(res["runs"]) == 6
  best = res["meta"]["best_variant"]
  assert best in ("sink_logit", "sisa", "fox")
  assert sorted((r["variant"], r["seed"]) for r in res["runs"]) == sorted(
      [(n, 0) for n in res["variants"]] + [("control", 1), (best, 1)])
  for name, v in res["variants"].items():   # the lr kept is the sweep's lowest held-out NLL
    recs = [r for r in res["sweep"] if r["variant"] == name]
    assert v["lr"] == min(recs, key=lambda r: r["heldout_nll"])["lr"]
  assert res["variants"]["sisa"]["step0"]["rel_logit_diff"] <= 1e-5
  assert res["variants"]["sink_logit"]["step0"]["rel_logit_diff"] <= 1e-5
  pols = ["streaming(4+28)", "window(32)"]
  for label, st in res["streams"].items():
    assert sorted(st["policies"]) == pols and st["tokens"] == 101
    for pol in pols:
      p = st["policies"][pol]
      if label.startswith("fox/"):
        assert "rope" in p["refused"]
      else:
        assert np.isfinite(p["nll"]) and len(p["by_position"]) == -(-100 // 16)
  sink = next(r for r in res["runs"] if r["variant"] == "sink_logit")["new_values"]
  path = "blocks/layers/0/mixer/sink_logit"
  assert sink["converted"][path]["mean"] == -20.0
  assert abs(sink["finetuned"][path]["mean"] + 20.0) > 1.0   # lr x5000, eps 1e-15: it travels
  out = finetune.write_report(wd)
  table = open(out["tables"]).read()
  assert "| pretrained (step 0) |" in table and "| sisa |" in table
  assert os.path.getsize(out["plot"]) > 1000
  # rerun: every stage is done, nothing is trained or scored again
  logs = []
  again = finetune.run_study(c, wd, base_config=base.get_config(), log=logs.append)
  assert [r["heldout_nll"] for r in again["runs"]] == [r["heldout_nll"] for r in res["runs"]]
  assert not any("steps of" in m or "converting" in m for m in logs), logs
  assert len(again["meta"]["invocations"]) == 2   # the wall time sums both invocations
  page = tmp_path / "page.md"
  page.write_text("# p\n\n<!-- finetune_study:begin -->\nold\n<!-- finetune_study:end -->\nafter\n")
  finetune.write_report(wd, str(page), str(tmp_path / "assets"))
  text = page.read_text()
  assert "old" not in text and text.endswith("after\n") and "2 invocation(s)" in text
  assert "| sisa |" in text and "window(32) - streaming(4+28)" in text
  assert (tmp_path / "assets" / finetune.PLOT).is_file()


def test_a_finished_run_is_judged_on_changed_values_not_on_new_fields():
  """A field added to configs/base.py since a fine-tune finished (at its default) does not
  make it stale; a changed value does, and is named."""
  from attn_jax.study.runner import changed_fields
  saved = {"optim": {"lr": 1e-4, "eps": 1e-15}, "train": {"steps": 30}}
  assert changed_fields(saved, {"optim": {"lr": 1e-4, "eps": 1e-15},
                                "train": {"steps": 30, "profile_steps": ""}}) == []
  changes = changed_fields(saved, {"optim": {"lr": 3e-4, "eps": 1e-15}, "train": {"steps": 30}})
  assert len(changes) == 1 and "config.optim.lr" in changes[0]


def synthetic_results():
  """A results.json of two models, the control on two seeds, without training anything."""
  def stream(window, streaming):
    return {"policies": {"window(8)": {"nll_past_cache": window, "wall_s": 2.0},
                         "streaming(4+4)": {"nll_past_cache": streaming, "wall_s": 3.0}}}
  run = lambda v, seed, nll, **kw: {"variant": v, "seed": seed, "lr": 1e-4, "tokens": 1024,
                                    "heldout_nll": nll, "final_train_loss": nll + 0.1,
                                    "wall_s": 60.0, **kw}
  runs = [run("control", 0, 3.0), run("sink_logit", 0, 2.9, new_values={
      "converted": {"sink": {"mean": -20.0, "absmax": 20.0}},
      "finetuned": {"sink": {"mean": -12.5, "absmax": 14.0}}}), run("control", 1, 3.2)]
  config = {"study": {"src": "smollm2", "lrs": [1e-4], "seeds": [0, 1], "stream_tokens": 64,
                      "stream_cache": 8, "stream_chunk": 4},
            "train": {"steps": 2}, "data": {"global_batch_size": 4, "seq_len": 128,
                                            "paths": "t.txt", "eval_fraction": 0.1},
            "optim": {"eps": 1e-15, "warmup_steps": 0, "min_lr_ratio": 0.1}}
  return {"meta": {"command": "python experiments/finetune_study.py ...", "complete": True,
                   "best_variant": "sink_logit", "started": "a", "finished": "b",
                   "machine": {"backend": "cpu", "devices": 1, "cpu_count": 2, "jax": "0"},
                   "invocations": [{"wall_s": 120.0, "loadavg_start": 0.5},
                                   {"wall_s": 60.0, "loadavg_end": 2.0, "commit": "abc1234"}],
                   "config": config},
          "variants": {"control": {"lr": 1e-4}, "sink_logit": {"lr": 1e-4}},
          "sweep": runs[:2], "runs": runs,
          "streams": {"pretrained": stream(4.0, 3.5), "control/seed0": stream(3.6, 3.4),
                      "control/seed1": stream(3.8, 3.4), "sink_logit/seed0": stream(3.3, 3.3)}}


def test_the_report_table_averages_seeds_and_the_window_excess_per_seed():
  from attn_jax.study import finetune
  res = synthetic_results()
  rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
          for r in finetune.table(res).splitlines()[2:]}
  # model: lr, seeds, held-out, window past, streaming past, window - streaming
  assert rows["pretrained (step 0)"] == ["-", "1", "-", "4.0000", "3.5000", "0.5000"]
  assert rows["control"] == ["0.0001", "2", "3.1000 ± 0.1000", "3.7000 ± 0.1000",
                             "3.4000 ± 0.0000", "0.3000 ± 0.1000"]
  assert rows["sink_logit"][2:] == ["2.9000", "3.3000", "3.3000", "0.0000"]
  text = finetune.conditions(res)
  assert "3.0 min in 2 invocation(s)" in text and "3 fine-tunes 3.0 min" in text
  assert "8 stream scores 0.3 min" in text and "per invocation not recorded, abc1234" in text
  assert "load average 0.5 to 2.0" in text
  params = finetune.new_params_table(res)
  assert "| sink_logit/seed0 | `sink` | -20 (20) | -12.5 (14) |" in params


def test_an_earlier_results_file_without_invocations_counts_as_one(tmp_path):
  from attn_jax.study import finetune
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"meta": {"started": "s", "finished": "f",
                                       "this_invocation_wall_s": 42.0}}))
  assert finetune.earlier_invocations(str(path)) == [
      {"started": "s", "finished": "f", "wall_s": 42.0}]
  assert finetune.earlier_invocations(str(tmp_path / "none.json")) == []


def test_three_kept_layouts_each_compared_with_the_most_kept():
  """configs/study_finetune_sinks.py: window(512), 1 + 511, 4 + 508; the table's excess
  columns are each layout minus the last (4 kept), per seed then averaged."""
  from attn_jax.study import finetune
  from configs import study_finetune_sinks
  c = study_finetune_sinks.get_config()
  assert c.data.window_offset == "random" and [v[0] for v in c.study.variants] == [
      "control", "sink_logit"]
  assert [p.label for p in finetune.stream_policies(c)] == [
      "window(512)", "streaming(1+511)", "streaming(4+508)"]
  c.study.stream_keep = (0, 512)
  with pytest.raises(ValueError, match=r"config\.study\.stream_keep"):
    finetune.stream_policies(c)
  res = synthetic_results()
  for st, one in zip(res["streams"].values(), (3.9, 3.5, 3.6, 3.3)):
    st["policies"]["streaming(1+7)"] = {"nll_past_cache": one, "wall_s": 1.0}
  lines = finetune.table(res).splitlines()
  assert lines[0].endswith("| window(8) - streaming(4+4) | streaming(1+7) - streaming(4+4) |")
  assert "| streaming(1+7) NLL past the cache | streaming(4+4) NLL" in lines[0]
  rows = {r.split("|")[1].strip(): [x.strip() for x in r.split("|")[2:-1]] for r in lines[2:]}
  assert rows["control"][-1] == "0.1500 ± 0.0500"          # (0.1 + 0.2) / 2 over two seeds
  res["meta"]["config"]["study"]["page_marker"] = "finetune_sinks"
  assert "<!-- finetune_sinks:begin -->" in finetune.page_section(res, "w", "img", "regen")


@pytest.mark.slow
def test_finetune_sinks_study_tiny(llama_dir, tmp_path):
  """The sinks config end to end at a tiny budget: both models, two seeds, random windows,
  three layouts streamed, its own page section."""
  from attn_jax.study import finetune
  from configs import study_finetune_sinks
  text = (TEST_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  data = tmp_path / "train.txt"
  data.write_text(text[:20000], encoding="utf-8")
  c = tiny_study(llama_dir, str(data))
  sinks = study_finetune_sinks.get_config()
  c.data.window_offset = sinks.data.window_offset
  c.study.update(variants=sinks.study.variants, lrs=(1e-3,), stream_keep=(0, 1, 4),
                 page_marker="finetune_sinks")
  res = finetune.run_study(c, str(tmp_path / "study"), base_config=base.get_config(),
                           log=lambda m: None)
  assert sorted((r["variant"], r["seed"]) for r in res["runs"]) == [
      ("control", 0), ("control", 1), ("sink_logit", 0), ("sink_logit", 1)]
  for st in res["streams"].values():
    assert sorted(st["policies"]) == ["streaming(1+31)", "streaming(4+28)", "window(32)"]
    assert all(np.isfinite(p["nll_past_cache"]) for p in st["policies"].values())
  page = tmp_path / "page.md"
  page.write_text("# p\n")
  finetune.write_report(str(tmp_path / "study"), str(page))
  text = page.read_text()
  assert text.count("<!-- finetune_sinks:begin -->") == 1
  assert "streaming(1+31) - streaming(4+28)" in text
