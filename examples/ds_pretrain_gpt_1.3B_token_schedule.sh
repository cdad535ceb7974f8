#!/usr/bin/env bash
# GPT-3 1.3B (24 x 2048, 16 heads, seq 2048) the way Megatron-DeepSpeed's examples_deepspeed/rebase scripts train it:
# a token-based schedule (stop at 300B tokens, warm up over 3B, cosine decay over 300B tokens), DeepSpeed activation
# checkpointing (activations partitioned across the TP group, checkpoints kept contiguous), fp16 with the
# DeepSpeed loss scaler, TensorBoard with timers, batch size, validation perplexity and optimizer states.
# 8 GPUs on one node: TP=2 x DP=4 (no pipeline), ZeRO stage 0. Launched by the DeepSpeed launcher:
#   DATA=data/pile_text_document bash examples/ds_pretrain_gpt_1.3B_token_schedule.sh
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

WORLD=${WORLD:-8}                          # 8 ranks = TP 2 x DP 4
DATA=${DATA:-data/pile_text_document}
OUT=${OUT:-runs/gpt-1.3b-tokens}

seq_len=2048
global_batch_size=512
micro_batch_size=2
mp_size=2
zero_stage=0
train_tokens=$((300 * 1000000000))         # stop when 300B tokens are consumed ...
train_samples=$((train_tokens * 2 / seq_len))   # ... well before this sample bound (Megatron-DeepSpeed's habit)
lr_warmup_tokens=$((3000 * 1000000))
lr_decay_tokens=${train_tokens}
config_json="$OUT/ds_config_gbs${global_batch_size}_mbs${micro_batch_size}_zero${zero_stage}.json"

ARGS=(
  # model
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length "$seq_len" --max-position-embeddings "$seq_len" --init-method-std 0.013
  # schedule: tokens, not iterations
  --train-tokens "$train_tokens" --train-samples "$train_samples"
  --lr 2.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine
  --lr-warmup-tokens "$lr_warmup_tokens" --lr-decay-tokens "$lr_decay_tokens"
  --override-opt_param-scheduler
  --micro-batch-size "$micro_batch_size" --global-batch-size "$global_batch_size"
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
  --fp16 --hysteresis 2 --seed 1234
  # parallelism: TP 2, no pipeline, DeepSpeed engine
  --tensor-model-parallel-size "$mp_size" --pipeline-model-parallel-size 1 --no-pipeline-parallel
  --deepspeed --deepspeed_config "$config_json" --zero-stage "$zero_stage"
  # DeepSpeed activation checkpointing: every layer, its saved input split across the TP ranks
  --checkpoint-activations --deepspeed-activation-checkpointing
  --partition-activations --contigious-checkpointing
  # data
  --data-path "$DATA" --data-impl mmap --split 949,50,1 --num-workers 0
  --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt
  # evaluation, checkpoints, logging
  --log-interval 10 --eval-interval 100 --eval-iters 10
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 100
  --exit-duration-in-mins 30000000
  --tensorboard-dir "$OUT/tensorboard" --tensorboard-queue-size 1
  --log-timers-to-tensorboard --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
  --log-optimizer-states-to-tensorboard
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

# The DeepSpeed JSON may only add keys; the batch sizes and ZeRO stage repeat the flags' values.
mkdir -p "$OUT"
cat > "$config_json" <<JSON
{
  "train_batch_size": $global_batch_size,
  "train_micro_batch_size_per_gpu": $micro_batch_size,
  "steps_per_print": 10,
  "zero_optimization": {"stage": $zero_stage},
  "wall_clock_breakdown": false
}
JSON

deepspeed --num_gpus "$WORLD" pretrain_gpt.py "${ARGS[@]}"
