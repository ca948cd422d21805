"""Attention whose logit decays with a cumulative per-head log rate: the score-bias family's
shared mixer body (FoX, fox.py; ALiBi, alibi.py), its options, its decoding state and its
explicit reference.

    s_ij = q_i.k_j / sqrt(d_h) + (g_i - g_j),   g_t = sum_{s<=t} log f_t   (log f <= 0)

A subclass computes its features (q, k, v, log f) and the output transform; the full forward
hands them to the kernels room (`entry.attend_decayed` with `entry.LogitDecay`: the decayed
Pallas kernel on GPU / TPU, the exact blockwise XLA core elsewhere, kernels/forget_xla.py),
which chooses and calls the core.

Padding (position -1) gets log f = 0: it leaves g unchanged. The full forward is index-causal
(right-padded rows: padding sits after the row's tokens), as SISA's chunked path.


Decoding (`init_state`, `ScoreBiasState`): the typed KV cache (`cache.py`) whose per-key extra is
s_j = g_j - g_last (<= 0, g_last: the row's running g after its last token), plus, with a token
shift, the last projected key / value. T new tokens attend to [cache ; themselves] with the
bias ell_i - s_j for cached keys and ell_i - ell_j among themselves, ell = the cumulative log f
over the new tokens only; then every s_j moves by the new tokens' decay. The large running sum
never forms, under any policy.

Eviction and the forget gate (a `Ring(W)` / `SinksRing(n, W)` policy at decode time; with
`rope=False` only, since FoX's ring keeps keys without RoPE). The cache's s_j is shifted by the
new tokens' decay after every call, so a kept key keeps its true decay to the query, accumulated
over every token in between, evicted ones included. Evicting a key j removes a weight proportional
to e^{g_i - g_j + q.k scale}: for a head that forgets (g_i - g_{i-W} << 0 across the window) the
window loses exponentially little, so a ring is close to exact; a head with f ~ 1 loses what
attention loses. The StreamingLLM sinks are decayed like any old key (their logit includes
g_i - g_sink, the whole stream's decay), so under forgetting they cannot soak up attention mass as
they do in a Transformer; the learned sink *logit* (`sink_logit`, a constant column, not decayed)
still can.

"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import SinkLogitOptions, probs_with_sink, sink_logit_of
from attn_jax.field_checks import field_check, is_int
from attn_jax.kernels import entry
from attn_jax.kernels.forget_xla import DEFAULT_BLOCK, PATHS, cumsum2, pair_decay2
from attn_jax.kernels.masks import segment_mask
from attn_jax.layers import stat_dtype, time_cumsum

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BiasOptions(SinkLogitOptions):
  """Options of the score-bias mixers (fox, alibi): the sink logit plus the block."""
  block_size: int = 0             # block of the blockwise path; 0 = auto (256)
  path: str = "auto"              # blocked | flash | auto (CPU: blocked up to BLOCKED_MAX_LEN)

  def validate_bias(self, where: str) -> None:
    check = field_check(where)
    check(is_int(self.block_size, 0), "block_size",
          f"must be an integer >= 0 (0 = auto), got {self.block_size!r}")
    check(self.path in PATHS, "path", f"must be one of {' | '.join(PATHS)}, got {self.path!r}")
    self.validate_sink_logit(where)

  @property
  def block(self) -> int:
    return int(self.block_size) or DEFAULT_BLOCK


class ScoreBiasState(NamedTuple):
  """Decoding state of a score-bias mixer: the KV cache, whose per-key extra is g_j - g_last
  [B, S, H] (fp32; <= 0), and the token-shift carry (previous projected key / value)."""
  cache: cache_lib.KVCache
  carry: dict


class ScoreBiasAttention(cache_lib.CachedMixer):
  """Attention with the logit bias g_i - g_j, g a cumulative per-head log forget rate.

  Subclasses own their parameters and define `features(x, positions, state, segment_ids=None)
  -> (q, k, v, log f, carry)` (q, k after any RoPE; carry: extra state entries such as the
  token-shift keys) and `finish(y, x)` (the output before W_o). Everything else (blockwise
  forward, caches, hooks) is here."""

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    cfg, opts = self.cfg, self.opts
    q, k, v, loga, carry = self.features(x_BTD, positions_BT, state, segment_ids_BT)
    sink = sink_logit_of(opts, self.sink_logit, cfg.n_heads)
    if state is None:
      y, _ = entry.attend_decayed(q, k, v, entry.LogitDecay(loga, opts.block),
                                  scale=cfg.head_dim ** -0.5, impl=cfg.attention_impl,
                                  path=opts.path, sink_logit_H=sink,
                                  segment_ids_BT=segment_ids_BT, what=type(self).__name__)
    else:
      y, kv = self._cached(q, k, v, loga, positions_BT, state.cache, sink)
      state = ScoreBiasState(kv, carry)
    aux = {"forget": jnp.mean(jnp.exp(loga))}       # mean forget rate (1 = no forgetting)
    return self.proj.o(self.finish(y, x_BTD)), state, aux

  def _cached(self, q, k, v, loga, positions_BT, kv: cache_lib.KVCache, sink):
    """T new tokens after the cache: bias ell_i - s_j on cached keys (s_j = g_j - g_last, kept
    relative under every policy), ell_i - ell_j among the new ones (ell: the new tokens' own
    cumulative log f); then every s_j moves by the new tokens' decay and the new keys join
    with s_j = ell_j - ell_last. Both differences of ell come from its double-word cumulative
    sum (`forget_xla.cumsum2`), so a long prefill under strong forgetting rounds each pair's
    decay at its own size, as the training paths do (module docstring). A prefill's first call into a
    dense cache (`kv.fresh`, `Linear`) on GPU / TPU takes the full forward's kernel for its
    outputs (`entry.fused_prefill`: no [T, T] bias), then writes the same keys."""
    cfg = self.cfg
    hi, lo = cumsum2(loga)         # ell as a double word: differences rounded at their size
    ell = hi + lo                                                      # [B, T, H]
    fused = None
    if kv.fresh and not kv.policy.bounded:
      fused = entry.fused_prefill(q, k, v, entry.LogitDecay(loga), scale=cfg.head_dim ** -0.5,
                                  impl=cfg.attention_impl, positions_BT=positions_BT,
                                  sink_logit_H=sink, what=f"{type(self).__name__} prefill")
    last = ell[:, -1]                       # padding (log f = 0) keeps the last valid g
    own = (hi - hi[:, -1:]) + (lo - lo[:, -1:])                        # ell_j - ell_last
    written = kv.write(k, v, positions_BT, own,
                       extra_update=lambda e: e - last[:, None].astype(e.dtype))
    if fused is not None:
      out = fused(q, k)
    elif cache_lib.writes_first(kv, q):
      # one token: the written cache's -s_j is ell_i - s_j of every cached key (the shift by
      # ell_i, then negated: the same rounding) and 0 = ell_i - ell_i for the token itself
      rel = jnp.where((written.pos >= 0)[..., None], -written.extra, 0.0)
      out = cache_lib.attend_written(written, q, positions_BT, scale=cfg.head_dim ** -0.5,
                                     bias=rel.transpose(0, 2, 1)[:, :, None, :],
                                     sink_logit_H=sink)
    else:
      out = self._attend_cache(q, k, v, (hi, lo), positions_BT, kv, sink)
    return out, written

  def _attend_cache(self, q, k, v, ell2, positions_BT, kv: cache_lib.KVCache, sink):
    """`attend_cache` with the decay bias: ell_i - s_j on cached keys, ell_i - ell_j (from the
    double word `ell2`) among the new ones."""
    T, (hi, lo) = q.shape[1], ell2
    rel = jnp.where((kv.pos >= 0)[..., None], -kv.extra, 0.0)          # g_last - g_j
    rel = rel.transpose(0, 2, 1)[:, :, None, :]                        # [B, H, 1, S]
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    new = jnp.where(causal, pair_decay2((hi, lo), (hi, lo)), 0.0)      # [B, H, T, T]
    bias = jnp.concatenate([(hi + lo).transpose(0, 2, 1)[..., None] + rel, new], axis=-1)
    return cache_lib.attend_cache(kv, q, k, v, positions_BT, scale=self.cfg.head_dim ** -0.5,
                                  bias=bias, sink_logit_H=sink)

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward from the explicit reference's scores
    (last column: the sink); diagnostics."""
    q, k, v, loga, _ = self.features(x_BTD, None, None)
    _, s = forget_attention_reference(q, k, v, time_cumsum(loga),
                                      scale=self.cfg.head_dim ** -0.5)
    return probs_with_sink(s, sink_logit_of(self.opts, self.sink_logit, self.cfg.n_heads))

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads): blocks of 8 so
    that short test sequences take the blocked path."""
    return dataclasses.replace(cls.Options(), block_size=8)

  @classmethod
  def cache_policy(cls, cfg, opts, policy):
    policy = super().cache_policy(cfg, opts, policy)
    if getattr(opts, "rope", False) and policy.bounded:
      raise ValueError(f"fox.rope: the {policy.label} cache needs rope=False (a ring keeps keys "
                       "without re-assigned RoPE positions; see fox.py)")
    return policy

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts, batch: int, capacity: int, dtype,
                 policy=None) -> ScoreBiasState:
    g = jax.ShapeDtypeStruct((cfg.n_heads,), stat_dtype(cfg))   # g_j - g_last per key
    kv = cache_lib.init_cache(cls.cache_policy(cfg, opts, policy), batch, capacity, cfg.kv_heads,
                              cfg.head_dim, cfg.head_dim, dtype, extra=g)
    return ScoreBiasState(kv, cls.carry_state(cfg, opts, batch, dtype))

  @classmethod
  def carry_state(cls, cfg, opts, batch, dtype) -> dict:
    return {}

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return entry.attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                           entry.causal_keys(seq_len))


def forget_attention_reference(q_BTHD, k_BTKD, v_BTKE, g_BTH, *, scale: float,
                               sink_logit_H=None, query_idx=None, segment_ids_BT=None):
  """Explicit O(T^2) Forgetting Attention (the tests' ground truth), in fp32 (fp64 for
  float64): masked softmax of q_i.k_j scale + (g_i - g_j), g the cumulative log f, with an
  optional sink column. `query_idx` restricts the query rows; `segment_ids_BT` masks pairs of
  different documents. Returns (out, scores)."""
  f32 = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
  T = k_BTKD.shape[1]
  idx = jnp.arange(T) if query_idx is None else jnp.asarray(query_idx)
  G = q_BTHD.shape[2] // k_BTKD.shape[2]
  k, v = jnp.repeat(f32(k_BTKD), G, axis=2), jnp.repeat(f32(v_BTKE), G, axis=2)
  g = f32(g_BTH)
  s = jnp.einsum("bihd,bjhd->bhij", f32(q_BTHD)[:, idx], k) * scale
  s = s + g[:, idx].transpose(0, 2, 1)[..., :, None] - g.transpose(0, 2, 1)[..., None, :]
  vis = idx[:, None] >= jnp.arange(T)[None, :]
  if segment_ids_BT is not None:
    vis = vis & segment_mask(segment_ids_BT[:, idx], segment_ids_BT)[:, None]
  s = jnp.where(vis, s, -jnp.inf)
  p = probs_with_sink(s, sink_logit_H)[..., :-1]
  return jnp.einsum("bhij,bjhd->bihd", p, v), s
