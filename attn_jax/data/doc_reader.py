"""The documents of an input file: one reader, for training from `data.paths` (text.py) and for
preparing token shards (shard_prep.py), with one rule for a bad record.

Formats (`fmt`: an entry of `formats.FORMATS`; by default the file name's; a "text" source reads
every file as .txt and a "jsonl" source as .jsonl, whatever its name):
  * .txt: `text_document="line"`: every non-blank line is a document (its line ending dropped,
    the rest as it is); "file": the whole file is one document, unless it is blank.
  * .jsonl, .jsonl.zst (needs `zstandard`): one JSON object per line, the document its field
    `text_field`; blank lines hold no document, nor does an empty string.
  * .parquet (needs `pyarrow`): column `text_field`; a null or empty value holds no document.
Lines end at "\\n" only (not at the other characters str.splitlines breaks on), so a line number
is the one an editor shows.

A bad record is a line that is not UTF-8; a JSONL line that is not JSON, not an object, without
the field `text_field` or whose field is not a string; a Parquet value that is not a string. It
is reported as "file:line: why" ("<source>:record <n>" for a stream of records,
`record_document`), and what it becomes is the caller's `BadRecords`:
  * on_error="raise" (the default, and training's only rule: a corpus trains as it is or not at
    all): a DataError naming it;
  * on_error="skip" (experiments/prepare_data.py --on_error=skip): counted in `skips` (the
    first `MAX_LISTED_SKIPS` listed, for the index and the summary) and left out; the rest of
    the file is read.
Blank lines, empty documents and null values are not bad: they hold no document. What cannot
be read at all (a corrupt zstd stream, a file that is not Parquet, a missing Parquet column) is
a DataError whatever `on_error`. A file as a whole (missing, empty, without any document) is
the caller's to judge: training refuses it (text.py), preparation reports it as a bad record
of its own ("file: empty file", shard_prep.py).

The two callers word two reasons differently, and their tests hold both wordings (`Wording`):
training's errors list the object's keys (`TRAIN_WORDS`); preparation's are short enough for
the index's list of skips, and a raised one says how to skip instead (`PREPARE_WORDS`).
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Iterator, Mapping

from attn_jax import paths
from attn_jax.data.formats import FORMATS, input_format

ON_ERROR = ("raise", "skip")
TEXT_DOCUMENT_MODES = ("line", "file")
MAX_LISTED_SKIPS = 20


class DataError(ValueError):
  """Bad input data; the message starts with "file:line:" (or "file:")."""


@dataclasses.dataclass
class Skips:
  """Counted bad records of one file (`on_error="skip"`)."""
  count: int = 0
  listed: list = dataclasses.field(default_factory=list)

  def add(self, where: str, why: str) -> None:
    self.count += 1
    if len(self.listed) < MAX_LISTED_SKIPS:
      self.listed.append(f"{where}: {why}")


@dataclasses.dataclass(frozen=True)
class Wording:
  """A caller's words for two reasons (module docstring); `hint` ends a raised error."""
  missing: str      # the object has no `text_field`: .format(field=, keys=)
  not_string: str   # the field is not a string: .format(field=, type=)
  hint: str = ""


TRAIN_WORDS = Wording(
    missing="missing field {field!r} (data.text_field); the object has keys {keys}",
    not_string="field {field!r} must be a string, got {type}")
PREPARE_WORDS = Wording(
    missing="no field {field!r} (data.text_field)",
    not_string="field {field!r} is a {type}, not a string",
    hint=" (prepare_data --on_error=skip counts and skips such records)")


@dataclasses.dataclass
class BadRecords:
  """What a bad record becomes (module docstring): a DataError, or a counted skip."""
  on_error: str = "raise"
  skips: Skips = dataclasses.field(default_factory=Skips)
  words: Wording = TRAIN_WORDS

  def __post_init__(self):
    if self.on_error not in ON_ERROR:
      raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")

  def __call__(self, where: str, why: str) -> None:
    if self.on_error == "raise":
      raise DataError(f"{where}: {why}{self.words.hint}")
    self.skips.add(where, why)


# ------------------------------------------------------------------ lines


def _byte_lines(path: str, zst: bool) -> Iterator[bytes]:
  if not zst:
    with paths.run_path(path).open("rb") as f:
      yield from f
    return
  try:
    import zstandard   # optional: only .zst inputs need it
  except ImportError:
    raise ImportError(f"{path}: reading .zst needs the `zstandard` package "
                      "(pip install zstandard)") from None
  with paths.run_path(path).open("rb") as raw:
    reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    try:
      yield from reader
    except zstandard.ZstdError as e:
      raise DataError(f"{path}: corrupt zstd stream: {e}") from None


def _lines(path: str, bad: BadRecords, zst: bool = False) -> Iterator[tuple[int, str]]:
  """(line number, text without its line ending) of every UTF-8 line; the others are bad."""
  for number, raw in enumerate(_byte_lines(path, zst), start=1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      bad(f"{path}:{number}", f"not valid UTF-8 ({e.reason} at byte {e.start})")
      continue
    yield number, line.rstrip("\r\n")


# ------------------------------------------------------------------ formats


def record_document(record, where: str, text_field: str, bad: BadRecords) -> str | None:
  """The text of one record (a JSONL line's object, a Hugging Face row); None if it is bad."""
  if not isinstance(record, Mapping):
    bad(where, f"expected a JSON object, got {type(record).__name__}")
    return None
  if text_field not in record:
    bad(where, bad.words.missing.format(field=text_field, keys=sorted(record)[:10]))
    return None
  doc = record[text_field]
  if not isinstance(doc, str):
    bad(where, bad.words.not_string.format(field=text_field, type=type(doc).__name__))
    return None
  return doc


def _jsonl_documents(path, text_field, bad, zst) -> Iterator[str]:
  for number, line in _lines(path, bad, zst):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      bad(where, f"invalid JSON: {e.msg} (column {e.colno})")
      continue
    doc = record_document(record, where, text_field, bad)
    if doc:
      yield doc


def _text_documents(path, text_document, bad) -> Iterator[str]:
  if text_document == "line":
    yield from (line for _, line in _lines(path, bad) if line.strip())
    return
  raw = paths.run_path(path).read_bytes()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[: e.start].count(b"\n") + 1
    bad(f"{path}:{line}", f"not valid UTF-8 ({e.reason} at byte {e.start})")
    return
  if text.strip():
    yield text


def _parquet_documents(path, text_field, bad) -> Iterator[str]:
  try:
    import pyarrow.parquet as pq   # optional: only .parquet inputs need it
  except ImportError:
    raise ImportError(f"{path}: reading .parquet needs the `pyarrow` package "
                      "(pip install pyarrow)") from None
  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # pyarrow.ArrowInvalid and friends
    raise DataError(f"{path}: not a readable Parquet file: {e}") from None
  if text_field not in pf.schema_arrow.names:
    raise DataError(f"{path}: no column {text_field!r} (data.text_field); columns "
                    f"{pf.schema_arrow.names[:10]}")
  row = 0
  for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
    for doc in batch.column(0).to_pylist():
      row += 1
      if doc is None:
        continue
      if not isinstance(doc, str):
        bad(f"{path}:row {row}", f"column {text_field!r} holds {type(doc).__name__}")
        continue
      if doc:
        yield doc


def read_documents(path: str, *, fmt: str | None = None, text_field: str = "text",
                   text_document: str = "line", bad: BadRecords | None = None
                   ) -> Iterator[str]:
  """The documents of one input file, in order, read as they are consumed (module docstring).
  `fmt`: how to read it (default: its name's format); `bad`: what a bad record becomes
  (default: a DataError naming it, in training's words)."""
  bad = BadRecords() if bad is None else bad
  fmt = fmt or input_format(path)
  if fmt in (".jsonl", ".jsonl.zst"):
    return _jsonl_documents(path, text_field, bad, zst=fmt == ".jsonl.zst")
  if fmt == ".parquet":
    return _parquet_documents(path, text_field, bad)
  if fmt == ".txt":
    if text_document not in TEXT_DOCUMENT_MODES:
      raise ValueError(
          f"data.text_document must be one of {TEXT_DOCUMENT_MODES}, got {text_document!r}")
    return _text_documents(path, text_document, bad)
  raise ValueError(f"{path}: unknown format (expected one of {FORMATS})")
