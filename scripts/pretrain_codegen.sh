#!/usr/bin/env bash
# Pretrain a CodeGeeX model with codegeex_train.
#
#   bash scripts/pretrain_codegen.sh                      # small CodeGeeX, stdlib corpus, CPU, 2 ranks, ~5 min
#   PP=2 bash scripts/pretrain_codegen.sh                 # the same on CPU as a 2-stage pipeline (TP 1, PP 2)
#   DEVICE=gpu NUM_GPUS=8 TP=8 bash scripts/pretrain_codegen.sh
#   # CodeGeeX-13B: TP 8 inside each node, 4 pipeline stages across nodes (10+10+10+9 of the 39 layers: the
#   # last stage also holds the top query layer and the output layer), ZeRO-2 DP over the rest
#   CONFIG=codegeex-13b DEVICE=gpu HOSTFILE=hostfile TP=8 PP=4 MICRO_BATCH=2 GLOBAL_BATCH=1536 \
#       DATA_PATH=... TOKENIZER_ARGS=... bash scripts/pretrain_codegen.sh --decoder-last-pipeline-num-layers 9
#   CONFIG=codegeex-13b DEVICE=gpu HOSTFILE=hostfile TP=8 DATA_PATH=data/code_text_document \
#       TOKENIZER_ARGS="--tokenizer-type HFTokenizer --tokenizer-model tokenizer.json" \
#       GLOBAL_BATCH=1536 bash scripts/pretrain_codegen.sh --wandb-project codegeex
#
# Variables: OUTPUT_DIR (checkpoints, metrics.jsonl, logs; default ./outputs/codegen-default), CONFIG
# (default | codegeex-13b), DEVICE (cpu | gpu; default gpu when nvidia-smi sees one), NUM_GPUS (ranks per
# node), HOSTFILE (several nodes, via pdsh/ssh), TP, PP (stages; 39 layers split unevenly need
# --decoder-first/last-pipeline-num-layers), MICRO_BATCH, GLOBAL_BATCH, TRAIN_ITERS, SEQ_LENGTH,
# DATA_PATH (default: the Python stdlib, preprocessed on first use), TOKENIZER_ARGS, DS_CONFIG, LR, MIN_LR, DECAY
# (the LR schedule after WARMUP: linear | cosine | constant),
# LAUNCHER_ARGS (more deepspeed launcher flags: --master_addr, --master_port, --ssh_port, --no_ssh --node_rank K).
# Any further arguments go to codegeex_train/pretrain.py and override the ones set here.
#
# Failures: a dead rank brings the job down; run the same command again and it resumes from OUTPUT_DIR's last
# complete checkpoint. SIGTERM (preemption) finishes the iteration, saves, and exits 0 on every rank.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTPUT_DIR=${OUTPUT_DIR:-./outputs/codegen-default}
CONFIG=${CONFIG:-default}
if [ -z "${DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi
TP=${TP:-1}
PP=${PP:-1}
PYTHON=${PYTHON:-python}
mkdir -p "$OUTPUT_DIR/logs"

case "$CONFIG" in
  default)  # small enough to learn visibly on 2 CPU cores in minutes
    MODEL_ARGS="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --max-position-embeddings 256
                --hidden-dropout 0.0 --attention-dropout 0.0 --activation fast_gelu"
    SEQ_LENGTH=${SEQ_LENGTH:-256}; MICRO_BATCH=${MICRO_BATCH:-8}; GLOBAL_BATCH=${GLOBAL_BATCH:-16}
    # Linear decay to 0 at 1.5e-3 ended lowest of those tried here (final train loss 4.41; 4.53 for 1e-3 or for
    # cosine to lr/10 at 2e-3, 4.60 at 3e-3): a short run gains most from annealing all the way.
    TRAIN_ITERS=${TRAIN_ITERS:-200}; LR=${LR:-1.5e-3}; MIN_LR=${MIN_LR:-0}; DECAY=${DECAY:-linear}
    WARMUP=${WARMUP:-20}; EVAL_INTERVAL=100; SAVE_INTERVAL=100; LOG_INTERVAL=10 ;;
  codegeex-13b)  # CodeGeeX-13B's shape: 39 layers + the top query layer, 40 heads of 128
    MODEL_ARGS="--num-layers 39 --hidden-size 5120 --num-attention-heads 40 --ffn-hidden-size 20480
                --max-position-embeddings 2048 --activation fast_gelu --checkpoint-activations"
    SEQ_LENGTH=${SEQ_LENGTH:-2048}; MICRO_BATCH=${MICRO_BATCH:-8}; GLOBAL_BATCH=${GLOBAL_BATCH:-1536}
    TRAIN_ITERS=${TRAIN_ITERS:-200000}; LR=${LR:-1e-4}; MIN_LR=${MIN_LR:-1e-5}; DECAY=${DECAY:-cosine}
    WARMUP=${WARMUP:-1500}; EVAL_INTERVAL=1000
    SAVE_INTERVAL=1000; LOG_INTERVAL=10 ;;
  *) echo "error: CONFIG=$CONFIG: use default or codegeex-13b" >&2; exit 2 ;;
esac

if [ "$DEVICE" = gpu ]; then
  NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L | wc -l)}
  DS_CONFIG=${DS_CONFIG:-$ROOT/ds_configs/gpu_bf16_zero2.json}
  PRECISION_ARGS="--bf16 --distributed-backend nccl"
  [[ "$DS_CONFIG" == *fp16* ]] && PRECISION_ARGS="--fp16 --distributed-backend nccl"
else
  NUM_GPUS=${NUM_GPUS:-2}
  DS_CONFIG=${DS_CONFIG:-$ROOT/ds_configs/cpu_fp32_zero2.json}
  PRECISION_ARGS="--distributed-backend gloo"
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # DeepSpeed JIT-builds a CPU comm op once; keep it with the checkout.
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}
  # Fixed glibc malloc thresholds (distributed/malloc.py): the adaptive mmap threshold fragments the heap (peak RSS
  # 0.8 -> 2.3 GB a rank); 4 MiB keeps it flat at the adaptive speed.
  export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4194304}
  export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4194304}
fi

if [ -z "${DATA_PATH:-}" ]; then
  # The embedded default corpus: the Python standard library's source, shipped tokenizer.
  DATA_PATH=$ROOT/.cache/data/stdlib_text_document
  if [ ! -f "$DATA_PATH.idx" ]; then
    "$PYTHON" "$ROOT/tools/preprocess_data.py" --input default --output-prefix "$ROOT/.cache/data/stdlib" \
      --whitespace-encoding --append-eod --workers 2
  fi
fi

if [ -n "${HOSTFILE:-}" ]; then
  # pdsh forwards only PYTHON*/UCX*/... variables to the other nodes; the rest travel in a .deepspeed_env file
  # (DS_ENV_FILE). Credentials never go there (log in to wandb / Hugging Face on each node instead).
  export DS_ENV_FILE=$(cd "$OUTPUT_DIR" && pwd)/.deepspeed_env
  (umask 077
   env | grep -E '^(DS_ACCELERATOR|TORCH_EXTENSIONS_DIR|OMP_NUM_THREADS|MALLOC_[A-Z_]*|WANDB_[A-Z_]*|HF_[A-Z_]*|NCCL_[A-Z_]*|GLOO_[A-Z_]*)=' \
     | grep -Ev '^[^=]*(KEY|TOKEN|SECRET|PASSWORD)[^=]*=' \
     | while IFS='=' read -r name value; do printf '%s=%q\n' "$name" "$value"; done > "$DS_ENV_FILE")
  LAUNCHER=(deepspeed --hostfile "$HOSTFILE")
else
  LAUNCHER=(deepspeed --num_gpus "$NUM_GPUS")
fi
# e.g. LAUNCHER_ARGS="--master_addr 10.0.0.1 --master_port 29500 --ssh_port 2222" (word list)
# shellcheck disable=SC2206
LAUNCHER+=(${LAUNCHER_ARGS:-})
command -v deepspeed >/dev/null 2>&1 || LAUNCHER=("$PYTHON" -m deepspeed.launcher.runner "${LAUNCHER[@]:1}")

# Resume automatically from this output directory's last complete checkpoint.
RESUME_ARGS=()
[ -f "$OUTPUT_DIR/latest" ] && RESUME_ARGS=(--load "$OUTPUT_DIR")

LOG="$OUTPUT_DIR/logs/train-$(date +%Y%m%d-%H%M%S).log"
echo "codegeex_train: CONFIG=$CONFIG DEVICE=$DEVICE ranks/node=$NUM_GPUS TP=$TP PP=$PP -> $OUTPUT_DIR (log $LOG)"
# shellcheck disable=SC2086  # MODEL_ARGS and PRECISION_ARGS are word lists
"${LAUNCHER[@]}" "$ROOT/codegeex_train/pretrain.py" \
  $MODEL_ARGS $PRECISION_ARGS \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --seq-length "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style "$DECAY" \
  --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 \
  --data-path "$DATA_PATH" --split 969,30,1 ${TOKENIZER_ARGS:-} \
  --deepspeed-config "$DS_CONFIG" --zero-stage 2 \
  --save "$OUTPUT_DIR" --save-interval "$SAVE_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 4 \
  --log-interval "$LOG_INTERVAL" --num-workers 1 --exit-signal-handler "${RESUME_ARGS[@]}" \
  "$@" 2>&1 | tee "$LOG"

# Plots of the run (loss, LR, grad norm, tokens/s, memory, communication) from its metrics.jsonl. The training
# succeeded by now: a plotting failure (no matplotlib, a custom --metrics-file, ...) only warns.
"$PYTHON" "$ROOT/tools/plot_metrics.py" "$OUTPUT_DIR" -o "$OUTPUT_DIR/plots.png" \
  || echo "warning: no plots: tools/plot_metrics.py failed on $OUTPUT_DIR (the training run itself succeeded)" >&2

# Where everything is, and what to run next.
TAG=$(cat "$OUTPUT_DIR/latest" 2>/dev/null || echo "(none: no checkpoint saved)")
cat <<SUMMARY

codegeex_train: finished. Outputs in $OUTPUT_DIR:
  checkpoint  $OUTPUT_DIR/$TAG (the 'latest' one; a relaunch resumes from it)
  metrics     $OUTPUT_DIR/metrics.jsonl
  plots       $OUTPUT_DIR/plots.png
  log         $LOG
Continue training (more iterations, same directory):
  TRAIN_ITERS=$((TRAIN_ITERS * 2)) OUTPUT_DIR=$OUTPUT_DIR bash scripts/pretrain_codegen.sh
Generate from it:
  $(command -v "$PYTHON") tools/generate.py --load $OUTPUT_DIR --prompt 'def fibonacci(n):\n' --max-new-tokens 64
SUMMARY
