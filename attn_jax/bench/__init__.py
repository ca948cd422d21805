"""Benchmarks behind experiments/bench.py, bench_sinkhorn.py and bench_stream.py. bench.py:
train-step throughput of several configs side by side (tokens/s and ratios, analytic FLOPs
and MFU, compiled peak memory, decode tokens/s):

  configs.py          Options (one field per flag), the named configs and their overrides
                      (dotted config paths, as training's --config.*), study rows
  rows.py             one row: the trainer's step timed, its decode figures; document masking
  printout.py         the printed tables
  suite.py            run(options): every config built first, then the table asked for, JSON
  roofline.py         the machine's measured peak and bandwidth, MFU, the decode bound
  kernel_tuning.py    the decayed-attention kernel's Triton choices timed
  hardware_page.py    docs/hardware.md from compile-only reports (experiments/hardware_page.py)
  sinkhorn_scaling.py Sinkhorn vs dense attention against length (experiments/bench_sinkhorn.py)
  stream.py           StreamingLLM vs window recomputation, constant memory
                      (experiments/bench_stream.py)

Each config is timed with the trainer's jitted train step (forward + backward + clipped AdamW
update with the mixer's optimizer overrides; `attn_jax.train.setup.build_setup`), compiled as
the trainer compiles it (`setup.compile_step`). The first config is the baseline of the
ratios. Reported: best wall time of the timed steps (tok/s, ratio) and the median process CPU
time per step (cpu s, cpu ratio); on a shared machine the CPU time is the steadier comparison.
A `--study` run benches every variant of a study config at its matched parameter count
(attn_jax/study/matching.py) plus the window and StreamingLLM cache policies of
`policy_mixers` (their decode tokens/s is the policy's cost; the train step is the same model).

Analytic training FLOPs per token (stated convention): 6 N_nonembedding + 6 d V (the LM head
matmul, also when tied) + 3 x n_layers x mixer.flops_per_token(seq_len) (attention: only the
causal lower triangle, (L+1)/2 keys per query; backward = 2 x forward), as computed by
`attn_jax.train.flops.train_flops_per_token` for the trainer's logs. Against what the machine
can do (`attn_jax.bench.roofline`, measured in the same run, printed before the tables):
TFLOP/s = tok/s x that; MFU meas = TFLOP/s / (measured matmul peak x devices), the peak being
the best of 5 square `jnp.dot`s in the model's dtype (n = peak_n); MFU sheet = the same against
the datasheet peak (`flops.PEAK_FLOPS` / `PEAK_FLOPS_TF32` by device kind and dtype; n/a where
unknown, e.g. CPU).

Decode against memory bandwidth: per config and each of decode_step_batches, one jitted loop of
decode_steps greedy one-token steps after an untimed prefill of decode_step_prompt random
tokens (capacity = prompt + steps), against bound = batch x copy bandwidth / (param bytes +
state bytes) (`roofline.decode_bytes`: non-embedding parameters + the LM head, each in the
dtype the step reads it in (`Decoder.for_decoding`, as `decode.generate` runs), plus the whole
decoding state); ratio = tok/s / bound. decode_only prints only this
table, for freshly initialised parameters (what device_check.sh runs per mixer).

Memory: the step is compiled ahead of time and its `memory_analysis()` gives the bytes one step
needs (`attn_jax.train.memory.needed_bytes`: arguments + outputs - donated + temporaries +
code); a config/length whose step does not fit the device is skipped with the fit message, so
long seq_lens run "where memory allows".
"""

from attn_jax.bench.configs import (PRESETS, SCALES, Options, named_config,  # noqa: F401
                                    row_policy, study_configs)
from attn_jax.bench.suite import run  # noqa: F401

__all__ = ["PRESETS", "SCALES", "Options", "named_config", "row_policy", "study_configs", "run"]
