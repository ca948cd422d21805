"""A Llama with a learned per-head sink logit (`attention.sink_logit="learned"`, e.g. a
converted `sink_logit` variant after fine-tuning) as a Hugging Face `GraniteSWAForCausalLM`,
the one transformers model (5.x) that is a dense Llama plus per-head sinks.

GraniteSWA's layer is Llama's (RMSNorm, RoPE, grouped-query attention, SiLU SwiGLU, the same
tensor names) with:
- multipliers on the embedding, the residual branches, the attention scores and the logits:
  written as 1, 1, 1/sqrt(head_dim) (Llama's scale) and 1;
- per-layer sliding windows and RoPE bases: `layer_types` all "full_attention" (its
  `sliding_window` must still be set: max_seq_len, used by no layer), `layer_rope_theta` the
  model's theta in every layer;
- `self_attn.sinks` [H] per layer, applied after the softmax as
  y_i <- y_i * sigmoid(lse_i - s_h), lse_i = log sum_j e^{z_ij}: that is
  sum_j e^{z_ij} / (sum_j e^{z_ij} + e^{s_h}), exactly the extra softmax column with a zero
  value of `attention/projection.py`. So the written model computes ours.
GraniteSWA has no SDPA path (its sinks need the eager, flex or flash kernels): load it with
`attn_implementation="eager"` on CPU.

Every other variant has no transformers counterpart and is refused by `loader.export_hf`
with `llama.exportable_problem`'s reason; GGUF export of a sink logit is refused too (the
llama architecture of llama.cpp has no sinks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attn_jax.model_config import ModelConfig
from attn_jax.pretrained.hf import hf_config as llama_config
from attn_jax.pretrained.llama import LlamaSpec, exportable_problem, params_to_hf
from attn_jax.registry import get_mixer

SINK_PARAM = "mixer/sink_logit"


def holds(cfg: ModelConfig) -> bool:
  """Whether `cfg` is a plain Llama but for a learned sink logit."""
  if exportable_problem(cfg) is None:
    return False
  plain = cfg.with_options("attention", sink_logit="none")
  return (cfg.options_for("attention") == get_mixer("attention").Options(sink_logit="learned")
          and exportable_problem(plain) is None)


def hf_config(spec: LlamaSpec) -> dict[str, Any]:
  """The `config.json` of a GraniteSWAForCausalLM computing the Llama + sinks of `spec`."""
  c = llama_config(spec)
  for key in ("pretraining_tp", "rope_scaling", "rope_theta"):
    c.pop(key)
  c.update(architectures=["GraniteSWAForCausalLM"], model_type="granite_swa",
           embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
           attention_multiplier=float(spec.head_dim) ** -0.5,
           sliding_window=spec.max_seq_len,   # no layer slides; the model builds the mask
           layer_types=["full_attention"] * spec.n_layers,
           layer_rope_theta=[float(spec.rope_theta)] * spec.n_layers)
  return c


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Llama's tensors (`llama.params_to_hf`) plus `model.layers.<i>.self_attn.sinks`."""
  out = params_to_hf(params, cfg)
  sinks = np.asarray(params["blocks"]["layers"][0]["mixer"]["sink_logit"], np.float32)
  for i in range(cfg.n_layers):
    out[f"model.layers.{i}.self_attn.sinks"] = np.ascontiguousarray(sinks[i])
  return out
