#!/usr/bin/env bash
# GPT 1.3B (24 x 2048, 16 heads) with TP=2 x PP=2 x ZeRO-1 across nodes, launched by the DeepSpeed launcher from a
# hostfile. Run it on the first node; the launcher starts every rank over ssh (pdsh).
#   HOSTFILE=hostfile bash examples/pretrain_gpt_1.3b_3d_multinode.sh
# hostfile, one line per node:   node-01 slots=8
#                                node-02 slots=8
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

NNODES=${NNODES:-2}
GPUS_PER_NODE=8
WORLD=$((NNODES * GPUS_PER_NODE))          # 16 ranks = TP 2 x PP 2 x DP 4
HOSTFILE=${HOSTFILE:-hostfile}
DATA=${DATA:-data/my-gpt2_text_document}
OUT=${OUT:-runs/gpt-1.3b}

# --- NCCL over InfiniBand / RoCE. The deepspeed launcher forwards NCCL_* variables to every node; the others go
# through .deepspeed_env (written below). ---
export NCCL_IB_DISABLE=0                   # use InfiniBand/RoCE verbs (1 would force TCP sockets: slow)
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1}   # HCAs (and ports) NCCL may use; `ibstat` lists them
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}   # RoCE v2 only: the GID of the RoCEv2/IPv4 address (`show_gids`); unset on IB
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}   # interface for NCCL's bootstrap TCP traffic (not the data path)
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}   # same for the gloo groups torch creates
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}    # GPUDirect RDMA when GPU and NIC share a PCIe host bridge
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}           # IB retransmission timeout exponent; raise on large fabrics
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}      # INFO (+ NCCL_DEBUG_SUBSYS=INIT,NET) prints the transport: check "NET/IB", not "NET/Socket"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective aborts the job instead of hanging it
export CUDA_DEVICE_MAX_CONNECTIONS=1       # keeps TP communication ordered with compute (needed with --sequence-parallel)

ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048
  --attention-dropout 0.1 --hidden-dropout 0.1
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  --zero-stage 1
  # DP = 16 / (2 x 2) = 4; 512 sequences per step = 4 micro x 4 DP x 32 micro-batches per pipeline flush.
  --micro-batch-size 4 --global-batch-size 512
  --bf16 --checkpoint-activations
  --train-iters 250000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --data-path "$DATA" --split 949,50,1
  --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt
  --eval-interval 1000 --eval-iters 10 --log-interval 10
  --save "$OUT/checkpoints" --save-interval 1000 --load "$OUT/checkpoints"
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
  --distributed-timeout-minutes 30
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

# The launcher starts the other nodes over ssh (pdsh) in a fresh environment and forwards to them only the NCCL_*,
# PYTHON*, MLFLOW*, MV2* and UCX* variables of this shell plus the VAR=value lines of .deepspeed_env (read from
# ~ and then from the launch directory): GLOO_SOCKET_IFNAME and the two settings below would reach this node alone.
# One VAR=value per line, no comments, no blank lines (DeepSpeed splits every line at its first "="). This
# overwrites ./.deepspeed_env. (With --no_ssh, each node runs its own launcher and no file is read: export there.)
cat > .deepspeed_env <<EOF
GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME
TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING
CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS
EOF

deepspeed --hostfile "$HOSTFILE" --num_nodes "$NNODES" --num_gpus "$GPUS_PER_NODE" \
  --master_port 29500 pretrain_gpt.py "${ARGS[@]}"
