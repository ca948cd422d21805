"""A minimal plain-JAX Mamba-2 language model, written from the Mamba-2 paper (Dao & Gu 2024,
section 7.1, the "parallel Mamba block", Fig. 6), not from attn_jax's mixer: the reference that
attn_jax's Mamba-2 is checked against (tests/test_mamba2_parity.py) and trained beside
(attn_jax/study/mamba2_parity.py, docs/mamba_parity.md).

One fused in-projection [z, x, B, C, dt] = u W_in, one depthwise causal conv (with bias) over the
concatenated [x, B, C] channels followed by SiLU, dt = softplus(dt_raw + dt_bias),
A = -exp(A_log) per head, and the selective scan run token by token (`jax.lax.scan` over time):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T     (h [H, P, N])
    y_t = h_t C_t + D x_t;   out_t = W_out RMSNorm(y_t * SiLU(z_t))

inside the same pre-norm language model as attn_jax's decoder (embedding, x + mixer(norm(x)),
x + SwiGLU(norm(x)), final norm, tied head). Both models are therefore the same function of
their parameters; `to_minimal` maps attn_jax's parameters onto the minimal layout. What can
differ is what the optimizer is given: the initial parameters (an init "recipe", per component
below) and which parameters are decayed.

Init recipe components (`RECIPES`; `CHOICES` lists each component's choices):
  embed    normal02 N(0, 0.02) | normal1 N(0, 1) (PyTorch's nn.Embedding default)
  in_proj  fan_in U(+-1/sqrt(d)) (nn.Linear default) | normal02
  out_proj fan_in | fan_in_res (fan_in / sqrt(2 L), mamba_ssm's rescale) | normal02 |
           normal02_res (N(0, 0.02 / sqrt(2 L)), the Transformer's)
  mlp      the SwiGLU's up/gate and down projections: same four choices (the _res
           rescale acts on the down projection only)
  conv     fan_in U(+-1/sqrt(d_conv)) kernel and bias (nn.Conv1d default) | normal02 (bias 0)
  dt_bias  mamba (softplus^-1 of log-uniform [1e-3, 1e-1]) | const (softplus^-1(0.01))
  a_log    mamba (log U[1, 16]) | one (A = -1)
and what the optimizer does with them:
  embed_lr the token table's lr multiplier: 1 | 0.02
  decay    weights (matrices, conv kernels, embedding; not biases, norms, A_log, D, dt_bias) |
           no_embed (as weights, embedding not decayed) | matrices (conv kernel not decayed)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections

f32 = jnp.float32

RECIPES = {
    # attn_jax today: mamba_ssm's mixer init inside the Transformer trunk's N(0, 0.02)
    "ours": {"embed": "normal02", "in_proj": "fan_in", "out_proj": "fan_in_res",
             "mlp": "normal02_res", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
             "decay": "weights", "embed_lr": "1"},
    # every module at its PyTorch default (no _init_weights pass)
    "torch": {"embed": "normal1", "in_proj": "fan_in", "out_proj": "fan_in", "mlp": "fan_in",
              "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba", "decay": "weights",
              "embed_lr": "1"},
    # mamba_ssm's language model (models/mixer_seq_simple.py _init_weights, GatedMLP)
    "mamba_lm": {"embed": "normal02", "in_proj": "fan_in", "out_proj": "fan_in_res",
                 "mlp": "fan_in_res", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
                 "decay": "weights", "embed_lr": "1"},
    # N(0, 0.02) on every matrix and the embedding
    "normal": {"embed": "normal02", "in_proj": "normal02", "out_proj": "normal02",
               "mlp": "normal02", "conv": "fan_in", "dt_bias": "mamba", "a_log": "mamba",
               "decay": "weights", "embed_lr": "1"},
}
CHOICES = {"embed": ("normal02", "normal1"),
           "in_proj": ("fan_in", "normal02"),
           "out_proj": ("fan_in", "fan_in_res", "normal02", "normal02_res"),
           "mlp": ("fan_in", "fan_in_res", "normal02", "normal02_res"),
           "conv": ("fan_in", "normal02"),
           "dt_bias": ("mamba", "const"),
           "a_log": ("mamba", "one"),
           "decay": ("weights", "no_embed", "matrices"),
           "embed_lr": ("1", "0.02")}



def dims_of(c: ml_collections.ConfigDict) -> dict:
  m, o = c.model, c.model.mamba2
  d_inner = int(round(o.expand * m.d_model))
  return {"V": int(m.vocab_size), "D": int(m.d_model), "E": d_inner, "H": d_inner // o.head_dim,
          "P": int(o.head_dim), "N": int(o.d_state), "G": int(o.n_groups), "K": int(o.d_conv),
          "F": int(m.d_ff), "L": int(m.n_layers), "eps": float(m.norm_eps)}



def _normal(key, shape, std):
  return std * jax.random.normal(key, shape, f32)


def _uniform(key, shape, bound):
  return jax.random.uniform(key, shape, f32, -bound, bound)


def _matrix(key, fan_in, fan_out, choice, n_layers):
  res = 1.0 / math.sqrt(2 * n_layers) if choice.endswith("_res") else 1.0
  if choice.startswith("fan_in"):
    return _uniform(key, (fan_in, fan_out), res / math.sqrt(fan_in))
  return _normal(key, (fan_in, fan_out), 0.02 * res)


def _softplus_inv(x):
  return x + jnp.log(-jnp.expm1(-x))


def init_minimal(key: jax.Array, dims: dict, recipe: dict) -> dict:
  """Parameters of the minimal model (plain dict) under an init recipe (`RECIPES`)."""
  V, D, E, H, N, G, K, F, L = (dims[k] for k in "VDEHNGKFL")
  C = E + 2 * G * N                                  # conv channels [x, B, C]
  keys = iter(jax.random.split(key, 4 + 8 * L))
  emb_std = 1.0 if recipe["embed"] == "normal1" else 0.02
  params = {"embed": _normal(next(keys), (V, D), emb_std), "final_norm": jnp.ones((D,), f32),
            "layers": []}
  mlp_in = recipe["mlp"].replace("_res", "")
  for _ in range(L):
    k = next(keys)
    if recipe["conv"] == "fan_in":
      kw, kb = jax.random.split(k)
      conv_w, conv_b = _uniform(kw, (K, C), 1 / math.sqrt(K)), _uniform(kb, (C,), 1 / math.sqrt(K))
    else:
      conv_w, conv_b = _normal(k, (K, C), 0.02), jnp.zeros((C,), f32)
    if recipe["dt_bias"] == "mamba":
      u = jax.random.uniform(next(keys), (H,), f32)
      dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)), 1e-4)
    else:
      dt = jnp.full((H,), 0.01, f32)
    a_log = (jnp.log(jax.random.uniform(next(keys), (H,), f32, 1.0, 16.0))
             if recipe["a_log"] == "mamba" else jnp.zeros((H,), f32))
    params["layers"].append({
        "norm1": jnp.ones((D,), f32),
        "w_in": _matrix(next(keys), D, 2 * E + 2 * G * N + H, recipe["in_proj"], L),
        "conv_w": conv_w, "conv_b": conv_b, "dt_bias": _softplus_inv(dt), "a_log": a_log,
        "d_skip": jnp.ones((H,), f32), "gnorm": jnp.ones((E,), f32),
        "w_out": _matrix(next(keys), E, D, recipe["out_proj"], L),
        "norm2": jnp.ones((D,), f32),
        "w_gate": _matrix(next(keys), D, F, mlp_in, L),
        "w_up": _matrix(next(keys), D, F, mlp_in, L),
        "w_down": _matrix(next(keys), F, D, recipe["mlp"], L)})
  return params


def minimal_decay_mask(params: dict, decay: str) -> dict:
  """True where AdamW decays (`CHOICES["decay"]`)."""
  decayed = {"w_in", "w_out", "w_gate", "w_up", "w_down"} | ({"conv_w"} if decay != "matrices"
                                                             else set())
  layer = lambda lp: {k: k in decayed for k in lp}
  return {"embed": decay != "no_embed", "final_norm": False,
          "layers": [layer(lp) for lp in params["layers"]]}


def _rms(x, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def selective_scan(x_BTHP, dt_BTH, a_H, b_BTGN, c_BTGN):
  """y_t = h_t C_t, h_t = exp(dt_t a) h_{t-1} + dt_t x_t B_t^T, one token at a time."""
  Bsz, _, H, P = x_BTHP.shape
  G, N = b_BTGN.shape[2:]
  rep = H // G

  def step(h_BHPN, inp):
    x, dt, b, c = inp
    b_BHN, c_BHN = jnp.repeat(b, rep, axis=1), jnp.repeat(c, rep, axis=1)
    h_BHPN = (jnp.exp(dt * a_H)[:, :, None, None] * h_BHPN
              + (dt[:, :, None] * x)[..., None] * b_BHN[:, :, None, :])
    return h_BHPN, jnp.einsum("bhpn,bhn->bhp", h_BHPN, c_BHN)

  seq = tuple(jnp.moveaxis(z, 1, 0) for z in (x_BTHP, dt_BTH, b_BTGN, c_BTGN))
  _, y_TBHP = jax.lax.scan(step, jnp.zeros((Bsz, H, P, N), f32), seq)
  return jnp.moveaxis(y_TBHP, 0, 1)


def minimal_mixer(lp: dict, u_BTD, dims: dict):
  E, H, P, N, G, K, eps = (dims[k] for k in ("E", "H", "P", "N", "G", "K", "eps"))
  Bsz, T, _ = u_BTD.shape
  zxbcdt = u_BTD @ lp["w_in"]
  z, xbc, dt_raw = jnp.split(zxbcdt, [E, 2 * E + 2 * G * N], axis=-1)
  xbc_pad = jnp.pad(xbc, ((0, 0), (K - 1, 0), (0, 0)))
  xbc = jax.nn.silu(lp["conv_b"] + sum(lp["conv_w"][k] * xbc_pad[:, k:k + T] for k in range(K)))
  x, b, c = jnp.split(xbc, [E, E + G * N], axis=-1)
  x_BTHP = x.reshape(Bsz, T, H, P)
  dt_BTH = jax.nn.softplus(dt_raw + lp["dt_bias"])
  y = selective_scan(x_BTHP, dt_BTH, -jnp.exp(lp["a_log"]), b.reshape(Bsz, T, G, N),
                     c.reshape(Bsz, T, G, N))
  y = y + lp["d_skip"][:, None] * x_BTHP
  y = y.reshape(Bsz, T, E) * jax.nn.silu(z)
  y = _rms(y.reshape(Bsz, T, G, E // G), eps).reshape(Bsz, T, E) * lp["gnorm"]
  return y @ lp["w_out"]


def minimal_logits(params: dict, tokens_BT, dims: dict):
  eps = dims["eps"]
  x = params["embed"][tokens_BT]
  for lp in params["layers"]:
    x = x + minimal_mixer(lp, _rms(x, eps) * lp["norm1"], dims)
    u = _rms(x, eps) * lp["norm2"]
    x = x + (jax.nn.silu(u @ lp["w_gate"]) * (u @ lp["w_up"])) @ lp["w_down"]
  return (_rms(x, eps) * params["final_norm"]) @ params["embed"].T


def to_minimal(ours: dict, dims: dict) -> dict:
  """attn_jax's pure-dict parameters (`nnx.to_pure_dict`) in the minimal layout."""
  V, D, E, H, N, G, L = (dims[k] for k in "VDEHNGL")
  out = {"embed": ours["embed"][:V], "final_norm": ours["final_norm"]["scale"], "layers": []}
  for r in range(L):
    blk = jax.tree.map(lambda a: a[r], ours["blocks"]["layers"][0])
    m = blk["mixer"]
    # attn_jax's in_proj and conv are already the authors' fused [z, x, B, C, dt] and [x, B, C]
    out["layers"].append({
        "norm1": blk["mixer_norm"]["scale"], "w_in": m["in_proj"]["kernel"],
        "conv_w": m["conv"]["kernel"], "conv_b": m["conv"]["bias"],
        "dt_bias": m["head_scalars"][0], "a_log": m["head_scalars"][1],
        "d_skip": m["head_scalars"][2],
        "gnorm": m["norm_scale"].reshape(-1), "w_out": m["out"]["kernel"].reshape(E, D),
        "norm2": blk["mlp_norm"]["scale"], "w_gate": blk["mlp"]["gate"]["kernel"],
        "w_up": blk["mlp"]["up"]["kernel"], "w_down": blk["mlp"]["down"]["kernel"]})
  return out
