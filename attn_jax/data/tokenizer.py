"""Tokenizers behind one small interface: bytes (no file needed) or a Hugging Face
`tokenizers` JSON file (e.g. the GPT-NeoX-20B tokenizer, vocabulary 50,277)."""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence

from attn_jax import paths


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes 0..255; id 256 is EOS. vocab_size = 257."""

  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_CONFIG = "tokenizer_config.json"


class HFTokenizer:
  """A `tokenizers` JSON file. EOS is, in this order: `eos_id` when given; the `eos_token` of a
  `tokenizer_config.json` beside the file (the Hugging Face layout, so that a checkpoint's own
  choice wins: SmolLM2-Instruct declares `<|im_end|>`, its chat turn end); the first of
  `<|endoftext|>` (GPT-2, NeoX, SmolLM), `<|end_of_text|>` (Llama 3), `</s>` (Llama 2,
  Mistral) and `<eos>` (Gemma) the vocabulary holds."""

  def __init__(self, path: str | os.PathLike, *, eos_id: int | None = None):
    from tokenizers import Tokenizer as _Tok

    path = os.fspath(path)
    if not paths.run_path(path).is_file():   # a local file or a gs:// object
      raise FileNotFoundError(f"tokenizer file not found: {path!r}")
    try:
      tok = _Tok.from_str(paths.run_path(path).read_text())
    except Exception as e:  # `tokenizers` raises a bare Exception without the path
      raise ValueError(f"tokenizer file {path!r} is not a valid tokenizers JSON file (from "
                       f"data.tokenizer): {e}") from None
    if eos_id is None:
      eos_id = _declared_eos(tok, paths.name(paths.run_path(path).parent / TOKENIZER_CONFIG))
    self._init(tok, path, eos_id)

  @classmethod
  def wrap(cls, tok, *, eos_id: int | None = None, source: str = "") -> "HFTokenizer":
    """An in-memory `tokenizers.Tokenizer` (a loaded checkpoint's) behind this interface."""
    self = cls.__new__(cls)
    self._init(tok, source, eos_id)
    return self

  def _init(self, tok, path: str, eos_id: int | None) -> None:
    self.path, self._tok = path, tok
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if eos_id is None:
      eos_id = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
    if eos_id is None:
      raise ValueError(f"tokenizer {path!r} has no EOS token (none of {', '.join(_EOS_NAMES)})")
    if not 0 <= int(eos_id) < self.vocab_size:
      raise ValueError(f"tokenizer {path!r}: EOS id {eos_id} is outside its vocabulary "
                       f"({self.vocab_size} ids)")
    self.eos_id = int(eos_id)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _declared_eos(tok, config_path: str) -> int | None:
  """The id of `eos_token` in a Hugging Face tokenizer_config.json (None: no file or field)."""
  if not paths.run_path(config_path).is_file():
    return None
  try:
    name = json.loads(paths.run_path(config_path).read_text()).get("eos_token")
  except (OSError, ValueError, AttributeError) as e:
    raise ValueError(f"{config_path}: not a readable tokenizer config ({e})") from None
  if isinstance(name, dict):   # {"content": "<|im_end|>", ...} in older files
    name = name.get("content")
  if name is None:
    return None
  eos = tok.token_to_id(str(name))
  if eos is None:
    raise ValueError(f"{config_path}: eos_token {name!r} is not in the tokenizer's vocabulary")
  return int(eos)


def get_tokenizer(spec: str) -> Tokenizer:
  """`spec` is "bytes" or a path to a tokenizers JSON file."""
  if spec in ("bytes", "byte", ""):
    return ByteTokenizer()
  return HFTokenizer(spec)
