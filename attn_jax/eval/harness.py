"""Log-likelihood scoring of (context, continuation) requests, as lm-evaluation-harness does it.

For a causal LM with `logits_fn(tokens[B, L]) -> logits[B, L, V]` (logits at t predict t+1):

  tokenization  trailing whitespace of the context moves to the front of the continuation;
                whole = enc(context + continuation), ctx = enc(context),
                cont = whole[len(ctx):] (so BPE merges across the boundary follow the joint
                encoding); an empty context is replaced by [eos].
  truncation    seq = (ctx + cont)[-(max_len + 1):], input = seq[:-1], targets = seq[1:];
                the continuation is the last len(cont) targets (len(cont) <= max_len).
  score         ll = sum_t log softmax(logits_t)[target_t] over the continuation positions;
                is_greedy = argmax(logits_t) == target_t at every continuation position.

Requests are grouped into a few fixed lengths (buckets: powers of two up to max_len) and
fixed-size batches, right-padded (padding after a causal row changes none of its logits), so
the jitted logits_fn compiles once per bucket; a small scoring kernel (softmax over only the
continuation rows) compiles once per (bucket, continuation width 4/8/16/...). Results come
back in the request order.

Aggregation follows the harness: accuracies are means with the sample standard error
sqrt(var_ddof1 / n) (`mean_stderr`); perplexity = exp(-mean ll) with a bootstrap standard error
(1000 resamples by default, seeded; the harness uses 100000).
"""

from __future__ import annotations

import functools
import math
import os
import time
import weakref
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.data.tokenizer import Tokenizer
from attn_jax.eval import tasks as tasks_lib

LogitsFn = Callable[[jax.Array], jax.Array]  # int32 [B, L] -> float [B, L, V]
Request = tuple[str, str]


# ---------------------------------------------------------------------------------------------
# tokenization


def _encode_many(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
  if hasattr(tokenizer, "encode_batch"):
    return [list(ids) for ids in tokenizer.encode_batch(list(texts))]
  return [list(tokenizer.encode(t)) for t in texts]


def encode_pairs(requests: Sequence[Request],
                 tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
  """(context, continuation) strings -> (context_ids, continuation_ids), harness convention."""
  plans = []  # (context, whole) strings, or (None, continuation) for an empty context
  for context, continuation in requests:
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
      continuation = context[-n_spaces:] + continuation
      context = context[:-n_spaces]
    plans.append((context, context + continuation) if context else (None, continuation))
  unique = sorted({s for plan in plans for s in plan if s is not None})
  ids = dict(zip(unique, _encode_many(tokenizer, unique)))
  out = []
  for context, whole in plans:
    whole_ids = ids[whole]
    if context is None:  # the harness conditions an empty context on the EOS/BOS token
      if whole_ids and whole_ids[0] == tokenizer.eos_id:
        out.append((whole_ids[:1], whole_ids[1:]))
      else:
        out.append(([tokenizer.eos_id], whole_ids))
    else:
      ctx_ids = ids[context]
      out.append((ctx_ids, whole_ids[len(ctx_ids):]))
  return out


# ---------------------------------------------------------------------------------------------
# bucketed, batched scoring


def default_buckets(max_len: int, min_len: int = 32,
                    steps_per_octave: int = 1) -> tuple[int, ...]:
  """Bucket lengths below `max_len`, then `max_len` itself: powers of two from `min_len`
  (steps_per_octave=1), or with 1.5x midpoints too (=2: 32, 48, 64, 96, ...), which pads
  ~15% instead of ~30% of the positions at the cost of about twice the compilations."""
  if max_len < 1:
    raise ValueError(f"max_len must be positive, got {max_len}")
  if steps_per_octave not in (1, 2):
    raise ValueError(f"steps_per_octave must be 1 or 2, got {steps_per_octave}")
  out, b = [], min_len
  while b < max_len:
    out.append(b)
    if steps_per_octave == 2 and b * 3 // 2 < max_len and b % 2 == 0:
      out.append(b * 3 // 2)
    b *= 2
  out.append(max_len)
  return tuple(out)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if length <= b:
      return b
  raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")


class _WeakScorer:
  """Calls (and exposes the attributes of, e.g. `hidden`/`head`) a weakly referenced scorer."""

  def __init__(self, ref):
    self._ref = ref

  def __call__(self, tokens):
    return self._ref()(tokens)

  def __getattr__(self, name):
    return getattr(self._ref(), name)


def per_logits_fn_cache(build: Callable[[LogitsFn], Callable]
                        ) -> Callable[[LogitsFn], Callable]:
  """Memoises `build(logits_fn)` (a jitted wrapper) per logits_fn object, so later calls with
  the same logits_fn reuse its compilations, without keeping logits_fn (and the parameters it
  closes over) alive: the entry holds only a weak reference and disappears with logits_fn."""
  cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  @functools.wraps(build)
  def get(logits_fn: LogitsFn) -> Callable:
    try:
      return cache[logits_fn]
    except KeyError:
      pass
    except TypeError:  # not weak-referenceable or not hashable: no caching
      return build(logits_fn)
    built = build(_WeakScorer(weakref.ref(logits_fn)))
    cache[logits_fn] = built
    return built

  return get


@per_logits_fn_cache
def _jitted_forward(logits_fn: LogitsFn):
  """(forward, select) for one logits_fn. `forward(tokens [B, L])` runs the model (compiles once
  per [rows, bucket] shape); `select(out, positions [B, C])` gives the logits at the C
  continuation positions [B, C, V] (a small kernel, compiled per (bucket, C)).

  A scorer that also offers `hidden(tokens) -> [B, L, D]` and `head(h) -> [..., V]` (as
  `attn_jax.eval.run.ModelScorer` does) has its LM head applied to the C selected rows only:
  with a 50k vocabulary the head over every position dominates the cost of a small model.
  """
  if hasattr(logits_fn, "hidden") and hasattr(logits_fn, "head"):
    forward = jax.jit(lambda tokens: logits_fn.hidden(tokens))  # [B, L, D]
    head = lambda h: logits_fn.head(h)  # late lookup: keep only the weak reference
  else:
    forward = jax.jit(lambda tokens: logits_fn(tokens))  # [B, L, V]
    head = lambda x: x

  def select(out, positions):
    return head(jnp.take_along_axis(out, positions[..., None], axis=1))  # [B, C, V]
  return forward, select


@functools.partial(jax.jit, static_argnums=0)
def _score_positions(select, out, positions, targets, mask):
  """Continuation log-likelihood and greedy match.

  out: the forward's [B, L, D] hidden states or [B, L, V] logits; positions, targets: int32
  [B, C] (input positions of the continuation and the tokens they must predict); mask: bool
  [B, C]. Returns ll [B], is_greedy [B]. Only the C selected rows go through the (head and)
  softmax: the context rows are never needed.
  """
  sel = select(out, positions)
  sel = sel.astype(jnp.float32)  # [B, C, V]
  top = jnp.max(sel, axis=-1, keepdims=True)  # [B, C, 1]
  lse = top[..., 0] + jnp.log(jnp.sum(jnp.exp(sel - top), axis=-1))  # [B, C]
  picked = jnp.take_along_axis(sel, targets[..., None], axis=-1)[..., 0]  # [B, C]
  ll = jnp.sum(jnp.where(mask, picked - lse, 0.0), axis=-1)  # [B]
  hit = jnp.argmax(sel, axis=-1) == targets  # [B, C]
  greedy = jnp.all(jnp.where(mask, hit, True), axis=-1)  # [B]
  return ll, greedy


def _prepare(ctx_ids: list[int], cont_ids: list[int], max_len: int):
  if not cont_ids:
    raise ValueError("continuation encodes to zero tokens")
  if len(cont_ids) > max_len:
    raise ValueError(f"continuation of {len(cont_ids)} tokens exceeds max_len={max_len}")
  seq = (ctx_ids + cont_ids)[-(max_len + 1):]
  return seq[:-1], cont_ids, len(cont_ids)  # input tokens, continuation, its length


def _pow2_at_least(n: int, lo: int = 1) -> int:
  p = lo
  while p < n:
    p *= 2
  return p


def loglikelihood_tokens(pairs: Sequence[tuple[list[int], list[int]]], logits_fn: LogitsFn, *,
                         max_len: int, batch_size: int, buckets: Sequence[int] | None = None,
                         batch_tokens: int | None = None) -> list[tuple[float, bool]]:
  """Scores already-tokenized (context_ids, continuation_ids) pairs; see the module docstring.

  A batch of bucket width W has batch_size rows, or min(batch_size, batch_tokens // W) (at
  least 1) when `batch_tokens` is given, which bounds the [rows, W, V] logits of long buckets.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  buckets = tuple(sorted(buckets)) if buckets else default_buckets(max_len)
  if max(buckets) < max_len:
    raise ValueError(f"largest bucket {max(buckets)} < max_len {max_len}")
  prepared = [_prepare(c, k, max_len) for c, k in pairs]
  lengths = [len(p[0]) for p in prepared]
  # longest first (a too-large batch fails at once), grouped by bucket
  order = sorted(range(len(prepared)), key=lambda i: (-bucket_for(lengths[i], buckets),
                                                       -lengths[i], i))
  forward, select = _jitted_forward(logits_fn)
  pending = []  # (indices, device ll, device greedy)
  start = 0
  while start < len(order):
    width = bucket_for(lengths[order[start]], buckets)
    rows = batch_size if batch_tokens is None else max(1, min(batch_size, batch_tokens // width))
    chunk = [order[start]]
    while (len(chunk) < rows and start + len(chunk) < len(order)
           and bucket_for(lengths[order[start + len(chunk)]], buckets) == width):
      chunk.append(order[start + len(chunk)])
    start += len(chunk)
    # continuation rows scored: 4, 8, 16, ... (few shapes, little padding: with a 50k vocabulary
    # each padded row costs a full LM-head row and softmax), at most the bucket width
    n_sel = min(width, _pow2_at_least(max(prepared[i][2] for i in chunk), 4))
    tokens = np.zeros((rows, width), np.int32)  # [B, Lb]; padding stays 0
    positions = np.zeros((rows, n_sel), np.int32)  # [B, C]
    targets = np.zeros((rows, n_sel), np.int32)  # [B, C]
    mask = np.zeros((rows, n_sel), bool)  # [B, C]
    for row, i in enumerate(chunk):
      inp, cont, n_cont = prepared[i]
      tokens[row, :len(inp)] = inp
      positions[row, :n_cont] = np.arange(len(inp) - n_cont, len(inp))
      targets[row, :n_cont] = cont
      mask[row, :n_cont] = True
    ll, greedy = _score_positions(select, forward(tokens), positions, targets, mask)
    pending.append((chunk, ll, greedy))
    if len(pending) % 8 == 0:  # bound how far dispatch runs ahead (each batch holds logits)
      jax.block_until_ready(pending[-8][1])
  results: list[tuple[float, bool] | None] = [None] * len(prepared)
  for chunk, ll, greedy in pending:
    ll, greedy = np.asarray(ll), np.asarray(greedy)
    for row, i in enumerate(chunk):
      results[i] = (float(ll[row]), bool(greedy[row]))
  return results  # type: ignore[return-value]


def loglikelihood(requests: Sequence[Request], logits_fn: LogitsFn, tokenizer: Tokenizer, *,
                  max_len: int, batch_size: int, buckets: Sequence[int] | None = None,
                  batch_tokens: int | None = None) -> list[tuple[float, bool]]:
  """(context, continuation) strings -> [(sum log p(continuation | context), is_greedy)]."""
  pairs = encode_pairs(requests, tokenizer)
  return loglikelihood_tokens(pairs, logits_fn, max_len=max_len, batch_size=batch_size,
                              buckets=buckets, batch_tokens=batch_tokens)


# ---------------------------------------------------------------------------------------------
# metrics


def mean_stderr(values: Sequence[float]) -> float:
  """Sample standard error of the mean, sqrt(var(ddof=1) / n), as the harness computes it."""
  x = np.asarray(values, np.float64)
  if x.size < 2:
    return float("nan")
  return float(np.std(x, ddof=1) / math.sqrt(x.size))


def bootstrap_stderr(values: Sequence[float], statistic: Callable[[np.ndarray], np.ndarray],
                     iters: int = 1000, seed: int = 0) -> float:
  """Standard deviation of `statistic` (vectorised over axis -1) over bootstrap resamples."""
  x = np.asarray(values, np.float64)
  if x.size < 2 or iters < 2:
    return float("nan")
  rng = np.random.default_rng(seed)
  stats = []
  for lo in range(0, iters, 100):
    idx = rng.integers(0, x.size, size=(min(100, iters - lo), x.size))
    stats.append(statistic(x[idx]))
  return float(np.std(np.concatenate(stats), ddof=1))


def _perplexity(lls: np.ndarray) -> np.ndarray:
  return np.exp(-np.mean(lls, axis=-1))


def score_docs(docs: Sequence[tasks_lib.Doc],
               results: Sequence[tuple[float, bool]]) -> dict[str, list[float]]:
  """Per-doc metric values from the flat results of `doc_requests(docs)`."""
  per_doc: dict[str, list[float]] = {}
  pos = 0
  for doc in docs:
    if isinstance(doc, tasks_lib.LoglikelihoodDoc):
      ll, greedy = results[pos]
      pos += 1
      per_doc.setdefault("acc", []).append(float(greedy))
      per_doc.setdefault("ll", []).append(ll)
    else:
      n = len(doc.requests)
      lls = np.array([r[0] for r in results[pos:pos + n]])
      pos += n
      lengths = np.array([float(len(c)) for c in doc.choices])
      per_doc.setdefault("acc", []).append(float(np.argmax(lls) == doc.gold))
      with np.errstate(divide="ignore", invalid="ignore"):
        per_doc.setdefault("acc_norm", []).append(float(np.argmax(lls / lengths) == doc.gold))
  if pos != len(results):
    raise ValueError(f"{len(results)} results for {pos} requests")
  return per_doc


def doc_requests(docs: Sequence[tasks_lib.Doc]) -> list[Request]:
  out: list[Request] = []
  for doc in docs:
    if isinstance(doc, tasks_lib.LoglikelihoodDoc):
      out.append((doc.context, doc.continuation))
    else:
      out.extend(doc.requests)
  return out


def evaluate_task(name: str, docs: Sequence[tasks_lib.Doc], logits_fn: LogitsFn,
                  tokenizer: Tokenizer, *, max_len: int, batch_size: int,
                  buckets: Sequence[int] | None = None, batch_tokens: int | None = None,
                  bootstrap_iters: int = 1000) -> dict:
  """Scores `docs` of task `name`; returns its metrics, each accuracy with `<metric>_stderr`,
  plus n_docs, n_requests, seconds, examples_per_s (docs/s) and requests_per_s."""
  spec = tasks_lib.get_task(name)
  if not docs:
    raise ValueError(f"task {name!r}: no documents")
  t0 = time.perf_counter()
  requests = doc_requests(docs)
  results = loglikelihood(requests, logits_fn, tokenizer, max_len=max_len,
                          batch_size=batch_size, buckets=buckets, batch_tokens=batch_tokens)
  seconds = time.perf_counter() - t0
  per_doc = score_docs(docs, results)
  out: dict = {}
  for metric in spec.metrics:
    if metric == "perplexity":
      lls = np.asarray(per_doc["ll"])
      out["perplexity"] = float(_perplexity(lls))
      out["perplexity_stderr"] = bootstrap_stderr(lls, _perplexity, iters=bootstrap_iters)
    else:
      out[metric] = float(np.mean(per_doc[metric]))
      out[f"{metric}_stderr"] = mean_stderr(per_doc[metric])
  out.update(n_docs=len(docs), n_requests=len(requests), seconds=seconds,
             examples_per_s=len(docs) / max(seconds, 1e-9),
             requests_per_s=len(requests) / max(seconds, 1e-9))
  return out


def evaluate(tasks: Sequence[str], logits_fn: LogitsFn, tokenizer: Tokenizer,
             data_paths: Mapping[str, str | os.PathLike | Sequence[str]], *, max_len: int,
             batch_size: int, limit: int | None = None, buckets: Sequence[int] | None = None,
             batch_tokens: int | None = None, bootstrap_iters: int = 1000) -> dict:
  """Loads and scores each task. `data_paths[task]` is its file (see `tasks.shared_data_paths`);
  `limit` keeps the first `limit` docs of each task (as the harness's --limit does).

  Returns {"results": {task: metrics}, "config": {...}} for `report.write_json/markdown`.
  """
  results = {}
  for name in tasks:
    if name not in data_paths:
      raise ValueError(f"no data path for task {name!r} (have {sorted(data_paths)})")
    docs = tasks_lib.load_task(name, data_paths[name])
    if limit is not None:
      docs = docs[:limit]
    results[name] = evaluate_task(name, docs, logits_fn, tokenizer, max_len=max_len,
                                  batch_size=batch_size, buckets=buckets,
                                  batch_tokens=batch_tokens, bootstrap_iters=bootstrap_iters)
  config = dict(tasks=list(tasks), max_len=max_len, batch_size=batch_size,
                batch_tokens=batch_tokens, limit=limit,
                buckets=list(buckets) if buckets else list(default_buckets(max_len)),
                vocab_size=int(tokenizer.vocab_size),
                tokenizer=getattr(tokenizer, "path", type(tokenizer).__name__))
  return {"results": results, "config": config}


__all__ = [
    "LogitsFn", "Request", "per_logits_fn_cache", "encode_pairs", "default_buckets",
    "bucket_for",
    "loglikelihood_tokens", "loglikelihood", "mean_stderr", "bootstrap_stderr", "score_docs",
    "doc_requests", "evaluate_task", "evaluate",
]
