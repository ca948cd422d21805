"""Maps to look at: what each mixer's "attention" is made of, as explicit [T, T] matrices.

For a few tokens of a (small) model, these functions form dense fp32 matrices from the mixers'
own projections, for plotting (notebooks/tour.ipynb) and for tests. They are O(T^2) and meant
for short sequences; the mixers themselves never form them.

`layer_inputs(model, tokens)`: every layer's mixer and the (normed) input it reads, with the
residual stream advanced by the real blocks (as `attention_mass.attention_maps` does).

`sisa_score_parts(mixer, x)` (attention/sisa.py): SISA's score split into its two terms,

    score_ij = q_i.k_j / sqrt(d_h)  +  lambda e^{g_i - g_j} (R(Phi_i) C_i).(R(Phi_j) B_j)
               `qk`                    `importance` = lambda * `decay` * `match`

with g, Phi the cumulative sums of log a and theta. `decay` is the SSM forgetting factor
(1 on the diagonal, falling with the log-decay accumulated between j and i), `match` the
read/write agreement of query i's C with key j's B.

`sinkhorn_sort_matrix(mixer, x)` (attention/sinkhorn.py): the balanced sort matrix P over
blocks (row i: how block i's sorted slot mixes the other blocks' keys and values) and, for the
non-causal mode, the hard permutation used at inference (the greedy assignment).

`mamba2_decay(mixer, x)` (ssm/mamba2.py; also the SSM branch of `hybrid_heads`): Mamba-2's
per-token decay exp(a_t) = exp(-exp(A_log) dt_t), the cumulative decay
L_ij = exp(a_{j+1} + ... + a_i) (j <= i), and the SSD's attention-like matrix
M_ij = (C_i . B_j) L_ij dt_j, with which the scan's output is y_i = sum_j M_ij x_j
(state-space duality, Dao & Gu 2024, section 3).

`implicit_attention(mixer, x)`: the same through any SSM mixer's own `implicit_attention` hook
(Mamba-2, the SSM branch of `hybrid_heads`, Mamba-3 SISO and MIMO: ssm/mamba3.py, whose
trapezoid gives M_ij = (q_i . k_j) L_ij (gamma_j + [j<i] beta'_{j+1}) on the un-convolved x);
nothing here reads a mixer's parameters.

Every matrix is [B, H, T, T] (Sinkhorn: [B, K, N, N] over kv heads and blocks) with zeros
above the diagonal where the quantity is causal, plus the boolean `mask` of defined entries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from attn_jax.attention import sinkhorn as sinkhorn_lib
from attn_jax.attention import sisa as sisa_lib

f32 = jnp.float32


def layer_inputs(model, tokens_BT) -> list:
  """[(layer index, mixer, normed mixer input [B, T', D] fp32)] in depth order; T' includes
  the sink tokens (`cfg.sink_tokens`), which come first."""
  cfg = model.cfg
  x = jnp.take(model.embed[...], tokens_BT, axis=0).astype(f32)
  if cfg.sink_tokens:
    x, _ = model._prepend_sinks(x, None)
  graphdef, stacked = nnx.split(model.blocks)
  out = []
  for r in range(cfg.n_repeats):
    period = nnx.merge(graphdef, jax.tree.map(lambda a: a[r], stacked))
    for blk in period.layers:
      out.append((len(out), blk.mixer, blk.mixer_norm(x)))
      if len(out) < cfg.n_layers:      # the last block's output is not needed
        x, _, _ = blk(x, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
                      train=False)
  return out


def _causal(T: int) -> jax.Array:
  return jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]


def sisa_score_parts(mixer, x_BTD) -> dict:
  """SISA's score terms for a full forward of `x_BTD` (positions 0..T-1), [B, H, T, T] fp32:
  qk, importance, decay (e^{g_i - g_j}), match ((R C_i).(R B_j)), plus lam [H] and mask."""
  f = mixer.features(x_BTD, None)
  q, k, lam = f.q, f.k, f.lam
  g, phi = sisa_lib.decay_and_phase(f.loga, f.theta)
  rc = f.c.astype(f32) if phi is None else sisa_lib.rotate_pairs(f.c, phi)
  rb = f.b.astype(f32) if phi is None else sisa_lib.rotate_pairs(f.b, phi)
  T = x_BTD.shape[1]
  mask = _causal(T)
  qk = jnp.einsum("bihd,bjhd->bhij", q.astype(f32), k.astype(f32)) / math.sqrt(q.shape[-1])
  dg = g.astype(f32).transpose(0, 2, 1)
  decay = jnp.exp(jnp.where(mask, dg[..., :, None] - dg[..., None, :], -jnp.inf))
  match = jnp.einsum("bihs,bjhs->bhij", rc.astype(f32), rb.astype(f32))
  importance = lam.astype(f32)[None, :, None, None] * decay * match
  zero = lambda a: jnp.where(mask, a, 0.0)
  return {"qk": zero(qk), "importance": zero(importance), "decay": decay, "match": zero(match),
          "lam": lam.astype(f32), "mask": mask}


def sinkhorn_sort_matrix(mixer, x_BTD) -> dict:
  """The balanced block-sort matrix of a Sinkhorn mixer (inference mode: no Gumbel noise).

  P [B, K, N, N]: exp of the mixer's log-space Sinkhorn result, 0 where a block may not take
  another (causal: only strictly earlier blocks). mask: the allowed entries. row_sums and
  col_sums of P. hard [B, K, N, N]: the one-hot inference permutation (non-causal mode;
  None in causal mode, whose rows each take their argmax past block)."""
  B, T, _ = x_BTD.shape
  _, aux = mixer.core(x_BTD, jnp.broadcast_to(jnp.arange(T), (B, T)), None, False)
  mask = jnp.broadcast_to(aux["allowed"], aux["logp"].shape)
  P = jnp.where(mask, jnp.exp(aux["logp"]), 0.0)
  hard = None
  if not mixer.opts.causal:
    idx, ok = sinkhorn_lib.greedy_permutation(aux["logp"], mask)
    hard = jax.nn.one_hot(idx, P.shape[-1]) * ok[..., None]
  return {"P": P, "mask": mask, "row_sums": P.sum(-1), "col_sums": P.sum(-2), "hard": hard}


def implicit_attention(mixer, x_BTD) -> dict:
  """An SSM mixer's decay and attention-like matrix for a full forward (positions 0..T-1),
  from its own `implicit_attention` hook: decay [B, T, H], L and M [B, H, T, T] (Mamba-3 MIMO:
  M [B, H, T, T, r, r]), the input x that M multiplies, mask, and the mixer's extras (Mamba-2:
  dt)."""
  return mixer.implicit_attention(x_BTD)


def mamba2_decay(mixer, x_BTD) -> dict:
  """Mamba-2's decay and SSD matrix (`implicit_attention` of a Mamba2 module, or of a
  `hybrid_heads` mixer's SSM branch): decay [B, T, H] (exp(a_t)), dt [B, T, H], L and M
  [B, H, T, T] (see the module docstring), x [B, T, H, P] (the conv+SiLU input the SSD scans)
  and mask."""
  return implicit_attention(mixer, x_BTD)
