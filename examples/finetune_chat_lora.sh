#!/usr/bin/env bash
# Chat fine-tuning with LoRA (docs/fine-tuning.md, "End to end"), in five steps:
#   1. render a chat JSONL with the tokenizer's chat template into an SFT dataset: tokens and a loss mask on the
#      assistant turns (tools/preprocess_data.py --sft; int32 tokens for a Llama 3-size vocabulary);
#   2. train LoRA adapters on the frozen base checkpoint: --sft (whole conversations packed, loss over the assistant
#      tokens of the global batch) --lora-rank --pretrained-checkpoint, the model's shape from the base
#      (--use-checkpoint-args), lm-evaluation-harness tasks scored during training (--eval-harness-tasks);
#   3. export the base to Hugging Face with the adapters as a PEFT folder (verified by logits);
#   4. export the model with the adapters merged in, a plain Hugging Face model (verified by logits);
#   5. evaluate the trained adapter checkpoint with tools/eval_harness.py (adapters over their recorded base).
#
#   BASE=checkpoints/llama3-base TOKENIZER_DIR=models/Llama-3.2-1B-Instruct CHAT_JSONL=data/chats.jsonl \
#       bash examples/finetune_chat_lora.sh
#
# BASE is a Trident checkpoint directory (a pretraining run's --save, or tools/checkpoint/hf_to_trident.py's output,
# at any TP x PP). TOKENIZER_DIR is a Hugging Face tokenizer folder whose tokenizer_config.json (or
# chat_template.jinja) has the chat template; CHAT_JSONL has one {"messages": [{"role": ..., "content": ...}, ...]}
# (or {"prompt": ..., "response": ...}) per line.
# Environment (defaults in brackets): BASE [checkpoints/llama3-base]; TOKENIZER_DIR [models/Llama-3.2-1B-Instruct];
# CHAT_JSONL [data/chats.jsonl]; OUT [runs/finetune_chat_lora]; TP, PP [2, 1]; NPROC ranks on this node
# [TP x PP; more adds data parallelism]; SEQ_LENGTH [4096]; MICRO_BATCH_SIZE [1]; GLOBAL_BATCH_SIZE [64];
# TRAIN_ITERS [500]; LR [2e-4] and MIN_LR [2e-5] (cosine, WARMUP_ITERS [20]); LORA_RANK [8]; LORA_ALPHA [16];
# EVAL_TASKS [trident_choice trident_lastword] from EVAL_INCLUDE_PATH [examples/eval_tasks], at most EVAL_LIMIT
# [200] documents each, every EVAL_INTERVAL [TRAIN_ITERS] iterations; ZERO_STAGE [1];
# DEVICE [cuda: bf16, NCCL; cpu: fp32, gloo]; PYTHON [python].
# A second run needs a new OUT: the exports refuse an existing output, and step 2 would resume the first run's
# adapters (--load is the run's own adapter directory: after a stop, run step 2 again to resume).
# The flags of step 2 live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example).
set -euo pipefail

BASE=${BASE:-checkpoints/llama3-base}
TOKENIZER_DIR=${TOKENIZER_DIR:-models/Llama-3.2-1B-Instruct}
CHAT_JSONL=${CHAT_JSONL:-data/chats.jsonl}
OUT=${OUT:-runs/finetune_chat_lora}
TP=${TP:-2}
PP=${PP:-1}
NPROC=${NPROC:-$((TP * PP))}
WORLD=$NPROC
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
TRAIN_ITERS=${TRAIN_ITERS:-500}
LR=${LR:-2e-4}
MIN_LR=${MIN_LR:-2e-5}
WARMUP_ITERS=${WARMUP_ITERS:-20}
LORA_RANK=${LORA_RANK:-8}
LORA_ALPHA=${LORA_ALPHA:-16}
read -r -a EVAL_TASKS <<<"${EVAL_TASKS:-trident_choice trident_lastword}"
EVAL_INCLUDE_PATH=${EVAL_INCLUDE_PATH:-examples/eval_tasks}
EVAL_LIMIT=${EVAL_LIMIT:-200}
EVAL_INTERVAL=${EVAL_INTERVAL:-$TRAIN_ITERS}
ZERO_STAGE=${ZERO_STAGE:-1}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}

if [[ "$DEVICE" == cpu ]]; then
  DEVICE_ARGS=()                           # fp32, gloo (the defaults on CPU)
else
  DEVICE_ARGS=(--bf16 --distributed-backend nccl)
fi

ARGS=(
  # the model: every architecture flag from the base checkpoint's trident_meta.json; only the adapters train
  --use-checkpoint-args --pretrained-checkpoint "$BASE"
  --lora-rank "$LORA_RANK" --lora-alpha "$LORA_ALPHA" --lora-target-modules qkv dense fc1 fc2
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --zero-stage "$ZERO_STAGE"
  --seq-length "$SEQ_LENGTH"
  --attention-dropout 0 --hidden-dropout 0
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
  --weight-decay 0.0 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999
  # the SFT dataset of step 1: conversations packed whole, the loss on the assistant tokens only
  --sft --data-path "$OUT/data/chat_text_document" --split 100,0,0
  --tokenizer-type HFTokenizer --tokenizer-model "$TOKENIZER_DIR"
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval "$TRAIN_ITERS"
  --eval-iters 0 --log-interval 1 --metrics-file "$OUT/metrics.jsonl"
  --eval-harness-tasks "${EVAL_TASKS[@]}" --eval-harness-include-path "$EVAL_INCLUDE_PATH"
  --eval-harness-limit "$EVAL_LIMIT" --eval-harness-interval "$EVAL_INTERVAL"
  "${DEVICE_ARGS[@]}"
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

if [[ "$DEVICE" == cpu ]]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu; fi

echo "== 1/5 render and tokenize the chats $CHAT_JSONL with $TOKENIZER_DIR's chat template"
mkdir -p "$OUT/data"
"$PYTHON" -m tools.preprocess_data --sft --input "$CHAT_JSONL" --output-prefix "$OUT/data/chat" \
  --tokenizer-type HFTokenizer --tokenizer-model "$TOKENIZER_DIR" --workers 1

echo "== 2/5 LoRA fine-tuning (--sft) of $BASE on $NPROC ranks -> $OUT/checkpoints"
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}"

echo "== 3/5 Trident -> Hugging Face: the base in $OUT/hf_base, the adapters as a PEFT folder in $OUT/peft"
"$PYTHON" -m tools.checkpoint.trident_to_hf --load "$OUT/checkpoints" --out "$OUT/hf_base" \
  --peft-output "$OUT/peft" --no-progress

echo "== 4/5 Trident -> Hugging Face with the adapters merged: $OUT/hf_merged"
"$PYTHON" -m tools.checkpoint.trident_to_hf --load "$OUT/checkpoints" --out "$OUT/hf_merged" --merge-lora \
  --no-progress

echo "== 5/5 lm-evaluation-harness on the adapter checkpoint: $OUT/eval.json"
EVAL_DEVICE=cuda
if [[ "$DEVICE" == cpu ]]; then EVAL_DEVICE=cpu; fi
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node $((TP * PP)) tools/eval_harness.py \
  --load "$OUT/checkpoints" --device "$EVAL_DEVICE" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --tasks "${EVAL_TASKS[@]}" --include-path "$EVAL_INCLUDE_PATH" --limit "$EVAL_LIMIT" \
  --output-path "$OUT/eval.json"
