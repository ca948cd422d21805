#!/usr/bin/env bash
# One prepared run on a GPU (or TPU) machine, one call of at most 9 minutes (the steps' timeouts
# add up to 8.8): the accelerator-only numerics, then train-step throughput of every variant at
# the 152M scale side by side (ratios to the Transformer, host CPU seconds per step, MFU
# against the datasheet and the measured peak, and each step's longest kernels from a profiled
# extra step) at T 2048 and the long rows at 8192, and one-token decode steps against the
# memory-bandwidth bound. Results go to stdout and, when $OUT is set (the device tool's output
# folder), to $OUT/*.txt. Each train row prints a line as soon as it is measured, so a step cut
# by its timeout keeps the rows it did.
#
#   bash experiments/device_check.sh            # steps "1 2 2L 2b" (the default, <= 9 min)
#   STEPS="t" ...                               # the kernel's Triton choices timed (1.5 min)
#   STEPS="3 4 5 2g" bash experiments/device_check.sh   # the longer extras: mixer memory vs T,
#                                               # a real LLM's generation, SISA's paths vs T,
#                                               # decode as CUDA graphs with and without (8.5 min)
#   QUICK=1 bash experiments/device_check.sh    # numerics + T 2048 only
#   JAX_PLATFORMS=cpu ATTN_JAX_GPU_TESTS_IMPL=xla BENCH_EXTRA="--scale=tiny \
#     --set=model.dtype=float32 --steps=1 --warmup=1 --batch_tokens=4096" \
#     TUNE_EXTRA="--tokens=1024 --seq_lens=128" \
#     bash experiments/device_check.sh          # CPU dry run (the sweep step reports no cuDNN;
#                                               # tune_decayed.py runs with --dry_run: no file)
#
# It needs a GPU (or TPU): run plainly where JAX sees neither, its first line says so and it
# stops (exit 2); the CPU dry run above is asked for explicitly with JAX_PLATFORMS=cpu. Every
# selected step runs even when one before it fails (the numerics run every test, no -x), and
# the last line names the steps that failed or timed out (exit 1 then).
#
# The device image has jax with CUDA, flax, optax, orbax and chex, and no network. Carry the
# pure-Python rest in .device_deps (git-ignored):
#   .venv/bin/pip install --target .device_deps --no-deps ml-collections pytest pluggy iniconfig \
#     packaging pygments
# and pass carry=[".device_deps"] to the device run. Training on real data (train.py with
# data.source=jsonl / shards) also imports grain, which needs portpicker and array-record beside
# it, tokenizers and tensorboardX: add `grain portpicker array-record tokenizers tensorboardX`
# to that pip line (their wheels for the device's Python) when the run trains.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"
backend="$(python3 -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -n 1)"
dry=""   # the CPU dry run, asked for explicitly
if [[ "$backend" == cpu && "${JAX_PLATFORMS:-}" == cpu ]]; then
  dry="--dry_run"
elif [[ "$backend" != gpu && "$backend" != tpu ]]; then
  seen="${backend:-no backend (jax did not start)}"
  echo "device_check.sh needs a GPU (or TPU): JAX sees $seen here, so nothing was run. The" \
    "CPU dry run is asked for explicitly: JAX_PLATFORMS=cpu bash experiments/device_check.sh" \
    "(with the header's BENCH_EXTRA and TUNE_EXTRA)" >&2
  exit 2
fi
out="${OUT:-/tmp/attn_jax_device_check}"
mkdir -p "$out"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"
want() { [[ " ${STEPS:-1 2 2L 2b} " == *" $1 "* ]]; }  # is step $1 selected?
failed=()
step() {  # $1 = step name, the rest = its command; a failure is noted and the script goes on
  local name="$1"; shift
  "$@"
  local rc=$?
  (( rc == 124 )) && failed+=("$name (timed out)")
  (( rc != 0 && rc != 124 )) && failed+=("$name (exit $rc)")
  return 0
}
quiet() { grep -v "^[IW][0-9]" || true; }   # JAX's native log lines dropped (none left: fine)

# 1. numerics on the accelerator: the decayed-attention Triton kernel against the float64
#    references, cuDNN and SISA's GPU paths against the fp32 ones. 1x (not in the default, its
#    compile time alone is minutes): the backend-independent attention / SISA / SSM / decoding
#    tests run on the device backend.
# fp32 tests compare at 1e-5: keep fp32 matmuls in full precision (no TF32) for them.
platform="${JAX_PLATFORMS:-$([[ "$backend" == tpu ]] && echo tpu || echo cuda)}"
numerics() {  # $1 = timeout s, the rest = test files; every test runs (no -x: a failure in the
  local t="$1"; shift   # first file used to skip the GPU paths of the second)
  JAX_PLATFORMS="$platform" XLA_FLAGS="" JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -25
}
step1() { numerics 70 tests/test_kernels.py tests/test_gpu_paths.py | tee "$out/numerics.txt"; }
step1x() {
  numerics 170 tests/test_attention.py tests/test_decode.py tests/test_sisa.py tests/test_trunk.py \
    tests/test_ssd.py tests/test_mamba.py tests/test_sinkhorn.py tests/test_sinks.py tests/test_fox.py \
    tests/test_mamba3_mimo.py tests/test_blockwise.py tests/test_lse_merge.py tests/test_loss.py \
    | tee -a "$out/numerics.txt"
}
want 1 && step 1 step1
want 1x && step 1x step1x

# t. (opt-in: kernels/decayed.GPU_TUNING holds its H200 result) the decayed-attention kernel's
#    Triton choices (kernels/decayed.GpuTuning): one SISA layer's fwd + bwd at the 152M shape per
#    candidate, beside cuDNN's flash attention on the same q, k, v. The best (least total time)
#    is written to $out/decayed_tuning.json and the train steps below run with it
#    ($ATTN_JAX_DECAYED_TUNING); the sweep's table gives the default beside it.
stept() {
  timeout 100 python3 experiments/tune_decayed.py --quick --kinds=sisa --seq_lens=2048,8192 \
    --steps=3 --write="$out/decayed_tuning.json" $dry ${TUNE_EXTRA:-} 2>&1 | quiet \
    | tee "$out/tune_decayed.txt"
}
want t && step t stept
[ -s "$out/decayed_tuning.json" ] && export ATTN_JAX_DECAYED_TUNING="$out/decayed_tuning.json"

# 2. train-step throughput, MFU against the bf16 matmul peak measured in the same run and the
#    datasheet peak (flops.PEAK_FLOPS by device kind), ratios vs the Transformer, bf16, at the
#    152M scale; SISA's paths side by side. (The decode-step table is its own run, 2b.)
bench() {  # $1 = timeout s, $2 = configs, $3 = lengths
  timeout "$1" python3 experiments/bench.py --configs="$2" --seq_lens="$3" --batch_tokens=65536 \
    --steps=3 --warmup=1 --decode_step_batches= --decode_tokens=0 --profile_top=8 \
    ${BENCH_EXTRA:-} 2>&1 | quiet
}
step2() {
  bench 250 transformer_152m,sisa_152m,mamba2_152m,fox_152m,alibi_152m,hybrid_head_152m,hybrid_block_152m,sinkhorn_152m,mamba3_152m \
    2048 | tee "$out/bench.txt"
}
want 2 && step 2 step2
# 2L. the long rows: the variants whose cost is per pair of tokens or per chunk, at T 8192
step2L() { bench 130 transformer_152m,sisa_152m,fox_152m,alibi_152m,mamba2_152m 8192 | tee "$out/bench_8192.txt"; }
[ -z "${QUICK:-}" ] && want 2L && step 2L step2L

# 2b. decode against memory bandwidth: one-token decode steps (after a 128-token prefill) at
#     batch 1 and 32 per mixer and cache policy, tokens/s vs copy bandwidth / bytes per step
#     (parameters + decoding state), with the measured copy bandwidth.
step2b() {
  timeout 80 python3 experiments/bench.py --decode_only --configs=transformer_152m,sisa_152m,mamba2_152m \
    --decode_step_batches=1,32 ${BENCH_EXTRA:-} 2>&1 | quiet | tee "$out/decode.txt"
}
want 2b && step 2b step2b

# 2g. (opt-in) decoding as CUDA graphs (attn_jax/command_buffers.py): decoding programs are
#     compiled with XLA command buffers that hold while loops too (the default set + WHILE).
#     experiments/decode_graphs.py compiles each config's one-token step and generation loop
#     for this GPU with and without, reads the thunk dump (fails, exit 1, unless with them the
#     loop is inside a command buffer and nothing of the step is outside one), then times the
#     decode steps (a jitted fori_loop of one-token steps, the bench's decode row) at batch 1
#     and 32 with and without, one process per setting, and the device memory the graphs took
#     (the driver's free bytes without minus with). The dry run compiles for a compile-only
#     H100 instead and times nothing ($GRAPHS_EXTRA's flags come last and win, e.g.
#     GRAPHS_EXTRA="--configs=transformer_50m --prompt=16 --new_tokens=16" for a short dry run).
#     Then train rows with XLA_FLAGS adding WHILE and CONDITIONAL to every program (the layer
#     scan, the loss chunks).
step2g() {
  local where="--target=local --time"
  [ -n "$dry" ] && where="--target=h100x1"
  timeout 420 python3 experiments/decode_graphs.py --configs=transformer_152m,mamba2_152m \
    --check $where ${GRAPHS_EXTRA:-} 2>&1 | quiet | tee "$out/decode_graphs.txt"
}
cb_flags="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
step2g_train() {
  XLA_FLAGS="${XLA_FLAGS:-} $cb_flags" bench 90 transformer_152m,mamba2_152m 2048 \
    | tee "$out/bench_graphs.txt"
}
want 2g && step 2g step2g
want 2g && step "2g (train)" step2g_train

# 3. SISA's chunked path (with cuDNN: fused past keys per query chunk + biased in-chunk block)
#    against plain attention, compiled fwd+bwd temporaries of one layer vs length on the GPU
#    core: both should grow ~linearly (on CPU attention grows ~T^2, SISA's blockwise path
#    linearly).
step3() {
  timeout 100 python3 experiments/mixer_memory.py --mixers=attention,sisa --dtype=bfloat16 \
    --seq_lens=2048,4096,8192,16384 --batch=4 --d_model=768 --n_heads=12 2>&1 \
    | quiet | tee "$out/mixer_memory.txt"
}
want 3 && step 3 step3

# 4. batch-1 generation of a real LLM's shape (the pretrained prefill speed target): SmolLM2-135M with random
#    weights (its file cannot be carried), fp32, 512-token prompt + 128 greedy tokens, against
#    transformers holding the same weights on the GPU when the image has torch + transformers
#    (otherwise ours alone, said in the output).
# 5. the decayed-attention kernel (kernels/decayed.py) at 152M: train steps (fwd + bwd) of SISA,
#    FoX and ALiBi through it (impl auto on the GPU / TPU) against the Transformer's cuDNN /
#    splash core and SISA's chunked path (per-chunk cuDNN calls + a biased in-chunk block), at
#    T 2048 and 8192 with the same tokens per step. Goal: SISA >= 0.8x the Transformer's step.
long="2048,8192"; [ -n "${QUICK:-}" ] && long="2048"
step5() {
  timeout 200 python3 experiments/bench.py --configs=transformer_152m,sisa_152m,sisa_152m@chunked,fox_152m,alibi_152m \
    --seq_lens="$long" --batch_tokens=65536 --steps=5 --warmup=2 --decode_step_batches= --decode_tokens=0 ${BENCH_EXTRA:-} \
    2>&1 | quiet | tee "$out/kernel_speed.txt"
}
want 5 && step 5 step5
step4() {
  timeout 90 python3 experiments/bench_pretrained.py --random=smollm2 --prompt_len=512 \
    --new_tokens=128 --repeats=5 2>&1 | quiet | tee "$out/pretrained_speed.txt"
}
want 4 && step 4 step4
if (( ${#failed[@]} )); then
  list=""; for f in "${failed[@]}"; do list+="${list:+, }$f"; done
  echo "device_check: steps ${STEPS:-1 2 2L 2b} done; FAILED: $list; results in $out"
  exit 1
fi
echo "device_check: steps ${STEPS:-1 2 2L 2b} done; results in $out"
