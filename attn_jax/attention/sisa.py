"""SISA: SSM-informed softmax attention, exact and causal at any length.

Paper: "Forget Attention: Importance-Aware Attention Is All You Need" (arXiv 2606.02332, 2026);
docs/papers.md §1. Per head h, with x = RMSNorm(input), d_h = d_model / H, d_s = d_state:

    q, k, v = x W_q, x W_k, x W_v;  q, k <- RoPE(q, k)            (ordinary positions)
    B_t = W_B x_t,  C_t = W_C x_t                                  ([H, d_s] per token)
    log a_t = -softplus(w_a . x_t + b)                             (one per head; b init -5)
    theta_t = W_theta x_t                                          ([H, d_s/2] angles)
    g_t = sum_{s<=t} log a_s,  Phi_t = sum_{s<=t} theta_s mod 2 pi (fp32 cumulative sums)
    lambda = softplus(lambda_raw)                                  (fp32, lambda_raw init -1)

    score_ij = q_i.k_j / sqrt(d_h) + lambda * e^{g_i - g_j} * (R(Phi_i) C_i) . (R(Phi_j) B_j)
    y_i = sum_{j<=i} softmax_j(score_ij) v_j,   out = y W_o

R(Phi) rotates the interleaved pairs (0,1), (2,3), ... of a d_s vector by the d_s/2 angles of
Phi (a data-dependent RoPE, as in Mamba-3); the match depends on Phi_j - Phi_i only.

One attention call, as in the paper: with a reference r (below),
    Q^ = [q ; lambda sqrt(d_h) e^{g_i - r} R(Phi_i) C_i],   K^ = [k ; e^{r - g_j} R(Phi_j) B_j],
scale 1/sqrt(d_h); V stays d_h wide (cores that need it as wide as Q are given it zero-padded,
exact). s^2 = lambda sqrt(d_h) sits on the query side (the paper splits s = d_h^{1/4}
sqrt(lambda) over both): the same products, without d sqrt(lambda)/d lambda = inf at 0.

Exact at any length, with no clamp (the authors' code clamps g - c to [-11, 11] with c read
from the whole sequence: wrong past 22 nats of decay, and not causal). Every exponential that
is evaluated is <= 1 or <= e^T for a fixed T, and no reference reads a later token:

The full forward hands these features to the kernels room (`entry.attend_decayed` with
`entry.MatchDecay`), which chooses and calls the core: the decayed Pallas kernel on GPU / TPU
(kernels/decayed.py: exact at any decay range in one call), else kernels/sisa_xla.py's paths:
- fast (`path="fast"`): r = 0, one softmax-attention call; query factors e^{g_i} <= 1, key
  factors e^{-g_j} <= e^T, valid while the decay range -g_{T-1} <= T = `fast_max_range` (60
  nats, 4 for float16): inside the fp32/bf16 exponent range with headroom for B, C and lambda.
- chunked (`path="chunked"`): blocks of c tokens (`chunk_size`); a query block and an earlier
  key block take r = g at the key block's last token, so both factors are <= 1; a block's own
  pairs enter as a [c, c] bias lambda e^{g_i - g_j} C.B formed from the difference
  g_i - g_j <= 0 (Mamba-2's segsum); the parts are combined by log-sum-exp, the past in O(T)
  memory, or, with a fused cuDNN core, query chunks whose past goes through that kernel.
- `path="auto"`: a `jax.lax.cond` on the measured range -min g (both paths compute the same
  function). A cond keeps both branches' residuals, so with a core in
  `kernel_choice.REMAT_CORE_IMPLS` both branches are rematerialised; fused cores keep O(T) residuals.
- decoding / prefill (`_cached`): the chunked path with one chunk after the cache, r = g of
  the last cached token; cached g_j are stored relative to it, so a one-token step has factors
  a_i <= 1 and <= 1 at any length. The state (`SISAState`) is a `cache.KVCache` with SISA's
  per-key R(Phi_j) B_j (its extra key channels, `kx`) and g_j - r (`SISAKeys`) plus the
  running g and Phi. The cache policy
  (`attention/cache.py`, chosen at decode time) re-assigns only the q.k part's RoPE positions:
  a key keeps its g_j and R(Phi_j) B_j, so a sink sees the true decay since it.

Padding tokens (position -1) get log a = 0 and theta = 0: they leave g and Phi unchanged.
Packed rows (`segment_ids_BT`): g and Phi restart at every document start and pairs of other
documents are masked on every path; a chunked reference that lies in another document is
clamped to a factor <= 1 (sisa_xla.py, a no-op on visible pairs). `reads_shared_prefix` is
False (a shared prefix has no meaningful decay to a restarted g).

Precision: g and Phi are fp32 cumulative sums (fp64 for a float64 model); g_i - g_j carries an
absolute error ~2^-24 |g|. Phi is wrapped mod 2 pi at every step (`phase_cumsum`, 2 pi split
in two floats), so angles stay below a few radians at any length (tested against float64 at
32K tokens). CPU sums with `lax.scan` (`jnp.cumsum` is an O(T^2) reduce_window there); GPU
and TPU have no loop over T (a while-loop iteration is a host round trip on a GPU): g by
`jnp.cumsum`, Phi by a parallel prefix of the angle as a double-float (`layers.angle_cumsum`,
closer to float64 than the loop). C, B, theta and the decay come from one matmul.

Sink logit (`sink_logit`, `projection.SinkLogitOptions`): the extra softmax column on every
path, part of the one softmax over the widened scores.

The derivations (each path's bounds, the residuals under a cond, decoding, packed rows, the
cumulative sums by backend) are in docs/sisa.md; measured costs in docs/benchmarks.md, produced
by `experiments/bench.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax import kernel_choice
from attn_jax.attention import cache as cache_lib
from attn_jax.attention.projection import (QKVProjection, SinkLogitOptions, make_sink_logit,
                                           probs_with_sink, sink_logit_of)
from attn_jax.field_checks import field_check, is_int, is_number
from attn_jax.kernels import entry
from attn_jax.kernels.masks import segment_mask
from attn_jax.kernels.sisa_xla import local_bias
from attn_jax.layers import (Linear, causal_positions, dtype_of, param, segment_starts,
                             angle_cumsum, starts_like, stat_dtype,
                             time_cumsum, time_scan)
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

PATHS = entry.DECAY_PATHS[entry.MatchDecay]   # auto | fast | chunked
# Largest fast-path decay range per compute dtype (nats): e^T must leave headroom below the
# dtype's max (fp32/bf16: e^88.7; fp16: e^11.1, and its normal range starts at e^-9.7).
_DTYPE_RANGE_LIMIT = {"float16": 4.0}
# ---------------------------------------------------------------- parameter matching

def sisa_extra_params(d_model: int, n_heads: int, d_state: int) -> int:
  """Mixer parameters SISA adds per layer over attention: W_B, W_C, w_a, b, W_theta, lambda."""
  d, H, ds = d_model, n_heads, d_state
  return 2 * d * H * ds + d * H + H + d * H * ds // 2 + H


def matched_d_ff(transformer_cfg, d_state: int, multiple: int = 4) -> int:
  """SwiGLU width that makes SISA's parameter count equal the Transformer's.

  The SwiGLU has 3 d d_ff weights, so d_ff shrinks by extra / (3 d), rounded to the nearest
  `multiple` (4 reproduces the paper's 1832 / 2748 / 2512 at d_s = 32, docs/papers.md §1.3).
  `transformer_cfg` is any object with d_model, n_heads and d_ff (ModelConfig or config.model).
  """
  d = int(transformer_cfg.d_model)
  extra = sisa_extra_params(d, int(transformer_cfg.n_heads), int(d_state))
  return int(multiple * round((int(transformer_cfg.d_ff) - extra / (3 * d)) / multiple))


# ---------------------------------------------------------------- elementwise pieces

# 2 pi as a sum of two floats (Cody-Waite): the fp32-rounded 2 pi alone is 1.7e-7 too large, an
# error every wrap would add to the phase.
_TWO_PI_HI = float(np.float32(2 * np.pi))
_TWO_PI_LO = 2 * np.pi - _TWO_PI_HI


def wrap_phase(x: jax.Array) -> jax.Array:
  """x mod 2 pi (approximately in [0, 2 pi)); exact to x's rounding for |x| of a few turns."""
  k = jnp.floor(x * (1 / (2 * np.pi)))
  return (x - k * _TWO_PI_HI) - k * _TWO_PI_LO


def phase_cumsum(theta_BTHP: jax.Array, starts_BT=None) -> jax.Array:
  """Phi_t = sum_{s<=t} theta_s mod 2 pi, every partial sum wrapped, so the angle never grows
  with t and keeps the precision of a few radians (module docstring); restarting at every
  `starts_BT` (packed rows). A token-by-token `lax.scan` on CPU, elsewhere a parallel prefix
  over the angle held as a double-float (`layers.angle_cumsum`: no loop over T on a GPU, and
  more precise than the loop: 2.4e-7 rad at 32K tokens against 4.7e-5)."""
  if kernel_choice.parallel_time_sums():
    reset = None if starts_BT is None else starts_like(starts_BT, theta_BTHP)
    return angle_cumsum(theta_BTHP, axis=1, reset=reset)
  return time_scan(lambda c, a: wrap_phase(c + a), theta_BTHP, starts_BT)


def decay_and_phase(loga_BTH, theta_BTHP, starts_BT=None):
  """g = cumsum(log a) and Phi = `phase_cumsum`(theta) over time (one scan on CPU). theta may
  be None. `starts_BT`: both restart at every document start of a packed row."""
  if theta_BTHP is None:
    return time_cumsum(loga_BTH, starts_BT), None
  if kernel_choice.parallel_time_sums():
    return time_cumsum(loga_BTH, starts_BT), phase_cumsum(theta_BTHP, starts_BT)
  both = time_scan(lambda c, a: jnp.concatenate([c[..., :1] + a[..., :1],
                                                  wrap_phase(c[..., 1:] + a[..., 1:])], -1),
                    jnp.concatenate([loga_BTH[..., None], theta_BTHP], axis=-1), starts_BT)
  return both[..., 0], both[..., 1:]


def rotate_pairs(x_BTHS: jax.Array, phi_BTHP: jax.Array) -> jax.Array:
  """R(Phi) x: interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), in Phi dtype."""
  x = x_BTHS.astype(phi_BTHP.dtype).reshape(x_BTHS.shape[:-1] + (-1, 2))
  c, s = jnp.cos(phi_BTHP), jnp.sin(phi_BTHP)
  x0, x1 = x[..., 0], x[..., 1]
  return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x_BTHS.shape)


# ---------------------------------------------------------------- explicit reference

def sisa_attention_reference(q_BTHD, k_BTHD, v_BTHD, c_BTHS, b_BTHS, g_BTH, phi_BTHP, lam_H, *,
                             query_idx=None, sink_logit_H=None, segment_ids_BT=None):
  """Explicit O(T^2) SISA attention in fp32 (the ground truth of the tests).

  q and k are after RoPE; C and B are *not* rotated; g and Phi are the cumulative sums (Phi
  None = no phase). Every pair (i, j <= i) is formed directly:
      score_ij = q_i.k_j / sqrt(d_h) + lambda e^{g_i - g_j} C_i^T R(Phi_j - Phi_i) B_j
  with e^{g_i - g_j} from the difference g_i - g_j and the rotation by the pairwise phase
  difference. `query_idx` (int array) restricts the query rows (long sequences).
  `sink_logit_H`: an explicit extra softmax column (logit sink_h, zero value), then dropped.
  `segment_ids_BT`: a packed row, pairs of different documents masked (g and Phi as given:
  the caller restarts them per document).
  Returns (out [B, Tq, H, Dv], scores [B, H, Tq, T] with -inf above the diagonal).
  """
  f32 = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
  T = k_BTHD.shape[1]
  idx = jnp.arange(T) if query_idx is None else jnp.asarray(query_idx)
  q, k, v = f32(q_BTHD)[:, idx], f32(k_BTHD), f32(v_BTHD)
  c, b = f32(c_BTHS)[:, idx], f32(b_BTHS)
  gq, gk = f32(g_BTH)[:, idx], f32(g_BTH)
  causal = idx[:, None] >= jnp.arange(T)[None, :]                          # [Tq, T]
  if segment_ids_BT is not None:                                           # [B, 1, Tq, T]
    causal = causal & segment_mask(segment_ids_BT[:, idx], segment_ids_BT)[:, None]
  qk = jnp.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
  dg = gq.transpose(0, 2, 1)[..., :, None] - gk.transpose(0, 2, 1)[..., None, :]
  dec = jnp.exp(jnp.where(causal, dg, -jnp.inf))                         # [B, H, Tq, T]
  c0, c1, b0, b1 = c[..., 0::2], c[..., 1::2], b[..., 0::2], b[..., 1::2]
  same = jnp.einsum("bihp,bjhp->bhijp", c0, b0) + jnp.einsum("bihp,bjhp->bhijp", c1, b1)
  if phi_BTHP is None:
    match = same.sum(-1)
  else:
    phi = f32(phi_BTHP)
    dphi = phi.transpose(0, 2, 1, 3)[:, :, None, :, :] - phi[:, idx].transpose(0, 2, 1, 3)[
        :, :, :, None, :]                                                  # Phi_j - Phi_i
    cross = jnp.einsum("bihp,bjhp->bhijp", c1, b0) - jnp.einsum("bihp,bjhp->bhijp", c0, b1)
    match = jnp.sum(jnp.cos(dphi) * same + jnp.sin(dphi) * cross, axis=-1)
  scores = qk + f32(lam_H)[None, :, None, None] * dec * match
  scores = jnp.where(causal, scores, -jnp.inf)
  p = probs_with_sink(scores, sink_logit_H)[..., :-1]
  return jnp.einsum("bhij,bjhd->bihd", p, v), scores


# ---------------------------------------------------------------- the mixer

class SISAFeatures(NamedTuple):
  """Per-token features of a SISA layer (`SISA.features`)."""
  q: jax.Array          # [B, T, H, d_h], after RoPE (before it for a cached call)
  k: jax.Array          # [B, T, K, d_h], likewise
  v: jax.Array          # [B, T, K, d_h]
  c: jax.Array          # [B, T, H, d_s]: C, not rotated
  b: jax.Array          # [B, T, H, d_s]: B, not rotated
  loga: jax.Array       # [B, T, H]: log a (0 on padding)
  theta: jax.Array | None   # [B, T, H, d_s/2]: the phase increments (None without phase)
  lam: jax.Array        # [H]: lambda


class SISAKeys(NamedTuple):
  """SISA's per-key data in the KV cache (beside it, R(Phi_j) B_j: the cache's extra key
  channels `kx`, [B, H, S, d_s], head-major like the keys)."""
  g: jax.Array      # [B, S, H]: g_j - g of the last cached token (>= 0)


class SISAState(NamedTuple):
  """SISA's decoding state: the KV cache and the running sums per row."""
  cache: cache_lib.KVCache
  g: jax.Array      # [B, H]: g of the last token (the stream's total decay; `decay_range`)
  phi: jax.Array    # [B, H, d_s/2]: Phi of the last token, mod 2 pi

def _rotated(c_BTHS, b_BTHS, phi_BTHP, dtype):
  """(R(Phi) C, R(Phi) B) in the sums' dtype (C, B themselves without phase)."""
  if phi_BTHP is None:
    return c_BTHS.astype(dtype), b_BTHS.astype(dtype)
  return rotate_pairs(c_BTHS, phi_BTHP), rotate_pairs(b_BTHS, phi_BTHP)


def _aux(loga_BTH, lam_H, g_BTH, chunked) -> dict:
  """The layer's monitoring values."""
  mean_loga = jnp.mean(loga_BTH)
  return {
      "lambda": jnp.mean(lam_H),
      # tokens for the mean decay to halve a weight; inf without decay
      "half_life": jnp.where(mean_loga < 0, math.log(0.5) / jnp.minimum(mean_loga, -1e-30),
                             jnp.inf),
      # total decay from the sequence start (g_-1 = 0) to the last token (packed rows: of
      # the longest-decaying document), max over batch and heads: max(g) - min(g) with the
      # empty prefix included; decides the path
      "decay_range": -jnp.min(g_BTH),
      "chunked": chunked,
  }


@register_mixer("sisa")
class SISA(cache_lib.CachedMixer):
  """SISA token mixer (see the module docstring). Options: `config.model.sisa`."""

  @dataclasses.dataclass(frozen=True)
  class Options(SinkLogitOptions):
    d_state: int = 32               # d_s: B/C channels per head (even: pairs are rotated)
    decay_bias_init: float = -5.0   # b of log a = -softplus(w.x + b): half-life ~100 tokens
    lambda_init: float = -1.0       # lambda = softplus(lambda_raw) ~ 0.313
    use_decay: bool = True
    use_phase: bool = True
    learn_lambda: bool = True
    chunk_size: int = 0             # block / query chunk of the chunked path; 0 = auto
                                    # (sisa_xla.block_len, or chunk_len with cuDNN)
    path: str = "auto"              # auto (cond on the decay range) | fast | chunked (all exact)
    fast_max_range: float = 60.0    # nats: largest decay range of the one-call fast path (<= 80)
    phase_init_std: float = 0.01    # init std of W_theta (as the authors' code)
    lambda_lr_mult: float = 0.1     # lambda_raw's learning-rate multiplier (paper: 10x lower)

    def validate(self, cfg: ModelConfig, where: str) -> None:
      need = field_check(where)
      if cfg.kv_heads != cfg.n_heads:
        raise ValueError(f"config.model.n_kv_heads: sisa needs one key head per query head "
                         f"(n_kv_heads 0 or {cfg.n_heads}), got {cfg.n_kv_heads}: B and the "
                         "decay are per query head")
      ds = self.d_state
      need(is_int(ds, 1) and ds % 2 == 0,
           "d_state", f"must be a positive even integer (pairs are rotated), got {ds!r}")
      for f in ("decay_bias_init", "lambda_init"):
        need(is_number(getattr(self, f)), f, f"must be a finite number, got {getattr(self, f)!r}")
      for f in ("use_decay", "use_phase", "learn_lambda"):
        need(isinstance(getattr(self, f), bool), f,
             f"must be True or False, got {getattr(self, f)!r}")
      cs = self.chunk_size
      need(is_int(cs, 0), "chunk_size",
           f"must be an integer >= 0 (0 = auto), got {cs!r}")
      need(self.path in PATHS, "path", f"{self.path!r} not in {PATHS}")
      fr = self.fast_max_range
      need(is_number(fr) and 0 < fr <= 80, "fast_max_range",
           f"must be in (0, 80] nats (e^80 is near the fp32/bf16 limit e^88.7), got {fr!r}")
      need(is_number(self.phase_init_std, 0), "phase_init_std",
           f"must be >= 0, got {self.phase_init_std!r}")
      need(is_number(self.lambda_lr_mult, 0), "lambda_lr_mult",
           f"must be a finite number >= 0, got {self.lambda_lr_mult!r}")
      self.validate_sink_logit(where)

  @classmethod
  def tiny(cls):
    """Options for test-sized models (d_model 32, 4 heads)."""
    return dataclasses.replace(cls.Options(), d_state=4)

  def __init__(self, cfg: ModelConfig, opts: "SISA.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, D, ds = cfg.n_heads, cfg.d_model, int(opts.d_state)
    # o stays in-major for decoding: an out-major o makes XLA materialise the widened
    # attention's output (a transpose and a convert of their own) before its reduction, 4 more
    # launches per one-token step on an H100 than in-major (tests/test_decode_launches.py)
    self.proj = QKVProjection(cfg, rngs=rngs, out_major_o=False)
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt)
    self.b_proj = Linear((D,), (H, ds), in_axes=("embed",), out_axes=("heads", "state"),
                         init_std=cfg.init_std, **kw)
    self.c_proj = Linear((D,), (H, ds), in_axes=("embed",), out_axes=("heads", "state"),
                         init_std=cfg.init_std, **kw)
    self.decay_proj = Linear((D,), (H,), in_axes=("embed",), out_axes=("heads",),
                             init_std=cfg.init_std, **kw)
    self.phase_proj = Linear((D,), (H, ds // 2), in_axes=("embed",), out_axes=("heads", "state"),
                             init_std=float(opts.phase_init_std), **kw)
    self.decay_bias = param(rngs, nnx.initializers.constant(float(opts.decay_bias_init)), (H,),
                            ("heads",), pdt, kind="bias")
    # lambda: its own (10x lower) learning rate and no weight decay, as the paper trains it.
    self.lambda_raw = param(rngs, nnx.initializers.constant(float(opts.lambda_init)), (H,),
                            ("heads",), pdt, lr_mult=opts.lambda_lr_mult, kind="scalar")
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  # -------------------------------------------------------------- per-token features
  def features(self, x_BTD, positions_BT, rotate: bool = True) -> "SISAFeatures":
    """q, k (after RoPE; before it with rotate=False), v, C, B, log a, theta (None without
    phase), lambda.

    Padding tokens (position -1) get log a = 0 and theta = 0: they leave g and Phi unchanged.
    """
    cfg, p = self.cfg, self.proj
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    if rotate:
      q, k, v = p.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    else:
      q, k, v = p.qkv(x_BTD)
    return SISAFeatures(q, k, v, *self._ssm_features(x_BTD, positions_BT))

  def _ssm_features(self, x_BTD, positions_BT):
    """(C, B, log a, theta, lambda): `features` without q, k, v."""
    cfg, o = self.cfg, self.opts
    f = stat_dtype(cfg)
    # C, B, theta and the decay pre-activation in one matmul (their kernels side by side), its
    # output [B, T, H n] with heads and channels on one axis: the array the kernel route keeps
    # for the backward (`_kernel_forward`), whose last axis a TPU pads to a multiple of 128.
    H, D = cfg.n_heads, cfg.d_model
    parts = [self.c_proj, self.b_proj] + [self.phase_proj] * bool(o.use_phase) \
        + [self.decay_proj] * bool(o.use_decay)
    widths = [math.prod(lin.out_shape) // H for lin in parts]
    w = jnp.concatenate([lin.kernel[...].reshape(D, H, -1) for lin in parts], axis=-1)
    ssm = jnp.einsum("btd,dn->btn", x_BTD.astype(self.c_proj.dtype),
                     w.reshape(D, -1).astype(self.c_proj.dtype))
    ssm = jnp.split(ssm.reshape(x_BTD.shape[:2] + (H, -1)), np.cumsum(widths)[:-1], axis=-1)
    c, b = ssm[0], ssm[1]
    theta = ssm[2].astype(f) if o.use_phase else None
    if o.use_decay:
      pre = ssm[-1][..., 0].astype(f) + self.decay_bias[...].astype(f)
      loga = -jax.nn.softplus(pre)
    else:
      loga = jnp.zeros(x_BTD.shape[:2] + (H,), f)
    if positions_BT is not None:
      valid = (positions_BT >= 0)[..., None]
      loga = jnp.where(valid, loga, 0.0)
      theta = None if theta is None else jnp.where(valid[..., None], theta, 0.0)
    lam = jax.nn.softplus(self.lambda_raw[...].astype(f))
    if not o.learn_lambda:
      lam = jax.lax.stop_gradient(lam)
    return c, b, loga, theta, lam

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    del rng, train
    seg = segment_ids_BT
    if state is None and self._takes_kernel(x_BTD):
      return self._kernel_forward(x_BTD, positions_BT, seg)
    f = self.features(x_BTD, positions_BT, rotate=state is None)
    # with a state: sums over the new tokens only; packed rows: restarted per document
    g, phi = decay_and_phase(f.loga, f.theta, None if seg is None else segment_starts(seg))
    if state is not None and phi is not None:
      phi = wrap_phase(state.phi[:, None] + phi)
    decay = self._decay(f, g, phi)
    sink = sink_logit_of(self.opts, self.sink_logit, self.cfg.n_heads)

    if state is None:   # the kernels room's XLA paths: fast / chunked
      out, chunked = entry.attend_decayed(
          f.q, f.k, f.v, decay, scale=self.cfg.head_dim ** -0.5, impl=self.cfg.attention_impl,
          path=self.opts.path, sink_logit_H=sink, segment_ids_BT=seg, what="sisa")
    else:
      out, kv = self._cached(f, decay, sink, seg, positions_BT, state.cache)
      g = state.g[:, None] + g                   # the running g: only for `decay_range`
      state = SISAState(kv, g[:, -1], state.phi if phi is None else phi[:, -1])
      chunked = jnp.ones((), jnp.float32)
    return self.proj.o(out), state, _aux(f.loga, f.lam, g, chunked)

  # -------------------------------------------------------------- full sequence, kernel
  def _takes_kernel(self, x_BTD) -> bool:
    """Whether the kernels room takes the decayed kernel for a full forward of x
    (`entry.takes_decayed_kernel`: path "auto" on a GPU / TPU at shapes it fits); else
    `entry.attend_decayed` chooses among the XLA paths."""
    cfg = self.cfg
    q_shape = x_BTD.shape[:2] + (cfg.n_heads, cfg.head_dim)
    kv_shape = x_BTD.shape[:2] + (cfg.kv_heads, cfg.head_dim)
    return entry.takes_decayed_kernel(cfg.attention_impl, self.opts.path, q_shape, kv_shape,
                                      kv_shape, what="sisa")

  def _kernel_forward(self, x_BTD, positions_BT, seg):
    """A full forward through the decayed kernel. The kernel's factors are made from x in a
    rematerialised function (`_factors_from_input`) that keeps only its one matmul's output
    for the backward (C, B, theta and the decay pre-activation, [B, T, H (2 d_s + d_s/2 + 1)]
    in the compute dtype): the cumulative sums, the rotations and their fp32 intermediates
    ([B, T, H, d_s/2] cos, sin, pair halves) are recomputed in the backward (elementwise work,
    no matmul) instead of being kept per layer, where on a TPU their d_s/2-wide last axis pads
    to 128 lanes (docs/sisa.md, "What the backward keeps"). The same operations as the route
    through `_decay` and `entry.match_factors`: the numerics do not change."""
    cfg = self.cfg
    B, T, _ = x_BTD.shape
    pos_BT = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = self.proj.rotated_qkv(x_BTD, pos_BT, cfg.rope_theta)
    factors = jax.checkpoint(functools.partial(self._factors_from_input, dtype=q.dtype),
                             policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    c, b, g, loga, lam = factors(x_BTD, positions_BT, seg)
    sink = sink_logit_of(self.opts, self.sink_logit, cfg.n_heads)
    out, chunked = entry.attend_decayed(
        q, k, v, entry.MatchFactors(c, b, g), scale=cfg.head_dim ** -0.5,
        impl=cfg.attention_impl, path=self.opts.path, sink_logit_H=sink, segment_ids_BT=seg,
        what="sisa")
    return self.proj.o(out), None, _aux(loga, lam, g, chunked)

  def _factors_from_input(self, x_BTD, positions_BT, seg, *, dtype):
    """(lambda R(Phi) C and R(Phi) B in `dtype`, g, log a, lambda) of a full forward from the
    layer's input: the kernel's factors (`entry.match_factors`)."""
    c, b, loga, theta, lam = self._ssm_features(x_BTD, positions_BT)
    g, phi = decay_and_phase(loga, theta, None if seg is None else segment_starts(seg))
    rc, rb = _rotated(c, b, phi, g.dtype)
    c, b = entry.match_factors(lam, rc, rb, dtype)
    return c, b, g, loga, lam

  def _decay(self, f: SISAFeatures, g, phi) -> entry.MatchDecay:
    """The decay features from the features and the cumulative sums g, Phi (None: no phase):
    C and B rotated, the query side's scale s^2 = lambda sqrt(d_h), and the options the kernels
    room chooses a path by."""
    cfg, o = self.cfg, self.opts
    rc, rb = _rotated(f.c, f.b, phi, g.dtype)
    qscale = f.lam * math.sqrt(cfg.head_dim)                    # s^2 = lambda sqrt(d_h)
    return entry.MatchDecay(rc, rb, g, f.lam, qscale, self.fast_range_limit(cfg, o),
                            int(o.chunk_size), cfg.sink_tokens > 0)

  # -------------------------------------------------------------- decoding
  def _cached(self, f: SISAFeatures, decay: entry.MatchDecay, sink, seg, positions_BT,
              kv: cache_lib.KVCache):
    """T new tokens (q, k before RoPE) after the cached ones, under the cache's policy: one
    chunk with reference r = g of the last cached token. Cached g_j are kept relative to it
    (g_j - r >= 0, shifted after every call), so key factors e^{r - g_j} <= 1, and ell = g - r
    is summed over the new tokens only: the query factors e^ell and the in-chunk decays
    e^{ell_i - ell_j} keep full precision however long the stream. Only the q.k part's RoPE
    positions depend on the policy (a ring re-assigns them); a cached key keeps its g_j and
    R(Phi_j) B_j, so a sink still sees the true decay accumulated over every token since.
    `decay.g_BTH` is ell. A prefill's first call (`kv.fresh`) on GPU / TPU computes its outputs
    with the full forward's kernel (`entry.fused_prefill`: no [T, T] scores), then writes the
    same keys."""
    cfg = self.cfg
    q, k, v, rc, rb, ell = f.q, f.k, f.v, decay.rc_BTHS, decay.rb_BTHS, decay.g_BTH
    T = q.shape[1]
    fresh_out = None
    if kv.fresh:
      fresh_out = entry.fused_prefill(q, k, v, decay, scale=cfg.head_dim ** -0.5,
                                      impl=cfg.attention_impl, positions_BT=positions_BT,
                                      sink_logit_H=sink, segment_ids_BT=seg, what="sisa prefill")
    kf = jnp.exp(jnp.where((kv.pos >= 0)[..., None], -kv.extra.g, -jnp.inf))  # 0 when empty
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    widen = cache_lib.Widening(q=(jnp.exp(ell) * decay.qscale_H)[..., None] * rc, k_scale=kf,
                               bias_new=local_bias(rc, rb, ell, ell, decay.lam_H, causal))
    out, kv = cache_lib.cached_attention(
        kv, q, k, v, positions_BT, theta=cfg.rope_theta, scale=cfg.head_dim ** -0.5,
        sink_logit_H=sink, widen=widen,
        extra_new=SISAKeys(g=ell), kx_new=rb, fresh_out=fresh_out)
    last = ell[:, -1:]     # padding (log a = 0) keeps the last valid token's g
    return out, kv.replace(extra=kv.extra._replace(g=kv.extra.g - last.astype(kv.extra.g.dtype)))

  def attention_probs(self, x_BTD):
    """[B, H, T, T + 1] attention map of a full forward, from the explicit reference's scores
    (last column: the sink); diagnostics."""
    f = self.features(x_BTD, None)
    g, phi = decay_and_phase(f.loga, f.theta)
    _, s = sisa_attention_reference(f.q, f.k, f.v, f.c, f.b, g, phi, f.lam)
    return probs_with_sink(s, sink_logit_of(self.opts, self.sink_logit, self.cfg.n_heads))

  # -------------------------------------------------------------- class-level hooks
  @staticmethod
  def fast_range_limit(cfg: ModelConfig, opts: "SISA.Options") -> float:
    return min(float(opts.fast_max_range), _DTYPE_RANGE_LIMIT.get(cfg.dtype, 1e9))

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts: "SISA.Options", batch: int, capacity: int, dtype,
                 policy: cache_lib.CachePolicy | None = None) -> "SISAState":
    H, ds, f = cfg.n_heads, int(opts.d_state), stat_dtype(cfg)
    extra = SISAKeys(g=jax.ShapeDtypeStruct((H,), f))   # R(Phi_j) B_j: the cache's kx
    kv = cache_lib.init_cache(cls.cache_policy(cfg, opts, policy), batch, capacity,
                              cfg.kv_heads, cfg.head_dim, cfg.head_dim, dtype, extra=extra,
                              kx_dim=ds)
    return SISAState(kv, jnp.zeros((batch, H), f), jnp.zeros((batch, H, ds // 2), f))

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts: "SISA.Options", seq_len: int) -> float:
    # Q^K^T over d_h + d_s channels and PV over d_h, causal lower triangle as attention's.
    # The elementwise O(H d_s) work per token (cumsums, rotations, decay factors) is not
    # counted, like RoPE and softmax (train/flops.py).
    return entry.attention_flops_per_token(cfg.n_heads, cfg.head_dim + int(opts.d_state),
                                           cfg.head_dim, entry.causal_keys(seq_len))

