"""Our evaluator next to lm-evaluation-harness on the same documents, document by document.

Two scorers see the same benchmark files:

  ours     `tasks.load_task` -> `harness.doc_requests` -> `harness.loglikelihood` on an attn_jax
           model (`run.ModelScorer`), our tokenizer, our metric code (`harness.evaluate_task`).
  lm-eval  lm-eval's own task definitions (its YAML: templates, `process_docs`, metrics) with
           only the dataset redirected to the local files (`lm_eval_task_manager`), run by any
           lm-eval `LM` through `lm_eval.simple_evaluate(..., log_samples=True)`; for a
           pretrained model that is lm-eval's `hf` model (`HFLM`: transformers, PyTorch) on the
           same weights exported as a Hugging Face folder.

Per document d with requests i (one per choice; one for LAMBADA) the comparison keeps

  ll_ours[d, i], ll_lm_eval[d, i]        sum log p(continuation | context), nats
  delta = max_i |ll_ours - ll_lm_eval|   and the relative delta / max(1, |ll_lm_eval|)
  prediction                             argmax_i ll (acc), argmax_i ll / len(choice_i)
                                         (acc_norm), all-greedy (LAMBADA acc)

and a document "differs" when its requests differ (template), a log-likelihood is off by more
than the tolerance, or a prediction differs. The tolerance is relative above one nat:
|delta| <= tol * max(1, |ll|), tol = 1e-4. fp32 sums over the continuation tokens carry a
rounding error that grows with the number of tokens and the size of each term (a 40-token
HellaSwag ending of -60 nats is a sum of 40 terms of a few nats each), so an absolute 1e-4
would test the summation order rather than the model. Accuracies are compared exactly, and
our metrics come from our code (`harness.score_docs`), theirs from lm-eval's aggregation.

lm-eval's YAML for each task lives in its package; `lm_eval_task_manager` writes one small
YAML per task that `include:`s it and replaces `dataset_path` with the `json` builder over a
local file (split names as the original task uses them), so nothing is downloaded. ARC is read
by lm-eval in the Hugging Face layout (`arc/hf_ai2_arc/*.jsonl`) and by us in the allenai
layout; the other tasks read the same file on both sides (`TASK_FILES`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from attn_jax.eval import harness
from attn_jax.eval import tasks as tasks_lib

TOLERANCE = 1e-4   # relative above one nat, absolute below (module docstring)

# task -> (split lm-eval reads, file lm-eval reads, file our loader reads), relative to the
# benchmark folder (`tasks.shared_data_paths` layout; tests/data has the same layout)
TASK_FILES: dict[str, tuple[str, str, str]] = {
    "lambada_openai": ("test", "lambada/lambada_test.jsonl", "lambada/lambada_test.jsonl"),
    "hellaswag": ("validation", "hellaswag/hellaswag.jsonl", "hellaswag/hellaswag.jsonl"),
    "arc_easy": ("test", "arc/hf_ai2_arc/ARC-Easy-test.jsonl", "arc/ARC-Easy-Test.jsonl"),
    "arc_challenge": ("test", "arc/hf_ai2_arc/ARC-Challenge-test.jsonl",
                      "arc/ARC-Challenge-Test.jsonl"),
    "winogrande": ("validation", "winogrande/dev.jsonl", "winogrande/dev.jsonl"),
}
DEFAULT_TASKS = ("lambada_openai", "hellaswag", "arc_easy", "winogrande")


def check_tasks(names: Sequence[str], data_dir: str | os.PathLike) -> list[str]:
  """Known task names whose two files exist under `data_dir`; else one clear ValueError."""
  names = [n.strip() for n in names if n.strip()]
  if not names:
    raise ValueError("tasks: give at least one task")
  for name in names:
    if name not in TASK_FILES:
      raise ValueError(f"tasks: unknown task {name!r}; known: {sorted(TASK_FILES)}")
    for rel in set(TASK_FILES[name][1:]):
      path = Path(data_dir) / rel
      if not path.is_file():
        raise ValueError(f"data_dir: {name} needs {path} (layout of tasks.shared_data_paths)")
  return names


# ---------------------------------------------------------------------------------------------
# lm-eval side


def _lm_eval_yaml_paths(names: Sequence[str]) -> dict[str, Path]:
  """Where lm-eval keeps the YAML of `names`: only the folders that hold them are indexed (the
  index of every task takes seconds), everything if this lm-eval version moved them."""
  import lm_eval.tasks
  from lm_eval.tasks import TaskManager

  root = Path(lm_eval.tasks.__file__).parent
  dirs = [root / d for d in ("arc", "hellaswag", "winogrande", "lambada") if (root / d).is_dir()]
  index = TaskManager(include_defaults=False, include_path=[str(d) for d in dirs]).task_index
  if not all(n in index for n in names):
    index = TaskManager().task_index
  missing = [n for n in names if n not in index]
  if missing:
    raise ValueError(f"tasks: lm-eval has no task {missing}")
  return {n: Path(index[n].yaml_path) for n in names}


def lm_eval_task_manager(data_dir: str | os.PathLike, names: Sequence[str],
                         folder: str | os.PathLike, cache_dir: str | os.PathLike):
  """A `TaskManager` over lm-eval's own YAML for `names`, datasets read from `data_dir`
  (module docstring). `folder` (created) receives the small override YAML files; `cache_dir`
  is the datasets cache for the local json files."""
  import yaml
  from lm_eval.tasks import TaskManager

  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  for name, yaml_path in _lm_eval_yaml_paths(names).items():
    split, rel, _ = TASK_FILES[name]
    cfg = {"include": str(yaml_path), "task": name, "dataset_path": "json",
           "dataset_name": None,
           "dataset_kwargs": {"data_files": {split: str(Path(data_dir) / rel)},
                              "cache_dir": str(cache_dir)},
           "training_split": None, "validation_split": None, "test_split": None,
           "fewshot_split": None, f"{split}_split": split}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
  return TaskManager(include_defaults=False, include_path=str(folder))


def hf_lm(hf_dir: str | os.PathLike, *, batch_size: int, max_length: int):
  """lm-eval's `hf` model on a local Hugging Face folder: fp32 on the CPU, no BOS added (our
  tokenizers add none either)."""
  from lm_eval.models.huggingface import HFLM
  return HFLM(pretrained=os.fspath(hf_dir), dtype="float32", device="cpu",
              batch_size=int(batch_size), max_length=int(max_length), add_bos_token=False)


def run_lm_eval(lm, names: Sequence[str], task_manager, limit: int | None) -> dict:
  """lm-eval's results per task: {"requests": [(context, continuation)] in document order,
  "lls", "greedy" (per request), "n_choices" (per document), "metrics"}."""
  import lm_eval

  out = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=task_manager,
                                limit=limit, log_samples=True, bootstrap_iters=0)
  results = {}
  for name in names:
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    metrics = {k.split(",")[0]: v for k, v in out["results"][name].items()
               if k.endswith(",none") and "stderr" not in k}
    results[name] = {
        "requests": [tuple(a) for s in samples for a in s["arguments"]],
        "lls": [float(r[0][0]) for s in samples for r in s["resps"]],
        "greedy": [bool(r[0][1]) for s in samples for r in s["resps"]],
        "n_choices": [len(s["arguments"]) for s in samples],
        "metrics": metrics}
  return results


# ---------------------------------------------------------------------------------------------
# our side


def run_ours(scorer, tokenizer, docs: Sequence[tasks_lib.Doc], name: str, *, max_len: int,
             batch_size: int) -> dict:
  """Our requests, per-request (ll, greedy) and metrics (`harness.task_metrics`, the task's own,
  as `harness.evaluate_task` reports them) for `docs`."""
  requests = harness.doc_requests(docs)
  scored = harness.loglikelihood(requests, scorer, tokenizer, max_len=max_len,
                                 batch_size=batch_size)
  metrics = harness.task_metrics(name, harness.score_docs(docs, scored), bootstrap_iters=None)
  return {"requests": requests, "lls": [s[0] for s in scored],
          "greedy": [s[1] for s in scored], "metrics": metrics}


# ---------------------------------------------------------------------------------------------
# the comparison


def _predictions(doc, lls: Sequence[float], greedy: Sequence[bool]) -> dict:
  if isinstance(doc, tasks_lib.LoglikelihoodDoc):
    return {"acc": int(bool(greedy[0]))}
  return harness.choice_picks(doc, lls)


def compare_task(name: str, docs: Sequence[tasks_lib.Doc], ours: Mapping, theirs: Mapping,
                 tol: float = TOLERANCE) -> tuple[dict, list[dict]]:
  """(summary row, per-document records) for one task (module docstring)."""
  if ours["requests"] != theirs["requests"]:
    k = next((k for k, (a, b) in enumerate(zip(ours["requests"], theirs["requests"]))
              if a != b), min(len(ours["requests"]), len(theirs["requests"])))
    got = ours["requests"][k] if k < len(ours["requests"]) else None
    want = theirs["requests"][k] if k < len(theirs["requests"]) else None
    raise ValueError(f"{name}: requests differ at request {k}: ours {got!r}, lm-eval {want!r}")
  records, at = [], 0
  max_abs = max_rel = 0.0
  n_diff = 0
  for d, doc in enumerate(docs):
    n = len(doc.requests) if isinstance(doc, tasks_lib.MultipleChoiceDoc) else 1
    sl = slice(at, at + n)
    at += n
    a = np.asarray(ours["lls"][sl], np.float64)
    b = np.asarray(theirs["lls"][sl], np.float64)
    delta = np.abs(a - b)
    rel = delta / np.maximum(1.0, np.abs(b))
    p_ours = _predictions(doc, a, ours["greedy"][sl])
    p_theirs = _predictions(doc, b, theirs["greedy"][sl])
    differs = bool(np.any(rel > tol)) or p_ours != p_theirs or \
        list(ours["greedy"][sl]) != list(theirs["greedy"][sl])
    n_diff += differs
    max_abs, max_rel = max(max_abs, float(delta.max())), max(max_rel, float(rel.max()))
    records.append({"doc": d, "ll_ours": a.tolist(), "ll_lm_eval": b.tolist(),
                    "greedy_ours": list(map(bool, ours["greedy"][sl])),
                    "greedy_lm_eval": list(map(bool, theirs["greedy"][sl])),
                    "gold": getattr(doc, "gold", None), "pred_ours": p_ours,
                    "pred_lm_eval": p_theirs, "max_abs_delta": float(delta.max()),
                    "max_rel_delta": float(rel.max()), "differs": differs})
  row = {"task": name, "docs": len(docs), "requests": at,
         "ours": {k: float(ours["metrics"][k]) for k in ("acc", "acc_norm", "perplexity")
                  if k in ours["metrics"]},
         "lm_eval": {k: float(theirs["metrics"][k]) for k in ("acc", "acc_norm", "perplexity")
                     if k in theirs["metrics"]},
         "max_abs_delta": max_abs, "max_rel_delta": max_rel, "docs_differing": n_diff}
  row["acc_equal"] = all(row["ours"].get(k) == row["lm_eval"].get(k)
                         for k in ("acc", "acc_norm") if k in row["lm_eval"])
  return row, records


def crosscheck(scorer, tokenizer, lm, data_dir: str | os.PathLike, names: Sequence[str], *,
               limit: int | None, max_len: int, batch_size: int, work_dir: str | os.PathLike,
               tol: float = TOLERANCE) -> dict:
  """Both evaluators on the first `limit` documents (all when None) of each task of `names`.
  `scorer`/`tokenizer`: ours (`run.ModelScorer`, an attn_jax tokenizer); `lm`: an lm-eval LM on
  the same weights. `work_dir` holds lm-eval's override YAML and datasets cache.

  Returns {"rows": [summary per task], "docs": {task: [per-document records]},
  "config": {...}}."""
  names = check_tasks(names, data_dir)
  work_dir = Path(work_dir)
  tm = lm_eval_task_manager(data_dir, names, work_dir / "tasks", work_dir / "datasets")
  theirs = run_lm_eval(lm, names, tm, limit)
  rows, per_doc = [], {}
  for name in names:
    docs = tasks_lib.load_task(name, Path(data_dir) / TASK_FILES[name][2])
    docs = docs if limit is None else docs[:limit]
    ours = run_ours(scorer, tokenizer, docs, name, max_len=max_len, batch_size=batch_size)
    row, records = compare_task(name, docs, ours, theirs[name], tol)
    rows.append(row)
    per_doc[name] = records
  return {"rows": rows, "docs": per_doc,
          "config": {"tasks": list(names), "limit": limit, "max_len": max_len,
                     "batch_size": batch_size, "tolerance": tol,
                     "data_dir": os.path.abspath(data_dir)}}


def _fmt(x: float | None) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def to_markdown(result: Mapping[str, Any]) -> str:
  """The summary table of `crosscheck`'s result."""
  lines = ["| task | docs | ours acc / acc_norm | lm-eval acc / acc_norm | max abs dll | "
           "max rel dll | docs differing |", "|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    o, t = r["ours"], r["lm_eval"]
    lines.append(f"| {r['task']} | {r['docs']} | {_fmt(o.get('acc'))} / "
                 f"{_fmt(o.get('acc_norm'))} | {_fmt(t.get('acc'))} / {_fmt(t.get('acc_norm'))} "
                 f"| {r['max_abs_delta']:.2e} | {r['max_rel_delta']:.2e} | "
                 f"{r['docs_differing']} |")
  return "\n".join(lines)


def write(result: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
  """crosscheck.json (everything, per document) and crosscheck.md (the table) in `out_dir`."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = {"json": str(out_dir / "crosscheck.json"), "md": str(out_dir / "crosscheck.md")}
  Path(paths["json"]).write_text(json.dumps(result, indent=1), encoding="utf-8")
  Path(paths["md"]).write_text(to_markdown(result) + "\n", encoding="utf-8")
  return paths


__all__ = ["TOLERANCE", "TASK_FILES", "DEFAULT_TASKS", "check_tasks", "lm_eval_task_manager",
           "hf_lm", "run_lm_eval", "run_ours", "compare_task", "crosscheck", "to_markdown",
           "write"]
