"""Batch-1 greedy generation speed of a converted checkpoint: ours against transformers (and
llama.cpp when llama-cpp-python is installed) on the same weights, measured in one run,
alternated: flags in, `attn_jax.eval.gen_speed.measure` out (docs/pretrained_eval.md).

  python experiments/convert.py --src=SmolLM2-135M-Instruct.Q4_1.gguf --workdir=runs/smollm2 \
      --hf_out=runs/smollm2_hf --gguf_out=runs/smollm2_f32.gguf --qtype=F32
  python experiments/bench_pretrained.py --checkpoint=runs/smollm2 --hf_dir=runs/smollm2_hf \
      --gguf=runs/smollm2_f32.gguf --prompt_len=512 --new_tokens=128 --repeats=5

The prompt is the first --prompt_len tokens of --prompt_file (default the tinyshakespeare
excerpt in tests/data). Prints the table; --out writes the raw timings and tokens as JSON.
Where the checkpoint cannot be installed (the GPU machine of experiments/device_check.sh):

  python experiments/bench_pretrained.py --random=smollm2 --prompt_len=512 --new_tokens=128

times SmolLM2's shape with random weights, against transformers holding the same weights when
it is installed (speed does not depend on the weights' values; the greedy tokens still must
agree).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CKPT = flags.DEFINE_string("checkpoint", "", "Run directory (ours).")
_RANDOM = flags.DEFINE_string(
    "random", "", "Instead of --checkpoint: random weights of a packaged checkpoint's shape "
    "(attn_jax.pretrained.packaged.SPECS, e.g. smollm2) and a random prompt; transformers' "
    "engine then holds the same weights (gen_speed.transformers_twin) when transformers is "
    "installed, on the GPU when torch sees one. For machines without the file "
    "(experiments/device_check.sh).")
_HF = flags.DEFINE_string("hf_dir", "", "Hugging Face folder of the same weights (transformers).")
_GGUF = flags.DEFINE_string("gguf", "", "GGUF file of the same weights (llama.cpp), optional.")
_PROMPT = flags.DEFINE_string("prompt_file", os.path.join(_ROOT, "tests", "data",
                                                          "tinyshakespeare", "input.txt"),
                              "Text whose first --prompt_len tokens are the prompt.")
_LEN = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Generated tokens (greedy).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (engines alternated).")
_THREADS = flags.DEFINE_integer("threads", 2, "torch / llama.cpp threads.")
_OUT = flags.DEFINE_string("out", "", "Write the result as JSON here.")


def _checkpoint_and_prompt():
  """(model, prompt ids) of --checkpoint: the first --prompt_len tokens of --prompt_file."""
  from attn_jax.data.tokenizer import get_tokenizer
  from attn_jax.train.checkpoint import load_for_inference
  model, config, _ = load_for_inference(_CKPT.value)
  tok = get_tokenizer(config.data.tokenizer)
  if not os.path.isfile(_PROMPT.value):
    raise FileNotFoundError(f"prompt_file: no such file {_PROMPT.value!r}")
  with open(_PROMPT.value, encoding="utf-8") as f:
    ids = list(tok.encode(f.read()))[:_LEN.value]
  if len(ids) < _LEN.value:
    raise ValueError(f"prompt_file: {_PROMPT.value} has {len(ids)} tokens, fewer than "
                     f"prompt_len={_LEN.value}")
  return model, ids


def _random_and_prompt():
  """(model, prompt ids) of --random: the packaged checkpoint's shape, seed-0 weights (the
  trunk's initialisation), uniform random prompt ids."""
  import numpy as np

  from attn_jax.model import build_model
  from attn_jax.pretrained.llama import model_config
  from attn_jax.pretrained.packaged import SPECS
  if _RANDOM.value not in SPECS:
    raise ValueError(f"random: unknown checkpoint {_RANDOM.value!r} (known: "
                     f"{', '.join(sorted(SPECS))})")
  spec = SPECS[_RANDOM.value]
  model = build_model(model_config(spec), seed=0)
  ids = np.random.default_rng(0).integers(0, spec.vocab_size, _LEN.value).tolist()
  return model, ids


def _reference_engines(model):
  """transformers (a folder, or the in-memory twin under --random) and llama.cpp engines."""
  from attn_jax.eval import gen_speed
  engines = []
  if _HF.value or _RANDOM.value:
    try:
      import torch
      from transformers import AutoModelForCausalLM
    except ImportError as e:
      if _HF.value:
        raise
      print(f"transformers is not importable here ({e}): ours alone")
      return engines
    torch.set_num_threads(_THREADS.value)
    if _HF.value:
      hf = AutoModelForCausalLM.from_pretrained(_HF.value, dtype=torch.float32).eval()
    else:
      hf = gen_speed.transformers_twin(model, "cuda" if torch.cuda.is_available() else "cpu")
    engines.append(gen_speed.transformers_engine(hf))
  if _GGUF.value:
    from llama_cpp import Llama  # pip install llama-cpp-python
    llm = Llama(model_path=_GGUF.value, n_ctx=_LEN.value + _NEW.value, n_threads=_THREADS.value,
                n_threads_batch=_THREADS.value, n_batch=_LEN.value, verbose=False)
    engines.append(gen_speed.llama_cpp_engine(llm))
  return engines


def main(argv):
  del argv
  os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  import jax

  from attn_jax.eval import gen_speed

  if bool(_CKPT.value) == bool(_RANDOM.value):
    raise ValueError("give exactly one of --checkpoint and --random")
  if _LEN.value < 1 or _NEW.value < 2:
    raise ValueError(f"prompt_len must be >= 1 and new_tokens >= 2 (got {_LEN.value}, "
                     f"{_NEW.value})")
  model, ids = _checkpoint_and_prompt() if _CKPT.value else _random_and_prompt()
  if _LEN.value + _NEW.value > model.cfg.max_seq_len:
    raise ValueError(f"prompt_len + new_tokens = {_LEN.value + _NEW.value} exceeds the model's "
                     f"{model.cfg.max_seq_len} positions")
  engines = [gen_speed.ours_engine(model)] + _reference_engines(model)
  result = gen_speed.measure(engines, ids, _NEW.value, _REPEATS.value)
  result["config"].update(checkpoint=os.path.abspath(_CKPT.value) if _CKPT.value else
                          f"random:{_RANDOM.value}", threads=_THREADS.value,
                          jax_backend=jax.default_backend())
  print(f"jax backend: {jax.default_backend()}; engines: "
        + ", ".join(f"{e.name} ({e.backend or 'other'})" for e in engines))
  print(gen_speed.to_markdown(result))
  # what each backend's dense matmul allows (gen_speed.ceiling_markdown): fp32 on the CPU
  if jax.default_backend() == "cpu" and any(e.backend == "torch" for e in engines):
    from attn_jax.model import count_params
    fpt = gen_speed.prefill_flops_per_token(model.cfg, count_params(model.cfg), _LEN.value)
    gemm = gen_speed.gemm_rates(_LEN.value, model.cfg.d_model, model.cfg.d_ff)
    result["prefill_flops_per_token"], result["gemm_gflops"] = fpt, gemm
    print()
    print(gen_speed.ceiling_markdown(result, fpt, gemm))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)
    print(f"written: {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
