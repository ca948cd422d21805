"""Language-modelling evaluation of the study (configs/study_lm_tiny.py): held-out bits per
byte, and loss against position past the training length.

The held-out stream is the data's own eval split (`pipeline.make_source(..., split="eval")`:
the last `data.eval_fraction` of the packed windows of text, JSONL or token shards, never
trained on): its windows are consecutive, so their inputs concatenated, plus the last target,
are one contiguous token stream s[0:S].

  * `eval/lm/bpb`: s cut into windows of the training length L (`data.seq_len`), at most
    `study.lm_windows` of them; bits per byte = sum over targets of -log2 p(target) / number
    of UTF-8 bytes the targets decode to (EOS and other special ids count 0 bytes). With the
    byte tokenizer this is bits per token over the non-EOS targets.
  * `eval/lm/pos<a>_<b>`: windows of `study.lm_extrapolate` x L tokens (as many as fit, at
    most `study.lm_windows`); bits per byte over the target positions [a, b), buckets of L
    positions. Buckets past L measure length extrapolation: the model never saw positions
    >= L in training (needs model.max_seq_len >= the longer windows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attn_jax.data.pipeline import make_source
from attn_jax.data.tokenizer import get_tokenizer
from attn_jax.model import abstract_model

LN2 = float(np.log(2.0))


def heldout_stream(config: ml_collections.ConfigDict) -> np.ndarray:
  """The eval split as one contiguous int32 token stream."""
  src = make_source(config.data, seed=int(config.seed), split="eval")
  if len(src) == 0:
    raise ValueError("config.data.eval_fraction: the eval split is empty")
  parts = [np.asarray(src[i]["inputs"]) for i in range(len(src))]
  parts.append(np.asarray(src[len(src) - 1]["targets"])[-1:])
  return np.concatenate(parts).astype(np.int32)


def token_bytes(spec: str, ids: np.ndarray) -> np.ndarray:
  """UTF-8 bytes each token id decodes to (0 for EOS / special ids), per id of `ids`."""
  tok = get_tokenizer(spec)
  uniq = np.unique(ids)
  lens = {int(i): (0 if int(i) == tok.eos_id else len(tok.decode([int(i)]).encode("utf-8")))
          for i in uniq}
  return np.vectorize(lens.__getitem__, otypes=[np.int64])(ids)


def windows(stream: np.ndarray, length: int, limit: int) -> np.ndarray:
  """[n, length + 1] consecutive windows (sharing one token), n <= limit."""
  n = min(int(limit), (len(stream) - 1) // length)
  if n < 1:
    raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of "
                     f"{length} + 1 (lower study.lm_extrapolate or raise data.eval_fraction)")
  idx = np.arange(n)[:, None] * length + np.arange(length + 1)[None, :]
  return stream[idx]


def _bucket_bpb(nll_NL: np.ndarray, bytes_NL: np.ndarray, bucket: int) -> dict[str, float]:
  out = {}
  for a in range(0, nll_NL.shape[1], bucket):
    b = min(a + bucket, nll_NL.shape[1])
    out[f"eval/lm/pos{a}_{b}"] = float(nll_NL[:, a:b].sum() / LN2 /
                                       max(int(bytes_NL[:, a:b].sum()), 1))
  return out


def lm_callback(config: ml_collections.ConfigDict):
  """Trainer eval callback `(state, step) -> {eval/lm/bpb, eval/lm/pos<a>_<b>, ...}`."""
  from flax import nnx


  s, L = config.study, int(config.data.seq_len)
  ext = int(s.lm_extrapolate) * L
  if ext > int(config.model.max_seq_len):
    raise ValueError(f"config.study.lm_extrapolate: windows of {ext} tokens exceed "
                     f"model.max_seq_len={config.model.max_seq_len}")
  stream = heldout_stream(config)
  sets = {}
  for length in sorted({L, ext}):
    w = windows(stream, length, int(s.lm_windows))
    sets[length] = (w, token_bytes(str(config.data.tokenizer), w[:, 1:]))
  graphdef = nnx.split(abstract_model(config.model))[0]

  @jax.jit
  def nll(state, tokens_BT, targets_BT):
    logits = nnx.merge(graphdef, *state)(tokens_BT).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]

  def score(st, w):   # one call per window length (all its windows in one batch)
    return np.asarray(nll(st, w[:, :-1], w[:, 1:]), np.float64)

  def callback(state, step):
    del step
    st = (state["params"], state["rest"])
    w, nb = sets[L]
    out = {"eval/lm/bpb": float(score(st, w).sum() / LN2 / max(int(nb.sum()), 1))}
    w, nb = sets[ext]
    out.update(_bucket_bpb(score(st, w), nb, L))
    return out

  return callback
