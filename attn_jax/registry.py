"""Name -> token-mixer class. Adding a variant = one new module that registers itself + a config.

Every module under `attn_jax/attention/` and `attn_jax/ssm/` is imported on the first lookup
(`pkgutil` over the two packages), so `@register_mixer("name")` on the class is all a new
variant needs: there is no hand-written list.

A mixer is an `nnx.Module` with this interface (the decoder, trainer, decoding and evaluator
only ever use it; none of them branches on a mixer's name):

    class Mixer(nnx.Module):
      @dataclasses.dataclass(frozen=True)
      class Options:                       # defaults, in this one place
        ...
        def validate(self, cfg, where): ...  # raise ValueError(f"{where}.<field>: ...")

      def __init__(self, cfg: ModelConfig, opts: Options, *, rngs: nnx.Rngs)
      def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
                   train=False)
          -> (y_BTD, new_state, aux)
      @classmethod init_state(cls, cfg, opts, batch, capacity, dtype[, policy]) -> pytree | None
      @classmethod flops_per_token(cls, cfg, opts, seq_len) -> float
      @classmethod max_chunk(cls, cfg, opts, capacity[, policy]) -> int | None    (optional)
      @classmethod stream_limit(cls, cfg, opts, capacity[, policy]) -> int | None (optional)

- `Options`: a frozen dataclass nested in the mixer class (`Mixer.Options`; a shared base such
  as `projection.SinkLogitOptions` may live elsewhere). `validate` runs once, where the model
  config is made: `ModelConfig.from_config`, `ModelConfig.with_options` and
  `config.validate_model` (which `model.build_model` runs) call it for every mixer of the
  pattern with `where = "config.model.<name>"`. `__init__` trusts the options it is given and
  does not validate them again (a test or notebook building a mixer directly validates through
  those entry points).
- `positions_BT` [B, T] int32: each token's absolute position in its row's stream; -1 marks
  padding (prompts of different lengths, right-padded), which must neither change the state
  nor be attended to.
- `segment_ids_BT` [B, T] int32 or None: packed rows (full forwards only, `state` is None):
  each token's document id, from 1 (`layers.SHARED_SEGMENT` = 0: a shared prefix, the decoder's
  sink tokens, which every document reads); `positions_BT` then restart at 0 in every document.
  The mixer makes the boundary exact: a document's outputs (and gradients) equal those of the
  document alone in a row of its own — attention-like mixers mask keys of other documents
  (`core.attend(q_segments=, kv_segments=)`), recurrent ones restart their state and
  convolution window where a document starts (`layers.segment_starts`). None: one stream per
  row (today's plain concatenation, and every decoding call).
  `reads_shared_prefix` (class attribute, default False): the mixer gives every document the
  shared prefix exactly as it would alone (attention masks do; a recurrent state restarted at
  a document's first token cannot), so sink tokens with packed rows need it on every layer.
- `state`: None for a full forward; else the layer's decoding state (fixed-shape arrays from
  `init_state`); the T new tokens continue the stream it holds and the updated state is
  returned. The state owns whatever positions/pointers it needs: the caller never computes
  cache slots.
- `rng`: a PRNG key for this layer (None = deterministic), `train`: Python bool.
- `aux`: a dict of scalars to monitor (e.g. SISA's lambda); the decoder stacks them over layers.
- `flops_per_token`: forward FLOPs per token of the *non-parameter* work (attention scores and
  values, scans); parameter matmuls are counted from the parameter count (train/flops.py).
- `max_chunk`: the most new tokens one stateful call can take with a state of `capacity`
  (None = any); `decode.py` prefills longer prompts in chunks of that size. `stream_limit`: the
  longest stream the state holds (None = any).
- `policy` (a keyword the state hooks may take): the decode-time cache policy
  (`attention/cache.py`: Linear, Ring(W), SinksRing(n, W)); a mixer whose state is a KV cache
  runs it under that policy (`cache.CachedMixer`), the others do not take it.
- Optimizer treatment (lr multiplier, weight decay on/off) is metadata on the parameters the
  mixer creates (`layers.param(..., kind=, lr_mult=)`), read by train/optim.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Callable

_MIXERS: dict[str, type] = {}
_PACKAGES = ("attn_jax.attention", "attn_jax.ssm")
_discovered = False


def register_mixer(name: str) -> Callable[[type], type]:
  def deco(cls: type) -> type:
    if name in _MIXERS and _MIXERS[name].__qualname__ != cls.__qualname__:
      raise ValueError(f"mixer {name!r} is already registered by {_MIXERS[name].__module__}")
    if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
      raise TypeError(f"mixer {name!r} ({cls.__module__}) needs a dataclass `Options`")
    _MIXERS[name] = cls
    cls.mixer_name = name
    return cls
  return deco


def _discover() -> None:
  """Import every module of the mixer packages once (importing registers them)."""
  global _discovered
  if _discovered:
    return
  _discovered = True
  for pkg_name in _PACKAGES:
    pkg = importlib.import_module(pkg_name)
    for info in pkgutil.iter_modules(pkg.__path__):
      importlib.import_module(f"{pkg_name}.{info.name}")


def get_mixer(name: str) -> type:
  _discover()
  if name not in _MIXERS:
    raise ValueError(f"unknown mixer {name!r}; registered mixers: {', '.join(sorted(_MIXERS))}")
  return _MIXERS[name]


def available_mixers(include_private: bool = False) -> list[str]:
  """Registered names; names starting with "_" (test doubles) only with `include_private`."""
  _discover()
  return sorted(n for n in _MIXERS if include_private or not n.startswith("_"))


def default_options(name: str) -> dict:
  """The mixer's option defaults as a plain dict (configs/base.py builds its sub-dicts from it)."""
  return {f.name: getattr(get_mixer(name).Options(), f.name)
          for f in dataclasses.fields(get_mixer(name).Options)}


def policy_kw(fn: Callable, policy) -> dict:
  """{"policy": policy} for a hook that takes the decode-time cache policy (a keyword
  `policy`: mixers whose state is a `cache.KVCache`), else {} (the others ignore it)."""
  return {"policy": policy} if "policy" in inspect.signature(fn).parameters else {}


def optional_hook(cls: type, name: str, cfg, opts, capacity: int, policy=None) -> int | None:
  """A mixer's optional `max_chunk` / `stream_limit` (None = unbounded when not defined)."""
  fn = getattr(cls, name, None)
  return None if fn is None else fn(cfg, opts, capacity, **policy_kw(fn, policy))
