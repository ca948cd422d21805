"""Trainer: resume == uninterrupted, sharded == unsharded, accumulation == big batch, metrics,
optimizer groups, clear config errors."""

import json

import jax
import numpy as np
import pytest

from attn_jax import config as config_lib
from attn_jax.train import trainer as trainer_lib
from attn_jax.train import fitting, preflight, setup as setup_lib
from attn_jax.train.metrics import read_metrics
from configs import quickstart


def tiny_config(steps=6, **data):
  c = quickstart.get_config()
  c.model.update(d_model=32, n_heads=2, d_ff=64, n_layers=2, pattern=())   # a Transformer
  c.data.update(seq_len=32, global_batch_size=8, mqar_num_pairs=4, mqar_num_queries=4,
                **data)
  c.train.update(steps=steps, log_every=1, progress_bar=False)
  c.checkpoint.every_steps = 100
  c.eval.every_steps = 0
  c.optim.warmup_steps = 2
  return c


def losses(workdir):
  return [(m["step"], m["loss"]) for m in read_metrics(workdir) if "loss" in m]


def run_interrupted(c, workdir, monkeypatch, *, at_batch):
  """A run stopped by a KeyboardInterrupt while it pulls its `at_batch`-th batch."""
  real_next = setup_lib.next_batch
  calls = {"n": 0}

  def interrupting(*a, **k):
    calls["n"] += 1
    if calls["n"] == at_batch:
      raise KeyboardInterrupt
    return real_next(*a, **k)

  monkeypatch.setattr(setup_lib, "next_batch", interrupting)
  with pytest.raises(KeyboardInterrupt):
    trainer_lib.train_and_evaluate(c, str(workdir))
  monkeypatch.setattr(setup_lib, "next_batch", real_next)


def test_resume_is_bit_identical(tmp_path, monkeypatch):
  c = tiny_config(steps=6)
  trainer_lib.train_and_evaluate(c, str(tmp_path / "full"))
  full = losses(tmp_path / "full")
  assert [s for s, _ in full] == list(range(1, 7))

  # Interrupt the second run after 3 steps (as a Ctrl-C would), then rerun the same command.
  run_interrupted(c, tmp_path / "resumed", monkeypatch, at_batch=4)
  from attn_jax.train.checkpoint import Checkpointer
  assert Checkpointer(str(tmp_path / "resumed")).latest_step() == 3  # work was not lost
  trainer_lib.train_and_evaluate(c, str(tmp_path / "resumed"))
  resumed = losses(tmp_path / "resumed")
  assert [s for s, _ in resumed] == list(range(1, 7))
  assert resumed == full  # bit-identical losses on CPU


def test_metrics_jsonl_and_loss_decreases(tmp_path):
  c = tiny_config(steps=40)
  c.train.log_every = 5
  c.eval.every_steps = 20
  out = trainer_lib.train_and_evaluate(c, str(tmp_path))
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  recs = [json.loads(l) for l in lines]  # every line is valid JSON
  train = [r for r in recs if "loss" in r]
  for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_sec"):
    assert key in train[0]
  assert train[-1]["loss"] < train[0]["loss"] - 0.1
  assert (tmp_path / "tb").is_dir() and any((tmp_path / "tb").iterdir())
  assert "eval/accuracy" in out


# Parameters after two AdamW steps: Adam divides by sqrt(v), so a gradient entry that is ~0
# turns float rounding (different reduction order across devices) into a difference of up to
# ~lr per step. A real sharding bug changes parameters by O(lr) = 1.5e-3 here; 1e-5 is < 1% of it.
PARAM_ATOL = 1e-5


def _one_step(c, devices, batch):
  setup = setup_lib.build_setup(c, devices=devices)
  state = setup.init_fn()
  b = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
  state, m = setup.step_fn(state, b)
  state, m = setup.step_fn(state, b)
  return float(m["loss"]), jax.device_get(state["params"])


def _batch(c, accum=1):
  from attn_jax.data import pipeline
  it = pipeline.make_train_iterator(c.data, seed=0)
  mbs = [next(it) for _ in range(accum)]
  return {k: np.stack([mb[k] for mb in mbs]) for k in ("inputs", "targets", "weights")}


def test_sharded_equals_unsharded():
  assert jax.device_count() == 8
  c = tiny_config()
  batch = _batch(c)
  loss1, p1 = _one_step(c, jax.devices()[:1], batch)
  c8 = tiny_config()
  c8.mesh.shape = (2, 4, 1)  # data x fsdp: batch over 8, weights sharded over fsdp
  loss8, p8 = _one_step(c8, jax.devices(), batch)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=PARAM_ATOL), p8, p1)


def test_grad_accumulation_equals_big_batch():
  c = tiny_config()
  big = _batch(c)                     # [1, 8, L]
  c2 = tiny_config()
  c2.train.grad_accum = 2
  c2.data.global_batch_size = 4
  split = {k: v.reshape(2, 4, *v.shape[2:]) for k, v in big.items()}  # same tokens, [2, 4, L]
  loss_big, p_big = _one_step(c, jax.devices()[:1], big)
  loss_acc, p_acc = _one_step(c2, jax.devices()[:1], split)
  np.testing.assert_allclose(loss_acc, loss_big, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=PARAM_ATOL), p_acc,
               p_big)


def test_weight_decay_groups():
  from flax import nnx
  from attn_jax.model import abstract_model
  from attn_jax.train.optim import param_groups
  c = tiny_config()
  c.model.mixer = "sisa"
  _, params = nnx.split(abstract_model(c.model), nnx.Param)
  decay, mult = param_groups(params)
  blk = decay["blocks"]["layers"][0]
  assert blk["mlp"]["gate"]["kernel"] is True
  assert decay["embed"] is True
  assert blk["mixer_norm"]["scale"] is False   # [layers, d]: a vector per layer
  assert decay["final_norm"]["scale"] is False
  assert blk["mixer"]["lambda_raw"] is False   # metadata: kind="scalar"
  assert mult["blocks"]["layers"][0]["mixer"]["lambda_raw"] == 0.1
  assert mult["final_norm"]["scale"] == 1.0 and mult["embed"] == 1.0


def test_clear_errors(tmp_path):
  c = tiny_config()
  c.model.vocab_size = 10
  with pytest.raises(ValueError, match="config.model.vocab_size"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "a"))
  c = tiny_config()
  c.data.global_batch_size = 6   # 8 devices on the data axis
  with pytest.raises(ValueError, match="config.data.global_batch_size"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "b"))
  c = tiny_config()
  c.model.mixer = "nope"
  with pytest.raises(ValueError, match="unknown mixer 'nope'.*attention"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "c"))
  c = tiny_config()
  c.model.d_model = 33
  with pytest.raises(ValueError, match="config.model.d_model"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "d"))
  c = tiny_config(source="text", paths=str(tmp_path / "missing.txt"))
  c.model.vocab_size = 257  # bytes tokenizer
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    trainer_lib.train_and_evaluate(c, str(tmp_path / "e"))


def test_unknown_config_field_via_flags(tmp_path):
  import subprocess, sys, os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "experiments/train.py", "--config=configs/quickstart.py",
                      f"--workdir={tmp_path}", "--config.model.not_a_field=3"],
                     cwd=root, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "not_a_field" in r.stderr


def test_batch_geometry_rewrites_only_the_batch_fields_of_a_copy():
  """`_fit_memory` returns a BatchGeometry; `apply` gives the run's config: the same object when
  the batch is the config's own, else a copy with the micro-batch and accumulation replaced."""
  c = config_lib.validate(tiny_config())
  geo = fitting.BatchGeometry.of(c)
  assert geo.shape == (1, 8, 32) and geo.tokens == 8 * 32
  assert geo.apply(c) is c
  smaller = fitting.BatchGeometry(accum=4, micro=2, seq_len=32)
  c2 = smaller.apply(c)
  assert (c2.data.global_batch_size, c2.train.grad_accum) == (2, 4)
  assert (c.data.global_batch_size, c.train.grad_accum) == (8, 1)   # the caller's is untouched
  assert smaller.tokens == geo.tokens
  rest = lambda cfg: {k: v for k, v in cfg.to_json().items() if k not in ("data", "train")}
  assert rest(c2) == rest(c)
  assert fitting.BatchGeometry.of(c2) == smaller


def test_a_run_names_its_data_source_first_and_warns_on_generated_data_for_a_large_model(
    caplog):
  """A preset larger than the quickstart on the base config's default (generated MQAR) says so
  at start; real data is named with its paths and tokenizer."""
  import logging
  from configs import sisa_152m
  c = tiny_config()
  with caplog.at_level(logging.INFO):
    preflight.say_data_source(c, 50_000)
  assert [r.levelno for r in caplog.records] == [logging.INFO]
  assert "GENERATED multi-query associative recall (4 key-value pairs" in caplog.text
  caplog.clear()
  big = sisa_152m.get_config()
  with caplog.at_level(logging.INFO):
    preflight.say_data_source(big, 152_000_000)
  warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warning) == 1 and "152.0M-parameter model trains on GENERATED data" in warning[0]
  caplog.clear()
  big.data.update(source="jsonl", paths="gs://b/train.jsonl", tokenizer="tok.json")
  with caplog.at_level(logging.INFO):
    preflight.say_data_source(big, 152_000_000)
  assert [r.getMessage() for r in caplog.records] == [
      "data: data.source='jsonl' from data.paths='gs://b/train.jsonl', tokenizer 'tok.json'"]


def test_a_failure_while_opening_the_outputs_leaves_no_writer_open(tmp_path, monkeypatch):
  """The metric writers are open when the evaluator's held-out batches are built; a failure
  there ends the run with that error, its writers and checkpointer closed (no writer thread
  left running), and the workdir usable by the next run."""
  import threading

  def broken(*args, **kwargs):
    raise RuntimeError("held-out batches unavailable")

  writers = lambda: {t for t in threading.enumerate() if t.name.endswith(" writer")}
  before = writers()   # another test's run in this process may hold its own
  monkeypatch.setattr(trainer_lib, "make_heldout_batches", broken)
  with pytest.raises(RuntimeError, match="held-out batches unavailable"):
    trainer_lib.train_and_evaluate(tiny_config(steps=2), str(tmp_path))
  left = [t.name for t in writers() - before]
  assert not left, left
  monkeypatch.undo()
  trainer_lib.train_and_evaluate(tiny_config(steps=2), str(tmp_path))
  assert [step for step, _ in losses(str(tmp_path))] == [1, 2]
