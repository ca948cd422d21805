"""A GGUF file's metadata and tensor index, parsed straight from a memory map.

The layout (ggml's gguf.md; versions 2 and 3, little-endian):

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv x      string key, u32 value type, value
    n_tensors x string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml type,
                u64 offset (from the start of the data section)
    padding to `general.alignment` (default 32), then the tensor data

with strings as u64 length + UTF-8 bytes and arrays as u32 element type + u64 count +
elements. `gguf.GGUFReader` parses the same thing into one numpy view per value, which for a
50K-token vocabulary and its merges costs seconds; here numeric arrays are read with one
`np.frombuffer` and strings with `struct`, a fraction of that. Dequantisation stays
`gguf.quants.dequantize` (tests/test_pretrained.py checks both parsers agree).

Every tensor's data is a uint8 view [rows, bytes per row] of the map (the form
`dequantize` takes for every ggml type, F32 and F16 included). A file that ends before its
header or before any tensor's last byte raises `ValueError` naming what is missing.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
       10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
VERSIONS = (2, 3)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  tensor_type: Any          # gguf.GGMLQuantizationType
  shape: tuple[int, ...]    # ggml order: innermost (ne0) first
  data_offset: int          # absolute, in bytes
  n_bytes: int
  data: np.ndarray          # uint8 [rows, bytes per row]


class _Cursor:
  def __init__(self, buf):
    self.buf, self.off, self.size = buf, 0, len(buf)

  def need(self, n: int, what: str) -> None:
    if n < 0 or self.off + n > self.size:
      raise ValueError(f"truncated: the file ends inside the header ({what} at byte "
                       f"{self.off}, the file has {self.size})")

  def scalar(self, vtype: int, what: str):
    fmt = _SCALARS[vtype]
    n = struct.calcsize(fmt)
    self.need(n, what)
    (v,) = struct.unpack_from(fmt, self.buf, self.off)
    self.off += n
    return v

  def string(self, what: str) -> str:
    n = self.scalar(10, what)
    self.need(n, what)
    s = bytes(self.buf[self.off:self.off + n]).decode("utf-8")
    self.off += n
    return s

  def value(self, vtype: int, what: str):
    if vtype == STRING:
      return self.string(what)
    if vtype == ARRAY:
      etype, count = self.scalar(4, what), self.scalar(10, what)
      if etype in _NP:
        dt = np.dtype(_NP[etype])
        self.need(count * dt.itemsize, what)
        out = np.frombuffer(self.buf, dt, count, self.off).tolist()
        self.off += count * dt.itemsize
        return out
      self.need(count * 8, what)   # every remaining element type takes >= 8 bytes
      return [self.value(etype, what) for _ in range(count)]
    if vtype not in _SCALARS:
      raise ValueError(f"unknown value type {vtype} ({what})")
    return self.scalar(vtype, what)


def parse(path: str):
  """(metadata {key: value}, [TensorInfo]) of a GGUF file; ValueError when it is damaged."""
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
  data = np.memmap(path, dtype=np.uint8, mode="r")
  cur = _Cursor(memoryview(data))
  cur.need(4, "magic")
  cur.off = 4
  version = cur.scalar(4, "version")
  if version not in VERSIONS:
    raise ValueError(f"GGUF version {version} (big-endian or unsupported; read: {VERSIONS})")
  n_tensors, n_kv = cur.scalar(10, "tensor count"), cur.scalar(10, "metadata count")
  meta = {}
  for _ in range(n_kv):
    key = cur.string("a metadata key")
    meta[key] = cur.value(cur.scalar(4, key), key)
  infos = []
  for _ in range(n_tensors):
    name = cur.string("a tensor name")
    dims = tuple(cur.scalar(10, name) for _ in range(cur.scalar(4, name)))
    infos.append((name, dims, cur.scalar(4, name), cur.scalar(10, name)))
  align = int(meta.get("general.alignment", 32))
  start = -(-cur.off // align) * align
  tensors = []
  for name, dims, raw, offset in infos:
    qtype = GGMLQuantizationType(raw)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, ne0 = math.prod(dims[1:]), dims[0]
    if ne0 % block:
      raise ValueError(f"tensor {name}: row of {ne0} is not a multiple of {qtype.name}'s "
                       f"block of {block}")
    row_bytes = ne0 // block * type_size
    begin, n_bytes = start + offset, rows * row_bytes
    if begin + n_bytes > data.shape[0]:
      raise ValueError(f"truncated: tensor {name} needs bytes up to {begin + n_bytes}, the "
                       f"file has {data.shape[0]}")
    view = data[begin:begin + n_bytes].reshape(rows, row_bytes)
    tensors.append(TensorInfo(name, qtype, dims, begin, n_bytes, view))
  return meta, tensors
