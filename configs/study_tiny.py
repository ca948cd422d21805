"""The comparison study at laptop scale: every variant on generated MQAR data, equal parameter
count, equal tokens, equal seeds, one trainer and one evaluator, on a 2-core CPU;
each variant in its authors' configuration, at the best lr of a sweep.

  python experiments/study.py --config=configs/study_tiny.py --workdir=runs/study
  python experiments/study.py --report=runs/study --readme=docs/studies.md --assets=docs/study

The task and the shared trunk are the quickstart's (configs/quickstart.py, where the reasoning
is): MQAR with 8 fresh key->value pairs followed by the 8 keys asked again back to back, 31
tokens, key/value vocabulary 32 (vocab 96); d_model 64, 4 heads (head dim 16), fp32; batch 128,
AdamW (wd 0.1 on weights and embeddings only: `layers.PARAM_KINDS`) with 100 warm-up steps,
cosine. The attention variants start with the same local-attention layer of window 2 (each
token sees itself and the one before: it writes each key into its value's position), then the
variant's own layer(s); the SSMs use their own short conv (Mamba-2, d_conv 4) or none (Mamba-3)
instead, as their authors stack them (two blocks):

  transformer       sliding_window(2) -> attention
  sisa_ds8/_ds16    sliding_window(2) -> SISA (d_state 8 / 16)
  mamba2/mamba3     Mamba-2 -> Mamba-2 / Mamba-3 -> Mamba-3 (with the block's MLP)
  mamba3_mimo       as mamba3, MIMO rank 4
  sinkhorn          sliding_window(2) -> Sinkhorn attention (causal, blocks of 16)
  hybrid_block      sliding_window(2) -> attention -> Mamba-2 (no MLP)
  hybrid_heads      sliding_window(2) -> half attention heads, half SSM heads
  fox / alibi       sliding_window(2) -> Forgetting Attention / ALiBi (no RoPE)
  fox_open          fox with its forget gate opened at init (decay time 1024 tokens)
  *_sink            the Transformer / SISA d_s 8 with one learnable sink token

The default run (`study.only` = CORE) is every method once: sisa_ds16, the MIMO variant (the
costliest run: its rank-4 update), hybrid_block and the two sink-token variants (EXTRA) are the
cut that keeps it within a 90-minute budget on 2 cores, sweep included; `--config.study.only=`
runs all 14. The SSMs' chunk is 32 >= T, so SSD is one chunk (its quadratic form; the output
does not depend on the chunk size, tests/test_ssd.py), the fastest form on CPU at this length;
MIMO's is 8, where its rank-4 update runs faster than at 32 (docs/studies.md).

Every variant declares its setting and source (the 4th entry of VARIANTS, shown in the
report). Initialisation is each mixer's own (Mamba-2/3: mamba_ssm's fan-in projections, dt,
A_log, D; module docstrings). Learning rate: swept for every variant over `study.lrs` = 1e-3,
3e-3 on seed 0 (Zoology sweeps logspace(-4, -2) and reports the best), then seeds 1, 2 at the
best by held-out recall; the sweep table is in the report. 1e-2 is left out of the sweep to fit
the budget: it lost to a lower lr for the Transformer, SISA and Mamba-2 alike (the figures
are in docs/studies.md).

The published point this scales down: Zoology's MQAR (Arora et al. 2023, section 3 and Fig. 2;
docs/papers.md §8.3): 2-layer models at d_model 64-512, vocab 8192, 4-64 key-value pairs at
T 64-256, ~12k-22k steps, best lr of a sweep, where attention solves MQAR at every width and gated
convolutions/SSMs need state (width) growing with the number of pairs. Here: T 31 with 8 pairs
(the smallest pairs-per-token ratio's order), vocab 96, d_model 64, 600 steps (2.4M tokens):
~20-40x fewer steps than Zoology; 9 variants x (2 sweep lrs + 2 seeds) = 36 runs
(docs/studies.md gives their time). At this budget the SSMs learn slowly: the sweep table shows
where each one stands. The state-size ordering of the Mamba-2 paper (Fig. 8) has its own config,
configs/study_mqar_state.py.

Parameters are matched to the Transformer's (attn_jax/study/matching.py): by d_ff (Mamba-2 and
the MIMO variant keep their declared expansion and state), or for Mamba-3 by its expansion in
whole heads, then its d_state. Evaluation every
`eval.every_steps`: held-out loss/accuracy at the answers, `mqar` = recall accuracy over all 8
queries (attn_jax.eval.run.task_callback) and the MQAR-space needle (attn_jax/study/needle.py)
at context 17: the 8 pairs, then one query, the first of its sequence (so the "values not
asked yet" shortcut is worth only 1/8), with the needle pair written first (depth 0, 16 tokens
back), in the middle or last (depth 1). Longer needle contexts put noise tokens between the
pairs and the query; the back-to-back training data has none, and in a trial (C 31) every
model scored near chance there, so the grid stays at the training layout.
`--config.study.only=transformer,sisa_ds8` runs a subset; `study.lrs = ()` skips the sweep
(every variant at optim.lr).
"""

import math

import ml_collections

from configs import base

WINDOW = "sliding_window"
SSM_TINY = (("d_state", 16), ("head_dim", 16), ("chunk_size", 32))


def _ssm(mixer, extra=()):
  return tuple((f"model.{mixer}.{k}", v) for k, v in SSM_TINY + tuple(extra))


def _ssm_only(mixer):
  """Two blocks of the SSM alone: its own short conv (or none) replaces the window layer."""
  return (("model.pattern", (mixer, mixer)), ("model.n_layers", 2))


def _second(*layers):
  """The pattern: the shared window-2 layer, then `layers`; n_layers follows."""
  return (("model.pattern", (WINDOW,) + layers), ("model.n_layers", 1 + len(layers)))


# FoX's forget-gate bias for a decay time of tau = 1024 tokens at init (longer than any context
# of these studies): -1 / log sigmoid(b) = tau.
FOX_OPEN_TAU = 1024
FOX_OPEN_BIAS = round(-math.log(math.expm1(1.0 / FOX_OPEN_TAU)), 4)

# (name, match field, overrides, declared setting and its source). Each variant runs in its
# authors' configuration; the lr is not declared: it is swept (study.lrs) for every variant.
VARIANTS = (
    ("transformer", "", (),
     "window-2 layer + attention, the quickstart layout; N(0, 0.02) init (GPT-2)"),
    ("sisa_ds8", "model.d_ff", _second("sisa") + (("model.sisa.d_state", 8),),
     "SISA init and lambda treatment of the authors' models/sisa.py (docs/papers.md §1.1)"),
    ("sisa_ds16", "model.d_ff", _second("sisa") + (("model.sisa.d_state", 16),),
     "as sisa_ds8, d_state 16 (the paper's 152M setting)"),
    ("mamba2", "model.d_ff",
     _ssm_only("mamba2") + _ssm("mamba2", (("d_state", 64), ("expand", 2.0))),
     "two Mamba-2 blocks, their own short conv (d_conv 4) instead of the window layer; expand 2 "
     "(mamba_ssm's default), d_state 64 (the middle state of the Mamba-2 paper's MQAR figure); "
     "mamba_ssm init (fan-in projections, dt/A_log/D as modules/mamba2.py)"),
    ("mamba3", "model.mamba3.expand,model.mamba3.d_state",
     _ssm_only("mamba3") + _ssm("mamba3"),
     "two Mamba-3 blocks as the paper stacks them (no conv, no window layer); mamba_ssm init, "
     "A = -softplus (release modules/mamba3.py)"),
    ("mamba3_mimo", "model.d_ff",
     _ssm_only("mamba3") + _ssm("mamba3", (("mimo_rank", 4), ("expand", 1.0),
                                           ("chunk_size", 8))),
     "as mamba3 (4 heads), MIMO rank 4 as the Mamba-3 paper; its wider B/C projections come "
     "out of the MLP, as the paper matches MIMO's parameters; chunk 8 (the result does not "
     "depend on it; faster than 32 on CPU)"),
    ("sinkhorn", "model.d_ff",
     _second("sinkhorn") + (("model.sinkhorn.block_size", 16), ("model.sinkhorn.sortnet_width", 32),
                            ("model.sinkhorn.sort_dim", 8)),
     "blocks of 16: with 8 on 31 tokens a query's own block never holds its pair; "
     "7 iterations, tau 0.75 (Tay et al. 2020)"),
    ("hybrid_block", "model.d_ff", _second("attention", "mamba2:nomlp") + _ssm("mamba2"),
     "window-2, attention, then a Mamba-2 block without MLP (Jamba/Samba interleave)"),
    ("hybrid_heads", "model.d_ff", _second("hybrid_heads") + _ssm("hybrid_heads"),
     "attention and Mamba-2 heads side by side (Hymba)"),
    ("fox", "model.d_ff", _second("fox"),
     "Forgetting Attention (Lin et al. 2025): window-2 layer + FoX, no RoPE, forget-gate bias 0 "
     "as the paper; the gate's d H + H parameters come out of the MLP"),
    ("fox_open", "model.d_ff", _second("fox") + (("model.fox.forget_bias_init", FOX_OPEN_BIAS),),
     f"fox with the gate opened at init: b_f = -log(expm1(1/tau)) = {FOX_OPEN_BIAS}, tau = "
     f"{FOX_OPEN_TAU} tokens (the authors' decay-time formula, which their code applies to "
     "data-independent gates only): it starts as attention without positions and learns to "
     "forget. The paper's b_f = 0 gives f = 1/2, a one-token half-life at init; tau = 32 "
     "left recall at 14% after 600 steps"),
    ("alibi", "model.d_ff", _second("alibi"),
     "ALiBi (Press et al. 2022): window-2 layer + attention with the paper's slopes, no RoPE"),
    ("transformer_sink", "model.d_ff", (("model.sink_tokens", 1),),
     "one learnable sink token (StreamingLLM, Xiao et al. 2023)"),
    ("sisa_ds8_sink", "model.d_ff",
     _second("sisa") + (("model.sisa.d_state", 8), ("model.sink_tokens", 1)),
     "sisa_ds8 with one learnable sink token"),
)


# What the default study runs (the cut that keeps it, sweep included, within its 90-minute
# budget on 2 cores): every method once. `--config.study.only=` (empty) adds the second SISA
# state size, Mamba-3 MIMO, the block hybrid and the two sink-token variants.
EXTRA = ("sisa_ds16", "mamba3_mimo", "hybrid_block", "transformer_sink", "sisa_ds8_sink")
CORE = ",".join(v[0] for v in VARIANTS if v[0] not in EXTRA)


def study_defaults() -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.variants = VARIANTS
  s.baseline = "transformer"
  s.only = ""                    # comma-separated subset of the variants ("" = all of them)
  s.seeds = (0, 1, 2)
  s.lrs = (1e-3, 3e-3)           # the lr sweep (seed sweep_seed), then all seeds at the best
  s.sweep_seed = -1              # -1: the first of `seeds`
  s.sweep_metric = ""            # "" = recall_metric (higher is better)
  s.param_tolerance = 0.02       # |params - baseline| / baseline allowed after matching
  s.d_ff_multiple = 4            # d_ff matched in steps of this
  s.niah = "synthetic"           # synthetic (attn_jax/study/needle.py) | text (eval task niah) | none
  s.niah_metric = "eval/needle/acc"
  s.recall_metric = "eval/mqar/acc"
  s.needle_lengths = (17,)       # needle grid: context lengths (<= data.seq_len)
  s.needle_depths = (0.0, 0.5, 1.0)
  s.needle_samples = 64
  s.lm_eval = False              # language-modelling metrics (attn_jax/study/lm.py)
  s.lm_extrapolate = 4
  s.lm_windows = 16
  s.readme_marker = "study"      # the README section: <!-- study:begin --> ... <!-- study:end -->
  s.throughput_seq_lens = (256, 512, 1024)
  s.throughput_batch_tokens = 2048
  s.throughput_steps = 3
  s.throughput_repeats = 1
  s.sink_stream = False          # the sink study's stream phase (configs/study_sinks.py)
  return s


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=96, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=1024,
                 dtype="float32", init_std=0.02)
  c.model.pattern = (WINDOW, "attention")
  c.model.sliding_window.window = 2
  c.data.update(source="synthetic", synthetic_task="mqar", seq_len=31, global_batch_size=128,
                mqar_num_pairs=8, mqar_num_queries=8, mqar_vocab=32)
  c.train.update(steps=600, log_every=50, progress_bar=False)
  c.optim.update(lr=3e-3, warmup_steps=100, weight_decay=0.1)
  c.checkpoint.update(every_steps=300, max_to_keep=1)
  c.eval.update(every_steps=100, tasks="mqar", batch_size=128)
  c.study = study_defaults()
  c.study.only = CORE
  return c
