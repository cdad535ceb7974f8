#!/usr/bin/env bash
# A LLaMA-2-7B-shaped model (32 x 4096, SwiGLU FFN 11008, RMSNorm, RoPE, untied embeddings, no biases) with
# grouped-query attention (8 K/V heads; the released 7B uses 32, i.e. MHA: set --num-key-value-heads 32 for that),
# bf16, TP=4 x PP=2 x ZeRO-1 on 4 nodes of 8 GPUs, launched by torchrun on every node:
#   NODE_RANK=0 MASTER_ADDR=node-01 bash examples/pretrain_llama2_7b_multinode.sh    # on node-01
#   NODE_RANK=1 MASTER_ADDR=node-01 bash examples/pretrain_llama2_7b_multinode.sh    # on node-02, ...
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

NNODES=${NNODES:-4}
GPUS_PER_NODE=8
WORLD=$((NNODES * GPUS_PER_NODE))          # 32 ranks = TP 4 x PP 2 x DP 4
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
DATA=${DATA:-data/llama_text_document}
TOKENIZER=${TOKENIZER:-data/llama2-tokenizer.model}
OUT=${OUT:-runs/llama2-7b}

# --- NCCL over InfiniBand / RoCE (torchrun: set on every node; each node runs this script, so every export below
# reaches its ranks: no .deepspeed_env needed, unlike the deepspeed launcher's pdsh path). ---
export NCCL_IB_DISABLE=0                   # use InfiniBand/RoCE verbs, never silently fall back to TCP
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}    # HCA name prefix (all mlx5_* ports); list specific ones as mlx5_0:1,mlx5_1:1
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}   # RoCE v2: GID index of the RoCEv2 address (see `show_gids`); ignored on IB
export NCCL_IB_TC=${NCCL_IB_TC:-106}       # RoCE: traffic class of the lossless (PFC/ECN) queue your switches configure
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}   # bootstrap interfaces: anything but loopback/docker
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}        # gloo needs one concrete interface name
export NCCL_IB_QPS_PER_CONNECTION=${NCCL_IB_QPS_PER_CONNECTION:-4}   # more queue pairs: better spread over RoCE ECMP paths
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}      # set INFO once and check the log says NET/IB (not NET/Socket)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # abort instead of hanging on a failed collective
export CUDA_DEVICE_MAX_CONNECTIONS=1       # ordered TP communication (needed with --sequence-parallel)

ARGS=(
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-key-value-heads 8
  --ffn-hidden-size 11008 --seq-length 4096 --max-position-embeddings 4096
  --swiglu --normalization rmsnorm --layernorm-epsilon 1e-5
  --use-rotary-position-embeddings --rotary-position-embeddings-theta 10000
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel
  --zero-stage 1 --bf16 --checkpoint-activations
  # DP = 32 / (4 x 2) = 4; 1024 sequences (4M tokens) per step = 1 micro x 4 DP x 256 micro-batches.
  --micro-batch-size 1 --global-batch-size 1024
  --train-iters 250000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --data-path "$DATA" --split 990,9,1
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER"
  --eval-interval 1000 --eval-iters 10 --log-interval 1
  --save "$OUT/checkpoints" --save-interval 500 --load "$OUT/checkpoints"
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
  --distributed-timeout-minutes 30
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port 6000 pretrain_gpt.py "${ARGS[@]}"
