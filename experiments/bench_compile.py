"""Compile time of the train step (or the one-token decode step) versus depth, for a layer
pattern: the decoder scans repeats of the pattern's period, so 12 and 24 layers of a train step
should compile in about the same time; decoding unrolls the layers (each layer's state updated
in place, model.py), so its compile time grows with depth.

  python experiments/bench_compile.py --pattern=attention,mamba2:nomlp --layers=12,24
  python experiments/bench_compile.py --step=decode

Each depth is lowered and compiled from abstract shapes (nothing runs) in a fresh process-level
cache state (the persistent compilation cache is off), alternating depths `--repeats` times;
the median per depth and the ratio are printed and written as JSON.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_PATTERN = flags.DEFINE_string("pattern", "attention,mamba2:nomlp", "Comma-separated layer specs.")
_LAYERS = flags.DEFINE_string("layers", "12,24", "Comma-separated depths.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Compilations per depth (alternating).")
_OUT = flags.DEFINE_string("out", "", "JSON output path.")
_STEP = flags.DEFINE_enum("step", "train", ["train", "decode"],
                          "train: the trainer's step; decode: one token per row at batch 1 "
                          "against a 64-slot cache (decode.jit_stateful, donated state).")


def _config(pattern, n_layers):
  from configs import quickstart
  c = quickstart.get_config()
  c.model.update(pattern=pattern, n_layers=n_layers, d_model=128, n_heads=4, d_ff=256)
  c.mesh.shape = (1, 1, 1)
  return c


def compile_seconds(pattern: tuple[str, ...], n_layers: int) -> float:
  import jax

  from attn_jax.train.setup import abstract_batch, build_setup, compile_step

  setup = build_setup(_config(pattern, n_layers), devices=jax.devices()[:1])
  batch = abstract_batch(setup, 1, 8, 64)
  jax.clear_caches()
  t0 = time.perf_counter()
  compile_step(setup, batch)   # as the trainer compiles it (inside the mesh's rules)
  return time.perf_counter() - t0


def decode_compile_seconds(pattern: tuple[str, ...], n_layers: int) -> float:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from attn_jax import decode
  from attn_jax.model import abstract_model, init_state
  from attn_jax.model_config import ModelConfig

  cfg = ModelConfig.from_config(_config(pattern, n_layers).model)
  graphdef, params = nnx.split(abstract_model(cfg))
  state = jax.eval_shape(lambda: init_state(cfg, 1, 64))
  step = decode.jit_stateful(
      lambda p, t, pos, s: nnx.merge(graphdef, p).step(t, positions_BT=pos, state=s),
      donate_argnums=(3,))
  tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  jax.clear_caches()
  t0 = time.perf_counter()
  step.lower(params, tok, tok, state).compile()
  return time.perf_counter() - t0


def main(argv):
  del argv
  import jax
  jax.config.update("jax_enable_compilation_cache", False)
  pattern = tuple(p.strip() for p in _PATTERN.value.split(","))
  depths = [int(x) for x in _LAYERS.value.split(",")]
  times = {d: [] for d in depths}
  for _ in range(_REPEATS.value):
    for d in depths:
      fn = decode_compile_seconds if _STEP.value == "decode" else compile_seconds
      times[d].append(fn(pattern, d))
  med = {d: statistics.median(t) for d, t in times.items()}
  base = med[depths[0]]
  print(f"pattern {pattern}, {_STEP.value} step")
  print(f"{'layers':>7} {'compile s (median)':>19} {'ratio':>6}")
  for d in depths:
    print(f"{d:>7} {med[d]:>19.2f} {med[d] / base:>6.2f}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"pattern": pattern, "step": _STEP.value, "seconds": times, "median": med}, f,
                indent=1)


if __name__ == "__main__":
  cli.run(main)
