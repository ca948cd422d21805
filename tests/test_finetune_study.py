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
  res = finetune.run_study(c, wd, log=lambda m: None)
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
  again = finetune.run_study(c, wd, log=logs.append)
  assert [r["heldout_nll"] for r in again["runs"]] == [r["heldout_nll"] for r in res["runs"]]
  assert not any("steps of" in m or "converting" in m for m in logs), logs


def test_a_finished_run_is_judged_on_changed_values_not_on_new_fields():
  """A field added to configs/base.py since a fine-tune finished (at its default) does not
  make it stale; a changed value does, and is named."""
  from attn_jax.study.finetune import changed_fields
  saved = {"optim": {"lr": 1e-4, "eps": 1e-15}, "train": {"steps": 30}}
  assert changed_fields(saved, {"optim": {"lr": 1e-4, "eps": 1e-15},
                                "train": {"steps": 30, "profile_steps": ""}}) == []
  changes = changed_fields(saved, {"optim": {"lr": 3e-4, "eps": 1e-15}, "train": {"steps": 30}})
  assert len(changes) == 1 and "config.optim.lr" in changes[0]
