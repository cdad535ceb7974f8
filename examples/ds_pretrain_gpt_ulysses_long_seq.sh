#!/usr/bin/env bash
# GPT-3 1.3B (24 x 2048, 16 heads) on 32K-token sequences with DeepSpeed-Ulysses, the way Megatron-DeepSpeed's
# examples_deepspeed/sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh trains it: each sample's 32768
# tokens are split over 4 ranks (8192 each); attention all-to-alls the heads (16 -> 4 per rank) so every rank
# attends over the whole sequence. 8 GPUs on one node: Ulysses SP 4 x DP 2 (no TP, no pipeline: Ulysses does not
# compose with pipeline parallelism), ZeRO-1 over the DP x SP ranks, bf16, flash attention (SDPA), full activation
# recomputation through DeepSpeed. Launched by the DeepSpeed launcher:
#   DATA=data/pile_text_document bash examples/ds_pretrain_gpt_ulysses_long_seq.sh
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

WORLD=${WORLD:-8}                          # 8 ranks = Ulysses SP 4 x DP 2
DATA=${DATA:-data/pile_text_document}
OUT=${OUT:-runs/gpt-1.3b-ulysses-32k}

seq_len=32768                              # divisible by sp_size: each rank holds seq_len / sp_size tokens
sp_size=4                                  # divides the 16 heads (and K/V heads) per TP rank
mp_size=1
pp_size=1
zero_stage=1
micro_batch_size=1
global_batch_size=16                       # micro x DP (= WORLD / (TP x PP x SP) = 2) x gradient accumulation 8
train_tokens=$((300 * 1000000000))
train_samples=$((train_tokens * 2 / seq_len))
config_json="$OUT/ds_config_gbs${global_batch_size}_mbs${micro_batch_size}_zero${zero_stage}_sp${sp_size}.json"

ARGS=(
  # model
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length "$seq_len" --max-position-embeddings "$seq_len" --init-method-std 0.013
  --attention-dropout 0 --hidden-dropout 0
  # schedule
  --train-tokens "$train_tokens" --train-samples "$train_samples"
  --lr 2.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-samples 10000
  --micro-batch-size "$micro_batch_size" --global-batch-size "$global_batch_size"
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --seed 1234
  # parallelism: DeepSpeed-Ulysses over 4 ranks, DP 2, no TP, no pipeline
  --ds-sequence-parallel-size "$sp_size"
  --tensor-model-parallel-size "$mp_size" --pipeline-model-parallel-size "$pp_size" --no-pipeline-parallel
  --deepspeed --deepspeed_config "$config_json" --zero-stage "$zero_stage"
  --deepspeed-activation-checkpointing --checkpoint-activations
  --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt
  --data-path "$DATA" --split 949,50,1
  # evaluation, checkpoints, logging
  --log-interval 10 --eval-interval 100 --eval-iters 10
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000
  --tensorboard-dir "$OUT/tensorboard"
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
  "bf16": {"enabled": true},
  "wall_clock_breakdown": false
}
JSON

deepspeed --num_gpus "$WORLD" pretrain_gpt.py "${ARGS[@]}"
