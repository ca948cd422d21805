"""Causal multi-head (optionally grouped-query) self-attention with RoPE: the baseline mixer,
plus the attention-sink and streaming-cache options every softmax-attention mixer shares.

    q, k, v = x W_q, x W_k, x W_v;  q, k <- RoPE(q, k);  y = softmax(q k^T / sqrt(d_h)) v W_o

Sink options (`SinkLogitOptions`, part of `SinkOptions`; SPEC.md section 3;
`config.model.<mixer>.sink_logit`, also taken by sliding_window and sinkhorn):
- "none": the plain softmax;
- "learned": a learnable logit per head, an extra softmax column with a zero value that is then
  dropped (gpt-oss "sinks"): p_ij = e^{s_ij} / (e^{sink_h} + sum_j' e^{s_ij'}). Initialised at
  0, no weight decay;
- "softmax1": the same column with the logit fixed at 0 ("Attention is off by one").
All three go to `core.attend(sink_logit_H=...)`, which every implementation supports natively.

Decoding caches (`cache`, changeable at inference: parameters do not depend on it):
- "dense": a linear `kv_state` buffer of `capacity` slots, keys stored after RoPE at their
  absolute positions (the whole stream; the default);
- "window": the last `cache_window` tokens, query included (a `kv_state` ring);
- "streaming": StreamingLLM (Xiao et al. 2023): the first `cache_sinks` tokens of the stream
  plus the last `cache_window` tokens (query included), `kv_state.write(..., sinks=n)`.
For "window" and "streaming" keys are cached BEFORE RoPE and rotated at call time by positions
assigned inside the cache, as in the paper: the visible keys of a query, oldest first, sit at
0, 1, ..., and the query at m = their number (cache [0,1,2,3,6,7,8] decoding token 9 uses 0..7).
For a query at stream position p: m = min(p, n + W - 1) (n sinks, W window). A window key at
stream position j gets m - (p - j): the true distance p - j; a sink key j gets j: distance
m - j. So only the sinks' distances are rewritten. Implementation, exact for chunks of any
length <= W (each query has its own m):
  * queries and non-sink keys are rotated by stream position minus one per-row base
    b = max(0, p_first - (n + W - 1)) (p_first: the first valid query of the row): every
    relative distance is the true one, and every angle stays below n + 2W however long the
    stream (fp32 RoPE angles of positions ~1e6 would lose ~0.1 rad);
  * the n sink slots (slot i holds stream token i) take part in the one `attend` call with a
    zero key and their exact score as an additive bias: scale * R(m_p) q_p . R(j) k_j, an
    [B, H, T, n] einsum;
  * masking uses stream positions: a sink slot is given the first query's position (always
    causal and inside the window for the chunk), other keys their own, window = W.
With n + W >= the stream length nothing is evicted, m = p, and the result is dense attention.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.attention import kv_state
from attn_jax.attention.core import attend, causal_positions, choose_impl, positional_mask
from attn_jax.config import ModelConfig
from attn_jax.layers import Linear, apply_rope, dtype_of, param, rope_angles
from attn_jax.registry import register_mixer

SINK_LOGITS = ("none", "learned", "softmax1")
CACHES = ("dense", "window", "streaming")


def _int_at_least(v, lo: int) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclasses.dataclass(frozen=True)
class SinkLogitOptions:
  """The sink-logit option alone, for softmax mixers whose decoding state is their own (a ring
  for sliding_window, a block buffer for sinkhorn) and so take no `cache` options."""
  sink_logit: str = "none"      # none | learned (per-head logit) | softmax1 (logit fixed at 0)

  def validate_sink_logit(self, where: str) -> None:
    if self.sink_logit not in SINK_LOGITS:
      raise ValueError(f"{where}.sink_logit: {self.sink_logit!r} not in {SINK_LOGITS}")


@dataclasses.dataclass(frozen=True)
class SinkOptions(SinkLogitOptions):
  """Options shared by the softmax-attention mixers with a KV cache (attention, SISA): the sink
  logit plus the decoding cache; see the module docstring."""
  cache: str = "dense"          # decoding cache: dense | window | streaming (StreamingLLM)
  cache_sinks: int = 4          # streaming: first tokens of the stream kept forever
  cache_window: int = 1020      # window / streaming: most recent tokens kept (query included)

  def validate_sinks(self, where: str) -> None:
    self.validate_sink_logit(where)
    if self.cache not in CACHES:
      raise ValueError(f"{where}.cache: {self.cache!r} not in {CACHES}")
    if not _int_at_least(self.cache_sinks, 0):
      raise ValueError(f"{where}.cache_sinks: must be an integer >= 0, got {self.cache_sinks!r}")
    if not _int_at_least(self.cache_window, 1):
      raise ValueError(f"{where}.cache_window: must be an integer >= 1, got "
                       f"{self.cache_window!r}")

  @property
  def ring_sinks(self) -> int:
    """Sink slots of the ring cache (0 for "window")."""
    return self.cache_sinks if self.cache == "streaming" else 0


def make_sink_logit(cfg: ModelConfig, opts: SinkLogitOptions, rngs: nnx.Rngs):
  """The learnable per-head sink logit (None unless sink_logit == "learned")."""
  if opts.sink_logit != "learned":
    return None
  return param(rngs, nnx.initializers.zeros_init(), (cfg.n_heads,), ("heads",),
               dtype_of(cfg.param_dtype), kind="scalar")


def sink_logit_of(opts: SinkLogitOptions, sink_param, n_heads: int):
  """The [H] sink logit handed to `core.attend` (None for the plain softmax)."""
  if opts.sink_logit == "learned":
    return sink_param[...].astype(jnp.float32)
  if opts.sink_logit == "softmax1":
    return jnp.zeros((n_heads,), jnp.float32)
  return None


# Attention cores whose backward would otherwise keep the [T, S] probabilities: the full
# forward recomputes them instead (jax.checkpoint on the core only). On CPU this is faster as
# well as smaller — recomputing the scores costs less than storing and reloading them
# (`experiments/bench.py --preset=issue9`, figures in the README). Fused kernels (cuDNN, splash)
# keep O(T) residuals and are not rematerialised.
REMAT_CORE_IMPLS = ("einsum", "blocked", "xla")


def probs_with_sink(scores_BHTS, sink_H):
  """Explicit softmax over [scores ; sink column] ([B, H, T, S + 1], fp32): what a layer's
  attention map is (`attention_probs`). The last column is the sink's share (0 without one)."""
  s = scores_BHTS.astype(jnp.float32)
  col = jnp.full(s.shape[:3] + (1,), -jnp.inf) if sink_H is None else jnp.broadcast_to(
      sink_H.astype(jnp.float32)[None, :, None, None], s.shape[:3] + (1,))
  return jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)


def qk_probs(mixer, x_BTD, window: int | None = None):
  """Attention map of a q.k mixer (RoPE at positions 0..T-1, causal, optional window, its sink
  logit): [B, H, T, T + 1] fp32."""
  cfg = mixer.cfg
  B, T, _ = x_BTD.shape
  pos = causal_positions(B, T)
  q, k, _ = mixer.proj.rotated_qkv(x_BTD, pos, cfg.rope_theta)
  k = jnp.repeat(k, cfg.n_heads // cfg.kv_heads, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
  s = jnp.where(positional_mask(pos, pos, True, window), s * cfg.head_dim ** -0.5, -jnp.inf)
  return probs_with_sink(s, sink_logit_of(mixer.opts, mixer.sink_logit, cfg.n_heads))


class QKVProjection(nnx.Module):
  """The q/k/v/o projections shared by attention-style mixers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, K, Dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, init_std=cfg.init_std)
    self.q = Linear((D,), (H, Dh), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
    self.k = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    self.v = Linear((D,), (K, Dh), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
    kw["init_std"] = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # scaled residual init
    self.o = Linear((H, Dh), (D,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)

  def rotated_qkv(self, x_BTD, positions_BT, rope_theta: float):
    """q, k after RoPE at `positions` (padding's -1 rotates harmlessly: it is masked), and v."""
    q, k, v = self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)
    return rope(q, positions_BT, rope_theta), rope(k, positions_BT, rope_theta), v


def rope(x_BTHD, positions_BT, theta: float):
  cos, sin = rope_angles(positions_BT, x_BTHD.shape[-1], theta)
  return apply_rope(x_BTHD, cos, sin)


# ------------------------------------------------------------------ the ring (window / streaming)

def ring_frame(positions_BT, n_sink: int, window: int):
  """(base [B], m [B, T]): RoPE positions in the cache are stream position - base; a query's
  position as seen by the sinks is m (see the module docstring)."""
  valid = positions_BT >= 0
  first = jnp.min(jnp.where(valid, positions_BT, jnp.iinfo(jnp.int32).max), axis=1)
  first = jnp.where(jnp.any(valid, axis=1), first, 0)
  base = jnp.maximum(first - (n_sink + window - 1), 0)
  m = jnp.minimum(positions_BT, n_sink + window - 1)
  return base, m, first


def ring_attend(q_BTHE, q_sink_BTHE, k_buf_BSKE, v_buf_BSKV, k_new_BTKE, v_new_BTKV,
                pos_buf_BS, positions_BT, first_B, *, n_sink: int, window: int, scale: float,
                impl: str, sink_logit_H=None, bias_new_BHTT=None):
  """One attend call over [ring buffer ; new tokens] with the StreamingLLM positions.

  q: queries in the ring frame; q_sink: the same queries as the sinks see them (rotated by m);
  k_buf: buffered keys in the ring frame, except slots < n_sink: the sinks' keys rotated by
  their own stream position (their score goes in as a bias, their key is zeroed). Q/K may be
  widened (SISA); `bias_new`: an extra score bias on the new keys ([B, H, T, T])."""
  B, T, H, _ = q_BTHE.shape
  S, K = k_buf_BSKE.shape[1], k_buf_BSKE.shape[2]
  impl = choose_impl(impl, q_BTHE.dtype, q_BTHE.shape[-1])
  bias = None
  mask_pos_BS = pos_buf_BS
  if n_sink:
    ks = k_buf_BSKE[:, :n_sink]
    qs = q_sink_BTHE.reshape(B, T, K, H // K, -1)
    s_sink = jnp.einsum("btkge,bske->bkgts", qs, ks, preferred_element_type=jnp.float32)
    s_sink = s_sink.reshape(B, H, T, n_sink) * scale
    k_buf_BSKE = k_buf_BSKE.at[:, :n_sink].set(0)
    bias = jnp.pad(s_sink, ((0, 0), (0, 0), (0, 0), (0, S - n_sink + T)))
    is_sink = (jnp.arange(S) < n_sink)[None, :] & (pos_buf_BS >= 0)
    mask_pos_BS = jnp.where(is_sink, first_B[:, None], pos_buf_BS)
  if bias_new_BHTT is not None:
    new = jnp.pad(bias_new_BHTT.astype(jnp.float32), ((0, 0), (0, 0), (0, 0), (S, 0)))
    bias = new if bias is None else bias + new
  if bias is not None and impl == "cudnn":
    bias = bias.astype(q_BTHE.dtype)
  dt = q_BTHE.dtype
  keys = jnp.concatenate([k_buf_BSKE.astype(dt), k_new_BTKE.astype(dt)], axis=1)
  vals = jnp.concatenate([v_buf_BSKV.astype(dt), v_new_BTKV.astype(dt)], axis=1)
  kv_pos = jnp.concatenate([mask_pos_BS, positions_BT.astype(jnp.int32)], axis=1)
  return attend(q_BTHE, keys, vals, scale=scale, causal=True, q_positions=positions_BT,
                kv_positions=kv_pos, window=window, bias=bias, sink_logit_H=sink_logit_H,
                impl=impl)


def ring_keys(k_buf_BSKD, pos_buf_BS, base_B, n_sink: int, theta: float):
  """Buffered pre-RoPE keys rotated for `ring_attend`: slots < n_sink by their stream position,
  the others by stream position - base."""
  slot_sink = (jnp.arange(k_buf_BSKD.shape[1]) < n_sink)[None, :]
  rpos = jnp.where(slot_sink, pos_buf_BS, pos_buf_BS - base_B[:, None])
  return rope(k_buf_BSKD, rpos, theta)


def init_ring(cfg: ModelConfig, opts: SinkOptions, batch: int, dtype, **extra) -> dict:
  return kv_state.init_kv_state(batch, opts.ring_sinks + opts.cache_window, cfg.kv_heads,
                                cfg.head_dim, cfg.head_dim, dtype, **extra)


# ------------------------------------------------------------------ flops

def attention_flops_per_token(n_heads: int, d_qk: int, d_v: int, keys: float) -> float:
  """Scores (d_qk) and values (d_v) per query against `keys` keys: 2 FLOPs per MAC."""
  return 2.0 * n_heads * (d_qk + d_v) * keys


def causal_keys(seq_len: int, window: int | None = None) -> float:
  """Mean keys per query of a causal (optionally windowed) sequence of `seq_len` tokens: the
  lower triangle only ((L+1)/2 without a window), as in the FlashAttention/MaxText convention."""
  L = seq_len
  if window is None or window >= L:
    return (L + 1) / 2.0
  w = window  # the first w queries see 1..w keys, the rest w each
  return (w * (w + 1) / 2.0 + (L - w) * w) / L


# ------------------------------------------------------------------ the mixer

@register_mixer("attention")
class Attention(nnx.Module):

  @dataclasses.dataclass(frozen=True)
  class Options(SinkOptions):
    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      self.validate_sinks(where)

  def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def __call__(self, x_BTD, *, positions_BT, state=None, rng=None, train=False):
    del rng, train
    cfg, opts = self.cfg, self.opts
    B, T, _ = x_BTD.shape
    scale = cfg.head_dim ** -0.5
    sink = sink_logit_of(opts, self.sink_logit, cfg.n_heads)
    if state is not None and opts.cache != "dense":
      return self._ring(x_BTD, positions_BT, state, sink)
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = self.proj.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    if state is None:  # positions None: plain 0..T-1, the kernels' fast causal path
      core_fn = lambda q, k, v, sink: attend(
          q, k, v, scale=scale, causal=True, q_positions=positions_BT,
          kv_positions=positions_BT, sink_logit_H=sink, impl=cfg.attention_impl)
      if choose_impl(cfg.attention_impl, q.dtype, q.shape[-1]) in REMAT_CORE_IMPLS:
        core_fn = jax.checkpoint(core_fn)
      return self.proj.o(core_fn(q, k, v, sink)), None, {}
    keys = kv_state.with_new(state, {"k": k, "v": v}, positions_BT)
    out = attend(q, keys["k"].astype(q.dtype), keys["v"].astype(q.dtype), scale=scale,
                 causal=True, q_positions=positions_BT, kv_positions=keys["pos"],
                 sink_logit_H=sink, impl=cfg.attention_impl)
    state = kv_state.write(state, {"k": k, "v": v}, positions_BT, ring=False)
    return self.proj.o(out), state, {}

  def _ring(self, x_BTD, positions_BT, state, sink):
    """window / streaming cache: keys cached before RoPE (see the module docstring)."""
    cfg, opts, th = self.cfg, self.opts, self.cfg.rope_theta
    n, W = opts.ring_sinks, opts.cache_window
    p = self.proj
    q, k, v = p.q(x_BTD), p.k(x_BTD), p.v(x_BTD)
    base, m, first = ring_frame(positions_BT, n, W)
    rel = positions_BT - base[:, None]
    out = ring_attend(rope(q, rel, th), rope(q, m, th),
                      ring_keys(state["k"], state["pos"], base, n, th), state["v"],
                      rope(k, rel, th), v, state["pos"], positions_BT, first, n_sink=n,
                      window=W, scale=cfg.head_dim ** -0.5, impl=cfg.attention_impl,
                      sink_logit_H=sink)
    state = kv_state.write(state, {"k": k, "v": v}, positions_BT, ring=True, sinks=n)
    return p.o(out), state, {}

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward (last column: the sink); diagnostics."""
    return qk_probs(self, x_BTD)

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts, batch: int, capacity: int, dtype) -> dict:
    if opts.cache != "dense":
      return init_ring(cfg, opts, batch, dtype)
    return kv_state.init_kv_state(batch, capacity, cfg.kv_heads, cfg.head_dim, cfg.head_dim,
                                  dtype)

  @classmethod
  def max_chunk(cls, cfg: ModelConfig, opts, capacity: int) -> int | None:
    return None if opts.cache == "dense" else opts.cache_window

  @classmethod
  def stream_limit(cls, cfg: ModelConfig, opts, capacity: int) -> int | None:
    return capacity if opts.cache == "dense" else None   # a ring holds any stream

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts, seq_len: int) -> float:
    return attention_flops_per_token(cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                     causal_keys(seq_len))
