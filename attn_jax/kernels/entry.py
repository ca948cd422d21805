"""The kernels room's entry point: a mixer hands over its features, this module chooses the core
(through `kernel_choice`, from the platform the program is compiled for, the shapes and the
options) and calls it. No mixer names a core; each computes its features and calls one of:

  attend(q, k, v, ...)                 softmax attention (masks by positions / documents /
                                       window, score bias, sink logit): the Transformer, sliding
                                       window, Sinkhorn, the hybrid heads
  attend_decayed(q, k, v, decay, ...)  decayed attention, `decay` one of
      LogitDecay(log f)                s_ij = scale q_i.k_j + g_i - g_j, g = cumsum(log f)
                                       (FoX; ALiBi with log f = -m_h)
      MatchDecay(R C, R B, g, lambda)  s_ij = scale q_i.k_j + lambda e^{g_i - g_j} (R C_i).(R B_j)
                                       (SISA)
      MatchFactors(c, b, g)            MatchDecay with the kernel's factors made by the caller
                                       (c = lambda R C, b = R B in q's dtype; `match_factors`),
                                       only where `takes_decayed_kernel` says the kernel is taken
  takes_decayed_kernel(...)            whether attend_decayed takes the decayed kernel: a mixer
                                       that asks first can make the kernel's factors itself, in
                                       a rematerialised function of its input (SISA)
  fused_prefill(q, k, v, decay, ...)   a prompt's first call into an empty dense cache: the
                                       decayed kernel's full forward, or None (the mixer's
                                       cached path)

The cores, one module each:
  dense.py       the fp32 softmax, the "einsum" / CPU "blocked" core (query chunks over their key
                 prefix), the explicit reference
  dpa.py         `jax.nn.dot_product_attention` with "xla" / "cudnn" (GPU: cuDNN flash attention)
  splash.py      TPU: JAX's Pallas splash-attention kernel under a `shard_map`
  blockwise.py   the FlashAttention-2 loops in XLA over earlier key blocks, for any score
                 function (online softmax forward, recomputing backward; O(T) memory)
  lse_merge.py   attention over one part of the keys with its log-sum-exp, and the exact merge
                 of parts
  forget_xla.py  logit decay in XLA: query blocks over their keys ("blocked") or the diagonal
                 blocks plus `blockwise` ("flash"), each pair's decay from disjoint sums
  sisa_xla.py    match decay in XLA: one widened-Q/K softmax call ("fast") or block pairs with
                 per-pair references ("chunked")
  decayed.py     the Pallas kernel for both decays (Triton on a GPU, Mosaic on a TPU, the
                 interpreter on a CPU)
  masks.py       what a query sees (positions, documents, window), shared by all of them

The choices (each is `kernel_choice`'s; this module only asks and calls):
  softmax core   `impl="auto"`: CPU -> "blocked", GPU -> "cudnn" for bf16 / fp16 heads cuDNN
                 supports (else "xla"), TPU -> "splash" where it applies (`splash.splash_problem`
                 names why not; then "xla"); another `impl` is taken as it is.
  remat          `attend(remat=True)`: a core that keeps the [T, S] probabilities for its
                 backward ("einsum", "blocked", "xla") is rematerialised; fused ones keep O(T).
  decayed        `attend_decayed(path="auto")` on a GPU / TPU takes the Pallas kernel where its
                 shapes fit (`decayed.use_kernel`; a misfit is logged once, naming why); else
                 the XLA core: LogitDecay's "blocked" (CPU, T <= forget_xla.BLOCKED_MAX_LEN) or
                 "flash", MatchDecay's "fast" while the decay range -min g is within the fast
                 limit, else "chunked" (a `lax.cond` on the measured range; both branches are
                 rematerialised unless their core keeps O(T) residuals itself). A named `path`
                 forces that XLA path.

Adding a core (docs/mixers.md): write it as a module here (its maths and its reference in the
docstring and tests), give `kernel_choice` the rule that picks it (platform, dtype, shapes; never
a mixer's name), and call it from the matching function above; the mixers do not change.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn_jax import kernel_choice
from attn_jax.kernels import decayed, dense, dpa, forget_xla, sisa_xla, splash
from attn_jax.kernels.masks import causal_block_mask, positional_mask
from attn_jax.layers import causal_positions, segment_starts


# ------------------------------------------------------------------ softmax attention

def attend(q, k, v, *, scale: float, causal: bool = True, q_positions=None, kv_positions=None,
           bias=None, sink_logit_H=None, prefix_causal: bool = False, impl: str = "auto",
           chunk: int | None = None, window: int | None = None, q_segments=None,
           kv_segments=None, shared_prefix: bool = True, remat: bool = False) -> jax.Array:
  """Multi-head softmax attention (dense.py's docstring: the maths, masks, sink, documents):
  [B, T, H, Dv] in q's dtype, on the core `impl` resolves to (module docstring).

  `prefix_causal`: q and kv are one stream (T == S, valid positions increasing, -1 padding),
  so key j > query i is never visible; lets the blocked path skip the upper triangle with
  positional masks. `chunk`: query rows per block of the blocked path. `window`: keys with
  q_pos - k_pos < window only (sliding-window attention). `q_segments` / `kv_segments`: document
  ids of packed rows; with them, `prefix_causal` still holds when positions restart per
  document (a later key of the same document has a larger position, one of another document
  is masked). `shared_prefix=False` promises that no key is in SHARED_SEGMENT (the row has no
  shared prefix), which lets splash take the segments. `remat`: rematerialise the core when
  it would keep [T, S] probabilities for the backward (`kernel_choice.remat_attention`)."""
  run = functools.partial(
      _attend, scale=scale, causal=causal, q_positions=q_positions, kv_positions=kv_positions,
      bias=bias, prefix_causal=prefix_causal, impl=impl, chunk=chunk, window=window,
      q_segments=q_segments, kv_segments=kv_segments, shared_prefix=shared_prefix)
  if remat and kernel_choice.remat_attention(impl, q.dtype, q.shape[-1]):
    run = jax.checkpoint(run)   # no [T, S] probabilities kept for the backward
  return run(q, k, v, sink_logit_H)


def _attend(q, k, v, sink_logit_H, *, scale, causal, q_positions, kv_positions, bias,
            prefix_causal, impl, chunk, window, q_segments, kv_segments, shared_prefix):
  B, T, H, Dqk = q.shape
  S, K = k.shape[1], k.shape[2]
  if k.shape[-1] != Dqk or H % K or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"attention shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
  if sink_logit_H is not None and jnp.shape(sink_logit_H) != (H,):
    raise ValueError(f"sink_logit_H must have shape ({H},), got {jnp.shape(sink_logit_H)}")
  segmented = q_segments is not None or kv_segments is not None
  plain_causal = (causal and q_positions is None and kv_positions is None and T == S
                  and window is None and not segmented)
  impl = kernel_choice.attention_impl(impl, q.dtype, Dqk)
  positioned = q_positions is not None or kv_positions is not None
  one_stream = prefix_causal or (causal and T == S and not positioned)   # plain_causal too
  if impl == "splash" and splash.splash_problem(
      causal=causal, T=T, S=S, bias=bias, window=window, segmented=segmented,
      one_stream=one_stream, shared_prefix=shared_prefix, positioned=positioned):
    impl = "xla"
  if impl == "splash":   # one stream: documents and padding as the kernel's segment ids
    q_ids, kv_ids = splash.segment_ids(q_positions, kv_positions, q_segments, kv_segments)
    out = splash.splash_attention(q, k, v, scale=scale, sink_H=sink_logit_H, q_ids=q_ids,
                                  kv_ids=kv_ids, window=window)
    if q_positions is None:
      return out
    return jnp.where((q_positions >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
  if (impl in ("xla", "cudnn") and window is not None and causal and T == S and not segmented
      and q_positions is None and kv_positions is None and sink_logit_H is None and bias is None):
    # one causal stream with a sliding window: the kernel's own window, no [T, S] mask
    return dpa.dpa(q, k, v, scale=scale, impl=impl, plain_causal=True, window=window)
  mask = None
  if not plain_causal and (causal or kv_positions is not None or window is not None
                           or segmented):
    if q_positions is None:
      q_positions = causal_positions(B, T) + (S - T)
    if kv_positions is None:
      kv_positions = causal_positions(B, S)
    mask = positional_mask(q_positions, kv_positions, causal, window, q_segments, kv_segments)

  if impl in ("einsum", "blocked"):
    prefix = impl == "blocked" and causal and T == S and (plain_causal or prefix_causal)
    step = (chunk or dense.DEFAULT_CHUNK) if prefix else T
    mask_fn = None
    if plain_causal:
      mask_fn = causal_block_mask
    elif mask is not None:
      mask_fn = lambda a, e, s_end: mask[..., a:e, :s_end]
    bias_fn = None if bias is None else (lambda a, e, s_end: bias[..., a:e, :s_end])
    return dense.blocked_attention(q, k, v, scale=scale, mask_fn=mask_fn, bias_fn=bias_fn,
                                   sink_logit_H=sink_logit_H, chunk=step, prefix=prefix)
  return dpa.dpa(q, k, v, scale=scale, mask=mask, bias=bias, sink_H=sink_logit_H,
                 plain_causal=plain_causal, impl=impl)


# ------------------------------------------------------------------ decayed attention

class LogitDecay(NamedTuple):
  """s_ij = scale q_i.k_j + g_i - g_j, g = cumsum(log f) per head (FoX; ALiBi: log f = -m_h)."""
  log_f_BTH: jax.Array             # [B, T, H] log forget rate (<= 0; 0 on padding), fp32
  block: int = forget_xla.DEFAULT_BLOCK   # block of the XLA core


class MatchDecay(NamedTuple):
  """s_ij = scale q_i.k_j + lambda e^{g_i - g_j} (R C_i).(R B_j) (SISA; sisa_xla.py)."""
  rc_BTHS: jax.Array               # R(Phi_i) C_i, fp32
  rb_BTHS: jax.Array               # R(Phi_j) B_j, fp32
  g_BTH: jax.Array                 # cumulative log-decay (from the reference of the call)
  lam_H: jax.Array                 # lambda
  qscale_H: jax.Array              # lambda sqrt(d_h): the query side's factor of the fast path
  fast_limit: float = 60.0         # largest decay range of the "fast" path (nats)
  chunk_size: int = 0              # block / query chunk of the "chunked" path (0: auto)
  shared_prefix: bool = True       # segment-0 keys (sink tokens) may be in a packed row


class MatchFactors(NamedTuple):
  """MatchDecay as the decayed kernel takes it, its factors made by the caller
  (`match_factors`): only for a call that takes the kernel (`takes_decayed_kernel`). A caller
  that makes them inside a `jax.checkpoint` of its own input keeps only that function's matmul
  outputs for the backward, not the fp32 rotations' intermediates (docs/sisa.md, "What the
  backward keeps")."""
  c_BTHS: jax.Array                # lambda R(Phi_i) C_i in q's dtype
  b_BTHS: jax.Array                # R(Phi_j) B_j in q's dtype
  g_BTH: jax.Array                 # cumulative log-decay, fp32


DECAY_PATHS = {LogitDecay: forget_xla.PATHS, MatchDecay: sisa_xla.PATHS,
               MatchFactors: ("auto",)}


def takes_decayed_kernel(impl: str, path: str, q_shape, k_shape, v_shape, *,
                         what: str = "decayed attention") -> bool:
  """Whether `attend_decayed(impl=impl, path=path)` of these shapes takes the decayed Pallas
  kernel (module docstring, "decayed"): path "auto" on a GPU / TPU where the shapes fit."""
  return path == "auto" and decayed.use_kernel(impl, q_shape, k_shape, v_shape, what=what)


def match_factors(lam_H, rc_BTHS, rb_BTHS, dtype):
  """The decayed kernel's MatchDecay factors (lambda R C, R B) in `dtype` (q's): lambda on the
  query factor (its gradient comes from the factor's), then the cast; the factors in q's dtype,
  as the widened Q/K of the XLA paths (bf16 tile products c.b on the tensor cores with fp32
  accumulation, like q.k)."""
  c = (lam_H.astype(rc_BTHS.dtype)[:, None] * rc_BTHS).astype(dtype)
  return c, rb_BTHS.astype(dtype)


def attend_decayed(q, k, v, decay: LogitDecay | MatchDecay | MatchFactors, *, scale: float,
                   impl: str = "auto", path: str = "auto", sink_logit_H=None,
                   segment_ids_BT=None, what: str = "decayed attention"):
  """Causal decayed self-attention of one stream per row (module docstring): (out [B, T, H, Dv]
  in q's dtype, chunked: 1.0 where MatchDecay took its chunked path, else 0.0).
  `segment_ids_BT`: packed rows (pairs of different documents masked, the decay restarted by
  the caller). `what` names the caller in the kernel choice's log lines."""
  paths = DECAY_PATHS[type(decay)]
  if path not in paths:
    raise ValueError(f"{what}: unknown path {path!r} ({' | '.join(paths)})")
  zero = jnp.zeros((), jnp.float32)
  if takes_decayed_kernel(impl, path, q.shape, k.shape, v.shape, what=what):
    return _kernel(q, k, v, decay, scale=scale, sink_logit_H=sink_logit_H,
                   segment_ids_BT=segment_ids_BT), zero
  if isinstance(decay, MatchFactors):
    raise ValueError(f"{what}: MatchFactors are the decayed kernel's, which is not taken here "
                     f"(impl {impl!r}, q {q.shape}); ask entry.takes_decayed_kernel first and "
                     "pass a MatchDecay otherwise")
  if isinstance(decay, LogitDecay):
    return forget_xla.forget_attention(q, k, v, decay.log_f_BTH, scale=scale, block=decay.block,
                                       sink_logit_H=sink_logit_H, segment_ids_BT=segment_ids_BT,
                                       path=path), zero
  ops = sisa_xla.Operands(q, k, v, decay.rc_BTHS, decay.rb_BTHS, decay.g_BTH, decay.lam_H,
                          decay.qscale_H, sink_logit_H, segment_ids_BT)
  return _match_paths(ops, decay, scale=scale, impl=impl, path=path)


def fused_prefill(q, k, v, decay: LogitDecay | MatchDecay, *, scale: float, impl: str,
                  positions_BT, sink_logit_H=None, segment_ids_BT=None, what: str):
  """A prompt's first call into an empty dense cache: fn(q, k) -> the full forward's outputs
  through the decayed kernel (no [T, T] scores for a long prompt), or None where the kernel is
  not taken (the mixer then runs its cached path). q, k, v give the shapes; fn takes q and k
  again, as the caller may rotate them in between (the cache's RoPE frame)."""
  if not decayed.use_kernel(impl, q.shape, k.shape, v.shape, what=what):
    return None
  return lambda q_, k_: _kernel(q_, k_, v, decay, scale=scale, sink_logit_H=sink_logit_H,
                                segment_ids_BT=segment_ids_BT, positions_BT=positions_BT)


def _kernel(q, k, v, decay, *, scale, sink_logit_H, segment_ids_BT=None, positions_BT=None):
  """The decayed Pallas kernel. LogitDecay: g as fp32's double word (hi, lo), so each pair's
  decay is rounded at its own size (`forget_xla.cumsum2`). MatchDecay: the factors by
  `match_factors` (MatchFactors: made so by the caller); g and the decay factor e^{g_i - g_j}
  stay fp32."""
  kw = dict(scale=scale, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
            sink_logit_H=sink_logit_H)
  if isinstance(decay, LogitDecay):
    starts = None if segment_ids_BT is None else segment_starts(segment_ids_BT)
    hi, lo = forget_xla.cumsum2(decay.log_f_BTH, starts)
    return decayed.decayed_attention(q, k, v, g_BTH=hi, g_lo_BTH=lo, fox=True, **kw)
  if isinstance(decay, MatchFactors):
    c, b = decay.c_BTHS, decay.b_BTHS
  else:
    c, b = match_factors(decay.lam_H, decay.rc_BTHS, decay.rb_BTHS, q.dtype)
  return decayed.decayed_attention(q, k, v, g_BTH=decay.g_BTH, c_BTHS=c, b_BTHS=b, **kw)


def _match_paths(ops: sisa_xla.Operands, decay: MatchDecay, *, scale, impl, path):
  """MatchDecay's XLA paths: "fast", "chunked", or (auto) a cond on the decay range."""
  fast = functools.partial(_match_fast, scale=scale, impl=impl, limit=decay.fast_limit,
                           shared_prefix=decay.shared_prefix)
  chunked = functools.partial(sisa_xla.chunked, scale=scale, impl=impl,
                              chunk_size=decay.chunk_size)
  if path == "fast":
    return fast(ops), jnp.zeros((), jnp.float32)
  if path == "chunked":
    return chunked(ops), jnp.ones((), jnp.float32)
  # g is non-increasing (log a <= 0, and rounding is monotone), so its range from the empty
  # prefix is -g at the last token (packed rows: at the last token of each document).
  use_fast = -jnp.min(ops.g) <= decay.fast_limit
  # Neither branch leaves [T, S] residuals to the cond (docs/sisa.md, "Picking the path"): the
  # fast one is rematerialised (except a fused cuDNN / splash call, whose own residuals are
  # O(T)); so is the blockwise chunked one (every core but cuDNN, splash included), whose
  # residuals (the diagonal blocks' probabilities, the flash part's out and lse) the cond
  # would otherwise zero-fill at every step the fast path is taken; the cuDNN chunked one
  # keeps only its inputs by construction (`lse_merge.sequential`).
  core = sisa_xla.core_impl(ops, impl)
  if core in kernel_choice.REMAT_CORE_IMPLS:
    fast = jax.checkpoint(fast)
  if core != "cudnn":   # `chunked` takes `blockwise_path`
    chunked = jax.checkpoint(chunked)
  out = jax.lax.cond(use_fast, fast, chunked, ops)
  return out, 1.0 - use_fast.astype(jnp.float32)


def _match_fast(ops: sisa_xla.Operands, *, scale, impl, limit, shared_prefix):
  """One softmax-attention call of the widened Q/K, reference r = 0 (valid while -g <= limit;
  packed rows: g restarts at 0 in every document, and pairs of other documents are masked;
  one stream, so `prefix_causal` holds and the blocked core keeps skipping the upper
  triangle)."""
  # The clips are no-ops when this path is chosen; they keep a speculative evaluation
  # (e.g. cond under vmap becomes select) free of inf.
  qf = jnp.exp(jnp.maximum(ops.g, -limit)) * ops.qscale    # [B, T, H] <= 1 * qscale
  kf = jnp.exp(jnp.minimum(-ops.g, limit))                 # [B, T, H] in [1, e^limit]
  qh, kh = sisa_xla.widen(ops.q, qf, ops.rc), sisa_xla.widen(ops.k, kf, ops.rb)
  seg = {} if ops.seg is None else dict(q_segments=ops.seg, kv_segments=ops.seg,
                                        prefix_causal=True, shared_prefix=shared_prefix)
  return attend(qh, kh, ops.v, scale=scale, causal=True, impl=impl, sink_logit_H=ops.sink,
                **seg)


# ------------------------------------------------------------------ cost

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
