"""The grain input pipeline: source -> shuffle -> repeat -> per-host shard -> batch -> prefetch.

Every batch is a dict of numpy arrays, B_host = `data.global_batch_size // process_count`:
    inputs  int32   [B_host, L]
    targets int32   [B_host, L]   (next token of inputs)
    weights float32 [B_host, L]   (loss/accuracy weight per position)
  and with `data.document_mask` (packed rows, documents.py; `documents.batch_keys`):
    segment_ids int32 [B_host, L] (each input token's document, from 1 in its row)
    positions   int32 [B_host, L] (its position in that document, from 0)

Order of the global example stream (one epoch = one pass over the source):
  * text/jsonl/shards: the packed training sequences (shards: windows of pre-tokenised
    token shards on disk, see shards.py), shuffled with `seed` when `data.shuffle`, and
    reshuffled differently every epoch (grain folds the epoch into the seed); repeats forever.
    With `data.window_offset="random"` each window starts at a random token instead of a
    multiple of L, drawn anew every epoch (offsets.py); the order and sharding are the same.
  * synthetic: example i of an effectively infinite random stream keyed by (seed, i); it is
    already i.i.d., so it is not shuffled (`data.shuffle` is ignored).
Global batch k is examples k*B .. k*B + B - 1 of that stream (B = `data.global_batch_size`).
A host reads only its rows [start, stop) of every global batch: `host_rows`, which the trainer
derives from the batch sharding (`sharding.host_batch_rows`: the rows its devices hold), or by
default block h of P equal blocks for `process_index` h. Its k-th batch therefore holds global
examples k*B + start .. k*B + stop - 1, so hosts see disjoint examples and the hosts' batches,
placed at their rows, are exactly the 1-host global batch of that step (what
`jax.make_array_from_process_local_data` assembles).

Checkpointing. `make_train_iterator` returns a `grain.DatasetIterator`; its whole position is
`it.get_state()` (a small JSON-able dict, e.g. {"next_index": 123}). With orbax (as the
trainer should do, in the same checkpoint as the train state):

    import orbax.checkpoint as ocp
    manager = ocp.CheckpointManager(workdir / "checkpoints")
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data_iter=iterator_save_args(train_iter)))        # grain.checkpoint.CheckpointSave
    ...
    train_iter = make_train_iterator(config.data, seed=config.seed, ...)   # fresh, same config
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_train_state),
        data_iter=iterator_restore_args(train_iter)))     # grain.checkpoint.CheckpointRestore
    train_iter = restored.data_iter                       # the same object, state restored

grain writes one `process_<i>-of-<n>.json` per host (i, n from jax.process_index/count). The
state is only valid for the same data config, seed and process count. Without orbax:
`state = iterator_state(it)` ... `restore_iterator(fresh_it, state)`.
"""

from __future__ import annotations

from typing import Any

from absl import flags
import grain
import numpy as np

from attn_jax.data import offsets, shards, synthetic, text
from attn_jax.data.tokenizer import get_tokenizer

Batch = dict[str, np.ndarray]

DATA_SOURCES = ("synthetic",) + text.TEXT_SOURCES + ("shards",)


def _check_seed(seed: int) -> int:
  seed = int(seed)
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32) for the data pipeline, got {seed}")
  return seed


def host_batch_size(global_batch_size: int, process_count: int) -> int:
  """`global_batch_size // process_count`, or ValueError naming `data.global_batch_size`."""
  global_batch_size = int(global_batch_size)
  if global_batch_size < 1:
    raise ValueError(f"data.global_batch_size must be >= 1, got {global_batch_size}")
  if global_batch_size % process_count:
    raise ValueError(
        f"data.global_batch_size={global_batch_size} is not divisible by the process count "
        f"{process_count}")
  return global_batch_size // process_count


def _check_process(process_index: int, process_count: int) -> None:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
        f"need 0 <= process_index < process_count, got process_index={process_index}, "
        f"process_count={process_count}")


def make_source(data_cfg, *, seed: int, split: str = "train"):
  """The random-access example source (grain RandomAccessDataSource) for `data.source`."""
  source = str(data_cfg.source)
  if source == "synthetic":
    return synthetic.SyntheticSource(data_cfg, seed=_check_seed(seed), split=split)
  if source in text.TEXT_SOURCES:
    return text.make_text_source(data_cfg, split=split)
  if source == "shards":
    return shards.make_shard_source(data_cfg, split=split)
  raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {source!r}")


def vocab_size_needed(data_cfg) -> int:
  """The smallest `model.vocab_size` that holds every token id the data can produce."""
  source = str(data_cfg.source)
  if source == "synthetic":
    task = str(data_cfg.synthetic_task)
    if task == "mqar":
      return synthetic.mqar_vocab_size(data_cfg)
    if task == "random":
      return int(data_cfg.random_vocab)
    raise ValueError(
        f"data.synthetic_task must be one of {synthetic.SYNTHETIC_TASKS}, got {task!r}")
  if source in text.TEXT_SOURCES:
    return int(get_tokenizer(str(data_cfg.tokenizer)).vocab_size)
  if source == "shards":
    return shards.shards_vocab_size(data_cfg)
  raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {source!r}")


def resolve_host_rows(global_batch_size: int, *, process_index: int = 0, process_count: int = 1,
                      host_rows: slice | None = None) -> slice:
  """This host's rows [start, stop) of each global batch (see the module docstring)."""
  global_batch_size = int(global_batch_size)
  if host_rows is None:
    _check_process(process_index, process_count)
    b = host_batch_size(global_batch_size, process_count)
    return slice(process_index * b, (process_index + 1) * b)
  start, stop, step = host_rows.indices(global_batch_size)
  if step != 1 or stop <= start or host_rows.start is None or host_rows.stop is None or (
      host_rows.stop > global_batch_size):
    raise ValueError(f"host_rows={host_rows} must be a non-empty slice inside the global batch "
                     f"[0, data.global_batch_size={global_batch_size})")
  return slice(start, stop)


class HostRows(grain.MapDataset):
  """Examples [k*B + start, k*B + stop) of `parent`, for k = 0, 1, ...: one host's rows of
  every global batch of B consecutive examples (reads nothing else)."""

  def __init__(self, parent: grain.MapDataset, global_batch_size: int, rows: slice):
    super().__init__(parent)
    self._global = int(global_batch_size)
    self._start, self._width = rows.start, rows.stop - rows.start

  def __len__(self) -> int:
    return (len(self._parent) // self._global) * self._width

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    k, j = divmod(int(index), self._width)
    return self._parent[k * self._global + self._start + j]

  def __str__(self) -> str:
    return f"HostRows(global_batch={self._global}, start={self._start}, width={self._width})"


def make_train_dataset(
    data_cfg, *, seed: int, process_index: int = 0, process_count: int = 1,
    host_rows: slice | None = None
) -> grain.MapDataset:
  """This host's infinite MapDataset of batches (see the module docstring for the order)."""
  rows = resolve_host_rows(data_cfg.global_batch_size, process_index=process_index,
                           process_count=process_count, host_rows=host_rows)
  seed = _check_seed(seed)
  source = make_source(data_cfg, seed=seed, split="train")
  examples = grain.MapDataset.source(source)
  if offsets.window_offset(data_cfg) == "random":
    examples = offsets.offset_examples(source, data_cfg, seed=seed)  # shuffled, repeated
  elif str(data_cfg.source) != "synthetic":
    if data_cfg.shuffle:
      examples = examples.shuffle(seed=seed)
    examples = examples.repeat()  # forever; shuffle is before repeat, so reshuffled per epoch
  host_examples = HostRows(examples, data_cfg.global_batch_size, rows)
  return host_examples.batch(rows.stop - rows.start, drop_remainder=True)


def make_train_iterator(
    data_cfg, *, seed: int, process_index: int = 0, process_count: int = 1,
    host_rows: slice | None = None
) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of this host's training batches (dicts, see top).

  Reads ahead with `data.read_threads` threads and `data.prefetch_batches` buffered batches;
  with `data.num_workers > 0` batches are built in that many worker processes (grain starts
  them fresh, so a script using them needs an `if __name__ == "__main__":` guard; call
  `it.close()` when done).
  """
  batches = make_train_dataset(
      data_cfg, seed=seed, process_index=process_index, process_count=process_count,
      host_rows=host_rows)
  read_threads = int(data_cfg.read_threads)
  prefetch_batches = max(int(data_cfg.prefetch_batches), read_threads)
  batches = batches.to_iter_dataset(
      grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch_batches))
  num_workers = int(data_cfg.num_workers)
  if num_workers > 0:
    # grain's worker processes read absl flags; outside an absl app (notebooks, pytest) they
    # are unparsed and grain would fail, so fall back to the flags' defaults there.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return iter(batches)


def make_eval_batches(
    data_cfg, *, seed: int, num_batches: int, batch_size: int | None = None,
    process_index: int = 0, process_count: int = 1, host_rows: slice | None = None
) -> list[Batch]:
  """Held-out batches, the same on every call (dicts as in training).

  synthetic: the "eval" random stream keyed by `seed` (disjoint from training).
  text/jsonl: the held-out last `data.eval_fraction` of the packed sequences, in order
  (`seed` unused); when they fill fewer than `num_batches` batches, only the full batches
  there are are returned (possibly fewer than asked).
  `batch_size` is global (default `data.global_batch_size`); each host gets its rows, like
  in training.
  """
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1, got {num_batches}")
  field = "data.global_batch_size" if batch_size is None else "the evaluation's batch size"
  if batch_size is None:
    batch_size = data_cfg.global_batch_size
  rows = resolve_host_rows(batch_size, process_index=process_index,
                           process_count=process_count, host_rows=host_rows)
  source = make_source(data_cfg, seed=seed, split="eval")
  batches = HostRows(grain.MapDataset.source(source), batch_size, rows).batch(
      rows.stop - rows.start, drop_remainder=True)
  available = len(batches)
  if available == 0:
    raise ValueError(
        f"the eval split has {len(source)} sequences, fewer than one batch of {batch_size} "
        f"({field}); raise data.eval_fraction or lower {field}")
  return [batches[i] for i in range(min(num_batches, available))]


def iterator_state(train_iter: grain.DatasetIterator) -> dict[str, Any]:
  """The iterator's position as a JSON-able dict (what grain's orbax handler writes)."""
  return train_iter.get_state()


def restore_iterator(train_iter: grain.DatasetIterator, state: dict[str, Any]) -> None:
  """Moves a fresh iterator (same config, seed, hosts) to a position from `iterator_state`."""
  train_iter.set_state(state)


def iterator_save_args(train_iter: grain.DatasetIterator):
  """Orbax save args for the iterator: an item of `ocp.args.Composite(...)`."""
  return grain.checkpoint.CheckpointSave(train_iter)


def iterator_restore_args(train_iter: grain.DatasetIterator):
  """Orbax restore args: restores into `train_iter` in place (and returns it)."""
  return grain.checkpoint.CheckpointRestore(train_iter)
