"""What the device can do, measured in the same process as a benchmark: dense matmul peak and
copy bandwidth; and the two ratios they bound: MFU of a train step and the bandwidth ratio of
a decode step.

Matmul peak (FLOP/s, one device): the best of `repeats` timed calls of one jitted square
`jnp.dot` of [n, n] x [n, n] in the dtype in use (2 n^3 FLOPs; n = 2048 on CPU, 8192 on an
accelerator), after a compiling call. This is the "achievable" peak of the machine for the
kernel class the model is made of, as opposed to the datasheet figure (`flops.PEAK_FLOPS`).

Copy bandwidth (bytes/s, one device): the best of `repeats` calls of one jitted loop of
elementwise passes (x <- -x, in place on a donated buffer) over a large array (256 MiB on CPU,
2 GiB on an accelerator: far beyond the caches), counting the bytes read plus the bytes
written (2 x size per pass), the STREAM convention.

    MFU = tokens/s x model FLOPs per token / (peak x devices)

Model FLOPs per token follow `flops.train_flops_per_token` (stated there: 6 N + attention's
causal lower triangle, no remat, backward = 2 x forward).

Decoding is bandwidth-bound at small batch: one decode step of B rows reads every parameter
once plus every row's decoding state, so at bandwidth W

    bound tokens/s = B x W / (param bytes + B x state bytes per row)

Param bytes = non-embedding parameters + the LM head d x V, each in the dtype a decoder holds
it in (`Decoder.for_decoding`: weight matrices in the compute dtype, the rest as stored): the
embedding table is gathered (B rows), the head is a full matmul (also when tied). State bytes
= the whole decoding state (`model.init_state` at the capacity used): attention over a linear
cache attends to every slot, masked or not, and SSM/ring states are read whole. Activations
and the logits are not counted. Ratio = measured decode tokens/s / bound (1.0 = the step runs
at copy bandwidth).
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax import decode
from attn_jax.layers import dtype_of
from attn_jax.model import init_state
from attn_jax.model_config import ModelConfig


def best_seconds(fn, args, repeats: int) -> float:
  """Best wall time (s) of `repeats` synchronised calls of `fn(*args)` after one untimed
  (compiling) call."""
  jax.block_until_ready(fn(*args))   # compiles
  best = math.inf
  for _ in range(max(1, int(repeats))):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def _on_cpu(device) -> bool:
  return (device or jax.devices()[0]).platform == "cpu"


def matmul_peak(dtype: str = "float32", n: int | None = None, repeats: int = 5,
                device=None) -> float:
  """Measured dense matmul FLOP/s of one device: best of `repeats` [n, n] @ [n, n]."""
  n = int(n or (2048 if _on_cpu(device) else 8192))
  dt = dtype_of(dtype)
  keys = jax.random.split(jax.random.key(0))
  a, b = (jax.device_put(jax.random.normal(k, (n, n), dt), device) for k in keys)
  return 2.0 * n ** 3 / best_seconds(jax.jit(jnp.dot), (a, b), repeats)


def copy_bandwidth(nbytes: int | None = None, repeats: int = 5, passes: int = 8,
                   device=None) -> float:
  """Measured bytes/s (read + written) of elementwise passes over `nbytes` of fp32: one jitted
  loop of `passes` in-place sign flips of a donated buffer (no fresh output to page in)."""
  nbytes = int(nbytes or (256 if _on_cpu(device) else 2048) * 2 ** 20)
  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
  flip = jax.jit(lambda v: jax.lax.fori_loop(0, passes, lambda i, u: -u, v), donate_argnums=0)
  x = jax.block_until_ready(flip(x))   # compiles
  best = math.inf
  for _ in range(max(1, int(repeats))):
    t = time.perf_counter()
    x = jax.block_until_ready(flip(x))
    best = min(best, time.perf_counter() - t)
  return 2.0 * x.nbytes * passes / best


def mfu(tok_s: float, flops_per_token: float, peak: float | None,
        n_devices: int = 1) -> float | None:
  """Model FLOPs utilisation; None when the peak is unknown."""
  if not peak:
    return None
  return tok_s * flops_per_token / (peak * n_devices)


def _tree_bytes(tree: Any) -> int:
  return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                 for a in jax.tree.leaves(tree)))


def decode_param_bytes(model) -> int:
  """Parameter bytes one decode step of `model.for_decoding()` reads (module docstring): every
  parameter in the dtype that copy stores it in, and of the vocabulary tables only the LM
  head's d x V (padding never read; the input lookup reads B rows: not counted)."""
  from flax import nnx
  m = model.for_decoding()
  total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(m, nnx.Param)))
  tables = [m.embed[...]] + ([] if m.cfg.tie_embeddings else [m.head[...]])
  total -= sum(t.size * t.dtype.itemsize for t in tables)
  return int(total + m.cfg.d_model * m.cfg.vocab_size * tables[-1].dtype.itemsize)


def decode_bytes(cfg: ModelConfig, n_params: dict, batch: int, capacity: int,
                 policy=None, param_bytes: int | None = None) -> dict:
  """Bytes one decode step of `batch` rows reads under the cache `policy` (module docstring):
  {"params", "state" (all rows), "total"}. `param_bytes` (`decode_param_bytes`) replaces the
  count from `n_params` in the parameter dtype."""
  params = param_bytes if param_bytes is not None else \
      (n_params["non_embedding"] + cfg.d_model * cfg.vocab_size) * \
      jnp.dtype(dtype_of(cfg.param_dtype)).itemsize
  state = _tree_bytes(jax.eval_shape(lambda: init_state(cfg, int(batch), int(capacity), policy)))
  return {"params": int(params), "state": state, "total": int(params) + state}


def decode_bound_tok_s(bytes_per_step: float, batch: int, bandwidth: float) -> float:
  """Tokens/s of a decode step that only moves `bytes_per_step` at `bandwidth`."""
  return batch * bandwidth / bytes_per_step


def decode_step_tok_s(model, prompt_BT: jax.Array, steps: int, repeats: int = 2,
                      policy=None) -> float:
  """Generated tokens/s of `steps` greedy one-token decode steps (one jitted loop), after a
  prefill of `prompt_BT` that is not timed; capacity = prompt length + steps."""
  from flax import nnx

  graphdef, state = nnx.split(model.for_decoding())   # as `decode.generate` runs it
  B, T = prompt_BT.shape

  @decode.jit_stateful
  def start(state, prompt_BT):
    logits_BV, dstate = decode.prefill(nnx.merge(graphdef, state), prompt_BT,
                                       capacity=T + steps, policy=policy)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), dstate

  @decode.jit_stateful
  def run(state, tok_B, dstate):
    m = nnx.merge(graphdef, state)
    layer_params = m.layer_params()   # sliced once per run, as `decode.generate` does

    def body(i, carry):
      tok_B, dstate = carry
      logits_BV, dstate = decode.decode_step(m, tok_B, jnp.full((B,), T + i, jnp.int32),
                                             dstate, layer_params)
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), dstate

    return jax.lax.fori_loop(0, steps, body, (tok_B, dstate))

  tok_B, dstate = start(state, prompt_BT)
  return B * steps / best_seconds(run, (state, tok_B, dstate), repeats)


def decode_row(model, n_params: dict, batch: int, prompt_len: int, steps: int,
               bandwidth: float, seed: int = 0, policy=None) -> dict:
  """Decode-step tokens/s of `model` at `batch` rows after a random prompt of `prompt_len`,
  the bytes one step reads at capacity prompt_len + steps (under the cache `policy`), the
  bandwidth bound and the ratio."""
  cfg = model.cfg
  prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt_len))
  tok_s = decode_step_tok_s(model, jnp.asarray(prompt, jnp.int32), steps, policy=policy)
  nbytes = decode_bytes(cfg, n_params, batch, prompt_len + steps, policy,
                        param_bytes=decode_param_bytes(model))
  bound = decode_bound_tok_s(nbytes["total"], batch, bandwidth)
  return {"batch": batch, "capacity": prompt_len + steps, "tok_s": tok_s, "bound_tok_s": bound,
          "ratio": tok_s / bound, "param_bytes": nbytes["params"],
          "state_bytes": nbytes["state"]}
