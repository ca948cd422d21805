"""Load a Llama checkpoint (GGUF file or Hugging Face folder) as an attn_jax `Decoder` with its
tokenizer; export a Decoder as a Hugging Face folder or a GGUF file.

    pre = load("SmolLM2-135M-Instruct.Q4_1.gguf")        # or a folder with config.json
    logits_BTV = pre.model(jnp.asarray([pre.encode("The sky is")]))
    export_hf(pre.model, "out/smollm2_hf", tokenizer=pre.tokenizer)

The model is built abstractly (`model.abstract_model`: no random initialisation) and the
checkpoint's arrays are put in its parameter slots, so a load costs reading and dequantising
the file and nothing more. Every step that can fail on the input (reading, mapping, the
tokenizer's vocabulary against the embedding rows) raises `PretrainedError` naming the file
and the field before anything is written. Writers put their files in a temporary folder next
to the target and rename it at the end, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax.data.tokenizer import HFTokenizer
from attn_jax.model import abstract_model
from attn_jax.model_config import ModelConfig
from attn_jax.pretrained import (checkpoint_tokenizer as tok_lib, gguf as gguf_lib, granite_swa,
                                 hf as hf_lib)
from attn_jax.pretrained.llama import (LlamaSpec, PretrainedError, exportable_problem, model_config,
                                       params_from_hf, params_to_hf)
from attn_jax.pretrained.packaged import resolve


@dataclasses.dataclass
class Pretrained:
  """A loaded checkpoint: the model, its tokenizer (`tokenizers.Tokenizer`), the checkpoint's
  hyper-parameters and where it came from ("gguf" or "hf" `kind`)."""
  model: Any
  tokenizer: Any
  spec: LlamaSpec
  source: str
  kind: str

  @property
  def cfg(self) -> ModelConfig:
    return self.model.cfg

  @property
  def text_tokenizer(self):
    """The tokenizer behind attn_jax's interface (`data/tokenizer.HFTokenizer`), EOS = the
    checkpoint's."""
    return HFTokenizer.wrap(self.tokenizer, eos_id=self.spec.eos_id if self.spec else None,
                            source=self.source)

  # encode/decode use the tokenizer directly: `text_tokenizer` needs an EOS, these do not
  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no BOS/EOS added: what `data/tokenizer.HFTokenizer` does)."""
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def read_checkpoint(path: str, *, tokenizer: str | None = None):
  """(spec, HF-named fp32 tensors, tokenizer, kind) of a GGUF file or HF folder; `tokenizer`:
  a tokenizer.json to use instead of the checkpoint's."""
  path = resolve(os.fspath(path))
  if os.path.isdir(path):
    spec, _ = hf_lib.read_config(path)
    tensors = hf_lib.read_tensors(path)
    tok_path = tokenizer or os.path.join(path, hf_lib.TOKENIZER)
    if not os.path.isfile(tok_path):
      raise PretrainedError(f"{path}: no {hf_lib.TOKENIZER} (pass a tokenizer file)")
    tok = tok_lib.load_json(tok_path)
    tok_lib.check_vocab(tok, spec.vocab_size, tok_path)
    return spec, tensors, tok, "hf"
  if not os.path.exists(path):
    raise PretrainedError(f"{path}: no such file or folder")
  reader = gguf_lib.open_reader(path)
  spec = gguf_lib.read_spec(reader, path)
  if tokenizer:
    tok = tok_lib.load_json(tokenizer)
    tok_lib.check_vocab(tok, spec.vocab_size, tokenizer)
  else:
    tok = tok_lib.from_gguf(reader, path)
    tok_lib.check_vocab(tok, spec.vocab_size, path, exact=True)
  return spec, gguf_lib.read_tensors(reader, path, spec), tok, "gguf"


def build(spec: LlamaSpec, tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str):
  """The Decoder of `cfg` holding the checkpoint's arrays (no random initialisation)."""
  params = params_from_hf(tensors, spec, cfg, source)
  graphdef, abs_params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  want = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(abs_params))
  have = jax.tree.map(lambda a: tuple(a.shape), params)
  if want != have:   # a mapping bug, not the user's input
    raise AssertionError(f"parameter tree mismatch: built {have}, the model wants {want}")
  nnx.replace_by_pure_dict(abs_params, jax.tree.map(jnp.asarray, params))
  return nnx.merge(graphdef, abs_params, rest)


def load(path: str, *, dtype: str = "float32", vocab_multiple: int = 128,
         tokenizer: str | None = None) -> Pretrained:
  """A Llama checkpoint (a .gguf file, a folder with config.json + safetensors +
  tokenizer.json, or a packaged checkpoint's name: `packaged.PACKAGED`) as a `Pretrained`
  (parameters fp32, compute in `dtype`)."""
  path = resolve(os.fspath(path))
  spec, tensors, tok, kind = read_checkpoint(path, tokenizer=tokenizer)
  cfg = model_config(spec, dtype=dtype, vocab_multiple=vocab_multiple)
  model = build(spec, tensors, cfg, path)
  return Pretrained(model, tok, spec, os.path.abspath(path), kind)


# ------------------------------------------------------------------ export


def spec_of(cfg: ModelConfig, *, bos_id: int | None = None,
            eos_id: int | None = None) -> LlamaSpec:
  """The Llama hyper-parameters of an exportable model config."""
  return LlamaSpec(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                   n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                   d_ff=cfg.d_ff, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                   norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings, bos_id=bos_id,
                   eos_id=eos_id)


def hf_tensors(model) -> dict[str, np.ndarray]:
  """The model's parameters under Hugging Face's Llama names (fp32 numpy); PretrainedError
  when the model has no Llama equivalent."""
  problem = exportable_problem(model.cfg)
  if problem:
    raise PretrainedError(f"cannot export as Llama: {problem}")
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return params_to_hf(params, model.cfg)


def as_tokenizer(tokenizer):
  """A `tokenizers.Tokenizer` from one, from `data/tokenizer.HFTokenizer`, or from a path."""
  if tokenizer is None or hasattr(tokenizer, "to_str"):
    return tokenizer
  if hasattr(tokenizer, "_tok"):
    return tokenizer._tok
  return tok_lib.load_json(os.fspath(tokenizer))


def special_names(tok, spec: LlamaSpec) -> dict[str, str | None]:
  if tok is None:
    return {}
  name = lambda i: None if i is None else tok.id_to_token(int(i))
  return {"bos_token": name(spec.bos_id), "eos_token": name(spec.eos_id)}


def export_hf(model, directory: str, *, tokenizer=None, bos_id: int | None = None,
              eos_id: int | None = None) -> str:
  """Writes `model` as a Hugging Face Llama folder (safetensors + config.json + tokenizer)
  that `transformers.LlamaForCausalLM.from_pretrained` loads; returns its path. A Llama with
  a learned sink logit is written as a `GraniteSWAForCausalLM` (`granite_swa.py`: the same
  computation). Refuses a model with no transformers equivalent, a tokenizer with more ids
  than the vocabulary, and an existing non-empty `directory`."""
  spec = spec_of(model.cfg, bos_id=bos_id, eos_id=eos_id)
  config = None
  if granite_swa.holds(model.cfg):
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors, config = granite_swa.hf_tensors(params, model.cfg), granite_swa.hf_config(spec)
  else:
    tensors = hf_tensors(model)
  tok = as_tokenizer(tokenizer)
  if tok is not None:
    tok_lib.check_vocab(tok, model.cfg.vocab_size, "tokenizer")
  with staged_dir(directory) as tmp:
    hf_lib.write_hf_dir(tmp, spec, tensors, None if tok is None else tok.to_str(),
                        special_names(tok, spec), config)
  return os.path.abspath(directory)


def export_gguf(model, path: str, *, tokenizer, qtype: str = "F32", bos_id: int | None = None,
                eos_id: int | None = None) -> str:
  """Writes `model` as a llama.cpp GGUF file (2-D weights as `qtype`); returns its path."""
  tensors = hf_tensors(model)
  tok = as_tokenizer(tokenizer)
  if tok is None:
    raise PretrainedError("a GGUF file carries its tokenizer: pass one")
  tok_lib.check_vocab(tok, model.cfg.vocab_size, "tokenizer", exact=True)
  fields = tok_lib.gguf_tokenizer_fields(tok, bos_id=bos_id, eos_id=eos_id)
  spec = spec_of(model.cfg, bos_id=bos_id, eos_id=eos_id)
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise PretrainedError(f"{path}: exists; choose a new output path")
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=os.path.dirname(path))
  os.close(fd)
  try:
    gguf_lib.write_gguf(tmp, spec, tensors, fields, qtype=qtype)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


class staged_dir:
  """`with staged_dir(target) as tmp:` write into `tmp` (beside `target`); renamed to `target`
  when the block ends without an error, removed otherwise. `target` must not exist or be an
  empty folder."""

  def __init__(self, target: str):
    self.target = os.path.abspath(target)

  def __enter__(self) -> str:
    if os.path.exists(self.target) and (not os.path.isdir(self.target)
                                        or os.listdir(self.target)):
      raise PretrainedError(f"{self.target}: exists and is not an empty folder; choose a new "
                            "output folder")
    parent = os.path.dirname(self.target)
    os.makedirs(parent, exist_ok=True)
    self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(self.tmp, 0o777 & ~umask)   # mkdtemp's 0700 would outlive the rename
    return self.tmp

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return
    if os.path.isdir(self.target):
      os.rmdir(self.target)   # empty (checked on entry)
    os.rename(self.tmp, self.target)
