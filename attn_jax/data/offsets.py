"""Training windows that start anywhere in the token stream (`data.window_offset`).

Packed sources (text, jsonl, shards) cut the stream t[0:T] into windows at multiples of the
sequence length L: window i is t[iL : iL + L + 1]. Every training window then begins at the
same L-periodic points in every epoch, and for a corpus whose documents are laid out in
L-sized pieces, at a document's first token. StreamingLLM's question (does a model trained
with a sink still need its first tokens once they are evicted?) asks for rows whose first
token is an ordinary token from the middle of the text, at a different place each epoch.

`data.window_offset`:
  * "none" (default): today's windows, unchanged.
  * "random": training window i (i = 0 .. n_train - 2) is t[iL + o : iL + o + L + 1] with
    o uniform in [0, L), drawn from (seed, epoch, i) by `offset_of`. A window then starts at
    a uniformly random token of the training part of the stream, so it begins at a document's
    first token only by chance, and a new offset is drawn in every epoch. The last aligned
    window (i = n_train - 1) is not used: moved by any o > 0 it would read the first eval
    window's tokens, so with offsets the train split has n_train - 1 windows and still ends at
    token n_train * L, the first eval input (held-out tokens are never trained on).

What stays as with aligned windows: inputs / targets are the window's [:-1] / [1:], weights
1; `data.document_mask` fields follow documents.py (a document cut by the window start begins
at position 0 in the row); the order is grain's shuffle of the window indices per epoch, then
repeat, then the hosts' rows (pipeline.py), so a batch is a pure function of (seed, step) and
the iterator's state is still its next index (resume is exact). The eval split keeps its
aligned windows, so held-out scores compare across settings.
"""

from __future__ import annotations

import grain
import numpy as np

WINDOW_OFFSETS = ("none", "random")
_OFFSET_STREAM = 0x51_0FF5E7   # keeps these draws apart from any other use of the data seed


def window_offset(data_cfg) -> str:
  """`data.window_offset` of the run's `DataConfig`, checked to be one of WINDOW_OFFSETS."""
  value = data_cfg.window_offset
  if value not in WINDOW_OFFSETS:
    raise ValueError(f"config.data.window_offset must be one of {WINDOW_OFFSETS}, got {value!r}")
  return value


def offset_of(seed: int, epoch: int, index: int, seq_len: int) -> int:
  """The start offset in [0, seq_len) of training window `index` in `epoch` (deterministic)."""
  rng = np.random.default_rng([_OFFSET_STREAM, int(seed), int(epoch), int(index)])
  return int(rng.integers(0, seq_len))


class OffsetWindows(grain.MapDataset):
  """Element k = source.window(i, o): i = `parent[k]` (a window index of the shuffled and
  repeated range), epoch = k // `count`, o = `offset_of(seed, epoch, i, L)`."""

  def __init__(self, parent: grain.MapDataset, source, *, seed: int, count: int):
    super().__init__(parent)
    self._source, self._seed, self._count = source, int(seed), int(count)

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    k = int(index)
    i = int(self._parent[k])
    offset = offset_of(self._seed, k // self._count, i, self._source.seq_len)
    return self._source.window(i, offset)

  def __str__(self) -> str:
    return f"OffsetWindows(count={self._count}, seed={self._seed})"


def offset_examples(source, data_cfg, *, seed: int) -> grain.MapDataset:
  """The endless training examples of a packed `source` with random window starts."""
  if not hasattr(source, "window"):
    raise ValueError(
        f"config.data.window_offset={window_offset(data_cfg)!r} needs a packed source "
        f"(text, jsonl, shards); data.source={str(data_cfg.source)!r} yields whole generated "
        "examples, not windows of a stream: set data.window_offset='none'")
  count = len(source) - 1
  if count < 1:
    raise ValueError(
        f"config.data.window_offset='random': the train split has {len(source)} window(s) of "
        f"data.seq_len={source.seq_len}; random starts need at least 2 (the last one would "
        "read held-out tokens); add data or lower data.seq_len")
  indices = grain.MapDataset.range(count)
  if data_cfg.shuffle:
    indices = indices.shuffle(seed=seed)
  return OffsetWindows(indices.repeat(), source, seed=seed, count=count)


class WindowSource:
  """What the windowed sources share (text.PackedSequences, shards.ShardWindows): `count`
  windows of `seq_len` tokens from stream window `first`; their length, indexing (item i is
  window i at offset 0) and where window i moved `offset` tokens later starts in the stream.
  A subclass sets `first`, `count` and `seq_len` and defines `window(index, offset)`."""

  ITEM = "window"   # how an index error names an item

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.count:
      raise IndexError(f"{self.ITEM} index {index} out of range [0, {self.count})")
    return self.window(index, 0)

  def start(self, index: int, offset: int) -> int:
    """The stream position where window `index` moved `offset` tokens later starts (the
    window checked to lie in its split, `check_window`)."""
    check_window(index, offset, count=self.count, seq_len=self.seq_len)
    return (self.first + index) * self.seq_len + offset


def check_window(index: int, offset: int, *, count: int, seq_len: int) -> None:
  """Window `index` moved by `offset` must lie in its split: [0, count * L + 1) relative."""
  if not 0 <= offset < seq_len:
    raise IndexError(f"window offset {offset} out of range [0, {seq_len})")
  if not 0 <= index < count or (offset and index >= count - 1):
    raise IndexError(f"window {index} at offset {offset} leaves the split of {count} windows")
