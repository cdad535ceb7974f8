#!/usr/bin/env bash
# GPT-2 small (125M) on one node of 8 GPUs: data parallel 8, ZeRO-1, bf16, GPT-2 BPE data made by
# tools/preprocess_data.py (prefix my-gpt2_text_document).
#   bash examples/pretrain_gpt2_125m_8gpu.sh
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

GPUS_PER_NODE=8
WORLD=$GPUS_PER_NODE
DATA=${DATA:-data/my-gpt2_text_document}
VOCAB=${VOCAB:-data/gpt2-vocab.json}
MERGES=${MERGES:-data/gpt2-merges.txt}
OUT=${OUT:-runs/gpt2-125m}

ARGS=(
  # GPT-2 small: 12 x 768, 12 heads, context 1024, learned positions, LayerNorm, GeLU, tied embeddings.
  --num-layers 12 --hidden-size 768 --num-attention-heads 12
  --seq-length 1024 --max-position-embeddings 1024
  --attention-dropout 0.1 --hidden-dropout 0.1
  # 8 x 8 x 1 = 64 sequences = 64K tokens per step (no gradient accumulation).
  --micro-batch-size 8 --global-batch-size 64
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --zero-stage 1
  --bf16
  --train-iters 100000 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --data-path "$DATA" --split 949,50,1
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES"
  --eval-interval 1000 --eval-iters 20 --log-interval 10
  --save "$OUT/checkpoints" --save-interval 2000 --load "$OUT/checkpoints"
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py "${ARGS[@]}"
