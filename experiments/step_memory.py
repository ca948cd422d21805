"""Compiled memory of one train step, from abstract shapes only (nothing is allocated or run).

  python experiments/step_memory.py --config=transformer_152m --batch=32 --seq_len=2048

Builds the trainer's step (`attn_jax.train.setup.build_setup`), compiles it as the trainer
does on the abstract train state and an abstract [1, batch, seq_len] batch
(`setup.step_memory`) and prints XLA's
`memory_analysis()` (arguments, outputs, donated, temporaries, code) and the fit verdict of
`attn_jax.train.memory.check_fit` on this machine's first device. Run it on two checkouts
(PYTHONPATH=...) to compare, e.g., the plain and the blockwise cross-entropy.
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "transformer_152m", "Config module under configs/.")
_BATCH = flags.DEFINE_integer("batch", 32, "Micro-batch (data.global_batch_size).")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Sequence length.")
_DTYPE = flags.DEFINE_string("dtype", "", "Override model.dtype.")
_REMAT = flags.DEFINE_string("remat", "", "Override model.remat.")


def main(argv):
  del argv
  from attn_jax.train import memory
  from attn_jax.train.setup import build_setup, step_memory

  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  config.data.global_batch_size = _BATCH.value
  config.data.seq_len = _SEQ.value
  config.model.max_seq_len = max(config.model.max_seq_len, _SEQ.value)
  config.train.grad_accum = 1
  if _DTYPE.value:
    config.model.dtype = _DTYPE.value
  if _REMAT.value:
    config.model.remat = _REMAT.value
  s = build_setup(config)
  mem = step_memory(s, _BATCH.value, 1, _SEQ.value)
  gib = memory.GiB
  print(f"{_CONFIG.value} batch {_BATCH.value} x {_SEQ.value} dtype {s.cfg.dtype} remat "
        f"{s.cfg.remat}: arguments {mem.argument_size_in_bytes / gib:.2f} GiB, outputs "
        f"{mem.output_size_in_bytes / gib:.2f}, donated {mem.alias_size_in_bytes / gib:.2f}, "
        f"temporaries {mem.temp_size_in_bytes / gib:.2f}, needed "
        f"{memory.needed_bytes(mem) / gib:.2f} GiB")
  print(memory.check_fit(mem, micro_batch=_BATCH.value, grad_accum=1, remat=s.cfg.remat).message)


if __name__ == "__main__":
  cli.run(main)
