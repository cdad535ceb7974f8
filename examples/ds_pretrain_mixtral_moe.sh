#!/usr/bin/env bash
# A Mixtral-style sparse MoE model in the shape of Megatron-DeepSpeed's MoE examples (examples_deepspeed/MoE/):
# LLaMA blocks (RMSNorm, SwiGLU, RoPE theta 1e6, GQA 32 heads / 8 K/V heads, no biases, untied embeddings) whose
# every MLP (--expert-interval 1) is a DeepSpeed-MoE layer of 8 experts, top-2 routing, no token dropping and
# no 2nd-expert sampling (Mixtral's router), load-balancing loss x 0.02. 16 x 2048 (FFN 7168 per expert), seq 4096,
# bf16, ZeRO-1 with MoE parameter groups, on 8 GPUs: TP 2 x DP 4, experts split over EP 4 (each rank holds 2 whole
# experts of every layer; expert-data-parallel size 1). Launched by torchrun:
#   DATA=data/bookcorpus_text_sentence TOKENIZER=data/tokenizer.model bash examples/ds_pretrain_mixtral_moe.sh
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

GPUS_PER_NODE=8
WORLD=$GPUS_PER_NODE                       # 8 ranks = TP 2 x DP 4; EP 4 inside the data-parallel ranks
DATA=${DATA:-data/bookcorpus_text_sentence}
TOKENIZER=${TOKENIZER:-data/tokenizer.model}   # the LLaMA/Mistral SentencePiece tokenizer.model
OUT=${OUT:-runs/mixtral_moe}
DS_CONFIG=$OUT/deepspeed.json

TP=2
EP=4
NUM_EXPERTS=8
ZERO_STAGE=1
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=64
SEQ_LENGTH=4096

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size 1 --no-pipeline-parallel
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 7168
  --num-attention-heads 32 --num-key-value-heads 8
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --use-rotary-position-embeddings --rotary-position-embeddings-theta 1000000
  --untie-embeddings-and-output-weights --swiglu --normalization rmsnorm --layernorm-epsilon 1e-5
  --disable-bias-linear --attention-dropout 0 --hidden-dropout 0
  # Mixture of Experts (DeepSpeed-MoE): every layer, 8 experts, top-2, no dropping, EP over data-parallel ranks
  --num-experts "$NUM_EXPERTS" --expert-interval 1 --topk 2 --mlp-type standard
  --moe-expert-parallel-size "$EP" --disable-moe-token-dropping --disable-moe-top2-2nd-expert-sampling
  --moe-loss-coeff 0.02 --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4
  --create-moe-param-group
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters 100000
  --save "$OUT/checkpoints" --load "$OUT/checkpoints"
  --data-path 1 "$DATA" --data-impl mmap --split 949,50,1
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER"
  --distributed-backend nccl
  --lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95
  --log-interval 1 --save-interval 5000 --eval-interval 1000 --eval-iters 10
  --tensorboard-dir "$OUT/tensorboard" --metrics-file "$OUT/metrics.jsonl"
  --bf16 --recompute-granularity selective
  --deepspeed --deepspeed_config="$DS_CONFIG" --zero-stage="$ZERO_STAGE"
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
