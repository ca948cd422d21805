"""A checkpoint's tokenizer as a Hugging Face `tokenizers.Tokenizer` (what `data/tokenizer.py`
wraps), from a `tokenizer.json` or rebuilt from a GGUF's vocabulary.

A GGUF of a byte-level BPE model (`tokenizer.ggml.model = "gpt2"`) stores the vocabulary in
id order (`tokenizer.ggml.tokens`, already spelled in GPT-2's byte-to-unicode alphabet), the
merges in rank order (`tokenizer.ggml.merges`, "a b"), a type per token
(`tokenizer.ggml.token_type`: 1 normal, 3 control, 4 user-defined, ...) and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`), which fixes how text is split into words
before the merges run. The rebuilt tokenizer is

    BPE(vocab, merges)  +  the pre-tokenizer named by `pre`  +  byte-level decoding,

with control tokens added as special tokens and user-defined ones as added tokens (both are
matched whole in the text, as llama.cpp does). The pre-tokenizers (llama.cpp's regexes as
`tokenizers` components):

    gpt2 (mpt, olmo, jais)          GPT-2's regex ('s|'t|...| ?\\p{L}+| ?\\p{N}+|...)
    smollm (starcoder, refact, ...) each digit on its own (\\p{N}), then GPT-2's regex
    llama-bpe, llama3               Llama 3's regex (numbers in groups of up to 3 digits)

Any other name, no name (llama.cpp's "default" is a regex list of its own, not GPT-2's), or a
SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) is refused naming the key; pass a
tokenizer.json instead. `gguf_tokenizer_fields` is the inverse, for `gguf.write_gguf`.
"""

from __future__ import annotations

import json
from typing import Any

from attn_jax.pretrained.gguf import field
from attn_jax.pretrained.llama import PretrainedError

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's names sharing one regex list (llama-vocab.cpp, the pre-type switch)
_GPT2_NAMES = ("gpt2", "gpt-2", "mpt", "olmo", "jais")
_SMOLLM_NAMES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


def pre_tokenizer(pre: str, source: str):
  """The `tokenizers` pre-tokenizer of llama.cpp's pre-tokenizer name (module docstring)."""
  from tokenizers import Regex, pre_tokenizers as pt
  if pre in _GPT2_NAMES:
    return pt.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _SMOLLM_NAMES:
    return pt.Sequence([pt.Digits(individual_digits=True),
                        pt.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre in _LLAMA3_NAMES:
    return pt.Sequence([pt.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])
  known = ", ".join(_GPT2_NAMES + _SMOLLM_NAMES + _LLAMA3_NAMES)
  raise PretrainedError(f"{source}: tokenizer.ggml.pre={pre!r}: no pre-tokenizer for it "
                        f"(known: {known})")


def from_gguf(reader, source: str):
  """The tokenizer a GGUF describes (module docstring)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors

  tokens, types, vocab, pairs = _gguf_vocab(reader, source)
  tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", ""), source)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if int(ty) == CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if int(ty) == USER_DEFINED]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


def _gguf_vocab(reader, source: str):
  """(tokens, their types, {token: id}, merge pairs) of a byte-level BPE GGUF, checked."""
  kind = field(reader, "tokenizer.ggml.model")
  if kind is None:
    raise PretrainedError(f"{source}: no tokenizer in the file (tokenizer.ggml.model is "
                          "missing); pass a tokenizer.json")
  if kind != "gpt2":
    raise PretrainedError(f"{source}: tokenizer.ggml.model={kind!r}: only byte-level BPE "
                          "('gpt2') vocabularies are rebuilt; pass a tokenizer.json")
  tokens = field(reader, "tokenizer.ggml.tokens")
  types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
  if len(types) != len(tokens):
    raise PretrainedError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
                          f"{len(tokens)} tokens")
  vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
  if len(vocab) != len(tokens):
    raise PretrainedError(f"{source}: tokenizer.ggml.tokens repeats a token ({len(tokens)} "
                          f"entries, {len(vocab)} distinct)")
  pairs = []
  for m in field(reader, "tokenizer.ggml.merges") or []:
    a, sep, b = m.partition(" ")
    if not sep:
      raise PretrainedError(f"{source}: tokenizer.ggml.merges entry {m!r} is not 'a b'")
    pairs.append((a, b))
  return tokens, types, vocab, pairs


def load_json(path: str):
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # `tokenizers` raises a bare Exception without the path
    raise PretrainedError(f"{path}: not a valid tokenizers JSON file: {e}") from None


def check_vocab(tok, vocab_size: int, source: str, *, exact: bool = False) -> None:
  """The tokenizer's ids must index the model's embedding rows (`exact`: as many ids as rows,
  which a GGUF's vocabulary always has)."""
  n = tok.get_vocab_size(with_added_tokens=True)
  if n > vocab_size or (exact and n != vocab_size):
    raise PretrainedError(f"{source}: vocabulary/tokenizer mismatch: the tokenizer has {n} "
                          f"ids, the embedding table {vocab_size} rows")


def _pre_name(pre: dict | None) -> str:
  """llama.cpp's name of a `tokenizers` pre-tokenizer JSON (those `pre_tokenizer` builds)."""
  if pre is None:
    return ""
  if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
    return "gpt2"
  if pre.get("type") == "Sequence":
    parts = pre.get("pretokenizers", [])
    types = [p.get("type") for p in parts]
    if (types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits")
        and parts[1].get("use_regex", True)):
      return "smollm"
    if (types == ["Split", "ByteLevel"] and parts[0].get("pattern", {}).get("Regex")
        == _LLAMA3_SPLIT):
      return "llama-bpe"
  return ""


def gguf_tokenizer_fields(tok, *, bos_id: int | None = None,
                          eos_id: int | None = None) -> dict[str, Any]:
  """What `gguf.write_gguf` stores of a byte-level BPE `tokenizers.Tokenizer`."""
  data = json.loads(tok.to_str())
  model = data.get("model", {})
  if model.get("type") != "BPE":
    raise PretrainedError(f"tokenizer model {model.get('type')!r}: only BPE goes into a GGUF")
  pre = _pre_name(data.get("pre_tokenizer"))
  if not pre:
    raise PretrainedError(f"pre-tokenizer {data.get('pre_tokenizer')}: no llama.cpp name "
                          "for it (ByteLevel, Digits + ByteLevel, Llama 3's Split)")
  vocab = tok.get_vocab(with_added_tokens=True)
  n = len(vocab)
  by_id = {i: t for t, i in vocab.items()}
  if sorted(by_id) != list(range(n)):
    raise PretrainedError("tokenizer ids are not contiguous from 0")
  added = {a["content"]: a for a in data.get("added_tokens", [])}
  types = [(CONTROL if added[t].get("special") else USER_DEFINED) if t in added else NORMAL
           for t in (by_id[i] for i in range(n))]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  return {"model": "gpt2", "pre": pre, "tokens": [by_id[i] for i in range(n)],
          "token_types": types, "merges": merges, "bos_id": bos_id, "eos_id": eos_id}
