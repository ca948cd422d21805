"""A plain-JAX reference Transformer train step, to compare attn_jax's step against.

  python experiments/bench_reference.py                        # bench.py's cpu_50m_fp32 shapes
  python experiments/bench_reference.py --attention=blocked    # same, attn_jax's attention core

Same architecture as attn_jax's Transformer: pre-norm RMSNorm blocks, RoPE (GPT-NeoX halves),
SwiGLU, tied embeddings, no biases; attention is an einsum over the full [T, T] square with a
causal mask (--attention=einsum) or `attn_jax.kernels.entry.attend` (--attention=blocked|xla);
the loss is the plain [B, T, V] fp32 cross-entropy; optax clip(1.0) + AdamW. Layers are a
Python loop over a list of parameter dicts (no scan). Prints the best wall time and the median
process CPU time per step over --steps steps (after --warmup).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_B = flags.DEFINE_integer("batch", 4, "Sequences per step.")
_T = flags.DEFINE_integer("seq_len", 1024, "Sequence length.")
_D = flags.DEFINE_integer("d_model", 512, "Model width.")
_H = flags.DEFINE_integer("n_heads", 8, "Heads.")
_L = flags.DEFINE_integer("n_layers", 6, "Layers.")
_V = flags.DEFINE_integer("vocab_size", 50277, "Vocabulary.")
_F = flags.DEFINE_integer("d_ff", 0, "SwiGLU width (0 = 4 d).")
_ATTN = flags.DEFINE_enum("attention", "einsum", ["einsum", "blocked", "xla"],
                          "einsum: full masked square; else attn_jax's core with that impl.")
_STEPS = flags.DEFINE_integer("steps", 4, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps (the first compiles).")


def init_params(key, d, h, n_layers, vocab, d_ff):
  import jax
  import jax.numpy as jnp
  ks = iter(jax.random.split(key, 2 + 7 * n_layers))
  nrm = lambda shape, std=0.02: std * jax.random.normal(next(ks), shape, jnp.float32)
  out_std = 0.02 / (2 * n_layers) ** 0.5
  layers = [{"n1": jnp.ones((d,)), "n2": jnp.ones((d,)), "wq": nrm((d, d)), "wk": nrm((d, d)),
             "wv": nrm((d, d)), "wo": nrm((d, d), out_std), "wg": nrm((d, d_ff)),
             "wu": nrm((d, d_ff)), "wd": nrm((d_ff, d), out_std)} for _ in range(n_layers)]
  return {"embed": nrm((vocab, d)), "norm": jnp.ones((d,)), "layers": layers}


def forward(params, tokens_BT, n_heads, attention):
  import jax
  import jax.numpy as jnp
  from attn_jax.kernels.entry import attend

  def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

  B, T = tokens_BT.shape
  x = params["embed"][tokens_BT]
  D = x.shape[-1]
  dh = D // n_heads
  inv = 1.0 / 10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
  ang = jnp.arange(T, dtype=jnp.float32)[:, None] * inv
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]

  def rope(t):
    t1, t2 = t[..., :dh // 2], t[..., dh // 2:]
    return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

  causal = jnp.tril(jnp.ones((T, T), bool))
  for p in params["layers"]:
    h = rms(x, p["n1"])
    q, k, v = (jnp.einsum("btd,de->bte", h, p[w]).reshape(B, T, n_heads, dh)
               for w in ("wq", "wk", "wv"))
    q, k = rope(q), rope(k)
    if attention == "einsum":
      s = jnp.einsum("bthd,bshd->bhts", q, k) * dh ** -0.5
      s = jnp.where(causal, s, -1e30)
      o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)
    else:
      o = attend(q, k, v, scale=dh ** -0.5, impl=attention)
    x = x + jnp.einsum("btd,de->bte", o.reshape(B, T, D), p["wo"])
    h = rms(x, p["n2"])
    x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(h @ p["wg"]) * (h @ p["wu"]), p["wd"])
  return rms(x, params["norm"]) @ params["embed"].T


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  d_ff = _F.value or 4 * _D.value
  params = init_params(jax.random.key(0), _D.value, _H.value, _L.value, _V.value, d_ff)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95,
                                                               weight_decay=0.1))
  opt = tx.init(params)

  def loss_fn(params, inputs, targets):
    logits = forward(params, inputs, _H.value, _ATTN.value)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

  @jax.jit
  def step(params, opt, inputs, targets):
    loss, g = jax.value_and_grad(loss_fn)(params, inputs, targets)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  toks = np.random.default_rng(0).integers(0, _V.value, (_B.value, _T.value + 1), np.int32)
  inputs, targets = jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])
  for _ in range(_WARMUP.value):
    params, opt, loss = step(params, opt, inputs, targets)
  jax.block_until_ready(loss)
  wall, cpu = [], []
  for _ in range(_STEPS.value):
    t, c = time.perf_counter(), time.process_time()
    params, opt, loss = step(params, opt, inputs, targets)
    jax.block_until_ready(loss)
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  tok = _B.value * _T.value
  print(f"reference ({_ATTN.value}) B{_B.value} T{_T.value} d{_D.value} h{_H.value} "
        f"L{_L.value} V{_V.value}: best {min(wall):.3f} s/step = {tok / min(wall):.0f} tok/s, "
        f"median CPU {np.median(cpu):.2f} s/step, loss {float(loss):.3f}", flush=True)


if __name__ == "__main__":
  cli.run(main)
