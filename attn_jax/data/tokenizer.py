"""Tokenizers behind one small interface: bytes (no file needed) or a Hugging Face
`tokenizers` JSON file (e.g. the GPT-NeoX-20B tokenizer, vocabulary 50,277)."""

from __future__ import annotations

import os
from typing import Protocol, Sequence


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


class HFTokenizer:
  """A `tokenizers` JSON file. EOS is the first of `<|endoftext|>` (GPT-2, NeoX, SmolLM),
  `<|end_of_text|>` (Llama 3), `</s>` (Llama 2, Mistral) and `<eos>` (Gemma) it holds."""

  def __init__(self, path: str | os.PathLike):
    from tokenizers import Tokenizer as _Tok

    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path!r}")
    self.path = path
    try:
      self._tok = _Tok.from_file(path)
    except Exception as e:  # `tokenizers` raises a bare Exception without the path
      raise ValueError(f"tokenizer file {path!r} is not a valid tokenizers JSON file (from "
                       f"data.tokenizer): {e}") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    eos = None
    for name in _EOS_NAMES:
      eos = self._tok.token_to_id(name)
      if eos is not None:
        break
    if eos is None:
      raise ValueError(f"tokenizer {path!r} has no EOS token (none of {', '.join(_EOS_NAMES)})")
    self.eos_id = int(eos)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def get_tokenizer(spec: str) -> Tokenizer:
  """`spec` is "bytes" or a path to a tokenizers JSON file."""
  if spec in ("bytes", "byte", ""):
    return ByteTokenizer()
  return HFTokenizer(spec)
