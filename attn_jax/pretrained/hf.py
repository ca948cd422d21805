"""Hugging Face checkpoint directories: `config.json` + safetensors (one file, or shards listed
by `model.safetensors.index.json`) + `tokenizer.json`; read and written.

Reading `config.json`: `model_type` must be "llama"; the fields `llama.LlamaSpec` needs are
read by their HF names, and the ones that would change the computation are checked (the
message names the field): `hidden_act` (SiLU only), `attention_bias`, `mlp_bias`, RoPE
scaling (`rope_scaling` or `rope_parameters.rope_type` other than "default"), a `head_dim`
other than hidden_size / num_attention_heads. RoPE's theta comes from `rope_parameters`
(transformers 5) or `rope_theta` (earlier versions).

Safetensors are parsed here (the format is an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, then the raw bytes): numpy has no bfloat16, so
BF16/F8 tensors are viewed through `ml_dtypes` (a JAX dependency) and converted to fp32.
Files are memory-mapped; a header that points past the end of the file is refused.

Writing (`write_hf_dir`): fp32 `model.safetensors` (metadata format "pt", which transformers
expects), a `config.json` that `LlamaForCausalLM.from_pretrained` reads, `tokenizer.json` +
`tokenizer_config.json` (PreTrainedTokenizerFast), and `generation_config.json`.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

import numpy as np

from attn_jax.data.tokenizer import TOKENIZER_CONFIG
from attn_jax.pretrained.llama import LlamaSpec, PretrainedError, check_spec

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"

_HF_FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size",
                "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings",
                "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}


def read_config(directory: str) -> tuple[LlamaSpec, dict]:
  """(spec, the raw config dict) of a HF checkpoint directory."""
  path = os.path.join(directory, CONFIG)
  if not os.path.isfile(path):
    raise PretrainedError(f"{directory}: no {CONFIG} (not a Hugging Face checkpoint folder)")
  try:
    with open(path) as f:
      c = json.load(f)
  except (OSError, ValueError) as e:
    raise PretrainedError(f"{path}: unreadable JSON: {e}") from None
  return spec_from_config(c, path), c


def spec_from_config(c: Mapping[str, Any], path: str) -> LlamaSpec:
  def refuse(key, msg):
    raise PretrainedError(f"{path}: {key}: {msg}")
  if c.get("model_type") != "llama":
    refuse("model_type", f"{c.get('model_type')!r}; only 'llama' maps onto attn_jax's "
           f"Transformer (architectures: {c.get('architectures')})")
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size"):
    if key not in c:
      refuse(key, "missing")
  if c.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", f"{c['hidden_act']!r}; the SwiGLU uses SiLU only")
  for key in ("attention_bias", "mlp_bias"):
    if c.get(key):
      refuse(key, "true; attn_jax's projections have no biases")
  rope = c.get("rope_parameters") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    refuse("rope_parameters.rope_type", f"{kind!r}: RoPE scaling is not supported (plain RoPE)")
  scaling = c.get("rope_scaling")
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    refuse("rope_scaling", f"{scaling}: RoPE scaling is not supported (plain RoPE)")
  if float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
    refuse("partial_rotary_factor", "RoPE on part of each head is not supported")
  heads = int(c["num_attention_heads"])
  d = int(c["hidden_size"])
  spec = LlamaSpec(
      vocab_size=int(c["vocab_size"]), d_model=d, n_layers=int(c["num_hidden_layers"]),
      n_heads=heads, n_kv_heads=int(c.get("num_key_value_heads") or heads),
      head_dim=int(c.get("head_dim") or d // heads), d_ff=int(c["intermediate_size"]),
      max_seq_len=int(c.get("max_position_embeddings", 2048)),
      rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      bos_id=_first_int(c.get("bos_token_id")), eos_id=_first_int(c.get("eos_token_id")))
  check_spec(spec, path, _HF_FIELDS)
  return spec


def _first_int(v) -> int | None:
  if isinstance(v, (list, tuple)):
    v = v[0] if v else None
  return None if v is None else int(v)


# ------------------------------------------------------------------ safetensors

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _np_dtype(name: str, path: str, tensor: str):
  if name in _DTYPES:
    return np.dtype(_DTYPES[name])
  import ml_dtypes
  extra = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2}
  if name in extra:
    return np.dtype(extra[name])
  raise PretrainedError(f"{path}: tensor {tensor} has dtype {name}, which is not read")


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """{name: fp32 array} of one safetensors file (module docstring)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise PretrainedError(f"{path}: truncated safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", raw)
    if 8 + n > size:
      raise PretrainedError(f"{path}: truncated safetensors file (header of {n} bytes, file "
                            f"of {size})")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise PretrainedError(f"{path}: unreadable safetensors header: {e}") from None
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else None
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    begin, end = info["data_offsets"]
    if data is None or end > data.shape[0]:
      raise PretrainedError(f"{path}: truncated: tensor {name} needs bytes up to {8 + n + end}, "
                            f"the file has {size}")
    dt = _np_dtype(info["dtype"], path, name)
    arr = data[begin:end].view(dt).reshape(info["shape"])
    floating = info["dtype"].startswith(("F", "BF"))
    out[name] = arr.astype(np.float32) if floating else np.asarray(arr)
  return out


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint (all shards) as fp32 numpy."""
  index = os.path.join(directory, INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
      raise PretrainedError(f"{index}: unreadable shard index: {e}") from None
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(directory, SINGLE)):
    files, weight_map = [SINGLE], None
  else:
    others = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
    hint = f" ({', '.join(others)} are pickles: convert them to safetensors)" if others else ""
    raise PretrainedError(f"{directory}: no {SINGLE} or {INDEX}{hint}")
  out = {}
  for name in files:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise PretrainedError(f"{index}: lists shard {name}, which is missing")
    out.update(read_safetensors(path))
  if weight_map is not None:
    missing = sorted(set(weight_map) - set(out))
    if missing:
      raise PretrainedError(f"{index}: tensor {missing[0]} is listed but in no shard")
  return out


# ------------------------------------------------------------------ writing


def hf_config(spec: LlamaSpec) -> dict[str, Any]:
  """The `config.json` of a `LlamaForCausalLM` with these hyper-parameters."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
      "intermediate_size": spec.d_ff, "num_hidden_layers": spec.n_layers,
      "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
      "head_dim": spec.head_dim, "hidden_act": "silu",
      "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps,
      "rope_theta": spec.rope_theta, "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
      "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
      "tie_word_embeddings": spec.tie_embeddings, "bos_token_id": spec.bos_id,
      "eos_token_id": spec.eos_id, "torch_dtype": "float32", "dtype": "float32",
      "pretraining_tp": 1, "use_cache": True}


def write_hf_dir(directory: str, spec: LlamaSpec, tensors: Mapping[str, np.ndarray],
                 tokenizer_json: str | None, special: Mapping[str, str | None],
                 config: Mapping[str, Any] | None = None) -> None:
  """Writes the files of a HF checkpoint into an existing (empty) `directory`; `config`: its
  config.json (default: the Llama one of `spec`, `hf_config`)."""
  from safetensors.numpy import save_file
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
            os.path.join(directory, SINGLE), metadata={"format": "pt"})
  _dump(os.path.join(directory, CONFIG), dict(config) if config else hf_config(spec))
  gen = {k: v for k, v in (("bos_token_id", spec.bos_id), ("eos_token_id", spec.eos_id))
         if v is not None}
  _dump(os.path.join(directory, "generation_config.json"), gen)
  if tokenizer_json is not None:
    write_tokenizer(directory, tokenizer_json, special, spec.max_seq_len)


def write_tokenizer(directory: str, tokenizer_json: str, special: Mapping[str, str | None],
                    max_len: int) -> None:
  """tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast, no BOS added, the
  checkpoint's bos/eos token names `special`, which `data/tokenizer.HFTokenizer` reads too)."""
  with open(os.path.join(directory, TOKENIZER), "w") as f:
    f.write(tokenizer_json)
  tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_len), "add_bos_token": False}
  tc.update({k: v for k, v in special.items() if v is not None})
  _dump(os.path.join(directory, TOKENIZER_CONFIG), tc)


def _dump(path: str, obj) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")
