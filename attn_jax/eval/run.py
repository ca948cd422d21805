"""Run evaluation tasks on a model: from a checkpoint (`evaluate_checkpoint`, used by
experiments/eval.py) or inside training (`run_tasks`, driven by `config.eval`).

Task names: lambada_openai (alias lambada), hellaswag, arc_easy, arc_challenge, winogrande
(files from `data_paths` or `config.eval.data_dir` in the layout of `tasks.shared_data_paths`),
niah (generated haystacks; needs a real tokenizer), mqar (generated, from `config.data`'s MQAR
settings, the held-out random stream).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from attn_jax import outputs, paths
from attn_jax.config import RunConfig, as_run
from attn_jax.data import pipeline
from attn_jax.data.tokenizer import Tokenizer, get_tokenizer
from attn_jax.eval import harness, mqar, niah, result_tables, tasks as tasks_lib
from attn_jax.model import abstract_model
from attn_jax.train.checkpoint import load_for_inference, run_checkpoints

ALIASES = tasks_lib.ALIASES
GENERATED = tasks_lib.GENERATED


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
  names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
  names = [ALIASES.get(t, t) for t in names if t]
  for t in names:
    if t not in GENERATED:
      tasks_lib.get_task(t)  # clear error for unknown names
  return names


class ModelScorer:
  """A logits_fn for the evaluators: `scorer(tokens [B, L]) -> logits [B, L, V]`. Its
  `hidden_apply` (final hidden states) and `head_apply` (the LM head) let the log-likelihood
  harness run the head on the continuation rows only.

  The model is split once. `state` is an argument of the jitted pure functions
  `logits_apply(state, tokens)`, `hidden_apply`, `head_apply` (which close over the graph
  definition only), and the evaluators pass it as one (`harness.scorer_fns`): parameters are
  never baked into a program as constants, and `set_state` (new parameters at each evaluation
  during training) reuses every compilation.
  """

  def __init__(self, model: nnx.Module | None = None, *, graphdef=None, state=()):
    if model is not None:
      graphdef, *state = nnx.split(model)
    if graphdef is None:
      raise ValueError("ModelScorer needs a model or a graphdef")
    self.state = tuple(state)
    self.logits_apply = jax.jit(lambda st, t: nnx.merge(graphdef, *st)(t))
    self.hidden_apply = jax.jit(lambda st, t: nnx.merge(graphdef, *st).hidden(t))
    self.head_apply = jax.jit(lambda st, h: nnx.merge(graphdef, *st).unembed(h))

  def set_state(self, *state) -> "ModelScorer":
    """New values for the model's state (same structure as at construction)."""
    self.state = tuple(state)
    return self

  def __call__(self, tokens):
    return self.logits_apply(self.state, tokens)


def _check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                     f"{vocab_size}: evaluate with the tokenizer the model was trained with "
                     "(config.data.tokenizer)")


def niah_lengths(config: RunConfig, max_len: int, *, warn: bool = True) -> tuple[int, ...]:
  """The NIAH context lengths to run: `config.eval.niah_lengths` up to `max_len`.

  Lengths over `max_len` are dropped with a warning (an error if none is left). A length over
  `config.model.max_seq_len` stays in the grid but is not run (the one rule of
  `config.seq_len_problem`): its cells are reported as "n/a: ... longer than the model's
  max_seq_len", never as a 0% that would say nothing about retrieval within its range.
  """
  asked = tuple(int(x) for x in config.eval.niah_lengths)
  lengths = tuple(x for x in asked if x <= max_len)
  if not lengths:
    raise ValueError(f"config.eval.niah_lengths={asked}: none fits max_len={max_len} "
                     "(config.eval.max_len, default config.data.seq_len)")
  if len(lengths) < len(asked) and warn:
    logging.warning("config.eval.niah_lengths=%s: skipping %s, longer than max_len=%d "
                    "(config.eval.max_len, default config.data.seq_len)", asked,
                    tuple(x for x in asked if x > max_len), max_len)
  model_max = int(config.model.max_seq_len)
  beyond = tuple(x for x in lengths if x > model_max)
  if beyond and warn:
    logging.warning("config.eval.niah_lengths=%s: %s exceed config.model.max_seq_len=%d; "
                    "those cells are not run and are reported as n/a", asked, beyond, model_max)
  return lengths


def eval_max_len(config: RunConfig, max_len: int | None = None) -> int:
  """The evaluation's context length: `max_len`, else config.eval.max_len, else data.seq_len."""
  return int(max_len or config.eval.max_len or config.data.seq_len)


def _check_data_dir(config: RunConfig, bench: Sequence[str]) -> None:
  if not config.eval.data_dir:
    raise ValueError(f"tasks {list(bench)} need data files: set config.eval.data_dir (a folder "
                     "laid out like shared/data; --data_dir of experiments/eval.py) or "
                     "pass data_paths")


def check_tasks(config: RunConfig, tasks: Sequence[str]) -> None:
  """What `run_tasks` would refuse at the first evaluation, checked before training: the
  benchmark tasks' config.eval.data_dir and the tokenizer's vocabulary, and for niah a grid
  with a cell to run (config.eval.niah_lengths within config.eval.max_len / data.seq_len and
  model.max_seq_len, the shortest one long enough for the needle and its question)."""
  bench = [t for t in tasks if t not in GENERATED]
  if bench:
    _check_data_dir(config, bench)
  if not bench and "niah" not in tasks:
    return
  tokenizer = get_tokenizer(config.data.tokenizer)
  _check_vocab(tokenizer, config.model.vocab_size)
  if "niah" not in tasks:
    return
  lengths = niah_lengths(config, eval_max_len(config), warn=False)
  model_max = int(config.model.max_seq_len)
  runnable = [x for x in lengths if x <= model_max]
  if not runnable:
    raise ValueError(f"config.eval.niah_lengths={tuple(lengths)}: every length exceeds "
                     f"config.model.max_seq_len={model_max}, so eval.tasks=niah would run no "
                     "cell; lower eval.niah_lengths or drop niah from eval.tasks")
  try:
    niah.build_case(tokenizer, min(runnable), 0.0, 1000)
  except ValueError as err:
    raise ValueError(f"config.eval.niah_lengths={tuple(lengths)}: {err}; raise "
                     "eval.niah_lengths (and eval.max_len / data.seq_len)") from None


def run_tasks(logits_fn, config: RunConfig, tasks: Sequence[str], *,
              tokenizer: Tokenizer | None = None,
              data_paths: Mapping[str, Any] | None = None, max_len: int | None = None,
              batch_size: int | None = None, limit: int | None = None) -> dict:
  """{"results": {task: metrics}, "config": {...}} for the given tasks (`config`: the run's
  typed config, or a ConfigDict, validated here)."""
  config = as_run(config)
  e = config.eval
  max_len = eval_max_len(config, max_len)
  batch_size = int(batch_size or e.batch_size)
  limit = limit if limit is not None else (int(e.limit) or None)
  bench = [t for t in tasks if t not in GENERATED]
  results: dict[str, Any] = {}
  if bench or "niah" in tasks:
    tokenizer = tokenizer or get_tokenizer(config.data.tokenizer)
    _check_vocab(tokenizer, config.model.vocab_size)
  if bench:
    if data_paths is None:
      _check_data_dir(config, bench)
      data_paths = tasks_lib.shared_data_paths(e.data_dir)
    out = harness.evaluate(bench, logits_fn, tokenizer, data_paths, max_len=max_len,
                           batch_size=batch_size, limit=limit)
    results.update(out["results"])
  if "niah" in tasks:
    lengths = niah_lengths(config, max_len)
    res = niah.run_niah(logits_fn, tokenizer, context_lengths=lengths,
                        depths=tuple(e.niah_depths), samples_per_cell=int(e.niah_samples),
                        batch_size=batch_size, max_seq_len=int(config.model.max_seq_len))
    results["niah"] = {"acc": res.accuracy, "grid": res.grid.tolist(),
                       "context_lengths": list(res.context_lengths), "depths": list(res.depths)}
    if res.not_available:
      results["niah"]["notes"] = list(res.not_available.values())
  if "mqar" in tasks:
    if config.data.source != "synthetic" or config.data.synthetic_task != "mqar":
      mcfg = dataclasses.replace(config.data, source="synthetic", synthetic_task="mqar")
    else:
      mcfg = config.data
    batches = pipeline.make_eval_batches(mcfg, seed=config.seed, num_batches=4,
                                         batch_size=batch_size)
    results["mqar"] = mqar.mqar_accuracy(logits_fn, batches, batch_size=batch_size)
  return {"results": results, "config": {"tasks": list(tasks), "max_len": max_len,
                                         "batch_size": batch_size, "limit": limit}}


def task_callback(config: RunConfig):
  """The trainer's evaluation callback for `config.eval.tasks`: `(state, step) -> metrics`.

  Task names and what the tasks need (`check_tasks`) are checked now (before hours of
  training). The scorer is built once from the
  model's abstract graph, and the train state's parameters are set at each call, so every
  evaluation after the first reuses its compilations.
  """

  config = as_run(config)
  tasks = parse_tasks(config.eval.tasks)
  if not tasks:
    return None
  check_tasks(config, tasks)
  graphdef = nnx.split(abstract_model(config.model))[0]
  scorer = ModelScorer(graphdef=graphdef)

  def callback(state, step):
    del step
    scorer.set_state(state["params"], state["rest"])
    try:
      out = run_tasks(scorer, config, tasks)
    finally:
      scorer.set_state()  # hold no reference to buffers the next train step donates
    return scalar_metrics(out["results"])

  return callback


def scalar_metrics(results: Mapping[str, Any], prefix: str = "eval/") -> dict[str, float]:
  """Flat {eval/<task>/<metric>: float} for metrics.jsonl / TensorBoard."""
  out = {}
  for task, metrics in results.items():
    for k, v in metrics.items():
      if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
        out[f"{prefix}{task}/{k}"] = float(v)
  return out


def evaluate_checkpoint(workdir: str, tasks: str | Sequence[str], *, step: int | None = None,
                        data_paths: Mapping[str, Any] | None = None, data_dir: str = "",
                        tokenizer: str = "", max_len: int = 0, batch_size: int = 0,
                        limit: int | None = None, out_dir: str = "",
                        allow_unverified: bool = False) -> dict:
  """Load the latest (or given) checkpoint under `workdir`, run `tasks`, write
  <out_dir>/eval.json and eval.md (default out_dir: <workdir>/eval). Returns the results.
  `allow_unverified`: a step without its checksum manifest loads (with a warning).

  The output folder is checked before any work (`attn_jax.outputs.results_folder`): an
  unwritable `out_dir` is an error at once; a run directory that cannot be written sends the
  results to a fallback folder (named in a warning and in `paths`); a write that fails at the
  end prints the results before its error."""

  names = parse_tasks(tasks)
  run_checkpoints(workdir)   # a run directory, before any folder is made in it
  folder = outputs.results_folder(workdir, "eval", explicit=out_dir, flag="--out_dir").path
  model, config, step = load_for_inference(workdir, step, allow_unverified=allow_unverified)
  if data_dir:
    config = config.replace_in("eval", data_dir=data_dir)
  tok = get_tokenizer(tokenizer) if tokenizer else None
  out = run_tasks(ModelScorer(model), config, names, tokenizer=tok, data_paths=data_paths,
                  max_len=max_len or None, batch_size=batch_size or None, limit=limit)
  out["config"].update(workdir=paths.name(workdir), step=int(step),
                       mixer=config.model.mixer, pattern=list(config.model.pattern))


  def write() -> dict:
    written = result_tables.write_report(out, folder)
    if "niah" in out["results"]:
      r = out["results"]["niah"]
      niah.plot_heatmap(np.asarray(r["grid"]), paths.name(paths.run_path(folder) / "niah.png"),
                        context_lengths=r["context_lengths"], depths=r["depths"])
    return written

  out["paths"] = outputs.write_or_print(write, result_tables.to_markdown(out), folder,
                                        flag="--out_dir")
  return out


def explain_checkpoint(workdir: str, *, max_examples: int = 3) -> list[str]:
  """A newcomer's summary of an MQAR training run: held-out answer accuracy next to the
  no-lookup baselines, then `mqar.describe_examples` on fresh held-out sequences (the eval split's
  random stream: pairs the model never trained on)."""

  model, config, step = load_for_inference(workdir)
  d = config.data
  n, m, v = int(d.mqar_num_pairs), int(d.mqar_num_queries), int(d.mqar_vocab)
  batches = pipeline.make_eval_batches(d, seed=config.seed, num_batches=4, batch_size=64)
  scorer = ModelScorer(model)
  acc = mqar.mqar_accuracy(scorer, batches, batch_size=64)
  base = mqar.guess_baselines(n, m, v)
  lines = [
      f"After {step} steps, on {acc['n_examples']} held-out sequences (fresh random pairs), "
      f"the model answers {acc['acc']:.1%} of the {acc['n_positions']} questions right.",
      f"Without looking the key up: {base['among_pairs']:.1%} (a random value of the "
      f"sequence), {base['among_unasked']:.1%} (a random value not asked yet), "
      f"{base['any_value']:.1%} (any value).",
      "Examples (keys are letters, values numbers):"]
  lines += ["  " + s for s in mqar.describe_examples(scorer, batches[0], num_pairs=n, mqar_vocab=v,
                                                max_examples=max_examples)]
  return lines
