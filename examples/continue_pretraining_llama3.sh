#!/usr/bin/env bash
# Continued pretraining of a Llama 3.x model (docs/continued-pretraining.md), in four steps:
#   1. convert the Hugging Face directory to a Trident checkpoint at TP x PP (the converter checks the logits of
#      what it wrote against transformers' and writes the model's flags beside it, $OUT/converted/model_args.sh);
#   2. tokenize a JSONL corpus with the model's own tokenizer (HFTokenizer on its tokenizer.json; int32 tokens,
#      the vocabulary exceeds 65,535);
#   3. train from the converted weights: --finetune (weights only, iteration 0) --use-checkpoint-args (the model's
#      shape, RoPE scaling included, from the checkpoint; no model flag to copy);
#   4. export the trained checkpoint back to Hugging Face (verified by logits again) with the tokenizer.
#
#   HF_DIR=models/Llama-3.2-1B DATA_JSONL=data/corpus.jsonl bash examples/continue_pretraining_llama3.sh
#
# Environment (defaults in brackets): HF_DIR the model [models/Llama-3.2-1B]; TOKENIZER_DIR its tokenizer [HF_DIR];
# DATA_JSONL the corpus, one {"text": ...} per line [data/corpus.jsonl]; OUT [runs/continue_llama3]; TP, PP [2, 1];
# NPROC ranks on this node [TP x PP; more adds data parallelism]; SEQ_LENGTH [4096]; MICRO_BATCH_SIZE [1];
# GLOBAL_BATCH_SIZE [64]; TRAIN_ITERS [1000]; LR [3e-5] and MIN_LR [3e-6] (cosine, WARMUP_ITERS [100]);
# ZERO_STAGE [1]; DEVICE [cuda: bf16, NCCL; cpu: fp32, gloo]; PYTHON [python].
# Every step refuses an existing output, so a second run needs a new OUT. To resume the training step after a stop,
# run step 3 again with --load "$OUT/checkpoints" instead of the converted checkpoint and without --finetune.
# The flags of step 3 live in ARGS; TRIDENT_EXAMPLE_NO_LAUNCH=1 only defines ARGS (tests parse every example).
set -euo pipefail

HF_DIR=${HF_DIR:-models/Llama-3.2-1B}
TOKENIZER_DIR=${TOKENIZER_DIR:-$HF_DIR}
DATA_JSONL=${DATA_JSONL:-data/corpus.jsonl}
OUT=${OUT:-runs/continue_llama3}
TP=${TP:-2}
PP=${PP:-1}
NPROC=${NPROC:-$((TP * PP))}
WORLD=$NPROC
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-3e-5}
MIN_LR=${MIN_LR:-3e-6}
WARMUP_ITERS=${WARMUP_ITERS:-100}
ZERO_STAGE=${ZERO_STAGE:-1}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}

if [[ "$DEVICE" == cpu ]]; then
  DEVICE_ARGS=()                           # fp32, gloo (the defaults on CPU)
else
  DEVICE_ARGS=(--bf16 --distributed-backend nccl)
fi

ARGS=(
  # the model: every architecture flag from the converted checkpoint's trident_meta.json
  --use-checkpoint-args --load "$OUT/converted" --finetune
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --zero-stage "$ZERO_STAGE"
  --seq-length "$SEQ_LENGTH"
  --attention-dropout 0 --hidden-dropout 0
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --data-path "$OUT/data/corpus_text_document" --split 100,0,0
  --tokenizer-type HFTokenizer --tokenizer-model "$TOKENIZER_DIR"
  --save "$OUT/checkpoints" --save-interval "$TRAIN_ITERS"
  --eval-iters 0 --log-interval 1 --metrics-file "$OUT/metrics.jsonl"
  "${DEVICE_ARGS[@]}"
)

if [[ "${TRIDENT_EXAMPLE_NO_LAUNCH:-0}" == 1 ]]; then return 0 2>/dev/null || exit 0; fi

if [[ "$DEVICE" == cpu ]]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu; fi

echo "== 1/4 Hugging Face -> Trident at TP=$TP x PP=$PP: $HF_DIR -> $OUT/converted"
"$PYTHON" -m tools.checkpoint.hf_to_trident --hf-dir "$HF_DIR" --save "$OUT/converted" \
  --tp "$TP" --pp "$PP" --no-progress
cat "$OUT/converted/model_args.sh"

echo "== 2/4 tokenize $DATA_JSONL with $TOKENIZER_DIR"
mkdir -p "$OUT/data"
"$PYTHON" -m tools.preprocess_data --input "$DATA_JSONL" --output-prefix "$OUT/data/corpus" \
  --tokenizer-type HFTokenizer --tokenizer-model "$TOKENIZER_DIR" --append-eod --workers 1

echo "== 3/4 continued pretraining on $NPROC ranks -> $OUT/checkpoints"
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}"

echo "== 4/4 Trident -> Hugging Face: $OUT/hf"
"$PYTHON" -m tools.checkpoint.trident_to_hf --load "$OUT/checkpoints" --out "$OUT/hf" --no-progress
