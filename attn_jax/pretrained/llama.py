"""The Llama architecture as attn_jax's Transformer baseline, and its weights both ways.

A Llama decoder (Touvron et al. 2023; Hugging Face `LlamaForCausalLM`) is, layer by layer,

    h = x + o(attn(RoPE(q(n1(x))), RoPE(k(n1(x))), v(n1(x))))     n1, n2: RMSNorm
    y = h + down(silu(gate(n2(h))) * up(n2(h)))

with a final RMSNorm and an LM head (tied to the embedding or not): exactly `model.Decoder` with
`mixer="attention"`, no pattern, no sink tokens and `sink_logit="none"`. Term by term:

- RMSNorm: HF computes x32 * rsqrt(mean(x32^2) + eps) in fp32, casts to the input dtype and
  multiplies by the weight; `layers.RMSNorm` multiplies by the scale in fp32 and casts after.
  In fp32 the two are the same expression; in bf16 they differ by one rounding of the product.
- RoPE: HF's `rotate_half` pairs channel j with j + d/2 (the NeoX "half-split" layout), the
  layout of `layers.apply_rope`; the frequencies theta^(-2j/d) are the same. (llama.cpp stores
  q/k rows permuted for its interleaved layout: `gguf.py` undoes that before it gets here.)
- Attention: softmax(q k^T / sqrt(head_dim)) with grouped K/V heads (head h reads K/V head
  h // (H / K)), as `kernels/dense.py`. attn_jax has head_dim = d_model / n_heads, so a
  checkpoint with another head_dim does not map.
- Projections: a torch `Linear` weight is [out, in]; attn_jax's `Linear` kernel is
  [*in, *out] with the head axes split out: q [D, H, Dh], k/v [D, K, Dh], o [H, Dh, D],
  gate/up [D, F], down [F, D]. Every layer's arrays are stacked on a leading `layers` axis
  (`model.py` scans the repeats of a period of one layer).
- Vocabulary: the embedding table is padded with zero rows to a multiple of `vocab_multiple`
  (never looked up; their logits are sliced off) and the padding is dropped on export.

What has no counterpart is refused with a message naming the checkpoint field: biases on the
attention or MLP projections, a norm other than RMSNorm (LayerNorm, Gemma's 1 + w), an
activation other than SiLU, RoPE scaling (linear, dynamic, YaRN, Llama-3's frequency bands),
partial rotary dimensions, sliding windows, mixture-of-experts layers.

The exchange format between the readers (`gguf.py`, `hf.py`) and this module is a `LlamaSpec`
(the hyper-parameters) and a flat dict of numpy arrays under Hugging Face's tensor names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np

from attn_jax.model import padded_vocab
from attn_jax.model_config import LayerSpec, ModelConfig
from attn_jax.registry import get_mixer


class PretrainedError(ValueError):
  """A checkpoint that cannot be read or mapped; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
  """A Llama checkpoint's hyper-parameters (Hugging Face's names in the comments)."""
  vocab_size: int            # vocab_size (rows of the embedding table)
  d_model: int               # hidden_size
  n_layers: int              # num_hidden_layers
  n_heads: int               # num_attention_heads
  n_kv_heads: int            # num_key_value_heads
  head_dim: int              # head_dim
  d_ff: int                  # intermediate_size
  max_seq_len: int           # max_position_embeddings
  rope_theta: float          # rope_parameters.rope_theta
  norm_eps: float            # rms_norm_eps
  tie_embeddings: bool       # tie_word_embeddings
  bos_id: int | None = None  # bos_token_id
  eos_id: int | None = None  # eos_token_id


def check_spec(spec: LlamaSpec, source: str, field: Mapping[str, str]) -> None:
  """The hyper-parameters attn_jax can hold; `field` maps a LlamaSpec name to the
  checkpoint's own key, so the message names what the user can look up."""
  def need(cond, name, msg):
    if not cond:
      raise PretrainedError(f"{source}: {field.get(name, name)}: {msg}")
  for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
               "d_ff", "max_seq_len"):
    need(int(getattr(spec, name)) > 0, name, f"must be a positive integer, got "
         f"{getattr(spec, name)!r}")
  need(spec.n_heads % spec.n_kv_heads == 0, "n_kv_heads",
       f"{spec.n_heads} query heads are not a multiple of {spec.n_kv_heads} key/value heads")
  need(spec.head_dim * spec.n_heads == spec.d_model, "head_dim",
       f"head_dim={spec.head_dim} with {spec.n_heads} heads is not d_model={spec.d_model}: "
       "attn_jax's attention has head_dim = d_model / n_heads")
  need(spec.head_dim % 2 == 0, "head_dim", f"{spec.head_dim} must be even for RoPE")
  need(spec.rope_theta > 0, "rope_theta", f"must be positive, got {spec.rope_theta!r}")
  need(spec.norm_eps > 0, "norm_eps", f"must be positive, got {spec.norm_eps!r}")


def model_config(spec: LlamaSpec, *, dtype: str = "float32",
                 vocab_multiple: int = 128) -> ModelConfig:
  """The attn_jax model config of a Llama checkpoint (fp32 parameters, `dtype` compute)."""
  return ModelConfig(
      mixer="attention", vocab_size=spec.vocab_size, vocab_multiple=vocab_multiple,
      d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads,
      n_kv_heads=spec.n_kv_heads, d_ff=spec.d_ff, max_seq_len=spec.max_seq_len,
      rope_theta=float(spec.rope_theta), tie_embeddings=bool(spec.tie_embeddings),
      norm_eps=float(spec.norm_eps), dtype=dtype, param_dtype="float32")


# ------------------------------------------------------------------ HF names -> parameters

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# per-layer HF tensor -> (path under blocks/layers/0, how to reshape the transposed weight)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("mixer_norm/scale", None),
    "post_attention_layernorm.weight": ("mlp_norm/scale", None),
    "self_attn.q_proj.weight": ("mixer/proj/q/kernel", "q"),
    "self_attn.k_proj.weight": ("mixer/proj/k/kernel", "kv"),
    "self_attn.v_proj.weight": ("mixer/proj/v/kernel", "kv"),
    "self_attn.o_proj.weight": ("mixer/proj/o/kernel", "o"),
    "mlp.gate_proj.weight": ("mlp/gate/kernel", "t"),
    "mlp.up_proj.weight": ("mlp/up/kernel", "t"),
    "mlp.down_proj.weight": ("mlp/down/kernel", "t"),
}
_TOP_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# Tensors some Llama exports carry that hold no weights (RoPE caches).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _unknown_tensor(name: str) -> str:
  if name.endswith(".bias"):
    return "a bias; attn_jax's Llama projections and norms have none (attention_bias / mlp_bias)"
  if "experts" in name or "router" in name or ".gate." in name:
    return "a mixture-of-experts tensor; attn_jax's Llama MLP is one dense SwiGLU"
  return "not a tensor of a Llama decoder"


def _expected_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
  D, H, K, Dh, F = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff
  return {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
          "self_attn.q_proj.weight": (H * Dh, D), "self_attn.k_proj.weight": (K * Dh, D),
          "self_attn.v_proj.weight": (K * Dh, D), "self_attn.o_proj.weight": (D, H * Dh),
          "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D),
          "mlp.down_proj.weight": (D, F)}


def _to_kernel(w: np.ndarray, how: str | None, spec: LlamaSpec) -> np.ndarray:
  """A torch [out, in] weight -> attn_jax's kernel layout (module docstring)."""
  D, H, K, Dh = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
  if how is None:
    return w
  if how == "q":
    return w.T.reshape(D, H, Dh)
  if how == "kv":
    return w.T.reshape(D, K, Dh)
  if how == "o":
    return w.T.reshape(H, Dh, D)
  return w.T


def _set(tree: dict, path: str, value) -> None:
  keys = path.split("/")
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def params_from_hf(tensors: Mapping[str, np.ndarray], spec: LlamaSpec, cfg: ModelConfig,
                   source: str) -> dict:
  """Hugging Face-named arrays -> the pure-dict parameters of `model.Decoder(cfg)` (fp32).
  Every tensor is accounted for: an unknown, missing or misshapen one is a PretrainedError
  naming it and `source`."""
  per_layer, top = _sort_tensors(tensors, spec, source)
  params = _top_params(top, spec, cfg, source)
  block: dict = {}
  for key, (path, how) in _LAYER_TENSORS.items():
    stacked = np.stack([_to_kernel(_f32(a), how, spec) for a in per_layer[key]])
    _set(block, path, stacked)
  params["blocks"] = {"layers": {0: block}}
  return params


def _sort_tensors(tensors, spec: LlamaSpec, source: str):
  """({per-layer name: [array of layer i]}, {top-level name: array}), every layer complete."""
  want = _expected_shapes(spec)
  per_layer: dict[str, list] = {k: [None] * spec.n_layers for k in want}
  top: dict[str, np.ndarray] = {}
  for name, arr in tensors.items():
    m = _LAYER.fullmatch(name)
    if _IGNORED.fullmatch(name):
      continue
    if m and m.group(2) in want:
      if int(m.group(1)) >= spec.n_layers:
        raise PretrainedError(f"{source}: tensor {name}: layer {m.group(1)} of a model with "
                              f"{spec.n_layers} layers (num_hidden_layers / block_count)")
      _check_shape(name, arr, want[m.group(2)], source)
      per_layer[m.group(2)][int(m.group(1))] = arr
    elif name in _TOP_TENSORS:
      top[name] = arr
    else:
      raise PretrainedError(f"{source}: tensor {name}: {_unknown_tensor(name)}")
  for key, arrs in per_layer.items():
    missing = [i for i, a in enumerate(arrs) if a is None]
    if missing:
      raise PretrainedError(f"{source}: tensor model.layers.{missing[0]}.{key} is missing "
                            f"({len(missing)} of {spec.n_layers} layers lack it)")
  return per_layer, top


def _top_params(top: dict, spec: LlamaSpec, cfg: ModelConfig, source: str) -> dict:
  """embed (padded), final_norm and the untied head; the tying checked against the tensors."""
  V, D = spec.vocab_size, spec.d_model
  for name, shape in (("model.embed_tokens.weight", (V, D)), ("model.norm.weight", (D,))):
    if name not in top:
      raise PretrainedError(f"{source}: tensor {name} is missing")
    _check_shape(name, top[name], shape, source)
  vp = padded_vocab(cfg)
  params = {"embed": _pad_rows(top["model.embed_tokens.weight"], vp),
            "final_norm": {"scale": _f32(top["model.norm.weight"])}}
  head = top.get("lm_head.weight")
  if not spec.tie_embeddings:
    if head is None:
      raise PretrainedError(f"{source}: tensor lm_head.weight is missing and the embeddings "
                            "are not tied (tie_word_embeddings is false)")
    _check_shape("lm_head.weight", head, (V, D), source)
    params["head"] = _pad_rows(head, vp).T.copy()
  elif head is not None and not np.array_equal(head, top["model.embed_tokens.weight"]):
    raise PretrainedError(f"{source}: tensor lm_head.weight differs from the embedding but "
                          "tie_word_embeddings is true")
  return params


def _f32(a: np.ndarray) -> np.ndarray:
  return np.asarray(a, dtype=np.float32)


def _pad_rows(w: np.ndarray, rows: int) -> np.ndarray:
  w = _f32(w)
  if w.shape[0] == rows:
    return w
  return np.concatenate([w, np.zeros((rows - w.shape[0],) + w.shape[1:], np.float32)])


def _check_shape(name: str, arr, shape: tuple[int, ...], source: str) -> None:
  if tuple(arr.shape) != tuple(shape):
    raise PretrainedError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, the config "
                          f"implies {tuple(shape)}")


# ------------------------------------------------------------------ parameters -> HF names


def exportable_problem(cfg: ModelConfig) -> str | None:
  """Why a model has no Llama equivalent (None when it has one): every layer plain softmax
  attention with a SwiGLU, no learned sink tokens, no sink logit."""
  if cfg.period != (LayerSpec("attention", True),):
    kinds = sorted({s.mixer + ("" if s.mlp else ":nomlp") for s in cfg.period})
    return (f"config.model.mixer/pattern: layers of kind {', '.join(kinds)}; a Llama decoder "
            "is plain softmax attention + SwiGLU in every layer (mixer='attention', no pattern)")
  if cfg.d_ff <= 0:
    return "config.model.d_ff: 0 (no MLP); every Llama layer has a SwiGLU"
  if cfg.sink_tokens:
    return (f"config.model.sink_tokens: {cfg.sink_tokens} learned sink tokens prepended to "
            "every sequence have no Llama counterpart")
  opts = cfg.options_for("attention")
  if opts != get_mixer("attention").Options():
    return (f"config.model.attention: {opts} differs from plain attention (a sink logit has no "
            "Llama counterpart)")
  return None


def params_to_hf(params: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`: Hugging Face-named fp32 arrays (padding rows dropped)."""
  V, D = cfg.vocab_size, cfg.d_model
  H, K, Dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
  block = params["blocks"]["layers"][0]
  get = lambda path: np.asarray(_get(block, path), np.float32)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32)[:V],
         "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32)}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.asarray(params["head"], np.float32)[:, :V].T
  inverse = {"q": lambda w: w.reshape(D, H * Dh).T, "kv": lambda w: w.reshape(D, K * Dh).T,
             "o": lambda w: w.reshape(H * Dh, D).T, "t": lambda w: w.T, None: lambda w: w}
  for key, (path, how) in _LAYER_TENSORS.items():
    stacked = get(path)
    for i in range(cfg.n_layers):
      out[f"model.layers.{i}.{key}"] = inverse[how](stacked[i])
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _get(tree, path: str):
  for k in path.split("/"):
    tree = tree[k]
  return tree
