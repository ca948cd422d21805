"""attn_jax's Mamba-2 beside a minimal plain-JAX Mamba-2 on identical MQAR batches
(attn_jax/study/mamba2_parity.py; the minimal model and its init recipes:
attn_jax/study/mamba2_minimal.py; results: docs/mamba_parity.md).

  python experiments/mamba2_parity.py --seeds=0,1,2,3,4 --steps=3000 --out=/tmp/parity.json
  python experiments/mamba2_parity.py --models=ours,minimal:ours,minimal:torch/embed=normal02 \
      --steps=1000 --out=/tmp/ablate.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from attn_jax.study.mamba2_minimal import RECIPES  # noqa: E402

_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Seeds (model init and data stream).")
_MODELS = flags.DEFINE_list("models", ["ours", "minimal:torch"], "'ours' and/or "
                            "'minimal:<recipe>' (recipes: " + ", ".join(RECIPES) + ").")
_STEPS = flags.DEFINE_integer("steps", 3000, "Training steps.")
_SCHEDULE = flags.DEFINE_integer("schedule_steps", None, "The lr schedule's horizon (default "
                                 "--steps): a shorter run that is the start of a longer one.")
_EVERY = flags.DEFINE_integer("every", 250, "Held-out recall every this many steps.")
_BATCH = flags.DEFINE_integer("batch", 128, "Batch size.")
_LR = flags.DEFINE_float("lr", None, "Peak lr (default: the setting's 3e-3).")
_CACHE = flags.DEFINE_string("compile_cache", "", "JAX persistent compilation cache directory.")
_OUT = flags.DEFINE_string("out", "mamba2_parity.json", "JSON results (appended to; runs done "
                           "are skipped).")


def main(argv):
  del argv
  import jax

  from attn_jax.study import mamba2_parity
  from configs import study_tiny
  if _CACHE.value:   # the train / eval programs compile once across runs and invocations
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  mamba2_parity.run(study_tiny.get_config(), _SEEDS.value, _MODELS.value, steps=_STEPS.value,
                    out=_OUT.value, every=_EVERY.value, batch=_BATCH.value, lr=_LR.value,
                    schedule_steps=_SCHEDULE.value)


if __name__ == "__main__":
  app.run(main)
