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
