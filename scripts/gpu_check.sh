#!/usr/bin/env bash
# The device check: one command on a CUDA machine (a session lent a GPU: <= 600 s per command) that always reports.
# Each step runs under its own timeout and prints one verdict line as it finishes (to stdout and, at once, to
# $OUT/summary.txt):   gpu-check: NAME VERDICT SECONDS KEY   (VERDICT: PASS, FAIL, SKIP or TIMEOUT).
# A global deadline (GPU_CHECK_BUDGET, 480 s) skips the steps that no longer fit instead of having them killed.
#
#   step      timeout  expected  runs when       what
#   wheels     60 s    0.2 min   always          the carried wheels (.whl, scripts/gpu_wheels.sh) the image lacks,
#                                                pip install --target $WORK/site (put on PYTHONPATH), never the image
#   env        90 s    0.3 min   always          nvidia-smi, python/torch/CUDA versions, capability, imports
#                                                (deepspeed, pytest, megatron.model); sets TORCH_CUDA_ARCH_LIST
#   build     240 s    1.5 min   CUDA            the CUDA extension JIT-built for this device's architecture only,
#                                                the whole compiler output in the log
#   pytest    150 s    1.5 min   CUDA            pytest -m "gpu and not slow" (the files holding gpu tests)
#   stress     90 s    0.5 min   always          benchmarks/gpu_stress.py (CUDA: large shapes, bf16 + fp32;
#                                                CPU: small shapes)
#   gpt2      120 s    0.7 min   CUDA            GPT-2 124M bf16, s=1024 b=8, 20 iterations: tokens/s, MFU
#   llama     150 s    1.0 min   CUDA            LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA) --no-flash-attn bf16, 20
#                                                iterations with kernels on and off: max loss difference (<= 0.05)
#   fp16       90 s    0.5 min   CUDA            fp16 with DeepSpeed's dynamic loss scale: scale, skips, finite loss
#   bench      90 s    0.7 min   CUDA, if time   benchmarks/bench_kernels.py bf16: kernel vs reference per op
#   memcheck  120 s    1.0 min   CUDA, if time   compute-sanitizer --tool memcheck on the stress script's tiny case
#                                                (where compute-sanitizer exists)
#   expected in all: ~6 min of required steps, ~8 min with both optional ones.
#
#   OUT=/tmp/o bash scripts/gpu_check.sh      # $OUT: summary.txt, logs.tar (every step's log and data), and the
#                                             # running step's NAME.log (each log is appended to logs.tar and
#                                             # removed once its step ends: a killed command still leaves
#                                             # evidence, and few files); default: gpu-check-out/ in the repository
# Settings: PYTHON (python), WHEELS (.whl), GPU_CHECK_WORK (scratch: wheels target, kernel cache; default
# $TMPDIR/trident-gpu-check), GPU_CHECK_BUDGET (480 s), GPU_CHECK_TIMEOUT_<NAME> (one step's timeout, seconds).
# Test hooks: GPU_CHECK_DRY_RUN=1 (every step prints its command instead of running it), GPU_CHECK_HANG=a,b (those
# steps sleep until their timeout), GPU_CHECK_FAIL=a,b (those steps fail). The script exits 0 whenever it wrote its
# report: the verdicts are the result. GPU_CHECK_DEFINE_ONLY=1 with `source` defines the flag arrays and returns.
set -uo pipefail

# The training runs' flags (tests/test_gpu_check.py parses and validates them).
GPT2_ARGS=(
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
  --max-position-embeddings 1024 --vocab-size 50257 --tokenizer-type NullTokenizer --mock-data
  --micro-batch-size 8 --global-batch-size 8 --train-iters 20 --lr 6e-4 --bf16
  --log-interval 1 --eval-iters 0
)
LLAMA_ARGS=(
  --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 --num-key-value-heads 4
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000 --tokenizer-type NullTokenizer --mock-data
  --micro-batch-size 4 --global-batch-size 4 --train-iters 20 --lr 3e-4 --bf16
  --swiglu --normalization rmsnorm --use-rotary-position-embeddings --untie-embeddings-and-output-weights
  --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --no-flash-attn
  --log-interval 1 --eval-iters 0 --seed 1234
)
# the default initial scale (2^32): the first iterations overflow and are skipped while the scale comes down
FP16_ARGS=(
  --num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --vocab-size 50257 --tokenizer-type NullTokenizer --mock-data --micro-batch-size 4 --global-batch-size 4
  --train-iters 30 --lr 3e-4 --fp16 --log-interval 1 --eval-iters 0
)
if [[ "${GPU_CHECK_DEFINE_ONLY:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

# name timeout(s) expected(min) optional(0/1) needs-CUDA(0/1): the header's table
STEPS=(
  "wheels 60 0.2 0 0"
  "env 90 0.3 0 0"
  "build 240 1.5 0 1"
  "pytest 150 1.5 0 1"
  "stress 90 0.5 0 0"
  "gpt2 120 0.7 0 1"
  "llama 150 1.0 0 1"
  "fp16 90 0.5 0 1"
  "bench 90 0.7 1 1"
  "memcheck 120 1.0 1 1"
)

SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
CALLER_DIR="$PWD"  # a relative OUT or GPU_CHECK_WORK is taken from where the script was started
cd "$(dirname "$SELF")/.." || exit 1
PY="${PYTHON:-python}"
HELPER=scripts/gpu_check_steps.py

# ---- step bodies: `bash scripts/gpu_check.sh --step NAME` runs one (the driver below runs it under `timeout`).
step_wheels() {
  local wheels="${WHEELS:-.whl}"
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "KEY: no wheels in $wheels (scripts/gpu_wheels.sh makes them); the image's packages only"
    return 0
  fi
  "$PY" "$HELPER" wheels "$wheels" "$WORK/site"
}
step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader ||
    echo "nvidia-smi: not available"
  command -v nvcc && nvcc --version | tail -n 2
  "$PY" "$HELPER" env "$WORK/env.txt"
}
step_build() { "$PY" "$HELPER" build; }
step_pytest() {
  local files timeout_flag=()
  mapfile -t files < <(grep -rlE 'mark\.gpu|marks=pytest\.mark\.gpu' tests --include='*.py' | sort)
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout=120)
  # addopts cleared: the default -m 'not slow' and --timeout=600 (pytest-timeout may be missing on the image)
  "$PY" -m pytest -o addopts= -q -rfE -p no:cacheprovider -m "gpu and not slow" \
    --continue-on-collection-errors "${timeout_flag[@]}" "${files[@]}"
  local rc=$?
  echo "KEY: $(grep -E '[0-9]+ (passed|failed|error|skipped|deselected)' "$OUT/pytest.log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
  return $rc
}
step_stress() {
  local device=cuda
  [[ "${CUDA_OK:-0}" == 1 ]] || device=cpu
  "$PY" -m benchmarks.gpu_stress --device "$device" --json "$OUT/stress.json"
  local rc=$?
  echo "KEY: $(tail -n 1 "$OUT/stress.log" | cut -c1-200)"
  return $rc
}
step_gpt2() {
  "$PY" pretrain_gpt.py "${GPT2_ARGS[@]}" --metrics-file "$OUT/gpt2.jsonl" &&
    "$PY" "$HELPER" train "$OUT/gpt2.jsonl"
}
step_llama() {
  "$PY" pretrain_gpt.py "${LLAMA_ARGS[@]}" --metrics-file "$OUT/llama.on.jsonl" 2>&1 |
    tee "$OUT/llama.on.out" || return 1
  local used
  used="$(grep -m 1 -o 'fused kernels (cuda): .*' "$OUT/llama.on.out")"
  if [[ -z "$used" || "$used" == *"PyTorch references"* ]]; then
    echo "KEY: the kernels-on run did not use the CUDA kernels (${used:-no loader line}; see the build step)"
    return 1
  fi
  TRIDENT_NO_KERNELS=1 "$PY" pretrain_gpt.py "${LLAMA_ARGS[@]}" --metrics-file "$OUT/llama.off.jsonl" &&
    "$PY" "$HELPER" compare "$OUT/llama.on.jsonl" "$OUT/llama.off.jsonl"
}
step_fp16() {
  "$PY" pretrain_gpt.py "${FP16_ARGS[@]}" --metrics-file "$OUT/fp16.jsonl" &&
    "$PY" "$HELPER" fp16 "$OUT/fp16.jsonl"
}
step_bench() {
  "$PY" -m benchmarks.bench_kernels --device cuda --dtype bf16 --repeats 10 --json "$OUT/bench.json" &&
    "$PY" "$HELPER" bench "$OUT/bench.json"
}
step_memcheck() {
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
  if [[ -z "$sanitizer" ]]; then
    echo "KEY: compute-sanitizer not found"
    return 3
  fi
  # no caching allocator: every tensor its own allocation, so a read past its end is seen, not a neighbour's
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$PY" -m benchmarks.gpu_stress --device cuda --size tiny --checks reference,unaligned
  local rc=$?
  echo "KEY: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -n 1 | sed 's/^=* *//') (rc $rc)"
  return $rc
}

in_list() { [[ ",${2}," == *",$1,"* ]]; }

if [[ "${1:-}" == --step ]]; then
  name=$2
  if in_list "$name" "${GPU_CHECK_HANG:-}"; then
    echo "GPU_CHECK_HANG: $name sleeps until its timeout"
    exec sleep 100000
  fi
  if in_list "$name" "${GPU_CHECK_FAIL:-}"; then
    echo "KEY: failed on purpose (GPU_CHECK_FAIL)"
    exit 3
  fi
  if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then
    echo "dry run: the step would run"
    declare -f "step_$name"
    echo "KEY: dry run"
    exit 0
  fi
  "step_$name"
  exit $?
fi

# ---- the driver
OUT="${OUT:-$PWD/gpu-check-out}"
WORK="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/trident-gpu-check}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
OUT="$(cd "$CALLER_DIR" && mkdir -p "$OUT" && cd "$OUT" && pwd)" || exit 1
WORK="$(cd "$CALLER_DIR" && mkdir -p "$WORK" && cd "$WORK" && pwd)" || exit 1
SUMMARY="$OUT/summary.txt"
rm -f "$OUT/logs.tar"  # this run's logs only
export OUT WORK PYTHON="$PY"
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$WORK/site/bin:$PATH"  # bin: ninja
export TRIDENT_KERNEL_CACHE="$WORK/kernels" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$SECONDS
verdicts=()

say() { echo "$*" | tee -a "$SUMMARY"; }

{
  echo "# gpu_check $(date -u +%FT%TZ) on $(hostname): budget ${BUDGET} s, logs in logs.tar"
  echo "# steps (timeout s, expected min, optional, needs CUDA): ${STEPS[*]/%/;}"
} | tee "$SUMMARY"

archive() {  # archive NAME: move the step's log and data files (NAME.*) into logs.tar
  local files=()
  mapfile -t files < <(cd "$OUT" && ls -1 -- "$1".* 2>/dev/null)
  ((${#files[@]})) || return 0
  tar -C "$OUT" -rf "$OUT/logs.tar" -- "${files[@]}" && (cd "$OUT" && rm -f -- "${files[@]}")
}

verdict() {  # verdict NAME VERDICT SECONDS KEY: print it and append it to the summary at once
  local line
  line="$(printf 'gpu-check: %-9s %-7s %4ss  %s' "$1" "$2" "$3" "$4")"
  verdicts+=("$line")
  say "$line"
}

run_step() {  # run_step NAME TIMEOUT OPTIONAL NEEDS_CUDA
  local name=$1 limit=$2 optional=$3 needs_cuda=$4 left rc t0 key verdict override
  override="GPU_CHECK_TIMEOUT_${name}"
  limit="${!override:-$limit}"
  left=$((BUDGET - (SECONDS - START)))
  if [[ "$needs_cuda" == 1 && "${CUDA_OK:-0}" != 1 && "${GPU_CHECK_DRY_RUN:-0}" != 1 ]]; then
    verdict "$name" SKIP 0 "no CUDA device (see env)"
    return
  fi
  if ((optional == 1 && left < limit)); then
    verdict "$name" SKIP 0 "${left} s left of the budget < its timeout ${limit} s"
    return
  fi
  if ((left < 10)); then
    verdict "$name" SKIP 0 "budget spent (${left} s left)"
    return
  fi
  ((limit > left)) && limit=$left
  t0=$SECONDS
  timeout --kill-after=10 "$limit" bash "$SELF" --step "$name" >"$OUT/$name.log" 2>&1
  rc=$?
  key="$(grep '^KEY: ' "$OUT/$name.log" | tail -n 1 | cut -c6-)"
  [[ -n "$key" ]] || key="$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160)"
  case $rc in
    0) verdict=PASS ;;
    124 | 137) verdict=TIMEOUT key="killed after ${limit} s; last: ${key}" ;;
    *) verdict=FAIL key="rc ${rc}: ${key}" ;;
  esac
  verdict "$name" "$verdict" "$((SECONDS - t0))" "$key"
  if [[ "$verdict" != PASS ]]; then
    tails+=("---- $name (last 15 lines of $name.log)" "$(tail -n 15 "$OUT/$name.log")")
  fi
  if [[ "$name" == env && -f "$WORK/env.txt" ]]; then
    # shellcheck disable=SC1091
    source "$WORK/env.txt"
    [[ -n "${ARCH:-}" ]] && export TORCH_CUDA_ARCH_LIST="$ARCH"
    export CUDA_OK="${CUDA_OK:-0}"
  fi
  archive "$name"
}

tails=()
for row in "${STEPS[@]}"; do
  read -r name limit _expected optional needs_cuda <<<"$row"
  run_step "$name" "$limit" "$optional" "$needs_cuda"
done

# The end: the tails of the steps that did not pass, then the verdicts again (the last lines a caller sees).
((${#tails[@]})) && printf '%s\n' "${tails[@]}"
echo "==== gpu_check summary ($((SECONDS - START)) s; $OUT/summary.txt, logs in $OUT/logs.tar)"
printf '%s\n' "${verdicts[@]}"
echo "# done in $((SECONDS - START)) s" >>"$SUMMARY"
exit 0
