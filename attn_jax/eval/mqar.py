"""Multi-query associative recall (MQAR) as an eval: accuracy of the argmax prediction at the
query positions (weight > 0) of MQAR examples {inputs, targets, weights}.

  acc         = #(argmax logits_t == targets_t, weights_t > 0) / #(weights_t > 0)
  example_acc = fraction of examples whose every weighted position is right

Examples may be single sequences ([L] arrays) or batches ([B, L]); either way they are
regrouped into [batch_size, L] batches per sequence length (the last one padded with weight-0
rows), so the jitted scorer compiles once per distinct L. MQAR: Arora et al., "Zoology:
Measuring and Improving Recall in Efficient Language Models" (2023).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.eval.harness import LogitsFn, ScorerFns, per_logits_fn_cache, scorer_state


@per_logits_fn_cache
def _jitted_recall(fns: ScorerFns):
  def recall(state, inputs, targets, mask):
    # inputs, targets: int32 [B, L]; mask: bool [B, L]
    pred = jnp.argmax(fns.logits(state, inputs), axis=-1)  # [B, L]
    hit = (pred == targets) & mask  # [B, L]
    return hit.sum(-1), mask.sum(-1)  # [B], [B]
  return jax.jit(recall)


def _rows(example: Mapping[str, np.ndarray], index: int):
  missing = {"inputs", "targets", "weights"} - set(example)
  if missing:
    raise ValueError(f"MQAR example {index}: missing keys {sorted(missing)}")
  x, y, w = (np.asarray(example[k]) for k in ("inputs", "targets", "weights"))
  if not x.shape == y.shape == w.shape or x.ndim not in (1, 2):
    raise ValueError(f"MQAR example {index}: inputs/targets/weights shapes {x.shape}, "
                     f"{y.shape}, {w.shape} should be equal, [L] or [B, L]")
  if x.ndim == 1:
    x, y, w = x[None], y[None], w[None]
  for r in range(x.shape[0]):
    yield x[r], y[r], w[r] > 0


def mqar_accuracy(logits_fn: LogitsFn, examples: Iterable[Mapping[str, np.ndarray]], *,
                  batch_size: int = 32, max_examples: int | None = None) -> dict:
  """Scores up to `max_examples` sequences from `examples` (any iterable of numpy dicts, e.g.
  the MQAR generator of attn_jax.data.synthetic); returns acc, example_acc and counts."""
  rows = itertools.chain.from_iterable(_rows(e, i) for i, e in enumerate(examples))
  if max_examples is not None:
    rows = itertools.islice(rows, max_examples)
  by_len: dict[int, list] = {}
  for row in rows:
    by_len.setdefault(row[0].shape[0], []).append(row)
  scorer = _jitted_recall(logits_fn)
  state = scorer_state(logits_fn)
  hits, counts = [], []
  for length, group in sorted(by_len.items()):
    for lo in range(0, len(group), batch_size):
      chunk = group[lo:lo + batch_size]
      inputs = np.zeros((batch_size, length), np.int32)  # [B, L]
      targets = np.zeros((batch_size, length), np.int32)  # [B, L]
      mask = np.zeros((batch_size, length), bool)  # [B, L]
      for r, (x, y, m) in enumerate(chunk):
        inputs[r], targets[r], mask[r] = x, y, m
      h, c = scorer(state, inputs, targets, mask)
      hits.append(np.asarray(h)[:len(chunk)])
      counts.append(np.asarray(c)[:len(chunk)])
  if not hits:
    raise ValueError("no MQAR examples to score")
  hits_, counts_ = np.concatenate(hits), np.concatenate(counts)
  if counts_.sum() == 0:
    raise ValueError("MQAR examples have no positions with weight > 0")
  scored = counts_ > 0
  return dict(acc=float(hits_.sum() / counts_.sum()),
              example_acc=float(np.mean(hits_[scored] == counts_[scored])),
              n_examples=int(hits_.size), n_positions=int(counts_.sum()))


def _key_name(key: int) -> str:
  """Keys as letters (a..z, then A..Z, then k<id>), so they read apart from the values."""
  letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
  return letters[key] if 0 <= key < len(letters) else f"k{key}"


def _token_name(token: int, mqar_vocab: int) -> str:
  """Key ids [0, V) as letters, value ids [V, 2V) as numbers 0..V-1, noise ids as `_`."""
  if 0 <= token < mqar_vocab:
    return _key_name(token)
  if mqar_vocab <= token < 2 * mqar_vocab:
    return str(token - mqar_vocab)
  return "_" if 2 * mqar_vocab <= token < 3 * mqar_vocab else f"<{token}>"


def describe_examples(logits_fn: LogitsFn, example: Mapping[str, np.ndarray], *,
                      num_pairs: int, mqar_vocab: int, max_examples: int = 3,
                      max_queries: int = 4) -> list[str]:
  """What the model answers on MQAR sequences, in words: one line per sequence,

    pairs: a->7 q->3 ...; asked q, model said 3 (right); asked a, model said 12 (wrong: 7)

  `example` holds [B, L] (or [L]) inputs/targets/weights laid out as
  attn_jax.data.synthetic.mqar_example writes them: the first `num_pairs` (key, value) pairs
  at positions 0..2N-1, and every weighted position t asks key inputs[t] with answer
  targets[t]. Keys print as letters, values as numbers (value id - V). The model's answer is
  the argmax over the whole vocabulary, so "said" may also be a key or noise token.
  """
  rows = list(_rows(example, 0))[:max_examples]
  if not rows:
    raise ValueError("no MQAR sequences to describe")
  inputs = np.stack([r[0] for r in rows]).astype(np.int32)  # [B, L]
  pred = np.asarray(jnp.argmax(logits_fn(inputs), axis=-1))  # [B, L]
  name = lambda t: _token_name(int(t), mqar_vocab)
  lines = []
  for b, (x, y, m) in enumerate(rows):
    pairs = " ".join(f"{name(x[2 * i])}->{name(x[2 * i + 1])}" for i in range(num_pairs))
    asked = []
    for t in np.flatnonzero(m)[:max_queries]:
      ok = pred[b, t] == y[t]
      verdict = "right" if ok else f"wrong: {name(y[t])}"
      asked.append(f"asked {name(x[t])}, model said {name(pred[b, t])} ({verdict})")
    lines.append(f"pairs: {pairs}; " + "; ".join(asked))
  return lines


def guess_baselines(num_pairs: int, num_queries: int, mqar_vocab: int) -> dict[str, float]:
  """Answer accuracies of strategies that do no key->value lookup (MQAR as in
  attn_jax.data.synthetic: M distinct keys of the N pairs are asked, in random order):

    any_value      1/V                          a random value id, ignoring the sequence
    among_pairs    1/N                          a random one of the N values in the sequence
    among_unasked  (1/M) sum_j 1/(N - j)        a random value not asked yet (j = 0..M-1)

  The last is the plateau a small model reaches before it forms the lookup (H_8/8 = 34% for
  N = M = 8)."""
  n, m = int(num_pairs), int(num_queries)
  return {"any_value": 1.0 / int(mqar_vocab), "among_pairs": 1.0 / n,
          "among_unasked": float(np.mean([1.0 / (n - j) for j in range(m)]))}
