"""Evaluate a trained checkpoint: flags in, `attn_jax.eval.run.evaluate_checkpoint` out.

  python experiments/eval.py --checkpoint=runs/sisa_152m \
      --tasks=lambada,hellaswag,arc_easy,winogrande,niah --data_dir=/path/to/data

Prints a results table and writes <checkpoint>/eval/eval.{json,md} (and niah.png), or under
--out_dir. The folder is checked before any work: an --out_dir that cannot be written is an
error at once; a run directory that cannot be written (a read-only mount, a shared copy of a
colleague's run) sends the results to a fallback folder named at start and in the output
(`attn_jax.outputs`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from attn_jax import cli  # noqa: E402

_CKPT = flags.DEFINE_string("checkpoint", None, "Training run directory (holds checkpoints/).",
                            required=True)
_TASKS = flags.DEFINE_string("tasks", "lambada,hellaswag,arc_easy,winogrande,niah",
                             "Comma-separated tasks.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_DATA = flags.DEFINE_string("data_dir", "", "Folder with lambada/, hellaswag/, arc/, winogrande/.")
_TOK = flags.DEFINE_string("tokenizer", "", "Tokenizer (default: the training config's).")
_MAXLEN = flags.DEFINE_integer("max_len", 0, "Context length (default: training seq_len).")
_BS = flags.DEFINE_integer("batch_size", 0, "Batch size (default: config.eval.batch_size).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N documents of each task.")
_OUT = flags.DEFINE_string("out_dir", "", "Where to write eval.json/eval.md (default: "
                           "<checkpoint>/eval; unwritable: a fallback folder, named).")
_UNVERIFIED = flags.DEFINE_bool("allow_unverified", False, "Load a checkpoint step that has no "
                                "checksum manifest (its bytes cannot be verified).")


def main(argv):
  del argv
  from attn_jax import distributed
  from attn_jax.eval import result_tables
  distributed.require_one_process("eval.py")   # one process reads a run; it joins no cluster
  from attn_jax.eval.run import evaluate_checkpoint

  out = evaluate_checkpoint(_CKPT.value, _TASKS.value, step=_STEP.value, data_dir=_DATA.value,
                            tokenizer=_TOK.value, max_len=_MAXLEN.value,
                            batch_size=_BS.value, limit=_LIMIT.value, out_dir=_OUT.value,
                            allow_unverified=_UNVERIFIED.value)
  print(result_tables.to_markdown(out))
  print(f"written: {out['paths']}")


if __name__ == "__main__":
  cli.run(main)
