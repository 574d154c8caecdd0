#!/usr/bin/env bash
# Pretrain (or fine-tune) a CodeGeeX model with codegeex_train.
#
#   bash scripts/pretrain_codegen.sh                      # small CodeGeeX, stdlib corpus, CPU, 2 ranks, ~5 min
#   PP=2 bash scripts/pretrain_codegen.sh                 # the same on CPU as a 2-stage pipeline (TP 1, PP 2)
#   PP=2 VPP=1 bash scripts/pretrain_codegen.sh           # interleaved 1F1B: 2 chunks of 1 layer on each stage
#   CP=2 SEQ_LENGTH=1024 bash scripts/pretrain_codegen.sh --position-embedding-type rope \
#       --max-position-embeddings 1024                     # context parallelism: each sequence split over 2 ranks
#   bash scripts/pretrain_codegen.sh                      # on a GPU node: every GPU nvidia-smi lists, bf16, NCCL
#   DRY_RUN=1 bash scripts/pretrain_codegen.sh            # check everything, print the layout and the command
#   DEVICE=gpu NUM_GPUS=8 TP=8 bash scripts/pretrain_codegen.sh
#   DEVICE=gpu NUM_GPUS=8 TP=8 SP=1 RECOMPUTE=selective bash scripts/pretrain_codegen.sh  # less activation memory
#   # CodeGeeX-13B: TP 8 inside each node, 4 pipeline stages across nodes (10+10+10+9 of the 39 layers: the
#   # last stage also holds the top query layer and the output layer), ZeRO-2 DP over the rest
#   CONFIG=codegeex-13b DEVICE=gpu HOSTFILE=hostfile TP=8 PP=4 MICRO_BATCH=2 \
#       DATA_PATH=... TOKENIZER_ARGS=... bash scripts/pretrain_codegen.sh --decoder-last-pipeline-num-layers 9
#   # Fine-tune CodeGeeX-13B from its converted weights (INIT_FROM: weights only; the same command again
#   # resumes from ./outputs/codegen-codegeex-13b's own checkpoint instead of starting over)
#   CONFIG=codegeex-13b DEVICE=gpu HOSTFILE=hostfile TP=8 INIT_FROM=ckpt/codegeex-13b-tp8 \
#       DATA_PATH=data/code_text_document \
#       TOKENIZER_ARGS="--tokenizer-type CodeGeeXTokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt" \
#       bash scripts/pretrain_codegen.sh --make-vocab-size-divisible-by 52224 --wandb-project codegeex
#
#   # Relaunch a run from the config it wrote (its data, tokenizer, layout, ...; it resumes in its directory)
#   CONFIG=outputs/codegen-default/config.yaml bash scripts/pretrain_codegen.sh
#
# Variables: OUTPUT_DIR (checkpoints, metrics.jsonl, logs; default the CONFIG file's save:, else
# ./outputs/codegen-$CONFIG), CONFIG
# (a preset in configs/: default | codegeex-13b | codegeex-1.3b | deepseek-coder-6.7b | qwen2.5-coder-1.5b |
# qwen2.5-coder-7b | starcoder2-7b | starcoder2-15b, or a .yaml file; docs/config-files.md), DEVICE (cpu | gpu; default gpu when nvidia-smi lists one, unless DS_ACCELERATOR=cpu;
# with HOSTFILE on a host without a GPU, e.g. a login node, there is no default: set it),
# NUM_GPUS (ranks per node; default the GPUs `nvidia-smi -L` lists, 2 on CPU), HOSTFILE (several nodes, via
# pdsh/ssh; the ranks are its slots), TP, PP (stages; 39 layers split unevenly need
# --decoder-first/last-pipeline-num-layers), VPP=N (interleaved 1F1B: --num-layers-per-virtual-pipeline-stage N,
# N layers per model chunk, layers / (PP x N) chunks per stage; needs PP > 1 and MICRO_BATCHES divisible by PP),
# CP (--context-parallel-size: each sequence split over CP ranks, two of 2 x CP chunks each; SEQ_LENGTH divisible
# by 2 x CP; DP = ranks / (TP x CP x PP); long sequences also want e.g. --position-embedding-type rope
# --max-position-embeddings SEQ_LENGTH among the arguments),
# MICRO_BATCH, MICRO_BATCHES (micro-batches per step; default
# PP), GLOBAL_BATCH (default: the config's, 3072 for codegeex-13b, and for the default config MICRO_BATCH x DP x
# MICRO_BATCHES with DP = ranks / (TP x PP), so it follows the GPUs),
# TRAIN_ITERS, SEQ_LENGTH, DATA_PATH (default: the Python stdlib, preprocessed on first use), TOKENIZER_ARGS,
# DS_CONFIG, LR, MIN_LR, DECAY (the LR schedule after WARMUP: linear | cosine | constant), LR_DECAY_ITERS (the
# decay's length, default TRAIN_ITERS; a resume keeps it: continue a run with TRAIN_ITERS larger and LR_DECAY_ITERS
# at the old length, as the finish banner says), INIT_FROM (a checkpoint
# directory to start from: --load DIR --finetune, weights only; ignored once OUTPUT_DIR holds a checkpoint),
# LAUNCHER_ARGS (more deepspeed launcher flags: --master_addr, --master_port, --ssh_port, --no_ssh --node_rank K),
# SP=1 (--sequence-parallel: activations between the TP regions split along the sequence; with TP 1 pretrain.py
# warns and ignores it), RECOMPUTE (none | selective | full: --recompute-granularity; selective re-runs the
# attention core in backward, full whole layers; default none, and for codegeex-13b selective with SP=1 when TP > 1,
# see docs/activation-memory.md; a --sequence-parallel, --recompute-granularity or --checkpoint-activations among
# the arguments wins), FIM_RATE (--fim-rate: the fraction of documents trained as fill-in-the-middle; default 0,
# left to right as CodeGeeX-13B; 0.5 as StarCoder), FIM_SPM_RATE (--fim-spm-rate, default 0.5), DOCUMENT_LEVEL
# (file | repo: the default corpus preprocessed as one document per file, or per repository, StarCoder2's
# <repo_name>/<file_sep> layout with each stdlib directory a repository; with FIM each file of a repository
# document is transformed on its own, --fim-split-sample <file_sep>; docs/code-data.md), DRY_RUN=1 (check the
# layout, then run pretrain.py's own checks at its ranks: its --dry-run, with WORLD_SIZE = the ranks, checks the data
# and tokenizer files, heads and layers against the layout, every argument, the DeepSpeed config, --load and memory;
# print the layout, the resolved config and the exact launch command and exit 0; nothing is launched or written,
# and a mistake is one error: line, exit 2).
# A variable set wins over the CONFIG file; the script's own defaults (data, tokenizer, DeepSpeed config, precision,
# layout, output directory, ...) fill in only what the file leaves unset, never override it. Any further arguments
# go to codegeex_train/pretrain.py and override both. Every python the script runs (the ranks too, on every node)
# imports codegeex_train from this checkout (PYTHONPATH), whatever copy the environment would resolve.
#
# Failures: a dead rank brings the job down; run the same command again and it resumes from OUTPUT_DIR's last
# complete checkpoint. SIGTERM (preemption) finishes the iteration, saves, and exits 0 on every rank.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# Every refusal is one line, before anything runs or is written.
die() { echo "error: $*" >&2; exit 2; }
# Every python this script runs (the config reader, the preprocessing, the dry run's checks, the ranks, the plots)
# imports codegeex_train from this checkout, whatever else the environment would resolve (a venv shared with another
# checkout or worktree, whose editable install points there; a PYTHONPATH): ROOT goes first on PYTHONPATH, which the
# launcher hands its ranks, and pdsh exports to the other nodes (DeepSpeed forwards every PYTHON* variable).
[[ "$ROOT" != *:* ]] || die "the checkout's path $ROOT holds a ':', which PYTHONPATH cannot: move the checkout"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
PYTHON=${PYTHON:-python}
case "$PYTHON" in  # a relative path works from any directory (the config reader runs in ROOT)
  /*) ;;
  */*) dir=$(cd "$(dirname "$PYTHON")" 2>/dev/null && pwd) || die "PYTHON=$PYTHON: no such directory"
       PYTHON=$dir/$(basename "$PYTHON") ;;
esac
CONFIG=${CONFIG:-default}
# A preset is configs/$CONFIG.yaml, or CONFIG=a .yaml file (docs/config-files.md): pretrain.py reads all of it
# (--config), the script the few values its layout arithmetic and its defaults need (below).
case "$CONFIG" in *.yaml | *.yml | */*) CONFIG_FILE=$CONFIG ;; *) CONFIG_FILE=$ROOT/configs/$CONFIG.yaml ;; esac
[ -f "$CONFIG_FILE" ] || die "CONFIG=$CONFIG: no such preset ($CONFIG_FILE); use one of" \
  "$(cd "$ROOT/configs" && ls -- *.yaml | sed 's/\.yaml$//' | paste -sd ' ') or a .yaml file"
CONFIG_FILE=$(cd "$(dirname "$CONFIG_FILE")" && pwd)/$(basename "$CONFIG_FILE")
[[ "$CONFIG_FILE" != *[[:space:]]* ]] || die "CONFIG=$CONFIG: the path $CONFIG_FILE has a space; move it"

# The file's values, read by pretrain.py's own reader (config/script_values.py: YAML in every form, and its
# refusals, as pretrain.py reads it; in ROOT, so that `-m` finds this checkout's package first). pretrain.py gets the
# whole file (--config FILE); the script adds a flag only for a variable the user set, which wins over the file, or
# for what the file leaves unset (the script's own defaults): a default of the script never overrides the file.
declare -A PRESET=() FROM=()
READ_STATUS=0
VALUES=$(cd "$ROOT" && exec "$PYTHON" -m codegeex_train.config.script_values "$CONFIG_FILE" 2>&1) || READ_STATUS=$?
case $READ_STATUS in
  0) ;;
  2) echo "$VALUES" >&2; exit 2 ;;  # the reader's own error: line
  *) die "PYTHON=$PYTHON could not read CONFIG=$CONFIG with codegeex_train's reader (exit $READ_STATUS:" \
       "${VALUES##*$'\n'}): set PYTHON to the Python of the environment codegeex_train is installed in" ;;
esac
while IFS= read -r line; do [[ "$line" == *=* ]] && PRESET[${line%%=*}]=${line#*=}; done <<< "$VALUES"
# pick NAME KEY [DEFAULT]: NAME's value from the user's variable (FROM[NAME]=var), else the file's KEY (file), else
# DEFAULT (default: the script's own, or empty).
pick() {
  if [ -n "${!1:-}" ]; then FROM[$1]=var
  elif [ -n "${PRESET[$2]:-}" ]; then printf -v "$1" %s "${PRESET[$2]}"; FROM[$1]=file
  else printf -v "$1" %s "${3:-}"; FROM[$1]=default; fi
}
# Resolved configs (RUN/config.yaml, which every run writes) hold their run's `save:`: relaunched, it resumes that
# run in that directory, unless OUTPUT_DIR says otherwise.
pick OUTPUT_DIR save "./outputs/codegen-$(basename "${CONFIG%.y*ml}")"
[ "${FROM[OUTPUT_DIR]}" != file ] || [[ "$OUTPUT_DIR" != *"<redacted>"* ]] || die "CONFIG=$CONFIG: save:" \
  "$OUTPUT_DIR had a credential redacted when the file was written: set OUTPUT_DIR to the run's directory"
CONFIG_DIR=$(dirname "$CONFIG_FILE")
if [ "${FROM[OUTPUT_DIR]}" = file ] && [ -f "$CONFIG_DIR/latest" ] &&
   [ "$(cd "$OUTPUT_DIR" 2>/dev/null && pwd -P)" != "$(cd "$CONFIG_DIR" && pwd -P)" ]; then
  die "CONFIG=$CONFIG is the config of the run in $CONFIG_DIR (it holds 'latest'), but its save: $OUTPUT_DIR is" \
    "another directory from here ($PWD): set OUTPUT_DIR=$CONFIG_DIR to resume that run, or OUTPUT_DIR=NEW_DIR" \
    "for a new run"
fi
DRY_RUN=${DRY_RUN:-0}
if [ -z "${DEVICE:-}" ]; then
  # DS_ACCELERATOR=cpu is DeepSpeed's own way of asking for the CPU: honoured. Otherwise the GPUs decide; a cluster
  # launched from a host without them (a login node) is not guessed: its nodes would all train on their CPUs.
  if [ "${DS_ACCELERATOR:-}" = cpu ]; then DEVICE=cpu
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu
  elif [ -n "${HOSTFILE:-}" ]; then
    die "HOSTFILE=$HOSTFILE, but this host has no GPU (\`nvidia-smi -L\` lists none), so every node would train on" \
      "its CPU: set DEVICE=gpu (GPU nodes) or DEVICE=cpu"
  else DEVICE=cpu; fi
fi
pick TP tensor_model_parallel_size 1
pick PP pipeline_model_parallel_size 1
pick CP context_parallel_size 1
pick VPP num_layers_per_virtual_pipeline_stage
NUM_LAYERS=${PRESET[num_layers]:-}
pick SEQ_LENGTH seq_length
pick MICRO_BATCH micro_batch_size
pick GLOBAL_BATCH global_batch_size  # none: MICRO_BATCH x DP x MICRO_BATCHES (below)
pick MICRO_BATCHES num_microbatches
pick TRAIN_ITERS train_iters
# Set, these go to pretrain.py and win over the file; unset, the file's values (or pretrain.py's defaults) hold.
LR=${LR:-} MIN_LR=${MIN_LR:-} DECAY=${DECAY:-} WARMUP=${WARMUP:-} LR_DECAY_ITERS=${LR_DECAY_ITERS:-}
for pair in NUM_LAYERS:num_layers SEQ_LENGTH:seq_length MICRO_BATCH:micro_batch_size TRAIN_ITERS:train_iters; do
  name=${pair%%:*}
  [ -n "${!name}" ] || die "CONFIG=$CONFIG: $CONFIG_FILE sets no ${pair#*:} and $name is not set (the script's" \
    "layout arithmetic needs it)"
done

# Variables the script sets for the launcher and its ranks (DRY_RUN prints them in front of the command).
ENV_VARS=("PYTHONPATH=$PYTHONPATH")
# The device's DeepSpeed config, precision and backend: the script's defaults, for what the file leaves unset.
case "$DEVICE" in
  gpu)  # DeepSpeed picks the CUDA accelerator itself: nothing forced
    [ "${DS_ACCELERATOR:-}" = cpu ] && die "DEVICE=gpu, but DS_ACCELERATOR=cpu in the environment would keep" \
      "DeepSpeed on the CPU: unset DS_ACCELERATOR, or use DEVICE=cpu"
    if [ -z "${NUM_GPUS:-}" ] && [ -z "${HOSTFILE:-}" ]; then
      NUM_GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
      [ "$NUM_GPUS" -gt 0 ] || die "DEVICE=gpu, but \`nvidia-smi -L\` lists no GPU: set NUM_GPUS (GPUs per node)"
    fi
    pick DS_CONFIG deepspeed_config "$ROOT/ds_configs/gpu_bf16_zero2.json"
    PRECISION_ARGS=(--bf16)
    [[ "$DS_CONFIG" == *fp16* ]] && PRECISION_ARGS=(--fp16)
    BACKEND=nccl ;;
  cpu)
    NUM_GPUS=${NUM_GPUS:-2}
    pick DS_CONFIG deepspeed_config "$ROOT/ds_configs/cpu_fp32_zero2.json"
    PRECISION_ARGS=() BACKEND=gloo
    [ "${PRESET[distributed_backend]:-}" != nccl ] || die "CONFIG=$CONFIG sets distributed_backend: nccl, which" \
      "needs GPU ranks, and DEVICE=cpu: run it on GPU nodes (DEVICE=gpu), or pass --distributed-backend gloo"
    # DeepSpeed JIT-builds a CPU comm op once; keep it with the checkout. Fixed glibc malloc thresholds
    # (distributed/malloc.py): the adaptive mmap threshold fragments the heap (peak RSS 0.8 -> 2.3 GB a rank);
    # 4 MiB keeps it flat at the adaptive speed.
    ENV_VARS+=(DS_ACCELERATOR=cpu "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
               "TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
               "MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4194304}"
               "MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4194304}") ;;
  *) die "DEVICE=$DEVICE: use cpu or gpu" ;;
esac
# A file that chooses its precision (bf16 or fp16, true or false) or its backend keeps them.
[ -z "${PRESET[bf16]:-}${PRESET[fp16]:-}" ] || PRECISION_ARGS=()
[ -n "${PRESET[distributed_backend]:-}" ] || PRECISION_ARGS+=(--distributed-backend "$BACKEND")
DS_CONFIG_ARGS=()
[ "${FROM[DS_CONFIG]}" = file ] || DS_CONFIG_ARGS=(--deepspeed-config "$DS_CONFIG")

# Layout flags among the arguments override the variables (the last one wins in pretrain.py too), so that the
# layout checked and printed here is the one that runs.
USER_LOAD= ARGS_SP= ARGS_RECOMPUTE= ARGS_DECAY_ITERS=
ARGV=("$@")
for ((i = 0; i < ${#ARGV[@]}; i++)); do
  flag=${ARGV[i]} value=${ARGV[i + 1]:-}
  case "$flag" in --*=*) value=${flag#*=} flag=${flag%%=*} ;; esac
  case "$flag" in
    --tensor-model-parallel-size) TP=$value FROM[TP]=args ;;
    --pipeline-model-parallel-size) PP=$value FROM[PP]=args ;;
    --context-parallel-size) CP=$value FROM[CP]=args ;;
    --seq-length) SEQ_LENGTH=$value FROM[SEQ_LENGTH]=args ;;
    --num-layers-per-virtual-pipeline-stage) VPP=$value FROM[VPP]=args ;;
    --num-layers) NUM_LAYERS=$value ;;
    --micro-batch-size) MICRO_BATCH=$value FROM[MICRO_BATCH]=args ;;
    --global-batch-size) GLOBAL_BATCH=$value FROM[GLOBAL_BATCH]=args ;;
    --num-microbatches) MICRO_BATCHES=$value FROM[MICRO_BATCHES]=args ;;
    --train-iters) TRAIN_ITERS=$value FROM[TRAIN_ITERS]=args ;;
    --lr-decay-iters) ARGS_DECAY_ITERS=$value ;;
    --load) USER_LOAD=$value ;;
    --sequence-parallel) ARGS_SP=1 ;;
    --recompute-granularity) ARGS_RECOMPUTE=$value ;;
    --checkpoint-activations) ARGS_RECOMPUTE=full ;;
  esac
done
# Sequence parallelism and recompute: the arguments' flags win, then the variables, then the file's own settings,
# then its launch: defaults (CodeGeeX-13B: selective recompute, SP when TP > 1). The script adds no flag of its own
# over the arguments' (so --checkpoint-activations never meets a --recompute-granularity selective from here), nor
# over the file's.
FILE_SP=${PRESET[sequence_parallel]:-} FILE_RECOMPUTE=${PRESET[recompute_granularity]:-}
[ "${PRESET[checkpoint_activations]:-}" = true ] && FILE_RECOMPUTE=full
if [ -n "$ARGS_SP" ]; then SP=1 FROM[SP]=args
elif [ -n "${SP:-}" ]; then FROM[SP]=var
elif [ -n "$FILE_SP" ]; then SP=$([ "$FILE_SP" = true ] && echo 1 || echo 0) FROM[SP]=file
else SP=0 FROM[SP]=default
  [ "${PRESET[sequence_parallel_with_tp]:-}" = true ] && [[ "$TP" =~ ^[0-9]+$ ]] && [ "$TP" -gt 1 ] && SP=1
fi
if [ -n "$ARGS_RECOMPUTE" ]; then RECOMPUTE=$ARGS_RECOMPUTE FROM[RECOMPUTE]=args
elif [ -n "${RECOMPUTE:-}" ]; then FROM[RECOMPUTE]=var
elif [ -n "$FILE_RECOMPUTE" ]; then RECOMPUTE=$FILE_RECOMPUTE FROM[RECOMPUTE]=file
else RECOMPUTE=${PRESET[recompute]:-none} FROM[RECOMPUTE]=default; fi
case "$SP" in 0 | 1) ;; *) die "SP=$SP: use 1 (--sequence-parallel) or 0" ;; esac
case "$RECOMPUTE" in none | selective | full) ;; *) die "RECOMPUTE=$RECOMPUTE: use none, selective or full" ;; esac
# A switch the file turns on has no --no- form: a variable that would turn it off is refused, not ignored.
[ "${FROM[SP]}" != var ] || [ "$SP" = 1 ] || [ "$FILE_SP" != true ] || die "SP=0, but CONFIG=$CONFIG sets" \
  "sequence_parallel: true, which the command line cannot turn off: set it to false in the file, or drop SP=0"
if [ "${FROM[RECOMPUTE]}" = var ] && [ -n "$FILE_RECOMPUTE" ] && [ "$RECOMPUTE" != "$FILE_RECOMPUTE" ] &&
   { [ "$RECOMPUTE" = none ] || [ "${PRESET[checkpoint_activations]:-}" = true ]; }; then
  die "RECOMPUTE=$RECOMPUTE, but CONFIG=$CONFIG sets $([ "${PRESET[checkpoint_activations]:-}" = true ] &&
    echo "checkpoint_activations: true" || echo "recompute_granularity: $FILE_RECOMPUTE"), which the command line" \
    "cannot undo: change it in the file, or drop RECOMPUTE=$RECOMPUTE"
fi
# The layout's flags: a variable set, or the script's default where the file sets none (the arguments carry theirs).
passed() { [ "${FROM[$1]}" = var ] || [ "${FROM[$1]}" = default ]; }
MEMORY_ARGS=()
[ "$SP" = 1 ] && passed SP && MEMORY_ARGS+=(--sequence-parallel)
[ "$RECOMPUTE" != none ] && passed RECOMPUTE && MEMORY_ARGS+=(--recompute-granularity "$RECOMPUTE")
LAYOUT_ARGS=()
passed TP && LAYOUT_ARGS+=(--tensor-model-parallel-size "$TP")
passed PP && LAYOUT_ARGS+=(--pipeline-model-parallel-size "$PP")
[ -n "$VPP" ] && passed VPP && LAYOUT_ARGS+=(--num-layers-per-virtual-pipeline-stage "$VPP")
CP_ARGS=()  # only when asked: the default command line stays as it was
[ "${FROM[CP]}" = var ] && { [ "$CP" != 1 ] || [ -n "${PRESET[context_parallel_size]:-}" ]; } &&
  CP_ARGS=(--context-parallel-size "$CP")
# e.g. LAUNCHER_ARGS="--master_addr 10.0.0.1 --master_port 29500 --ssh_port 2222" (word list)
# shellcheck disable=SC2206
EXTRA_LAUNCHER_ARGS=(${LAUNCHER_ARGS:-})
LAUNCH_NODES=0 LAUNCH_GPUS=0 SUBSET=
for ((i = 0; i < ${#EXTRA_LAUNCHER_ARGS[@]}; i++)); do
  flag=${EXTRA_LAUNCHER_ARGS[i]} value=${EXTRA_LAUNCHER_ARGS[i + 1]:-}
  case "$flag" in --*=*) value=${flag#*=} flag=${flag%%=*} ;; esac
  case "$flag" in
    --num_nodes) LAUNCH_NODES=$value ;;
    --num_gpus) LAUNCH_GPUS=$value ;;
    --include | --exclude) SUBSET=$flag ;;
  esac
done
for name in TP PP CP VPP NUM_LAYERS MICRO_BATCH NUM_GPUS GLOBAL_BATCH MICRO_BATCHES LAUNCH_NODES LAUNCH_GPUS \
    SEQ_LENGTH; do
  value=${!name:-}
  [ -z "$value" ] || [[ "$value" =~ ^[0-9]+$ ]] || die "$name=$value: not a whole number"
done
for name in TP PP CP VPP MICRO_BATCH GLOBAL_BATCH MICRO_BATCHES SEQ_LENGTH; do
  [ "${!name:-1}" -gt 0 ] || die "$name=${!name}: must be at least 1"
done
# Context parallelism (Megatron's rule): each sequence is cut into 2 x CP chunks, two per CP rank.
(( SEQ_LENGTH % (2 * CP) == 0 )) || die "CP=$CP cuts SEQ_LENGTH $SEQ_LENGTH into $((2 * CP)) equal chunks" \
  "(two per CP rank): use a SEQ_LENGTH divisible by $((2 * CP))"
# Interleaved 1F1B (Megatron's rules): a pipeline, and the layers cut into PP x VPP-layer chunks.
if [ -n "$VPP" ]; then
  [ "$PP" -gt 1 ] || die "VPP=$VPP (--num-layers-per-virtual-pipeline-stage) needs PP > 1: interleaving splits" \
    "the pipeline's stages into chunks; unset VPP for PP $PP"
  if (( NUM_LAYERS % (PP * VPP) )); then
    FITS=$(for ((n = 1; n <= NUM_LAYERS / PP; n++)); do (( NUM_LAYERS % (PP * n) )) || printf ' %s' "$n"; done)
    [ -n "$FITS" ] && FITS="use VPP among:$FITS" || FITS="no VPP works at PP $PP"
    die "VPP=$VPP: the $NUM_LAYERS layers do not split into chunks of $VPP on each of the $PP stages" \
      "(layers divisible by PP x VPP = $((PP * VPP))): $FITS"
  fi
fi

# The ranks: NUM_GPUS on this node, or the hostfile's slots (trimmed as deepspeed's --num_nodes/--num_gpus do).
if [ -n "${HOSTFILE:-}" ]; then
  [ -f "$HOSTFILE" ] || die "HOSTFILE=$HOSTFILE: no such file"
  read -r NODES RANKS < <(awk -v max_nodes="$LAUNCH_NODES" -v per_node="$LAUNCH_GPUS" '
    { sub(/^[ \t]+/, ""); sub(/[ \t\r]+$/, "") }
    $0 == "" || /^#/ { next }
    $2 !~ /^slots=[0-9]+/ { bad = 1; print "bad", $0; exit }
    max_nodes > 0 && nodes >= max_nodes { next }
    { nodes++; ranks += per_node > 0 ? per_node : substr($2, 7) + 0 }
    END { if (!bad) print nodes + 0, ranks + 0 }' "$HOSTFILE")
  [ "$NODES" != bad ] || die "HOSTFILE=$HOSTFILE: not a 'hostname slots=N' line: $RANKS"
  [ "$RANKS" -gt 0 ] || die "HOSTFILE=$HOSTFILE: no 'hostname slots=N' line"
else
  NODES=1 RANKS=$NUM_GPUS
  [ "$LAUNCH_GPUS" -gt 0 ] && RANKS=$LAUNCH_GPUS
fi
[ "$RANKS" -gt 0 ] || die "NUM_GPUS=${NUM_GPUS:-}: no ranks to launch"
if [ -n "$SUBSET" ]; then
  # --include/--exclude pick slots by name: the ranks are unknown here, pretrain.py checks the layout itself.
  [ -n "${GLOBAL_BATCH:-}" ] || die "LAUNCHER_ARGS has $SUBSET: the number of ranks is unknown here, set GLOBAL_BATCH"
  DP="?" MICRO_BATCHES=${MICRO_BATCHES:-?} RANKS="? (LAUNCHER_ARGS $SUBSET)"
else
  # DP = ranks / (TP x CP x PP); the default global batch follows it: MICRO_BATCH x DP x MICRO_BATCHES.
  (( RANKS % (TP * CP * PP) == 0 )) || die "TP $TP x CP $CP x PP $PP = $((TP * CP * PP)) does not divide the" \
    "$RANKS ranks ($NODES node(s)): the data-parallel size would not be whole"
  DP=$((RANKS / (TP * CP * PP)))
  PER_STEP=$((MICRO_BATCH * DP))
  if [ -n "${GLOBAL_BATCH:-}" ]; then
    (( GLOBAL_BATCH % PER_STEP == 0 )) || die "GLOBAL_BATCH $GLOBAL_BATCH is not divisible by MICRO_BATCH" \
      "$MICRO_BATCH x DP $DP = $PER_STEP: use a multiple of $PER_STEP"
    [ -z "${MICRO_BATCHES:-}" ] || (( MICRO_BATCHES * PER_STEP == GLOBAL_BATCH )) || die "MICRO_BATCHES" \
      "$MICRO_BATCHES disagrees with GLOBAL_BATCH $GLOBAL_BATCH / (MICRO_BATCH x DP = $PER_STEP)"
    MICRO_BATCHES=$((GLOBAL_BATCH / PER_STEP))
  else
    # One micro-batch per DP rank a step, and at least one per pipeline stage (fewer leave stages idle).
    MICRO_BATCHES=${MICRO_BATCHES:-$PP}
    GLOBAL_BATCH=$((PER_STEP * MICRO_BATCHES))
  fi
  [ -z "$VPP" ] || (( MICRO_BATCHES % PP == 0 )) || die "VPP=$VPP: interleaved 1F1B needs the micro-batches per" \
    "step (MICRO_BATCHES $MICRO_BATCHES = GLOBAL_BATCH / (MICRO_BATCH x DP)) divisible by PP $PP: use a" \
    "GLOBAL_BATCH of a multiple of $((PER_STEP * PP))"
fi

# Where the weights come from: this output directory's last complete checkpoint wins (a relaunch resumes);
# else INIT_FROM's weights alone (--finetune: iteration, optimizer and LR schedule start fresh); else scratch.
# A file's load: (a resolved config's: its run's, or a fine-tuning's source with finetune: true) is not overridden
# by the script's own --load: pretrain.py reads it (under --finetune it resumes --save once that holds a checkpoint).
FILE_LOAD=${PRESET[load]:-} FILE_FINETUNE=${PRESET[finetune]:-false}
if [ -f "$OUTPUT_DIR/latest" ]; then
  LOAD_ARGS=()
  [ -n "$FILE_LOAD" ] || LOAD_ARGS=(--load "$OUTPUT_DIR")
  START="resume from $OUTPUT_DIR ($(cat "$OUTPUT_DIR/latest"))${INIT_FROM:+, not INIT_FROM=$INIT_FROM}"
elif [ -n "${INIT_FROM:-}" ]; then
  [ -d "$INIT_FROM" ] || die "INIT_FROM=$INIT_FROM: no such directory"
  LOAD_ARGS=(--load "$INIT_FROM" --finetune)
  START="the weights in INIT_FROM=$INIT_FROM (--finetune: iteration, optimizer and LR schedule fresh)"
elif [ -n "$FILE_LOAD" ]; then
  LOAD_ARGS=()
  START="--load $FILE_LOAD (CONFIG's load$([ "$FILE_FINETUNE" != true ] || echo ", --finetune"))"
else
  LOAD_ARGS=()
  START="from scratch"
fi
LOAD_FROM="in the arguments"
if [ -z "$USER_LOAD" ] && [ -n "$FILE_LOAD" ] && [ "$FILE_FINETUNE" != true ] &&
   { [ -f "$OUTPUT_DIR/latest" ] || [ -z "${INIT_FROM:-}" ]; }; then
  USER_LOAD=$FILE_LOAD LOAD_FROM="in CONFIG=$CONFIG (load:)"
fi
if [ -n "$USER_LOAD" ] && [ "$(cd "$USER_LOAD" 2>/dev/null && pwd -P || echo "$USER_LOAD")" != \
                            "$(cd "$OUTPUT_DIR" 2>/dev/null && pwd -P || echo "$OUTPUT_DIR")" ]; then
  START="--load $USER_LOAD ($([ "$LOAD_FROM" = "in the arguments" ] && echo "from the arguments" || echo "CONFIG's load"))"
  echo "warning: --load $USER_LOAD $LOAD_FROM overrides the automatic resume: the same command again would" \
    "start over from it. Use INIT_FROM=$USER_LOAD to fine-tune from it and resume from $OUTPUT_DIR." >&2
fi

# FIM: the variables, when set, win over the file's fim_rate and fim_spm_rate; with repository documents each file
# is transformed on its own (the script's --fim-split-sample, unless the file names its own).
DOCUMENT_LEVEL=${DOCUMENT_LEVEL:-file}
case "$DOCUMENT_LEVEL" in file | repo) ;; *) die "DOCUMENT_LEVEL=$DOCUMENT_LEVEL: use file or repo" ;; esac
[[ "${FIM_RATE:-0}" =~ ^(0|1|0?\.[0-9]+|1\.0*)$ ]] || die "FIM_RATE=$FIM_RATE: use a fraction in [0, 1], e.g. 0.5"
[[ "${FIM_SPM_RATE:-0}" =~ ^(0|1|0?\.[0-9]+|1\.0*)$ ]] || die "FIM_SPM_RATE=$FIM_SPM_RATE: use a fraction in [0, 1]"
CODE_DATA_ARGS=()
[ -z "${FIM_RATE:-}" ] || CODE_DATA_ARGS+=(--fim-rate "$FIM_RATE")
[ -z "${FIM_SPM_RATE:-}" ] || CODE_DATA_ARGS+=(--fim-spm-rate "$FIM_SPM_RATE")
if [[ ! "${FIM_RATE:-${PRESET[fim_rate]:-0}}" =~ ^0?\.?0*$ ]] && [ "$DOCUMENT_LEVEL" = repo ] &&
   [ -z "${PRESET[fim_split_sample]:-}" ]; then
  CODE_DATA_ARGS+=(--fim-split-sample "<file_sep>")
fi

# The data: DATA_PATH, else the file's (data_path or train_data_path, with its tokenizer), else the default corpus.
PREPROCESS=() DATA_ARGS=()
FILE_DATA=${PRESET[data_path]:-${PRESET[train_data_path]:-}}
FILE_TOKENIZER=
for key in tokenizer_type tokenizer_model vocab_file merge_file; do
  [ -z "${PRESET[$key]:-}" ] || FILE_TOKENIZER+="${FILE_TOKENIZER:+, }$key: ${PRESET[$key]}"
done
if [ -n "${DATA_PATH:-}" ]; then
  DATA_ARGS=(--data-path "$DATA_PATH")
elif [ -n "$FILE_DATA" ]; then
  DATA_PATH=$FILE_DATA
elif [ -n "$FILE_TOKENIZER" ] && [ -z "${TOKENIZER_ARGS:-}" ]; then
  die "CONFIG=$CONFIG sets a tokenizer ($FILE_TOKENIZER) but no data_path: the default corpus is tokenized with" \
    "the shipped tokenizer; set DATA_PATH to data preprocessed with that tokenizer (or data_path in the file)"
else
  # The embedded default corpus: the Python standard library's source, shipped tokenizer.
  if [ "$DOCUMENT_LEVEL" = repo ]; then
    # Repository documents need the sentinels: the shipped tokenizer with them appended is saved beside the data.
    DATA_PATH=$ROOT/.cache/data/stdlib_repo_text_document
    TOKENIZER_ARGS=${TOKENIZER_ARGS:-"--tokenizer-type HFTokenizer
                    --tokenizer-model $ROOT/.cache/data/stdlib_repo_tokenizer.json --whitespace-encoding"}
    [ -f "$DATA_PATH.idx" ] || PREPROCESS=("$PYTHON" "$ROOT/tools/preprocess_data.py" --input default
                                           --output-prefix "$ROOT/.cache/data/stdlib_repo" --whitespace-encoding
                                           --append-eod --workers 2 --document-level repo --repo-format starcoder2
                                           --file-order random)
  else
    DATA_PATH=$ROOT/.cache/data/stdlib_text_document
    [ -f "$DATA_PATH.idx" ] || PREPROCESS=("$PYTHON" "$ROOT/tools/preprocess_data.py" --input default
                                           --output-prefix "$ROOT/.cache/data/stdlib" --whitespace-encoding
                                           --append-eod --workers 2)
  fi
  DATA_ARGS=(--data-path "$DATA_PATH")
fi

if [ -n "${HOSTFILE:-}" ]; then
  # pdsh forwards only PYTHON*/UCX*/... variables to the other nodes; the rest travel in a .deepspeed_env file
  # (DS_ENV_FILE, written below). Credentials never go there (log in to wandb / Hugging Face on each node instead).
  if [ -d "$OUTPUT_DIR" ]; then OUTPUT_ABS=$(cd "$OUTPUT_DIR" && pwd)
  else case "$OUTPUT_DIR" in /*) OUTPUT_ABS=$OUTPUT_DIR ;; *) OUTPUT_ABS=$PWD/${OUTPUT_DIR#./} ;; esac; fi
  ENV_VARS+=("DS_ENV_FILE=$OUTPUT_ABS/.deepspeed_env")
  # DeepSpeed's multi-node runner puts its working directory first on the nodes' PYTHONPATH, before ROOT.
  [ "$(pwd -P)" = "$(cd "$ROOT" && pwd -P)" ] || [ ! -e codegeex_train/__init__.py ] || die "HOSTFILE=$HOSTFILE:" \
    "DeepSpeed puts the working directory first on every node's PYTHONPATH, and $PWD holds another copy of" \
    "codegeex_train, which the ranks would run instead of $ROOT's: launch from $ROOT, or from a directory without one"
  LAUNCHER=(deepspeed --hostfile "$HOSTFILE")
else
  LAUNCHER=(deepspeed --num_gpus "$NUM_GPUS")
fi
LAUNCHER+=("${EXTRA_LAUNCHER_ARGS[@]}")
command -v deepspeed >/dev/null 2>&1 || LAUNCHER=("$PYTHON" -m deepspeed.launcher.runner "${LAUNCHER[@]:1}")

# The whole file, then what a variable sets (winning over the file) or the file leaves unset (the script's defaults).
RUN_ARGS=()
for pair in SEQ_LENGTH:--seq-length MICRO_BATCH:--micro-batch-size GLOBAL_BATCH:--global-batch-size \
    TRAIN_ITERS:--train-iters; do
  name=${pair%%:*}
  passed "$name" && RUN_ARGS+=("${pair#*:}" "${!name}")
done
for pair in LR:--lr MIN_LR:--min-lr DECAY:--lr-decay-style WARMUP:--lr-warmup-iters \
    LR_DECAY_ITERS:--lr-decay-iters; do
  name=${pair%%:*}
  [ -z "${!name}" ] || RUN_ARGS+=("${pair#*:}" "${!name}")
done
SAVE_ARGS=()
[ "${FROM[OUTPUT_DIR]}" = file ] || SAVE_ARGS=(--save "$OUTPUT_DIR")
# shellcheck disable=SC2086  # TOKENIZER_ARGS is a word list
CMD=("${LAUNCHER[@]}" "$ROOT/codegeex_train/pretrain.py" --config "$CONFIG_FILE"
  "${PRECISION_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${MEMORY_ARGS[@]}" "${CP_ARGS[@]}" "${RUN_ARGS[@]}"
  "${DATA_ARGS[@]}" ${TOKENIZER_ARGS:-} "${CODE_DATA_ARGS[@]}" "${DS_CONFIG_ARGS[@]}" "${SAVE_ARGS[@]}"
  "${LOAD_ARGS[@]}"
  "$@")

echo "codegeex_train: layout CONFIG=$CONFIG DEVICE=$DEVICE NODES=$NODES RANKS=$RANKS TP=$TP PP=$PP VPP=${VPP:-none}" \
  "CP=$CP DP=$DP SEQ_LENGTH=$SEQ_LENGTH" \
  "MICRO_BATCH=$MICRO_BATCH MICRO_BATCHES=$MICRO_BATCHES GLOBAL_BATCH=$GLOBAL_BATCH SP=$SP RECOMPUTE=$RECOMPUTE"
# Words as a shell reads them back: plain ones as they are, the rest quoted.
shell_words() {
  local word out=()
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$word"); else out+=("$(printf '%q' "$word")"); fi
  done
  echo "${out[*]}"
}
if [ "$DRY_RUN" != 0 ]; then
  echo "codegeex_train: OUTPUT_DIR=$OUTPUT_DIR; start: $START"
  [ ${#PREPROCESS[@]} -eq 0 ] || echo "codegeex_train: a real run first preprocesses the default corpus:" \
    "$(shell_words "${PREPROCESS[@]}")"
  [ -z "${HOSTFILE:-}" ] || echo "codegeex_train: a real run first writes ${ENV_VARS[-1]#DS_ENV_FILE=} (the" \
    "variables the other nodes need)"
  # pretrain.py's own checks at these ranks (its --dry-run: data, tokenizer, heads and layers against the layout,
  # every flag, the DeepSpeed config, --load, memory) with the launch's arguments and variables; no process group.
  # The default corpus still to be preprocessed has no data files to check yet (nor, for repository documents, the
  # tokenizer with their sentinels, which is built with them).
  CHECK=("$PYTHON" "${CMD[@]:${#LAUNCHER[@]}}" --dry-run)
  [ ${#PREPROCESS[@]} -eq 0 ] || CHECK+=(--dry-run-skip-data)
  if [ -n "$SUBSET" ]; then
    echo "codegeex_train: pretrain.py's checks did not run (LAUNCHER_ARGS has $SUBSET: the ranks are unknown here);" \
      "run them with WORLD_SIZE=<ranks> $(shell_words "${CHECK[@]}")"
  elif [ ${#PREPROCESS[@]} -gt 0 ] && [ "$DOCUMENT_LEVEL" = repo ]; then
    echo "codegeex_train: pretrain.py's checks did not run: the repository corpus and its tokenizer do not exist" \
      "yet (the preprocessing above builds them); DRY_RUN=1 after it runs them"
  else
    env "${ENV_VARS[@]}" WORLD_SIZE="$RANKS" "${CHECK[@]}" || exit $?
  fi
  echo "codegeex_train: DRY_RUN=$DRY_RUN: nothing was launched. The launch command (one line):"
  shell_words "${ENV_VARS[@]}" "${CMD[@]}"
  exit 0
fi

mkdir -p "$OUTPUT_DIR/logs"
export "${ENV_VARS[@]}"
[ ${#PREPROCESS[@]} -eq 0 ] || "${PREPROCESS[@]}"
if [ -n "${HOSTFILE:-}" ]; then
  (umask 077
   env | grep -E '^(DS_ACCELERATOR|TORCH_EXTENSIONS_DIR|OMP_NUM_THREADS|MALLOC_[A-Z_]*|WANDB_[A-Z_]*|HF_[A-Z_]*|NCCL_[A-Z_]*|GLOO_[A-Z_]*)=' \
     | grep -Ev '^[^=]*(KEY|TOKEN|SECRET|PASSWORD)[^=]*=' \
     | while IFS='=' read -r name value; do printf '%s=%q\n' "$name" "$value"; done > "$DS_ENV_FILE")
fi
LOG="$OUTPUT_DIR/logs/train-$(date +%Y%m%d-%H%M%S).log"
echo "codegeex_train: OUTPUT_DIR=$OUTPUT_DIR (log $LOG); start: $START"
# Preemption: SLURM (time limit, preemption, scancel --full) and `kill -- -PGID` signal every process of the job,
# this shell and tee included. The shell waits for the launch (its trap runs once the launch has ended), tee ignores
# the signal and keeps logging while the ranks save. A signalled DeepSpeed launcher exits 1 whatever its ranks did:
# the ranks report a stop by signal after a complete save in OUTPUT_DIR/preempted (the tag, written after `latest`).
rm -f "$OUTPUT_DIR/preempted"
trap : TERM INT
STATUS=0
"${CMD[@]}" 2>&1 | (trap '' TERM INT; exec tee "$LOG") || STATUS=$?
trap - TERM INT
PREEMPTED=$(cat "$OUTPUT_DIR/preempted" 2>/dev/null || true)
if [ -n "$PREEMPTED" ] && [ "$PREEMPTED" = "$(cat "$OUTPUT_DIR/latest" 2>/dev/null)" ]; then
  echo "codegeex_train: stopped by a signal after saving $OUTPUT_DIR/$PREEMPTED (launcher exit code $STATUS," \
    "reported as 0); run the same command to resume from it"
  exit 0
fi
[ "$STATUS" -eq 0 ] || exit "$STATUS"

# Plots of the run (loss, LR, grad norm, tokens/s, memory, communication) from its metrics.jsonl. The training
# succeeded by now: a plotting failure (no matplotlib, a custom --metrics-file, ...) only warns.
"$PYTHON" "$ROOT/tools/plot_metrics.py" "$OUTPUT_DIR" -o "$OUTPUT_DIR/plots.png" \
  || echo "warning: no plots: tools/plot_metrics.py failed on $OUTPUT_DIR (the training run itself succeeded)" >&2

# Where everything is, and what to run next (with this run's layout: a checkpoint loads at the same TP and PP). A
# resume keeps the LR schedule (pretrain.py refuses another): continuing fixes the decay where this run had it.
DECAY_ITERS=${ARGS_DECAY_ITERS:-${LR_DECAY_ITERS:-${PRESET[lr_decay_iters]:-$TRAIN_ITERS}}}
TAG=$(cat "$OUTPUT_DIR/latest" 2>/dev/null || echo "(none: no checkpoint saved)")
SAME=$([ "$CONFIG" = default ] || printf 'CONFIG=%s ' "$CONFIG"; [ "$TP" = 1 ] || printf 'TP=%s ' "$TP"
       [ "$PP" = 1 ] || printf 'PP=%s ' "$PP"; [ -z "$VPP" ] || printf 'VPP=%s ' "$VPP"
       [ "$CP" = 1 ] || printf 'CP=%s ' "$CP")
cat <<SUMMARY

codegeex_train: finished (start: $START). Outputs in $OUTPUT_DIR:
  checkpoint  $OUTPUT_DIR/$TAG (the 'latest' one; a relaunch resumes from it, INIT_FROM or not)
  metrics     $OUTPUT_DIR/metrics.jsonl
  plots       $OUTPUT_DIR/plots.png
  log         $LOG
Continue training (more iterations, same directory, its LR schedule as it was: decay over $DECAY_ITERS, then MIN_LR):
  ${SAME}TRAIN_ITERS=$((TRAIN_ITERS * 2)) LR_DECAY_ITERS=$DECAY_ITERS OUTPUT_DIR=$OUTPUT_DIR bash scripts/pretrain_codegen.sh
Fine-tune from it (its weights only, into a new directory; iteration, optimizer and LR schedule start fresh):
  ${SAME}INIT_FROM=$OUTPUT_DIR OUTPUT_DIR=$OUTPUT_DIR-finetune DATA_PATH=... bash scripts/pretrain_codegen.sh
Generate from it:
  $(command -v "$PYTHON") tools/generate.py --load $OUTPUT_DIR --prompt 'def fibonacci(n):\n' --max-new-tokens 64
SUMMARY
