"""Pre-tokenised corpora: token shards on disk, read as fixed-length windows without loading.

Preparing (`prepare`, CLI `experiments/prepare_data.py`) tokenises every input file once, in
parallel worker processes (one input file = one task = one output shard), into

    <out>/shard_00000.bin ...   raw little-endian token ids, uint16 if the vocabulary fits
                                (<= 65536 ids), else uint32; every document followed by EOS
    <out>/shard_00000.docs.npy  int64 end offset of every document in the shard (written by
                                default; --nodoc_boundaries leaves it out)
    <out>/index.json            written last: shards (file, source, tokens, docs, bytes, sha256),
                                total tokens, dtype, tokenizer (spec, vocab_size, eos_id, id),
                                counted skips (file:line and why)

Inputs: files or folders (searched recursively) of `.jsonl`, `.jsonl.zst` (needs `zstandard`),
`.parquet` (needs `pyarrow`) and `.txt` (one document per non-blank line, or per file); or a
stream of records (`prepare_records`), e.g. a Hugging Face dataset streamed by `hf_records`
(needs `datasets`, the `hf` extra), cut into shards of `docs_per_shard` documents. Bad data
(an undecodable line, invalid JSON, a missing/non-string text field, an empty file, a corrupt
compressed file) is an error naming file and line, or with `on_error="skip"` a counted skip
(the first few listed in the index and the summary).

Document masking (`data.document_mask`): windows also carry `segment_ids` and `positions`
(documents.py: the EOS ending a document is the BOS of the next), from each shard's
`.docs.npy` (memory-mapped too, checked against the index: its count and last end), which is
exact even where the EOS id also occurs inside a document. A shard without one (prepared with
--nodoc_boundaries, or before boundaries were the default) falls back to the EOS tokens of the
window, with a warning naming the folder.

Reading (`data.source = "shards"`, `data.paths` = the output folder). The shards concatenated in
index order form one stream t[0:T]; window i is t[i*L : i*L + L + 1] (L = `data.seq_len`;
inputs = window[:-1], targets = window[1:], weights 1), exactly the packing of `text.py`, and the
last ceil(n * `data.eval_fraction`) windows are the eval split (training windows may start at
a random token instead, `data.window_offset`, offsets.py). Shards are `np.memmap`s opened
lazily (in each grain worker; pickling keeps only the paths), so building the source costs
O(number of shards) whatever the corpus size, and a window touches only its L + 1 tokens (it may
span two or more shards). Order, per-host rows and resumption come from `pipeline.py` (grain's
lazy index shuffle over window indices). Opening checks every shard's size against the index
(a truncated or missing shard is an error naming it) and its sha256 against the index (a
flipped byte is an error naming the shard, not a silent change of the data).

When shards are hashed (`verify_checksums`): hashing costs one read of the corpus, so what a
start hashes is bounded by `data.verify_mb` (default 2048 MB, about a second or two of reading):
  * a shard never verified, or whose size or mtime changed since, is hashed at every start;
  * the others are hashed again at every start too, least recently verified first, until
    `data.verify_mb` is used up: a corpus under that size is fully re-hashed at each start
    (bit rot, or a bad copy made with `cp -p` / `rsync -a` that kept the mtime, is caught
    there), a larger one a rotating sample of its shards per start, so every shard is hashed
    again within corpus size / verify_mb starts (-1: all every start; 0: only new or changed);
  * within one process a shard is hashed once (the train and eval splits share it).
What was verified, and when, is remembered in `$ATTN_JAX_CACHE/verified_shards.json` (default
`~/.cache/attn_jax`). `verify_shards` re-hashes all of them regardless.

Token ids are checked as windows are read (`TokenShards.read`, a max per shard slice): an id
outside the index's vocabulary (a flipped bit in a shard that was not re-hashed yet) is a
DataError naming the shard, the token offset and the id, never NaN losses.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import io
import json
import logging
import multiprocessing
import os
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from attn_jax import jsonio, paths
from attn_jax.data import documents as doc_lib
from attn_jax.data.formats import FORMATS, INDEX, input_format
from attn_jax.data.offsets import check_window
from attn_jax.data.text import split_counts
from attn_jax.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

ON_ERROR = ("raise", "skip")
MAX_LISTED_SKIPS = 20
_ENCODE_BATCH = 512


class DataError(ValueError):
  """Bad input data; the message starts with "file:line:" (or "file:")."""


# ------------------------------------------------------------------ inputs


def list_inputs(paths: str | Sequence[str]) -> list[str]:
  """Input files from files, folders (recursive, known formats only) and globs, sorted per
  entry (so the output order is deterministic)."""
  if isinstance(paths, str):
    paths = [p for p in paths.split(",") if p.strip()]
  out: list[str] = []
  for entry in paths:
    entry = os.path.expanduser(entry.strip())
    if os.path.isdir(entry):
      found = sorted(os.path.join(r, n) for r, _, ns in os.walk(entry) for n in ns
                     if input_format(n))
      if not found:
        raise FileNotFoundError(f"no {'/'.join(FORMATS)} files under {entry!r}")
      out.extend(found)
    elif os.path.isfile(entry):
      if input_format(entry) is None:
        raise ValueError(f"{entry}: unknown format (expected one of {FORMATS})")
      out.append(entry)
    else:
      found = sorted(glob.glob(entry, recursive=True))
      if not found:
        raise FileNotFoundError(f"input not found: {entry!r}")
      out.extend(f for f in found if input_format(f))
  return out


@dataclasses.dataclass
class Skips:
  """Counted bad records of one file (`on_error="skip"`)."""
  count: int = 0
  listed: list = dataclasses.field(default_factory=list)

  def add(self, where: str, why: str) -> None:
    self.count += 1
    if len(self.listed) < MAX_LISTED_SKIPS:
      self.listed.append(f"{where}: {why}")


def _bad(where: str, why: str, on_error: str, skips: Skips) -> None:
  if on_error == "raise":
    raise DataError(f"{where}: {why} (prepare_data --on_error=skip counts and skips such records)")
  skips.add(where, why)


def _byte_lines(path: str) -> Iterator[bytes]:
  if path.endswith(".zst"):
    try:
      import zstandard
    except ImportError:
      raise ImportError(f"{path}: reading .zst needs the `zstandard` package "
                        "(pip install zstandard)") from None
    with open(path, "rb") as raw:
      reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
      try:
        yield from reader
      except zstandard.ZstdError as e:
        raise DataError(f"{path}: corrupt zstd stream: {e}") from None
  else:
    with open(path, "rb") as f:
      yield from f


def _jsonl_documents(path, text_field, on_error, skips) -> Iterator[str]:
  for number, raw in enumerate(_byte_lines(path), start=1):
    where = f"{path}:{number}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      _bad(where, f"not valid UTF-8 ({e.reason} at byte {e.start})", on_error, skips)
      continue
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError as e:
      _bad(where, f"invalid JSON ({e})", on_error, skips)
      continue
    doc = record_document(record, where, text_field, on_error, skips)
    if doc:
      yield doc


def record_document(record, where: str, text_field: str, on_error: str,
                    skips: Skips) -> str | None:
  """The text of one record (a JSONL line's object, a Hugging Face row); None if skipped."""
  if not isinstance(record, Mapping) or text_field not in record:
    _bad(where, f"no field {text_field!r} (data.text_field)", on_error, skips)
    return None
  doc = record[text_field]
  if not isinstance(doc, str):
    _bad(where, f"field {text_field!r} is a {type(doc).__name__}, not a string", on_error,
         skips)
    return None
  return doc


def _text_documents(path, text_document, on_error, skips) -> Iterator[str]:
  if text_document == "file":
    with open(path, "rb") as f:
      raw = f.read()
    try:
      yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
      line = raw[: e.start].count(b"\n") + 1
      _bad(f"{path}:{line}", f"not valid UTF-8 ({e.reason})", on_error, skips)
    return
  for number, raw in enumerate(_byte_lines(path), start=1):
    try:
      line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
      _bad(f"{path}:{number}", f"not valid UTF-8 ({e.reason} at byte {e.start})", on_error,
           skips)
      continue
    if line.strip():
      yield line


def _parquet_documents(path, text_field, on_error, skips) -> Iterator[str]:
  try:
    import pyarrow.parquet as pq
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
        _bad(f"{path}:row {row}", f"column {text_field!r} holds {type(doc).__name__}",
             on_error, skips)
        continue
      if doc:
        yield doc


def read_documents(path: str, *, text_field: str = "text", text_document: str = "line",
                   on_error: str = "raise", skips: Skips | None = None) -> Iterator[str]:
  """The documents of one input file (format from its name)."""
  skips = Skips() if skips is None else skips
  fmt = input_format(path)
  if fmt in (".jsonl", ".jsonl.zst"):
    return _jsonl_documents(path, text_field, on_error, skips)
  if fmt == ".parquet":
    return _parquet_documents(path, text_field, on_error, skips)
  if fmt == ".txt":
    return _text_documents(path, text_document, on_error, skips)
  raise ValueError(f"{path}: unknown format (expected one of {FORMATS})")


# ------------------------------------------------------------------ tokenising


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_id(spec: str) -> str:
  """"bytes", or "sha256:<hex>" of the tokenizer file: what the index and training compare."""
  if spec in ("bytes", "byte", ""):
    return "bytes"
  with open(spec, "rb") as f:
    return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def _encode(tokenizer: Tokenizer, docs: list[str]) -> list[np.ndarray]:
  if isinstance(tokenizer, ByteTokenizer):
    return [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]
  batch = getattr(tokenizer, "encode_batch", None)
  ids = batch(docs) if batch is not None else [tokenizer.encode(d) for d in docs]
  return [np.asarray(i, np.int64) for i in ids]


def _write_shard(docs: Iterable[str], out_path: str, tokenizer: Tokenizer, dtype: np.dtype,
                 doc_boundaries: bool) -> dict | None:
  """Tokenises `docs` (each followed by EOS) into `out_path` (a temporary name, renamed at the
  end); {"tokens", "docs", "sha256"}, or None (nothing written) when there was no document."""
  sha = hashlib.sha256()
  tokens = count = 0
  ends: list[int] = []
  tmp = out_path + ".tmp"
  eos = np.asarray([tokenizer.eos_id], dtype)

  with open(tmp, "wb") as f:
    def flush(batch: list[str]):
      nonlocal tokens, count
      pieces = []
      for ids in _encode(tokenizer, batch):
        pieces.extend((ids.astype(dtype, copy=False), eos))
        tokens += len(ids) + 1
        ends.append(tokens)
      data = np.concatenate(pieces).astype("<" + dtype.str[1:], copy=False).tobytes()
      f.write(data)
      sha.update(data)
      count += len(batch)

    batch: list[str] = []
    for doc in docs:
      batch.append(doc)
      if len(batch) == _ENCODE_BATCH:
        flush(batch)
        batch = []
    if batch:
      flush(batch)
  if tokens == 0:
    os.remove(tmp)
    return None
  os.replace(tmp, out_path)
  if doc_boundaries:
    np.save(out_path[: -len(".bin")] + ".docs.npy", np.asarray(ends, np.int64))
  return {"tokens": tokens, "docs": count, "sha256": sha.hexdigest()}


def _tokenize_file(task: dict) -> dict:
  """Worker: one input file -> one shard."""
  if task["workers"] > 1:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes, not threads
  path, out_path = task["input"], task["output"]
  skips = Skips()
  if os.path.getsize(path) == 0:
    _bad(path, "empty file", task["on_error"], skips)
    return {"input": path, "skipped_file": True, "skips": dataclasses.asdict(skips)}
  docs = read_documents(path, text_field=task["text_field"], text_document=task["text_document"],
                        on_error=task["on_error"], skips=skips)
  written = _write_shard(docs, out_path, get_tokenizer(task["tokenizer"]),
                         np.dtype(task["dtype"]), task["doc_boundaries"])
  if written is None:
    _bad(path, "no documents (every line blank or skipped)", task["on_error"], skips)
    return {"input": path, "skipped_file": True, "skips": dataclasses.asdict(skips)}
  return dict(written, input=path, skipped_file=False, file=os.path.basename(out_path),
              bytes=os.path.getsize(path), skips=dataclasses.asdict(skips))


def _start_output(output: str, overwrite: bool) -> None:
  if os.path.exists(os.path.join(output, INDEX)) and not overwrite:
    raise FileExistsError(f"{output} already holds a prepared corpus ({INDEX}); pass "
                          "--overwrite to replace it")
  os.makedirs(output, exist_ok=True)
  if os.path.exists(os.path.join(output, INDEX)):
    os.remove(os.path.join(output, INDEX))   # the index goes last: no stale index meanwhile


def _finish_output(output: str, results: list[dict], *, tokenizer: str, tok: Tokenizer,
                   dtype: np.dtype, text_field: str, doc_boundaries: bool, seconds: float,
                   what: str, extra_skips: Skips | None = None) -> dict:
  """Writes index.json (last, atomically) from the per-shard `results`; returns it."""
  shards = [{k: r[k] for k in ("file", "tokens", "docs", "bytes", "sha256")} | {
      "source": r["input"]} for r in results if not r["skipped_file"]]
  if not shards:
    raise DataError(f"no usable documents in {what}")
  extra_skips = extra_skips or Skips()
  skipped = extra_skips.listed + [s for r in results for s in r["skips"]["listed"]]
  index = {
      "version": 1,
      "dtype": dtype.name,
      "tokenizer": {"spec": tokenizer, "id": tokenizer_id(tokenizer),
                    "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id)},
      "text_field": text_field,
      "doc_boundaries": bool(doc_boundaries),
      "total_tokens": sum(s["tokens"] for s in shards),
      "total_docs": sum(s["docs"] for s in shards),
      "shards": shards,
      "skipped_records": extra_skips.count + sum(r["skips"]["count"] for r in results),
      "skipped_files": [r["input"] for r in results if r["skipped_file"]],
      "skipped_examples": skipped[:MAX_LISTED_SKIPS],
  }
  jsonio.write(index, os.path.join(output, INDEX))
  return dict(index, seconds=seconds, tokens_per_sec=index["total_tokens"] / max(seconds, 1e-9))


def prepare(inputs: str | Sequence[str], output: str, *, tokenizer: str = "bytes",
            text_field: str = "text", text_document: str = "line", workers: int = 0,
            on_error: str = "raise", doc_boundaries: bool = True, overwrite: bool = False,
            progress: bool = True) -> dict:
  """Tokenises `inputs` into token shards + index.json under `output`; returns the index
  (plus "seconds" and "tokens_per_sec")."""
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
  files = list_inputs(inputs)
  if not files:
    raise FileNotFoundError(f"no input files in {inputs!r}")
  _start_output(output, overwrite)
  tok = get_tokenizer(tokenizer)
  dtype = token_dtype(tok.vocab_size)
  workers = workers or min(len(files), os.cpu_count() or 1)
  tasks = [dict(input=f, output=os.path.join(output, f"shard_{i:05d}.bin"), tokenizer=tokenizer,
                dtype=dtype.name, text_field=text_field, text_document=text_document,
                on_error=on_error, doc_boundaries=doc_boundaries, workers=workers)
           for i, f in enumerate(files)]
  t0 = time.perf_counter()
  results = [None] * len(tasks)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True,
               desc="tokenising", dynamic_ncols=True)
  total = 0

  def done(i, r):
    nonlocal total
    results[i] = r
    total += r.get("tokens", 0)
    if bar is not None:
      bar.update(os.path.getsize(r["input"]))
      bar.set_postfix(tokens=f"{total:,}")

  if workers <= 1:
    for i, t in enumerate(tasks):
      done(i, _tokenize_file(t))
  else:
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
      for i, r in pool.imap_unordered(_indexed, list(enumerate(tasks))):
        done(i, r)
  if bar is not None:
    bar.close()
  return _finish_output(output, results, tokenizer=tokenizer, tok=tok, dtype=dtype,
                        text_field=text_field, doc_boundaries=doc_boundaries,
                        seconds=time.perf_counter() - t0,
                        what=f"{len(files)} input file(s): {files[:5]}")


def _indexed(item):
  i, task = item
  return i, _tokenize_file(task)


# ------------------------------------------------------------------ record streams (Hugging Face)

HF_EXTRA = 'pip install "attn_jax[hf]"  (the `datasets` package)'


def hf_records(name: str, *, split: str = "train", config: str | None = None,
               data_files: str | Sequence[str] | None = None) -> Iterable[Mapping[str, Any]]:
  """The rows of a Hugging Face dataset, streamed (nothing downloaded in full):
  `datasets.load_dataset(name, config, split=split, streaming=True)`."""
  try:
    import datasets
  except ImportError:
    raise ImportError(f"--hf_dataset needs the Hugging Face `datasets` library: {HF_EXTRA}"
                      ) from None
  kwargs = {"data_files": data_files} if data_files else {}
  return datasets.load_dataset(name, config or None, split=split, streaming=True, **kwargs)


def prepare_hf(name: str, output: str, *, split: str = "train", config: str | None = None,
               data_files: str | Sequence[str] | None = None, load=None, **kwargs) -> dict:
  """`prepare_records` over the streamed Hugging Face dataset `name` (`load(name, split=,
  config=, data_files=)` gives the records; default `hf_records`, tests inject their own)."""
  load = load or hf_records
  records = load(name, split=split, config=config, data_files=data_files)
  source = f"hf:{name}" + (f"/{config}" if config else "") + f"[{split}]"
  return prepare_records(records, output, source=source, **kwargs)


def _chunks(records: Iterable[Mapping[str, Any]], source: str, text_field: str, on_error: str,
            skips: Skips, docs_per_shard: int) -> Iterator[dict]:
  """Consecutive runs of `docs_per_shard` documents of `records` (the last may be shorter)."""
  docs: list[str] = []
  first = 1
  number = 0
  for number, record in enumerate(records, start=1):
    doc = record_document(record, f"{source}:record {number}", text_field, on_error, skips)
    if doc:
      docs.append(doc)
    if len(docs) == docs_per_shard:
      yield {"docs": docs, "input": f"{source} records {first}-{number}"}
      docs, first = [], number + 1
  if docs:
    yield {"docs": docs, "input": f"{source} records {first}-{number}"}


def _tokenize_chunk(task: dict) -> dict:
  """Worker: a list of documents -> one shard."""
  if task["workers"] > 1:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  written = _write_shard(task["docs"], task["output"], get_tokenizer(task["tokenizer"]),
                         np.dtype(task["dtype"]), task["doc_boundaries"])
  return dict(written, input=task["input"], skipped_file=False,
              file=os.path.basename(task["output"]),
              bytes=sum(len(d.encode("utf-8")) for d in task["docs"]),
              skips=dataclasses.asdict(Skips()))


def prepare_records(records: Iterable[Mapping[str, Any]], output: str, *, source: str,
                    tokenizer: str = "bytes", text_field: str = "text",
                    docs_per_shard: int = 20_000, workers: int = 0, on_error: str = "raise",
                    doc_boundaries: bool = True, overwrite: bool = False,
                    progress: bool = True) -> dict:
  """Tokenises a stream of records (dicts with `text_field`, e.g. `hf_records(...)`) into the
  shards + index.json that `prepare` writes for files: every `docs_per_shard` documents become
  one shard, tokenised by `workers` processes while the stream is read (at most 2 * workers
  chunks in memory). The same records as one JSONL file (and docs_per_shard >= their count)
  give byte-identical shards. Bad records are reported as "<source>:record <n>"."""
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
  if int(docs_per_shard) < 1:
    raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
  _start_output(output, overwrite)
  tok = get_tokenizer(tokenizer)
  dtype = token_dtype(tok.vocab_size)
  workers = workers or (os.cpu_count() or 1)
  skips = Skips()
  results: list[dict] = []
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(unit="doc", desc=f"tokenising {source}", dynamic_ncols=True)

  def done(r):
    results.append(r)
    if bar is not None:
      bar.update(r["docs"])
      bar.set_postfix(tokens=f"{sum(x['tokens'] for x in results):,}")

  t0 = time.perf_counter()
  chunks = _chunks(records, source, text_field, on_error, skips, int(docs_per_shard))
  tasks = (dict(chunk, output=os.path.join(output, f"shard_{i:05d}.bin"), tokenizer=tokenizer,
                dtype=dtype.name, doc_boundaries=doc_boundaries, workers=workers)
           for i, chunk in enumerate(chunks))
  if workers <= 1:
    for t in tasks:
      done(_tokenize_chunk(t))
  else:
    import collections
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
      pending: collections.deque = collections.deque()
      for t in tasks:   # bounded read-ahead: Pool.imap would pull the whole stream into memory
        pending.append(pool.apply_async(_tokenize_chunk, (t,)))
        while len(pending) >= 2 * workers:
          done(pending.popleft().get())
      while pending:
        done(pending.popleft().get())
  if bar is not None:
    bar.close()
  return _finish_output(output, results, tokenizer=tokenizer, tok=tok, dtype=dtype,
                        text_field=text_field, doc_boundaries=doc_boundaries,
                        seconds=time.perf_counter() - t0, what=source, extra_skips=skips)


# ------------------------------------------------------------------ reading


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


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with paths.run_path(path).open("rb") as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
  return h.hexdigest()


def _verified_cache_path() -> str:
  root = os.environ.get("ATTN_JAX_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attn_jax")
  return os.path.join(root, "verified_shards.json")


def _load_verified() -> dict:
  try:
    with open(_verified_cache_path()) as f:
      return dict(json.load(f))
  except (OSError, ValueError, TypeError):
    return {}


def _save_verified(entries: dict) -> None:
  """Best effort (a read-only home only costs re-hashing next time)."""
  path = _verified_cache_path()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    jsonio.write(entries, path, indent=None)
  except OSError:
    pass


def _fingerprint(path: str) -> str:
  if paths.is_uri(path):   # an object: its size and generation (a new one at every write)
    info = paths.info(path)
    version = info.get("generation") or info.get("etag") or info.get("mtime") or ""
    return f"{info.get('size')}:{version}"
  st = os.stat(path)
  return f"{st.st_size}:{st.st_mtime_ns}"


def _size(path: str) -> int:
  return int(paths.run_path(path).stat().length)


class _ObjectTokens:
  """A shard on object storage read like its memmap: `len()` and slices, each slice one ranged
  read of the object (no copy of the shard on the local disk)."""

  def __init__(self, path: str, dtype: np.dtype):
    self.path, self.dtype = path, dtype
    self._n = _size(path) // dtype.itemsize
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


VERIFY_MB = 2048
_VERIFIED_HERE: dict[str, tuple[str, str]] = {}   # path -> (fingerprint, sha256) hashed here


def _to_hash(files, metas, known: dict, budget: float) -> list[tuple[str, dict]]:
  """The shards to hash this start (see the module docstring): every new or changed one, then
  the others least recently verified first while the budget (bytes; < 0: no limit) lasts; at
  least one of them when the budget is positive, so a shard larger than it still gets its
  turn."""
  must, rest = [], []
  for path, meta in zip(files, metas):
    seen = (_fingerprint(path), meta["sha256"])
    if _VERIFIED_HERE.get(path) == seen:
      continue
    entry = known.get(path) or []
    if tuple(entry[:2]) != seen:
      must.append((path, meta))
    else:
      rest.append((entry[2] if len(entry) > 2 else 0.0, path, meta))
  rest.sort(key=lambda r: r[0])
  chosen = []
  for _, path, meta in rest:
    size = _size(path)
    if budget >= 0 and size > budget and (chosen or budget == 0):
      break
    chosen.append((path, meta))
    budget = max(budget - size, 0.0) if budget >= 0 else budget
  return must + chosen


def verify_checksums(files: Sequence[str], metas: Sequence[dict], *,
                     verify_mb: float = VERIFY_MB) -> None:
  """DataError naming the first shard whose sha256 differs from the index; which shards are
  hashed at this start follows `verify_mb` (see the module docstring)."""
  pairs = [(p, m) for p, m in zip(files, metas) if m.get("sha256")]
  known = _load_verified()
  todo = _to_hash([p for p, _ in pairs], [m for _, m in pairs], known,
                  float(verify_mb) * 2**20 if verify_mb >= 0 else -1.0)
  if not todo:
    return
  total = sum(_size(p) for p, _ in todo)
  if total > 256 * 2**20:
    logging.info("verifying the sha256 of %d token shards (%.0f MB; data.verify_mb=%s; "
                 "remembered in %s)", len(todo), total / 2**20, verify_mb, _verified_cache_path())
  for path, meta in todo:
    if _sha256_file(path) != meta["sha256"]:
      raise DataError(f"corrupt token shard {path}: its sha256 differs from {INDEX} (changed "
                      "or flipped bytes); prepare the corpus again (experiments/prepare_data.py)")
    known[path] = [_fingerprint(path), meta["sha256"], time.time()]
    _VERIFIED_HERE[path] = (_fingerprint(path), meta["sha256"])
  _save_verified(known)


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
      size = _size(path)
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


class ShardWindows:
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

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.count:
      raise IndexError(f"window index {index} out of range [0, {self.count})")
    return self.window(index, 0)

  def window(self, index: int, offset: int) -> dict[str, np.ndarray]:
    """Window `index` moved `offset` tokens later (`data.window_offset`, offsets.py)."""
    check_window(index, offset, count=self.count, seq_len=self.seq_len)
    start = (self.first + index) * self.seq_len + offset
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
    return ShardWindows(shards, first=0, count=num_train, **kw)
  if split == "eval":
    if num_eval == 0:
      raise ValueError("no eval split: data.eval_fraction is 0")
    return ShardWindows(shards, first=num_train, count=num_eval, **kw)
  raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def shards_vocab_size(data_cfg) -> int:
  return int(read_index(str(data_cfg.paths).strip())["tokenizer"]["vocab_size"])


def verify_shards(directory: str) -> list[str]:
  """Problems found by re-hashing every shard against the index ([] = all good)."""
  shards = TokenShards(directory, verify=False)
  problems = []
  for path, meta in zip(shards.files, shards.index["shards"]):
    if _sha256_file(path) != meta["sha256"]:
      problems.append(f"{path}: sha256 differs from the index (corrupted)")
  return problems


