"""GGUF files (llama.cpp's format) of Llama models: read them, and write them.

A GGUF holds key/value metadata (`<arch>.block_count`, `tokenizer.ggml.tokens`, ...) and named
tensors, each stored in its own ggml type (F32, F16, BF16 or a block quantisation: Q8_0,
Q4_1, Q4_K, ...). `gguf_file.py` parses the file, the `gguf` package dequantises every type it
knows to fp32 (and writes files); this module maps names and layouts onto Hugging Face's
(`llama.py` takes it from there):

    token_embd.weight      model.embed_tokens.weight     output_norm.weight  model.norm.weight
    output.weight          lm_head.weight (absent: tied)
    blk.N.attn_norm        model.layers.N.input_layernorm
    blk.N.attn_q/k/v       model.layers.N.self_attn.q_proj/k_proj/v_proj
    blk.N.attn_output      model.layers.N.self_attn.o_proj
    blk.N.ffn_norm         model.layers.N.post_attention_layernorm
    blk.N.ffn_gate/up/down model.layers.N.mlp.gate_proj/up_proj/down_proj

Shapes: ggml lists dimensions innermost first (`ne0` = the input dimension), the reader's
numpy arrays are [rows, ne0] = torch's [out, in].

RoPE layout. llama.cpp's Llama graph rotates adjacent channel pairs (2j, 2j + 1) of each head
(the GPT-J "interleaved" layout), while HF Llama, trained with the half-split layout, pairs j
with j + Dh/2. Its converter therefore permutes the rows of q_proj (per query head) and of
k_proj (per key/value head) so that the interleaved rotation computes the same thing:
half-split row i * Dh/2 + j of a head is stored at row 2 j + i. `unpermute_rows` reverses
it: [H, 2, Dh/2, D] <- [H, Dh/2, 2, D]. V and O are stored as they are.

Truncated or foreign files are refused before any weight is read: the magic bytes, the
header's parse, and every tensor's byte range against the file size.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

from attn_jax.pretrained import gguf_file
from attn_jax.pretrained.llama import LlamaSpec, PretrainedError, check_spec

GGUF_MAGIC = b"GGUF"
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_GGUF_KEYS = {"d_model": "embedding_length", "n_layers": "block_count",
              "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
              "d_ff": "feed_forward_length", "max_seq_len": "context_length",
              "rope_theta": "rope.freq_base", "norm_eps": "attention.layer_norm_rms_epsilon"}


@dataclasses.dataclass
class GGUFFile:
  """A parsed GGUF file (`gguf_file.parse`): its metadata and its tensors."""
  path: str
  metadata: dict
  tensors: list


def open_reader(path: str) -> GGUFFile:
  """The parsed GGUF file, or a PretrainedError naming the file (not one, truncated, damaged)."""
  try:
    import gguf  # noqa: F401  (the ggml type table and the dequantisers)
  except ImportError:
    raise PretrainedError("reading GGUF files needs the `gguf` package: pip install "
                          "'attn_jax[pretrained]'") from None
  if not os.path.isfile(path):
    raise PretrainedError(f"{path}: no such file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise PretrainedError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
  try:
    metadata, tensors = gguf_file.parse(path)
  except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
    why = " ".join(str(e).split())[:200]
    if why.startswith("truncated"):
      raise PretrainedError(f"{path}: {why}") from None
    raise PretrainedError(f"{path}: unreadable GGUF (damaged?): {why}") from None
  return GGUFFile(path, metadata, tensors)


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
  """A metadata value (a str, number, bool or list), `default` when absent."""
  return reader.metadata.get(key, default)


def read_spec(reader, path: str) -> LlamaSpec:
  """The hyper-parameters from the metadata; a PretrainedError naming the key for what does
  not map (another architecture, RoPE scaling, partial rotary dims, experts)."""
  arch = field(reader, "general.architecture")
  if arch != "llama":
    raise PretrainedError(f"{path}: general.architecture is {arch!r}; only 'llama' maps onto "
                          "attn_jax's Transformer")
  need = lambda key: _required(reader, path, f"llama.{key}")
  embd = _tensor(reader, "token_embd.weight", path)
  vocab = int(embd.shape[1])    # ggml order: [ne0 = d_model, ne1 = vocab]
  n_heads, d_model = int(need("attention.head_count")), int(need("embedding_length"))
  spec = LlamaSpec(
      vocab_size=vocab, d_model=d_model, n_layers=int(need("block_count")), n_heads=n_heads,
      n_kv_heads=int(field(reader, "llama.attention.head_count_kv", n_heads)),
      head_dim=int(field(reader, "llama.attention.key_length", d_model // max(n_heads, 1))),
      d_ff=int(need("feed_forward_length")), max_seq_len=int(need("context_length")),
      rope_theta=_f32_decimal(field(reader, "llama.rope.freq_base", 10000.0)),
      norm_eps=_f32_decimal(need("attention.layer_norm_rms_epsilon")),
      tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
      bos_id=_opt_int(field(reader, "tokenizer.ggml.bos_token_id")),
      eos_id=_opt_int(field(reader, "tokenizer.ggml.eos_token_id")))
  keys = {k: f"llama.{v}" for k, v in _GGUF_KEYS.items()}
  keys.update(vocab_size="token_embd.weight rows", head_dim="llama.attention.key_length")
  check_spec(spec, path, keys)
  _check_unmapped(reader, path, spec)
  return spec


def _check_unmapped(reader, path: str, spec: LlamaSpec) -> None:
  rot = field(reader, "llama.rope.dimension_count", spec.head_dim)
  if int(rot) != spec.head_dim:
    raise PretrainedError(f"{path}: llama.rope.dimension_count={rot} rotates part of each "
                          f"head (head_dim {spec.head_dim}); attn_jax rotates all of it")
  vlen = field(reader, "llama.attention.value_length", spec.head_dim)
  if int(vlen) != spec.head_dim:
    raise PretrainedError(f"{path}: llama.attention.value_length={vlen} differs from the key "
                          f"length {spec.head_dim}")
  scaling = field(reader, "llama.rope.scaling.type", "none")
  factor = field(reader, "llama.rope.scaling.factor", 1.0)
  if scaling not in ("none", "") or float(factor) not in (0.0, 1.0):
    raise PretrainedError(f"{path}: llama.rope.scaling.type={scaling!r} (factor {factor}): "
                          "RoPE scaling is not supported (plain RoPE only)")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise PretrainedError(f"{path}: tensor rope_freqs.weight: per-frequency RoPE scaling "
                          "(Llama 3.1 style) is not supported (plain RoPE only)")
  experts = field(reader, "llama.expert_count", 0)
  if int(experts or 0):
    raise PretrainedError(f"{path}: llama.expert_count={experts}: mixture-of-experts layers "
                          "are not supported")


def _required(reader, path: str, key: str):
  v = field(reader, key)
  if v is None:
    raise PretrainedError(f"{path}: metadata key {key} is missing")
  return v


def _f32_decimal(v) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
  9.999999747378752e-06): the value the checkpoint's author wrote, and the same float32."""
  return float(np.format_float_scientific(np.float32(v), unique=True))


def _opt_int(v) -> int | None:
  return None if v is None else int(v)


def _tensor(reader, name: str, path: str):
  for t in reader.tensors:
    if t.name == name:
      return t
  raise PretrainedError(f"{path}: tensor {name} is missing")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's interleaved q/k rows -> HF's half-split rows (module docstring)."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF's half-split q/k rows -> llama.cpp's interleaved rows (what its converter writes)."""
  rows = w.shape[0]
  return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(t) -> np.ndarray:
  """One tensor as fp32 numpy, in numpy order ([rows, ne0])."""
  from gguf.quants import dequantize
  try:
    arr = dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise PretrainedError(f"tensor {t.name}: {e}") from None
  return np.asarray(arr, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def read_tensors(reader, path: str, spec: LlamaSpec) -> dict[str, np.ndarray]:
  """Every tensor, dequantised to fp32 under its Hugging Face name, q/k rows un-permuted."""
  out = {}
  for t in reader.tensors:
    out[hf_name(t.name, path)] = t
  arrays = {}
  for name, t in out.items():
    w = dequantized(t)
    if name.endswith("self_attn.q_proj.weight"):
      w = unpermute_rows(w, spec.n_heads)
    elif name.endswith("self_attn.k_proj.weight"):
      w = unpermute_rows(w, spec.n_kv_heads)
    arrays[name] = w
  return arrays


def hf_name(name: str, path: str) -> str:
  if name in _TOP_NAMES:
    return _TOP_NAMES[name]
  head, _, rest = name.partition(".")
  if head == "blk":
    idx, _, leaf = rest.partition(".")
    if leaf in _LAYER_NAMES and idx.isdigit():
      return f"model.layers.{idx}.{_LAYER_NAMES[leaf]}"
    if leaf.endswith(".bias"):
      raise PretrainedError(f"{path}: tensor {name}: a bias; attn_jax's Llama projections "
                            "have none")
  raise PretrainedError(f"{path}: tensor {name}: not a tensor of a Llama decoder")


# ------------------------------------------------------------------ writing


def write_gguf(path: str, spec: LlamaSpec, tensors: dict[str, np.ndarray], tokenizer_fields:
               dict[str, Any], *, qtype: str = "F32", name: str = "attn_jax") -> None:
  """A llama.cpp GGUF of HF-named fp32 `tensors`: q/k rows permuted, 2-D weights stored as
  `qtype` (F32, F16, BF16, Q8_0, ... whatever `gguf.quants.quantize` does; norms stay F32, as
  llama.cpp keeps them). `tokenizer_fields` from `tokenizer.gguf_tokenizer_fields`."""
  import gguf
  qt = getattr(gguf.GGMLQuantizationType, qtype, None)
  if qt is None:
    raise PretrainedError(f"qtype {qtype!r} is not a ggml type (F32, F16, BF16, Q8_0, ...)")
  to_gguf = {v: k for k, v in _TOP_NAMES.items()}
  w = gguf.GGUFWriter(path, "llama")
  w.add_name(name)
  w.add_context_length(spec.max_seq_len)
  w.add_embedding_length(spec.d_model)
  w.add_block_count(spec.n_layers)
  w.add_feed_forward_length(spec.d_ff)
  w.add_head_count(spec.n_heads)
  w.add_head_count_kv(spec.n_kv_heads)
  w.add_rope_freq_base(float(spec.rope_theta))
  w.add_layer_norm_rms_eps(float(spec.norm_eps))
  w.add_rope_dimension_count(spec.head_dim)
  w.add_vocab_size(spec.vocab_size)
  w.add_file_type(int(_FILE_TYPES.get(qtype, 0)))
  _add_tokenizer(w, tokenizer_fields)
  for hf, arr in tensors.items():
    arr = np.asarray(arr, np.float32)
    if hf.endswith("self_attn.q_proj.weight"):
      arr = permute_rows(arr, spec.n_heads)
    elif hf.endswith("self_attn.k_proj.weight"):
      arr = permute_rows(arr, spec.n_kv_heads)
    if hf in to_gguf:
      gname = to_gguf[hf]
    else:
      idx, leaf = hf[len("model.layers."):].split(".", 1)
      gname = f"blk.{idx}.{next(k for k, v in _LAYER_NAMES.items() if v == leaf)}"
    _add_tensor(w, gname, arr, qt if arr.ndim == 2 else gguf.GGMLQuantizationType.F32)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


def _add_tensor(w, name: str, arr: np.ndarray, qt) -> None:
  import gguf
  if qt == gguf.GGMLQuantizationType.F32:
    w.add_tensor(name, arr)
    return
  data = gguf.quants.quantize(arr, qt)
  w.add_tensor(name, data, raw_dtype=qt)   # shape: from the quantised bytes


def _add_tokenizer(w, fields: dict[str, Any]) -> None:
  w.add_tokenizer_model(fields["model"])
  w.add_tokenizer_pre(fields["pre"])
  w.add_token_list(fields["tokens"])
  w.add_token_types(fields["token_types"])
  if fields.get("merges"):
    w.add_token_merges(fields["merges"])
  for key, fn in (("bos_id", w.add_bos_token_id), ("eos_id", w.add_eos_token_id),
                  ("unk_id", w.add_unk_token_id), ("pad_id", w.add_pad_token_id)):
    if fields.get(key) is not None:
      fn(int(fields[key]))
  w.add_add_bos_token(bool(fields.get("add_bos", False)))
