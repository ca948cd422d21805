"""Analytic training FLOPs and peak device throughput, for MFU.

Convention (stated once, used everywhere):
- A matmul of an [m, k] by [k, n] is 2*m*k*n FLOPs.
- Parameter matmuls: 2 * N_matmul FLOPs per token forward, where N_matmul is every parameter
  except the token embedding table (a gather, no FLOPs) — plus the LM head (d_model * vocab),
  which is a matmul even when tied.
- Mixer non-parameter work (attention scores/values, scans): the mixer's `flops_per_token`.
  Causal attention counts only the lower triangle that is needed: a token attends on average
  to (L+1)/2 keys. (Kernels that compute the full square do more work than is counted.)
- Training = 3 x forward (backward = 2 x forward); rematerialisation is *not* counted, so MFU
  is model FLOPs utilisation, not hardware FLOPs utilisation.
- Norms, activations, softmax exponentials and RoPE are not counted.
"""

from __future__ import annotations

import jax

from attn_jax.model_config import ModelConfig
from attn_jax.registry import get_mixer

# Dense bf16 peak per device (FLOP/s), from vendor datasheets (no sparsity).
PEAK_FLOPS = {
    "h100": 989e12, "h200": 989e12, "gh200": 989e12, "b200": 2250e12, "a100": 312e12,
    "l4": 121e12, "a10": 125e12, "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12,
    "tpu v5p": 459e12, "tpu v5": 459e12, "tpu v6 lite": 918e12, "tpu v6e": 918e12,
}
# fp32 matmuls at JAX's default precision run as TF32 on these GPUs: dense TF32 tensor-core
# peak (datasheets, no sparsity). TPUs are absent: their fp32 rate depends on the precision
# passes chosen, so no single figure applies.
PEAK_FLOPS_TF32 = {
    "h100": 495e12, "h200": 495e12, "gh200": 495e12, "b200": 1100e12, "a100": 156e12,
    "l4": 60e12, "a10": 62.5e12,
}
_PEAKS_BY_DTYPE = {"bfloat16": PEAK_FLOPS, "float16": PEAK_FLOPS, "float32": PEAK_FLOPS_TF32}


def peak_flops_per_device(device=None, override: float = 0.0,
                          dtype: str = "bfloat16") -> float | None:
  """Datasheet peak FLOP/s of one device for matmuls in `dtype`, or None when unknown (e.g.
  CPU): MFU is then not reported."""
  if override:
    return float(override)
  table = _PEAKS_BY_DTYPE.get(str(dtype), {})
  kind = (device or jax.devices()[0]).device_kind.lower()
  for key in sorted(table, key=len, reverse=True):
    if key in kind:
      return table[key]
  return None


def forward_flops_per_token(cfg: ModelConfig, n_params: dict[str, int], seq_len: int) -> float:
  head = cfg.d_model * cfg.vocab_size
  # non_embedding excludes the embedding table and an untied head; the head matmul is added
  # once. (It also holds norm scales and per-head scalars: < 0.1% of N, counted as matmul.)
  dense = 2.0 * (n_params["non_embedding"] + head)
  mixer = sum(get_mixer(spec.mixer).flops_per_token(cfg, cfg.options_for(spec.mixer), seq_len)
              for spec in cfg.layer_specs)
  return dense + mixer


def train_flops_per_token(cfg: ModelConfig, n_params: dict[str, int], seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, n_params, seq_len)
