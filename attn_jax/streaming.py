"""Streaming inference over unbounded token streams: interchangeable KV-cache policies for
scoring (per-position loss) and generation (StreamingLLM, docs/papers.md §3.2).

Stream policies (`StreamPolicy(name, window, sinks)`; each but "recompute" runs a KV-cache
policy, `cache.CachePolicy`, underneath):
- "dense":     every token stays (`cache.Linear`); memory grows with the stream;
- "window":    the last `window` tokens (`cache.Ring(window)`; the first tokens are evicted);
- "recompute": sliding window with re-computation: each token gets a fresh forward over the
               last `window` tokens (positions 0..window-1 every time) — the paper's strong,
               slow baseline;
- "streaming": StreamingLLM, the first `sinks` tokens plus the last `window` tokens, positions
               assigned inside the cache (`cache.SinksRing(sinks, window)`, attention/cache.py).
The three cache policies are `StreamPolicy.cache`, handed to `model.init_state` at decode time: the
same model (no rebuild) runs under any; mixers whose state is not a KV cache (SSMs) and those
whose cache policy is their function (sliding window, Sinkhorn) keep their own states. The
states are fixed-size buffers, so the jitted step is compiled once, whatever the stream length.

Scoring (`score_stream`): the stream is fed in chunks of `chunk` tokens (at most the cache
window) through `model.step`; the last chunk is padded (positions -1), so one compiled shape
serves the whole stream. losses[i] = -log p(tokens[i+1] | what the policy keeps of
tokens[..i]) in nats. "recompute" batches its windows ([batch, window] forwards, last logit
of each): the scores are those of one window per token; `experiments/bench_stream.py` times
it one token at a time, as a decoder would run it. It costs one window forward per scored
token, so on a large model it can be subsampled: `stride` s scores the first window in one
forward (positions 0..window-1, where recompute is dense attention) and after it only every
s-th position (losses NaN elsewhere). Every scored loss is exactly the stride-1 one; summaries
(`summarize`, `summarize_ranges`) average the scored positions, and a policy compared with it
should be compared at the same positions (`paired`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax import decode, paths as paths_lib
from attn_jax.attention import cache as cache_lib
from attn_jax.model_config import ModelConfig, validate_model
from attn_jax.data.text import read_text_file, split_paths
from attn_jax.data.tokenizer import get_tokenizer
from attn_jax.decode import jit_stateful
from attn_jax.model import abstract_model, mixer_limits
from attn_jax.options import is_int
from attn_jax.registry import get_mixer

POLICIES = ("dense", "window", "recompute", "streaming")


@dataclasses.dataclass(frozen=True)
class StreamPolicy:
  name: str
  window: int = 1020     # recent tokens kept (query included); unused by "dense"
  sinks: int = 4         # "streaming": first tokens kept

  def validate(self) -> None:
    if self.name not in POLICIES:
      raise ValueError(f"policy {self.name!r} not in {POLICIES}")
    if not is_int(self.window, 1):
      raise ValueError(f"policy {self.name}: window must be an integer >= 1, got {self.window!r}")
    if not is_int(self.sinks, 0):
      raise ValueError(f"policy {self.name}: sinks must be an integer >= 0, got {self.sinks!r}")

  @property
  def label(self) -> str:
    if self.name == "dense":
      return "dense"
    if self.name == "streaming":
      return f"streaming({self.sinks}+{self.window})"
    return f"{self.name}({self.window})"

  @property
  def span(self) -> int:
    """Most tokens a query sees (itself included); 0 = unbounded."""
    return {"dense": 0, "streaming": self.sinks + self.window}.get(self.name, self.window)

  @property
  def cache(self) -> cache_lib.CachePolicy | None:
    """The KV-cache policy (None for "recompute": no cache)."""
    self.validate()
    return {"dense": cache_lib.LINEAR, "window": cache_lib.Ring(self.window),
            "streaming": cache_lib.SinksRing(self.sinks, self.window)}.get(self.name)


def cached_mixers(cfg: ModelConfig) -> list[str]:
  """Mixers of the pattern whose decoding state is a KV cache under the policy asked for."""
  return sorted({s.mixer for s in cfg.period
                 if getattr(get_mixer(s.mixer), "follows_policy", False)})


def check_policy(cfg: ModelConfig, policy: StreamPolicy) -> None:
  """Clear errors before any work: a window the model cannot hold."""
  policy.validate()
  span = policy.span
  if span and span > cfg.max_seq_len:
    raise ValueError(f"policy {policy.label}: a window of {span} tokens is larger than the "
                     f"model holds (model.max_seq_len={cfg.max_seq_len}); use a smaller "
                     "--window/--sinks")
  if policy.name in ("window", "streaming") and not cached_mixers(cfg):
    raise ValueError(f"policy {policy.label}: the model has no mixer whose KV cache takes a "
                     f"policy (pattern {[s.mixer for s in cfg.period]})")


def with_max_seq_len(model, max_seq_len: int):
  """The same parameters under `model.max_seq_len` raised (a config override at inference:
  the parameters do not depend on it, RoPE has no table). Dense attention then runs positions
  past the length the model was trained at; nothing else changes."""
  if not is_int(max_seq_len, 1):
    raise ValueError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
  cfg = dataclasses.replace(model.cfg, max_seq_len=int(max_seq_len))
  validate_model(cfg)
  graphdef, abstract = nnx.split(abstract_model(cfg))
  state = nnx.state(model)
  if jax.tree.structure(abstract) != jax.tree.structure(state):
    raise ValueError(f"model.max_seq_len={max_seq_len}: the model's parameters depend on it "
                     "(a position table?); it cannot be raised at inference")
  return nnx.merge(graphdef, state)


def state_bytes(state) -> int:
  """Bytes held by a decoding state (every array leaf)."""
  return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(state)))


# ------------------------------------------------------------------ reading a stream

def read_stream(paths: str | Iterable[str], tokenizer: str = "bytes", *, tail: float = 0.0,
                max_tokens: int = 0) -> np.ndarray:
  """Token ids [N] of the concatenated files (EOS between files). `tail` in (0, 1): only the
  last fraction of the stream (e.g. a training run's held-out part); `max_tokens`: at most
  this many (from the start of what is kept)."""
  tok = get_tokenizer(tokenizer)
  ids = []
  for p in split_paths(paths):
    ids.extend(tok.encode(read_text_file(p, what="stream file", source="--text")))
    ids.append(tok.eos_id)
  arr = np.asarray(ids[:-1] if ids else [], np.int32)
  if tail:
    arr = arr[int(len(arr) * (1 - tail)):]
  if max_tokens:
    arr = arr[:max_tokens]
  if arr.size < 2:
    raise ValueError(f"the stream from {paths!r} is empty (needs >= 2 tokens to score, got "
                     f"{arr.size})")
  return arr


# ------------------------------------------------------------------ scoring

def _token_losses(logits_BTV, targets_BT):
  logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]


class CachedScorer:
  """Feeds one stream (batch 1) chunk by chunk through a cache policy's fixed-size state.
  It holds the block parameters split per layer (`Decoder.layer_params`: one more copy of them)
  so that no chunk step slices them again.

  `trace_limit`: raise if the chunk step is traced more than this many times
  (`chex.assert_max_traces`; for tests)."""

  def __init__(self, model, policy: StreamPolicy, *, chunk: int = 256, capacity: int = 0,
               trace_limit: int | None = None):
    check_policy(model.cfg, policy)
    if policy.name == "recompute":
      raise ValueError("CachedScorer runs cache policies; recompute has no cache")
    self.model = model
    self.policy = policy
    max_chunk, stream = mixer_limits(model.cfg, max(capacity, 1), policy.cache)
    if stream is not None and capacity < 1:
      raise ValueError(f"policy {policy.label} needs `capacity` (the stream length)")
    self.chunk = min(chunk, max_chunk or chunk)
    self.capacity = capacity
    self.graphdef, self.params = nnx.split(self.model)
    self.layer_params = model.layer_params()   # sliced once (Decoder.layer_params)
    self.state = model.init_state(1, max(capacity, 1), policy.cache)
    self.position = 0

    def step(params, layer_params, state, inputs_T, targets_T, positions_T):
      model = nnx.merge(self.graphdef, params)
      logits, state = model.step(inputs_T[None], positions_BT=positions_T[None], state=state,
                                 layer_params=layer_params)
      return _token_losses(logits, targets_T[None])[0], state

    if trace_limit is not None:
      import chex
      chex.clear_trace_counter()   # chex counts per code location, across scorers
      step = chex.assert_max_traces(step, n=trace_limit)
    self._step = jit_stateful(step, donate_argnums=(2,))

  def score(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Losses of `targets` given the stream so far and `inputs` (same length <= chunk)."""
    n, c = len(inputs), self.chunk
    if not 0 < n <= c or len(targets) != n:
      raise ValueError(f"a chunk of 1..{c} inputs with as many targets, got {n}/{len(targets)}")
    pad = c - n
    pos = np.concatenate([self.position + np.arange(n), np.full(pad, -1)]).astype(np.int32)
    inp = np.pad(np.asarray(inputs, np.int32), (0, pad))
    tgt = np.pad(np.asarray(targets, np.int32), (0, pad))
    losses, self.state = self._step(self.params, self.layer_params, self.state, inp, tgt, pos)
    self.position += n
    return np.asarray(losses)[:n]

  @property
  def cache_bytes(self) -> int:
    return state_bytes(self.state)


def _recompute_losses(model, tokens: np.ndarray, window: int, batch: int, progress,
                      stride: int = 1):
  """losses[i] from a fresh forward over tokens[max(0, i - window + 1) : i + 1], for i < window
  and every `stride`-th i after (NaN at the others)."""
  N = len(tokens)
  fwd = nnx.jit(lambda m, x: m(x))
  w = min(window, N - 1)
  first = fwd(model, jnp.asarray(tokens[None, :w]))
  out = np.full(N - 1, np.nan, np.float32)
  out[:w] = np.asarray(_token_losses(first, jnp.asarray(tokens[None, 1:w + 1])))[0]
  progress.update(w)
  starts = np.arange(1, N - w, stride)       # window [s, s + w) predicts tokens[s + w]
  last = nnx.jit(lambda m, x: m.unembed(m.hidden(x)[:, -1]))   # the head for one row only
  for a in range(0, len(starts), batch):
    s = starts[a:a + batch]
    pad = batch - len(s)
    idx = np.pad(s, (0, pad), mode="edge")[:, None] + np.arange(w)[None, :]
    logits = last(model, jnp.asarray(tokens[idx]))
    tgt = tokens[np.minimum(idx[:, -1] + 1, N - 1)]
    out[s + w - 1] = np.asarray(_token_losses(logits[:, None],
                                              jnp.asarray(tgt)[:, None]))[:len(s), 0]
    progress.update(min(len(s) * stride, N - 1 - progress.n))
  return out


def score_stream(model, tokens: np.ndarray, policy: StreamPolicy, *, chunk: int = 256,
                 batch: int = 16, progress: bool = True, stride: int = 1) -> np.ndarray:
  """Per-position losses [N - 1] (nats) of a token stream under `policy` (module docstring).
  `stride`: "recompute" scores every stride-th position past its first window (NaN between)."""
  from tqdm.auto import tqdm
  tokens = np.asarray(tokens, np.int32)
  N = len(tokens)
  if N < 2:
    raise ValueError(f"the stream is empty (needs >= 2 tokens to score, got {N})")
  check_policy(model.cfg, policy)
  if not is_int(stride, 1):
    raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
  bar = tqdm(total=N - 1, desc=policy.label, unit="tok", disable=not progress, leave=False)
  try:
    if policy.name == "recompute":
      return _recompute_losses(model, tokens, policy.window, batch, bar, stride)
    scorer = CachedScorer(model, policy, chunk=chunk,
                          capacity=N if policy.name == "dense" else 0)
    out = []
    for a in range(0, N - 1, scorer.chunk):
      e = min(a + scorer.chunk, N - 1)
      out.append(scorer.score(tokens[a:e], tokens[a + 1:e + 1]))
      bar.update(e - a)
    return np.concatenate(out)
  finally:
    bar.close()


# ------------------------------------------------------------------ generation

def greedy_continuation(model, prompt: np.ndarray, policy: StreamPolicy, *,
                        max_new_tokens: int) -> np.ndarray:
  """Greedy continuation of one prompt [T] under a policy -> [T + max_new_tokens].

  Cache policies run `decode.generate` (one jitted loop; bounded caches generate any length);
  "recompute" runs a fresh [1, window] forward per token (positions -1 pad a short window)."""
  check_policy(model.cfg, policy)
  prompt = np.asarray(prompt, np.int32)
  T = len(prompt)
  if policy.name != "recompute":
    cache_len = T + max_new_tokens if policy.name == "dense" else 1
    return np.asarray(decode.generate(model, prompt[None], max_new_tokens=max_new_tokens,
                                      cache_len=cache_len, policy=policy.cache))[0]
  W = policy.window

  @nnx.jit
  def next_token(m, window_1W, n_valid):
    pos = jnp.where(jnp.arange(W) < n_valid, jnp.arange(W), -1)[None].astype(jnp.int32)
    logits = m(window_1W, positions_BT=pos)[0]
    return jnp.argmax(logits[n_valid - 1]).astype(jnp.int32)

  seq = list(prompt)
  for _ in range(max_new_tokens):
    ctx = np.asarray(seq[-W:], np.int32)
    buf = np.pad(ctx, (0, W - len(ctx)))
    seq.append(int(next_token(model, jnp.asarray(buf[None]), len(ctx))))
  return np.asarray(seq, np.int32)


# ------------------------------------------------------------------ results

def write_results(out_dir: str, results: dict[str, np.ndarray], meta: dict,
                  smooth: int = 64) -> dict[str, str]:
  """losses.json ({meta, policies: {label: [loss per position]}}), losses.csv (position,
  one column per policy) and loss.png (running mean over `smooth` positions vs position)."""
  import csv
  import json
  paths = {k: paths_lib.name(paths_lib.run_path(out_dir) / f) for k, f in
           (("json", "losses.json"), ("csv", "losses.csv"), ("png", "loss.png"))}
  summary = {k: summarize(v) for k, v in results.items()}
  with paths_lib.open_for_write(paths["json"]) as f:   # unscored positions (NaN) as null
    json.dump({"meta": meta, "summary": summary,
               "policies": {k: [None if np.isnan(x) else round(float(x), 5) for x in v]
                            for k, v in results.items()}}, f)
  n = max(len(v) for v in results.values())
  with paths_lib.open_for_write(paths["csv"]) as f:   # csv's own \r\n, as with newline=""
    w = csv.writer(f)
    w.writerow(["position"] + list(results))
    for i in range(n):
      w.writerow([i + 1] + [f"{v[i]:.5f}" if i < len(v) and not np.isnan(v[i]) else ""
                            for v in results.values()])
  plot_losses(paths["png"], results, smooth=smooth, title=meta.get("title", ""))
  return paths


def _nanmean(x) -> float:
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  return float(x.mean()) if x.size else float("nan")


def summarize(losses: np.ndarray, parts: int = 4) -> dict:
  """Mean loss (nats) over the whole stream and over `parts` consecutive slices (scored
  positions only: NaN = not scored)."""
  sl = np.array_split(np.asarray(losses, np.float64), parts)
  return {"mean": _nanmean(losses), "slices": [_nanmean(s) for s in sl]}


def summarize_ranges(losses: np.ndarray, edges) -> list[dict]:
  """Mean loss and perplexity over ranges [e_k, e_{k+1}) of the query's position (losses[i]
  is computed at position i, from tokens 0..i, and predicts token i + 1; `edges` are the
  inner boundaries, the stream's ends are added), scored positions only; a range past the
  end of a shorter stream has n = 0 (mean NaN), so that runs of different lengths give the
  same ranges. -> [{"start", "end" (exclusive), "n", "mean", "ppl"}]."""
  v = np.asarray(losses, np.float64)
  pos = np.arange(len(v))
  inner = sorted(int(e) for e in edges if int(e) > 0)
  cuts = [0] + inner + [max([len(v)] + [e + 1 for e in inner])]
  out = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    sel = v[(pos >= a) & (pos < b)]
    sel = sel[~np.isnan(sel)]
    mean = float(sel.mean()) if sel.size else float("nan")
    out.append({"start": a, "end": b, "n": int(sel.size), "mean": mean,
                "ppl": float(np.exp(mean))})
  return out


def scored_from(losses: np.ndarray, start: int) -> np.ndarray:
  """Mask of the scored (not NaN) loss indices >= `start`."""
  mask = ~np.isnan(np.asarray(losses, np.float64))
  mask[:start] = False
  return mask


def paired(results: dict[str, np.ndarray], reference: str, start: int = 0) -> dict[str, float]:
  """Mean loss of every policy at the positions `reference` scored (a subsampled recompute),
  from loss index `start` on (its first window, where the cache policies agree, left out):
  a side-by-side comparison on the same tokens."""
  mask = scored_from(results[reference], start)
  return {k: _nanmean(np.asarray(v, np.float64)[mask]) if len(v) >= len(mask) else float("nan")
          for k, v in results.items()}   # NaN: a policy scored a shorter prefix


def binned_means(losses: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
  """(bin centres, mean loss of the scored positions in each bin of `width` positions)."""
  v = np.asarray(losses, np.float64)
  n = -(-len(v) // width)
  centres, means = [], []
  for b in range(n):
    part = v[b * width:(b + 1) * width]
    part = part[~np.isnan(part)]
    if part.size:
      centres.append(b * width + (min((b + 1) * width, len(v)) - b * width) / 2)
      means.append(part.mean())
  return np.asarray(centres), np.asarray(means)


def running_mean(losses: np.ndarray, smooth: int) -> tuple[np.ndarray, np.ndarray]:
  """(positions k..N, mean loss over the `smooth` positions ending at each; k = the window,
  at most N) of a fully scored stream."""
  v = np.asarray(losses, np.float64)
  k = max(1, min(smooth, len(v)))
  return np.arange(k, len(v) + 1), np.convolve(v, np.ones(k) / k, mode="valid")


def plot_losses(path: str, results: dict[str, np.ndarray], *, smooth: int = 64,
                title: str = "") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for label, v in results.items():
    v = np.asarray(v, np.float64)
    if np.isnan(v).any():     # subsampled: the mean of the scored positions per bin
      x, mean = binned_means(v, max(1, smooth))
      ax.plot(x, mean, label=label, lw=1.2, marker=".", ms=3)
      continue
    ax.plot(*running_mean(v, smooth), label=label, lw=1.2)
  ax.set_xlabel("position in the stream (tokens)")
  ax.set_ylabel(f"loss (nats), mean over {smooth} positions")
  ax.set_title(title or "streaming loss per policy")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  paths_lib.save_figure(fig, path, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------ reports over several runs

def read_results(out_dirs: Iterable[str]) -> tuple[dict[str, np.ndarray], int]:
  """({label: losses (NaN = not scored)}, longest stream's tokens) from the losses.json of
  several `write_results` folders, which must have read the same text (meta "text", "tail");
  a run may score fewer tokens of it (--max_tokens: a prefix of the same stream)."""
  import json
  results, source, tokens = {}, None, 0
  for d in out_dirs:
    path = os.path.join(d, "losses.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: no losses.json (an experiments/stream.py output folder?)")
    with open(path) as f:
      data = json.load(f)
    meta = data["meta"]
    src = (meta.get("text"), meta.get("tail", 0.0))
    if source is not None and src != source:
      raise ValueError(f"{path}: read {src[0]!r} (tail {src[1]}), the runs before it "
                       f"{source[0]!r} (tail {source[1]}); a report compares one stream")
    source, tokens = src, max(tokens, int(meta["tokens"]))
    for label, vals in data["policies"].items():
      if label in results:
        raise ValueError(f"{path}: policy {label} is in two of the runs")
      results[label] = np.asarray([np.nan if x is None else x for x in vals], np.float64)
  return results, tokens


def cache_of(label: str) -> int | None:
  """Tokens a policy label keeps ("streaming(4+1020)" -> 1024; "dense" -> None)."""
  if "(" not in label:
    return None
  inner = label[label.index("(") + 1:label.rindex(")")]
  return sum(int(x) for x in inner.split("+"))


def report_table(results: dict[str, np.ndarray], edges) -> dict:
  """Per policy: scored positions, mean NLL and perplexity overall, past its first eviction
  (loss index >= its cache size: the context no longer fits) and per range
  (`summarize_ranges`); per subsampled policy: every policy's mean at the positions it scored
  past its first window, and how many."""
  rows = []
  for label, v in results.items():
    mean, c = _nanmean(v), cache_of(label)
    rows.append({"label": label, "cache": c,
                 "scored": int(np.count_nonzero(~np.isnan(v))), "mean": mean,
                 "ppl": float(np.exp(mean)), "past": _nanmean(v[c:]) if c else None,
                 "ranges": summarize_ranges(v, edges)})
  out = {}
  for k, v in results.items():
    if np.isnan(v).any():
      c = cache_of(k) or 0
      out[k] = {"n": int(scored_from(v, c).sum()),
                "means": paired(results, k, start=c)}
  return {"rows": rows, "paired": out}


def table_markdown(table: dict, tokens: int) -> str:
  rows = table["rows"]
  ranges = rows[0]["ranges"] if rows else []
  head = ["policy", "cache", "scored", "NLL", "ppl", "NLL past eviction"] + [
      f"NLL {r['start']}-{r['end'] - 1}" for r in ranges]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["label"], str(r["cache"] or "all"), str(r["scored"]), f"{r['mean']:.3f}",
             f"{r['ppl']:.2f}", "-" if r["past"] is None else f"{r['past']:.3f}"]
    sparse = any(x["n"] < min(x["end"], r["scored"]) - x["start"] for x in r["ranges"]
                 if x["n"])   # subsampled: say how many positions each mean has
    cells += ["-" if not x["n"] else f"{x['mean']:.3f}" + (f" (n={x['n']})" if sparse else "")
              for x in r["ranges"]]
    lines.append("| " + " | ".join(cells) + " |")
  out = "\n".join(lines)
  if table["paired"]:
    labels = [r["label"] for r in rows]
    lines = ["", "", f"Mean NLL at the positions each subsampled policy scored past its first "
             f"window ({tokens} tokens):", "",
             "| positions of | n | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for ref, p in table["paired"].items():
      lines.append(f"| {ref} | {p['n']} | " + " | ".join(
          "-" if np.isnan(p["means"][k]) else f"{p['means'][k]:.3f}" for k in labels) + " |")
    out += "\n".join(lines)
  return out


def plot_report(path: str, eviction_path: str, results: dict[str, np.ndarray], *,
                bin_width: int = 512, smooth: int = 64, zoom: int = 4096, mark: int = 0,
                paired_path: str | None = None) -> None:
  """`path`: binned mean NLL vs position, one panel per cache size (dense in each; subsampled
  policies left out: single tokens are too noisy to draw against position).
  `eviction_path`: the first `zoom` positions, running mean over `smooth` (lighter shades for
  smaller caches). `paired_path`: per subsampled policy, the loss of each policy of its cache
  size against its own, token by token at the positions it scored past its first window."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.colors as mcolors
  import matplotlib.pyplot as plt
  caches = sorted({c for c in map(cache_of, results) if c})
  base = {"dense": "black", "window": "tab:red", "recompute": "tab:green",
          "streaming": "tab:blue"}

  def draw(ax, label, x, y, marker=None):
    rgb = np.asarray(mcolors.to_rgb(base.get(label.split("(")[0], "gray")))
    c = cache_of(label)
    fade = 0.0 if not c else 0.55 * (len(caches) - 1 - caches.index(c)) / max(1, len(caches) - 1)
    ax.plot(x, y, color=tuple(rgb + (1 - rgb) * fade), marker=marker, ms=3, lw=1.1, label=label)


  fig, axes = plt.subplots(1, max(1, len(caches)), figsize=(6 * max(1, len(caches)), 4),
                           sharey=True, squeeze=False)
  for ax, c in zip(axes[0], caches or [None]):
    for label, v in results.items():
      if cache_of(label) in (None, c) and not np.isnan(v).any():
        draw(ax, label, *binned_means(v, bin_width))
    if mark:
      ax.axvline(mark, color="gray", lw=0.8, ls=":")
    ax.set_title(f"cache {c} tokens" if c else "", fontsize=9)
    ax.set_xlabel("position (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel(f"NLL (nats), mean per {bin_width} positions")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 3.6))
  for label, v in results.items():
    v = np.asarray(v[:zoom], np.float64)
    if np.isnan(v).any():
      continue
    draw(ax, label, *running_mean(v, smooth))
  for c in caches:
    ax.axvline(c, color="gray", lw=0.6, ls=":")
  ax.set_xlabel("position (tokens); dotted: the cache sizes (first eviction)")
  ax.set_ylabel(f"NLL, running mean over {smooth}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(eviction_path, dpi=90)
  plt.close(fig)
  refs = [k for k, v in results.items() if np.isnan(v).any()]
  if not (paired_path and refs):
    return
  fig, axes = plt.subplots(1, len(refs), figsize=(4 * len(refs), 4), squeeze=False)
  for ax, ref in zip(axes[0], refs):
    c = cache_of(ref) or 0
    mask = scored_from(results[ref], c)
    x = results[ref][mask]
    for label, v in results.items():
      if label != ref and cache_of(label) == c and len(v) >= len(mask):
        rgb = mcolors.to_rgb(base.get(label.split("(")[0], "gray"))
        ax.scatter(x, v[mask], s=10, color=rgb, label=label)
    lim = [0, float(np.nanmax([x.max()] + [v[mask].max() for v in results.values()
                                           if len(v) >= len(mask)])) + 0.5]
    ax.plot(lim, lim, color="gray", lw=0.8)
    ax.set_xlabel(f"{ref} NLL ({int(mask.sum())} tokens)")
    ax.set_ylabel("NLL of the same token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(paired_path, dpi=90)
  plt.close(fig)
