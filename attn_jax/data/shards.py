"""Reading pre-tokenised corpora: the token shards of a prepared folder (shard_prep.py) as
fixed-length windows, without loading them.

Reading (`data.source = "shards"`, `data.paths` = the prepared folder). The shards concatenated
in index order form one stream t[0:T]; window i is t[i*L : i*L + L + 1] (L = `data.seq_len`;
inputs = window[:-1], targets = window[1:], weights 1), exactly the packing of `text.py`, and the
last ceil(n * `data.eval_fraction`) windows are the eval split (training windows may start at
a random token instead, `data.window_offset`, offsets.py). Shards are `np.memmap`s opened
lazily (in each grain worker; pickling keeps only the paths), so building the source costs
O(number of shards) whatever the corpus size, and a window touches only its L + 1 tokens (it may
span two or more shards); a shard on object storage is read in ranges instead. Order, per-host
rows and resumption come from `pipeline.py` (grain's lazy index shuffle over window indices).
Opening checks every shard's size against the index (a truncated or missing shard is an error
naming it) and its sha256 against the index within `data.verify_mb` (shard_checks.py: a flipped
byte is an error naming the shard, not a silent change of the data); `verify_shards` re-hashes
them all.

Document masking (`data.document_mask`): windows also carry `segment_ids` and `positions`
(documents.py: the EOS ending a document is the BOS of the next), from each shard's
`.docs.npy` (memory-mapped too, checked against the index: its count and last end), which is
exact even where the EOS id also occurs inside a document. A shard without one (prepared with
--nodoc_boundaries, or before boundaries were the default) falls back to the EOS tokens of the
window, with a warning naming the folder.

Token ids are checked as windows are read (`TokenShards.read`, a max per shard slice): an id
outside the index's vocabulary (a flipped bit in a shard that was not re-hashed yet) is a
DataError naming the shard, the token offset and the id, never NaN losses.
"""

from __future__ import annotations

import bisect
import functools
import io
import json
import logging

import numpy as np

from attn_jax import paths
from attn_jax.data import documents as doc_lib
from attn_jax.data.doc_reader import DataError
from attn_jax.data.formats import INDEX
from attn_jax.data.offsets import WindowSource
from attn_jax.data.shard_checks import (
    VERIFY_MB, file_size, rehash, tokenizer_id, verify_checksums)
from attn_jax.data.text import split_counts, split_source


def read_index(directory: str) -> dict:
  path = paths.name(paths.run_path(directory) / INDEX)
  if not paths.run_path(path).is_file():
    raise FileNotFoundError(
        f"no {INDEX} in {directory!r} (data.paths for data.source='shards' must be a folder "
        "written by experiments/prepare_data.py; an unfinished preparation has no index)")
  try:
    index = json.loads(paths.run_path(path).read_text())
    index["shards"], index["dtype"], index["tokenizer"]["vocab_size"]  # noqa: B018
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: not a valid shard index ({e})") from None
  return index


class _ObjectTokens:
  """A shard on object storage read like its memmap: `len()` and slices, each slice one ranged
  read of the object (no copy of the shard on the local disk)."""

  def __init__(self, path: str, dtype: np.dtype):
    self.path, self.dtype = path, dtype
    self._n = file_size(path) // dtype.itemsize
    self._f = None

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index: slice) -> np.ndarray:
    start, stop, step = index.indices(self._n)
    if step != 1:
      raise IndexError("object-storage shards are read in contiguous ranges")
    if self._f is None:
      self._f = paths.run_path(self.path).open("rb")
    self._f.seek(start * self.dtype.itemsize)
    data = self._f.read(max(stop - start, 0) * self.dtype.itemsize)
    return np.frombuffer(data, self.dtype)


class TokenShards:
  """The concatenated token stream of a prepared folder, as lazily opened memmaps."""

  def __init__(self, directory: str, *, verify: bool = True, verify_mb: float = VERIFY_MB):
    self.directory = paths.name(directory)   # a local folder or a gs:// URI
    self.index = read_index(self.directory)
    self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
    self.files = [paths.name(paths.run_path(self.directory) / s["file"])
                  for s in self.index["shards"]]
    self.counts = [int(s["tokens"]) for s in self.index["shards"]]
    for path, count in zip(self.files, self.counts):
      if not paths.run_path(path).is_file():
        raise FileNotFoundError(f"token shard missing: {path} (listed in {INDEX})")
      size = file_size(path)
      if size != count * self.dtype.itemsize:
        raise ValueError(f"corrupt token shard {path}: {size} bytes, the index says {count} "
                         f"{self.dtype.name} tokens = {count * self.dtype.itemsize} bytes")
    if verify:
      verify_checksums(self.files, self.index["shards"], verify_mb=verify_mb)
    self.vocab_size = int(self.index["tokenizer"]["vocab_size"])
    self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
    self.num_tokens = int(self.starts[-1])
    self.eos_id = int(self.index["tokenizer"].get("eos_id", -1))
    self.doc_files = [p[: -len(".bin")] + ".docs.npy" if p.endswith(".bin") else None
                      for p in self.files]
    self.has_ends = [f is not None and paths.run_path(f).is_file() for f in self.doc_files]
    self._maps: list | None = None
    self._ends: list | None = None

  def __getstate__(self):  # grain workers reopen the files; never pickle the data
    state = dict(self.__dict__)
    state["_maps"] = state["_ends"] = None
    return state

  def _map(self, i: int) -> np.ndarray:
    if self._maps is None:
      self._maps = [None] * len(self.files)
    if self._maps[i] is None:
      self._maps[i] = (_ObjectTokens(self.files[i], self.dtype) if paths.is_uri(self.files[i])
                       else np.memmap(self.files[i], dtype=self.dtype, mode="r"))
    return self._maps[i]

  def ends(self, i: int) -> np.ndarray:
    """Shard i's document end offsets (its `.docs.npy`, memory-mapped, checked once)."""
    if self._ends is None:
      self._ends = [None] * len(self.files)
    if self._ends[i] is None:
      path, meta = self.doc_files[i], self.index["shards"][i]
      try:
        ends = (np.load(io.BytesIO(paths.run_path(path).read_bytes())) if paths.is_uri(path)
                else np.load(path, mmap_mode="r"))
      except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable document-boundary file ({e})") from None
      docs = meta.get("docs")
      if (ends.ndim != 1 or not len(ends) or int(ends[-1]) != self.counts[i]
          or (docs is not None and len(ends) != int(docs)) or np.any(np.diff(ends) <= 0)):
        raise DataError(
            f"{path}: document boundaries do not match {INDEX} (need {docs} increasing ends, "
            f"the last = the shard's {self.counts[i]} tokens); prepare the corpus again")
      self._ends[i] = ends
    return self._ends[i]

  def document_starts(self, start: int, inputs: np.ndarray) -> np.ndarray:
    """Window indices j in [1, len(inputs)) where a document begins (documents.py), for the
    window whose inputs are stream[start : start + len(inputs)]: from the shards' stored
    ends, or from the window's EOS tokens in a shard without them."""
    stop = start + len(inputs)
    found = []
    i = bisect.bisect_right(self.starts, start + 1) - 1
    while i < len(self.files) and self.starts[i] < stop:
      base = int(self.starts[i])
      lo, hi = max(start + 1, base), min(stop, int(self.starts[i + 1]))
      if self.has_ends[i]:
        found.append(doc_lib.eos_offsets(self.ends(i), lo - base, hi - base) + (base - start))
      else:
        found.append(np.flatnonzero(inputs[lo - start: hi - start] == self.eos_id) + (lo - start))
      i += 1
    return np.concatenate(found) if found else np.zeros(0, np.int64)

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream as int32."""
    if not 0 <= start <= stop <= self.num_tokens:
      raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
    out = np.empty(stop - start, np.int32)
    i = bisect.bisect_right(self.starts, start) - 1
    pos = start
    while pos < stop:
      lo = pos - self.starts[i]
      hi = min(stop, self.starts[i + 1]) - self.starts[i]
      piece = self._map(i)[lo:hi]
      if piece.size and int(piece.max()) >= self.vocab_size:
        self._bad_id(i, lo, piece)
      out[pos - start: pos - start + hi - lo] = piece
      pos += hi - lo
      i += 1
    return out

  def _bad_id(self, i: int, lo: int, piece: np.ndarray) -> None:
    at = int(np.argmax(piece >= self.vocab_size))
    offset = int(lo) + at
    raise DataError(
        f"corrupt token shard {self.files[i]}: token id {int(piece[at])} at token offset "
        f"{offset} (byte {offset * self.dtype.itemsize}) is outside the vocabulary "
        f"(vocab_size {self.vocab_size} in {INDEX}); its bytes changed after it was prepared "
        "(experiments/prepare_data.py --verify re-hashes every shard; prepare the corpus "
        "again)")


class ShardWindows(WindowSource):
  """Random-access source of windows `first + i` of a TokenShards stream (grain protocol)."""

  def __init__(self, shards: TokenShards, *, seq_len: int, first: int, count: int,
               document_mask: bool = False):
    if (first + count) * seq_len + 1 > shards.num_tokens:
      raise ValueError("ShardWindows range exceeds the token stream")
    self.shards, self.seq_len, self.first, self.count = shards, seq_len, first, count
    self.document_mask = document_mask
    missing = len(shards.has_ends) - sum(shards.has_ends)
    if document_mask and missing:
      logging.warning("data.document_mask: %d of the %d token shards in %s have no document "
                      "boundary file (.docs.npy; prepared with --nodoc_boundaries?): their "
                      "documents are split at EOS tokens instead", missing,
                      len(shards.has_ends), shards.directory)

  def window(self, index: int, offset: int) -> dict[str, np.ndarray]:
    """Window `index` moved `offset` tokens later (`data.window_offset`, offsets.py)."""
    start = self.start(index, offset)
    window_T = self.shards.read(start, start + self.seq_len + 1)
    example = {"inputs": window_T[:-1], "targets": window_T[1:],
               "weights": np.ones(self.seq_len, np.float32)}
    if self.document_mask:
      example.update(doc_lib.document_fields(
          self.shards.document_starts(start, example["inputs"]), self.seq_len))
    return example

  def __repr__(self) -> str:
    return (f"ShardWindows({self.shards.directory}, first={self.first}, count={self.count}, "
            f"seq_len={self.seq_len})")


def check_tokenizer(index: dict, data_cfg) -> None:
  """The configured `data.tokenizer` must be the one the shards were made with."""
  spec = str(data_cfg.tokenizer)
  want = index["tokenizer"]
  try:
    have = tokenizer_id(spec)
  except OSError as e:
    raise FileNotFoundError(f"data.tokenizer={spec!r}: {e}") from None
  if have != want["id"]:
    raise ValueError(
        f"data.tokenizer={spec!r} is not the tokenizer the shards in data.paths were made with "
        f"({want['spec']!r}, vocab {want['vocab_size']}); set data.tokenizer to it")


def make_shard_source(data_cfg, *, split: str = "train") -> ShardWindows:
  """The packed train or eval split of the prepared folder `data.paths`."""
  directory = str(data_cfg.paths).strip()
  if not directory or "," in directory:
    raise ValueError(f"data.paths must be one prepared folder for data.source='shards', got "
                     f"{data_cfg.paths!r}")
  verify_mb = data_cfg.verify_mb
  if (isinstance(verify_mb, bool) or not isinstance(verify_mb, (int, float))
      or (verify_mb < 0 and verify_mb != -1)):
    raise ValueError(f"config.data.verify_mb: must be a number of MB >= 0, or -1 (every shard "
                     f"at every start), got {verify_mb!r}")
  shards = TokenShards(directory, verify_mb=verify_mb)
  check_tokenizer(shards.index, data_cfg)
  num_train, num_eval = split_counts(shards.num_tokens, data_cfg)
  kw = dict(seq_len=int(data_cfg.seq_len), document_mask=doc_lib.document_mask(data_cfg))
  if split == "train":
    counts = [meta.get("docs") for meta in shards.index["shards"]]
    if all(c is not None for c in counts):
      doc_lib.warn_if_one_document(sum(int(c) for c in counts), data_cfg)
  return split_source(functools.partial(ShardWindows, shards, **kw), split, num_train,
                      num_eval)


def shards_vocab_size(data_cfg) -> int:
  return int(read_index(str(data_cfg.paths).strip())["tokenizer"]["vocab_size"])



def verify_shards(directory: str) -> list[str]:
  """Problems found by re-hashing every shard against the index ([] = all good)."""
  shards = TokenShards(directory, verify=False)
  return rehash(shards.files, shards.index["shards"])
