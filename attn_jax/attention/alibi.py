"""ALiBi (Press, Smith, Lewis, "Train Short, Test Long: Attention with Linear Biases", ICLR
2022): the position-prior baseline of the score-bias family (docs/papers.md §6.3).

    s_ij = q_i.k_j / sqrt(d_h) - m_h (i - j)        (j <= i; no RoPE, no positional embedding)

Slopes (the paper's): for H a power of two, m_h = 2^(-8 h / H), h = 1..H (H = 8: 1/2, 1/4, ...,
1/256). Otherwise, with n the largest power of two below H, the n slopes of n heads followed by
every other slope of 2n heads (the odd-indexed ones 2^(-4 / n), 2^(-12 / n), ...) until H.

Why a mixer and not an option of `attention`: -m_h (i - j) is Forgetting Attention with a fixed
log forget rate, log f_t = -m_h, so g_i - g_j = -m_h (i - j) exactly (i - j counts the tokens in
between). ALiBi therefore runs on FoX's exact blockwise path and decoding state (score_bias.py and
kernels/forget_xla.py: the bias never goes through a [T, T] tensor, the cache stores
g_j = -m_h n_j), with no RoPE; an
`attention` option would have needed a second attention core and a second cache layout inside
attention's RoPE-based caches. Counting tokens rather than subtracting positions makes padding
(position -1, log f = 0) free: a right-padded row's distances are its own tokens'.

Packed rows: as FoX (score_bias.py): pairs of different documents are masked, and within a document
g_i - g_j = -m_h (i - j) counts only that document's tokens, exactly its alone value.

Eviction (a `Ring` / `SinksRing` policy at decode time): the cache keeps g_j - g_last, so a kept key keeps its
true distance; with sinks, a sink's bias is -m_h times its full distance (as in a full cache,
unlike StreamingLLM's re-assigned positions), so low-slope heads still read it and steep heads
do not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax.attention.projection import QKVProjection, make_sink_logit
from attn_jax.attention.score_bias import BiasOptions, ScoreBiasAttention
from attn_jax.layers import stat_dtype
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


def alibi_slopes(n_heads: int) -> np.ndarray:
  """The paper's per-head slopes m_h (module docstring), float64 [H]."""
  def power_of_two(n):
    return np.array([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)])

  n = 2 ** int(math.floor(math.log2(n_heads)))
  if n == n_heads:
    return power_of_two(n)
  return np.concatenate([power_of_two(n), power_of_two(2 * n)[0::2][:n_heads - n]])


@register_mixer("alibi")
class ALiBi(ScoreBiasAttention):
  """ALiBi attention (module docstring). Options: `config.model.alibi`."""

  @dataclasses.dataclass(frozen=True)
  class Options(BiasOptions):     # the block and the sink logit only (score_bias.BiasOptions)
    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      self.validate_bias(where)

  def __init__(self, cfg: ModelConfig, opts: "ALiBi.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def features(self, x_BTD, positions_BT, state, segment_ids_BT=None):
    del state, segment_ids_BT   # no token shift: the core's document masks suffice
    p, f = self.proj, stat_dtype(self.cfg)
    B, T, _ = x_BTD.shape
    loga = jnp.broadcast_to(-jnp.asarray(alibi_slopes(self.cfg.n_heads), f), (B, T,
                                                                              self.cfg.n_heads))
    if positions_BT is not None:
      loga = jnp.where((positions_BT >= 0)[..., None], loga, 0.0)
    return *p.qkv(x_BTD), loga, {}

  def finish(self, y_BTHD, x_BTD):
    return y_BTHD
