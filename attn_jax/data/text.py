"""Local text corpora: read documents, tokenize once, pack into fixed-length sequences.

Sources (`data.source`):
  * "text": plain UTF-8 files. With `data.text_document = "line"` every non-blank line is a
    document; with "file" each whole file is one document.
  * "jsonl": one JSON object per line, the document in field `data.text_field` (a string).
    Blank lines are skipped; empty documents are skipped.
Every file is read by `doc_reader.read_documents` (the reader experiments/prepare_data.py uses
too), as .txt for "text" and .jsonl for "jsonl" whatever its name: a bad line (not UTF-8; in a
JSONL file, not a JSON object, without the field or with a non-string one) is an error naming
file:line, and a file without any document (empty, blank) is an error naming it.
`data.paths`: comma-separated files or folders; a folder stands for its `.txt` ("text") or
`.jsonl` ("jsonl") files, searched recursively and read in sorted order, as
experiments/prepare_data.py reads a folder (`data_files`). A folder of prepared token shards,
or one without such files, is an error naming it and the source that reads what it holds.

Packing. Every document is followed by the tokenizer's EOS id and all documents (in file
order, files in `data.paths` order) are concatenated into one int32 token stream t[0:T].
Sequence i is the window t[i*L : i*L + L + 1] (L = `data.seq_len`), so consecutive windows
share one token: inputs = window[:-1], targets = window[1:], weights = 1. Every token except
t[0] is a target exactly once, and the inputs of sequences 0, 1, ... concatenated are the
stream itself. There are n = (T - 1) // L sequences; the tail that does not fill one is dropped.

Document masking (`data.document_mask`): every sequence also carries `segment_ids` and
`positions` (documents.py: the EOS ending a document is the BOS of the next), from the document
ends recorded while tokenizing (exact whatever the documents contain).

Training windows may also start at a random token instead of a multiple of L
(`data.window_offset`, offsets.py); the eval split keeps the aligned windows.

Held-out split. The last ceil(n * `data.eval_fraction`) sequences are the eval split and are
never trained on (the first eval window's first token is the last train window's last target
token, nothing more is shared).

The corpus is tokenized once per process and kept in memory (keyed by the files' paths, sizes
and modification times, plus the tokenizer and format options).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Sequence

import numpy as np

from attn_jax import paths
from attn_jax.data import documents as doc_lib
from attn_jax.data.doc_reader import read_documents
from attn_jax.data.formats import INDEX, input_format
from attn_jax.data.offsets import WindowSource
from attn_jax.data.tokenizer import Tokenizer, get_tokenizer

TEXT_SOURCES = ("text", "jsonl")


def split_paths(paths: str | Sequence[str]) -> list[str]:
  """`data.paths` is a comma-separated string (or already a sequence); empty entries dropped."""
  if isinstance(paths, str):
    paths = paths.split(",")
  return [os.path.expanduser(p.strip()) for p in paths if p.strip()]


# The format each source reads its files as, and the files a folder in data.paths contributes
# (as experiments/prepare_data.py reads a folder: recursively, known formats only, sorted).
FOLDER_FORMATS = {"text": ".txt", "jsonl": ".jsonl"}


def _folder_files(folder: str, source: str) -> list[str]:
  """The `source`'s files under `folder`, or an error naming the folder and why not."""
  ext = FOLDER_FORMATS[source]
  if (paths.run_path(folder) / INDEX).is_file():
    raise ValueError(f"data.paths: {folder!r} is a folder of token shards (it holds "
                     f"{INDEX}, written by experiments/prepare_data.py); train on it "
                     f"with data.source='shards', not {source!r}")
  found: dict[str, list[str]] = {}
  for rel in paths.files(folder):   # recursive, on a local disk or object storage
    fmt = input_format(rel)
    if fmt is not None:
      found.setdefault(fmt, []).append(folder.rstrip("/") + "/" + rel)
  if found.get(ext):
    return sorted(found[ext])
  other = ", ".join(f"{len(v)} {k}" for k, v in sorted(found.items()))
  hint = ""
  if found.get(".txt") or found.get(".jsonl"):
    hint = (f"; it holds {other} files: set data.source="
            f"{'text' if found.get('.txt') else 'jsonl'!r}")
  elif found:
    hint = (f"; it holds {other} files: tokenize them with experiments/prepare_data.py "
            "--input=<folder>, then train with data.source='shards'")
  raise FileNotFoundError(f"data.paths: the folder {folder!r} holds no {ext} files (with "
                          f"data.source={source!r} a folder contributes its {ext} files, "
                          f"searched recursively, in sorted order){hint}")


def data_files(data_cfg) -> list[str]:
  """The files of `data.paths` for a "text" or "jsonl" source, in reading order: each file as
  given, each folder as its files of the source's format (`FOLDER_FORMATS`: recursive, sorted);
  a path that does not exist, or a folder without such files, is an error naming it."""
  source = str(data_cfg.source)
  if source not in TEXT_SOURCES:
    raise ValueError(f"data.source must be one of {TEXT_SOURCES} here, got {source!r}")
  split = split_paths(data_cfg.paths)
  if not split:
    raise ValueError(f"data.paths is empty: data.source={source!r} needs at least one file")
  files = []
  for path in split:
    if paths.run_path(path).is_dir():
      files.extend(_folder_files(path, source))
    elif paths.run_path(path).is_file():
      files.append(path)
    else:
      raise FileNotFoundError(f"data file not found: {path!r} (from data.paths)")
  return files


def _require_file(path: str, what: str, source: str) -> None:
  if not paths.run_path(path).is_file():
    raise FileNotFoundError(f"{what} not found: {path!r} (from {source})")


def read_text_file(path: str, *, what: str = "data file", source: str = "data.paths") -> str:
  """The whole UTF-8 text of `path`; a missing, binary / non-UTF-8 or empty file is an error
  naming it, the byte offset and where the path came from (`source`: a config field or flag)."""
  _require_file(path, what, source)
  try:
    content = paths.run_path(path).read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{what} {path!r} (from {source}) is not UTF-8 text: byte {e.start} is "
                     f"{e.object[e.start:e.start + 1]!r} (a binary file?)") from None
  if not content.strip():
    raise ValueError(f"{what} is empty: {path!r} (from {source})")
  return content


def file_documents(path: str, *, source: str, text_field: str = "text",
                   text_document: str = "line") -> list[str]:
  """The documents of one data.paths file for `source` "text" or "jsonl" (module docstring): a
  bad line is a DataError naming file:line; a missing file, or one without a document, an
  error naming it."""
  if source not in TEXT_SOURCES:
    raise ValueError(f"data.source must be one of {TEXT_SOURCES} here, got {source!r}")
  _require_file(path, "data file", "data.paths")
  documents = list(read_documents(path, fmt=FOLDER_FORMATS[source], text_field=text_field,
                                  text_document=text_document))
  if not documents:
    read_text_file(path)   # a blank file: "data file is empty"
    raise ValueError(f"data file has no non-empty {text_field!r} documents: {path!r}")
  return documents


def read_text_documents(path: str, *, text_document: str = "line") -> list[str]:
  """Documents of a plain text file: its non-blank lines, or the whole file."""
  return file_documents(path, source="text", text_document=text_document)


def read_jsonl_documents(path: str, *, text_field: str = "text") -> list[str]:
  """Documents of a JSONL file: field `text_field` of every object. Errors name file:line."""
  return file_documents(path, source="jsonl", text_field=text_field)


def tokenize_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> np.ndarray:
  """int32 [T]: each document's ids followed by `tokenizer.eos_id`, all concatenated."""
  return pack_documents(tokenizer, documents)[0]


def pack_documents(tokenizer: Tokenizer, documents: Sequence[str]
                   ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [T], ends int64 [D]): the stream of `tokenize_documents` and the exclusive
  end offset of every document in it (its EOS sits at end - 1).

  Uses the tokenizer's `encode_batch` (parallel in `tokenizers`) when it has one.
  """
  encode_batch = getattr(tokenizer, "encode_batch", None)
  if encode_batch is not None:
    ids_per_document = encode_batch(list(documents))
  else:
    ids_per_document = [tokenizer.encode(d) for d in documents]
  lengths_D = np.fromiter((len(ids) + 1 for ids in ids_per_document), np.int64,
                          count=len(ids_per_document))
  tokens_T = np.empty(int(lengths_D.sum()), np.int32)
  ends_D = np.cumsum(lengths_D)
  for ids, end in zip(ids_per_document, ends_D):
    tokens_T[end - 1 - len(ids) : end - 1] = ids
  tokens_T[ends_D - 1] = tokenizer.eos_id
  return tokens_T, ends_D


@functools.lru_cache(maxsize=4)
def _cached_corpus(
    paths: tuple[str, ...], file_stamps: tuple, source: str, text_field: str,
    text_document: str, tokenizer_spec: str
) -> tuple[np.ndarray, np.ndarray]:
  del file_stamps  # only part of the cache key
  documents = [d for path in paths for d in file_documents(
      path, source=source, text_field=text_field, text_document=text_document)]
  tokens_T, ends_D = pack_documents(get_tokenizer(tokenizer_spec), documents)
  tokens_T.setflags(write=False)  # shared by every caller of the cache
  ends_D.setflags(write=False)
  return tokens_T, ends_D


def load_token_stream(data_cfg) -> np.ndarray:
  """The corpus of `data.paths` as one read-only int32 [T] stream (tokenized once, cached)."""
  return load_corpus(data_cfg)[0]


def load_corpus(data_cfg) -> tuple[np.ndarray, np.ndarray]:
  """(read-only token stream int32 [T], document ends int64 [D]) of `data.paths` (cached)."""
  files = tuple(data_files(data_cfg))   # folders: their files (FOLDER_FORMATS)
  source = str(data_cfg.source)
  file_stamps = []
  for path in files:
    stat = paths.run_path(path).stat()   # a local file or an object (gs://)
    file_stamps.append((stat.length, stat.mtime))
  return _cached_corpus(
      files, tuple(file_stamps), source, str(data_cfg.text_field),
      str(data_cfg.text_document), str(data_cfg.tokenizer))


class PackedSequences(WindowSource):
  """Random-access source of packed windows: item i = stream window `first + i` (see above).

  `doc_ends` (the documents' end offsets, `pack_documents`): items also carry `segment_ids`
  and `positions` (documents.py). Satisfies grain's RandomAccessDataSource protocol.
  """

  ITEM = "sequence"

  def __init__(self, tokens_T: np.ndarray, *, seq_len: int, first: int, count: int,
               doc_ends: np.ndarray | None = None):
    if (first + count) * seq_len + 1 > len(tokens_T):
      raise ValueError("PackedSequences range exceeds the token stream")
    self.tokens_T = tokens_T
    self.seq_len = seq_len
    self.first = first
    self.count = count
    self.doc_ends = doc_ends

  def window(self, index: int, offset: int) -> dict[str, np.ndarray]:
    """Item `index` moved `offset` tokens later (`data.window_offset`, offsets.py)."""
    start = self.start(index, offset)
    window_T = self.tokens_T[start : start + self.seq_len + 1]
    example = {
        "inputs": window_T[:-1].copy(),
        "targets": window_T[1:].copy(),
        "weights": np.ones(self.seq_len, np.float32),
    }
    if self.doc_ends is not None:
      example.update(doc_lib.document_fields(
          doc_lib.starts_from_ends(self.doc_ends, start, self.seq_len), self.seq_len))
    return example

  def __repr__(self) -> str:
    return f"PackedSequences(first={self.first}, count={self.count}, seq_len={self.seq_len})"


def split_counts(num_tokens: int, data_cfg) -> tuple[int, int]:
  """(train, eval) sequence counts for a stream of `num_tokens` tokens; errors if no training."""
  seq_len = int(data_cfg.seq_len)
  eval_fraction = float(data_cfg.eval_fraction)
  if seq_len < 1:
    raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
  num_sequences = max(num_tokens - 1, 0) // seq_len
  if num_sequences == 0:
    raise ValueError(
        f"too few tokens in data.paths={data_cfg.paths!r}: {num_tokens} tokens (EOS included) "
        f"do not fill one sequence of data.seq_len + 1 = {seq_len + 1} tokens")
  num_eval = math.ceil(num_sequences * eval_fraction) if eval_fraction > 0 else 0
  if num_sequences - num_eval < 1:
    raise ValueError(
        f"too few tokens in data.paths={data_cfg.paths!r}: {num_tokens} tokens make "
        f"{num_sequences} sequence(s) of data.seq_len + 1 = {seq_len + 1} tokens, and "
        f"data.eval_fraction={eval_fraction} holds out {num_eval}, leaving none to train on")
  return num_sequences - num_eval, num_eval


def split_source(make, split: str, num_train: int, num_eval: int):
  """`make(first=, count=)` of the train split (windows [0, num_train)) or of the eval split
  (the num_eval windows after them)."""
  if split == "train":
    return make(first=0, count=num_train)
  if split == "eval":
    if num_eval == 0:
      raise ValueError("no eval split: data.eval_fraction is 0")
    return make(first=num_train, count=num_eval)
  raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def make_text_source(data_cfg, *, split: str = "train") -> PackedSequences:
  """The packed train or eval split of the corpus in `data.paths`."""
  tokens_T, ends_D = load_corpus(data_cfg)
  num_train, num_eval = split_counts(len(tokens_T), data_cfg)
  kw = dict(seq_len=int(data_cfg.seq_len),
            doc_ends=ends_D if doc_lib.document_mask(data_cfg) else None)
  if split == "train":
    doc_lib.warn_if_one_document(len(ends_D), data_cfg)
  return split_source(functools.partial(PackedSequences, tokens_T, **kw), split, num_train,
                      num_eval)
