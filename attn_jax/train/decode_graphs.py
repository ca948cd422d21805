"""The decoding programs compiled for a GPU target with and without command buffers: what each
captures and what its memory analysis says (`attn_jax.command_buffers`: the options and the
dump reader).

Two programs, as decoding runs them (`kernel_choice.stateful_compiler_options` on the target's
platform, `decode.jit_stateful`'s and `decode.generate`'s options):

  step      `decode.decode_step` of one token per row against the states a prefill of
            `prompt` tokens leaves (capacity prompt + new_tokens), on `Decoder.for_decoding`
            parameters with `Decoder.layer_params` made outside, the states donated
            (`decode.jit_stateful`, as `train/aot.py`'s decode program);
  generate  `decode.generate`: prefill, then the `lax.while_loop` of one-token steps, greedy,
            `new_tokens` new tokens (inside one jit, as `generate` compiles itself).

Each is compiled twice, inside `command_buffers.use(True)` and `use(False)` (then XLA's
default set, no WHILE), for the first device of `target`, with a dump read by
`command_buffers.read_dump`. Abstract parameters: nothing is allocated or run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attn_jax import command_buffers as cb, decode, kernel_choice, targets
from attn_jax.model import abstract_model


@dataclasses.dataclass(frozen=True)
class Row:
  """One program compiled with the options on and off."""
  program: str
  on: cb.Compiled
  off: cb.Compiled


def _decoding_params(cfg):
  """(graphdef, abstract state) of `abstract_model(cfg).for_decoding()`: the decoding copy's own
  graphdef (its fused q/k/v and gate/up kernels make its parameter tree differ from the
  model's)."""
  graphdef, state = nnx.split(abstract_model(cfg))
  return nnx.split(nnx.eval_shape(lambda st: nnx.merge(graphdef, st).for_decoding(), state))


def _programs(cfg, batch: int, prompt: int, new_tokens: int, sharding):
  """{name: () -> Lowered} of the two programs (module docstring), jitted when called (so
  inside `command_buffers.use`), every argument on `sharding`."""
  graphdef, params = _decoding_params(cfg)
  capacity = prompt + new_tokens
  model = lambda p: nnx.merge(graphdef, p)
  put = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
  prompt_BT = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
  token_B = jax.ShapeDtypeStruct((batch,), jnp.int32)
  layers = jax.eval_shape(lambda p: model(p).layer_params(), params)
  states = jax.eval_shape(lambda p, x: decode.prefill(model(p), x, capacity=capacity)[1],
                          params, prompt_BT)

  def step(p, layer_params, tok_B, pos_B, state):
    return decode.decode_step(model(p), tok_B, pos_B, state, layer_params)

  def generate(p, x_BT):
    return decode.generate(model(p), x_BT, max_new_tokens=new_tokens, cache_len=capacity)

  return {
      "step": lambda: decode.jit_stateful(step, donate_argnums=(4,)).lower(
          put(params), put(layers), put(token_B), put(token_B), put(states)),
      "generate": lambda: jax.jit(
          generate, compiler_options=kernel_choice.stateful_compiler_options()).lower(
          put(params), put(prompt_BT)),
  }


def capture_report(cfg, target: str = "h100x1", *, device=None, batch: int = 1, prompt: int = 8,
                   new_tokens: int = 8, programs=("step", "generate")) -> list[Row]:
  """Each of `programs` of model `cfg` (a ModelConfig) compiled for GPU `target` (or for
  `device`, e.g. a real GPU's `jax.devices()[0]`) with the command-buffer options on and off
  (module docstring)."""
  if device is None:
    if targets.get(target).platform != "gpu":
      raise ValueError(f"command buffers are XLA:GPU's: {target!r} is not a GPU target")
    device = targets.devices(target)[0]
  elif kernel_choice.of_devices(device) != "gpu":
    raise ValueError(f"command buffers are XLA:GPU's: {device} is not a GPU")
  sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P())
  rows = []
  with kernel_choice.use_platform(device):
    lowerings = _programs(cfg, batch, prompt, new_tokens, sharding)
    for name in programs:
      got = {}
      for on in (True, False):
        with cb.use(on):
          got[on] = cb.compile_with_dump(lowerings[name])
      rows.append(Row(name, got[True], got[False]))
  return rows


def format_rows(rows: list[Row]) -> str:
  """The rows as lines a person reads."""
  out = []
  for r in rows:
    for label, c in (("on", r.on), ("off", r.off)):
      mem = ", ".join(f"{k} {v}" for k, v in c.memory.items())
      out.append(f"{r.program:8s} {label:3s}: {c.capture.summary()}; memory bytes: {mem}")
  return "\n".join(out)


def _cell(c: cb.Capture) -> str:
  graphs = f"{c.command_buffers} graph{'s' * (c.command_buffers != 1)}"
  out = f"{graphs}, {c.inside} thunks in / {c.outside} out"
  for lp in c.loops:
    out += (f"; loop inside ({lp.inside} thunks)" if lp.captured else
            f"; loop host-driven, {lp.per_iteration} launches per token")
  return out


def markdown_rows(preset: str, rows: list[Row]) -> list[str]:
  """Table rows (docs/hardware.md): per program the capture with the options and without, and
  the memory analysis (arguments and temporaries; 'equal' where both settings agree)."""
  out = []
  for i, r in enumerate(rows):
    mem = f"arguments {r.on.memory['argument']:,}, temporaries {r.on.memory['temp']:,}"
    mem += ": equal" if r.on.memory == r.off.memory else f" (without: {r.off.memory})"
    out.append(f"| {preset if i == 0 else ''} | {r.program} | {_cell(r.on.capture)} | "
               f"{_cell(r.off.capture)} | {mem} |")
  return out
