"""Forgetting Attention (FoX): softmax attention whose logits carry a data-dependent forget gate.

Paper: Lin, Nikishin, He, Courville, "Forgetting Transformer: Softmax Attention with a Forget
Gate" (ICLR 2025); docs/papers.md §6.1. Per head h, with x = RMSNorm(input), d_h = d_model / H:

    q, k, v = x W_q, x W_k, x W_v
    f_t = sigmoid(w_f . x_t + b_f),  log f_t = -softplus(-(w_f . x_t + b_f))   (one per head)
    g_t = sum_{s<=t} log f_s                                                 (fp32 cumsum)
    s_ij = q_i.k_j / sqrt(d_h) + (g_i - g_j)  =  q_i.k_j / sqrt(d_h) + sum_{l=j+1..i} log f_l
    y_i = sum_{j<=i} softmax_j(s_ij) v_j,   out = y W_o

The whole logit decays (SISA instead decays an *added* read/write term, sisa.py): FoX is
attention with a learned, content-dependent recency prior. b_f starts at 0 (f ~ 1/2 at init,
the paper's default "full" gate; `forget_bias_init` moves it).

RoPE: off by default (`rope=False`), as in the paper, whose FoX models use no positional
embedding: g_i - g_j already orders the keys by (learned) distance, and the paper reports
RoPE adds nothing on top of the gate. Without RoPE the ring caches need no re-assigned
positions either (below). `rope=True` rotates q and k at their stream positions like
`attention` (dense cache only).

"Pro" block options (the paper's FoX (Pro)): `qk_norm` (per-head RMSNorm of q and k, its
scale per head), `key_shift` / `value_shift` (data-dependent token shift on the projected keys
/ values: k_t <- a_t k_{t-1} + (1 - a_t) k_t, a_t = sigmoid(w . x_t) per kv head, before the
QK-norm), `output_norm` (per-head RMSNorm of the attention output) and `output_gate`
(y <- y * sigmoid(x W_g), [H, d_h] per token, before W_o). Each adds parameters
(`extra_params`); the configs narrow the SwiGLU to match the Transformer.

The attention itself is the score-bias family's (score_bias.py: `ScoreBiasAttention`, the
options, the decoding state, the reference): the features below go to the kernels room
(`entry.attend_decayed` with `entry.LogitDecay`), whose cores are exact and causal at any
length with no [T, T] bias (kernels/forget_xla.py: each pair's decay from sums over disjoint
ranges, float64-checked under log f down to -20 nats per token; kernels/decayed.py: the Pallas
kernel on GPU / TPU).

Packed rows: pairs of different documents are masked and the decay restarts per document
(score_bias.py, kernels/forget_xla.py). The token shift (`key_shift` / `value_shift`) restarts
at a document's first token (its previous token is the zero carry, as at the start of a row).

ALiBi (alibi.py) is the same computation with log f = -m_h fixed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.attention.projection import QKVProjection, make_sink_logit, rope
from attn_jax.attention.score_bias import BiasOptions, ScoreBiasAttention
from attn_jax.field_checks import field_check, is_number
from attn_jax.layers import Linear, causal_positions, dtype_of, param, stat_dtype
from attn_jax.mixer import register_mixer

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig


def extra_params(d_model: int, n_heads: int, n_kv_heads: int, opts: "FoX.Options") -> int:
  """Parameters FoX adds per layer over attention: the gate (d H + H) and the Pro options."""
  d, H, K, dh = d_model, n_heads, n_kv_heads, d_model // n_heads
  n = d * H + H
  n += opts.qk_norm * (H + K) * dh + opts.output_norm * H * dh + opts.output_gate * d * H * dh
  return n + (opts.key_shift + opts.value_shift) * d * K


def matched_d_ff(transformer_model, extra: int, multiple: int = 4) -> int:
  """SwiGLU width whose 3 d d_ff weights absorb `extra` mixer parameters per layer."""
  d = int(transformer_model.d_model)
  return int(multiple * round((int(transformer_model.d_ff) - extra / (3 * d)) / multiple))


def _rms(x, scale, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def token_shift(x_BTKD, alpha_BTK, prev_BKD, valid_BT, segment_ids_BT=None):
  """x_t <- a_t x_prev + (1 - a_t) x_t with x_prev the previous valid token of the row (the
  carried `prev_BKD` for the first, and for a document's first token in a packed row);
  returns (shifted, the last valid token's x = next prev)."""
  B, T = valid_BT.shape
  idx_BT = jnp.where(valid_BT, jnp.arange(T)[None, :], -1)
  last_BT = jax.lax.cummax(idx_BT, axis=1)                       # last valid index <= t
  before_BT = jnp.pad(last_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :T]
  if segment_ids_BT is not None:   # the previous token belongs to another document: none
    seg_before = jnp.take_along_axis(segment_ids_BT, jnp.maximum(before_BT, 0), axis=1)
    before_BT = jnp.where(seg_before == segment_ids_BT, before_BT, -1)
  gather = lambda i_BT: jnp.take_along_axis(x_BTKD, jnp.maximum(i_BT, 0)[..., None, None], 1)
  prev = jnp.where((before_BT >= 0)[..., None, None], gather(before_BT),
                   prev_BKD[:, None].astype(x_BTKD.dtype))
  a = alpha_BTK[..., None].astype(jnp.float32)
  out = (a * prev.astype(jnp.float32) + (1 - a) * x_BTKD.astype(jnp.float32))
  nxt = jnp.where((last_BT[:, -1] >= 0)[:, None, None], gather(last_BT[:, -1:])[:, 0],
                  prev_BKD.astype(x_BTKD.dtype))
  return out.astype(x_BTKD.dtype), nxt


# ---------------------------------------------------------------- the mixer

@register_mixer("fox")
class FoX(ScoreBiasAttention):
  """Forgetting Attention (module docstring). Options: `config.model.fox`."""

  @dataclasses.dataclass(frozen=True)
  class Options(BiasOptions):
    forget_bias_init: float = 0.0   # b_f: f = sigmoid(w.x + b_f) ~ 1/2 at init (the paper's)
    rope: bool = False              # RoPE on q, k (the paper: none; linear cache only)
    qk_norm: bool = False           # Pro: per-head RMSNorm of q and k
    key_shift: bool = False         # Pro: data-dependent token shift of the keys
    value_shift: bool = False       # Pro: ... of the values
    output_norm: bool = False       # Pro: per-head RMSNorm of the attention output
    output_gate: bool = False       # Pro: y * sigmoid(x W_g) before W_o

    def validate(self, cfg: ModelConfig, where: str) -> None:
      del cfg
      need = field_check(where)
      b = self.forget_bias_init
      need(is_number(b), "forget_bias_init", f"must be a finite number, got {b!r}")
      for name in ("rope", "qk_norm", "key_shift", "value_shift", "output_norm", "output_gate"):
        need(isinstance(getattr(self, name), bool), name,
             f"must be True or False, got {getattr(self, name)!r}")
      self.validate_bias(where)

  def __init__(self, cfg: ModelConfig, opts: "FoX.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    H, K, Dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, init_std=cfg.init_std)
    self.proj = QKVProjection(cfg, rngs=rngs)
    self.fgate = Linear((D,), (H,), in_axes=("embed",), out_axes=("heads",), **kw)
    self.fgate_bias = param(rngs, nnx.initializers.constant(float(opts.forget_bias_init)), (H,),
                            ("heads",), pdt, kind="bias")
    ones = nnx.initializers.ones_init()
    norm = lambda n, ax: param(rngs, ones, (n, Dh), (ax, "head_dim"), pdt, kind="norm")
    self.q_norm = norm(H, "heads") if opts.qk_norm else None
    self.k_norm = norm(K, "kv_heads") if opts.qk_norm else None
    self.out_norm = norm(H, "heads") if opts.output_norm else None
    shift = lambda: Linear((D,), (K,), in_axes=("embed",), out_axes=("kv_heads",), **kw)
    self.k_shift = shift() if opts.key_shift else None
    self.v_shift = shift() if opts.value_shift else None
    self.ogate = (Linear((D,), (H, Dh), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
                  if opts.output_gate else None)
    self.sink_logit = make_sink_logit(cfg, opts, rngs)

  def log_forget(self, x_BTD, positions_BT):
    """log f [B, T, H] in fp32 (fp64 for float64); 0 for padding."""
    f = stat_dtype(self.cfg)
    pre = self.fgate(x_BTD).astype(f) + self.fgate_bias[...].astype(f)
    loga = jax.nn.log_sigmoid(pre)
    if positions_BT is not None:
      loga = jnp.where((positions_BT >= 0)[..., None], loga, 0.0)
    return loga

  def features(self, x_BTD, positions_BT, state, segment_ids_BT=None):
    cfg, opts, p = self.cfg, self.opts, self.proj
    B, T, _ = x_BTD.shape
    pos = causal_positions(B, T) if positions_BT is None else positions_BT
    q, k, v = p.qkv(x_BTD)
    carry = {}
    for name, lin in (("k", self.k_shift), ("v", self.v_shift)):
      if lin is None:
        continue
      x = k if name == "k" else v
      prev = (jnp.zeros((B,) + x.shape[2:], x.dtype) if state is None
              else state.carry[f"{name}_prev"])
      x, carry[f"{name}_prev"] = token_shift(x, jax.nn.sigmoid(lin(x_BTD).astype(jnp.float32)),
                                             prev, pos >= 0, segment_ids_BT)
      k, v = (x, v) if name == "k" else (k, x)
    if opts.qk_norm:
      q, k = _rms(q, self.q_norm[...], cfg.norm_eps), _rms(k, self.k_norm[...], cfg.norm_eps)
    if opts.rope:
      q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    return q, k, v, self.log_forget(x_BTD, positions_BT), carry

  def finish(self, y_BTHD, x_BTD):
    if self.out_norm is not None:
      y_BTHD = _rms(y_BTHD, self.out_norm[...], self.cfg.norm_eps)
    if self.ogate is not None:
      y_BTHD = y_BTHD * jax.nn.sigmoid(self.ogate(x_BTD).astype(jnp.float32)).astype(y_BTHD.dtype)
    return y_BTHD

  @classmethod
  def carry_state(cls, cfg, opts, batch, dtype) -> dict:
    prev = jnp.zeros((batch, cfg.kv_heads, cfg.head_dim), dtype)
    return {f"{n}_prev": prev for n, on in (("k", opts.key_shift), ("v", opts.value_shift)) if on}
