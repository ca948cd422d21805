"""Name -> token-mixer class. Adding a variant = one new module that registers itself + a config.

A mixer is an `nnx.Module` built as `cls(cfg: ModelConfig, *, rngs)` and called as

    y, new_cache, aux = mixer(x_BTD, positions=positions_BT, cache=cache, cache_index=idx)

- `positions` [B, T] int32: absolute token positions (RoPE, decay offsets, masks).
- `cache`: None for a full forward; else this layer's decoding state (a pytree of fixed-shape
  arrays made by `cls.init_cache(cfg, batch, max_len, dtype)`), and `cache_index` (int32
  scalar) is how many tokens it already holds. The mixer returns the updated state.
- `aux`: a dict of scalars to monitor (e.g. SISA's lambda); the decoder stacks them over layers.

Class-level hooks the trainer/evaluator use (they never branch on a mixer's name):
- `init_cache(cfg, batch, max_len, dtype) -> pytree`
- `flops_per_token(cfg, seq_len) -> float`: forward FLOPs per token of the mixer's
  *non-parameter* work (attention scores and values, scans); parameter matmuls are counted from
  the parameter count (see train/flops.py).
- `optimizer_overrides` (optional class attribute): {parameter name: {"lr_mult": float,
  "weight_decay": bool}} for parameters that need their own learning rate or no decay (e.g.
  SISA's `lambda_raw`: lr x0.1, no decay). Matched on the last component of the parameter path.
- `validate(cfg)` (optional staticmethod): raise ValueError naming `config.model.<field>`.
"""

from __future__ import annotations

from typing import Callable

_MIXERS: dict[str, type] = {}


def register_mixer(name: str) -> Callable[[type], type]:
  def deco(cls: type) -> type:
    if name in _MIXERS and _MIXERS[name] is not cls:
      raise ValueError(f"mixer {name!r} is already registered by {_MIXERS[name].__module__}")
    _MIXERS[name] = cls
    cls.mixer_name = name
    return cls
  return deco


def _import_builtin_mixers() -> None:
  # Importing the modules registers them. Keep this list in one place.
  import importlib
  for mod in ("attn_jax.attention.mha", "attn_jax.attention.sisa"):
    try:
      importlib.import_module(mod)
    except ModuleNotFoundError as e:
      if e.name != mod:
        raise


def get_mixer(name: str) -> type:
  _import_builtin_mixers()
  if name not in _MIXERS:
    raise ValueError(f"config.model.mixer: unknown mixer {name!r}; registered mixers: "
                     f"{', '.join(sorted(_MIXERS))}")
  return _MIXERS[name]


def available_mixers() -> list[str]:
  _import_builtin_mixers()
  return sorted(_MIXERS)
