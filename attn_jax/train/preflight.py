"""What a training run checks before it writes anything, and the line that says what it trains
on.

`checked_setup` is every check of the config that needs no workdir (the init_from run it names,
`config.validate` inside `setup.build_setup`, `validate_for_training`, the W&B package when a
project is named), with the abstract set-up those checks need: a refused run has made no folder
and taken no lock. `validate_for_training` holds the checks a training run adds to
`config.validate`: the non-finite and spike options, the data (every text / JSONL file read:
an empty or non-UTF-8 one is named before the workdir exists; the token shards' index), its
held-out split against one batch, the vocabulary against the data's and the global batch
against the mesh; each error names the config field.

`data_source` / `say_data_source` give the run's first log line: the data it trains on, and a
warning when a model larger than the quickstart trains on generated data (most likely a preset
run without its data.* fields)."""

from __future__ import annotations

import logging

import ml_collections

from attn_jax import sharding as shd
from attn_jax.config import RunConfig, as_run
from attn_jax.data import pipeline, text
from attn_jax.data.shards import TokenShards
from attn_jax.field_checks import field_check
from attn_jax.train import init_from
from attn_jax.train.loss_monitor import NONFINITE_MODES
from attn_jax.train.setup import Setup, build_setup
from attn_jax.train.wandb_writer import check_installed


def checked_setup(config: ml_collections.ConfigDict | RunConfig) -> Setup:
  """Every check of the config (and of the data files and init_from run it names) that needs
  no workdir, and the abstract set-up they need: a refused run writes nothing. The setup holds
  the typed run config (`Setup.run`) the rest of the run reads."""
  run = as_run(config)       # config.validate, once (a RunConfig passes through)
  init_from.check(run)       # config.train.init_from
  setup = build_setup(run)
  validate_for_training(run, setup)
  check_installed(run)       # config.metrics.wandb_project without wandb
  return setup


def validate_for_training(config: RunConfig, setup: Setup) -> None:
  """What a training run checks beyond `config.validate` (which `build_setup` ran): the
  non-finite and spike options, the vocabulary against the data's, and the global batch against
  the mesh's batch shards; every error names the config field.
  (Each host's rows come from the batch sharding, `sharding.host_batch_rows`: a host whose
  devices hold a replicated batch reads all of it, so no divisibility by the process count is
  required.)"""
  t = config.train
  need = field_check("config.train")
  need(t.nonfinite in NONFINITE_MODES, "nonfinite", f"{t.nonfinite!r} not in {NONFINITE_MODES}")
  need(int(t.nonfinite_max_consecutive) >= 1, "nonfinite_max_consecutive",
       f"must be >= 1, got {t.nonfinite_max_consecutive!r}")
  need(int(t.spike_window) >= 0 and int(t.spike_window) != 1, "spike_window",
       f"must be 0 (off) or >= 2, got {t.spike_window!r}")
  need(float(t.spike_threshold) > 0, "spike_threshold",
       f"must be > 0, got {t.spike_threshold!r}")
  if str(config.data.source) in text.TEXT_SOURCES:
    text.data_files(config.data)   # every file there (a folder: its files), named if missing
  check_heldout_batch(config, setup)
  vocab = pipeline.vocab_size_needed(config.data)
  if vocab > setup.cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={setup.cfg.vocab_size} is smaller than the data's "
                     f"vocabulary ({vocab}, from config.data.tokenizer/source)")
  gbs, shards = config.data.global_batch_size, shd.batch_shards(setup.mesh, setup.rules)
  if gbs % shards:
    raise ValueError(f"config.data.global_batch_size={gbs} is not divisible by the "
                     f"{shards} batch shards of the mesh {dict(setup.mesh.shape)}")


def check_heldout_batch(config: RunConfig, setup: Setup) -> None:
  """A packed source's held-out split holds one batch: the trainer evaluates on batches of
  `data.global_batch_size` sequences (`setup.make_heldout_batches`; with
  `train.auto_microbatch` the fitted micro-batch, at least one row per batch shard) from the
  last `data.eval_fraction` of the corpus (`text.split_counts`). Text / JSONL: the corpus is
  read and tokenized here (cached: the run reads it once), so an empty, binary or non-UTF-8
  file is an error naming it before anything is written; shards: their index and sizes."""
  d = config.data
  source = str(d.source)
  if source == "synthetic":   # an endless generated held-out stream
    return
  if source in text.TEXT_SOURCES:
    n_tokens = len(text.load_token_stream(d))
  else:
    directory = str(d.paths).strip()
    if not directory or "," in directory:
      raise ValueError(f"config.data.paths must be one prepared folder for data.source="
                       f"'shards', got {d.paths!r}")
    n_tokens = TokenShards(directory, verify=False).num_tokens   # checksums: at open
  n_train, n_eval = text.split_counts(n_tokens, d)
  need = (shd.batch_shards(setup.mesh, setup.rules) if config.train.auto_microbatch
          else d.global_batch_size)
  if n_eval < need:
    raise ValueError(
        f"config.data.global_batch_size={d.global_batch_size}: the held-out split has {n_eval} "
        f"sequence(s) of data.seq_len={d.seq_len} (data.eval_fraction={d.eval_fraction} of "
        f"{n_train + n_eval}), fewer than one held-out batch of {need}: raise "
        "data.eval_fraction, add data, or lower data.global_batch_size")


# The quickstart (MQAR, about 0.1M parameters) is meant to train on generated data; a model past
# this size on generated data is most likely a preset run without its data.* fields.
GENERATED_DATA_WARN_PARAMS = 1_000_000


def data_source(config: RunConfig) -> str:
  """One line naming what the run trains on."""
  d = config.data
  if str(d.source) == "synthetic":
    task = str(d.synthetic_task)
    what = (f"multi-query associative recall ({d.mqar_num_pairs} key-value pairs, "
            f"{d.mqar_num_queries} queries, keys and values from {d.mqar_vocab} tokens)"
            if task == "mqar" else "uniform random tokens (nothing to learn: a throughput run)")
    return (f"data: GENERATED {what}, made on the fly (data.source='synthetic', "
            f"data.synthetic_task={task!r})")
  return (f"data: data.source={str(d.source)!r} from data.paths={str(d.paths)!r}, tokenizer "
          f"{str(d.tokenizer)!r}")


def say_data_source(config: RunConfig, n_params: int) -> None:
  """Logs `data_source` first thing; a warning when a model larger than the quickstart trains
  on generated data."""
  logging.info("%s", data_source(config))
  if str(config.data.source) == "synthetic" and n_params > GENERATED_DATA_WARN_PARAMS:
    logging.warning(
        "this %.1fM-parameter model trains on GENERATED data (data.source='synthetic', the "
        "base config's default), not on text: for a language model pass "
        "--config.data.source=jsonl (or text, shards) --config.data.paths=... "
        "--config.data.tokenizer=...", n_params / 1e6)
