"""Language modelling on real text at laptop scale: the study_tiny variants (same layouts,
declared settings, parameter matching) trained on a text corpus the user gives, equal
parameters and tokens, 2 seeds; held-out bits per byte with spread, and bits per byte by
position on windows 4x the training length (length extrapolation). The laptop analogue of the
paper's LAMBADA claim; configs/study_152m.py is the GPU/TPU version on the real loader.

  python experiments/study.py --config=configs/study_lm_tiny.py \\
      --config.data.paths=../shared/data/tinyshakespeare/input.txt --workdir=runs/study_lm
  python experiments/study.py --report=runs/study_lm --readme=docs/studies.md

Data: `data.source` text (one document per non-blank line; `data.text_document=file` for
whole files), jsonl (`data.text_field`) or shards (a folder from experiments/prepare_data.py);
the byte tokenizer (vocab 257), so bits per byte is bits per token over the non-EOS targets.
The held-out split is the data's own (the last 2% of packed windows, never trained on).

Budget (2 CPU cores, <= 90 min): d_model 64, 4 heads, 2 layers, seq 128, batch 32 (4,096
tokens per step, as study_tiny's 3,968), 600 steps = 2.5M tokens (~2.2 passes over
tinyshakespeare's 1.1 MB); one lr for every variant (3e-3, study_tiny's Transformer setting):
no sweep, which would take the study past 90 minutes (`--config.study.lrs=1e-3,3e-3,1e-2`
adds it). What is cut to fit: seq 128 and 600 steps (a byte-level model this small is far
from converged; the comparison is at equal, small budget), six variants (LM_VARIANTS) and two
seeds (`--config.study.seeds=0,1,2` adds the third). Mamba-2 is the slowest variant to train
here (its tokens/s are in docs/studies.md).
"""

from configs import study_tiny

SEQ = 128
# The methods whose claims are about language modelling and length: the Transformer, SISA, the
# SSMs, FoX and ALiBi (the decay / position-prior relatives). `--config.study.only=` runs every
# study_tiny variant.
LM_VARIANTS = "transformer,sisa_ds8,mamba2,mamba3,fox,alibi"


def get_config():
  c = study_tiny.get_config()
  c.model.update(vocab_size=257, max_seq_len=4 * SEQ)
  c.data.update(source="text", paths="", tokenizer="bytes", seq_len=SEQ, global_batch_size=32,
                text_document="line", eval_fraction=0.02)
  c.train.update(steps=600)
  c.optim.update(lr=3e-3, warmup_steps=100)
  c.eval.update(every_steps=200, tasks="", batch_size=32)
  s = c.study
  s.lrs = ()
  s.only = LM_VARIANTS
  s.seeds = (0, 1)               # two seeds (spread = their range): the cut to fit 90 minutes
  s.niah = "none"
  s.niah_metric = ""
  s.recall_metric = ""
  s.sweep_metric = "-eval/lm/bpb"
  s.lm_eval = True
  s.lm_extrapolate = 4           # windows of 4 x seq_len for the by-position table
  s.lm_windows = 16              # held-out windows per length
  s.readme_marker = "study_lm"   # README section between <!-- study_lm:begin/end -->
  s.throughput_seq_lens = ()
  return c
