"""The data files attn_jax reads by name: the input formats `experiments/prepare_data.py` turns
into token shards (and a folder in `data.paths` is searched for), and the shard folder's index.

Shared by the document reader (`data/doc_reader.py`), the shard writer (`data/shard_prep.py`)
and reader (`data/shards.py`) and the text readers (`data/text.py`): the document reader must
not import the others, and text.py not the shard modules.
"""

from __future__ import annotations

INDEX = "index.json"                                   # a prepared shard folder's index
FORMATS = (".jsonl.zst", ".jsonl", ".parquet", ".txt")  # inputs, longest suffix first


def input_format(path: str) -> str | None:
  """The input format (`FORMATS` entry) a file name has, or None."""
  for ext in FORMATS:
    if path.endswith(ext):
      return ext
  return None
