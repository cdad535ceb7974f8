#!/usr/bin/env bash
# A LLaMA-2-style model in the shape of Megatron-DeepSpeed's examples_deepspeed/pretrain_llama2_distributed.sh
# (24 x 2048, 16 heads with 4 K/V heads (GQA), SwiGLU FFN 5504, RMSNorm, RoPE, untied embeddings, no biases,
# no dropout), bf16, TP=2 x PP=2 x DP=2 on 8 GPUs, DeepSpeed activation checkpointing with Megatron's full/uniform
# recompute, Adam(0.9, 0.95), W&B logging when LOG_TO_WANDB=1 (offline without network). Launched by torchrun:
#   DATA=data/bookcorpus_text_sentence TOKENIZER=data/tokenizer.model bash examples/ds_pretrain_llama2_distributed.sh
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

GPUS_PER_NODE=8
WORLD=$GPUS_PER_NODE                       # 8 ranks = TP 2 x PP 2 x DP 2
DATA=${DATA:-data/bookcorpus_text_sentence}
TOKENIZER=${TOKENIZER:-data/tokenizer.model}   # the official LLaMA tokenizer.model
OUT=${OUT:-runs/llama2}
DS_CONFIG=$OUT/deepspeed.json

TP=2
PP=2
ZERO_STAGE=0
MICRO_BATCH_SIZE=4
GLOBAL_BATCH_SIZE=32
SEQ_LENGTH=2048
LOG_TO_WANDB=${LOG_TO_WANDB:-0}

WANDB_ARGS=()
if [[ "$LOG_TO_WANDB" == 1 ]]; then
  WANDB_ARGS=(--wandb-project pretrain-llama2 --wandb-exp-name exp0 --wandb-save-dir "$OUT/wandb")
fi

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5504
  --num-attention-heads 16 --num-key-value-heads 4
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters 250000
  --save "$OUT/checkpoints" --load "$OUT/checkpoints"
  --data-path 1 "$DATA" --data-impl mmap --split 949,50,1
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER"
  --distributed-backend nccl
  --lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95
  --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
  --bf16 --no-query-key-layer-scaling --attention-dropout 0 --hidden-dropout 0
  --use-rotary-position-embeddings --untie-embeddings-and-output-weights
  --swiglu --normalization rmsnorm --disable-bias-linear
  "${WANDB_ARGS[@]}"
  --deepspeed --deepspeed_config="$DS_CONFIG" --zero-stage="$ZERO_STAGE"
  --deepspeed-activation-checkpointing --recompute-granularity full --recompute-method uniform
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

mkdir -p "$OUT"
cat > "$DS_CONFIG" <<JSON
{
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "steps_per_print": 1,
  "zero_optimization": {"stage": $ZERO_STAGE},
  "bf16": {"enabled": true}
}
JSON

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes 1 --node_rank 0 \
  --master_addr localhost --master_port 6000 pretrain_gpt.py "${ARGS[@]}"
