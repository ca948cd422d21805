"""Shared building blocks: parameters with logical axis names, RMSNorm, RoPE, SwiGLU, embedding.

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds its *logical* axis names
(`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `state`, `layers`, `norm`). The
logical->mesh mapping lives in the config (`config.mesh.rules`, applied in `sharding.py`);
modules never mention mesh axes. Eager sharding is off: shardings are applied by the trainer's
jitted init (`out_shardings`), never at construction.

Every parameter also declares its *kind* where it is created (`param(..., kind=)`); the
optimizer's weight-decay rule is a function of the kind alone (`PARAM_KINDS`), never of the
parameter's name or number of axes:

  weight          projection matrices, conv kernels                      decayed
  embedding       token embedding / unembedding tables                   decayed
  bias            additive biases (Linear/conv biases, Mamba's dt_bias,  not decayed
                  Mamba-3's B/C biases, SISA's decay bias)
  norm            norm scales                                            not decayed
  scalar          per-head / per-channel scalars in the maths (A_log, D,  not decayed
                  SISA's lambda, learned sink logits)
  learned_input   learned input vectors with no input to scale          not decayed
                  (sink-token embeddings)

Sources: AdamW recipes exempt biases and norm gains (GPT-2/nanoGPT grouping); state-spaces/mamba
marks A_log, D and dt_bias `_no_weight_decay` (`mamba_ssm/modules/mamba2.py`); the SISA paper
trains lambda without decay (docs/papers.md §1.1).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax import kernel_choice

Initializer = Callable[..., jax.Array]

# kind -> weight-decayed? (module docstring). The only source of the decay rule.
PARAM_KINDS: dict[str, bool] = {"weight": True, "embedding": True, "bias": False, "norm": False,
                                "scalar": False, "learned_input": False}


def fan_in_uniform(fan_in: int, scale: float = 1.0) -> Initializer:
  """U(+-scale / sqrt(fan_in)): PyTorch's default for nn.Linear / nn.Conv1d weights
  (kaiming_uniform with a = sqrt(5) gives bound sqrt(6 / ((1 + 5) fan_in)) = 1 / sqrt(fan_in));
  std = scale / sqrt(3 fan_in). `scale` < 1 is mamba_ssm's rescaled out_proj."""
  bound = float(scale) / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


def dtype_of(name: str) -> jnp.dtype:
  try:
    return jnp.dtype({"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(name, name))
  except TypeError as e:
    raise ValueError(f"unknown dtype {name!r} (use float32, bfloat16 or float16)") from e


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
          dtype=jnp.float32, *, kind: str, lr_mult: float | None = None) -> nnx.Param:
  """A parameter initialised with `init(key, shape, dtype)` and tagged with logical `axes`.

  Optimizer treatment travels with the parameter as metadata (read by train/optim.py): `kind`
  (one of `PARAM_KINDS`) decides weight decay, `lr_mult` scales its learning rate.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  if kind not in PARAM_KINDS:
    raise ValueError(f"parameter kind {kind!r} is not one of {sorted(PARAM_KINDS)}")
  meta = {"kind": kind}
  if lr_mult is not None:
    meta["lr_mult"] = float(lr_mult)
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes),
                   eager_sharding=False, **meta)


class Linear(nnx.Module):
  """y = x @ W (no bias). W: [*in_shape, *out_shape], computed in `dtype` with fp32 params.

  Initialised N(0, init_std) unless `init` (an initializer, e.g. `fan_in_uniform`) is given."""

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
               in_axes: Sequence[str | None], out_axes: Sequence[str | None], rngs: nnx.Rngs,
               init_std: float = 0.02, init: Initializer | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.float32):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.dtype = dtype
    self.kernel = param(rngs, init or nnx.initializers.normal(init_std),
                        self.in_shape + self.out_shape, tuple(in_axes) + tuple(out_axes),
                        param_dtype, kind="weight")

  def __call__(self, x: jax.Array) -> jax.Array:
    # One 2-D matmul [N, K] @ [K, M] (N = leading dims, K = in dims, M = out dims; merging
    # contiguous dims is a free reshape). With [B, T, K] inputs the weight gradient contracts
    # over two dims (B and T), and XLA:CPU then transposes the [B, T, M] cotangent into
    # [M, B*T] before the matmul, a strided copy as large as the activation; with one leading
    # dim dW = x^T g is a plain matmul. Same FLOPs, same result (docs/benchmarks.md).
    lead, k, m = _matmul_dims(x, self.in_shape, self.out_shape)
    w_KM = self.kernel[...].astype(self.dtype).reshape(k, m)
    y_NM = jnp.dot(x.astype(self.dtype).reshape(-1, k), w_KM)
    return y_NM.reshape(lead + self.out_shape)


def _matmul_dims(x: jax.Array, in_shape, out_shape) -> tuple[tuple, int, int]:
  """(x's leading dims, K, M) of a `Linear`-style matmul of x [..., *in_shape]; an input whose
  trailing shape is not `in_shape` is refused by name."""
  lead = x.shape[:x.ndim - len(in_shape)]
  if x.shape[len(lead):] != in_shape:
    raise ValueError(f"Linear: input trailing shape {x.shape[len(lead):]} != {in_shape}")
  return lead, math.prod(in_shape), math.prod(out_shape)


class OutMajorLinear(nnx.Module):
  """A decoding copy's `Linear` with its kernel stored out-major, [*out_shape, *in_shape] (made
  by `Linear.out_major`). y = x @ W as before, each output element the same dot product over
  the same inputs; for one token on a GPU, XLA turns a small matmul into a multiply and a
  reduction, and with the reduced (input) dimension innermost that reduction also takes the
  elementwise work that produced x (a SwiGLU's silu(gate) * up) in the same kernel, where an
  in-major kernel's column reduction leaves it a kernel of its own."""

  def __init__(self, kernel: nnx.Param, in_shape, out_shape, dtype):
    self.kernel, self.in_shape, self.out_shape, self.dtype = kernel, in_shape, out_shape, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    lead, k, m = _matmul_dims(x, self.in_shape, self.out_shape)
    w_MK = self.kernel[...].astype(self.dtype).reshape(m, k)
    y_NM = jnp.einsum("nk,mk->nm", x.astype(self.dtype).reshape(-1, k), w_MK)
    return y_NM.reshape(lead + self.out_shape)


def out_major(lin: "Linear | OutMajorLinear") -> OutMajorLinear:
  """`lin` with its kernel out-major (`OutMajorLinear`; stacked leading dims, such as the
  blocks' `layers` axis, stay first, with their sharding names); one already so is returned as
  it is."""
  if isinstance(lin, OutMajorLinear):
    return lin
  w = lin.kernel[...]
  n_in, n_out = len(lin.in_shape), len(lin.out_shape)
  lead = w.ndim - n_in - n_out
  perm = (tuple(range(lead)) + tuple(range(lead + n_in, w.ndim))
          + tuple(range(lead, lead + n_in)))
  names = tuple(lin.kernel.get_metadata().get("out_sharding") or (None,) * w.ndim)
  kernel = nnx.Param(jnp.transpose(w, perm), out_sharding=tuple(names[i] for i in perm),
                     eager_sharding=False, kind="weight")
  return OutMajorLinear(kernel, lin.in_shape, lin.out_shape, lin.dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, statistics in fp32."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-5, dtype=jnp.bfloat16,
               param_dtype=jnp.float32):
    del rngs   # ones: no key drawn, so the other parameters' random streams do not move
    self.eps, self.dtype = eps, dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",),
                           eager_sharding=False, kind="norm")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


# Packed rows (several documents in one row): `segment_ids_BT` [B, T] int32 numbers each token's
# document from 1; SHARED_SEGMENT marks a shared prefix every document reads (the decoder's
# learned sink tokens). Positions restart at 0 in every document.
SHARED_SEGMENT = 0


def segment_starts(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, T] bool: the token starts a new document (its id differs from the previous token's;
  False at t = 0, where every row starts fresh anyway). Recurrent mixers reset their state and
  their convolution window there."""
  prev_BT = jnp.pad(segment_ids_BT[:, :-1], ((0, 0), (1, 0)), mode="edge")
  return segment_ids_BT != prev_BT


def segmented_scan(op, x, reset: jax.Array, axis: int):
  """(op-fold of x since the latest reset at or before t, whether there was one) along `axis`,
  for an associative `op(earlier, later)`; x an array or a tuple of them, `reset` bool, of
  their shape. A parallel prefix (`lax.associative_scan`: 2 log2(n) elementwise passes, no
  loop). The restarts are selects: no cotangent crosses one (exact zeros)."""
  def comb(u, v):
    keep = lambda a, b: jnp.where(v[1], a, b)
    return jax.tree.map(keep, v[0], op(u[0], v[0])), u[1] | v[1]
  return jax.lax.associative_scan(comb, (x, reset), axis=axis)


def segmented_cumsum(x: jax.Array, reset: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """`segmented_scan` of +: (sum of x since the latest reset at or before t, whether there was
  one) along `axis`."""
  return segmented_scan(jnp.add, x, reset, axis)


def wrapped_cumsum(x: jax.Array, wrap, axis: int, reset=None) -> jax.Array:
  """Inclusive running sum of x along `axis` reduced by `wrap` (x mod 2 pi) after every
  addition, as a parallel prefix (addition mod 2 pi is associative, so wrap(u + v) of two
  wrapped partial sums is a combine). `reset` (bool, x's shape): the sum restarts there.
  Each combine rounds once: for long sums of many similar angles see `angle_cumsum`."""
  x = wrap(x)
  op = lambda u, v: wrap(u + v)
  if reset is None:
    return jax.lax.associative_scan(op, x, axis=axis)
  return segmented_scan(op, x, reset, axis)[0]


# 2 pi as an unevaluated sum of two floats, hi (float32-exact) + lo
_2PI_HI = float(np.float32(2 * np.pi))
_2PI_LO = 2 * np.pi - _2PI_HI


def _two_sum(a, b):
  """a + b = s + e exactly (Knuth's TwoSum: additions only, no condition on the magnitudes)."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _add_angles(u, v):
  """(u + v) mod 2 pi for angles held as double-floats (hi, lo), hi in about [0, 2 pi): the
  sum's rounding error kept in lo (TwoSum), k whole turns taken off as k (2 pi hi + 2 pi lo)
  with k (2 pi hi) exact (k <= 2) and its subtraction TwoSum'd too. Additions and exact
  products only, so no fused multiply-add a compiler may form changes the result."""
  s, e = _two_sum(u[0], v[0])
  k = jnp.floor(s * (1 / (2 * np.pi)))
  hi, e2 = _two_sum(s, -k * _2PI_HI)
  lo = (u[1] + v[1] + e) + (e2 - k * _2PI_LO)
  out = hi + lo
  return out, lo - (out - hi)


def angle_cumsum(theta: jax.Array, axis: int, reset=None) -> jax.Array:
  """Inclusive running sum of angles theta (radians) mod 2 pi along `axis`, as a parallel
  prefix with no loop, restarting where `reset` (bool, theta's shape) is True; in about
  [0, 2 pi).

  Precision: the running angle is a double-float hi + lo and every addition and every turn
  taken off keeps its rounding error (`_add_angles`), so the sum carries ~2^-48 relative error
  and the result only its final rounding. Summing thousands of similar fp32 angles by plain
  fp32 additions (a token-by-token loop, or a prefix of wrap(u + v)) accumulates a bias of
  ~T ulp instead: 4.7e-5 rad at 32K tokens for the loop against 2.4e-7 here (tested). Each
  theta is first brought into [0, 2 pi) the same way (exact for |theta| < 4 pi a token)."""
  zero = jnp.zeros_like(theta)
  x = _add_angles((theta, zero), (zero, zero))
  if reset is None:
    hi, lo = jax.lax.associative_scan(_add_angles, x, axis=axis)
  else:
    hi, lo = segmented_scan(_add_angles, x, reset, axis)[0]
  return hi + lo


# ------------------------------------------------------------ running sums over time (axis 1)
# Shared by the mixers that carry a cumulative log-decay or phase (SISA, FoX, ALiBi).

def stat_dtype(cfg):
  """Dtype of g, Phi, lambda and the decay factors: fp32 (fp64 for a float64 model)."""
  return jnp.promote_types(jnp.float32, dtype_of(cfg.dtype))


def time_scan(step, x_BT: jax.Array, starts_BT=None) -> jax.Array:
  """Inclusive scan over axis 1 (`step(carry, x) -> carry`, the carry starting at zero, and
  reset to zero before every token where `starts_BT` [B, T] is True)."""
  xs = jnp.moveaxis(x_BT, 1, 0)
  if starts_BT is None:
    _, ys = jax.lax.scan(lambda c, a: (step(c, a),) * 2, jnp.zeros_like(xs[0]), xs)
    return jnp.moveaxis(ys, 0, 1)
  rs = jnp.moveaxis(_expand(starts_BT, x_BT), 1, 0)

  def body(c, ar):
    a, r = ar
    c = step(jnp.where(r, jnp.zeros_like(c), c), a)
    return c, c

  _, ys = jax.lax.scan(body, jnp.zeros_like(xs[0]), (xs, rs))
  return jnp.moveaxis(ys, 0, 1)


def _expand(starts_BT, x_BT):
  """[B, T] flags broadcast against x [B, T, ...]."""
  return starts_BT.reshape(starts_BT.shape + (1,) * (x_BT.ndim - 2))


def starts_like(starts_BT, x_BT):
  """[B, T] flags as an array of x's shape (the `reset` of the parallel prefixes)."""
  return jnp.broadcast_to(_expand(starts_BT, x_BT), x_BT.shape)


def time_cumsum(x_BT: jax.Array, starts_BT=None) -> jax.Array:
  """Inclusive cumulative sum over axis 1: `jnp.cumsum` (or a segmented parallel prefix) where
  `kernel_choice.parallel_time_sums()`, a `lax.scan` on CPU. With `starts_BT` ([B, T] bool,
  `layers.segment_starts`): a segmented sum restarting at every True (a packed row's
  documents), whose value and gradient read only the own segment (the resets are selects, so a
  cotangent never crosses one: exact zeros, not cancellations)."""
  if starts_BT is None:
    if kernel_choice.parallel_time_sums():
      return jnp.cumsum(x_BT, axis=1)
    return time_scan(jnp.add, x_BT)
  if not kernel_choice.parallel_time_sums():
    return time_scan(jnp.add, x_BT, starts_BT)
  return segmented_cumsum(x_BT, starts_like(starts_BT, x_BT), axis=1)[0]


def causal_positions(batch: int, length: int) -> jax.Array:
  """Positions 0..length-1 of every row, [batch, length] int32 (a plain full forward)."""
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def rope_angles(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos/sin for rotary embeddings. positions [B, T] -> ([B, T, dim/2], [B, T, dim/2]) fp32."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  ang = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_BTHD: jax.Array, cos_BTK: jax.Array, sin_BTK: jax.Array,
               head_axis: int = 2) -> jax.Array:
  """Rotate the two halves of the head dim (GPT-NeoX layout) by the given angles, in fp32.
  `head_axis`: where x's head axis is (1 for a head-major [B, H, T, D])."""
  d2 = x_BTHD.shape[-1] // 2
  x = x_BTHD.astype(jnp.float32)
  x1, x2 = x[..., :d2], x[..., d2:]
  c, s = jnp.expand_dims(cos_BTK, head_axis), jnp.expand_dims(sin_BTK, head_axis)
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BTHD.dtype)


def fused_param(parts: Sequence[jax.Array], axes: Sequence[str | None],
                like: nnx.Variable) -> nnx.Param:
  """One decoding-time kernel from `Linear` kernels that read the same input (`fuse_for_decoding`
  of a module, called by `Decoder.for_decoding`): `parts` concatenated along axis -2, with the
  logical `axes` of its own dims; leading dims beyond those (the stacked `layers` axis of the
  blocks) keep the names `like` (one of the kernels) gives them. A matmul on it
  (`fused_matmul`) computes every output element as the separate kernels do: the same dot
  product over the same input, so one launch reads the input once instead of once per kernel."""
  value = jnp.concatenate(parts, axis=-2)
  lead = value.ndim - len(axes)
  names = tuple(like.get_metadata().get("out_sharding") or ())
  names = names[:lead] if len(names) >= lead else (None,) * lead
  return nnx.Param(value, out_sharding=names + tuple(axes), eager_sharding=False, kind="weight")


def fused_matmul(x: jax.Array, w: jax.Array, n_in: int, dtype) -> jax.Array:
  """x [..., *in] @ w [*in, *out] as one 2-D matmul in `dtype` -> [..., *out] (`Linear`'s
  product for a fused kernel: `fused_param`)."""
  in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
  lead = x.shape[:x.ndim - n_in]
  y = jnp.dot(x.astype(dtype).reshape(-1, math.prod(in_shape)),
              w.astype(dtype).reshape(math.prod(in_shape), -1))
  return y.reshape(lead + out_shape)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, init_std: float,
               out_std: float, dtype, param_dtype):
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.gate = Linear((d_model,), (d_ff,), in_axes=("embed",), out_axes=("mlp",),
                       init_std=init_std, **kw)
    self.up = Linear((d_model,), (d_ff,), in_axes=("embed",), out_axes=("mlp",),
                     init_std=init_std, **kw)
    self.down = Linear((d_ff,), (d_model,), in_axes=("mlp",), out_axes=("embed",),
                       init_std=out_std, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    if not hasattr(self, "gate_up"):
      return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
    gu = fused_matmul(x, self.gate_up[...], 1, self.down.dtype)   # [..., 2, F]
    return self.down(jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :])

  def fuse_for_decoding(self) -> None:
    """Replace `gate` and `up` by one kernel [D, 2, F] (`gate_up`): one matmul reads x once
    (`Decoder.for_decoding`), and store `down` out-major (`out_major`: its reduction takes
    silu(gate) * up in). Each output element is the same dot product as before. A module
    already fused is left as it is."""
    self.down = out_major(self.down)
    if not hasattr(self, "gate"):
      return
    parts = [jnp.expand_dims(m.kernel[...], -2) for m in (self.gate, self.up)]
    self.gate_up = fused_param(parts, ("embed", None, "mlp"), self.gate.kernel)
    del self.gate, self.up
