#!/usr/bin/env bash
# On a CUDA machine (a session lent a GPU): build the fused kernels, run the GPU tests, the kernel benchmark and a
# GPT-2 124M training run (s=1024, bf16, one GPU), then print one summary. Not part of CI (CI has no GPU).
#
#   bash scripts/gpu_check.sh                  # uses the python on PATH (torch with CUDA must be installed)
#   WHEELS=dir bash scripts/gpu_check.sh       # first pip-installs every wheel in dir (deepspeed, hjson, ...;
#                                              # scripts/gpu_wheels.sh makes them in .whl for the GPU image)
#   OUT=dir                                    # where logs and JSON go (default /tmp/trident-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/trident-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
summary=()
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1 t0=$SECONDS rc
  shift
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-16s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$OUT/$name.log")")
  return $rc
}
if [ -n "${WHEELS:-}" ]; then
  step wheels "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
step build "$PY" -m pip install --no-build-isolation --no-deps -e .
step kernels-status "$PY" -c "
from megatron import fused_kernels as fk
for kind in ('cpu', 'cuda'):
    fk.extension(kind)
print(fk.status())"
step pytest-gpu "$PY" -m pytest -m gpu -q -p no:cacheprovider
step bench-bf16 "$PY" -m benchmarks.bench_kernels --device cuda --dtype bf16 --repeats 10 --json "$OUT/kernels_bf16.json"
step bench-fp32 "$PY" -m benchmarks.bench_kernels --device cuda --dtype fp32 --repeats 10 --json "$OUT/kernels_fp32.json"
step train-124m "$PY" pretrain_gpt.py \
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
  --max-position-embeddings 1024 --vocab-size 50257 --tokenizer-type NullTokenizer --mock-data \
  --micro-batch-size 8 --global-batch-size 8 --train-iters 30 --lr 6e-4 --bf16 \
  --log-interval 5 --eval-iters 0 --metrics-file "$OUT/train_124m.jsonl"
step train-summary "$PY" -c "
import json, statistics
rows = [json.loads(x) for x in open('$OUT/train_124m.jsonl') if 'tokens_per_sec' in x]
tail = [r for r in rows if r.get('iteration', 0) > 10] or rows
print('GPT-2 124M bf16 s=1024 b=8: tokens/s %.0f, TFLOP/s %.1f, MFU %s' % (
    statistics.median(r['tokens_per_sec'] for r in tail),
    statistics.median(r['tflops_per_device'] for r in tail),
    statistics.median(r['mfu'] for r in tail) if tail[0].get('mfu') is not None else 'n/a'))"
echo "==== summary (logs in $OUT)"
printf '%s\n' "${summary[@]}"
for f in kernels-status pytest-gpu bench-bf16 train-summary; do
  echo "---- $f"; tail -n 25 "$OUT/$f.log"
done
