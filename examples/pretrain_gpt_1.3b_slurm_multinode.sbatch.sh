#!/usr/bin/env bash
# GPT 1.3B with TP=2 x PP=2 x ZeRO-1 on 4 nodes of 8 GPUs under Slurm: srun starts one task per GPU and
# pretrain_gpt.py derives RANK / WORLD_SIZE / LOCAL_RANK from SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID,
# MASTER_ADDR from the first node of the step and MASTER_PORT from the job id (export either to override).
#   sbatch examples/pretrain_gpt_1.3b_slurm_multinode.sbatch.sh
#SBATCH --job-name=trident-gpt-1.3b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=TERM@300        # SIGTERM 5 min before the time limit: Trident saves a checkpoint and exits 5
# The flags live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example this way).
set -euo pipefail

NNODES=${SLURM_JOB_NUM_NODES:-4}
GPUS_PER_NODE=8
WORLD=$((NNODES * GPUS_PER_NODE))          # 32 ranks = TP 2 x PP 2 x DP 8
DATA=${DATA:-data/my-gpt2_text_document}
OUT=${OUT:-runs/gpt-1.3b-slurm}

# --- NCCL over InfiniBand / RoCE (srun passes the submitting environment to every task). ---
export NCCL_IB_DISABLE=0                   # use InfiniBand/RoCE verbs (1 would force TCP sockets: slow)
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1}   # HCAs (and ports) NCCL may use; `ibstat` lists them
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}   # RoCE v2 only: the GID of the RoCEv2/IPv4 address (`show_gids`); unset on IB
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}   # interface for NCCL's bootstrap TCP traffic (not the data path)
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}   # same for the gloo groups torch creates
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}      # INFO prints the transport: check "NET/IB", not "NET/Socket"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective aborts the job instead of hanging it
export CUDA_DEVICE_MAX_CONNECTIONS=1       # keeps TP communication ordered with compute (needed with --sequence-parallel)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  --zero-stage 1
  # DP = 32 / (2 x 2) = 8; 512 sequences per step = 4 micro x 8 DP x 16 micro-batches per pipeline flush.
  --micro-batch-size 4 --global-batch-size 512
  --bf16 --checkpoint-activations
  --train-iters 250000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --data-path "$DATA" --split 949,50,1
  --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt
  --eval-interval 1000 --eval-iters 10 --log-interval 10
  # Requeued or resubmitted jobs resume from the newest complete checkpoint (auto-resume).
  --save "$OUT/checkpoints" --save-interval 1000 --load "$OUT/checkpoints"
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
  --distributed-timeout-minutes 30
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

# --kill-on-bad-exit: one failed task ends the step instead of leaving the others blocked in a collective.
srun --kill-on-bad-exit=1 --cpu-bind=none python pretrain_gpt.py "${ARGS[@]}"
