"""Needle in a haystack in MQAR's token space: NIAH for models trained on MQAR.

The text NIAH of attn_jax/eval/niah.py asks for a number hidden in English filler; a model
trained only on generated MQAR sequences has never seen text, so it scores 0 there whatever it
can recall. This probe keeps NIAH's grid (context length x depth) inside the training
distribution (attn_jax/data/synthetic.py's layout, keys [0, V), values [V, 2V), noise
[2V, 3V)):

    k_1 v_1 ... k_N v_N | noise ... noise | k_j      -> answer v_j (the needle)

  * one sequence of exactly C tokens per sample; the last input token is the query key k_j and
    the prediction at that position must be v_j (argmax over the whole vocabulary);
  * depth d in [0, 1] picks the needle pair j = round(d (N - 1)) within the key-value block
    (d = 0: the first pair written, the farthest from the query; d = 1: the last);
  * C (the context length) sets the distance between the pairs and the query.

The query is the first one of its sequence, so the no-lookup "values not yet asked" trick of
MQAR gives only 1/N here: chance = 1/N with N = `data.mqar_num_pairs`. Every sample draws a
fresh random key->value bijection from `numpy.random.default_rng([seed, 7, C, cell, i])`, so
the grid is the same at every evaluation and for every variant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attn_jax.model import abstract_model


def needle_batch(*, context_length: int, depth: float, samples: int, num_pairs: int,
                 mqar_vocab: int, seed: int, cell: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [samples, C], answers int32 [samples])."""
  C, N, V = int(context_length), int(num_pairs), int(mqar_vocab)
  if C < 2 * N + 1:
    raise ValueError(f"needle context length {C} < 2 * mqar_num_pairs + 1 = {2 * N + 1}")
  j = int(round(float(depth) * (N - 1)))
  tokens_SC = np.empty((samples, C), np.int32)
  answers_S = np.empty((samples,), np.int32)
  for i in range(samples):
    rng = np.random.default_rng([seed, 7, C, cell, i])
    keys_N = rng.choice(V, N, replace=False)
    values_N = V + rng.choice(V, N, replace=False)
    row = 2 * V + rng.integers(0, V, C)
    row[0:2 * N:2], row[1:2 * N:2] = keys_N, values_N
    row[C - 1] = keys_N[j]
    tokens_SC[i], answers_S[i] = row, values_N[j]
  return tokens_SC, answers_S


def needle_callback(config: ml_collections.ConfigDict):
  """Trainer eval callback `(state, step) -> {"eval/needle/acc", "eval/needle/C<c>_d<d>"}`.

  Lengths `config.study.needle_lengths` (each <= data.seq_len), depths
  `config.study.needle_depths`, `config.study.needle_samples` per cell. The model's graph is
  split once and its parameters passed as an argument (one compilation per length)."""
  from flax import nnx


  s, d = config.study, config.data
  lengths = tuple(int(x) for x in s.needle_lengths)
  depths = tuple(float(x) for x in s.needle_depths)
  bad = [x for x in lengths if x > d.seq_len]
  if bad:
    raise ValueError(f"config.study.needle_lengths: {bad} exceed data.seq_len={d.seq_len}")
  batches = {C: [needle_batch(context_length=C, depth=dp, samples=int(s.needle_samples),
                              num_pairs=d.mqar_num_pairs, mqar_vocab=d.mqar_vocab,
                              seed=config.seed, cell=c) for c, dp in enumerate(depths)]
             for C in lengths}
  graphdef = nnx.split(abstract_model(config.model))[0]

  @jax.jit
  def predict(state, tokens_BC):
    logits_BCV = nnx.merge(graphdef, *state)(tokens_BC)
    return jnp.argmax(logits_BCV[:, -1], axis=-1)

  def callback(state, step):
    del step
    st = (state["params"], state["rest"])
    out, hits_all = {}, []
    for C in lengths:
      toks = np.concatenate([b[0] for b in batches[C]])
      pred = np.asarray(predict(st, toks))
      hits = pred == np.concatenate([b[1] for b in batches[C]])
      hits_all.append(hits)
      for c, dp in enumerate(depths):
        n = int(s.needle_samples)
        out[f"eval/needle/C{C}_d{dp:g}"] = float(hits[c * n:(c + 1) * n].mean())
    out["eval/needle/acc"] = float(np.concatenate(hits_all).mean())
    return out

  return callback
