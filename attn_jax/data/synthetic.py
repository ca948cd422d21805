"""Generated training data: multi-query associative recall (MQAR) and uniform random tokens.

MQAR (Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models"). One example of `seq_len + 1` tokens, with N = `mqar_num_pairs`, M = `mqar_num_queries`
and V = `mqar_vocab`:

    k_1 v_1 k_2 v_2 ... k_N v_N | noise ... q_1 a_1 ... noise ... q_M a_M ... noise

  * keys k_i are drawn without replacement from [0, V), values v_i without replacement from
    [V, 2V), so the key -> value map is a fresh random bijection in every example;
  * the M queries q_j are distinct keys from the N pairs (drawn without replacement), each
    directly followed by its value a_j; the query pairs sit at uniformly random,
    non-overlapping positions after the key-value block (so the recall distance varies from
    1 pair to the whole sequence);
  * every other position is filled with noise tokens drawn uniformly from [2V, 3V), a range
    that never holds a key or a value.

The vocabulary needed is therefore 3V (`mqar_vocab_size`). `targets` is the next token and
`weights` is 1.0 exactly at the M input positions holding a query key q_j (whose target is the
answer a_j), 0 elsewhere. The answer is not a function of local context: the same key maps
to a different value in every example, so a model that does not look back at the pair scores
at most 1/N (guessing among the values it has seen) and 1/V without any context.

The `random` task gives uniform tokens in [0, `random_vocab`) with all weights 1 (for
throughput runs; its loss floor is log(random_vocab)).

With `data.document_mask` every example is one document: `segment_ids` all 1 and `positions`
0..L-1 (documents.py), i.e. exactly what the model sees without the switch.

Examples are a pure function of (seed, split, index): `np.random.default_rng([seed, split,
index])`, so the sources below are random-access grain data sources and the train and eval
splits are disjoint random streams of the same task.
"""

from __future__ import annotations

import numpy as np

from attn_jax.data import documents as doc_lib

# Synthetic sources have no natural end; this length is "infinite" for any training run
# (and below sys.maxsize, which grain reserves for repeated datasets).
SYNTHETIC_LENGTH = 2**62

# Separate random streams per split: example i of "train" and of "eval" never coincide.
SPLIT_STREAMS = {"train": 0, "eval": 1}

SYNTHETIC_TASKS = ("mqar", "random")


def mqar_vocab_size(data_cfg) -> int:
  """The smallest `model.vocab_size` that holds every MQAR token id: 3 * `data.mqar_vocab`.

  Ids [0, V) are keys, [V, 2V) values, [2V, 3V) noise.
  """
  return 3 * int(data_cfg.mqar_vocab)


def check_mqar_config(data_cfg) -> None:
  """Raises ValueError naming the `data.*` field when an MQAR example cannot be built."""
  seq_len = int(data_cfg.seq_len)
  num_pairs = int(data_cfg.mqar_num_pairs)
  num_queries = int(data_cfg.mqar_num_queries)
  vocab = int(data_cfg.mqar_vocab)
  if num_pairs < 1:
    raise ValueError(f"data.mqar_num_pairs must be >= 1, got {num_pairs}")
  if not 1 <= num_queries <= num_pairs:
    raise ValueError(
        f"data.mqar_num_queries must be in [1, data.mqar_num_pairs={num_pairs}] (queries ask "
        f"distinct keys), got {num_queries}")
  if num_pairs > vocab:
    raise ValueError(
        f"data.mqar_num_pairs={num_pairs} exceeds data.mqar_vocab={vocab}: keys and values are "
        "drawn without replacement from ranges of size mqar_vocab")
  tokens_needed = 2 * num_pairs + 2 * num_queries
  if tokens_needed > seq_len + 1:
    raise ValueError(
        f"data.seq_len={seq_len} is too short for MQAR: {num_pairs} pairs and {num_queries} "
        f"queries need {tokens_needed} tokens, at most data.seq_len + 1")


def mqar_example(
    rng: np.random.Generator, *, seq_len: int, num_pairs: int, num_queries: int, mqar_vocab: int
) -> dict[str, np.ndarray]:
  """One MQAR example (layout in the module docstring); arguments are assumed checked."""
  total_len = seq_len + 1
  keys_N = rng.choice(mqar_vocab, num_pairs, replace=False)
  values_N = mqar_vocab + rng.choice(mqar_vocab, num_pairs, replace=False)
  tokens_T = (2 * mqar_vocab + rng.integers(0, mqar_vocab, total_len)).astype(np.int32)
  tokens_T[0 : 2 * num_pairs : 2] = keys_N
  tokens_T[1 : 2 * num_pairs : 2] = values_N

  # Query starts: M sorted distinct offsets c_j in [0, free - M), then p_j = c_j + j keeps
  # consecutive (query, answer) pairs at least 2 apart and the last answer inside the tail.
  free_len = total_len - 2 * num_pairs
  offsets_M = np.sort(rng.choice(free_len - num_queries, num_queries, replace=False))
  query_pos_M = 2 * num_pairs + offsets_M + np.arange(num_queries)
  queried_pair_M = rng.choice(num_pairs, num_queries, replace=False)
  tokens_T[query_pos_M] = keys_N[queried_pair_M]
  tokens_T[query_pos_M + 1] = values_N[queried_pair_M]

  weights_L = np.zeros(seq_len, np.float32)
  weights_L[query_pos_M] = 1.0  # input is the query key, target its value
  return {"inputs": tokens_T[:-1], "targets": tokens_T[1:], "weights": weights_L}


def random_tokens_example(
    rng: np.random.Generator, *, seq_len: int, random_vocab: int
) -> dict[str, np.ndarray]:
  """Uniform tokens in [0, random_vocab); every position weighted."""
  tokens_T = rng.integers(0, random_vocab, seq_len + 1).astype(np.int32)
  return {
      "inputs": tokens_T[:-1],
      "targets": tokens_T[1:],
      "weights": np.ones(seq_len, np.float32),
  }


class SyntheticSource:
  """Random-access source of generated examples: item i = f(seed, split, i).

  Satisfies grain's RandomAccessDataSource protocol (`__len__`, `__getitem__`), so it can be
  wrapped with `grain.MapDataset.source`.
  """

  def __init__(self, data_cfg, *, seed: int, split: str = "train"):
    if split not in SPLIT_STREAMS:
      raise ValueError(f"split must be one of {tuple(SPLIT_STREAMS)}, got {split!r}")
    if seed < 0:
      raise ValueError(f"seed must be >= 0 for synthetic data, got {seed}")
    self.task = str(data_cfg.synthetic_task)
    self.seq_len = int(data_cfg.seq_len)
    if self.seq_len < 1:
      raise ValueError(f"data.seq_len must be >= 1, got {self.seq_len}")
    if self.task == "mqar":
      check_mqar_config(data_cfg)
      self._example_kwargs = dict(
          seq_len=self.seq_len,
          num_pairs=int(data_cfg.mqar_num_pairs),
          num_queries=int(data_cfg.mqar_num_queries),
          mqar_vocab=int(data_cfg.mqar_vocab))
      self._make_example = mqar_example
    elif self.task == "random":
      random_vocab = int(data_cfg.random_vocab)
      if random_vocab < 1:
        raise ValueError(f"data.random_vocab must be >= 1, got {random_vocab}")
      self._example_kwargs = dict(seq_len=self.seq_len, random_vocab=random_vocab)
      self._make_example = random_tokens_example
    else:
      raise ValueError(
          f"data.synthetic_task must be one of {SYNTHETIC_TASKS}, got {self.task!r}")
    self.seed = int(seed)
    self.split = split
    self.document_mask = doc_lib.document_mask(data_cfg)

  def __len__(self) -> int:
    return SYNTHETIC_LENGTH

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < SYNTHETIC_LENGTH:
      raise IndexError(f"synthetic example index {index} out of range")
    rng = np.random.default_rng([self.seed, SPLIT_STREAMS[self.split], index])
    example = self._make_example(rng, **self._example_kwargs)
    if self.document_mask:
      example.update(doc_lib.single_document(self.seq_len))
    return example

  def __repr__(self) -> str:
    return f"SyntheticSource(task={self.task!r}, split={self.split!r}, seed={self.seed})"
