"""Our evaluator against lm-evaluation-harness on the same weights and documents: flags in,
`attn_jax.eval.crosscheck.crosscheck` out (docs/pretrained_eval.md).

  python experiments/convert.py --src=SmolLM2-135M-Instruct.Q4_1.gguf \
      --workdir=runs/smollm2 --hf_out=runs/smollm2_hf
  python experiments/compare_lm_eval.py --checkpoint=runs/smollm2 --hf_dir=runs/smollm2_hf \
      --data_dir=/path/to/data --limit=200 --out_dir=runs/smollm2/crosscheck

Ours scores the run directory (attn_jax, JAX); lm-eval's `hf` model scores the Hugging Face
folder (transformers, PyTorch, fp32, CPU), both on lm-eval's own task definitions pointed at
the local files, offline. Prints the table; writes crosscheck.json (per document) and
crosscheck.md under --out_dir.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CKPT = flags.DEFINE_string("checkpoint", None, "Run directory scored by our evaluator.",
                            required=True)
_HF = flags.DEFINE_string("hf_dir", None, "Hugging Face folder of the same weights (lm-eval).",
                          required=True)
_DATA = flags.DEFINE_string("data_dir", None, "Folder with lambada/, hellaswag/, arc/ "
                            "(and arc/hf_ai2_arc/), winogrande/.", required=True)
_TASKS = flags.DEFINE_string("tasks", "lambada_openai,hellaswag,arc_easy,winogrande",
                             "Comma-separated tasks.")
_LIMIT = flags.DEFINE_integer("limit", None, "First N documents of each task (default all).")
_MAXLEN = flags.DEFINE_integer("max_len", 2048, "Context length of both evaluators.")
_BS = flags.DEFINE_integer("batch_size", 16, "Batch size of both evaluators.")
_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads for lm-eval's model.")
_OUT = flags.DEFINE_string("out_dir", "", "Where to write crosscheck.{json,md} "
                           "(default <checkpoint>/crosscheck).")


def main(argv):
  del argv
  work = tempfile.mkdtemp(prefix="crosscheck-")
  # offline, caches in a temporary folder (before the Hugging Face libraries are imported)
  os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                    HF_HOME=os.path.join(work, "hf"))
  import torch

  from attn_jax.data.tokenizer import get_tokenizer
  from attn_jax.eval import crosscheck
  from attn_jax.eval.run import ModelScorer
  from attn_jax.train.checkpoint import load_for_inference

  torch.set_num_threads(_THREADS.value)
  names = crosscheck.check_tasks(_TASKS.value.split(","), _DATA.value)
  model, config, _ = load_for_inference(_CKPT.value)
  tokenizer = get_tokenizer(config.data.tokenizer)
  lm = crosscheck.hf_lm(_HF.value, batch_size=_BS.value, max_length=_MAXLEN.value)
  result = crosscheck.crosscheck(ModelScorer(model), tokenizer, lm, _DATA.value, names,
                                 limit=_LIMIT.value, max_len=_MAXLEN.value,
                                 batch_size=_BS.value, work_dir=work)
  result["config"].update(checkpoint=os.path.abspath(_CKPT.value),
                          hf_dir=os.path.abspath(_HF.value), torch_threads=_THREADS.value)
  print(crosscheck.to_markdown(result))
  paths = crosscheck.write(result, _OUT.value or os.path.join(_CKPT.value, "crosscheck"))
  print(f"written: {paths}")


if __name__ == "__main__":
  cli.run(main)
