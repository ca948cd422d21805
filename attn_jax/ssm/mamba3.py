"""Mamba-3 mixer, SISO (Lahoti et al., "Mamba-3", arXiv 2603.15569): trapezoidal SSM, complex
state as a data-dependent rotation of B and C, no short conv.

Per token (heads of P = head_dim channels, state size N = d_state, R = rope_fraction * N / 2
rotation angles shared by the heads):

    z, x, B, C, dt_raw, A_raw, lam_raw, theta_raw = in-projections of the input
    dt = softplus(dt_raw + dt_bias) (0 on padding);  A = min(-f(A_raw), -A_floor),
    f = softplus (default) or heavy_tail;  a = A dt <= 0,  alpha = exp(a)
    lam = sigmoid(lam_raw);  gamma = lam dt;  beta = (1 - lam) dt alpha
    B <- RMSNorm_N(B) + B_bias[h],  C <- RMSNorm_N(C) + C_bias[h]          (bias per head, init 1)
    phi_t = (phi_{t-1} + pi tanh(theta_raw_t) dt_t) mod 2 pi                 (R angles per head)
    k_t = Rot(phi_t) B_t,  q_t = Rot(phi_t) C_t     (rotate interleaved pairs (2i, 2i+1), i < R)
    h_t = alpha_t h_{t-1} + gamma_t x_t k_t^T + beta_t x_{t-1} k_{t-1}^T   (exp-trapezoidal rule)
    y_t = h_t q_t + D x_t;   out = W_out (y * SiLU(z))

Rotating k_s and q_t by the cumulative angles makes q_t . k_s depend on phi_t - phi_s: the
complex-diagonal SSM written in real arithmetic (the paper's "RoPE trick"). This matches the
reference recurrence `mamba3_siso_step_ref` in state-spaces/mamba
(`tests/ops/triton/test_mamba3_siso.py`) and the module `mamba_ssm/modules/mamba3.py`
(defaults: SISO, rope_fraction 0.5, no output norm, B/C bias init 1, D = 1).

A's activation (`a_activation`): "softplus", A = -softplus(A_raw) (-0.693 at init), is the
released code the paper's results come from (`modules/mamba3.py` from the release 5235bdc,
March 2026, to 7438488; docs/papers.md §5.3); "heavy_tail", f(u) = 1 + u (u >= 0), 1 / (1 - u)
(u < 0) (-1 at init), is the reference's later change (c69aaab, "Stabilize data-dependent A
with heavy-tail activation", June 2026: for WSD schedules and higher learning rates).

Initialisation as the reference (`mamba2.projection_inits`): in-projections (z, x, B, C, dt,
A, lambda, theta) U(+-1/sqrt(d_model)), PyTorch's nn.Linear default, which `modules/mamba3.py`
keeps; out-projection U(+-1/sqrt(d_inner)) / sqrt(n_residuals * n_layers)
(`models/mixer_seq_simple.py`); dt_bias = softplus^{-1}(dt), dt log-uniform in [1e-3, 1e-1]
floored at 1e-4; B/C biases 1, B/C norm scales 1, D = 1. Not decayed (`layers.PARAM_KINDS`):
dt_bias, B/C biases, norm scales, D (the reference marks dt_bias and D `_no_weight_decay`).
The in-projections are one parameter `in_proj` [d_model, sum of the parts] whose outputs are
z, x, B, C, dt, A, lambda, theta side by side (`IN_PROJ_PARTS`, shapes `part_shapes`; B and C
r columns wide under MIMO), as the authors' one in_proj: one gradient write per layer and one
set of optimizer kernels where eight separate Linears had eight (mamba2.py's "Parameter
layout"); checkpoints with the eight separate kernels do not load. So are the small
parameters stacked: `head_scalars` [2, H] (dt_bias, D; kind scalar), `bc_bias` [2, H, (r,) N]
(B's and C's biases) and `bc_norm` [2, N] (their norm scales), each row initialised as above
and read through the properties dt_bias, D, b_bias, c_bias, b_norm, c_norm.

Chunked training form: the trapezoid is an SSD with two inputs per token, gamma_t x_t k_t^T
and beta_t x_{t-1} k_{t-1}^T (the previous token's x and k shifted by one, the first one taken
from the carried state), both entering h_t after the decay alpha_t. `ssd.ssd_chunked(...,
extra=...)` runs them through the same intra-chunk and chunk-state steps (G = H, since B/C are
rotated per head); the inter-chunk scan and state->output steps are shared. (Folding the two
into one input of weight gamma_s + beta'_{s+1}, as the reference kernel does, reads dt of token
s + 1 for token s and cancels it again in the output: exact in algebra, but future tokens then
reach past outputs through rounding, which the causality test detects.) The cumulative angles
are computed per chunk and carried across chunks mod 2 pi (a scan), so they stay in range at
any length. On a GPU / TPU a full forward runs this SSD through the fused Pallas kernels
(`kernels/ssd_chunks.py`: SISO with `extra=`, chosen by `ssd_chunks.chunked_ssd`; MIMO's
columns as rows of the same kernels, `ssd_chunks.chunked_mimo`); decoding keeps the XLA forms.

Implicit attention (`Mamba3.implicit_attention`, for eval/maps.py): unrolling the trapezoid
from a zero state, y_t = sum_{j<=t} M_tj x_j + D x_t with
M_tj = (q_t . k_j) L_tj (gamma_j + [j<t] beta'_{j+1}), L_tj = exp(a_{j+1} + ... + a_t): the
input of token j enters h_j with gamma_j and h_{j+1} with beta'_{j+1} alpha_{j+1}.

Rematerialisation, as Mamba-2's (`mamba2.remat_full_forward`): a full forward keeps only its
inputs and the in-projection output (z, x, B, C, dt, A, lambda, theta side by side in the
compute dtype: one matmul, `mamba2.fused_projection`, tagged `mamba2.IN_PROJ`) for the
backward pass, which recomputes the B/C norms, the angles and rotations, the trapezoid's
shifted inputs, the SSD chunk internals of both inputs and the gate from them (kept, those
fp32 tensors made a layer's residuals ~15x larger).

`trapezoid_recurrent` is the explicit recurrence (lax.scan over time, the test reference) and
the decode step is one token of it. Decoding state: angles [H, R], h [H, P, N] (fp32), and the
last token's k [H, N] and x [H, P]: constant in the generated length. Padding (position -1):
dt = 0, so alpha = 1, gamma = beta = 0, the angle does not move, and the carried (x, k) stay
those of the last valid token (right padding within a call, as in mamba2.py).

MIMO (`mimo_rank` r >= 1; 0 = SISO, the default): the paper's multi-input multi-output state
update. Per token and head, B and C become r columns (B_t, C_t in R^{N x r}, from a projection
r times wider, each column RMS-normed with a per-head, per-rank bias), and x enters through r
per-head channel weights, X_t = [x_t * w^x_1, ..., x_t * w^x_r] in R^{P x r}:

    h_t = alpha_t h_{t-1} + gamma_t X_t K_t^T + beta_t X_{t-1} K_{t-1}^T     (rank-r updates)
    Y_t = h_t Q_t + D X_t                                                    ([P, r])
    y_t = sum_i w^o_i * Y_t[:, i] * SiLU(z_t * w^z_i)                        ([P])

with K = Rot(phi) B, Q = Rot(phi) C column by column (the same angles). The state h stays
[P, N]: MIMO does r times the state-update FLOPs per byte of state (the point of the paper:
decoding is memory-bound). w^x, w^o start at 1/r and w^z at 1 (as state-spaces/mamba), so with
r = 1 every weight is 1 and the mixer is the SISO one (tested against it). Chunked form
(`mimo_chunked`): the two inputs of the trapezoid are 2r input columns (U = [gamma X_t ;
beta X_{t-1}], keys [K_t ; K_{t-1}]) and the r columns of Q are r outputs of one SSD,
    Y_{t,o} = sum_{s<=t} L_ts sum_i (Q_{t,o} . K_{s,i}) U_{s,i} + e^{A_t} h_in Q_{t,o},
with the segment decays of `ssd.segsum_exp` and the state passing of `ssd.pass_chunk_states`;
`mimo_recurrent` is the token-by-token reference and the decode step. Decoding state: the SISO
one with k [H, r, N].

Packed rows (`segment_ids_BT`, full forwards): at a document's first token t0 every term that
crosses time restarts, so the document is computed as in a row of its own (h_0 = 0, x_0 = k_0 =
0, phi_0 = 0 there):
  state      alpha_{t0} = 0 (a_{t0} = -inf in the chunked forms, `ssd.ssd_chunked(reset_BT=)`
             and `mimo_chunked`; h zeroed before the update in the recurrences);
  trapezoid  x_{t0-1}, k_{t0-1} (the previous document's last token) replaced by 0, so
             beta_{t0} x_{t0-1} k_{t0-1}^T = 0 (`previous_token`);
  angles     phi_{t0} = inc_{t0}: the cumulative sum restarts (a segmented cumulative sum
             within chunks, the carry across chunks dropped after a start; `wrapped_cumsum`).
(The angles enter only as differences phi_t - phi_s within a document, so their restart is
exact in algebra even without it; restarting keeps the rounding of the document alone.)
`reads_shared_prefix` stays False: a restarted state holds no prefix shared by every document.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax import layers
from attn_jax.field_checks import field_check, is_int, is_number
from attn_jax.kernels import ssd_chunks
from attn_jax.layers import Linear, causal_positions, dtype_of, param, segmented_cumsum
from attn_jax.mixer import Mixer, register_mixer
from attn_jax.ssm import ssd
from attn_jax.ssm.mamba2 import (FullForwardRemat, document_resets, dt_bias_init,
                                 fused_projection, last_valid_window, projection_inits,
                                 split_last, tiny_ssd_options, valid_mask)

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

f32 = jnp.float32
TWO_PI = 2.0 * math.pi
IN_PROJ_PARTS = ("z", "x", "B", "C", "dt", "a", "lam", "theta")   # Mamba3.in_proj's outputs


def head_scalars_init(opts):
  """Mamba-3's per-head scalars stacked [2, H]: dt_bias (`mamba2.dt_bias_init`) and D = 1."""
  def init(key, shape, dtype=f32):
    H = shape[1]
    return jnp.stack([dt_bias_init(opts.dt_min, opts.dt_max)(key, (H,), dtype),
                      jnp.ones((H,), dtype)])
  return init


def heavy_tail(u: jax.Array) -> jax.Array:
  """1 + u for u >= 0, 1 / (1 - u) for u < 0: positive, C^1 at 0 (Mamba-3's A activation)."""
  return jnp.maximum(u, 0.0) + 1.0 / (1.0 - jnp.minimum(u, 0.0))


A_ACTIVATIONS = {"softplus": jax.nn.softplus, "heavy_tail": heavy_tail}


def wrap(phi: jax.Array) -> jax.Array:
  return phi - TWO_PI * jnp.floor(phi / TWO_PI)


def rotate_pairs(x_XN: jax.Array, phi_XR: jax.Array) -> jax.Array:
  """Rotate pairs (2i, 2i+1), i < R, of the last axis by phi[..., i]; the rest unchanged."""
  R = phi_XR.shape[-1]
  xr = x_XN[..., :2 * R].reshape(x_XN.shape[:-1] + (R, 2))
  x0, x1 = xr[..., 0], xr[..., 1]
  c, s = jnp.cos(phi_XR), jnp.sin(phi_XR)
  rot = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x_XN.shape[:-1] + (2 * R,))
  return jnp.concatenate([rot, x_XN[..., 2 * R:]], axis=-1)


def wrapped_cumsum(inc_BTX: jax.Array, phi0_BX: jax.Array, chunk: int,
                   reset_BT=None) -> jax.Array:
  """phi_t = (phi0 + sum_{r<=t} inc_r) mod 2 pi: a cumulative sum within chunks of `chunk`
  tokens, and the carry entering each chunk, wrap(phi0 + the chunk totals before it), a
  parallel prefix over chunks whose combine adds and wraps (`layers.wrapped_cumsum`; no loop
  over the chunks, whose count grows with T). `reset_BT`: the sum restarts at these tokens
  (phi_t = inc_t there; `phi0` and earlier increments reach no token at or after a reset)."""
  B, T = inc_BTX.shape[:2]
  Q = max(1, min(chunk, T))
  nc = -(-T // Q)
  tail = [(0, 0)] * (inc_BTX.ndim - 2)
  inc = jnp.pad(inc_BTX.astype(f32), [(0, 0), (0, nc * Q - T)] + tail)
  inc = inc.reshape((B, nc, Q) + inc_BTX.shape[2:])
  if reset_BT is None:
    local, seen = jnp.cumsum(inc, axis=2), None
  else:   # a segmented sum within the chunk; the carry only where no reset precedes in it
    r = jnp.pad(reset_BT, ((0, 0), (0, nc * Q - T))).reshape((B, nc, Q) + (1,) * len(tail))
    local, seen = segmented_cumsum(inc, jnp.broadcast_to(r, inc.shape), axis=2)
  # the sum over chunks: [phi0, total_0, .., total_{C-2}] scanned, restarting after a chunk
  # that holds a reset (its total is then its sum since that reset)
  items = jnp.concatenate([phi0_BX.astype(f32)[:, None], local[:, :-1, -1]], axis=1)
  hold = None if seen is None else jnp.pad(seen[:, :-1, -1], [(0, 0), (1, 0)] + tail)
  carry = layers.wrapped_cumsum(items, wrap, axis=1, reset=hold)     # [B, C, X...]
  phi = carry[:, :, None] + local
  if seen is not None:
    phi = jnp.where(seen, local, phi)
  return wrap(phi).reshape((B, nc * Q) + inc_BTX.shape[2:])[:, :T]


def previous_token(z_BTX, z0_BX, reset_BT=None):
  """z_{t-1} for every t (z0 before the first), 0 at reset tokens (a document's first token
  has no previous one, as at the start of a fresh row)."""
  prev = jnp.concatenate([z0_BX[:, None].astype(f32), z_BTX[:, :-1].astype(f32)], axis=1)
  if reset_BT is None:
    return prev
  return jnp.where(reset_BT.reshape(reset_BT.shape + (1,) * (prev.ndim - 2)), 0.0, prev)


def trapezoid_chunked(x_BTHP, a_BTH, gamma_BTH, betap_BTH, k_BTHN, q_BTHN, *, chunk,
                      h0_BHPN=None, x0_BHP=None, k0_BHN=None, reset_BT=None, dot_dtype=None,
                      ssd_fn=ssd.ssd_chunked):
  """Chunked trapezoidal SSM: one SSD with two inputs (see module docstring); `dot_dtype` as
  `ssd.ssd_chunked`'s; `ssd_fn`: that SSD or the fused kernels' (`ssd_chunks.chunked_ssd`).

  -> (y_BTHP without the D skip, h_T) fp32. (x0, k0): the token before the first (zeros if
  None); the second input is beta_t x_{t-1} k_{t-1}^T with beta_t = beta'_t exp(a_t).
  `reset_BT`: documents restart at these tokens (module docstring).
  """
  B, T, H, P = x_BTHP.shape
  x0 = jnp.zeros((B, H, P), f32) if x0_BHP is None else x0_BHP.astype(f32)
  k0 = jnp.zeros((B, H, k_BTHN.shape[-1]), f32) if k0_BHN is None else k0_BHN.astype(f32)
  x_prev = previous_token(x_BTHP, x0, reset_BT)
  k_prev = previous_token(k_BTHN, k0, reset_BT)
  beta = betap_BTH * jnp.exp(a_BTH)
  return ssd_fn(x_BTHP * gamma_BTH[..., None], a_BTH, k_BTHN, q_BTHN, chunk=chunk,
                h0_BHPN=h0_BHPN, extra=(x_prev * beta[..., None], k_prev), reset_BT=reset_BT,
                dot_dtype=dot_dtype)


def trapezoid_step(h_BHPN, x0_BHP, k0_BHN, x_BHP, a_BH, gamma_BH, betap_BH, k_BHN, q_BHN):
  """One token: h = alpha h + beta'alpha x_{t-1} k_{t-1}^T + gamma x_t k_t^T; y = h q."""
  alpha = jnp.exp(a_BH)[..., None, None]
  outer = lambda x_BHP, k_BHN: x_BHP[..., :, None] * k_BHN[..., None, :]
  h = (alpha * h_BHPN + (betap_BH[..., None, None] * alpha) * outer(x0_BHP, k0_BHN)
       + gamma_BH[..., None, None] * outer(x_BHP, k_BHN))
  return jnp.einsum("bhpn,bhn->bhp", h, q_BHN), h


def trapezoid_recurrent(x_BTHP, a_BTH, gamma_BTH, betap_BTH, k_BTHN, q_BTHN, *, h0_BHPN=None,
                        x0_BHP=None, k0_BHN=None, reset_BT=None):
  """The explicit recurrence, one token at a time (lax.scan over T); same returns as chunked.
  `reset_BT`: the carried (h, x, k) are set to 0 before these tokens' update."""
  B, T, H, P = x_BTHP.shape
  N = k_BTHN.shape[-1]
  h0 = jnp.zeros((B, H, P, N), f32) if h0_BHPN is None else h0_BHPN
  x0 = jnp.zeros((B, H, P), f32) if x0_BHP is None else x0_BHP
  k0 = jnp.zeros((B, H, N), f32) if k0_BHN is None else k0_BHN

  def step(carry, inp):
    if reset_BT is not None:
      r, *inp = inp
      carry = jax.tree.map(lambda c: jnp.where(r.reshape((B,) + (1,) * (c.ndim - 1)), 0.0, c),
                           carry)
    h, xp, kp = carry
    x, a, g, bp, k, q = inp
    y, h = trapezoid_step(h, xp, kp, x, a, g, bp, k, q)
    return (h, x, k), y

  seq = tuple(jnp.moveaxis(z.astype(f32), 1, 0)
              for z in (x_BTHP, a_BTH, gamma_BTH, betap_BTH, k_BTHN, q_BTHN))
  if reset_BT is not None:
    seq = (jnp.moveaxis(reset_BT, 1, 0),) + seq
  (h, _, _), y = jax.lax.scan(step, (h0, x0, k0), seq)
  return jnp.moveaxis(y, 0, 1), h


def mimo_chunked(u_BTHIP, a_BTH, k_BTHIN, q_BTHON, *, chunk, h0_BHPN=None, reset_BT=None,
                 dot_dtype=None):
  """Chunked MIMO SSD (module docstring): I input columns (u, k), O output columns (q), one
  [P, N] state per head. -> (y [B, T, H, O, P], h_T [B, H, P, N]) fp32. T need not be a
  multiple of `chunk` (the tail is padded with a = 0, u = k = q = 0). `reset_BT`: the state
  restarts there (a = -inf, as `ssd.ssd_chunked`); `dot_dtype` as there."""
  Bsz, T, H, _, P = u_BTHIP.shape
  a_BTH = ssd.restart_decay(a_BTH, reset_BT)
  Q = max(1, min(int(chunk), T))
  nc = -(-T // Q)
  pad = nc * Q - T

  def chunks(z):   # dtype kept: the matmuls cast their operands (`dot_dtype`)
    z = jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2))
    return z.reshape((Bsz, nc, Q) + z.shape[2:])

  u, a, k, q = chunks(u_BTHIP), chunks(a_BTH.astype(f32)), chunks(k_BTHIN), chunks(q_BTHON)
  dot = functools.partial(ssd.einsum_in, f32 if dot_dtype is None else dot_dtype)
  L = ssd.segsum_exp(a)                                               # [B, C, H, Q(t), Q(s)]
  qk = dot("bcthon,bcshin->bchtsoi", q, k)
  y_diag = dot("bchtsoi,bcship->bcthop", qk * L[..., None, None], u)
  rev = jnp.cumsum(a[:, :, ::-1], axis=2)[:, :, ::-1]                 # sum_{r>=s} a_r
  to_end = jnp.exp(jnp.pad(rev[:, :, 1:], ((0, 0), (0, 0), (0, 1), (0, 0))))
  S = dot("bcshin,bcship->bchpn", k, u * to_end[..., None, None])     # chunk states
  h_in, h_final = ssd.pass_chunk_states(jnp.sum(a, axis=2), S, h0_BHPN)  # [B, C, H, P, N]
  from_start = jnp.exp(jnp.cumsum(a, axis=2))                         # [B, C, Q, H]
  y_off = dot("bcthon,bchpn->bcthop", q, h_in) * from_start[..., None, None]
  return (y_diag + y_off).reshape(Bsz, nc * Q, H, -1, P)[:, :T], h_final


def mimo_recurrent(u_BTHIP, a_BTH, k_BTHIN, q_BTHON, *, h0_BHPN=None, reset_BT=None):
  """The MIMO recurrence one token at a time (lax.scan): h = e^a h + sum_i u_i k_i^T,
  y_o = h q_o. Same returns as `mimo_chunked`. `reset_BT`: h = 0 before these tokens."""
  Bsz, T, H, _, P = u_BTHIP.shape
  h0 = (jnp.zeros((Bsz, H, P, k_BTHIN.shape[-1]), f32) if h0_BHPN is None
        else h0_BHPN.astype(f32))

  def step(h, inp):
    if reset_BT is not None:
      r, *inp = inp
      h = jnp.where(r[:, None, None, None], 0.0, h)
    u, a, k, q = inp
    h = jnp.exp(a)[..., None, None] * h + jnp.einsum("bhip,bhin->bhpn", u, k)
    return h, jnp.einsum("bhpn,bhon->bhop", h, q)

  seq = tuple(jnp.moveaxis(z.astype(f32), 1, 0) for z in (u_BTHIP, a_BTH, k_BTHIN, q_BTHON))
  if reset_BT is not None:
    seq = (jnp.moveaxis(reset_BT, 1, 0),) + seq
  h, y = jax.lax.scan(step, h0, seq)
  return jnp.moveaxis(y, 0, 1), h


def trapezoid_mimo(x_BTHRP, a_BTH, gamma_BTH, betap_BTH, k_BTHRN, q_BTHRN, *, chunk=None,
                   h0_BHPN=None, x0_BHRP=None, k0_BHRN=None, reset_BT=None, dot_dtype=None,
                   mimo_fn=None):
  """The trapezoid with rank-r inputs X (x times w^x) and keys K: 2r input columns
  [gamma X_t ; beta X_{t-1}] with keys [K_t ; K_{t-1}], beta = beta' e^a; `chunk` None = the
  recurrence. -> (Y [B, T, H, r, P] without the D skip, h_T). `reset_BT`: documents restart
  at these tokens (module docstring); `dot_dtype` as `ssd.ssd_chunked`'s; `mimo_fn`: the
  chunked SSD (None: `mimo_chunked`; the fused kernels' `ssd_chunks.mimo_kernel`, same
  arguments and returns, as `ssd_chunks.chunked_mimo` chooses)."""
  B, T, H, r, P = x_BTHRP.shape
  N = k_BTHRN.shape[-1]
  x0 = jnp.zeros((B, H, r, P), f32) if x0_BHRP is None else x0_BHRP.astype(f32)
  k0 = jnp.zeros((B, H, r, N), f32) if k0_BHRN is None else k0_BHRN.astype(f32)
  x_prev, k_prev = previous_token(x_BTHRP, x0, reset_BT), previous_token(k_BTHRN, k0, reset_BT)
  beta = betap_BTH * jnp.exp(a_BTH)
  u = jnp.concatenate([x_BTHRP * gamma_BTH[..., None, None], x_prev * beta[..., None, None]],
                      axis=3)
  k = jnp.concatenate([k_BTHRN.astype(f32), k_prev], axis=3)
  if chunk is None:
    return mimo_recurrent(u, a_BTH, k, q_BTHRN, h0_BHPN=h0_BHPN, reset_BT=reset_BT)
  return (mimo_fn or mimo_chunked)(u, a_BTH, k, q_BTHRN, chunk=chunk, h0_BHPN=h0_BHPN,
                                   reset_BT=reset_BT, dot_dtype=dot_dtype)


@register_mixer("mamba3")
class Mamba3(FullForwardRemat, Mixer):

  @dataclasses.dataclass(frozen=True)
  class Options(ssd.HeadOptions):   # d_state, expand, head_dim, n_heads, n_groups
    rope_fraction: float = 0.5   # fraction of the state dims rotated (R = fraction * N / 2)
    chunk_size: int = 64
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    a_floor: float = 1e-4        # A <= -a_floor
    a_activation: str = "softplus"   # A = -f(A_raw): softplus | heavy_tail (module docstring)
    mimo_rank: int = 0           # MIMO rank r (0 = SISO; the paper's MIMO uses 4, with
                                 # chunk_size 64 / r)

    def n_angles(self) -> int:
      return int(self.d_state * self.rope_fraction) // 2

    def validate(self, cfg: ModelConfig, where: str) -> None:
      need = field_check(where)
      for f in ("d_state", "head_dim", "n_groups", "chunk_size"):
        need(is_int(getattr(self, f), 1), f, f"must be an integer >= 1, got {getattr(self, f)!r}")
      ssd.validate_inner_width(self, cfg.d_model, need)
      need(self.rope_fraction in (0.5, 1.0) and self.n_angles() >= 1, "rope_fraction",
           f"must be 0.5 or 1.0 with at least one angle, got {self.rope_fraction}")
      need(is_number(self.dt_min) and is_number(self.dt_max) and 0 < self.dt_min <= self.dt_max,
           "dt_min", "need 0 < dt_min <= dt_max")
      need(is_number(self.a_floor) and self.a_floor > 0, "a_floor",
           f"must be a number > 0, got {self.a_floor!r}")
      need(self.a_activation in A_ACTIVATIONS, "a_activation",
           f"must be one of {sorted(A_ACTIVATIONS)}, got {self.a_activation!r}")
      need(is_int(self.mimo_rank, 0), "mimo_rank",
           f"must be an integer >= 0 (0 = SISO), got {self.mimo_rank!r}")

  @classmethod
  def tiny(cls):
    return tiny_ssd_options(cls.Options())

  def __init__(self, cfg: ModelConfig, opts: "Mamba3.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    H, P, N, G, D = opts.heads(cfg), opts.head_dim, opts.d_state, opts.n_groups, cfg.d_model
    R = opts.n_angles()
    self.H, self.P, self.N, self.G, self.R = H, P, N, G, R
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    proj_in, proj_out = projection_inits(cfg, opts, H * P)
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, **proj_in)
    width = sum(math.prod(v) for v in self.part_shapes().values())
    self.in_proj = Linear((D,), (width,), in_axes=("embed",), out_axes=(None,), **kw)
    ones = nnx.initializers.ones
    self.head_scalars = param(rngs, head_scalars_init(opts), (2, H), (None, "heads"),
                              kind="scalar")                       # dt_bias, D
    self.bc_bias = param(rngs, ones, (2, H, N), (None, "heads", "state"), kind="bias")
    self.bc_norm = param(rngs, ones, (2, N), (None, "state"), kind="norm")
    kw.update(proj_out)   # the rescaled residual init (mamba2.projection_inits)
    self.out = Linear((H, P), (D,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)
    if opts.mimo_rank:
      self._init_mimo(opts.mimo_rank, rngs)

  def _init_mimo(self, r: int, rngs: nnx.Rngs):
    """MIMO: B/C biases r columns wide (the projection's B and C parts are: `part_shapes`),
    and the per-head rank weights w^x, w^z, w^o [H, r, P] (module docstring); they replace
    the SISO B/C biases."""
    H, P, N = self.H, self.P, self.N
    ones = nnx.initializers.ones
    self.bc_bias = param(rngs, ones, (2, H, r, N), (None, "heads", None, "state"), kind="bias")
    const = lambda v: param(rngs, nnx.initializers.constant(v), (H, r, P),
                            ("heads", None, "head_dim"), kind="scalar")
    self.mimo_x, self.mimo_z, self.mimo_o = const(1.0 / r), const(1.0), const(1.0 / r)

  def _bc(self, u_BT2GX):
    """B and C side by side ([B, T, 2, G, (r,) N]: the fused projection's adjacent parts) ->
    [B, T, 2, H, (r,) N]: each column RMS-normed over N with its own scale (b_norm, c_norm),
    repeated from groups to heads, plus its per-head bias (b_bias, c_bias). One pass for both,
    each entry as B's and C's own."""
    u = u_BT2GX.astype(f32)
    u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + self.cfg.norm_eps)
    scale = self.bc_norm[...].astype(f32)                        # [2, N]
    u = u * scale.reshape((2,) + (1,) * (u.ndim - 4) + scale.shape[1:])
    u = jnp.repeat(u, self.H // self.G, axis=3)                  # group -> heads
    return u + self.bc_bias[...].astype(f32)                     # [2, H, (r,) N]

  # the small parameters, rows of stacked ones (module docstring): read-only views
  dt_bias = property(lambda self: self.head_scalars[0])
  D = property(lambda self: self.head_scalars[1])
  b_bias = property(lambda self: self.bc_bias[0])
  c_bias = property(lambda self: self.bc_bias[1])
  b_norm = property(lambda self: self.bc_norm[0])
  c_norm = property(lambda self: self.bc_norm[1])

  def _inputs(self, x_BTD, positions_BT):
    """Per-token SSM inputs (fp32): x, a, gamma, beta', B and C (unrotated, side by side on
    axis 2: "bc"), angle increments, z."""
    valid = valid_mask(positions_BT)
    shapes = list(self.part_shapes().values())
    shapes[2:4] = [(2,) + shapes[2]]                             # B, C adjacent, one array
    z, x, bc, dt_raw, a_raw, lam_raw, theta_raw = (   # one matmul, kept for the backward
        p.astype(f32) for p in split_last(fused_projection(x_BTD, self.in_projections()),
                                          shapes))
    dt = jax.nn.softplus(dt_raw + self.dt_bias[...].astype(f32))
    dt = jnp.where(valid[..., None], dt, 0.0)
    A = jnp.minimum(-A_ACTIVATIONS[self.opts.a_activation](a_raw), -self.opts.a_floor)
    lam = jax.nn.sigmoid(lam_raw)
    theta = math.pi * jnp.tanh(theta_raw)                                # [B, T, R]
    return dict(x=x, a=A * dt, gamma=lam * dt, betap=(1 - lam) * dt, bc=self._bc(bc),
                inc=theta[:, :, None, :] * dt[..., None], z=z,
                n_valid=valid.sum(axis=1).astype(jnp.int32))

  def _rotated(self, u, phi_BTHR):
    """(k, q): B and C rotated by the angles, both in one pass."""
    ang = phi_BTHR[:, :, None]                                   # [B, T, 1, H, R]
    if self.opts.mimo_rank:
      ang = ang[..., None, :]                                    # [B, T, 1, H, 1, R]
    kq = rotate_pairs(u["bc"], ang)
    return kq[:, :, 0], kq[:, :, 1]

  def in_projections(self) -> tuple:
    """The in-projection (one Linear, the parts `IN_PROJ_PARTS` side by side) as
    `mamba2.fused_projection` takes it."""
    return (self.in_proj,)

  def part_shapes(self) -> dict:
    """{part: its per-token shape} of the in-projection's outputs, in order (`IN_PROJ_PARTS`;
    B and C [G, r, N] under MIMO rank r)."""
    H, P, N, G, R, r = self.H, self.P, self.N, self.G, self.R, self.opts.mimo_rank
    bc = (G, r, N) if r else (G, N)
    return dict(zip(IN_PROJ_PARTS, [(H, P), (H, P), bc, bc, (H,), (H,), (H,), (R,)]))

  def projected(self, x_BTD) -> dict:
    """{part: the in-projection's output of that part} (`part_shapes`; compute dtype)."""
    return dict(zip(IN_PROJ_PARTS, split_last(self.in_proj(x_BTD),
                                              list(self.part_shapes().values()))))

  def part_columns(self, name: str) -> slice:
    """The in-projection kernel's columns (last axis) of part `name` (`IN_PROJ_PARTS`)."""
    start = 0
    for k, shape in self.part_shapes().items():
      if k == name:
        return slice(start, start + math.prod(shape))
      start += math.prod(shape)
    raise KeyError(f"{name!r} is not one of {IN_PROJ_PARTS}")

  def ssm_heads(self, x_BTD, *, positions_BT, state=None, recurrent=False, segment_ids_BT=None):
    """-> (gated head outputs [B, T, H, P] fp32, new state). `recurrent`: the scan reference.
    `segment_ids_BT`: packed rows, everything restarts per document (module docstring)."""
    reset = document_resets(segment_ids_BT, state, type(self).__name__)
    if self.opts.mimo_rank:
      return self._mimo_heads(x_BTD, positions_BT=positions_BT, state=state, recurrent=recurrent,
                              reset_BT=reset)
    u = self._inputs(x_BTD, positions_BT)
    B, T = x_BTD.shape[:2]
    st = state if state is not None else self.init_state(self.cfg, self.opts, B, 0, f32)
    recurrent = recurrent or (state is not None and T == 1)     # decode step: the recurrence
    phi = self._angles(u, st, recurrent, reset)
    k, q = self._rotated(u, phi)
    carried = dict(h0_BHPN=st["ssm"], x0_BHP=st["x"].astype(f32), k0_BHN=st["k"].astype(f32),
                   reset_BT=reset)
    args = (u["x"], u["a"], u["gamma"], u["betap"], k, q)
    if recurrent:
      y, h = trapezoid_recurrent(*args, **carried)
    else:
      fn = ssd_chunks.chunked_ssd(state is None, u["x"].shape, k.shape, self.opts.chunk_size,
                                  what=type(self).__name__)
      y, h = trapezoid_chunked(*args, chunk=self.opts.chunk_size,
                               dot_dtype=dtype_of(self.cfg.dtype), ssd_fn=fn, **carried)
    y = (y + self.D[...].astype(f32)[:, None] * u["x"]) * jax.nn.silu(u["z"])
    return y, None if state is None else self._next_state(st, u, phi, h, k)

  def _angles(self, u, st, recurrent: bool, reset_BT=None):
    """Cumulative rotation angles of the new tokens after the carried ones (mod 2 pi),
    restarting at `reset_BT` (documents)."""
    if recurrent:
      return _sequential_angles(u["inc"], st["angle"], reset_BT)
    return wrapped_cumsum(u["inc"], st["angle"], self.opts.chunk_size, reset_BT)

  def _next_state(self, st, u, phi, h, k):
    """The decoding state after the call: angle, SSM state, the last valid token's k and x."""
    last = lambda prev, new: last_valid_window(prev[:, None], new, u["n_valid"])[:, 0]
    return {"angle": last(st["angle"], phi), "ssm": h,
            "k": last(st["k"], k).astype(st["k"].dtype),
            "x": last(st["x"], u["x"]).astype(st["x"].dtype)}

  def _mimo_heads(self, x_BTD, *, positions_BT, state=None, recurrent=False, reset_BT=None):
    """`ssm_heads` with rank-r inputs and outputs (module docstring); same returns."""
    u = self._inputs(x_BTD, positions_BT)                 # bc: [B, T, 2, H, r, N]
    B, T = x_BTD.shape[:2]
    st = state if state is not None else self.init_state(self.cfg, self.opts, B, 0, f32)
    recurrent = recurrent or (state is not None and T == 1)
    phi = self._angles(u, st, recurrent, reset_BT)
    k, q = self._rotated(u, phi)
    wx, wz, wo = (w[...].astype(f32) for w in (self.mimo_x, self.mimo_z, self.mimo_o))
    xr = u["x"][..., None, :] * wx                                       # [B, T, H, r, P]
    fn = None if recurrent else ssd_chunks.chunked_mimo(
        state is None, xr.shape, k.shape, self.opts.chunk_size, what=type(self).__name__)
    y, h = trapezoid_mimo(xr, u["a"], u["gamma"], u["betap"], k, q,
                          chunk=None if recurrent else self.opts.chunk_size, h0_BHPN=st["ssm"],
                          x0_BHRP=st["x"].astype(f32)[:, :, None] * wx, k0_BHRN=st["k"],
                          reset_BT=reset_BT, dot_dtype=dtype_of(self.cfg.dtype), mimo_fn=fn)
    y = (y + self.D[...].astype(f32)[:, None, None] * xr) * jax.nn.silu(u["z"][..., None, :] * wz)
    y = jnp.sum(y * wo, axis=3)
    return y, None if state is None else self._next_state(st, u, phi, h, k)

  def implicit_attention(self, x_BTD) -> dict:
    """The trapezoid's attention-like matrix of a full forward (positions 0..T-1), for
    diagnostics (eval/maps.py). Unrolled from h = 0 (module docstring's recurrence), the input
    x_j k_j^T enters h_j with weight gamma_j and h_{j+1} with beta'_{j+1} alpha_{j+1}, and
    L_{t,j+1} alpha_{j+1} = L_tj carries both to t:
        y_t = sum_{j<=t} M_tj x_j + D x_t,   M_tj = (q_t . k_j) L_tj (gamma_j + [j<t] beta'_{j+1})
    with L_tj = exp(a_{j+1} + ... + a_t), q, k the rotated C, B. MIMO: one matrix per (output
    column o, input column i), M_tjoi = (Q_to . K_ji) L_tj (...), acting on X_j[:, i].
    Returns decay [B, T, H] (alpha_t), L [B, H, T, T], M [B, H, T, T] (MIMO: [B, H, T, T, r, r],
    axes (o, i)), x (the input: [B, T, H, P]; MIMO X = x w^x, [B, T, H, r, P]) and mask; the
    output is then (y + D x) * SiLU(z) (MIMO: summed over o with w^o, z scaled by w^z)."""
    B, T = x_BTD.shape[:2]
    u = self._inputs(x_BTD, causal_positions(B, T))
    phi = self._angles(u, self.init_state(self.cfg, self.opts, B, 0, f32), recurrent=False)
    r = self.opts.mimo_rank
    k, q = self._rotated(u, phi)
    mask = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    A = jnp.cumsum(u["a"], axis=1).transpose(0, 2, 1)                  # [B, H, T]
    L = jnp.exp(jnp.where(mask, A[..., :, None] - A[..., None, :], -jnp.inf))
    betap_next = jnp.pad(u["betap"][:, 1:], ((0, 0), (0, 1), (0, 0))).transpose(0, 2, 1)
    strict = jnp.arange(T)[:, None] > jnp.arange(T)[None, :]
    weight = u["gamma"].transpose(0, 2, 1)[:, :, None, :] + jnp.where(
        strict, betap_next[:, :, None, :], 0.0)                         # [B, H, T, T]
    if r:
      qk = jnp.einsum("bthon,bjhin->bhtjoi", q, k)
      M = qk * (L * weight)[..., None, None]
      x = u["x"][..., None, :] * self.mimo_x[...].astype(f32)
    else:
      M, x = jnp.einsum("bthn,bjhn->bhtj", q, k) * L * weight, u["x"]
    return {"decay": jnp.exp(u["a"]), "L": L, "M": M, "x": x, "mask": mask}

  def project(self, y_BTHP):
    """The mixer's output: the heads' fp32 y [B, T, H, P] cast to the compute dtype, then
    the out-projection."""
    return self.out(y_BTHP.astype(dtype_of(self.cfg.dtype)))

  def reference(self, x_BTD, *, positions_BT, state=None, segment_ids_BT=None):
    """The same mixer through the token-by-token recurrence (test reference)."""
    y, state = self.ssm_heads(x_BTD, positions_BT=positions_BT, state=state, recurrent=True,
                              segment_ids_BT=segment_ids_BT)
    return self.project(y), state

  @classmethod
  def init_state(cls, cfg: ModelConfig, opts: "Mamba3.Options", batch: int, capacity: int,
                 dtype, policy=None):
    """Angles and SSM state in fp32, last token's k and x in `dtype`; no `capacity`."""
    del capacity
    H, P, N = opts.heads(cfg), opts.head_dim, opts.d_state
    return {"angle": jnp.zeros((batch, H, opts.n_angles()), f32),
            "ssm": jnp.zeros((batch, H, P, N), f32),
            "k": jnp.zeros((batch, H) + (opts.mimo_rank,) * bool(opts.mimo_rank) + (N,), dtype),
            "x": jnp.zeros((batch, H, P), dtype)}

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts: "Mamba3.Options", seq_len: int) -> float:
    """Chunked SSD with per-head B/C (G = H) and two inputs per token (the trapezoid);
    rotations, norms and gates are elementwise and not counted."""
    H = opts.heads(cfg)
    if opts.mimo_rank:   # 2r input columns, r output columns (mimo_chunked), one state
      r, P, N = opts.mimo_rank, opts.head_dim, opts.d_state
      Q = max(1, min(opts.chunk_size, seq_len))
      macs = 2 * r * r * H * (N + P) * (Q + 1) / 2 + 3 * r * H * P * N
      return 2.0 * macs + ssd.passing_flops_per_token(H * P * N, opts.chunk_size, seq_len)
    return ssd.ssd_flops_per_token(n_heads=H, head_dim=opts.head_dim, d_state=opts.d_state,
                                   n_groups=H, chunk=opts.chunk_size, seq_len=seq_len,
                                   n_inputs=2)


def _sequential_angles(inc_BTHR, phi0_BHR, reset_BT=None):
  """phi_t = (phi_{t-1} + inc_t) mod 2 pi, one token at a time (the reference's order);
  phi_{t-1} is taken as 0 at `reset_BT` tokens."""
  def step(phi, inp):
    if reset_BT is None:
      inc = inp
    else:
      r, inc = inp
      phi = jnp.where(r.reshape(r.shape + (1,) * (phi.ndim - 1)), 0.0, phi)
    phi = wrap(phi + inc)
    return phi, phi
  xs = jnp.moveaxis(inc_BTHR, 1, 0)
  if reset_BT is not None:
    xs = (jnp.moveaxis(reset_BT, 1, 0), xs)
  _, phi = jax.lax.scan(step, phi0_BHR.astype(f32), xs)
  return jnp.moveaxis(phi, 0, 1)
