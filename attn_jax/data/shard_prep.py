"""Preparing pre-tokenised corpora: input files, or a stream of records, tokenised once into
the token shards that `shards.py` reads as fixed-length windows.

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
`.parquet` (needs `pyarrow`) and `.txt` (one document per non-blank line, or per file), read by
`doc_reader.read_documents` (the reader training from text/jsonl uses too); or a stream of
records (`prepare_records`), e.g. a Hugging Face dataset streamed by `hf_records` (needs
`datasets`, the `hf` extra), cut into shards of `docs_per_shard` documents. A bad record (an
undecodable line, invalid JSON, a missing/non-string text field; doc_reader.py) and a file
without any document (an empty file) are an error naming file and line, or with
`on_error="skip"` a counted skip (the first few listed in the index and the summary); a
corrupt compressed file is an error either way.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import multiprocessing
import os
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from attn_jax import jsonio
from attn_jax.data.doc_reader import (
    MAX_LISTED_SKIPS, ON_ERROR, PREPARE_WORDS, BadRecords, DataError, Skips, read_documents,
    record_document)
from attn_jax.data.formats import FORMATS, INDEX, input_format
from attn_jax.data.shard_checks import tokenizer_id
from attn_jax.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

_ENCODE_BATCH = 512


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



# ------------------------------------------------------------------ tokenising


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)



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
  bad = BadRecords(task["on_error"], skips, PREPARE_WORDS)
  if os.path.getsize(path) == 0:
    bad(path, "empty file")
    return {"input": path, "skipped_file": True, "skips": dataclasses.asdict(skips)}
  docs = read_documents(path, text_field=task["text_field"], text_document=task["text_document"],
                        bad=bad)
  written = _write_shard(docs, out_path, get_tokenizer(task["tokenizer"]),
                         np.dtype(task["dtype"]), task["doc_boundaries"])
  if written is None:
    bad(path, "no documents (every line blank or skipped)")
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


def _chunks(records: Iterable[Mapping[str, Any]], source: str, text_field: str,
            bad: BadRecords, docs_per_shard: int) -> Iterator[dict]:
  """Consecutive runs of `docs_per_shard` documents of `records` (the last may be shorter)."""
  docs: list[str] = []
  first = 1
  number = 0
  for number, record in enumerate(records, start=1):
    doc = record_document(record, f"{source}:record {number}", text_field, bad)
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
  chunks = _chunks(records, source, text_field, BadRecords(on_error, skips, PREPARE_WORDS),
                   int(docs_per_shard))
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

