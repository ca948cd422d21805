"""Needle in a haystack: can the model read back a number hidden at depth d of a long context?

For each context length C (tokens the model sees, answer included) and depth d in [0, 1]:

  prompt = filler sentences, with "The secret number is N." inserted at the sentence boundary
           nearest to fraction d of the filler tokens, then
           " What is the secret number? The secret number is"
  answer = greedy decoding (argmax of logits_fn on the growing sequence) of
           len(enc(" N")) + 1 tokens; correct iff the first run of digits in the decoded text
           is exactly N (so " 42." and " 42" count, " 421" and " 4" do not).

The filler is generated text: sentences from a small embedded list in a seeded order (no
downloads). N is a random `digits`-digit number per (length, depth, sample). Every prompt for
one context length is right-padded to exactly C tokens, so the jitted step compiles once per
context length; the number of forwards is n_lengths x n_batches x (answer tokens + 1), cheap
enough for an in-training eval of a tiny model. After Kamradt's "needle in a haystack" test
(2023).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax import paths
from attn_jax.data.tokenizer import Tokenizer
from attn_jax.eval.harness import LogitsFn, ScorerFns, per_logits_fn_cache, scorer_state
from attn_jax.model_config import seq_len_problem

FILLER_SENTENCES = (
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Most of the orchard was planted by hand during a dry and windy spring.",
    "A good map leaves out far more than it shows, and that is its strength.",
    "The committee met on Tuesday and agreed to postpone the vote until autumn.",
    "Bread rises faster in a warm kitchen, but the flavour suffers for it.",
    "She kept a notebook of every bird she saw along the northern coast.",
    "The bridge was repainted in a colour that nobody in the village liked.",
    "Long division is easier to explain with apples than with symbols.",
    "Trains from the valley arrive late whenever the fog settles on the pass.",
    "An old clock in the hallway chimes a few minutes after every hour.",
    "The library moved its maps to the top floor to keep them out of the damp.",
    "He repaired the fence with wood taken from the collapsed barn.",
    "Clouds gathered over the hills, yet the afternoon stayed completely dry.",
    "The recipe calls for two onions, a handful of herbs and plenty of patience.",
    "Children in the square were flying kites shaped like fish and dragons.",
    "The lighthouse keeper wrote letters that were never sent to anyone.",
    "Every spring the meadow fills with small yellow flowers and loud bees.",
    "The museum displays a boat that was carved from a single oak trunk.",
    "A quiet road runs along the lake and ends at a shuttered hotel.",
    "The teacher asked the class to describe the smell of rain in one sentence.",
    "Snow closed the mountain road for three weeks in the middle of winter.",
    "The market sells cheese, honey, wool and a great deal of gossip.",
    "Old photographs of the harbour show ships with tall white sails.",
    "The gardener believed that tomatoes grow better when you talk to them.",
)
NEEDLE = "The secret number is {number}."
QUESTION = " What is the secret number? The secret number is"


@dataclasses.dataclass(frozen=True)
class NIAHCase:
  context_length: int  # tokens the model sees, prompt + generated answer
  depth: float  # requested depth in [0, 1]
  actual_depth: float  # filler tokens before the needle / all filler tokens
  number: int
  prompt_ids: tuple[int, ...]
  max_new_tokens: int


@dataclasses.dataclass
class NIAHResult:
  grid: np.ndarray  # float [n_lengths, n_depths], accuracy per cell; NaN = not run (n/a)
  context_lengths: tuple[int, ...]
  depths: tuple[float, ...]
  samples: list[dict]  # one per case: context_length, depth, number, generated, correct
  not_available: dict[int, str] = dataclasses.field(default_factory=dict)  # length -> why

  @property
  def accuracy(self) -> float:
    """Mean over the cells that were run (NaN when none was)."""
    run = self.grid[~np.isnan(self.grid)]
    return float(np.mean(run)) if run.size else float("nan")

  def to_dict(self) -> dict:
    return dict(grid=self.grid.tolist(), context_lengths=list(self.context_lengths),
                depths=list(self.depths), accuracy=self.accuracy,
                not_available={str(k): v for k, v in self.not_available.items()})


def _filler_order(seed: int, n: int) -> list[str]:
  rng = np.random.default_rng(seed)
  out: list[str] = []
  while len(out) < n:
    out.extend(FILLER_SENTENCES[i] for i in rng.permutation(len(FILLER_SENTENCES)))
  return out[:n]


def build_case(tokenizer: Tokenizer, context_length: int, depth: float, number: int, *,
               seed: int = 0, max_new_tokens: int | None = None) -> NIAHCase:
  """The prompt for one cell: as much filler as fits in context_length - max_new_tokens."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must lie in [0, 1], got {depth}")
  needle = NEEDLE.format(number=number)
  if max_new_tokens is None:
    max_new_tokens = len(tokenizer.encode(f" {number}")) + 1
  budget = context_length - max_new_tokens
  fixed = len(tokenizer.encode(" " + needle + QUESTION))
  if fixed > budget:
    raise ValueError(f"context_length {context_length} too short for the needle and question "
                     f"({fixed} + {max_new_tokens} tokens)")
  # sentence lengths, encoded with their leading space as they appear in the text
  per = {s: len(tokenizer.encode(" " + s)) for s in FILLER_SENTENCES}
  upper = max(0, (budget - fixed) // min(per.values()) + 1)
  order = _filler_order(seed, upper)
  approx = np.cumsum([per[s] for s in order]) if order else np.zeros(0, np.int64)
  filler = order[:int(np.searchsorted(approx, budget - fixed, side="right"))]
  while True:
    lens = np.array([per[s] for s in filler], np.int64)
    cum = np.concatenate([[0], np.cumsum(lens)])  # filler tokens before sentence j
    j = int(np.argmin(np.abs(cum - depth * cum[-1])))  # sentence boundary nearest the depth
    parts = filler[:j] + [needle] + filler[j:]
    prompt = tokenizer.encode(" ".join(parts) + QUESTION)
    if len(prompt) <= budget or not filler:
      break
    filler = filler[:-1]
  if len(prompt) > budget:
    raise ValueError(f"context_length {context_length}: prompt of {len(prompt)} tokens > "
                     f"budget {budget}")
  actual = float(cum[j] / cum[-1]) if cum[-1] else float(depth)
  return NIAHCase(context_length, float(depth), actual, int(number), tuple(prompt),
                  int(max_new_tokens))


@per_logits_fn_cache
def _jitted_next_token(fns: ScorerFns):
  def next_token(state, tokens, pos):
    # tokens: int32 [B, C]; pos: int32 [B], index of each row's last real token
    logits = fns.logits(state, tokens)  # [B, C, V]
    last = jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0]  # [B, V]
    return jnp.argmax(last, axis=-1).astype(jnp.int32)  # [B]
  return jax.jit(next_token)


def greedy_generate(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int, width: int, batch_size: int) -> list[list[int]]:
  """Greedy continuation of each prompt, computed on fixed [batch_size, width] buffers
  (full forward per step, no cache: right padding is invisible to a causal model)."""
  step = _jitted_next_token(logits_fn)
  state = scorer_state(logits_fn)
  out: list[list[int]] = []
  for lo in range(0, len(prompts), batch_size):
    chunk = prompts[lo:lo + batch_size]
    tokens = np.zeros((batch_size, width), np.int32)  # [B, C]
    lengths = np.ones((batch_size,), np.int64)  # [B]; padded rows hold one 0 token
    for row, p in enumerate(chunk):
      if len(p) + max_new_tokens > width:
        raise ValueError(f"prompt of {len(p)} tokens + {max_new_tokens} new > width {width}")
      tokens[row, :len(p)] = p
      lengths[row] = len(p)
    generated = np.zeros((batch_size, max_new_tokens), np.int32)  # [B, T]
    for t in range(max_new_tokens):
      nxt = np.asarray(step(state, tokens, (lengths - 1).astype(np.int32)))  # [B]
      generated[:, t] = nxt
      if t + 1 < max_new_tokens:
        tokens[np.arange(batch_size), lengths] = nxt
        lengths += 1
    out.extend(generated[row].tolist() for row in range(len(chunk)))
  return out


def answer_is_correct(generated_text: str, number: int) -> bool:
  match = re.match(r"\s*(\d+)", generated_text)
  return match is not None and match.group(1) == str(number)


def run_niah(logits_fn: LogitsFn, tokenizer: Tokenizer, *,
             context_lengths: Sequence[int] = (256, 512, 1024),
             depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), samples_per_cell: int = 2,
             digits: int = 4, batch_size: int = 16, batch_tokens: int | None = 8192,
             seed: int = 0, max_seq_len: int | None = None) -> NIAHResult:
  """Accuracy grid [len(context_lengths), len(depths)]; see the module docstring.

  Rows per forward: batch_size, capped at batch_tokens // context_length (at least 1) so the
  [rows, C, V] logits stay bounded for long contexts and large vocabularies. A context length
  over `max_seq_len` (the model's) is not run: its row is NaN and `not_available` says why
  (`config.seq_len_problem`, the rule every entry point follows)."""
  rng = np.random.default_rng(seed)
  grid = np.zeros((len(context_lengths), len(depths)), np.float64)
  samples: list[dict] = []
  not_available: dict[int, str] = {}
  for li, length in enumerate(context_lengths):
    problem = max_seq_len and seq_len_problem(max_seq_len, length, f"context length {length}")
    if problem:
      grid[li] = np.nan
      not_available[int(length)] = f"n/a: {problem}"
      continue
    cases = []
    for di, depth in enumerate(depths):
      for s in range(samples_per_cell):
        number = int(rng.integers(10 ** (digits - 1), 10 ** digits))
        case_seed = seed * 1_000_003 + li * 10_007 + di * 101 + s
        cases.append((di, build_case(tokenizer, length, depth, number, seed=case_seed)))
    new = max(c.max_new_tokens for _, c in cases)
    rows = batch_size if batch_tokens is None else max(1, min(batch_size, batch_tokens // length))
    gens = greedy_generate(logits_fn, [c.prompt_ids for _, c in cases], max_new_tokens=new,
                           width=length, batch_size=rows)
    for (di, case), gen in zip(cases, gens):
      text = tokenizer.decode(gen[:case.max_new_tokens])
      correct = answer_is_correct(text, case.number)
      grid[li, di] += correct / samples_per_cell
      samples.append(dict(context_length=length, depth=case.depth,
                          actual_depth=case.actual_depth, number=case.number,
                          prompt_tokens=len(case.prompt_ids), generated=text, correct=correct))
  return NIAHResult(grid, tuple(int(c) for c in context_lengths),
                    tuple(float(d) for d in depths), samples, not_available)


def plot_heatmap(result: NIAHResult | np.ndarray, path: str, *,
                 context_lengths: Sequence[int] | None = None,
                 depths: Sequence[float] | None = None, title: str = "Needle in a haystack"
                 ) -> bool:
  """Saves a depth x context-length accuracy heatmap; returns False (with a message) when
  matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"plot_heatmap: matplotlib is not installed; skipping {path} "
          "(pip install 'attn_jax[plot]')")
    return False
  if isinstance(result, NIAHResult):
    grid, context_lengths, depths = result.grid, result.context_lengths, result.depths
  else:
    grid = np.asarray(result)
  context_lengths = context_lengths or range(grid.shape[0])
  depths = depths or range(grid.shape[1])
  fig, ax = plt.subplots(figsize=(1.2 + 0.9 * grid.shape[0], 1.0 + 0.6 * grid.shape[1]))
  im = ax.imshow(grid.T, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
  ax.set_xticks(range(grid.shape[0]), [str(c) for c in context_lengths])
  ax.set_yticks(range(grid.shape[1]), [f"{d:.2f}" for d in depths])
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("needle depth")
  ax.set_title(title)
  for i in range(grid.shape[0]):
    for j in range(grid.shape[1]):
      label = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}"
      ax.text(i, j, label, ha="center", va="center", fontsize=8)
  fig.colorbar(im, ax=ax, label="accuracy")
  fig.tight_layout()
  paths.save_figure(fig, path, dpi=120)
  plt.close(fig)
  return True
