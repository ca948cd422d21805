#!/usr/bin/env bash
# One prepared run on a GPU (or TPU) machine: the accelerator-only
# numerics, then train-step throughput / MFU of each variant side by side. Results go to stdout
# and, when $OUT is set (the device tool's output folder), to $OUT/*.txt.
#
#   bash experiments/device_check.sh            # everything (the steps' timeouts cap it at 18.8 min)
#   STEPS="1 5" bash experiments/device_check.sh; STEPS="2 2b" ...; STEPS="3 4" ...  # in calls
#                                               # of 8.6, 7 and 3.2 min (one device command may run
#                                               # 10 min, a session has 15: "1 5" first)
#   QUICK=1 bash experiments/device_check.sh    # numerics + one sequence length only
#   JAX_PLATFORMS=cpu ATTN_JAX_GPU_TESTS_IMPL=xla BENCH_EXTRA="--scale=tiny --dtype=float32 \
#     --seq_lens=128 --steps=1 --warmup=1 --batch_tokens=4096" bash experiments/device_check.sh  # CPU dry run
#
# The device image has jax with CUDA, flax, optax, orbax and chex, and no network. The other
# packages the numerics and the bench need, ml-collections and pytest (pure Python), are carried in
# .device_deps (git-ignored; make it with
#   .venv/bin/pip install --target .device_deps --no-deps ml-collections pytest pluggy iniconfig
# and pass carry=[".device_deps"] to the device run). grain, tokenizers and tensorboardX are not
# needed here: the trainer imports them only when it trains on real data.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/attn_jax_device_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"
want() { [[ " ${STEPS:-1 5 2 2b 3 4} " == *" $1 "* ]]; }  # is step $1 selected?

# 1. numerics on the accelerator: cuDNN core and SISA on it vs the fp32 references, plus the
#    backend-independent attention / SISA / decoding tests (run on the device backend here).
#    The GPU-specific and newest kernels first (1a), so a timeout in the broad list (1b; its
#    compile time alone is minutes) still leaves their result.
# fp32 tests compare at 1e-5: keep fp32 matmuls in full precision (no TF32) for them.
numerics() {  # $1 = timeout s, the rest = test files
  local t="$1"; shift
  JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" XLA_FLAGS="" JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout "$t" python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1 | tail -25
}
want 1 && numerics 145 tests/test_gpu_paths.py tests/test_flash.py tests/test_split.py tests/test_loss.py \
  | tee "$out/numerics.txt"
want 1 && numerics 170 tests/test_attention.py tests/test_decode.py tests/test_sisa.py tests/test_trunk.py \
  tests/test_ssd.py tests/test_mamba.py tests/test_sinkhorn.py tests/test_sinks.py tests/test_fox.py \
  tests/test_mamba3_mimo.py \
  | tee -a "$out/numerics.txt"

# 2. train-step throughput, MFU against the bf16 matmul peak measured in the same run and the
#    datasheet peak (flops.PEAK_FLOPS by device kind), ratios vs the Transformer, bf16, at the
#    152M scale; SISA's paths side by side. (The decode-step table is its own run, 2b.)
seqs="1024,4096"; [ -n "${QUICK:-}" ] && seqs="1024"
# Every variant at 152M: Transformer, SISA (paths), Mamba-2/3, both hybrids, Sinkhorn, sinks, FoX, ALiBi.
want 2 && timeout 320 python3 experiments/bench.py --configs=transformer_152m,sisa_152m,sisa_152m@fast,sisa_152m@chunked,mamba2_152m,mamba3_152m,hybrid_block_152m,hybrid_head_152m,sinkhorn_152m,transformer_152m_sink,fox_152m,alibi_152m \
  --seq_lens="$seqs" --batch_tokens=65536 --steps=5 --warmup=2 --decode_step_batches= ${BENCH_EXTRA:-} \
  2>&1 | grep -v "^[IW][0-9]" | tee "$out/bench.txt"

# 2b. decode against memory bandwidth: one-token decode steps (after a 128-token prefill) at
#     batch 1 and 32 per mixer and cache policy, tokens/s vs copy bandwidth / bytes per step
#     (parameters + decoding state), with the measured copy bandwidth.
want 2b && timeout 100 python3 experiments/bench.py --decode_only --configs=transformer_152m,transformer_152m@streaming,sisa_152m,mamba2_152m,mamba3_152m,hybrid_block_152m,hybrid_head_152m,sinkhorn_152m,transformer_152m_sink,fox_152m,alibi_152m \
  --decode_step_batches=1,32 ${BENCH_EXTRA:-} 2>&1 | grep -v "^[IW][0-9]" | tee "$out/decode.txt"

# 3. SISA's chunked path (with cuDNN: fused past keys per query chunk + biased in-chunk block)
#    against plain attention, compiled fwd+bwd temporaries of one layer vs length on the GPU
#    core: both should grow ~linearly (on CPU attention grows ~T^2, SISA's blockwise path
#    linearly).
want 3 && timeout 100 python3 experiments/mixer_memory.py --mixers=attention,sisa --dtype=bfloat16 \
  --seq_lens=2048,4096,8192,16384 --batch=4 --d_model=768 --n_heads=12 2>&1 \
  | grep -v "^[IW][0-9]" | tee "$out/mixer_memory.txt"

# 4. batch-1 generation of a real LLM's shape (the pretrained prefill speed target): SmolLM2-135M with random
#    weights (its file cannot be carried), fp32, 512-token prompt + 128 greedy tokens, against
#    transformers holding the same weights on the GPU when the image has torch + transformers
#    (otherwise ours alone, said in the output).
# 5. the decayed-attention kernel (kernels/decayed.py) at 152M: train steps (fwd + bwd) of SISA,
#    FoX and ALiBi through it (impl auto on the GPU / TPU) against the Transformer's cuDNN /
#    splash core and SISA's chunked path (per-chunk cuDNN calls + a biased in-chunk block), at
#    T 2048 and 8192 with the same tokens per step. Goal: SISA >= 0.8x the Transformer's step.
long="2048,8192"; [ -n "${QUICK:-}" ] && long="2048"
want 5 && timeout 200 python3 experiments/bench.py --configs=transformer_152m,sisa_152m,sisa_152m@chunked,fox_152m,alibi_152m \
  --seq_lens="$long" --batch_tokens=65536 --steps=5 --warmup=2 --decode_step_batches= --decode_tokens=0 ${BENCH_EXTRA:-} \
  2>&1 | grep -v "^[IW][0-9]" | tee "$out/kernel_speed.txt"

want 4 && timeout 90 python3 experiments/bench_pretrained.py --random=smollm2 --prompt_len=512 \
  --new_tokens=128 --repeats=5 2>&1 | grep -v "^[IW][0-9]" | tee "$out/pretrained_speed.txt"
echo "device_check: steps ${STEPS:-1 5 2 2b 3 4} done; results in $out"
