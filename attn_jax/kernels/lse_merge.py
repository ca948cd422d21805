"""Attention over a key set split in parts, combined exactly by log-sum-exp.

For one query i and keys split into disjoint parts P_1 .. P_n, with s_ij = scale q_i.k_j +
bias_ij:

    o_i^(m)   = sum_{j in P_m} exp(s_ij - lse_i^(m)) v_j,    lse_i^(m) = log sum_{j in P_m} e^{s_ij}
    out_i     = sum_m e^{lse_i^(m)} o_i^(m) / (sum_m e^{lse_i^(m)} + e^{sink_h})

which is the softmax over the union (plus the optional sink column) — the split-KV form of
FlashAttention-2 (its section 3.1.1). It lets a caller send each part through the cheapest
exact route: SISA's chunked path sends a query chunk's *past* keys through one fused kernel
with no bias and no mask, and only the chunk's own keys through a small biased, masked block
(sisa_xla.py), so no [T, S] bias exists and the fused kernel is kept on GPU.

`partial_attention` returns (out, lse) in fp32 (fp64 for float64 inputs). Routes:
- "cudnn" / "xla" (no bias, no mask): `jax.nn.dot_product_attention(..., return_residual=True)`. Its
  VJP ignores the cotangent of the log-sum-exp (the cuDNN rule takes only the output's), which
  would silently drop d lse / d(q, k). `_fused_lse` therefore has its own VJP, built from the
  kernel's *output* VJP alone:
      d lse_i / d q_i = scale sum_j p_ij k_j = scale (P K)_i        (one more call with V = K)
      d lse_i / d k_j -> scale sum_i g_i p_ij q_i = scale (P^T (g q))_j
  and P^T c is exactly the kernel's VJP with respect to V for the cotangent c. Residuals are the
  inputs (the backward recomputes, as flash attention does). The kernel returns lse in the input
  dtype; with bf16 inputs the combination weights e^{lse} then carry bf16 rounding of lse.
- everything else: an fp32 einsum over the part (the parts a caller sends here are small, or
  the caller rematerialises them), with autodiff through lse.
A query that sees no key in a part gets lse = NEG_INF and zero output: weight 0 in `combine`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kernels.dpa import dpa
from attn_jax.kernels.masks import NEG_INF


def _acc(x):
  """Accumulation dtype: fp32, or fp64 for a float64 model."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _split_heads(q_BTHD, n_kv: int):
  """[B, T, H, D] -> [B, T, K, G, D] (query head h reads kv head h // G)."""
  B, T, H, D = q_BTHD.shape
  return q_BTHD.reshape(B, T, n_kv, H // n_kv, D)


def _einsum_lse(q, k, v, *, scale, bias, mask):
  """fp32 (out [B, T, H, Dv], lse [B, T, H]); bias [B|1, H|1, T, S], mask bool broadcastable."""
  B, T, H, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  f = _acc(q)
  s = jnp.einsum("btkgd,bskd->bkgts", _split_heads(q, K), k, preferred_element_type=f) * scale
  s = s.reshape(B, H, T, S)
  if bias is not None:
    s = s + bias.astype(f)
  if mask is not None:
    s = jnp.where(mask, s, NEG_INF)
  m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1, keepdims=True), NEG_INF / 2))
  e = jnp.exp(s - m)
  z = jnp.sum(e, axis=-1, keepdims=True)
  seen = z > 0
  z = jnp.where(seen, z, 1.0)
  lse = jnp.where(seen, m + jnp.log(z), NEG_INF)
  p = (e / z).reshape(B, K, H // K, T, S)
  o = jnp.einsum("bkgts,bske->btkge", p, v.astype(f))
  return o.reshape(B, T, H, -1), lse[..., 0].transpose(0, 2, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_lse(q, k, v, scale, impl):
  return _fused_lse_fwd(q, k, v, scale, impl)[0]


def _fused_lse_fwd(q, k, v, scale, impl):
  dv = v.shape[-1]
  vp = v if dv >= q.shape[-1] else jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
  o, lse = jax.nn.dot_product_attention(q, k, vp, scale=scale, implementation=impl,
                                        return_residual=True)
  return (o[..., :dv].astype(jnp.float32), lse.astype(jnp.float32)), (q, k, v)


def _fused_lse_bwd(scale, impl, res, cts):
  q, k, v = res
  do, dlse = cts
  _, vjp_out = jax.vjp(lambda a, b, c: dpa(a, b, c, scale=scale, impl=impl), q, k, v)
  dq, dk, dv = vjp_out(do.astype(q.dtype))
  # P K, and the map c -> P^T c
  pk, vjp_val = jax.vjp(lambda c: dpa(q, k, c, scale=scale, impl=impl), k)
  g = dlse[..., None]
  (pt_gq,) = vjp_val((g * q.astype(jnp.float32)).astype(q.dtype))
  dq = dq.astype(jnp.float32) + scale * g * pk.astype(jnp.float32)
  dk = dk.astype(jnp.float32) + scale * pt_gq.astype(jnp.float32)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv


_fused_lse.defvjp(_fused_lse_fwd, _fused_lse_bwd)


def partial_attention(q, k, v, *, scale: float, impl: str = "einsum", bias=None, mask=None):
  """Softmax attention of q over one part of the keys: (out fp32 [B, T, H, Dv], lse fp32
  [B, T, H]). `impl` "cudnn" / "xla" (jax.nn.dot_product_attention's implementations) take the
  fused route when there is no bias and no mask; "xla" runs the same custom VJP through XLA's
  reference kernel, which is how the route is tested without a GPU."""
  if impl in ("cudnn", "xla") and bias is None and mask is None:
    return _fused_lse(q, k, v, float(scale), impl)
  return _einsum_lse(q, k, v, scale=scale, bias=bias, mask=mask)


def combine(parts, sink_logit_H=None):
  """Exact softmax over the union of the parts' keys (plus the sink column): fp32 [B, T, H, E].

  parts: sequence of (out [B, T, H, E], lse [B, T, H]) from `partial_attention`."""
  lses = [lse for _, lse in parts]
  f = _acc(lses[0])
  sink = None if sink_logit_H is None else sink_logit_H.astype(f)
  m = functools.reduce(jnp.maximum, lses)
  if sink is not None:
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(jnp.maximum(m, NEG_INF / 2))
  ws = [jnp.exp(lse - m) for lse in lses]
  z = functools.reduce(jnp.add, ws)
  if sink is not None:
    z = z + jnp.exp(sink - m)
  num = functools.reduce(jnp.add, [w[..., None] * o for w, (o, _) in zip(ws, parts)])
  safe = jnp.where(z > 0, z, 1.0)
  return jnp.where((z > 0)[..., None], num / safe[..., None], 0.0)


# ------------------------------------------------------------------ one part after another

def _after(tree, dep):
  """tree, made to depend on `dep` (an array) through a zero-valued term. XLA keeps the data
  dependency (x * 0 is not folded for floats: NaN semantics), which an optimization_barrier does
  not guarantee on every backend (the CPU pipeline drops barriers before scheduling)."""
  z = jnp.ravel(dep)[0].astype(jnp.float32) * 0.0
  return jax.tree.map(lambda x: x + z.astype(x.dtype), tree)


def sequential(fns, args):
  """[f(*args) for f in fns], evaluated one after another in the forward *and* the backward,
  each f rematerialised: memory holds one f's temporaries at a time.

  XLA is free to reorder independent computations, and it does: unrolled query chunks that
  read the same inputs are otherwise scheduled side by side (their [c, S] temporaries coexist),
  and the recomputations of rematerialised chunks are hoisted ahead of the backward. Here the
  inputs of f_{n+1} depend (through a zero term, `_after`) on the output of f_n in the forward,
  and the inputs of f_n's recomputation on the cotangents accumulated from f_{n+1} in the
  backward. The residuals are `args` only. `fns` must be hashable (functools.partial of a
  method is).
  """
  return _sequential(tuple(fns), args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sequential(fns, args):
  return _sequential_fwd(fns, args)[0]


def _sequential_fwd(fns, args):
  outs, a = [], args
  for f in fns:
    outs.append(f(*a))
    a = _after(args, outs[-1])
  return outs, args


def _sequential_bwd(fns, args, cts):
  """Integer leaves of `args` (a packed row's segment ids) get float0 zero cotangents."""
  inexact = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)
  acc = jax.tree.map(jnp.zeros_like, args)
  a = args
  for f, ct in zip(reversed(fns), reversed(cts)):
    _, vjp = jax.vjp(f, *a)
    acc = jax.tree.map(lambda s, g: s + g if inexact(s) else s, acc, vjp(ct))
    a = _after(args, jax.tree.leaves(acc)[0])
  return (jax.tree.map(lambda s: s if inexact(s) else np.zeros(s.shape, jax.dtypes.float0),
                       acc),)


_sequential.defvjp(_sequential_fwd, _sequential_bwd)
