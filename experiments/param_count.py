"""Print the parameter count of a config from abstract shapes (nothing is allocated).

  python experiments/param_count.py --config=configs/sisa_152m.py
  python experiments/param_count.py --config=configs/sisa_152m.py --compare=configs/transformer_152m.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.")
_COMPARE = config_flags.DEFINE_config_file("compare", None, "Optional config to compare with.")


def main(argv):
  del argv
  from attn_jax.model import count_params

  n = count_params(_CONFIG.value.model)
  print(f"{flags.FLAGS['config'].config_filename}: mixer={_CONFIG.value.model.mixer}")
  for k, v in n.items():
    print(f"  {k:>14}: {v:>14,}  ({v / 1e6:.2f}M)")
  if _COMPARE.value is not None:
    m = count_params(_COMPARE.value.model)
    diff = n["total"] - m["total"]
    print(f"{flags.FLAGS['compare'].config_filename}: total {m['total']:,}; "
          f"difference {diff:+,} ({100 * diff / m['total']:+.3f}%)")


if __name__ == "__main__":
  app.run(main)
