"""Benchmark loaders: the official files -> documents made of (context, continuation) requests.

Each loader turns one file format into documents scored the way EleutherAI's
lm-evaluation-harness scores them (zero-shot, default templates):

  lambada_openai  OpenAI's detokenized LAMBADA jsonl (key `text`).
                  context = text.split(" ")[:-1] joined by " ", continuation = " " + last word.
                  acc = the greedy argmax reproduces every continuation token;
                  perplexity = exp(-mean over docs of the continuation log-likelihood).
  hellaswag       rowanz jsonl (`ctx_a, ctx_b, activity_label, endings, label`).
                  query = pre(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()),
                  choices = [pre(e) for e in endings], requests (query, " " + choice), where
                  pre() strips, turns " [title]" into ". ", drops "[...]" and collapses "  ".
  arc_easy /      allenai layout (`question.stem`, `question.choices[{text,label}]`) or the HF
  arc_challenge   layout (`question`, `choices{text,label}`); answerKey is a letter or a digit
                  and is looked up among the labels. "Question: {q}\\nAnswer:" + " " + choice.
  winogrande      `sentence, option1, option2, answer` ("1"/"2"), partial scoring: one context
                  per option, sentence[:blank] + option, sharing the continuation
                  " " + sentence[blank+1:].strip().

Multiple-choice metrics: acc = argmax_i ll_i == gold; acc_norm = argmax_i ll_i / len(choice_i)
with len the character count of the choice text without the leading delimiter, as the harness
computes it (`completion_len`).

Every malformed line raises ValueError("path:line: reason"); no line is dropped.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterator, Sequence

from attn_jax.data.jsonl import parse_object


@dataclasses.dataclass(frozen=True)
class LoglikelihoodDoc:
  """One (context, continuation) request scored alone (LAMBADA)."""

  context: str
  continuation: str


@dataclasses.dataclass(frozen=True)
class MultipleChoiceDoc:
  """One question: requests[i] = (context_i, continuation_i) scores choice i.

  `choices` holds the choice strings the harness uses for acc_norm lengths (for WinoGrande
  the per-option contexts, since there the choices live in the context).
  """

  requests: tuple[tuple[str, str], ...]
  choices: tuple[str, ...]
  gold: int

  def __post_init__(self):
    if len(self.requests) != len(self.choices) or not self.requests:
      raise ValueError(f"{len(self.requests)} requests for {len(self.choices)} choices")
    if not 0 <= self.gold < len(self.requests):
      raise ValueError(f"gold index {self.gold} out of range for {len(self.requests)} choices")

  def with_gold(self, gold: int) -> "MultipleChoiceDoc":
    return dataclasses.replace(self, gold=gold)


Doc = LoglikelihoodDoc | MultipleChoiceDoc


# ---------------------------------------------------------------------------------------------
# jsonl reading with line-numbered errors


def _iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, int, dict]]:
  """Yields (where, line_number, record) for every line; blank or non-object lines raise."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"benchmark file not found: {path!r}")
  lineno = 0
  with open(path, "rb") as f:   # decoded line by line: a bad byte is named with its line
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line; "
                         "a binary file?)") from None
      if not line.strip():
        raise ValueError(f"{where}: empty line")
      yield where, lineno, parse_object(line, where)
  if lineno == 0:
    raise ValueError(f"benchmark file is empty: {path!r}")


def _get(record: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
  if key not in record:
    raise ValueError(f"{where}: missing key {key!r}")
  value = record[key]
  if not isinstance(value, kind) or isinstance(value, bool):
    names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
    raise ValueError(f"{where}: key {key!r} should be {names}, got {type(value).__name__}")
  return value


def _str_list(value: Any, what: str, where: str) -> list[str]:
  if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
    raise ValueError(f"{where}: {what} should be a non-empty list of strings")
  return value


# ---------------------------------------------------------------------------------------------
# LAMBADA (lambada_openai)


def lambada_doc(text: str) -> LoglikelihoodDoc:
  words = text.split(" ")
  if len(words) < 2 or not words[-1]:
    raise ValueError("text has no ' '-separated last word")
  return LoglikelihoodDoc(context=" ".join(words[:-1]), continuation=" " + words[-1])


def load_lambada(path: str | os.PathLike) -> list[LoglikelihoodDoc]:
  docs = []
  for where, _, record in _iter_jsonl(path):
    text = _get(record, "text", str, where)
    try:
      docs.append(lambada_doc(text))
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
  return docs


# ---------------------------------------------------------------------------------------------
# HellaSwag


def hellaswag_preprocess(text: str) -> str:
  """The harness's cleanup of WikiHow artefacts."""
  text = text.strip()
  text = text.replace(" [title]", ". ")
  text = re.sub(r"\[.*?\]", "", text)
  return text.replace("  ", " ")


def _int_label(value: Any, key: str, where: str) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{where}: {key!r} should be an integer, got bool")
  if isinstance(value, int):
    return value
  if isinstance(value, str) and value.strip().lstrip("-").isdigit():
    return int(value)
  raise ValueError(f"{where}: {key!r} should be an integer, got {value!r}")


def hellaswag_doc(record: dict, where: str = "<record>") -> MultipleChoiceDoc:
  ctx_a = _get(record, "ctx_a", str, where)
  ctx_b = _get(record, "ctx_b", str, where)
  label = _get(record, "activity_label", str, where)
  endings = _str_list(record.get("endings"), "'endings'", where)
  if "label" not in record or record["label"] in ("", None):
    raise ValueError(f"{where}: missing key 'label' (unlabelled test split?)")
  gold = _int_label(record["label"], "label", where)
  if not 0 <= gold < len(endings):
    raise ValueError(f"{where}: label {gold} out of range for {len(endings)} endings")
  query = hellaswag_preprocess(label + ": " + ctx_a + " " + ctx_b.capitalize())
  choices = tuple(hellaswag_preprocess(e) for e in endings)
  return MultipleChoiceDoc(tuple((query, " " + c) for c in choices), choices, gold)


def load_hellaswag(path: str | os.PathLike) -> list[MultipleChoiceDoc]:
  return [hellaswag_doc(record, where) for where, _, record in _iter_jsonl(path)]


# ---------------------------------------------------------------------------------------------
# ARC (Easy / Challenge)


def arc_doc(record: dict, where: str = "<record>") -> MultipleChoiceDoc:
  question = record.get("question")
  if isinstance(question, dict):  # allenai ARC-V1-Feb2018 layout
    stem = _get(question, "stem", str, where)
    raw = question.get("choices")
    if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
      raise ValueError(f"{where}: 'question.choices' should be a non-empty list of objects")
    texts = [_get(c, "text", str, where) for c in raw]
    labels = [_get(c, "label", str, where) for c in raw]
  elif isinstance(question, str):  # Hugging Face allenai/ai2_arc layout
    stem = question
    raw = record.get("choices")
    if not isinstance(raw, dict):
      raise ValueError(f"{where}: 'choices' should be an object with 'text' and 'label'")
    texts = _str_list(raw.get("text"), "'choices.text'", where)
    labels = _str_list(raw.get("label"), "'choices.label'", where)
  else:
    raise ValueError(f"{where}: 'question' should be a string or an object with 'stem'")
  if len(texts) != len(labels):
    raise ValueError(f"{where}: {len(texts)} choice texts but {len(labels)} labels")
  answer = _get(record, "answerKey", str, where)
  if answer not in labels:
    raise ValueError(f"{where}: answerKey {answer!r} not among the labels {labels}")
  context = f"Question: {stem}\nAnswer:"
  return MultipleChoiceDoc(tuple((context, " " + t) for t in texts), tuple(texts),
                           labels.index(answer))


def load_arc(path: str | os.PathLike) -> list[MultipleChoiceDoc]:
  return [arc_doc(record, where) for where, _, record in _iter_jsonl(path)]


# ---------------------------------------------------------------------------------------------
# WinoGrande (partial scoring)


def winogrande_doc(record: dict, where: str = "<record>",
                   answer: str | None = None) -> MultipleChoiceDoc:
  sentence = _get(record, "sentence", str, where)
  options = [_get(record, "option1", str, where), _get(record, "option2", str, where)]
  if answer is None:
    answer = _get(record, "answer", str, where)
  if answer not in ("1", "2"):
    raise ValueError(f"{where}: answer should be '1' or '2', got {answer!r}")
  if sentence.count("_") != 1:
    raise ValueError(f"{where}: sentence should contain exactly one '_' blank, "
                     f"found {sentence.count('_')}")
  blank = sentence.index("_")
  contexts = tuple(sentence[:blank] + option for option in options)
  continuation = " " + sentence[blank + 1:].strip()
  return MultipleChoiceDoc(tuple((c, continuation) for c in contexts), contexts,
                           int(answer) - 1)


def load_winogrande(path: str | os.PathLike,
                    labels_path: str | os.PathLike | None = None) -> list[MultipleChoiceDoc]:
  """`labels_path`: the official `*-labels.lst` (one "1"/"2" per line) for files whose records
  carry no `answer`; when given, it takes precedence and must have one label per record."""
  labels = None
  if labels_path is not None:
    labels_path = os.fspath(labels_path)
    with open(labels_path, encoding="utf-8") as f:
      labels = [line.strip() for line in f.read().splitlines()]
  docs = []
  for where, lineno, record in _iter_jsonl(path):
    answer = None
    if labels is not None:
      if lineno > len(labels):
        raise ValueError(f"{where}: no label (only {len(labels)} lines in {labels_path})")
      answer = labels[lineno - 1]
      if answer not in ("1", "2"):
        raise ValueError(f"{labels_path}:{lineno}: label should be '1' or '2', got {answer!r}")
    docs.append(winogrande_doc(record, where, answer))
  if labels is not None and len(labels) != len(docs):
    raise ValueError(f"{labels_path}:{len(docs) + 1}: {len(labels)} labels for "
                     f"{len(docs)} records")
  return docs


# ---------------------------------------------------------------------------------------------
# registry


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  kind: str  # "loglikelihood" | "multiple_choice"
  metrics: tuple[str, ...]
  load: Callable[..., list]
  description: str


TASKS: dict[str, TaskSpec] = {
    "lambada_openai": TaskSpec("lambada_openai", "loglikelihood", ("acc", "perplexity"),
                               load_lambada, "LAMBADA (OpenAI detokenized test), last word"),
    "hellaswag": TaskSpec("hellaswag", "multiple_choice", ("acc", "acc_norm"),
                          load_hellaswag, "HellaSwag (rowanz format)"),
    "arc_easy": TaskSpec("arc_easy", "multiple_choice", ("acc", "acc_norm"), load_arc,
                         "ARC-Easy"),
    "arc_challenge": TaskSpec("arc_challenge", "multiple_choice", ("acc", "acc_norm"), load_arc,
                              "ARC-Challenge"),
    "winogrande": TaskSpec("winogrande", "multiple_choice", ("acc",), load_winogrande,
                           "WinoGrande (partial scoring)"),
}


GENERATED = ("niah", "mqar")   # built by eval/niah.py and eval/mqar.py, not read from a file
ALIASES = {"lambada": "lambada_openai", "arc_e": "arc_easy", "arc_c": "arc_challenge"}


def task_names() -> str:
  """Every name a task list takes (eval.py --tasks, config.eval.tasks), for messages."""
  aliases = ", ".join(f"{a} = {t}" for a, t in ALIASES.items())
  return f"{', '.join(sorted(TASKS) + list(GENERATED))} (aliases: {aliases})"


def get_task(name: str) -> TaskSpec:
  """The file-backed task `name`; ValueError naming every task name there is otherwise."""
  if name in GENERATED:
    raise ValueError(f"eval task {name!r} is generated (attn_jax/eval/{name}.py), not loaded "
                     "from a file")
  if name not in TASKS:
    raise ValueError(f"unknown eval task {name!r}; known: {task_names()}")
  return TASKS[name]


def load_task(name: str, path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Doc]:
  """Loads task `name` from `path` (WinoGrande also takes (jsonl, labels.lst))."""
  spec = get_task(name)
  if isinstance(path, (list, tuple)):
    return spec.load(*path)
  return spec.load(path)


def shared_data_paths(root: str | os.PathLike) -> dict[str, str]:
  """Task -> file for the layout of shared/data (see its SOURCES.md)."""
  root = os.fspath(root)
  return {
      "lambada_openai": os.path.join(root, "lambada", "lambada_test.jsonl"),
      "hellaswag": os.path.join(root, "hellaswag", "hellaswag.jsonl"),
      "arc_easy": os.path.join(root, "arc", "ARC-Easy-Test.jsonl"),
      "arc_challenge": os.path.join(root, "arc", "ARC-Challenge-Test.jsonl"),
      "winogrande": os.path.join(root, "winogrande", "dev.jsonl"),
  }
