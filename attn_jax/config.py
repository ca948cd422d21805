"""Typed, validated views of the ml-collections config.

`ModelConfig` is a frozen, hashable dataclass (it becomes static structure of the NNX graph);
`validate(config)` checks the whole ConfigDict in one place, with errors naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class Options:
  """A frozen attribute bag for mixer-specific options (e.g. `cfg.sisa.d_state`)."""
  items: tuple[tuple[str, Any], ...] = ()

  def __getattr__(self, name):
    for k, v in object.__getattribute__(self, "items"):
      if k == name:
        return v
    raise AttributeError(f"option {name!r} not set (have: {[k for k, _ in self.items]})")

  def to_dict(self) -> dict:
    return dict(self.items)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  mixer: str = "attention"
  vocab_size: int = 50277
  d_model: int = 768
  n_layers: int = 12
  n_heads: int = 12
  n_kv_heads: int = 0
  d_ff: int = 3072
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  norm_eps: float = 1e-5
  init_std: float = 0.02
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  attention_impl: str = "auto"
  options: tuple[tuple[str, Options], ...] = ()   # mixer sub-dicts, e.g. ("sisa", Options(...))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  def __getattr__(self, name):  # cfg.sisa -> Options
    for k, v in object.__getattribute__(self, "options"):
      if k == name:
        return v
    raise AttributeError(name)

  @classmethod
  def from_config(cls, m: ml_collections.ConfigDict) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)} - {"options"}
    kw, opts = {}, []
    for key, val in m.items():
      if key in fields:
        kw[key] = val
      elif isinstance(val, ml_collections.ConfigDict):
        opts.append((key, Options(tuple(sorted(val.to_dict().items())))))
      else:
        raise ValueError(f"config.model.{key}: unknown field")
    cfg = cls(**kw, options=tuple(sorted(opts)))
    validate_model(cfg)
    return cfg

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


_REMAT = ("none", "full", "dots", "dots_no_batch")


def validate_model(cfg: ModelConfig) -> None:
  from attn_jax.registry import get_mixer

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f"config.model.{field}: {msg}")

  for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
    need(int(getattr(cfg, f)) > 0, f, f"must be a positive integer, got {getattr(cfg, f)!r}")
  need(cfg.d_model % cfg.n_heads == 0, "d_model",
       f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
  need(cfg.head_dim % 2 == 0, "n_heads", f"head_dim={cfg.head_dim} must be even for RoPE")
  need(cfg.n_kv_heads >= 0 and cfg.n_heads % cfg.kv_heads == 0, "n_kv_heads",
       f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads}")
  need(cfg.remat in _REMAT, "remat", f"{cfg.remat!r} not in {_REMAT}")
  need(cfg.attention_impl in ("auto", "einsum", "xla", "cudnn"), "attention_impl",
       f"{cfg.attention_impl!r} not in (auto, einsum, xla, cudnn)")
  for f in ("dtype", "param_dtype"):
    need(getattr(cfg, f) in ("float32", "bfloat16", "float16"), f,
         f"{getattr(cfg, f)!r} not in (float32, bfloat16, float16)")
  mixer_cls = get_mixer(cfg.mixer)  # raises a clear error for unknown names
  if hasattr(mixer_cls, "validate"):
    mixer_cls.validate(cfg)


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
  """Check the whole config; returns the typed model config."""
  cfg = ModelConfig.from_config(config.model)
  d, t, o = config.data, config.train, config.optim

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f"config.{field}: {msg}")

  need(d.seq_len > 0, "data.seq_len", "must be positive")
  need(d.seq_len <= cfg.max_seq_len, "data.seq_len",
       f"{d.seq_len} exceeds model.max_seq_len={cfg.max_seq_len}")
  need(d.global_batch_size > 0, "data.global_batch_size", "must be positive")
  need(t.steps > 0, "train.steps", "must be positive")
  need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
  need(t.log_every >= 1, "train.log_every", "must be >= 1")
  need(o.lr > 0, "optim.lr", "must be positive")
  need(0 <= o.warmup_steps, "optim.warmup_steps", "must be >= 0")
  need(config.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  need(len(config.mesh.shape) == len(config.mesh.axis_names), "mesh.shape",
       f"{config.mesh.shape} does not match mesh.axis_names {config.mesh.axis_names}")
  return cfg
