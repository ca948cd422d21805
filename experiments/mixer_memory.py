"""Compiled memory of one mixer layer's forward + backward vs sequence length, side by side.

  python experiments/mixer_memory.py --mixers=attention,sisa --seq_lens=2048,4096,8192 \
      --sisa_path=chunked

Abstract shapes only (`attn_jax.train.memory.mixer_memory`): prints XLA's temporaries per
mixer and length, and each mixer's ratio to the first one. On CPU plain attention's kernels
keep per-chunk score blocks and grow ~T^2; SISA's chunked path (blockwise, past blocks through
kernels/blockwise.py) grows linearly.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_MIXERS = flags.DEFINE_list("mixers", ["attention", "sisa"], "Mixers to compare.")
_LENS = flags.DEFINE_list("seq_lens", ["2048", "4096", "8192"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_D = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("n_heads", 4, "Heads.")
_IMPL = flags.DEFINE_string("impl", "auto", "model.attention_impl.")
_PATH = flags.DEFINE_string("sisa_path", "chunked", "model.sisa.path (auto | fast | chunked).")
_D_STATE = flags.DEFINE_integer("sisa_d_state", 32, "model.sisa.d_state.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "model.dtype (bfloat16 for the cuDNN core).")


def main(argv):
  del argv
  from attn_jax.model_config import ModelConfig
  from attn_jax.train import memory
  from configs import base

  c = base.get_config()
  c.model.update(d_model=_D.value, n_heads=_HEADS.value, n_layers=1, vocab_size=256,
                 dtype=_DTYPE.value, attention_impl=_IMPL.value,
                 max_seq_len=max(int(t) for t in _LENS.value))
  c.model.sisa.update(path=_PATH.value, d_state=_D_STATE.value, decay_bias_init=-1.0)
  print(f"fwd+bwd temporaries of one layer, d_model {_D.value}, {_HEADS.value} heads, batch "
        f"{_BATCH.value}, {_DTYPE.value}, impl {_IMPL.value} (MiB; ratio to {_MIXERS.value[0]})")
  for t in _LENS.value:
    row = []
    for name in _MIXERS.value:
      c.model.mixer = name
      cfg = ModelConfig.from_config(c.model)
      row.append(memory.mixer_memory(cfg, name, _BATCH.value, int(t)).temp_size_in_bytes / 2**20)
    cells = "  ".join(f"{n} {m:9.1f} ({m / row[0]:.2f}x)" for n, m in zip(_MIXERS.value, row))
    print(f"T {int(t):6d}: {cells}", flush=True)


if __name__ == "__main__":
  cli.run(main)
