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
the jitted logits_fn compiles once per bucket. The continuation tokens of a batch are
flattened into one list of rows (padded to a few sizes), and only those rows go through the LM
head and log-softmax, in cache-sized blocks; that kernel compiles once per (bucket, row count).
Results come back in the request order.

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
from typing import Callable, Mapping, NamedTuple, Sequence

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


class ScorerFns(NamedTuple):
  """The pure functions behind a logits_fn: `logits(state, tokens [B, L]) -> [B, L, V]`, and
  optionally `hidden(state, tokens) -> [B, L, D]` and `head(state, h [..., D]) -> [..., V]`."""
  logits: Callable
  hidden: Callable | None = None
  head: Callable | None = None


def scorer_fns(logits_fn: LogitsFn) -> ScorerFns:
  """A scorer with an explicit state (`attn_jax.eval.run.ModelScorer`: attributes `state`,
  `logits_apply`, and optionally `hidden_apply`/`head_apply`) hands over its pure functions, so
  the evaluators' jitted code takes the state as an argument: new parameters (`set_state`)
  reuse every compilation and are never baked into a program as constants. Any other callable
  `tokens -> logits` is wrapped (its closure is then the caller's business), through a weak
  reference when possible so that the memo below does not keep it alive."""
  if hasattr(logits_fn, "logits_apply"):
    return ScorerFns(logits_fn.logits_apply, getattr(logits_fn, "hidden_apply", None),
                     getattr(logits_fn, "head_apply", None))
  try:
    ref = weakref.ref(logits_fn)
  except TypeError:
    ref = lambda: logits_fn
  return ScorerFns(lambda state, tokens: ref()(tokens))


def scorer_state(logits_fn: LogitsFn):
  """The state argument for the functions of `scorer_fns(logits_fn)`."""
  return logits_fn.state if hasattr(logits_fn, "logits_apply") else ()


def per_logits_fn_cache(build: Callable[[ScorerFns], Callable]
                        ) -> Callable[[LogitsFn], Callable]:
  """Memoises `build(scorer_fns(logits_fn))` (jitted code taking the scorer's state as its
  first argument) per logits_fn object, so later calls with the same logits_fn reuse its
  compilations, without keeping logits_fn alive: the entry disappears with logits_fn."""
  cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  @functools.wraps(build)
  def get(logits_fn: LogitsFn) -> Callable:
    try:
      return cache[logits_fn]
    except KeyError:
      pass
    except TypeError:  # not weak-referenceable or not hashable: no caching
      return build(scorer_fns(logits_fn))
    built = build(scorer_fns(logits_fn))
    cache[logits_fn] = built
    return built

  return get


def _identity_head(state, x):
  del state
  return x


@per_logits_fn_cache
def _jitted_forward(fns: ScorerFns):
  """(forward, head): `forward(state, tokens [B, L])` runs the model (compiles once per
  [rows, bucket] shape); `head(state, x [R, ...])` maps the forward's rows to logits [R, V].

  With `hidden` and `head` (as `attn_jax.eval.run.ModelScorer` offers), the LM head is applied
  to the continuation rows only: with a 50k vocabulary the head over every position dominates
  the cost of a small model.
  """
  if fns.hidden is not None and fns.head is not None:
    return jax.jit(fns.hidden), fns.head  # [B, L, D]
  return jax.jit(fns.logits), _identity_head  # [B, L, V]


# Rows of the head + softmax computed at once: a [64, 50k] float32 block (13 MB) stays in cache,
# where the whole [R, V] logits would stream through memory several times (max, exp-sum, target,
# argmax); much smaller blocks pay the per-block overhead instead (on CPU, 32-64-row blocks
# ran faster than both the whole [R, V] block and 8-row blocks).
_ROW_BLOCK = 64


def _row_block(n_rows: int) -> int:
  if n_rows <= _ROW_BLOCK:
    return n_rows
  for b in (_ROW_BLOCK, 32, 16, 8):
    if n_rows % b == 0:
      return b
  return 1


@functools.partial(jax.jit, static_argnums=(0, 7))
def _score_rows(head, state, out, row, pos, target, valid, n_requests):
  """Continuation log-likelihood and greedy match per request.

  out: the forward's [B, L, D] hidden states or [B, L, V] logits. The continuation tokens of
  all requests of the batch come flattened: row, pos, target: int32 [R] (batch row, input
  position whose logits predict `target`), valid: bool [R] (False = padding). Only these R
  rows go through the (head and) log-softmax, `_row_block` rows at a time; the context rows are
  never needed. Returns ll [n_requests] (sum over the request's tokens), is_greedy
  [n_requests] (argmax == target at every token; ties go to the lowest id, as argmax does).
  """
  n = row.shape[0]
  blk = _row_block(n)
  x = out[row, pos]  # [R, D] or [R, V]

  def block(args):
    xb, tb = args  # [blk, ...], [blk]
    logits = head(state, xb).astype(jnp.float32)  # [blk, V]
    top = jnp.max(logits, axis=-1)  # [blk]
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
    picked = jnp.take_along_axis(logits, tb[:, None], axis=-1)[:, 0]
    return picked - lse, jnp.argmax(logits, axis=-1) == tb

  lp, hit = jax.lax.map(block, (x.reshape(n // blk, blk, *x.shape[1:]),
                                target.reshape(n // blk, blk)))
  lp, hit = lp.reshape(n), hit.reshape(n)
  ll = jax.ops.segment_sum(jnp.where(valid, lp, 0.0), row, num_segments=n_requests)
  miss = jax.ops.segment_sum(jnp.where(valid, ~hit, False).astype(jnp.int32), row,
                             num_segments=n_requests)
  return ll, miss == 0


def _prepare(ctx_ids: list[int], cont_ids: list[int], max_len: int):
  if not cont_ids:
    raise ValueError("continuation encodes to zero tokens")
  if len(cont_ids) > max_len:
    raise ValueError(f"continuation of {len(cont_ids)} tokens exceeds max_len={max_len}")
  seq = (ctx_ids + cont_ids)[-(max_len + 1):]
  return seq[:-1], cont_ids, len(cont_ids)  # input tokens, continuation, its length


def _padded_rows(n: int) -> int:
  """Flattened continuation rows padded to 8, 16, 24, 32, 48, 64, 96, 128, 192, ... (powers of
  two and their 1.5x midpoints from 16): at most ~1/3 padding, two kernel shapes per octave."""
  if n <= 8:
    return 8
  p = 16
  while True:
    if n <= p:
      return p
    if n <= p * 3 // 2:
      return p * 3 // 2
    p *= 2


def loglikelihood_tokens(pairs: Sequence[tuple[list[int], list[int]]], logits_fn: LogitsFn, *,
                         max_len: int, batch_size: int, buckets: Sequence[int] | None = None,
                         batch_tokens: int | None = None) -> list[tuple[float, bool]]:
  """Scores already-tokenized (context_ids, continuation_ids) pairs; see the module docstring.

  A batch of bucket width W has batch_size rows, or min(batch_size, batch_tokens // W) (at
  least 1) when `batch_tokens` is given, which bounds the [rows, W, ...] activations of long
  buckets.
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
  forward, head = _jitted_forward(logits_fn)
  state = scorer_state(logits_fn)
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
    tokens = np.zeros((rows, width), np.int32)  # [B, Lb]; padding stays 0
    # the continuation tokens of the whole batch, flattened (no per-request padding: with a
    # 50k vocabulary each padded row would cost a full LM-head row and softmax)
    n_flat = _padded_rows(sum(prepared[i][2] for i in chunk))
    row = np.zeros(n_flat, np.int32)  # [R]
    pos = np.zeros(n_flat, np.int32)
    target = np.zeros(n_flat, np.int32)
    valid = np.zeros(n_flat, bool)
    at = 0
    for r, i in enumerate(chunk):
      inp, cont, n_cont = prepared[i]
      tokens[r, :len(inp)] = inp
      sl = slice(at, at + n_cont)
      row[sl] = r
      pos[sl] = np.arange(len(inp) - n_cont, len(inp))
      target[sl] = cont
      valid[sl] = True
      at += n_cont
    ll, greedy = _score_rows(head, state, forward(state, tokens), row, pos, target,
                             valid, rows)
    pending.append((chunk, ll, greedy))
    if len(pending) % 8 == 0:  # bound how far dispatch runs ahead (each batch holds activations)
      jax.block_until_ready(pending[-8][1])
  results: list[tuple[float, bool] | None] = [None] * len(prepared)
  for chunk, ll, greedy in pending:
    ll, greedy = np.asarray(ll), np.asarray(greedy)
    for r, i in enumerate(chunk):
      results[i] = (float(ll[r]), bool(greedy[r]))
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


def choice_picks(doc: tasks_lib.MultipleChoiceDoc, lls: Sequence[float]) -> dict[str, int]:
  """The choice a multiple-choice document's log-likelihoods pick: by the sum ("acc") and per
  character of the choice string ("acc_norm", the harness' length normalisation)."""
  lls = np.asarray(lls, np.float64)
  lengths = np.array([float(len(c)) for c in doc.choices])
  with np.errstate(divide="ignore", invalid="ignore"):
    return {"acc": int(np.argmax(lls)), "acc_norm": int(np.argmax(lls / lengths))}


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
      picks = choice_picks(doc, [r[0] for r in results[pos:pos + n]])
      pos += n
      for metric, pick in picks.items():
        per_doc.setdefault(metric, []).append(float(pick == doc.gold))
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


def task_metrics(name: str, per_doc: Mapping[str, Sequence], *,
                 bootstrap_iters: int | None = 1000) -> dict:
  """Task `name`'s own metrics (`TaskSpec.metrics`) from `score_docs`' per-document scores:
  accuracies are means, perplexity exp(-mean ll); each with `<metric>_stderr` unless
  `bootstrap_iters` is None."""
  out: dict = {}
  for metric in tasks_lib.get_task(name).metrics:
    if metric == "perplexity":
      lls = np.asarray(per_doc["ll"])
      out["perplexity"] = float(_perplexity(lls))
      if bootstrap_iters is not None:
        out["perplexity_stderr"] = bootstrap_stderr(lls, _perplexity, iters=bootstrap_iters)
    else:
      out[metric] = float(np.mean(per_doc[metric]))
      if bootstrap_iters is not None:
        out[f"{metric}_stderr"] = mean_stderr(per_doc[metric])
  return out


def evaluate_task(name: str, docs: Sequence[tasks_lib.Doc], logits_fn: LogitsFn,
                  tokenizer: Tokenizer, *, max_len: int, batch_size: int,
                  buckets: Sequence[int] | None = None, batch_tokens: int | None = None,
                  bootstrap_iters: int = 1000) -> dict:
  """Scores `docs` of task `name`; returns its metrics, each accuracy with `<metric>_stderr`,
  plus n_docs, n_requests, seconds, examples_per_s (docs/s) and requests_per_s."""
  tasks_lib.get_task(name)   # an unknown task name is refused before any scoring
  if not docs:
    raise ValueError(f"task {name!r}: no documents")
  t0 = time.perf_counter()
  requests = doc_requests(docs)
  results = loglikelihood(requests, logits_fn, tokenizer, max_len=max_len,
                          batch_size=batch_size, buckets=buckets, batch_tokens=batch_tokens)
  seconds = time.perf_counter() - t0
  out = task_metrics(name, score_docs(docs, results), bootstrap_iters=bootstrap_iters)
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
    "LogitsFn", "Request", "ScorerFns", "scorer_fns", "scorer_state", "per_logits_fn_cache",
    "encode_pairs", "default_buckets", "bucket_for",
    "loglikelihood_tokens", "loglikelihood", "mean_stderr", "bootstrap_stderr", "score_docs",
    "doc_requests", "choice_picks", "task_metrics", "evaluate_task", "evaluate",
]
