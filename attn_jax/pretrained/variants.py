"""A pretrained Llama as an attention variant, unchanged at step 0: the plain import's
parameters plus the variant's new ones, initialised so that the logits equal the plain model's
(`experiments/convert.py --src=smollm2 --mixer=sisa`; docs/pretrained_variants.md).

Offered (`VARIANTS`), and why each new parameter's init gives the plain model:

- "attention": the plain import itself (a control that goes through the same path).
- "sink_logit": `attention` with a learned per-head sink logit s_h (projection.py): an extra
  softmax column with a zero value, so each head's output becomes (1 - p_i) y_i with
  p_i = e^{s_h} / (e^{s_h} + sum_j e^{z_ij}) <= e^{s_h - max_j z_ij}. No finite s_h gives
  p_i = 0, and s_h = -inf is exact but never trains (dL/ds_h = -sum_i p_i (...) = 0). So s_h
  starts at a finite `sink_init` and the distance is measured and printed. The default, -30,
  is set by SmolLM2-135M, some of whose heads have rows whose largest logit is near -10: on
  512 tokens of tinyshakespeare its logits move by 1.4e-5 relative at s_h = -20, 3.0e-2 at
  -12, 0.14 at -8. Adam normalises the gradient, whose size
  is the sum of p_i over every query of the batch, so s_h moves from the first steps.
- "sisa": score_ij = z_ij + lambda_h e^{g_i - g_j} (R(Phi_i) C_i).(R(Phi_j) B_j) (sisa.py).
  lambda = softplus(lambda_raw) is > 0 for every finite lambda_raw (in fp32 it reaches 0 only
  below about -104, where its gradient sigmoid(lambda_raw) is 0 too), so the term is not
  switched off through lambda. Instead W_C = 0: C_i = 0, so the widened query's extra d_s
  channels are exactly 0.0 and every added product is exactly 0 in floating point (B, the decay
  and the phase are finite). W_B keeps its random init (N(0, init_std)), so dL/dW_C =
  lambda sum (...) R B_j is not 0 and the term grows from the first step (one factor of a
  product at zero, the other random: LoRA's init); dL/dW_B is 0 until W_C moves. lambda, the
  decay and the phase keep SISA's defaults. SISA has one key head per query head, so a
  grouped-query checkpoint's W_k, W_v are repeated over their query group (head h reads K/V
  head h // (H / K), exactly what grouped-query attention computes). What is not bit-exact:
  SISA's attention path (V zero-padded to d_h + d_s, blockwise log-sum-exp) rounds differently
  from the plain core: 6.5e-7 relative on the suite's tiny Llama; 0 (bit-identical logits) on
  SmolLM2-135M, 512 tokens of tinyshakespeare.
- "fox": Forgetting Attention with RoPE (`fox.rope=True`; a Llama has RoPE), score_ij =
  z_ij + sum_{l=j+1..i} log f_l, log f = log sigmoid(w_f.x + b_f) (fox.py). log sigmoid(b) =
  -softplus(-b) ~ -e^{-b} < 0 for every finite b: not exact. w_f = 0 and b_f = `fox_bias`
  (default 16) make every pair's logit move by -(i - j) e^{-b} (1.1e-7 nats per token of
  distance: 2.3e-4 at 2,048 tokens), the same for every token; measured and printed
  (SmolLM2-135M, 512 tokens of tinyshakespeare: 4.4e-6 relative at b = 16, 2.1e-4 at 12,
  1.1e-2 at 8). The
  gradient to b_f and w_f is e^{-b} times a sum over all pairs of the batch, which Adam
  normalises. FoX's Pro options (QK-norm, output gate, token shift) are off: they have no
  identity setting.

Refused, naming why (`REFUSED`): ALiBi (no RoPE and fixed slopes: no setting of it computes
RoPE attention), softmax1 (a fixed zero logit: the model changes at step 0 by the mass a zero
logit takes), learned sink tokens (a zero sink embedding stays 0 through RMSNorm, so its key
is 0 and its value 0 in every layer: softmax1 again, not the plain model), and every mixer
with no attention to inherit (Mamba-2/3, Sinkhorn's sorted blocks, window attention, head
hybrids).

`to_variant` returns the variant model and a record of what came from the checkpoint, what is
new (with its init), what was expanded, and the measured step-0 distance (max |variant -
plain| / max |plain| over the logits of a probe sequence), which `workdir.write_workdir` puts
in the run's pretrained.json and checkpoint meta.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn_jax import jsonio
from attn_jax.model import abstract_model, build_model
from attn_jax.model_config import ModelConfig
from attn_jax.pretrained.llama import PretrainedError, exportable_problem

VARIANTS = ("attention", "sink_logit", "sisa", "fox")

_NO_ATTENTION = ("has no softmax attention over the full past to inherit the checkpoint's "
                 "q/k/v/o, so no setting of it computes the plain model")
REFUSED = {
    "alibi": ("ALiBi has no RoPE and fixed per-head slopes: no setting of it computes the "
              "RoPE attention the checkpoint was trained with"),
    "softmax1": ("softmax1 fixes the sink logit at 0: every head's output is scaled by "
                 "1 - 1/(1 + sum_j e^{z_ij}) at step 0 (use sink_logit, a learned logit that "
                 "starts far below the scores)"),
    "sink_tokens": ("a learned sink token starting at 0 stays 0 through RMSNorm, so its key and "
                    "value are 0 in every layer: softmax1 at step 0, not the plain model (use "
                    "sink_logit)"),
    "mamba2": f"Mamba-2 {_NO_ATTENTION}",
    "mamba3": f"Mamba-3 {_NO_ATTENTION}",
    "sinkhorn": f"Sinkhorn attention (sorted + local blocks) {_NO_ATTENTION}",
    "window": f"window attention {_NO_ATTENTION}",
    "hybrid_heads": f"the head hybrid {_NO_ATTENTION}",
}


@dataclasses.dataclass(frozen=True)
class VariantInit:
  """The inits with a choice (module docstring): the sink logit's start and FoX's gate bias."""
  sink_init: float = -30.0
  fox_bias: float = 16.0
  sisa_d_state: int = 32


def check_variant(variant: str) -> None:
  if variant in VARIANTS:
    return
  why = REFUSED.get(variant)
  if why:
    raise PretrainedError(f"--mixer={variant}: cannot be converted exactly: {why}")
  raise PretrainedError(f"--mixer={variant}: unknown; offered: {', '.join(VARIANTS)} "
                        f"(refused, with the reason: {', '.join(REFUSED)})")


def variant_config(cfg: ModelConfig, variant: str, init: VariantInit) -> ModelConfig:
  """The plain import's config `cfg` turned into `variant`'s."""
  check_variant(variant)
  if variant == "attention":
    return cfg
  if variant == "sink_logit":
    return cfg.with_options("attention", sink_logit="learned")
  if variant == "sisa":   # one key head per query head (the K/V weights are repeated)
    return cfg.replace(mixer="sisa", n_kv_heads=0).with_options(
        "sisa", d_state=int(init.sisa_d_state))
  return cfg.replace(mixer="fox").with_options("fox", rope=True,
                                               forget_bias_init=float(init.fox_bias))


def _unflat(flat: dict[str, Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    keys = path.split("/")
    for k in keys[:-1]:
      node = node.setdefault(int(k) if k.isdigit() else k, {})
    node[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = v
  return out


MIXER = "blocks/layers/0/mixer/"
# new parameters set to a value rather than kept at the variant's random init: path -> (value
# from the init choices, what the record says about it)
_IDENTITY = {
    "sink_logit": {MIXER + "sink_logit": (lambda i: i.sink_init, "sink_init = {v:g}")},
    "sisa": {MIXER + "c_proj/kernel": (lambda i: 0.0, "0 (C = 0: the state term is exactly 0)")},
    "fox": {MIXER + "fgate/kernel": (lambda i: 0.0, "0 (the gate is the same for every token)"),
            MIXER + "fgate_bias": (lambda i: i.fox_bias, "fox_bias = {v:g}")},
}


def variant_params(plain: dict, cfg: ModelConfig, var_cfg: ModelConfig, variant: str,
                   init: VariantInit, seed: int = 0) -> tuple[dict, dict]:
  """(the variant's pure-dict parameters, record {"from_checkpoint", "expanded", "new"}):
  every array of the plain import copied (K/V heads repeated where the variant has one key
  head per query head), the new ones at the variant's random init (`seed`) or the identity
  value of `_IDENTITY`."""
  fresh = jsonio.flatten(jax.tree.map(np.asarray, nnx.to_pure_dict(
      nnx.state(build_model(var_cfg, seed=seed), nnx.Param))), "/")
  have = jsonio.flatten(jax.tree.map(np.asarray, plain), "/")
  group = cfg.n_heads // cfg.kv_heads
  out, record = {}, {"from_checkpoint": [], "expanded": {}, "new": {}}
  for path, arr in fresh.items():
    if path in have:
      src = np.asarray(have[path], np.float32)
      if src.shape != arr.shape:   # [R, D, K, Dh] -> [R, D, H, Dh]: head h reads K/V h // G
        src = np.repeat(src, group, axis=2)
        record["expanded"][path] = f"{cfg.kv_heads} key/value heads repeated x{group}"
      assert src.shape == arr.shape, (path, src.shape, arr.shape)
      out[path] = src
      record["from_checkpoint"].append(path)
      continue
    value = _IDENTITY.get(variant, {}).get(path)
    if value is not None:
      out[path] = np.full(arr.shape, value[0](init), np.float32)
      record["new"][path] = value[1].format(v=value[0](init))
    else:
      out[path] = np.asarray(arr, np.float32)
      record["new"][path] = f"the variant's init (seed {seed})"
  missing = sorted(set(have) - set(fresh))
  if missing:   # every checkpoint array must land somewhere
    raise AssertionError(f"{variant}: checkpoint arrays with no slot: {missing}")
  return _unflat(out), record


def step0_distance(plain_model, var_model, tokens_BT) -> float:
  """max |variant logits - plain logits| / max |plain logits| on `tokens_BT` (fp32)."""
  a = np.asarray(plain_model(jnp.asarray(tokens_BT)), np.float64)
  b = np.asarray(var_model(jnp.asarray(tokens_BT)), np.float64)
  return float(np.abs(b - a).max() / np.abs(a).max())


def probe_tokens(vocab_size: int, length: int = 128, seed: int = 0) -> np.ndarray:
  """A fixed [2, length] probe of token ids (the distance is measured on it)."""
  return np.random.default_rng(seed).integers(0, vocab_size, (2, length), dtype=np.int32)


def to_variant(model, variant: str, init: VariantInit = VariantInit(), *, seed: int = 0,
               probe=None) -> tuple[Any, dict]:
  """(the variant Decoder, record): `model` (a plain import, `loader.load(...).model`) with
  the variant's new parameters (module docstring); the record adds the variant, its inits and
  the step-0 distance measured on `probe` (default `probe_tokens`; the model's compute dtype)."""
  cfg = model.cfg
  problem = exportable_problem(cfg)
  if problem:
    raise PretrainedError(f"a variant starts from a plain Llama import; this model is not one: "
                          f"{problem}")
  var_cfg = variant_config(cfg, variant, init)
  plain = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params, record = variant_params(plain, cfg, var_cfg, variant, init, seed)
  graphdef, abs_params, rest = nnx.split(abstract_model(var_cfg), nnx.Param, ...)
  nnx.replace_by_pure_dict(abs_params, jax.tree.map(jnp.asarray, params))
  var_model = nnx.merge(graphdef, abs_params, rest)
  probe = probe_tokens(cfg.vocab_size, min(128, cfg.max_seq_len)) if probe is None else probe
  dist = step0_distance(model, var_model, probe)
  record.update(variant=variant, init=dataclasses.asdict(init), seed=seed,
                step0={"rel_logit_diff": dist, "probe_tokens": list(np.shape(probe)),
                       "dtype": cfg.dtype})
  return var_model, record
