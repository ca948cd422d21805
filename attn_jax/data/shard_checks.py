"""Checks of a prepared token-shard folder against its index: every shard's sha256 (hashed within
a budget per start, remembered across starts) and the tokenizer's identity.

When shards are hashed (`verify_checksums`, called as `shards.TokenShards` opens a folder):
hashing costs one read of the corpus, so what a start hashes is bounded by `data.verify_mb`
(default 2048 MB, about a second or two of reading):
  * a shard never verified, or whose size or mtime changed since, is hashed at every start;
  * the others are hashed again at every start too, least recently verified first, until
    `data.verify_mb` is used up: a corpus under that size is fully re-hashed at each start
    (bit rot, or a bad copy made with `cp -p` / `rsync -a` that kept the mtime, is caught
    there), a larger one a rotating sample of its shards per start, so every shard is hashed
    again within corpus size / verify_mb starts (-1: all every start; 0: only new or changed);
  * within one process a shard is hashed once (the train and eval splits share it).
What was verified, and when, is remembered in `$ATTN_JAX_CACHE/verified_shards.json` (default
`~/.cache/attn_jax`). `rehash` (`shards.verify_shards`, prepare_data.py --verify) hashes every
shard regardless.

The tokenizer's identity (`tokenizer_id`: "bytes", or the sha256 of its file) is written into
the index at preparation and compared with `data.tokenizer` when training reads the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Sequence

from attn_jax import jsonio, paths
from attn_jax.data.doc_reader import DataError
from attn_jax.data.formats import INDEX

VERIFY_MB = 2048
_VERIFIED_HERE: dict[str, tuple[str, str]] = {}   # path -> (fingerprint, sha256) hashed here


def tokenizer_id(spec: str) -> str:
  """"bytes", or "sha256:<hex>" of the tokenizer file: what the index and training compare."""
  if spec in ("bytes", "byte", ""):
    return "bytes"
  with open(spec, "rb") as f:
    return "sha256:" + hashlib.sha256(f.read()).hexdigest()


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


def file_size(path: str) -> int:
  """Bytes of a local file or an object."""
  return int(paths.run_path(path).stat().length)


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
    size = file_size(path)
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
  total = sum(file_size(p) for p, _ in todo)
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


def rehash(files: Sequence[str], metas: Sequence[dict]) -> list[str]:
  """Problems found by hashing every shard against its index entry ([] = all good), whatever
  was verified before."""
  return [f"{path}: sha256 differs from the index (corrupted)"
          for path, meta in zip(files, metas) if _sha256_file(path) != meta["sha256"]]
