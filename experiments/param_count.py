"""Print the parameter count of a config from abstract shapes (nothing is allocated).

  python experiments/param_count.py --config=configs/sisa_152m.py
  python experiments/param_count.py --config=configs/sisa_152m.py --compare=configs/transformer_152m.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402
from attn_jax import config_flags as checked_flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.")
_COMPARE = config_flags.DEFINE_config_file("compare", None, "Optional config to compare with.")


def main(argv):
  del argv
  from attn_jax.model import count_params
  from attn_jax.model_config import ModelConfig

  m_cfg = ModelConfig.from_config(_CONFIG.value.model)   # validates once, names a bad field
  n = count_params(m_cfg)
  pattern = m_cfg.pattern or (m_cfg.mixer,)
  print(f"{flags.FLAGS['config'].config_filename}: pattern={pattern}, {m_cfg.n_layers} layers")
  for k, v in n.items():
    if k != "by_kind":
      print(f"  {k:>14}: {v:>14,}  ({v / 1e6:.2f}M)")
  print(f"  {'layer kind':>22} {'layers':>6} {'mixer':>13} {'mlp':>13} {'norms':>9}")
  for kind, row in n["by_kind"].items():
    print(f"  {kind:>22} {row['layers']:>6} {row['mixer']:>13,} {row['mlp']:>13,} "
          f"{row['norms']:>9,}")
  if _COMPARE.value is not None:
    m = count_params(_COMPARE.value.model)
    diff = n["total"] - m["total"]
    print(f"{flags.FLAGS['compare'].config_filename}: total {m['total']:,}; "
          f"difference {diff:+,} ({100 * diff / m['total']:+.3f}%)")


if __name__ == "__main__":
  # a config file that fails to load, an unknown or mistyped --config.* field: one line, exit 2
  cli.run(main, flags_parser=checked_flags.flags_parser("config"))
