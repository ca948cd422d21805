"""Throughput of the log-likelihood evaluator on the real benchmark files.

  python experiments/bench_eval.py --data_dir=../shared/data \
      --tokenizer=../shared/data/tokenizer_neox/20B_tokenizer.json --tasks=arc_easy

Builds a randomly initialised model from --config (default: the quickstart's tiny d=64, 2-layer
Transformer) with the tokenizer's vocabulary, then scores every document of each task twice:
the first pass includes compilation (a few shapes per bucket), the second is the steady state.
Reports docs/s and requests/s of both passes. The accuracy of a random model is printed as a
check that the run scored something (it should sit near chance), not as a result.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "quickstart", "Config module under configs/.")
_DATA = flags.DEFINE_string("data_dir", None, "Folder laid out like shared/data.", required=True)
_TOK = flags.DEFINE_string("tokenizer", "byte", "Tokenizer: 'byte' or a tokenizer.json path.")
_TASKS = flags.DEFINE_list("tasks", ["arc_easy"], "Log-likelihood tasks to time.")
_MAXLEN = flags.DEFINE_integer("max_len", 256, "Context length.")
_BS = flags.DEFINE_integer("batch_size", 64, "Requests per batch.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Only the first N documents (0 = all).")
_PASSES = flags.DEFINE_integer("passes", 2, "Passes over each task (the first compiles).")


def main(argv):
  del argv
  import jax

  from attn_jax.data.tokenizer import get_tokenizer
  from attn_jax.eval import harness, tasks
  from attn_jax.eval.run import ModelScorer
  from attn_jax.model import build_model

  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  tok = get_tokenizer(_TOK.value)
  vocab = -(-tok.vocab_size // 128) * 128  # the tokenizer's size rounded up to 128
  config.model.update(vocab_size=vocab, max_seq_len=max(config.model.max_seq_len,
                                                         _MAXLEN.value))
  model = build_model(config.model, seed=0)
  scorer = ModelScorer(model)
  paths = tasks.shared_data_paths(_DATA.value)
  print(f"backend {jax.default_backend()} x{jax.device_count()}; config {_CONFIG.value} "
        f"(d_model {config.model.d_model}, {config.model.n_layers} layers), vocab {vocab}; "
        f"max_len {_MAXLEN.value}, batch {_BS.value}")
  print("| task | docs | requests | pass | seconds | docs/s | requests/s | acc (random) |")
  print("|---|---|---|---|---|---|---|---|")
  for name in _TASKS.value:
    t0 = time.perf_counter()
    docs = tasks.load_task(name, paths[name])
    if _LIMIT.value:
      docs = docs[:_LIMIT.value]
    load_s = time.perf_counter() - t0
    for p in range(_PASSES.value):
      r = harness.evaluate_task(name, docs, scorer, tok, max_len=_MAXLEN.value,
                                batch_size=_BS.value)
      print(f"| {name} | {r['n_docs']} | {r['n_requests']} | {'cold' if p == 0 else 'warm'} "
            f"| {r['seconds']:.1f} | {r['examples_per_s']:.0f} | {r['requests_per_s']:.0f} "
            f"| {r['acc']:.3f} |")
    print(f"(loading {name}: {load_s:.1f} s; tokenization is inside each pass)")


if __name__ == "__main__":
  cli.run(main)
