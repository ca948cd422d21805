"""The attention-sink study: does a model pre-trained with a sink stream with that one sink?

StreamingLLM (Xiao et al. 2023, section 3.3, Table 3; docs/papers.md §3.3) pre-trains 160M
models three ways (vanilla, softmax1 = a zero sink, one learnable sink token prepended to every
sample) and streams them with 0 + 1024, 1 + 1023, 2 + 1022 and 4 + 1020 cache entries (kept
first tokens + recent window): the sink-token model needs only its sink, the vanilla model
about 4 first tokens, softmax1 helps only partly. This config scales that to a 2-core CPU:

  python experiments/study.py --config=configs/study_sinks.py \\
      --config.data.paths=../shared/data/tinyshakespeare/input.txt --workdir=runs/study_sinks
  python experiments/study.py --report=runs/study_sinks --readme=docs/studies.md \\
      --assets=docs/study_sinks

Models (equal parameters within 2%, matched by the SwiGLU width; same data, steps, seeds, lr):
  vanilla      4 attention layers, RoPE
  sink_token   one learnable sink token prepended to every row (model.sink_tokens = 1)
  softmax1     a zero sink logit in every head (the paper's "zero sink")
  sink_logit   a learned per-head sink logit (gpt-oss's `sinks`), init 0 = softmax1 at step 0
  sisa         SISA (d_state 8) in every layer: its decaying importance term
  fox          Forgetting Attention in every layer (no RoPE, gate bias 0 as its paper)
No window-2 layer (unlike the MQAR and LM studies): the sink question is about stacks of one
softmax mixer, as the paper's Pythia models.

Data: tinyshakespeare, byte tokenizer (vocab 257), one document per line joined by EOS into
one stream; the held-out part is the data's own last 2% (never trained on). Training windows
start at a random token (`data.window_offset = "random"`, data/offsets.py): no training row
starts at a line's first byte by construction, so whatever the model uses as its sink is
learned from position, not from an EOS or a line start.

After training (attn_jax/study/sinks.py): the held-out stream (its first
`study.sink_stream_tokens` tokens, 32 x the cache) scored under dense attention, window(W),
re-computation over W, and the StreamingLLM layouts k + (W - k) for k in `study.sink_keep`;
W = `study.sink_cache` = 128, half the training length as the paper's 1024 of 2048. Then the
attention each layer puts on the sink token, the first real tokens and the sink-logit column
(eval/attention_mass.py's maps), on `study.sink_mass_seqs` held-out windows of the training
length.

Size and budget: d_model 96, 4 layers, 4 heads, seq 256, batch 16 (4,096 tokens per step),
600 steps (2.5M tokens, ~2.2 passes over tinyshakespeare's 1.1 MB), lr 3e-3 for every model,
two seeds: 12 training runs plus 12 x 6 stream scores. The estimate for the whole study on
the 2-core CPU is 50-65 minutes (not measured: scaled from the LM study's 14.1 min for 12
runs of 2.5M tokens at d_model 64 / 2 layers, by the 3.6x larger per-token compute, plus
compiling 6 stream programs per model); the study's section records the measured time.
What is cut to fit: the paper's 160M / 2048 / 1024 becomes ~0.5M / 256 / 128, byte tokens,
and the 2 + (W - 2) column.
"""

from configs import study_tiny

SEQ = 256
CACHE = 128

VARIANTS = (
    ("vanilla", "", (("model.mixer", "attention"),),
     "4 attention layers, RoPE, N(0, 0.02) init (GPT-2); the paper's vanilla Pythia recipe"),
    ("sink_token", "model.d_ff", (("model.mixer", "attention"), ("model.sink_tokens", 1)),
     "one learnable sink token prepended to every training row (StreamingLLM section 3.3)"),
    ("softmax1", "model.d_ff", (("model.mixer", "attention"),
                                ("model.attention.sink_logit", "softmax1")),
     "softmax1: a sink logit fixed at 0 in every head (the paper's zero sink; Miller 2023)"),
    ("sink_logit", "model.d_ff", (("model.mixer", "attention"),
                                  ("model.attention.sink_logit", "learned")),
     "a learned per-head sink logit (gpt-oss `sinks`), init 0"),
    ("sisa", "model.d_ff", (("model.mixer", "sisa"), ("model.sisa.d_state", 8)),
     "SISA d_state 8 in every layer, the authors' init (docs/papers.md §1.1)"),
    ("fox", "model.d_ff", (("model.mixer", "fox"),),
     "Forgetting Attention in every layer (Lin et al. 2025): no RoPE, forget-gate bias 0"),
)


def get_config():
  c = study_tiny.get_config()
  c.model.update(mixer="attention", pattern=(), vocab_size=257, vocab_multiple=1, d_model=96,
                 n_layers=4, n_heads=4, d_ff=256, max_seq_len=SEQ)
  c.data.update(source="text", paths="", tokenizer="bytes", seq_len=SEQ, global_batch_size=16,
                text_document="line", eval_fraction=0.02, window_offset="random")
  c.train.update(steps=600, log_every=50)
  c.optim.update(lr=3e-3, warmup_steps=100)
  c.checkpoint.update(every_steps=300, max_to_keep=1)
  c.eval.update(every_steps=300, tasks="", batch_size=16)
  s = c.study
  s.variants = VARIANTS
  s.baseline = "vanilla"
  s.only = ""
  s.lrs = ()
  s.seeds = (0, 1)
  s.niah = "none"
  s.niah_metric = ""
  s.recall_metric = ""
  s.sweep_metric = "-eval/lm/bpb"
  s.lm_eval = True
  s.lm_extrapolate = 1           # held-out bits per byte at the training length only
  s.lm_windows = 16
  s.readme_marker = "study_sinks"
  s.throughput_seq_lens = ()
  s.sink_stream = True           # the stream phase (attn_jax/study/sinks.py)
  s.sink_cache = CACHE           # W: cache entries of every bounded layout
  s.sink_keep = (0, 1, 4)        # StreamingLLM layouts k + (W - k)
  s.sink_stream_tokens = 32 * CACHE
  s.sink_chunk = 64              # tokens per cached scoring call
  s.sink_mass_seqs = 4           # held-out windows of data.seq_len for the attention mass
  s.sink_mass_min_query = 16     # queries before this position are not averaged
  s.sink_tolerance = 0.05        # nats/token: "streams with k kept" = within this of 4 kept
  return c
