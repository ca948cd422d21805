"""attn_jax models inside EleutherAI's lm-evaluation-harness (`pip install lm-eval`, or the
`lmeval` extra: `pip install -e '.[lmeval]'`).

Registers the lm-eval model `attn_jax` (`AttnJaxLM`), a `TemplateLM`, so lm-eval's own
tokenization convention applies (`_encode_pair`: trailing context whitespace moves to the
continuation, the continuation is the joint encoding minus the context's tokens; an empty
context becomes `[prefix_token_id]` = EOS). Scoring goes through
`attn_jax.eval.harness.loglikelihood_tokens` (bucketed, batched, LM head on the continuation rows
only) with `attn_jax.eval.run.ModelScorer`:

  loglikelihood          (context, continuation) -> (sum log p, is_greedy), lm-eval's
                         tokenization, sequences left-truncated to the last max_length + 1 tokens.
  loglikelihood_rolling  the whole text in lm-eval's rolling windows
                         (`get_rolling_token_windows` + `make_disjoint_window`, context_len 1,
                         first token conditioned on EOS), each token scored once.
  generate_until         greedy decoding (`attn_jax.decode.generate`), stops at EOS, cut at the
                         first `until` string, at most `max_gen_toks` new tokens; the context is
                         left-truncated to max_length - max_gen_toks. Sampling arguments
                         (do_sample=True, temperature > 0, num_beams > 1, ...) raise ValueError.

From the command line (stock lm-eval has no plugin discovery for models, so this entry point
registers the model and then hands its arguments to lm-eval's own CLI):

  python -m attn_jax.eval.lm_eval_adapter --model attn_jax \
      --model_args checkpoint=runs/x,max_len=1024 --tasks arc_easy,hellaswag --batch_size 32
  attn-jax-lm-eval ...        # the same, as a console script

`--model attn_jax` is added when no --model is given. model_args: `checkpoint=DIR` (required;
loaded with `attn_jax.train.checkpoint.load_for_inference`), `step=N` (default latest),
`tokenizer=PATH|bytes` (default the training config's `data.tokenizer`), `max_len=N` (default
`config.eval.max_len` or `config.data.seq_len`, as attn_jax's own evaluator), `max_gen_toks=N`
(default 256), `batch_tokens=N`. The batch size comes from lm-eval's `--batch_size` (its default
is 1; `auto` means 32 here).

From Python (tests, notebooks), with an in-memory model:

  lm = AttnJaxLM.from_model(model, tokenizer, max_len=512, batch_size=32)
  lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

Importing attn_jax never imports this module; importing it without lm-eval raises ImportError.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from typing import Any, Sequence

try:
  from lm_eval import utils as _lm_utils
  from lm_eval.api import registry as _registry
  from lm_eval.api.model import TemplateLM
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "attn_jax.eval.lm_eval_adapter needs EleutherAI's lm-evaluation-harness: "
      "pip install lm-eval  (or, in this repository, pip install -e '.[lmeval]')") from e

import numpy as np

from attn_jax import decode
from attn_jax.data.tokenizer import Tokenizer, get_tokenizer
from attn_jax.eval import harness
from attn_jax.eval.run import ModelScorer
from attn_jax.train.checkpoint import load_for_inference

logger = logging.getLogger(__name__)

MODEL_NAME = "attn_jax"
DEFAULT_BATCH_SIZE = 32  # for lm-eval's --batch_size auto
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until

# generation arguments that greedy decoding can honour (anything else raises ValueError)
_GREEDY_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "num_beams",
                      "top_k", "top_p"}


def _as_int(value: Any, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} should be an integer, got {value!r}") from None


def _batch_size(value: Any) -> int:
  if value is None:
    return DEFAULT_BATCH_SIZE
  if isinstance(value, str) and value.strip().lower().startswith("auto"):
    logger.info("attn_jax: batch_size=%r -> %d (no automatic batch sizing)", value,
                DEFAULT_BATCH_SIZE)
    return DEFAULT_BATCH_SIZE
  size = _as_int(value, "batch_size")
  if size is None or size < 1:
    raise ValueError(f"batch_size must be a positive integer or 'auto', got {value!r}")
  return size


class AttnJaxLM(TemplateLM):
  """An attn_jax decoder as an lm-eval `LM` (see the module docstring).

  Construct from a training run with `AttnJaxLM(checkpoint=DIR, ...)` (what lm-eval's
  `--model_args` does) or around an in-memory model with `AttnJaxLM.from_model(...)`.
  """

  backend = "causal"

  def __init__(self, checkpoint: str | None = None, step: int | str | None = None,
               tokenizer: str | Tokenizer | None = None, max_len: int | str | None = None,
               batch_size: int | str | None = None, max_gen_toks: int | str | None = None,
               batch_tokens: int | str | None = None, *, model=None, device: str | None = None,
               max_batch_size: int | None = None, **unused):
    super().__init__()
    if unused:
      raise TypeError(f"attn_jax model: unknown model_args {sorted(unused)}; known: checkpoint, "
                      "step, tokenizer, max_len, batch_size, max_gen_toks, batch_tokens")
    del max_batch_size  # lm-eval passes it for 'auto' batch sizing; we size nothing automatically
    if device:
      logger.info("attn_jax: device=%r ignored; JAX places the model (JAX_PLATFORMS selects)",
                  device)
    if (checkpoint is None) == (model is None):
      raise ValueError("attn_jax model: give model_args checkpoint=DIR (a training run "
                       "directory), or use AttnJaxLM.from_model(model, tokenizer) in Python")
    if model is not None:
      if tokenizer is None:
        raise ValueError("AttnJaxLM.from_model needs a tokenizer (object or path)")
      default_len = int(model.cfg.max_seq_len)
      self._source = "in-memory model"
    else:

      model, config, loaded_step = load_for_inference(os.fspath(checkpoint), _as_int(step, "step"))
      if tokenizer is None:
        tokenizer = config.data.tokenizer
      default_len = int(config.eval.max_len or config.data.seq_len)
      self._source = f"{os.path.abspath(checkpoint)} step {loaded_step}"
    if isinstance(tokenizer, (str, os.PathLike)):
      tokenizer = get_tokenizer(os.fspath(tokenizer))
    vocab = int(model.cfg.vocab_size)
    if tokenizer.vocab_size > vocab:
      raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                       f"{vocab}: use the tokenizer the model was trained with")


    self._model = model
    self._tok = tokenizer
    self._scorer = ModelScorer(model)
    self._max_length = _as_int(max_len, "max_len") or default_len
    if self._max_length < 2:
      raise ValueError(f"max_len must be at least 2, got {self._max_length}")
    self._batch_size = _batch_size(batch_size)
    self._max_gen_toks = _as_int(max_gen_toks, "max_gen_toks") or DEFAULT_MAX_GEN_TOKS
    self._batch_tokens = _as_int(batch_tokens, "batch_tokens")
    self._device = "jax"
    logger.info("attn_jax: %s, max_length %d, batch_size %d, tokenizer %s", self._source,
                self._max_length, self._batch_size, self.tokenizer_name)

  @classmethod
  def from_model(cls, model, tokenizer: str | Tokenizer, *, max_len: int | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, max_gen_toks: int | None = None,
                 batch_tokens: int | None = None) -> "AttnJaxLM":
    """Wraps an in-memory attn_jax `Decoder` (nnx module) and a tokenizer (an
    `attn_jax.data.tokenizer` object or a path / "bytes"). max_len defaults to the model's
    `cfg.max_seq_len`."""
    return cls(model=model, tokenizer=tokenizer, max_len=max_len, batch_size=batch_size,
               max_gen_toks=max_gen_toks, batch_tokens=batch_tokens)

  # -------------------------------------------------------------------------------------------
  # what TemplateLM needs

  @property
  def eot_token_id(self) -> int:
    return int(self._tok.eos_id)

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self._tok, "path", type(self._tok).__name__))

  @property
  def model(self):
    return self._model

  @property
  def attn_jax_tokenizer(self) -> Tokenizer:
    return self._tok

  @property
  def scorer(self):
    """The `ModelScorer` every log-likelihood goes through (reuse it to share compilations)."""
    return self._scorer

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    """attn_jax tokenizers add no special tokens (no BOS), whatever `add_special_tokens` says."""
    del add_special_tokens, kwargs
    return list(self._tok.encode(string))

  def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
    del kwargs
    return self._tok.decode([int(t) for t in tokens])

  def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    if not pairs:
      return []
    return harness.loglikelihood_tokens(pairs, self._scorer, max_len=self._max_length,
                                        batch_size=self._batch_size,
                                        batch_tokens=self._batch_tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            **kwargs) -> list[tuple[float, bool]]:
    """requests: [((context, continuation) | None, context_ids, continuation_ids)]."""
    del disable_tqdm, kwargs
    pairs = []
    for key, ctx, cont in requests:
      if not ctx:
        raise ValueError(f"request {key!r}: the context encodes to zero tokens (lm-eval gives "
                         "an empty context the prefix token; a whitespace-only one has none)")
      pairs.append((list(ctx), list(cont)))
    results = self._score(pairs)
    for (key, _, _), res in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, res)
    return results

  # -------------------------------------------------------------------------------------------
  # rolling log-likelihood (perplexity tasks)

  def rolling_windows(self, string: str) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows of `string`: (context_ids, continuation_ids)."""
    windows = _lm_utils.get_rolling_token_windows(
        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
        max_seq_len=self._max_length, context_len=1)
    return [_lm_utils.make_disjoint_window(w) for w in windows]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    strings = [req.args[0] for req in requests]
    owner, pairs = [], []
    for i, s in enumerate(strings):
      for ctx, cont in self.rolling_windows(s):
        owner.append(i)
        pairs.append((list(ctx), list(cont)))
    totals = [0.0] * len(strings)
    for i, (ll, _) in zip(owner, self._score(pairs)):
      totals[i] += ll
    for s, total in zip(strings, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", (s,), total)
    return totals

  # -------------------------------------------------------------------------------------------
  # greedy generation

  def _gen_plan(self, context: str, gen_kwargs: dict | None) -> tuple[list[int], int, list[str]]:
    kw = dict(gen_kwargs or {})
    unknown = set(kw) - _GREEDY_GEN_KWARGS
    if unknown:
      raise ValueError(f"attn_jax generate_until supports greedy decoding only; unsupported "
                       f"generation arguments {sorted(unknown)} (supported: "
                       f"{sorted(_GREEDY_GEN_KWARGS)})")
    if kw.get("do_sample"):
      raise ValueError("attn_jax generate_until supports greedy decoding only: do_sample=True "
                       "is not supported")
    if float(kw.get("temperature", 0.0) or 0.0) > 0.0:
      raise ValueError(f"attn_jax generate_until supports greedy decoding only: temperature="
                       f"{kw['temperature']} is not supported (use 0)")
    if int(kw.get("num_beams", 1) or 1) != 1:
      raise ValueError("attn_jax generate_until supports greedy decoding only: num_beams="
                       f"{kw['num_beams']} is not supported")
    until = kw.get("until") or []
    if isinstance(until, str):
      until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
      raise ValueError(f"'until' should be a string or a list of strings, got {until!r}")
    max_gen = _as_int(kw.get("max_gen_toks"), "max_gen_toks") or self._max_gen_toks
    if not 1 <= max_gen < self._max_length:
      raise ValueError(f"max_gen_toks={max_gen} must be in [1, max_len={self._max_length})")
    ctx = self.tok_encode(context) if context else []
    ctx = ctx[-(self._max_length - max_gen):] or [self.prefix_token_id]
    return ctx, max_gen, [u for u in until if u]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy continuations in batches of batch_size: prompts of any lengths share a batch
    (right-padded to a power-of-two bucket, per-row `lengths`), so there is one compilation
    per (bucket, max_gen_toks, rows) rather than per prompt length."""
    del disable_tqdm

    args = [req.args for req in requests]
    plans = [self._gen_plan(context, gen_kwargs) for context, gen_kwargs in args]
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i, (_, max_gen, _) in enumerate(plans):
      groups[max_gen].append(i)
    out: list[str | None] = [None] * len(plans)
    eos = self.eot_token_id
    for max_gen, idx in sorted(groups.items(), reverse=True):
      idx = sorted(idx, key=lambda i: -len(plans[i][0]))   # similar lengths together
      for lo in range(0, len(idx), self._batch_size):
        chunk = idx[lo:lo + self._batch_size]
        lengths = [len(plans[i][0]) for i in chunk]
        width = min(1 << (max(lengths) - 1).bit_length(), self._max_length - max_gen)
        prompt = np.zeros((len(chunk), width), np.int32)
        for row, i in enumerate(chunk):
          prompt[row, :lengths[row]] = plans[i][0]
        tokens = np.asarray(decode.generate(self._model, prompt, lengths=lengths,
                                            max_new_tokens=max_gen, eos_id=eos))
        for row, i in enumerate(chunk):
          new = tokens[row, lengths[row]:lengths[row] + max_gen].tolist()
          if eos in new:
            new = new[:new.index(eos)]
          text = self.tok_decode(new)
          for stop in plans[i][2]:
            text = text.split(stop, 1)[0]
          out[i] = text
          self.cache_hook.add_partial("generate_until", args[i], text)
    return out  # type: ignore[return-value]


def register() -> type[AttnJaxLM]:
  """Registers `AttnJaxLM` as lm-eval's model `attn_jax` (idempotent; done on import). Also
  makes sure lm-eval's own models stay available by name (its registry fills itself lazily only
  while empty)."""
  import lm_eval.models  # noqa: F401  (lazy placeholders for hf, vllm, ...)

  reg = _registry.model_registry
  if MODEL_NAME in reg:
    current = reg.get(MODEL_NAME)
    if current is AttnJaxLM:
      return AttnJaxLM
    same = (getattr(current, "__module__", None), getattr(current, "__qualname__", None)) == (
        AttnJaxLM.__module__, AttnJaxLM.__qualname__)
    objs = getattr(reg, "_objs", None)
    if not same or not isinstance(objs, dict):
      raise ValueError(f"lm-eval model name {MODEL_NAME!r} is already taken by {current!r}")
    objs[MODEL_NAME] = AttnJaxLM  # this module was reloaded: register the new class
    return AttnJaxLM
  _registry.register_model(MODEL_NAME)(AttnJaxLM)
  return AttnJaxLM


def main(argv: Sequence[str] | None = None) -> None:
  """`python -m attn_jax.eval.lm_eval_adapter ARGS`: lm-eval's CLI with `attn_jax` registered
  (and `--model attn_jax` added when no model is named)."""
  register()
  from lm_eval.__main__ import cli_evaluate

  argv = list(sys.argv[1:] if argv is None else argv)
  names_model = any(a in ("--model", "-M") or a.startswith("--model=") for a in argv)
  if (argv and not names_model and argv[0] not in ("ls", "validate")
      and not set(argv) & {"-h", "--help"}):
    argv += ["--model", MODEL_NAME]
  saved = sys.argv
  sys.argv = ["attn-jax-lm-eval", *argv]  # lm-eval's CLI parses sys.argv itself
  try:
    cli_evaluate()
  finally:
    sys.argv = saved


if __name__ == "__main__":
  # run through the importable module, so that the class registered is the one others import
  from attn_jax.eval import lm_eval_adapter as _adapter

  _adapter.main()
else:
  register()
