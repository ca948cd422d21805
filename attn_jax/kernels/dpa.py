"""`jax.nn.dot_product_attention` ("xla" / "cudnn": XLA's reference kernel, cuDNN's fused flash
attention on a GPU) as a softmax-attention core of `entry.attend` (dense.py's docstring: the
maths, the masks, the sink, documents).

- It requires V as wide as Q/K, so a narrower V is zero-padded to Dqk and the output sliced
  back (exact).
- A sink becomes one extra key slot with a zero value whose score is sink_h: Q gains one channel
  holding sink_h / scale, K gains one channel that is 1 on the sink slot and 0 on real keys.
  For the plain causal mask (top-left aligned `is_causal`) a dummy query row is prepended as
  well, so the [T+1, T+1] causal square shows the sink slot to every real query; the dummy
  output row is dropped. For cuDNN the extra channel is padded to a multiple of 8.
- Documents and positions arrive as a boolean mask (`masks.positional_mask`): cuDNN's API here
  has no segment ids, so a mask costs a [T, S] bias on that path. A query that sees no key
  returns zeros, as every core does.
- A sliding window of one plain causal stream is the kernel's own `local_window_size`: no
  [T, S] mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sink_slot(q, k, v, *, scale, sink_H, mask, bias, plain_causal, pad_to):
  """Express the sink as an extra key slot (see module docstring). Returns q, k, v, mask, bias."""
  B, T, H, D = q.shape
  extra = 1 + (-(D + 1)) % pad_to  # the sink channel plus zero channels up to a multiple
  q_sink = jnp.broadcast_to((sink_H.astype(jnp.float32) / scale).astype(q.dtype)[None, None, :,
                                                                                   None],
                            (B, T, H, 1))
  q = jnp.concatenate([q, q_sink, jnp.zeros((B, T, H, extra - 1), q.dtype)], axis=-1)
  k = jnp.pad(k, ((0, 0), (1, 0), (0, 0), (0, extra)))        # slot 0: zeros ...
  k = k.at[:, 0, :, D].set(1.0)                                  # ... with a 1 in the sink channel
  v = jnp.pad(v, ((0, 0), (1, 0), (0, 0), (0, 0)))               # zero value
  if bias is not None:
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, 0), (1, 0)))
  if plain_causal:  # a dummy query row 0: the [T+1, T+1] causal square shows slot 0 to all
    q = jnp.pad(q, ((0, 0), (1, 0), (0, 0), (0, 0)))
    if bias is not None:
      bias = jnp.pad(bias, ((0, 0), (0, 0), (1, 0), (0, 0)))
  elif mask is not None:  # (no mask: non-causal, every key and the slot visible)
    mask = jnp.concatenate([jnp.ones(mask.shape[:3] + (1,), bool), mask], axis=-1)
  return q, k, v, mask, bias


def dpa(q, k, v, *, scale, impl, mask=None, bias=None, sink_H=None, plain_causal=False,
        window=None):
  """`jax.nn.dot_product_attention` with `impl` ("xla" / "cudnn"): V narrower than Q/K is
  zero-padded and the output sliced back; a sink becomes an extra key slot (module docstring).
  `window` (with `plain_causal`, no sink): the kernel's own sliding window, keys i - window <
  j <= i, so no [T, S] mask is built."""
  B, T, H, Dqk = q.shape
  Dv = v.shape[-1]
  if sink_H is not None:
    q, k, v, mask, bias = _sink_slot(q, k, v, scale=scale, sink_H=sink_H, mask=mask, bias=bias,
                                     plain_causal=plain_causal,
                                     pad_to=8 if impl == "cudnn" else 1)
  width = q.shape[-1]
  if Dv != width:  # dot_product_attention needs V as wide as Q/K: pad with zeros, slice back.
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, width - Dv)))
  local = None if window is None else (int(window) - 1, 0)
  if impl == "cudnn" and not cudnn_takes(q.shape[1], k.shape[1]):
    impl = "xla"
  out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=scale, is_causal=plain_causal, implementation=impl,
      local_window_size=local)
  out = out[:, -T:, :, :Dv]
  if mask is not None and sink_H is None:  # a query that sees no key returns zeros
    seen_BT = jnp.any(mask[:, 0], axis=-1)
    out = jnp.where(seen_BT[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out


def cudnn_takes(T: int, S: int) -> bool:
  """Whether cuDNN's fused attention compiles these lengths in a training step: its forward
  rule for differentiation (JAX 0.10's check_is_flash_attention) sees a bias argument even when
  there is none (a placeholder array) and then needs even query and key lengths, so an odd
  length such as the quickstart's 31 would stop the compile. Such calls take the XLA path."""
  return T % 2 == 0 and S % 2 == 0
