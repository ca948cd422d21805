"""Mamba-2 / Mamba-3 start where state-spaces/mamba's conventions put them (module docstrings).

* Every projection is PyTorch's nn.Linear default U(+-1/sqrt(fan_in)) (the out-projection
  divided by sqrt(n_residuals * n_layers)): bound respected, sample std within five standard
  errors of bound / sqrt(3) (the standard error of a uniform sample's std is computed from n);
  dt = softplus(dt_bias) in [dt_min, dt_max], A = exp(A_log) in [1, 16], D = 1.
* Mamba-2's SSM path: RMS(C.h) and RMS(D.x) of the module at init lie in the bands an
  independent numpy Monte Carlo of the convention gives (8 draws of the projection and conv
  weights with the module's dt_bias and A; band = [min / 1.25, 1.25 max]), and the Transformer's
  N(0, 0.02) (`proj_init="normal"`) falls below both. (The convention itself starts C.h at
  ~1% of D.x at T = 32: dt is 1e-3..1e-1.)
* Output scale: Mamba-2's output is W_out applied to a gated RMSNorm (mean square 1 per group),
  so its RMS is sqrt(d_inner) * std(W_out) = 1 / sqrt(3 n_res n_layers); Mamba-3's output is
  at least its D.x * SiLU(z) part, x and z ~ N(0, 1/3) (fan-in init of unit-RMS inputs), whose
  mean square is E[x^2] E[SiLU(z)^2] (a quadrature), times d_inner std(W_out)^2.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn_jax.model_config import ModelConfig
from attn_jax.registry import get_mixer
from attn_jax.ssm import ssd

D_MODEL, N_LAYERS, HEAD_DIM, D_STATE = 64, 2, 16, 16
N_RES = 2                 # blocks with an MLP (d_ff > 0)


def _cfg():
  return ModelConfig(vocab_size=64, d_model=D_MODEL, n_layers=N_LAYERS, n_heads=4, d_ff=128,
                     max_seq_len=64, dtype="float32", param_dtype="float32", init_std=0.02)


def _mixer(name, **opts):
  cfg = _cfg()
  o = dataclasses.replace(get_mixer(name).Options(), head_dim=HEAD_DIM, d_state=D_STATE,
                          chunk_size=16, **opts)
  return get_mixer(name)(cfg, o, rngs=nnx.Rngs(0)), o


def _input(seed=1, shape=(4, 32, D_MODEL)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)   # RMS 1, as after a norm


def _std_tolerance(n):
  """Five standard errors of a uniform sample's std, relative: Var(s^2) / sigma^4 ~ (kurtosis
  - 1) / n with kurtosis 9/5, and d s / s = d s^2 / (2 s^2)."""
  return 5 * math.sqrt(0.8 / n) / 2


@pytest.mark.parametrize("name", ["mamba2", "mamba3"])
def test_parameters_follow_the_reference_convention(name):
  m, o = _mixer(name)
  d_inner = o.heads(_cfg()) * HEAD_DIM
  linears = {k: v for k, v in vars(m).items() if hasattr(v, "kernel") and k.startswith(("in_",
                                                                                       "out"))}
  assert "out" in linears and any(k.startswith("in_") for k in linears)   # Mamba-2: in_proj
  for k, lin in linears.items():
    w = np.asarray(lin.kernel[...])
    fan_in = d_inner if k == "out" else D_MODEL
    bound = 1 / math.sqrt(fan_in) / (math.sqrt(N_RES * N_LAYERS) if k == "out" else 1)
    assert np.abs(w).max() <= bound, k
    rel = abs(w.std() / (bound / math.sqrt(3)) - 1)
    assert rel < _std_tolerance(w.size), (k, w.std(), bound / math.sqrt(3))
  dt = np.asarray(jax.nn.softplus(m.dt_bias[...]))
  assert np.all(dt >= o.dt_min * (1 - 1e-5)) and np.all(dt <= o.dt_max * (1 + 1e-5))
  np.testing.assert_array_equal(np.asarray(m.D[...]), 1.0)
  if name == "mamba2":
    a = np.exp(np.asarray(m.A_log[...]))
    assert np.all(a >= 1 - 1e-5) and np.all(a <= 16 * (1 + 1e-5))


# ------------------------------------------------------------- Mamba-2's SSM path at init

def _silu(x):
  return x / (1 + np.exp(-x))


def _convention_scales(rng, u, dt_bias, A, P, N, K=4):
  """(RMS(C.h), RMS(D.x)) of a Mamba-2 layer whose projections and conv are drawn from
  mamba_ssm's init (numpy, float64); dt_bias and A are given (the module's own draw, which
  both conventions share), so the band measures the projections' convention only."""
  H = A.shape[0]
  Bsz, T, D = u.shape
  lin = lambda *shape: rng.uniform(-1, 1, shape) / math.sqrt(shape[0])

  def conv(x):
    w, b = rng.uniform(-1, 1, (K, x.shape[-1])) / math.sqrt(K), \
        rng.uniform(-1, 1, x.shape[-1]) / math.sqrt(K)
    xp = np.concatenate([np.zeros((Bsz, K - 1, x.shape[-1])), x], axis=1)
    return _silu(b + sum(w[k] * xp[:, k:k + T] for k in range(K)))

  x = conv(u @ lin(D, H * P)).reshape(Bsz, T, H, P)
  b, c = conv(u @ lin(D, N)), conv(u @ lin(D, N))
  dt = np.log1p(np.exp(u @ lin(D, H) + dt_bias))                             # [B, T, H]
  h = np.zeros((Bsz, H, P, N))
  y = np.zeros((Bsz, T, H, P))
  for t in range(T):
    h = np.exp(A * dt[:, t])[..., None, None] * h + \
        (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, None, None, :]
    y[:, t] = np.einsum("bhpn,bn->bhp", h, c[:, t])
  return np.sqrt(np.mean(y ** 2)), np.sqrt(np.mean(x ** 2))


def _module_scales(m, u):
  """The same ratio through the module's own layers (conv, SSD) at its initial parameters."""
  xs, bs, cs, dt, _ = m.conv_inputs(u)
  a = -jnp.exp(m.A_log[...]) * dt
  y, _ = ssd.ssd_chunked(xs * dt[..., None], a, bs, cs, chunk=16)
  skip = m.D[...][:, None] * xs
  return float(jnp.sqrt(jnp.mean(y ** 2))), float(jnp.sqrt(jnp.mean(skip ** 2)))


def test_mamba2_ssm_path_scale_matches_the_convention():
  m, _ = _mixer("mamba2")
  u = _input()
  dt_bias, A = np.asarray(m.dt_bias[...], np.float64), -np.exp(np.asarray(m.A_log[...]))
  draws = np.array([_convention_scales(np.random.default_rng(s), np.asarray(u, np.float64),
                                       dt_bias, A, HEAD_DIM, D_STATE) for s in range(8)])
  lo, hi = draws.min(axis=0) / 1.25, draws.max(axis=0) * 1.25     # (C.h, D.x) bands
  got = np.array(_module_scales(m, u))
  assert np.all((lo <= got) & (got <= hi)), (got, lo, hi)
  old, _ = _mixer("mamba2", proj_init="normal")   # the Transformer's N(0, 0.02) start
  assert np.all(np.array(_module_scales(old, u)) < lo)


def test_mamba2_output_rms_is_the_rescaled_out_projection():
  m, _ = _mixer("mamba2")
  y = m(_input())[0]
  want = 1 / math.sqrt(3 * N_RES * N_LAYERS)
  assert abs(float(jnp.sqrt(jnp.mean(y ** 2))) / want - 1) < 0.2


def test_mamba3_output_at_least_its_skip_path():
  m, o = _mixer("mamba3")
  d_inner = o.heads(_cfg()) * HEAD_DIM
  z = np.linspace(-8, 8, 20001) * math.sqrt(1 / 3)          # quadrature of E[SiLU(z)^2]
  pdf = np.exp(-z ** 2 * 1.5) / math.sqrt(2 * math.pi / 3)
  e_silu2 = float(np.sum(_silu(z) ** 2 * pdf) * (z[1] - z[0]))
  std_out = 1 / math.sqrt(3 * d_inner * N_RES * N_LAYERS)
  floor = math.sqrt(d_inner * std_out ** 2 * (1 / 3) * e_silu2)
  rms = float(jnp.sqrt(jnp.mean(m(_input())[0] ** 2)))
  assert rms >= 0.8 * floor, (rms, floor)
  old, _ = _mixer("mamba3", proj_init="normal")
  assert float(jnp.sqrt(jnp.mean(old(_input())[0] ** 2))) < 0.8 * floor


@pytest.mark.parametrize("act,want", [("softplus", -math.log(2.0)), ("heavy_tail", -1.0)])
def test_mamba3_a_activation(act, want):
  """A = -f(A_raw) at A_raw = 0: -ln 2 for the release's softplus (the default), -1 for the
  reference's later heavy tail."""
  m, _ = _mixer("mamba3", a_activation=act)
  cols = m.part_columns("a")
  m.in_proj.kernel[...] = m.in_proj.kernel[...].at[:, cols].set(0.0)
  u = _input(shape=(1, 4, D_MODEL))
  got = m._inputs(u, jnp.arange(4)[None])
  dt = jax.nn.softplus(m.projected(u)["dt"] + m.dt_bias[...])
  np.testing.assert_allclose(np.asarray(got["a"]), want * np.asarray(dt), rtol=1e-6)
  assert _mixer("mamba3")[0].opts.a_activation == "softplus"
  with pytest.raises(ValueError, match="config.model.mamba3.a_activation"):
    _cfg().replace(mixer="mamba3").with_options("mamba3", a_activation="relu")   # with the config
