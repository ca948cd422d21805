"""attn_jax.bench.roofline: measured peak and bandwidth, MFU, decode bytes and bound; the
datasheet peaks by dtype (train/flops.py)."""

import math
import types

import pytest

from attn_jax.bench import roofline
from attn_jax.model import build_model, count_params
from attn_jax.model_config import ModelConfig
from attn_jax.registry import available_mixers
from attn_jax.train import flops
from tests.test_trunk import _cfg


def _transformer(**kw):
  base = dict(vocab_size=61, d_model=32, n_heads=4, d_ff=48, max_seq_len=64, dtype="float32",
              pattern=("attention",), n_layers=2)
  return ModelConfig(**dict(base, **kw))


def test_measured_peak_and_bandwidth_are_positive_and_finite():
  peak = roofline.matmul_peak("float32", n=128, repeats=2)
  bw = roofline.copy_bandwidth(nbytes=2 ** 20, repeats=2, passes=2)
  assert math.isfinite(peak) and peak > 0
  assert math.isfinite(bw) and bw > 0


def test_mfu_and_bound_formulas():
  assert roofline.mfu(100.0, 1e9, 1e12, n_devices=2) == pytest.approx(0.05)
  assert roofline.mfu(100.0, 1e9, None) is None
  # 2 rows, 1 MB per step at 1 GB/s: 1000 steps/s, 2000 tokens/s
  assert roofline.decode_bound_tok_s(1e6, 2, 1e9) == pytest.approx(2000.0)


def test_decode_bytes_from_known_parameter_counts():
  cfg = _transformer()
  n = count_params(cfg)
  d, L, f, V = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
  non_embedding = L * (4 * d * d + 3 * d * f + 2 * d) + d   # q,k,v,o + SwiGLU + 2 norms; final
  assert n["non_embedding"] == non_embedding
  one = roofline.decode_bytes(cfg, n, batch=1, capacity=16)
  assert one["params"] == (non_embedding + d * V) * 4                      # fp32 parameters
  assert one["state"] >= 2 * L * 16 * cfg.n_heads * cfg.head_dim * 4    # at least K and V
  half = _transformer(param_dtype="bfloat16")
  assert roofline.decode_bytes(half, n, 1, 16)["params"] == one["params"] // 2
  assert one["total"] == one["params"] + one["state"]


@pytest.mark.parametrize("tie", [True, False])
def test_decode_param_bytes_count_the_weights_as_the_decoding_copy_holds_them(tie):
  """fp32 model: the formula's count; bf16 compute on fp32 parameters: every weight matrix at
  2 bytes (`Decoder.for_decoding`), norms at 4, the head's d x V once."""
  n = count_params(_transformer(tie_embeddings=tie))
  fp32 = _transformer(tie_embeddings=tie)
  assert roofline.decode_param_bytes(build_model(fp32, seed=0)) == \
      roofline.decode_bytes(fp32, n, 1, 16)["params"]
  cfg = _transformer(tie_embeddings=tie, dtype="bfloat16")
  d, L = cfg.d_model, cfg.n_layers
  norms = 2 * L * d + d
  want = (n["non_embedding"] - norms) * 2 + norms * 4 + d * cfg.vocab_size * 2
  assert roofline.decode_param_bytes(build_model(cfg, seed=0)) == want


@pytest.mark.parametrize("mixer", available_mixers())
def test_decode_state_bytes_are_per_row(mixer):
  """The bound's B x state-per-row: every mixer's decoding state scales with the batch."""
  cfg = _cfg((mixer,))
  n = count_params(cfg)
  one, four = (roofline.decode_bytes(cfg, n, b, capacity=16) for b in (1, 4))
  assert four["params"] == one["params"]
  assert four["state"] == 4 * one["state"] > 0


def test_decode_row_measures_and_relates_to_the_bound():
  cfg = _transformer()
  row = roofline.decode_row(build_model(cfg, seed=0), count_params(cfg), batch=2,
                            prompt_len=5, steps=3, bandwidth=1e10)
  assert row["capacity"] == 8 and row["tok_s"] > 0
  assert row["ratio"] == pytest.approx(row["tok_s"] / row["bound_tok_s"])
  assert row["bound_tok_s"] == pytest.approx(2 * 1e10 / (row["param_bytes"] + row["state_bytes"]))


def test_datasheet_peak_by_device_kind_and_dtype():
  h200 = types.SimpleNamespace(device_kind="NVIDIA H200")
  assert flops.peak_flops_per_device(h200) == 989e12                       # bf16 default
  assert flops.peak_flops_per_device(h200, dtype="float32") == 495e12      # TF32
  cpu = types.SimpleNamespace(device_kind="cpu")
  assert flops.peak_flops_per_device(cpu, dtype="float32") is None
  tpu = types.SimpleNamespace(device_kind="TPU v5 lite")
  assert flops.peak_flops_per_device(tpu, dtype="float32") is None
  assert flops.peak_flops_per_device(cpu, override=1e12) == 1e12
