"""The token-mixer contract: the one base class every variant subclasses.

The decoder, trainer, decoding loop and evaluator use a mixer only through this interface, and
none of them branches on a mixer's name. A new variant is one module under `attn_jax/attention/`
or `attn_jax/ssm/` (discovered by `registry.py`) plus a config; `docs/mixers.md` walks through
one, and `tests/test_mixer_contract.py` runs that walk-through as written.

`register_mixer(name)` lives here, beside the contract it checks, and not in `registry.py`: the
registry imports every mixer module (discovery), so neither a mixer module nor anything it
imports may import the registry, or `attn_jax.config` (which imports the registry; a mixer names
`ModelConfig` only under `TYPE_CHECKING`). tests/test_layout.py checks the import graph, the
discovery's edges included, for cycles.

    @register_mixer("name")
    class MyMixer(Mixer):
      @dataclasses.dataclass(frozen=True)
      class Options:                                   # defaults, in this one place
        width: int = 8
        def validate(self, cfg, where): ...            # raise ValueError(f"{where}.width: ...")

      axis_rules = (("my_axis", None),)                # logical axes this mixer introduces
      def __init__(self, cfg, opts, *, rngs): ...
      def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
                   train=False): ...                   # -> (y_BTD, new_state, aux)
      @classmethod
      def flops_per_token(cls, cfg, opts, seq_len): ...

Arguments of `__call__`:
- `positions_BT` [B, T] int32: each token's absolute position in its row's stream; -1 marks
  padding (prompts of different lengths, right-padded), which must neither change the state
  nor be attended to.
- `segment_ids_BT` [B, T] int32 or None: packed rows (full forwards only, `state` is None):
  each token's document id, from 1 (`layers.SHARED_SEGMENT` = 0: a shared prefix, the decoder's
  sink tokens, which every document reads); `positions_BT` then restart at 0 in every document.
  The mixer makes the boundary exact: a document's outputs (and gradients) equal those of the
  document alone in a row of its own. Attention-like mixers mask keys of other documents
  (`entry.attend(q_segments=, kv_segments=)`), recurrent ones restart their state and
  convolution window where a document starts (`layers.segment_starts`). None: one stream per
  row (plain concatenation, and every decoding call).
- `state`: None for a full forward; else the layer's decoding state (fixed-shape arrays from
  `init_state`); the T new tokens continue the stream it holds and the updated state is
  returned. The state owns whatever positions/pointers it needs: the caller never computes
  cache slots.
- `rng`: a PRNG key for this layer (None = deterministic); `train`: a Python bool.
Returns `aux`: a dict of scalars to monitor (e.g. SISA's lambda), stacked over layers.

Class-level hooks (defaults below; override what applies):
- `Options`: a frozen dataclass nested in the class (a shared base such as
  `projection.SinkLogitOptions` may live elsewhere). `validate(cfg, where)` runs once, where
  the model config is made (`ModelConfig.from_config`, `with_options`, `validate_model`), with
  `where = "config.model.<name>"`; `__init__` trusts the options it is given.
- `tiny()`: Options for test-sized models (d_model 32, 4 heads, a few tokens): every test and
  the notebook build small models from it, so a new mixer states its small shape once.
- `axis_rules`: (logical axis, default mesh axes) for each logical axis name this mixer's
  parameters introduce beyond the trunk's (`sharding.TRUNK_RULES`); `config.mesh.rules`
  overrides them.
- `reads_shared_prefix`: the mixer gives every packed document the shared prefix exactly as it
  would alone (attention masks do; a recurrent state restarted at a document's first token
  cannot), so sink tokens with packed rows need it on every layer.
- `packed_rows_problem(opts)`: None if packed rows are exact with these options, else a short
  reason; `config.validate` then refuses `data.document_mask` with it (sinkhorn's non-causal
  mode).
- `init_state(cfg, opts, batch, capacity, dtype, policy=None)`: the decoding state (a pytree;
  None if the mixer is stateless). `policy` is the decode-time KV-cache policy
  (`attention/cache.py`: Linear, Ring(W), SinksRing(n, W)); a mixer whose state is not a KV
  cache ignores it.
- `flops_per_token(cfg, opts, seq_len)`: forward FLOPs per token of the *non-parameter* work
  (attention scores and values, scans); parameter matmuls are counted from the parameter count
  (train/flops.py).
- `max_chunk(cfg, opts, capacity, policy=None)`: the most new tokens one stateful call takes
  with a state of `capacity` (None = any); decoding prefills longer prompts in chunks of it.
  `max_fresh_chunk(...)`: the same for the first call into a fresh state (a prefill's first
  call, `cache.as_fresh`), which a mixer may run as its full forward (default: `max_chunk`).
  `stream_limit(...)`: the longest stream the state holds (None = any).
- Optimizer treatment (lr multiplier, weight decay on/off) is metadata on the parameters the
  mixer creates (`layers.param(..., kind=, lr_mult=)`), read by train/optim.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from flax import nnx


class Mixer(nnx.Module):
  """Base class of every token mixer (see the module docstring for the contract)."""

  mixer_name: ClassVar[str] = ""            # set by `register_mixer`
  reads_shared_prefix: ClassVar[bool] = False
  axis_rules: ClassVar[tuple[tuple[str, Any], ...]] = ()

  @dataclasses.dataclass(frozen=True)
  class Options:
    """No options."""

    def validate(self, cfg, where: str) -> None:
      del cfg, where

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT=None, state=None, rng=None,
               train=False):
    raise NotImplementedError(f"{type(self).__name__}.__call__")

  @classmethod
  def tiny(cls) -> Any:
    """Options for test-sized models; the defaults unless a mixer says otherwise."""
    return cls.Options()

  @classmethod
  def packed_rows_problem(cls, opts) -> str | None:
    """Why packed rows would not be exact with these options (None: they are)."""
    del opts
    return None

  @classmethod
  def init_state(cls, cfg, opts, batch: int, capacity: int, dtype, policy=None) -> Any:
    del cfg, opts, batch, capacity, dtype, policy
    return None

  @classmethod
  def flops_per_token(cls, cfg, opts, seq_len: int) -> float:
    raise NotImplementedError(f"{cls.__name__}.flops_per_token")

  @classmethod
  def max_chunk(cls, cfg, opts, capacity: int, policy=None) -> int | None:
    del cfg, opts, capacity, policy
    return None

  @classmethod
  def max_fresh_chunk(cls, cfg, opts, capacity: int, policy=None) -> int | None:
    return cls.max_chunk(cfg, opts, capacity, policy=policy)

  @classmethod
  def stream_limit(cls, cfg, opts, capacity: int, policy=None) -> int | None:
    del cfg, opts, capacity, policy
    return None


# name -> mixer class, filled by `register_mixer` as the mixer modules are imported; looked up
# through `attn_jax.registry` (which imports them all first).
REGISTERED: dict[str, type] = {}


def register_mixer(name: str) -> Callable[[type], type]:
  def deco(cls: type) -> type:
    if name in REGISTERED and REGISTERED[name].__qualname__ != cls.__qualname__:
      raise ValueError(f"mixer {name!r} is already registered by {REGISTERED[name].__module__}")
    if not (isinstance(cls, type) and issubclass(cls, Mixer)):
      raise TypeError(f"mixer {name!r} ({getattr(cls, '__module__', cls)}) must subclass "
                      "attn_jax.mixer.Mixer")
    if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
      raise TypeError(f"mixer {name!r} ({cls.__module__}) needs a dataclass `Options`")
    REGISTERED[name] = cls
    cls.mixer_name = name
    return cls
  return deco
