#!/usr/bin/env bash
# CPU quickstart: a tiny GPT on synthetic data (--mock-data), 2 processes (TP=2) on gloo, fp32, ~1 minute.
#   bash examples/pretrain_gpt_cpu_quickstart.sh
# Then plot:  python -m tools.plot_metrics runs/quickstart/metrics.jsonl --out runs/quickstart/loss.png
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

NPROC=2
WORLD=$NPROC
OUT=${OUT:-runs/quickstart}

ARGS=(
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
  --max-position-embeddings 64
  --attention-dropout 0.0 --hidden-dropout 0.0
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
  --micro-batch-size 4 --global-batch-size 8
  --train-iters 100 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10
  --weight-decay 0.01 --clip-grad 1.0
  --mock-data --vocab-size 255 --split 98,2,0
  --eval-interval 50 --eval-iters 5
  --log-interval 10
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
torchrun --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}"
