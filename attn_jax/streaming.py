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
s-th position (losses NaN elsewhere). Every scored loss is exactly the stride-1 one; the
reports (eval/stream_reports.py: the files a run writes, means, tables, figures) average the
scored positions, and compare a policy with a subsampled one at the positions it scored.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax import decode
from attn_jax.attention import cache as cache_lib
from attn_jax.data.text import read_text_file, split_paths
from attn_jax.data.tokenizer import get_tokenizer
from attn_jax.decode import jit_stateful
from attn_jax.field_checks import is_int
from attn_jax.model import abstract_model, mixer_limits
from attn_jax.model_config import ModelConfig, validate_model
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
