"""Per-token document ids and positions of a packed window (`data.document_mask`).

Packed sources join documents with EOS: the stream is d_1 EOS d_2 EOS d_3 ... A window's inputs
are stream[s : s + L] and its targets stream[s + 1 : s + L + 1]. With `data.document_mask` on
every example also carries

    segment_ids int32 [L]   the document of each *input* token, numbered from 1 in the window
    positions   int32 [L]   the input token's position in its document, from 0

Convention: the EOS that ends document k is the first input token (the BOS) of document k + 1,
i.e. the segment id increments at every EOS input token. Document k + 1 alone is then the row
[EOS, t_1 .. t_n] with targets [t_1 .. t_n, EOS]: every target is the next token of an input of
the same document, so no loss target is dropped or changes meaning, and the masked row gives
exactly the loss of the documents run one per row. The first document of a stream has no EOS
before it (it starts at its first token); a document cut by the window start starts at
position 0 in that window (as it would in a row of its own); a window starting at an EOS begins
with that document's BOS. A document of length n therefore spans n + 1 input tokens (its BOS and
its n tokens), except the stream's first.

`starts` below are the window-relative indices j in [1, L) where a new document begins (its BOS,
the EOS input token). Sources find them from stored document ends (exact even when the EOS id
also occurs inside a document) or, without them, from the EOS tokens of the window.
"""

from __future__ import annotations

import logging

import numpy as np

SEGMENT_KEYS = ("segment_ids", "positions")   # the batch keys added by data.document_mask


def document_fields(starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
  """{"segment_ids", "positions"} [length] of a window whose documents begin at `starts`
  (sorted window indices in [1, length); index 0 always begins one)."""
  starts = np.asarray(starts, np.int64)
  if starts.size and (starts[0] < 1 or starts[-1] >= length or np.any(np.diff(starts) <= 0)):
    raise ValueError(f"document starts must be increasing in [1, {length}), got {starts}")
  new_doc = np.zeros(length, np.int32)
  new_doc[starts] = 1
  segment_ids = 1 + np.cumsum(new_doc, dtype=np.int32)
  first = np.concatenate([[0], starts])              # start of document k+1 at first[k]
  positions = np.arange(length, dtype=np.int64) - first[segment_ids - 1]
  return {"segment_ids": segment_ids, "positions": positions.astype(np.int32)}


def eos_starts(inputs: np.ndarray, eos_id: int) -> np.ndarray:
  """Document starts of a window from its EOS input tokens (the fallback without stored ends)."""
  return np.flatnonzero(np.asarray(inputs)[1:] == eos_id) + 1


def eos_offsets(ends: np.ndarray, lo: int, hi: int) -> np.ndarray:
  """The stream offsets in [lo, hi) of the EOS tokens that end documents, from the sorted
  exclusive document ends `ends` (a document's EOS sits at end - 1)."""
  ends = np.asarray(ends)
  a, b = np.searchsorted(ends, [lo + 1, hi + 1], side="left")
  return ends[a:b].astype(np.int64) - 1


def starts_from_ends(ends: np.ndarray, first: int, length: int) -> np.ndarray:
  """Window starts for the window whose inputs are stream[first : first + length]."""
  return eos_offsets(ends, first + 1, first + length) - first


def single_document(length: int) -> dict[str, np.ndarray]:
  """The fields of a row that is one document (synthetic examples)."""
  return document_fields(np.zeros(0, np.int64), length)


def warn_if_one_document(num_documents: int, data_cfg) -> None:
  """`data.document_mask` on a corpus of a single document masks nothing (every segment id is
  1): said once, when the training split is built, with how to get documents."""
  if num_documents > 1 or not document_mask(data_cfg):
    return
  how = ("data.text_document='file' makes each file one document; with 'line' every non-blank "
         "line is one" if str(data_cfg.source) == "text" else
         "documents come from the corpus's records / EOS-separated texts")
  logging.warning("config.data.document_mask=True, but data.paths=%r holds %d document (%s): "
                  "every row lies inside it, all segment ids are 1 and the mask changes "
                  "nothing; split the corpus into documents or set data.document_mask=False",
                  str(data_cfg.paths), num_documents, how)


def document_mask(data_cfg) -> bool:
  """`data.document_mask` of the run's `DataConfig`, checked to be a bool."""
  value = data_cfg.document_mask
  if not isinstance(value, bool):
    raise ValueError(f"config.data.document_mask must be True or False, got {value!r}")
  return value


def batch_keys(data_cfg) -> tuple[str, ...]:
  """The keys of every batch the pipeline yields for this data config."""
  return ("inputs", "targets", "weights") + (SEGMENT_KEYS if document_mask(data_cfg) else ())
