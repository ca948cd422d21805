"""Fine-tune a run directory (experiments/convert.py's, or any trained run) on text or JSONL:

  python experiments/train.py --config=configs/finetune.py:runs/smollm2_sisa \\
      --workdir=runs/smollm2_sisa_ft --config.data.paths=input.txt

The model (every field and mixer option) and the tokenizer are the run's own
(`train/init_from.finetune_config`); its parameters start the run with a fresh optimizer state
(`config.train.init_from`; docs/pretrained_variants.md). Without a run after the colon the
preset points at runs/smollm2 (`convert.py --src=smollm2 --workdir=runs/smollm2`) and takes
its model when that run exists. Rerunning the command resumes from the run's own checkpoints.

Settings for a 135M model on a CPU: sequences of 512 tokens, batch 8, 200 steps, lr 1e-4
(warm-up 20, cosine to 0.1 x), no weight decay; `--config.train.trainable=new` trains only the
parameters the conversion added, `--config.train.new_scalar_lr_mult` speeds up its new
scalars (a sink logit, a forget bias), which also needs a small `--config.optim.eps` (their
gradients are ~1e-11).
"""

from attn_jax.run_layout import RunLayout
from configs.base import get_config as base_config

DEFAULT_RUN = "runs/smollm2"


def get_config(run: str = ""):
  c = base_config()
  run = run or DEFAULT_RUN
  if RunLayout.of(run).checkpoints.is_dir():
    from attn_jax.train.init_from import finetune_config
    c = finetune_config(run, c)
  else:   # a template: train.py stops at init_from's check, naming the missing run
    c.train.init_from = run
  c.model.dtype = "float32"
  c.data.update(source="text", paths="", text_document="file", seq_len=512,
                global_batch_size=8, eval_fraction=0.05)
  c.train.update(steps=200, log_every=10)
  c.optim.update(lr=1e-4, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0)
  c.checkpoint.update(every_steps=50, max_to_keep=2)
  c.eval.update(every_steps=50, batch_size=8)
  return c
