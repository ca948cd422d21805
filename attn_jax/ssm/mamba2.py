"""Mamba-2 mixer (Dao & Gu, "Transformers are SSMs", 2024): SSD with a scalar-times-identity A.

Per token (d_inner = n_heads * head_dim channels, heads of head_dim channels, n_groups groups of
B/C shared by n_heads / n_groups heads):

    z, x, B, C, dt_raw = in-projections of the input (z, x: [H, P]; B, C: [G, N]; dt_raw: [H])
    x, B, C  <- SiLU(causal depthwise conv of width d_conv (with bias) over time)
    dt = softplus(dt_raw + dt_bias)  (0 on padding tokens);   a = -exp(A_log) * dt  (<= 0)
    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T;   y_t = h_t C_t + D x_t          (per head, SSD)
    out = W_out RMSNorm(y * SiLU(z))                                   (gated RMSNorm over d_inner)

as in state-spaces/mamba `mamba_ssm/modules/mamba2.py` (defaults: expand 2, head_dim 64,
d_state 64 here, d_conv 4, conv bias, no in/out-projection bias, RMSNorm of y * SiLU(z) per
group of d_inner / n_groups channels before the out projection).

Initialisation, each as that reference (file names under `mamba_ssm/`):
  in-projections   U(+-1/sqrt(d_model)), PyTorch's nn.Linear default (`modules/mamba2.py`)
  out-projection   U(+-1/sqrt(d_inner)) / sqrt(n_residuals * n_layers)
                   (`models/mixer_seq_simple.py` `_init_weights`); `projection_inits`
  conv kernel/bias U(+-1/sqrt(d_conv)), PyTorch's nn.Conv1d default (depthwise: fan-in d_conv)
  dt_bias          softplus^{-1}(dt), dt log-uniform in [dt_min, dt_max] = [1e-3, 1e-1],
                   floored at 1e-4 (`modules/mamba2.py`)
  A_log            log U[a_init_min, a_init_max] = log U[1, 16];  D = 1;  norm scale = 1
Weight decay (`layers.PARAM_KINDS`): projection and conv kernels only; conv biases, dt_bias
(kind bias), A_log, D (scalar) and the norm scale are exempt, as the reference marks them
`_no_weight_decay` (and exempts biases by name). `proj_init="normal"` is the Transformer's
N(0, init_std) instead, kept as an ablation.

Parameter layout, as the authors': one in-projection `in_proj` [d_model, 2 d_inner + 2 G N + H]
whose outputs are z, x, B, C, dt_raw side by side (`IN_PROJ_PARTS`), and one depthwise conv
`conv` over the adjacent x, B, C channels [d_conv, d_inner + 2 G N] (kernel and bias). Each
runs as one matmul / one conv, and each is one parameter: in a scanned stack every parameter
is one gradient write per layer in the backward scan and its own optimizer and norm kernels
at the step's top level, so five projections and three convs kept apart (each with its own
logical axes, concatenated at call time) cost a GPU a dozen or so kernel launches a layer
more, plus the concatenations (tests/test_launches.py counts them). The fused output axis has
no logical name (its parts are sharded alike anyway: the SSD kernels keep heads whole on each
device). Checkpoints
written with the five / three separate parameters (before this layout) do not load; the
minimal study's conversion (`study/mamba2_minimal.to_minimal`) reads this layout. For the same
reason the per-head scalars dt_bias, A_log and D are the rows of one [3, H] parameter
`head_scalars` (`HEAD_SCALARS`; each initialised as above, none weight-decayed, kind scalar),
read through the properties `dt_bias`, `A_log`, `D`.

Training uses the chunked SSD: on a GPU / TPU the fused Pallas kernels (`kernels/ssd_chunks.py`,
chosen by `ssd_chunks.chunked_ssd` in a full forward), else `ssd.ssd_chunked`.
Rematerialisation: a full forward (no decoding state) runs under `jax.checkpoint`
(`remat_full_forward`, whatever `cfg.remat` says) saving only its inputs and the fused
in-projection's output (z, x, B, C, dt_raw side by side in the compute dtype, tagged
`IN_PROJ`): the backward pass recomputes the conv, SiLU, dt, the SSD's chunk internals
(segment decays L [Q, Q] per chunk and head, C B^T, the chunk states and the states entering
each chunk) and the gated norm from them, as state-spaces/mamba's fused kernel
(`mamba_split_conv1d_scan_combined`) does. Saved, those fp32 internals are about 27 tensors
the size of x in fp32 per layer, which kept across a stack of layers made Mamba-2's train-step
temporaries ~3.5x a Transformer's of the same size; the in-projections are 2 (2 d_inner +
2 G N + H) bytes per token in bf16 (`experiments/step_memory.py`, docs/benchmarks.md). The
output projection is inside the checkpoint too, so the gated-norm output it reads is
recomputed, not kept. The forward's numerics are unchanged; the backward runs the conv and
SSD forward once more. (Decoding calls, with a state, are not differentiated: no checkpoint.)

The decoding state is the conv window (the
last d_conv - 1 conv inputs, x, B and C side by side as the one conv reads them: one array, so
a one-token step shifts it in one kernel) plus the SSM state h [H, P, N] (fp32): constant in
the generated length. A one-token step uses `ssd.ssd_step`; a longer continuation (prefill chunk) runs the
chunked form from the carried state.

Padding (position -1): dt = 0, so the token neither decays nor writes the state. Padding is
assumed to be right padding within a call (pads after the valid tokens of a row, as
decode.py produces); the conv window carried out is the last d_conv - 1 *valid* inputs, so a
row that is all padding in a call leaves its whole state unchanged.

Packed rows (`segment_ids_BT`, full forwards): at a document's first token t0 both memories
restart, so each document is computed as in a row of its own.
  conv   y_t = b + sum_{d<K} w_{K-1-d} x_{t-d} [seg_{t-d} = seg_t]: a tap reaching into another
         document reads 0, as the zero left padding of a fresh row (`CausalConv`);
  SSD    a_{t0} = -inf, so exp(a_{t0}) = 0 and h_{t0} = dt x_{t0} B_{t0}^T
         (`ssd.ssd_chunked(reset_BT=)`, whose docstring shows this exact in the chunked form).
The D skip, gate and norm are per token. A state restarted at t0 cannot also hold a prefix
shared by every document, so `reads_shared_prefix` stays False (mixer.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from attn_jax.field_checks import field_check, is_int, is_number
from attn_jax.kernels import ssd_chunks
from attn_jax.layers import (Linear, causal_positions, dtype_of, fan_in_uniform, out_major,
                             param, segment_starts)
from attn_jax.mixer import Mixer, register_mixer
from attn_jax.ssm import ssd

if TYPE_CHECKING:  # annotations only: model_config imports the registry, which imports the mixers
  from attn_jax.model_config import ModelConfig

f32 = jnp.float32

# The checkpoint name of the in-projection outputs: the only values a full forward's backward
# pass keeps (`remat_full_forward`, module docstring).
IN_PROJ = "ssm_in_proj"
IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")       # Mamba2.in_proj's outputs, in order
HEAD_SCALARS = ("dt_bias", "A_log", "D")          # Mamba2.head_scalars' rows, in order


# ----------------------------------------------------------------------- shared pieces

def remat_full_forward(cfg: ModelConfig, fn):
  """`fn` under `jax.checkpoint`, saving only the values tagged `IN_PROJ` (and its inputs):
  the backward pass recomputes everything else of it (module docstring). CSE is prevented
  unless the layers are scanned, as the trunk's own remat (model.py)."""
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(IN_PROJ),
                        prevent_cse=not cfg.scan_layers)


def dt_bias_init(dt_min: float, dt_max: float, floor: float = 1e-4):
  """softplus^{-1} of dt ~ log-uniform[dt_min, dt_max] (Mamba's dt initialisation)."""
  def init(key, shape, dtype=f32):
    u = jax.random.uniform(key, shape, f32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
  return init


def projection_inits(cfg: ModelConfig, opts, d_inner: int) -> tuple[dict, dict]:
  """`Linear` init keywords of an SSM block's (in-projections, out-projection).

  proj_init "fan_in" (default), state-spaces/mamba's convention: the in-projection keeps
  PyTorch's nn.Linear default U(+-1/sqrt(d_model)) (`modules/mamba2.py`, `modules/mamba3.py`
  never re-initialise it), the out-projection is that default U(+-1/sqrt(d_inner)) divided by
  sqrt(n_residuals * n_layers) (`models/mixer_seq_simple.py` `_init_weights`,
  rescale_prenorm_residual; n_residuals = 2 with an MLP per block (cfg.d_ff > 0), else 1).
  "normal": the Transformer's N(0, init_std) and N(0, init_std / sqrt(2 n_layers)) (an
  ablation: at init_std 0.02 it starts Mamba-2's C.h ~150x below its D.x skip).
  """
  if opts.proj_init == "normal":
    return ({"init_std": cfg.init_std},
            {"init_std": cfg.init_std / math.sqrt(2 * cfg.n_layers)})
  n_res = 2 if cfg.d_ff > 0 else 1
  return ({"init": fan_in_uniform(cfg.d_model)},
          {"init": fan_in_uniform(d_inner, 1.0 / math.sqrt(n_res * cfg.n_layers))})


def head_scalars_init(opts):
  """Mamba-2's per-head scalars stacked [3, H] (`HEAD_SCALARS`): dt_bias (`dt_bias_init`),
  A_log = log U[a_init_min, a_init_max] and D = 1, each from its own key."""
  def init(key, shape, dtype=f32):
    k_dt, k_a = jax.random.split(key)
    H = shape[1]
    return jnp.stack([dt_bias_init(opts.dt_min, opts.dt_max)(k_dt, (H,), dtype),
                      uniform_init(opts.a_init_min, opts.a_init_max, jnp.log)(k_a, (H,), dtype),
                      jnp.ones((H,), dtype)])
  return init


def uniform_init(lo: float, hi: float, transform=lambda u: u):
  def init(key, shape, dtype=f32):
    return transform(jax.random.uniform(key, shape, f32, lo, hi)).astype(dtype)
  return init


def valid_mask(positions_BT: jax.Array) -> jax.Array:
  return positions_BT >= 0


def document_resets(segment_ids_BT, state, owner: str):
  """[B, T] bool, True at each document's first token (`layers.segment_starts`), or None for
  one stream per row. Packed rows are full forwards: a decoding state is refused."""
  if segment_ids_BT is None:
    return None
  if state is not None:
    raise ValueError(f"{owner}: segment_ids_BT (packed rows) is for full forwards; got a "
                     "decoding state too")
  return segment_starts(segment_ids_BT)


def last_valid_window(prev_BWX: jax.Array, new_BTX: jax.Array, n_valid_B: jax.Array) -> jax.Array:
  """The last W entries of concat(prev, new[:n_valid]) per row (right-padded `new`)."""
  W = prev_BWX.shape[1]
  cat = jnp.concatenate([prev_BWX, new_BTX.astype(prev_BWX.dtype)], axis=1)
  idx = n_valid_B[:, None] + jnp.arange(W)[None, :]                  # [B, W]
  idx = idx.reshape(idx.shape + (1,) * (cat.ndim - 2))
  return jnp.take_along_axis(cat, idx, axis=1)


def tiny_ssd_options(options):
  """`options` (an SSD mixer's) for test-sized models (d_model 32, 4 heads)."""
  return dataclasses.replace(options, d_state=8, head_dim=8, chunk_size=4)


def causal_conv(x_BTX, w_KX, b_X, window_BWX=None, n_valid_B=None, segment_ids_BT=None):
  """Depthwise causal conv over time with bias, y_t = b + sum_k w_k x_{t-K+1+k}, channels
  [X...] (any trailing shape, `w_KX` [K, X...], `b_X` [X...]) -> (y_BTX fp32, new window or
  None). window = the last K-1 inputs before x; `segment_ids_BT` (packed rows, no window): a
  tap reaching into another document reads 0. Per channel, so the conv of several channel
  groups concatenated is the concatenation of their convs, entry for entry."""
  K = w_KX.shape[0]
  B, T = x_BTX.shape[:2]
  xf = x_BTX.astype(f32)
  prev = (jnp.zeros((B, K - 1) + x_BTX.shape[2:], f32) if window_BWX is None
          else window_BWX.astype(f32))
  cat = jnp.concatenate([prev, xf], axis=1)                       # [B, K-1+T, ...]
  same = None
  if segment_ids_BT is not None:   # same[b, t, k]: tap k of token t is in t's document
    seg = jnp.pad(segment_ids_BT, ((0, 0), (K - 1, 0)), mode="edge")   # t < 0 reads 0 anyway
    same = jnp.stack([seg[:, k:k + T] == segment_ids_BT for k in range(K)], axis=-1)
  y = _tap_sum(cat, w_KX.astype(f32), b_X.astype(f32), same)
  new_window = None
  if window_BWX is not None:
    new_window = last_valid_window(window_BWX, x_BTX, n_valid_B).astype(window_BWX.dtype)
  return y, new_window


def _taps(cat_BSX, same_BTK, K: int) -> list[jax.Array]:
  """x_{t-(K-1-k)} for every t, k < K (the windows of `cat`, [B, K-1+T, X...]); 0 where that
  token is in another document (`same` False; the last tap is the token itself)."""
  T = cat_BSX.shape[1] - K + 1
  out = []
  for k in range(K):
    x_k = cat_BSX[:, k:k + T]
    if same_BTK is not None and k < K - 1:
      keep = same_BTK[:, :, k].reshape(same_BTK.shape[:2] + (1,) * (cat_BSX.ndim - 2))
      x_k = jnp.where(keep, x_k, 0.0)
    out.append(x_k)
  return out


@jax.custom_vjp
def _tap_sum(cat_BSX, w_KX, b_X, same_BTK):
  """y_t = b + sum_k w_k tap_k(t) (`_taps`), with the VJP written out (`_tap_sum_bwd`)."""
  return _tap_sum_fwd(cat_BSX, w_KX, b_X, same_BTK)[0]


def _tap_sum_fwd(cat_BSX, w_KX, b_X, same_BTK):
  K = w_KX.shape[0]
  y = b_X + sum(w_KX[k] * u for k, u in enumerate(_taps(cat_BSX, same_BTK, K)))
  return y, (cat_BSX, w_KX, same_BTK)


def _tap_sum_bwd(res, g_BTX):
  """dcat = sum_k (g w_k, masked) placed at tap k's window; (dw_k, db) = sum over rows and
  time of g tap_k and of g: one reduction over the K taps and the bias stacked, where
  autodiff's gave one per tap and one for the bias (each a kernel on a GPU)."""
  cat, w, same = res
  K = w.shape[0]
  taps = _taps(cat, same, K)
  dwb = jnp.sum(g_BTX[:, :, None] * jnp.stack(taps + [jnp.ones_like(g_BTX)], axis=2),
                axis=(0, 1))
  tail = [(0, 0)] * (cat.ndim - 2)
  dcat = 0.0
  for k in range(K):
    d = g_BTX * w[k]
    if same is not None and k < K - 1:
      d = jnp.where(same[:, :, k].reshape(same.shape[:2] + (1,) * len(tail)), d, 0.0)
    dcat = dcat + jnp.pad(d, [(0, 0), (k, K - 1 - k)] + tail)
  return dcat, dwb[:K], dwb[K], None


_tap_sum.defvjp(_tap_sum_fwd, _tap_sum_bwd)


class CausalConv(nnx.Module):
  """Depthwise causal conv over time with bias (`causal_conv`).

  Channels have shape `channels` (e.g. (H, P)) with logical axes `axes`. PyTorch's Conv1d init
  (uniform +-1/sqrt(fan_in), fan_in = width for a depthwise conv), as Mamba uses.
  """

  def __init__(self, width: int, channels: tuple[int, ...], axes: tuple, *, rngs: nnx.Rngs):
    bound = 1.0 / math.sqrt(width)
    self.width = width
    self.kernel = param(rngs, uniform_init(-bound, bound), (width,) + channels,
                        (None,) + tuple(axes), kind="weight")
    self.bias = param(rngs, uniform_init(-bound, bound), channels, tuple(axes), kind="bias")

  def __call__(self, x_BTX: jax.Array, window_BWX=None, n_valid_B=None, segment_ids_BT=None):
    """-> (y_BTX fp32, new window or None) (`causal_conv`)."""
    return causal_conv(x_BTX, self.kernel[...], self.bias[...], window_BWX, n_valid_B,
                       segment_ids_BT)


def fused_projection(x_BTD: jax.Array, linears) -> jax.Array:
  """The outputs of several `Linear`s of one input as one matmul, [B, T, sum_i M_i] (each
  Linear's outputs flattened, in the order given; `split_last`), tagged `IN_PROJ`:

      x W_1, ..., x W_n  =  x [W_1 | ... | W_n]

  column for column the same dot products, so the same values; one kernel (and one saved
  residual, one weight-gradient matmul and one input-gradient matmul in the backward) where
  there were n. The kernels are concatenated at call time (a kernel of its own on a GPU, in
  the forward and the rematerialised forward), so the SSD mixers keep their in-projection as
  one Linear (n = 1: no concatenation; module docstring's "Parameter layout"). Concatenated
  output axes lose a sharding of one projection's outputs (heads over a `tensor` axis): the
  SSD kernels keep heads whole on each device anyway (`ssd_chunks._sharded`)."""
  first = linears[0]
  if any(lin.in_shape != first.in_shape or lin.dtype != first.dtype for lin in linears):
    raise ValueError("fused_projection: the Linears must share their input shape and dtype")
  k = math.prod(first.in_shape)
  lead = x_BTD.shape[:x_BTD.ndim - len(first.in_shape)]
  w_KM = jnp.concatenate([lin.kernel[...].astype(first.dtype).reshape(k, -1) for lin in linears],
                         axis=1)
  y_NM = jnp.dot(x_BTD.astype(first.dtype).reshape(-1, k), w_KM)
  return checkpoint_name(y_NM.reshape(lead + (w_KM.shape[1],)), IN_PROJ)


def split_last(y_BTM: jax.Array, shapes) -> list[jax.Array]:
  """`y`'s last axis cut into consecutive parts of these shapes (their sizes' sum)."""
  out, start = [], 0
  for shape in shapes:
    n = math.prod(shape)
    out.append(y_BTM[..., start:start + n].reshape(y_BTM.shape[:-1] + tuple(shape)))
    start += n
  if start != y_BTM.shape[-1]:
    raise ValueError(f"split_last: parts of {start} entries for an axis of {y_BTM.shape[-1]}")
  return out


# ----------------------------------------------------------------------- the mixer

class FullForwardRemat:
  """The Mixer call shared by the SSD mixers (Mamba-2, Mamba-3): a full forward (no state)
  runs `project(ssm_heads(x))` under `remat_full_forward` (module docstring); with a state,
  the heads carry it and nothing is rematerialised. The mixer gives `cfg`, `ssm_heads`,
  `project` and its out-projection `out`."""

  def __call__(self, x_BTD, *, positions_BT=None, segment_ids_BT=None, state=None, rng=None,
               train=False):
    if positions_BT is None:   # a plain 0..T-1 full forward
      positions_BT = causal_positions(*x_BTD.shape[:2])
    del rng, train
    if state is None:
      return self.remat_forward(x_BTD, positions_BT, segment_ids_BT), None, {}
    y, state = self.ssm_heads(x_BTD, positions_BT=positions_BT, state=state,
                              segment_ids_BT=segment_ids_BT)
    return self.project(y), state, {}

  def remat_forward(self, x_BTD, positions_BT, segment_ids_BT=None):
    """project(ssm_heads(x)) of a full forward under `remat_full_forward`."""
    def fwd(x, pos, seg):
      return self.project(self.ssm_heads(x, positions_BT=pos, segment_ids_BT=seg)[0])
    return remat_full_forward(self.cfg, fwd)(x_BTD, positions_BT, segment_ids_BT)

  def fuse_for_decoding(self) -> None:
    """The decoding copy (`Decoder.for_decoding`) stores `out` out-major (`layers.out_major`):
    for one token its reduction then takes the gated norm's (or gate's) elementwise work in (one kernel
    where an in-major kernel's column reduction needs two). Idempotent."""
    self.out = out_major(self.out)


@register_mixer("mamba2")
class Mamba2(FullForwardRemat, Mixer):

  @dataclasses.dataclass(frozen=True)
  class Options(ssd.HeadOptions):   # d_state, expand, head_dim, n_heads, n_groups
    d_conv: int = 4
    chunk_size: int = 64         # Q of the chunked SSD
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    a_init_min: float = 1.0      # A = -exp(A_log), A_log = log U[a_init_min, a_init_max]
    a_init_max: float = 16.0

    def validate(self, cfg: ModelConfig, where: str) -> None:
      need = field_check(where)
      for f in ("d_state", "head_dim", "n_groups", "d_conv", "chunk_size"):
        need(is_int(getattr(self, f), 1), f, f"must be an integer >= 1, got {getattr(self, f)!r}")
      ssd.validate_inner_width(self, cfg.d_model, need)
      need(is_number(self.dt_min) and is_number(self.dt_max) and 0 < self.dt_min <= self.dt_max,
           "dt_min", "need 0 < dt_min <= dt_max")
      need(is_number(self.a_init_min) and is_number(self.a_init_max)
           and 0 < self.a_init_min <= self.a_init_max, "a_init_min",
           "need 0 < a_init_min <= a_init_max")

  @classmethod
  def tiny(cls):
    return tiny_ssd_options(cls.Options())

  def __init__(self, cfg: ModelConfig, opts: "Mamba2.Options", *, rngs: nnx.Rngs):
    self.cfg, self.opts = cfg, opts
    H, P, N, G, D = opts.heads(cfg), opts.head_dim, opts.d_state, opts.n_groups, cfg.d_model
    self.H, self.P, self.N, self.G = H, P, N, G
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    proj_in, proj_out = projection_inits(cfg, opts, H * P)
    kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, **proj_in)
    self.in_proj = Linear((D,), (2 * H * P + 2 * G * N + H,), in_axes=("embed",),
                          out_axes=(None,), **kw)          # z, x, B, C, dt (IN_PROJ_PARTS)
    self.conv = CausalConv(opts.d_conv, (H * P + 2 * G * N,), (None,), rngs=rngs)   # x, B, C
    self.head_scalars = param(rngs, head_scalars_init(opts), (len(HEAD_SCALARS), H),
                              (None, "heads"), kind="scalar")   # dt_bias, A_log, D
    self.norm_scale = param(rngs, nnx.initializers.ones, (H, P), ("heads", "head_dim"),
                            kind="norm")
    kw.update(proj_out)   # the rescaled residual init (projection_inits)
    self.out = Linear((H, P), (D,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)

  # the per-head scalars, rows of one parameter (module docstring): read-only views
  @property
  def dt_bias(self) -> jax.Array:
    return self.head_scalars[0]

  @property
  def A_log(self) -> jax.Array:
    return self.head_scalars[1]

  @property
  def D(self) -> jax.Array:
    return self.head_scalars[2]

  def in_projections(self) -> tuple:
    """The in-projection (one Linear: z, x, B, C, dt side by side, `IN_PROJ_PARTS`; x, B, C
    adjacent, the conv's channels) as `fused_projection` takes it."""
    return (self.in_proj,)

  def part_shapes(self) -> dict:
    """{part: its per-token shape} of the in-projection's outputs (`IN_PROJ_PARTS`)."""
    H, P, N, G = self.H, self.P, self.N, self.G
    return dict(zip(IN_PROJ_PARTS, [(H, P), (H, P), (G, N), (G, N), (H,)]))

  def conv_inputs(self, x_BTD, positions_BT=None):
    """(x, B, C after the conv and SiLU (fp32), dt = softplus(dt_raw + dt_bias) (fp32, 0 on
    padding), z) of a full forward (no state): the SSD's inputs, for diagnostics and tests."""
    if positions_BT is None:
      positions_BT = causal_positions(*x_BTD.shape[:2])
    sh = self.part_shapes()
    z, xbc, dt_raw = split_last(self.in_proj(x_BTD), [sh["z"], (self.conv.bias.shape[0],),
                                                      sh["dt"]])
    xbc, _ = self.conv(xbc)
    xs, bs, cs = split_last(jax.nn.silu(xbc), [sh["x"], sh["B"], sh["C"]])
    dt = jax.nn.softplus(dt_raw.astype(f32) + self.dt_bias[...].astype(f32))
    return xs, bs, cs, jnp.where(valid_mask(positions_BT)[..., None], dt, 0.0), z

  # -------------------------------------------------------------- pieces reused by hybrids
  def ssm_heads(self, x_BTD, *, positions_BT, state=None, segment_ids_BT=None):
    """-> (gated-normed head outputs [B, T, H, P] in the compute dtype, new state).
    `segment_ids_BT`: packed rows, conv and state restart per document (module docstring)."""
    opts, cfg = self.opts, self.cfg
    reset = document_resets(segment_ids_BT, state, type(self).__name__)
    valid = valid_mask(positions_BT)
    n_valid = valid.sum(axis=1).astype(jnp.int32)
    H, P, N, G = self.H, self.P, self.N, self.G
    z, xbc, dt_raw = split_last(fused_projection(x_BTD, self.in_projections()),
                                [(H, P), (H * P + 2 * G * N,), (H,)])   # kept for the backward
    window = None if state is None else state["conv"]
    xbc, new_window = self.conv(xbc, window, n_valid, segment_ids_BT)
    xs, bs, cs = split_last(jax.nn.silu(xbc), [(H, P), (G, N), (G, N)])
    # dt_bias, A_log and D read through one broadcast of their parameter to every token: the
    # backward then sums their cotangents over (B, T) in one reduction, not one per scalar
    hs = jnp.broadcast_to(self.head_scalars[...].astype(f32), dt_raw.shape[:2] + (3, H))
    dt_bias, A_log, D = hs[:, :, 0], hs[:, :, 1], hs[:, :, 2]
    dt = jax.nn.softplus(dt_raw.astype(f32) + dt_bias)
    dt = jnp.where(valid[..., None], dt, 0.0)                      # padding: state unchanged
    a = -jnp.exp(A_log) * dt                                       # [B, T, H], <= 0
    x_in = xs * dt[..., None]
    h0 = None if state is None else state["ssm"]
    if state is not None and x_BTD.shape[1] == 1:
      y, h = ssd.ssd_step(h0, x_in[:, 0], a[:, 0], bs[:, 0], cs[:, 0])
      y = y[:, None]
    else:
      fn = ssd_chunks.chunked_ssd(state is None, x_in.shape, bs.shape, opts.chunk_size,
                                  what=type(self).__name__)
      y, h = fn(x_in, a, bs, cs, chunk=opts.chunk_size, h0_BHPN=h0, reset_BT=reset,
                dot_dtype=dtype_of(cfg.dtype))
    y = y + D[..., None] * xs
    y = y * jax.nn.silu(z.astype(f32))
    Bsz, T = y.shape[:2]
    yg = y.reshape(Bsz, T, self.G, self.H // self.G, self.P)       # norm per B/C group
    yg = yg * jax.lax.rsqrt(jnp.mean(jnp.square(yg), axis=(-2, -1), keepdims=True) + cfg.norm_eps)
    y = yg.reshape(y.shape) * self.norm_scale[...].astype(f32)
    new_state = None
    if state is not None:
      new_state = {"conv": new_window, "ssm": h}
    return y.astype(dtype_of(cfg.dtype)), new_state

  def implicit_attention(self, x_BTD) -> dict:
    """The SSD's attention-like matrix of a full forward (positions 0..T-1), for diagnostics
    (eval/maps.py): decay [B, T, H] (exp(a_t)), dt [B, T, H], the cumulative decay L and
    M_ij = (C_i . B_j) L_ij dt_j ([B, H, T, T]), x [B, T, H, P] (the conv+SiLU input the SSD
    scans, y_i = sum_j M_ij x_j before the D skip, gate and norm) and the causal mask."""
    xs, bs, cs, dt, _ = self.conv_inputs(x_BTD)
    a = -jnp.exp(self.A_log[...].astype(f32)) * dt                  # [B, T, H]
    T = x_BTD.shape[1]
    mask = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    A = jnp.cumsum(a, axis=1).transpose(0, 2, 1)                    # [B, H, T]
    L = jnp.exp(jnp.where(mask, A[..., :, None] - A[..., None, :], -jnp.inf))
    cb = jnp.einsum("bign,bjgn->bgij", cs.astype(f32), bs.astype(f32))   # [B, G, T, T]
    cb = jnp.repeat(cb, self.H // self.G, axis=1)                   # group -> heads
    M = cb * L * dt.transpose(0, 2, 1)[:, :, None, :]
    return {"decay": jnp.exp(a), "dt": dt, "L": L, "M": M, "x": xs, "mask": mask}

  def project(self, y_BTHP):
    """The mixer's output: the out-projection of the gated-normed heads [B, T, H, P]."""
    return self.out(y_BTHP)

  # -------------------------------------------------------------- class hooks
  @classmethod
  def init_state(cls, cfg: ModelConfig, opts: "Mamba2.Options", batch: int, capacity: int,
                 dtype, policy=None):
    """The conv window (the last d_conv-1 conv inputs x, B, C side by side, [B, W, H P + 2 G
    N] in `dtype`, as the one `conv` reads them) + the SSM state (fp32); no `capacity`."""
    del capacity
    H, P, N, G, W = opts.heads(cfg), opts.head_dim, opts.d_state, opts.n_groups, opts.d_conv - 1
    return {"conv": jnp.zeros((batch, W, H * P + 2 * G * N), dtype),
            "ssm": jnp.zeros((batch, H, P, N), f32)}

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, opts: "Mamba2.Options", seq_len: int) -> float:
    """The chunked SSD's work (`ssd.ssd_flops_per_token`); the conv and projections are
    parameter work, counted from the parameter count."""
    return ssd.ssd_flops_per_token(n_heads=opts.heads(cfg), head_dim=opts.head_dim,
                                   d_state=opts.d_state, n_groups=opts.n_groups,
                                   chunk=opts.chunk_size, seq_len=seq_len)
