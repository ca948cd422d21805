"""The model's typed config: `ModelConfig`, its layer pattern and its mixers' options.

`ModelConfig` is a frozen, hashable dataclass (it becomes static structure of the NNX graph);
`ModelConfig.from_config(config.model)` builds it from the ConfigDict's model section (each
mixer's `Options` from its sub-dict) and `validate_model` checks it, with errors naming the
field. Its field defaults are the run's model defaults (`attn_jax.config.default_config` builds
the ConfigDict's model section from them). The other sections of a run are `attn_jax.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from attn_jax.field_checks import check_fields, field_check, is_int, is_number
from attn_jax.kernel_choice import ATTENTION_IMPLS
from attn_jax.registry import get_mixer


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer of the pattern: a mixer (registry name) and whether the block has an MLP."""
  mixer: str
  mlp: bool = True

  @classmethod
  def parse(cls, spec: str) -> "LayerSpec":
    """ "mixer" or "mixer:nomlp" (a block without the SwiGLU, e.g. a Mamba block)."""
    name, _, flag = str(spec).partition(":")
    if flag not in ("", "nomlp") or not name:
      raise ValueError(f"config.model.pattern: bad layer spec {spec!r} (use 'mixer' or "
                       "'mixer:nomlp')")
    return cls(name, flag != "nomlp")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's shape. `pattern` is the repeating period of layer specs (n_layers must be a
  multiple of its length); empty means `(mixer,)`, today's homogeneous stack. `options` holds
  each mixer's `Options` instance (defaults from the mixer module, overridden by the config's
  `model.<mixer>` sub-dict); read them with `cfg.options_for(name)`."""
  mixer: str = "attention"
  pattern: tuple[str, ...] = ()
  vocab_size: int = 50277
  vocab_multiple: int = 128      # the embedding/head tables are padded to a multiple of this
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
  embed_init_std: float = 0.0    # std of the token table's N(0, s) draw; 0 = init_std
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  attention_impl: str = "auto"
  sink_tokens: int = 0           # learnable sink tokens prepended to every sequence (model.py)
  options: tuple[tuple[str, Any], ...] = ()   # (mixer name, its Options instance)

  @property
  def embed_std(self) -> float:
    """The token table's init std: `embed_init_std`, or `init_std` when that is 0."""
    return float(self.embed_init_std or self.init_std)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def period(self) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec.parse(s) for s in (self.pattern or (self.mixer,)))

  @property
  def n_repeats(self) -> int:
    return self.n_layers // len(self.period)

  @property
  def layer_specs(self) -> tuple[LayerSpec, ...]:
    """All n_layers specs in order (the period repeated)."""
    return self.period * self.n_repeats

  def options_for(self, mixer: str):
    for k, v in self.options:
      if k == mixer:
        return v
    return get_mixer(mixer).Options()

  @classmethod
  def from_config(cls, m: ml_collections.ConfigDict) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)} - {"options"}
    kw, subs = {}, {}
    for key, val in m.items():
      if key in fields:
        kw[key] = tuple(val) if key == "pattern" else val
      elif isinstance(val, ml_collections.ConfigDict):
        subs[key] = val.to_dict()
      else:
        raise ValueError(f"config.model.{key}: unknown field (known: {', '.join(sorted(fields))})")
    check_fields(cls, kw, "config.model")   # 3.0 layers, "64" for d_model: named here
    cfg = cls(**kw, options=tuple(sorted((k, make_options(k, v)) for k, v in subs.items())))
    validate_model(cfg)
    return cfg

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def with_options(self, mixer: str, **overrides) -> "ModelConfig":
    """A copy whose `mixer` options have these fields replaced (validated)."""
    opts = dataclasses.replace(self.options_for(mixer), **overrides)
    rest = tuple((k, v) for k, v in self.options if k != mixer)
    cfg = self.replace(options=tuple(sorted(rest + ((mixer, opts),))))
    validate_model(cfg)
    return cfg


def make_options(mixer: str, values: dict):
  """The mixer's Options from a config sub-dict; unknown names are errors naming the field."""
  try:
    opt_cls = get_mixer(mixer).Options
  except ValueError:
    raise ValueError(f"config.model.{mixer}: not a field and not a registered mixer") from None
  known = {f.name for f in dataclasses.fields(opt_cls)}
  for k in values:
    if k not in known:
      raise ValueError(f"config.model.{mixer}.{k}: unknown option (known: "
                       f"{', '.join(sorted(known))})")
  vals = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()}
  check_fields(opt_cls, vals, f"config.model.{mixer}")
  return opt_cls(**vals)


_REMAT = ("none", "full", "dots", "dots_no_batch")


def validate_model(cfg: ModelConfig) -> None:
  need = field_check("config.model")
  for f in ("vocab_size", "vocab_multiple", "d_model", "n_layers", "n_heads", "max_seq_len"):
    need(int(getattr(cfg, f)) > 0, f, f"must be a positive integer, got {getattr(cfg, f)!r}")
  need(cfg.d_model % cfg.n_heads == 0, "d_model",
       f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
  need(cfg.head_dim % 2 == 0, "n_heads", f"head_dim={cfg.head_dim} must be even for RoPE")
  need(cfg.n_kv_heads >= 0 and cfg.n_heads % cfg.kv_heads == 0, "n_kv_heads",
       f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads}")
  need(cfg.remat in _REMAT, "remat", f"{cfg.remat!r} not in {_REMAT}")
  need(cfg.attention_impl in ATTENTION_IMPLS, "attention_impl",
       f"{cfg.attention_impl!r} not in {ATTENTION_IMPLS}")
  for f in ("dtype", "param_dtype"):
    need(getattr(cfg, f) in ("float32", "bfloat16", "float16"), f,
         f"{getattr(cfg, f)!r} not in (float32, bfloat16, float16)")
  need(is_number(cfg.embed_init_std, 0), "embed_init_std",
       f"must be a number >= 0 (0 = init_std), got {cfg.embed_init_std!r}")
  need(cfg.d_ff >= 0, "d_ff", f"must be >= 0 (0 = no MLP), got {cfg.d_ff}")
  need(is_int(cfg.sink_tokens, 0), "sink_tokens",
       f"must be an integer >= 0 (0 = none), got {cfg.sink_tokens!r}")
  need(not (cfg.pattern and cfg.mixer != "attention"), "pattern",
       f"set either model.mixer ({cfg.mixer!r}) or model.pattern ({cfg.pattern!r}), not both")
  period = cfg.period   # parses every spec
  need(cfg.n_layers % len(period) == 0, "n_layers",
       f"n_layers={cfg.n_layers} is not a multiple of the pattern's period {len(period)} "
       f"({cfg.pattern})")
  for spec in period:
    try:
      mixer_cls = get_mixer(spec.mixer)
    except ValueError as e:
      field = "pattern" if cfg.pattern else "mixer"
      raise ValueError(f"config.model.{field}: {e}") from None
    opts = cfg.options_for(spec.mixer)
    if not isinstance(opts, mixer_cls.Options):
      raise ValueError(f"config.model.{spec.mixer}: options of type {type(opts).__name__}, "
                       f"expected {mixer_cls.__name__}.Options")
    if hasattr(opts, "validate"):
      opts.validate(cfg, f"config.model.{spec.mixer}")


def seq_len_problem(max_seq_len: int, length: int, what: str) -> str | None:
  """The one rule for every entry point (decode.generate, streaming windows, NIAH contexts): a
  single forward pass sees at most `model.max_seq_len` tokens, the longest the model was built
  and trained for. None when `length` is within it, else the message."""
  if int(length) <= int(max_seq_len):
    return None
  return (f"{what}: {int(length)} tokens is longer than the model's max_seq_len="
          f"{int(max_seq_len)} (config.model.max_seq_len)")


def check_seq_len(max_seq_len: int, length: int, what: str) -> None:
  """ValueError (see `seq_len_problem`) when `length` exceeds `max_seq_len`."""
  problem = seq_len_problem(max_seq_len, length, what)
  if problem:
    raise ValueError(problem)
