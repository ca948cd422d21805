"""State-space duality (SSD): the scalar-decay linear recurrence of Mamba-2, in three forms.

The recurrence (one head; x_t in R^P, B_t, C_t in R^N, log-decay a_t <= 0):

    h_t = exp(a_t) h_{t-1} + x_t B_t^T          h_t in R^{P x N}
    y_t = h_t C_t

Unrolled, y_t = sum_{s<=t} exp(A_t - A_s) (C_t . B_s) x_s with A_t = a_1 + ... + a_t: a causal
"attention" whose mask L_ts = exp(A_t - A_s) is 1-semiseparable (Dao & Gu, "Transformers are
SSMs", 2024, section 6). The chunked algorithm splits time into chunks of Q tokens and the
matrix into diagonal blocks (within a chunk) and low-rank off-diagonal blocks (across chunks):

1. intra-chunk ("segsum"):  y_diag_t = sum_{s in chunk, s<=t} exp(A_t - A_s) (C_t . B_s) x_s,
   with A the cumulative sum *within the chunk*; two matmuls per chunk (C B^T, then with x).
2. chunk states:  S_c = sum_{s in c} exp(A_end - A_s) x_s B_s^T  (the state a chunk adds).
3. inter-chunk recurrence:  H_c = exp(A_end(c-1)) H_{c-1} + S_{c-1} (H_0 = the initial state),
   unrolled into matmuls with chunk-level segsum matrices (`pass_chunk_states`).
4. state -> output:  y_off_t = exp(A_t) H_c C_t  for t in chunk c.

y = y_diag + y_off. Every exponent is a sum of non-positive log-decays a_r over a segment
(s, t] inside one chunk, so nothing above exp(0) = 1 is ever computed, at any length; the
segment sums are accumulated directly (masked cumulative sums, reverse cumulative sums for the
decay to the chunk end) rather than as differences A_t - A_s of one running sum, so strong
decay loses no accuracy to cancellation, and the sums restart every chunk.

This follows `ssd_minimal_discrete` in state-spaces/mamba (`mamba_ssm/modules/ssd_minimal.py`,
Listing 1 of the paper), with the decay to the chunk end as a direct sum. Step 3 is the
listing's segsum matmul over chunks rather than a scan over chunks (on a GPU every iteration of
a loop is a host round trip, so a loop whose length grows with T is a slow step), blocked in
~sqrt(C) groups past 64 chunks so its work stays ~C^1.5 (`entering_states`).
`ssd_chunked(..., extra=(x2, B2))` adds a second input x2_t B2_t^T per token (Mamba-3).

Document boundaries (packed rows; `reset_BT` [B, T] bool, True at a document's first token t0,
`layers.segment_starts`): the state restarts, h_{t0} = x_{t0} B_{t0}^T, as at the start of a
fresh row. The chunked form sets a_{t0} = -inf (decay factor exp(a_{t0}) = 0). Every term that
carries something from before t0 to t0 or later has a_{t0} in its exponent, so it is 0:
  segsum   L_ts, s < t0 <= t: a_{s+1} + ... + a_t includes a_{t0};
  to_end   exp(a_{s+1} + ... + a_end), s < t0 <= end: such s add nothing to the chunk state S_c;
  chunks   exp(A_end(c)) = 0 for a chunk holding a start: H_{c+1} = S_c, nothing older;
  output   exp(A_t) H_c, t >= t0 in chunk c (also when t0 is the chunk's first token).
A term within one document sums a_r over (s, t] with s >= t0, never a_{t0}: it is the term of
the document alone (the same exponents; only where chunk boundaries fall, i.e. rounding,
differs). a_{t0} itself reaches nothing, as the first token's decay of a fresh row (gradient 0
in both). Exponents are sums of values <= 0 and -inf (never inf - inf), and exp(-inf) = 0 with
derivative 0, so neither pass meets a NaN.
`ssd_recurrent(reset_BT=)` instead zeroes h before the start token's update (the reference).

`ssd_recurrent` is the explicit step-by-step recurrence (a `lax.scan` over time): the reference
for tests and the naive baseline of `experiments/bench_ssd.py`. `ssd_step` is one token of it
(the decode step).

Precision. Decays, exponents, segment sums and states are fp32 in every form. The chunked
form's four matmul steps (C B^T, its product with x, the chunk states, the state -> output)
take their operands in `dot_dtype` and accumulate in fp32: fp32 by default (the references,
the tests), the model's compute dtype in the mixers, as mamba_ssm's Triton kernels feed their
tensor-core dots bf16 tiles (the decayed C B^T cast to x's dtype before its product with x,
the entering states cast to C's before theirs). fp32 operands would make them fp32 matmuls on
a GPU at a fraction of the bf16 rate and twice the bytes. Their backward takes the cotangent
in `dot_dtype` too (`einsum_in`): left to autodiff, an fp32 cotangent against a bf16 operand
widens the operand and both backward matmuls run in fp32. The chunk-state passing stays fp32.

B and C are given per group ([..., G, N]) and shared by the H/G heads of a group (Mamba-2's
n_groups; Mamba-3 passes G = H since its B, C are rotated per head).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from attn_jax.field_checks import is_int, is_number

f32 = jnp.float32


def _check(x_BTHP, a_BTH, b_BTGN, c_BTGN):
  B, T, H, _ = x_BTHP.shape
  G = b_BTGN.shape[2]
  if a_BTH.shape != (B, T, H) or b_BTGN.shape != c_BTGN.shape or b_BTGN.shape[:2] != (B, T) \
      or H % G:
    raise ValueError(f"SSD shapes do not fit: x {x_BTHP.shape}, a {a_BTH.shape}, "
                     f"B {b_BTGN.shape}, C {c_BTGN.shape}")
  return B, T, H, G


def segsum_exp(a_BCQH: jax.Array) -> jax.Array:
  """L[b, c, h, t, s] = exp(a_{s+1} + ... + a_t) for s <= t, else 0, within each chunk.

  The segment sums are summed directly (a masked cumulative sum down each column, as the
  "stable" `segsum` of ssd_minimal.py) rather than as differences A_t - A_s of one cumulative
  sum, which would lose ~|A| * 2^-24 of absolute accuracy in the exponent under strong decay.
  Masked entries get -inf before the exp, so only sums of non-positive terms are exponentiated
  (and the masked part has zero gradient).
  """
  Q = a_BCQH.shape[2]
  a = jnp.moveaxis(a_BCQH.astype(f32), 3, 2)                    # [B, C, H, Q]
  strict = jnp.tril(jnp.ones((Q, Q), bool), -1)                 # r > s
  terms = jnp.where(strict, a[..., :, None], 0.0)               # [.., r, s] = a_r if r > s
  seg = jnp.cumsum(terms, axis=-2)                              # [.., t, s] = sum_{s<r<=t} a_r
  return jnp.exp(jnp.where(jnp.tril(jnp.ones((Q, Q), bool)), seg, -jnp.inf))


def pass_chunk_states(loga_BCX: jax.Array, S_BCXPN: jax.Array, h0_BXPN: jax.Array | None):
  """The states entering each chunk of H_{c+1} = exp(z_c) H_c + S_c (H_0 = h0), unrolled:

      H_c = exp(z_0 + ... + z_{c-1}) h0 + sum_{c' < c} exp(z_{c'+1} + ... + z_{c-1}) S_{c'}

  as matmuls with segsum matrices (the Mamba-2 paper's Listing 1, step 3; `entering_states`
  blocks them so the work stays ~n^1.5 for n chunks): no loop over the chunks, whose count
  grows with T (a `lax.scan` there is a host round trip per chunk on a GPU).
  z: [B, C, X...] total log-decay of each chunk (<= 0, -inf across a restart); S: [B, C, X...,
  P, N]; h0: [B, X..., P, N] or None (zero). Returns (H_0 .. H_{C-1} [B, C, X..., P, N],
  H_C = exp(z_{C-1}) H_{C-1} + S_{C-1}, the final state)."""
  Bsz, C = loga_BCX.shape[:2]
  X, PN = loga_BCX.shape[2:], S_BCXPN.shape[-2:]
  z = loga_BCX.astype(f32).reshape(Bsz, C, -1)
  flat = lambda a, lead: a.reshape(lead + (z.shape[-1],) + PN)
  h0 = None if h0_BXPN is None else flat(h0_BXPN.astype(f32), (Bsz,))
  H = entering_states(z, flat(S_BCXPN, (Bsz, C)), h0)
  final = jnp.exp(z[:, -1])[..., None, None] * H[:, -1] + flat(S_BCXPN[:, -1], (Bsz,))
  return H.reshape((Bsz, C) + X + PN), final.reshape((Bsz,) + X + PN)


DIRECT_MAX = 64   # entering_states: one segsum matmul up to this many items


def _block_size(n: int) -> int:
  """Items per block of `entering_states` (n > DIRECT_MAX): the power of two nearest above
  sqrt(n) (so that a power-of-two n splits into whole blocks without padding)."""
  return 1 << math.ceil(math.log2(math.sqrt(n)))


def _exclusive_cumsum(w: jax.Array, axis: int) -> jax.Array:
  """sum_{r < t} w_r along `axis`, summed directly (no difference: -inf entries stay exact)."""
  pad = [(0, 0)] * w.ndim
  pad[axis] = (1, 0)
  return jnp.pad(jnp.cumsum(jax.lax.slice_in_dim(w, 0, w.shape[axis] - 1, axis=axis), axis),
                 pad)


def _entering_matrix(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(Lx, last) from w [..., n, X] (the item axis second to last but one): Lx[.., X, t, s] =
  exp(w_{s+1} + ... + w_{t-1}) for s < t (the state entering item t, from item s), 0 else;
  last[.., X, s] = exp(w_{s+1} + ... + w_{n-1}) (item s's share of the state after the last)."""
  L = segsum_exp(w)                                              # [.., X, n (t), n (s)]
  Lx = jnp.pad(L[..., :-1, :], [(0, 0)] * (L.ndim - 2) + [(1, 0), (0, 0)])
  return Lx, L[..., -1, :]


def entering_states(w_BnX: jax.Array, s_BnXPN: jax.Array, h0_BXPN: jax.Array | None):
  """H_t, the state entering item t of H_{t+1} = exp(w_t) H_t + s_t (H_0 = h0, None = 0;
  w_t <= 0 or -inf), for t < n, without a loop and without copying the [B, n, X, P, N] items.

  Up to DIRECT_MAX items: H = Lx s (`_entering_matrix`, n (n - 1) / 2 multiply-adds per state
  entry) + exp(w_0 + ... + w_{t-1}) h0. Beyond: blocks of K ~ sqrt(n) items: within each the
  same matmul from a zero state, the state each block leaves (its last row of the segsum
  matrix against its items) passed over the M = n / K blocks by this function (their decays
  the block sums, h0 entering the first), and each item adds the state entering its block
  decayed by exp(w_{block start} + ... + w_{t-1}). Every exponent is a direct sum of terms
  <= 0 (no difference of large sums)."""
  Bsz, n = w_BnX.shape[:2]
  if n <= DIRECT_MAX:
    Lx, _ = _entering_matrix(w_BnX[:, None])                     # [B, 1, X, n, n]
    H = jnp.einsum("bxts,bsxpn->btxpn", Lx[:, 0], s_BnXPN)
    if h0_BXPN is not None:
      H = H + jnp.exp(_exclusive_cumsum(w_BnX, 1))[..., None, None] * h0_BXPN[:, None]
    return H
  K = _block_size(n)
  M = -(-n // K)
  def pad(a):   # whole blocks (none added for a power-of-two n)
    return a if M * K == n else jnp.pad(a, [(0, 0), (0, M * K - n)] + [(0, 0)] * (a.ndim - 2))
  w = pad(w_BnX).reshape((Bsz, M, K) + w_BnX.shape[2:])          # [B, M, K, X]
  s = pad(s_BnXPN).reshape((Bsz, M, K) + s_BnXPN.shape[2:])      # [B, M, K, X, P, N]
  Lx, last = _entering_matrix(w)                                 # [B, M, X, K, K], [B, M, X, K]
  local = jnp.einsum("bmxts,bmsxpn->bmtxpn", Lx, s)              # from a zero state
  leaves = jnp.einsum("bmxs,bmsxpn->bmxpn", last, s)             # each block's own end state
  G = entering_states(jnp.sum(w, axis=2), leaves, h0_BXPN)       # [B, M, X, P, N]
  into = jnp.exp(_exclusive_cumsum(w, 2))                        # block start .. t - 1
  H = (local + into[..., None, None] * G[:, :, None]).reshape((Bsz, M * K) + s.shape[3:])
  return H if M * K == n else H[:, :n]


def recurrence_macs(n: int) -> float:
  """Multiply-adds per state entry of `entering_states` over n items (causal convention: the
  strict lower triangles of its segsum matrices, a block's end state K, the block corrections
  one each)."""
  if n <= DIRECT_MAX:
    return n * (n - 1) / 2
  K = _block_size(n)
  M = -(-n // K)
  return M * K * (K - 1) / 2 + M * K + recurrence_macs(M) + M * K


def restart_decay(a_BTH: jax.Array, reset_BT) -> jax.Array:
  """a with -inf at the reset tokens (decay factor 0: nothing before them survives); a itself
  when `reset_BT` is None (no op added to the program)."""
  if reset_BT is None:
    return a_BTH
  if reset_BT.shape != a_BTH.shape[:2]:
    raise ValueError(f"reset_BT must have shape {a_BTH.shape[:2]}, got {reset_BT.shape}")
  return jnp.where(reset_BT[:, :, None], -jnp.inf, a_BTH.astype(f32))


def einsum_in(dtype, spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """einsum(spec, x, y) with operands in `dtype`, accumulated and returned in fp32; its
  backward's matmuls also take `dtype` operands (`_low_dot`)."""
  if jnp.dtype(dtype) == f32:
    return jnp.einsum(spec, x.astype(f32), y.astype(f32))
  return _low_dot(dtype, spec, x.astype(dtype), y.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _low_dot(dtype, spec, x, y):
  return jnp.einsum(spec, x, y, preferred_element_type=f32)


def _low_dot_fwd(dtype, spec, x, y):
  return _low_dot(dtype, spec, x, y), (x, y)


def _low_dot_bwd(dtype, spec, res, g):
  """The cotangent in `dtype` too: left to autodiff, an fp32 cotangent against a `dtype`
  operand makes XLA widen the operand, and both backward matmuls run in fp32."""
  _, vjp = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), *res)
  return vjp(g.astype(dtype))


_low_dot.defvjp(_low_dot_fwd, _low_dot_bwd)


def ssd_chunked(x_BTHP, a_BTH, b_BTGN, c_BTGN, *, chunk: int, h0_BHPN=None, extra=None,
                reset_BT=None, dot_dtype=None):
  """Chunked SSD (see module docstring). Returns (y_BTHP fp32, final state h_BHPN fp32).

  `reset_BT` [B, T] bool: the state restarts at these tokens (documents, module docstring).

  `extra = (x2_BTHP, b2_BTGN)` adds a second input, h_t = exp(a_t) h_{t-1} + x_t B_t^T +
  x2_t B2_t^T (Mamba-3's trapezoid): it goes through steps 1 and 2 like the first.

  T need not be a multiple of `chunk`: the tail is padded with a = 0 (decay 1), x = B = C = 0,
  which leaves the state unchanged; the padded outputs are dropped.

  `dot_dtype`: the operand dtype of the four matmul steps (None: fp32), see "Precision" in the
  module docstring; products accumulate in fp32 whatever it is.
  """
  Bsz, T, H, G = _check(x_BTHP, a_BTH, b_BTGN, c_BTGN)
  P, N, J = x_BTHP.shape[-1], b_BTGN.shape[-1], H // G
  a_BTH = restart_decay(a_BTH, reset_BT)
  Q = max(1, min(int(chunk), T))
  nc = -(-T // Q)
  pad = nc * Q - T

  def chunks(z):   # dtype kept: the matmuls cast their operands (`dot_dtype`)
    if pad:
      z = jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2))
    return z.reshape((Bsz, nc, Q) + z.shape[2:])

  terms = [(x_BTHP, b_BTGN)] + ([tuple(extra)] if extra is not None else [])
  terms = [(chunks(x).reshape(Bsz, nc, Q, G, J, P), chunks(b)) for x, b in terms]
  a = chunks(a_BTH.astype(f32))                                 # [B, C, Q, H]
  c = chunks(c_BTGN)                                            # [B, C, Q, G, N]
  A = jnp.cumsum(a, axis=2)                                     # within-chunk cumulative decay
  dot = functools.partial(einsum_in, f32 if dot_dtype is None else dot_dtype)

  # 1. intra-chunk: (C B^T) masked by the segsum decay, then with x.
  L = segsum_exp(a).reshape(Bsz, nc, G, J, Q, Q)
  y_diag = sum(dot("bcgjts,bcsgjp->bctgjp", dot("bctgn,bcsgn->bcgts", c, b)[:, :, :, None] * L, x)
               for x, b in terms)

  # 2. chunk states: decay from each token to the chunk end, exp(a_{s+1} + ... + a_end),
  # summed directly (exclusive reverse cumulative sum), not as A_end - A_s.
  rev = jnp.cumsum(a[:, :, ::-1], axis=2)[:, :, ::-1]           # sum_{r>=s} a_r
  to_end = jnp.exp(jnp.pad(rev[:, :, 1:], ((0, 0), (0, 0), (0, 1), (0, 0))))
  to_end = to_end.reshape(Bsz, nc, Q, G, J)
  S = sum(dot("bcsgn,bcsgjp->bcgjpn", b, x * to_end[..., None])  # [B, C, G, J, P, N]
          for x, b in terms)

  # 3. inter-chunk recurrence, as one segsum matmul over chunks: state entering each chunk.
  chunk_loga = A[:, :, -1, :].reshape(Bsz, nc, G, J)          # total chunk log-decay
  h0 = None if h0_BHPN is None else h0_BHPN.reshape(Bsz, G, J, P, N)
  h_in, h_final = pass_chunk_states(chunk_loga, S, h0)          # [B, C, G, J, P, N]

  # 4. state -> output: decay from the chunk start to t (exponent A_t <= 0).
  from_start = jnp.exp(A).reshape(Bsz, nc, Q, G, J)
  y_off = dot("bctgn,bcgjpn->bctgjp", c, h_in) * from_start[..., None]

  y = (y_diag + y_off).reshape(Bsz, nc * Q, H, P)[:, :T]
  return y, h_final.reshape(Bsz, H, P, N)


def ssd_step(h_BHPN, x_BHP, a_BH, b_BGN, c_BGN):
  """One token of the recurrence: returns (y_BHP, new h_BHPN), fp32."""
  Bsz, H, P = x_BHP.shape
  G, N = b_BGN.shape[1:]
  J = H // G
  h = h_BHPN.astype(f32).reshape(Bsz, G, J, P, N)
  x = x_BHP.astype(f32).reshape(Bsz, G, J, P)
  b, c = b_BGN.astype(f32), c_BGN.astype(f32)
  dec = jnp.exp(a_BH.astype(f32)).reshape(Bsz, G, J)
  h = dec[..., None, None] * h + jnp.einsum("bgjp,bgn->bgjpn", x, b)
  y = jnp.einsum("bgjpn,bgn->bgjp", h, c)
  return y.reshape(Bsz, H, P), h.reshape(Bsz, H, P, N)


def ssd_recurrent(x_BTHP, a_BTH, b_BTGN, c_BTGN, *, h0_BHPN=None, reset_BT=None):
  """The explicit recurrence, one token at a time (lax.scan over T). Same returns as ssd_chunked.
  `reset_BT`: h is set to 0 before the update of these tokens (a document's first token)."""
  Bsz, T, H, G = _check(x_BTHP, a_BTH, b_BTGN, c_BTGN)
  P, N = x_BTHP.shape[-1], b_BTGN.shape[-1]
  h0 = jnp.zeros((Bsz, H, P, N), f32) if h0_BHPN is None else h0_BHPN.astype(f32)

  def step(h, inp):
    if reset_BT is not None:
      r, *inp = inp
      h = jnp.where(r[:, None, None, None], 0.0, h)
    y, h = ssd_step(h, *inp)
    return h, y

  seq = (x_BTHP, a_BTH, b_BTGN, c_BTGN) if reset_BT is None else (reset_BT, x_BTHP, a_BTH,
                                                                  b_BTGN, c_BTGN)
  seq = tuple(jnp.moveaxis(z, 1, 0) for z in seq)
  h, y_TBHP = jax.lax.scan(step, h0, seq)
  return jnp.moveaxis(y_TBHP, 0, 1), h


def ssd_flops_per_token(*, n_heads: int, head_dim: int, d_state: int, n_groups: int,
                        chunk: int, seq_len: int, n_inputs: int = 1) -> float:
  """Forward FLOPs per token of `ssd_chunked` (2 per multiply-add), causal convention.

  Intra-chunk C B^T (per group) and its product with x (per head) count the lower triangle
  only, (Q+1)/2 key positions per token, as causal attention does; chunk states and the
  state->output products are N*P multiply-adds per head per token each; the state passing
  (`pass_chunk_states` over C = ceil(T / Q) chunks, `passing_flops_per_token`) grows slowly
  with T per token (~sqrt(C) / Q N*P per head). Elementwise work (exp, masks, decays)
  is not counted. `n_inputs` = 2 with `extra`: the intra-chunk and chunk-state work is done per
  input.
  """
  H, P, N, G, R = n_heads, head_dim, d_state, n_groups, n_inputs
  Q = max(1, min(chunk, seq_len))
  macs = R * (G * N + H * P) * (Q + 1) / 2 + (R + 1) * H * P * N
  return 2.0 * macs + passing_flops_per_token(H * P * N, chunk, seq_len)


def passing_flops_per_token(state_size: int, chunk: int, seq_len: int) -> float:
  """FLOPs per token of `pass_chunk_states` for `state_size` = H P N state entries:
  `recurrence_macs` of its C items (C = ceil(seq_len / chunk)) per sequence of seq_len
  tokens (the final state's update, one per entry, included)."""
  C = -(-seq_len // max(1, min(chunk, seq_len)))
  return 2.0 * state_size * (recurrence_macs(C) + 1) / seq_len


@dataclasses.dataclass(frozen=True)
class HeadOptions:
  """The SSM width fields Mamba-2 and Mamba-3 options share (their `Options` extend it), and
  the projections' initialisation (`mamba2.projection_inits`)."""
  d_state: int = 64            # N
  expand: float = 2.0          # d_inner = expand * d_model (when n_heads = 0)
  head_dim: int = 64           # P
  n_heads: int = 0             # 0: d_inner / head_dim; else overrides expand
  n_groups: int = 1            # G: groups of B/C projections (heads per group share them)
  proj_init: str = "fan_in"    # fan_in: mamba_ssm's (PyTorch default); normal: N(0, init_std)

  def heads(self, cfg) -> int:
    return inner_heads(self, cfg.d_model)


PROJ_INITS = ("fan_in", "normal")


def inner_heads(opts, d_model: int) -> int:
  """SSM heads of a Mamba block's options: `n_heads`, or expand * d_model / head_dim."""
  return opts.n_heads or int(round(opts.expand * d_model)) // opts.head_dim


def validate_inner_width(opts, d_model: int, need) -> None:
  """The head/width checks shared by the Mamba-2 and Mamba-3 options (`need(cond, field,
  msg)` raises naming the field)."""
  need(is_int(opts.n_heads, 0), "n_heads", f"must be an integer >= 0, got {opts.n_heads!r}")
  if not opts.n_heads:
    need(is_number(opts.expand) and opts.expand > 0, "expand",
         f"must be a number > 0, got {opts.expand!r}")
    d_inner = opts.expand * d_model
    need(d_inner == int(d_inner) and int(d_inner) % opts.head_dim == 0, "expand",
         f"expand * d_model = {d_inner} must be a multiple of head_dim={opts.head_dim}")
  heads = inner_heads(opts, d_model)
  need(heads % opts.n_groups == 0, "n_groups",
       f"n_heads={heads} must be a multiple of n_groups={opts.n_groups}")
  need(opts.proj_init in PROJ_INITS, "proj_init",
       f"must be one of {PROJ_INITS}, got {opts.proj_init!r}")
