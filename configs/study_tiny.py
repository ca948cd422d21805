"""The comparison study at laptop scale (issue #14): every variant on generated MQAR data, equal
parameter count, equal tokens, equal seeds, one trainer and one evaluator, on a 2-core CPU.

  python experiments/study.py --config=configs/study_tiny.py --workdir=runs/study
  python experiments/study.py --report=runs/study --readme=README.md

Shared by every variant: d_model 64, 4 heads (head dim 16), fp32, MQAR with 8 key->value pairs
and 8 queries in 128 tokens (key/value vocabulary 32, so vocab 96), batch 16, 300 steps
(614,400 tokens per run), AdamW lr 3e-3,
evaluation every `eval.every_steps` (held-out loss/accuracy, `mqar` = recall accuracy through
attn_jax.eval.run.task_callback, and the MQAR-space needle grid of attn_jax/study/needle.py).
The baseline is a 2-layer Transformer; SSM variants use 4 layers without MLP (as the paper's
Mamba baselines use ~2.5x the layers) and are matched by their expansion in whole heads, then
their d_state; the rest by d_ff
(attn_jax/study/variants.py). `--config.study.only=transformer,sisa_ds8` runs a subset.
"""

import ml_collections

from configs import base

# (name, match field, overrides): see attn_jax/study/variants.py
SSM_TINY = (("d_state", 16), ("head_dim", 16), ("chunk_size", 32))


def _ssm(mixer, extra=()):
  return tuple((f"model.{mixer}.{k}", v) for k, v in SSM_TINY + tuple(extra))


VARIANTS = (
    ("transformer", "", ()),
    ("sisa_ds8", "model.d_ff", (("model.mixer", "sisa"), ("model.sisa.d_state", 8))),
    ("sisa_ds16", "model.d_ff", (("model.mixer", "sisa"), ("model.sisa.d_state", 16))),
    ("mamba2", "model.mamba2.expand,model.mamba2.d_state",
     (("model.pattern", ("mamba2:nomlp",)), ("model.n_layers", 4)) + _ssm("mamba2")),
    ("mamba3", "model.mamba3.expand,model.mamba3.d_state",
     (("model.pattern", ("mamba3:nomlp",)), ("model.n_layers", 4)) + _ssm("mamba3")),
    ("sinkhorn", "model.d_ff",
     (("model.mixer", "sinkhorn"), ("model.sinkhorn.block_size", 16),
      ("model.sinkhorn.sortnet_width", 32), ("model.sinkhorn.sort_dim", 8))),
    ("hybrid_block", "model.d_ff",
     (("model.pattern", ("attention", "mamba2:nomlp")), ("model.n_layers", 4))
     + _ssm("mamba2")),
    ("hybrid_heads", "model.d_ff",
     (("model.pattern", ("hybrid_heads",)),) + _ssm("hybrid_heads")),
    ("transformer_sink", "model.d_ff", (("model.sink_tokens", 1),)),
    ("sisa_ds8_sink", "model.d_ff",
     (("model.mixer", "sisa"), ("model.sisa.d_state", 8), ("model.sink_tokens", 1))),
)


def study_defaults() -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.variants = VARIANTS
  s.baseline = "transformer"
  s.only = ""                    # comma-separated subset of the variants ("" = all)
  s.seeds = (0, 1, 2)
  s.param_tolerance = 0.02       # |params - baseline| / baseline allowed after matching
  s.d_ff_multiple = 4            # d_ff matched in steps of this
  s.niah = "synthetic"           # synthetic (attn_jax/study/needle.py) | text (eval task niah) | none
  s.niah_metric = "eval/needle/acc"
  s.recall_metric = "eval/mqar/acc"
  s.needle_lengths = (64, 128)   # needle grid: context lengths (<= data.seq_len)
  s.needle_depths = (0.0, 0.5, 1.0)
  s.needle_samples = 32
  s.throughput_seq_lens = (256, 512, 1024)
  s.throughput_batch_tokens = 2048
  s.throughput_steps = 3
  s.throughput_repeats = 1
  return s


def get_config():
  c = base.get_config()
  c.model.update(mixer="attention", vocab_size=96, d_model=64, n_layers=2, n_heads=4,
                 d_ff=256, max_seq_len=1024, dtype="float32", init_std=0.02)
  c.data.update(source="synthetic", synthetic_task="mqar", seq_len=128, global_batch_size=16,
                mqar_num_pairs=8, mqar_num_queries=8, mqar_vocab=32)
  c.train.update(steps=300, log_every=25, progress_bar=False)
  c.optim.update(lr=3e-3, warmup_steps=30, weight_decay=0.1)
  c.checkpoint.update(every_steps=150, max_to_keep=1)
  c.eval.update(every_steps=75, tasks="mqar", batch_size=32)
  c.study = study_defaults()
  return c
