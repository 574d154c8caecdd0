"""The pretraining command line: typed config sections, Megatron's flag names, validated once.

``parse_args`` turns argv into ``Args`` (one dataclass per concern); ``validate`` checks every
cross-section rule in a fixed order and derives, once, the run's ``ParallelPlan`` (layout/plan.py), before any
process group exists. ``Args`` stay as parsed: the tokenizer's vocabulary goes into a copy of the model config
(``ModelConfig.with_vocab``) that ``validate`` checks.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import warnings
from dataclasses import dataclass

from codegeex_train.config import config_file, megatron_flags
from codegeex_train.config.lr_schedule import OVERRIDE_FLAG, USE_CHECKPOINT_FLAG, SchedulePolicy
from codegeex_train.config.model_config import ModelConfig, ModelConfigError
from codegeex_train.layout.recompute import GRANULARITIES as RECOMPUTE_GRANULARITIES
from codegeex_train.layout.recompute import METHODS as RECOMPUTE_METHODS
from codegeex_train.layout.recompute import MODULES as RECOMPUTE_MODULES
from codegeex_train.layout.recompute import Recompute
from codegeex_train.config.redaction import redact_secrets
from codegeex_train.config.tokenizer_flags import tokenizer_field
from codegeex_train.config.options import (
    UNIT_OPEN,
    FlagParser,
    Range,
    above,
    add_foreign_flags,
    at_least,
    build_parser,
    dataclass_from_args,
    option,
    out_of_range,
)
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.distributed.log import LEVELS as LOG_LEVELS
from codegeex_train.distributed.log import level_name
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError


HUMANEVAL_LANGUAGES = ("python", "cpp", "java", "js", "go")  # evaluation/languages.py's, checked by a test
INFILLING_BENCHMARKS = ("single-line", "multi-line", "random-span", "random-span-light")  # evaluation/infilling.py's
MAX_TIMEOUT_MINUTES = 1e6  # about two years; far above it, timedelta (and the backends' milliseconds) overflow


class ConfigError(ValueError):
    """Bad flags; the message names the flag(s) and the fix."""


@dataclass
class ParallelConfig:
    """Parallelism: TP inside a node, PP across stages, DP (DeepSpeed ZeRO) over the rest."""

    tensor_model_parallel_size: int = option(1, "TP size: ranks that split every layer (contiguous ranks, "
                                             "keep inside a node)", bounds=at_least(1))
    pipeline_model_parallel_size: int = option(1, "PP size: pipeline stages (layers split evenly; see the two "
                                               "flags below for an uneven split)", bounds=at_least(1))
    decoder_first_pipeline_num_layers: int | None = option(None, "layers on the first pipeline stage; the rest "
                                                           "split evenly over the others", bounds=at_least(1))
    decoder_last_pipeline_num_layers: int | None = option(None, "layers on the last pipeline stage (it also holds "
                                                          "the final LayerNorm, top query layer and output layer)",
                                                          bounds=at_least(1))
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "interleaved 1F1B: layers per virtual pipeline stage N; each rank holds v = layers / (PP x N) model "
        "chunks, shrinking the bubble to about (PP - 1) / (v x micro-batches) for v times the point-to-point "
        "traffic. Needs PP > 1 and micro-batches per step divisible by PP", bounds=at_least(1))
    context_parallel_size: int = option(
        1, "CP size: ranks that split each sequence (Megatron's context parallelism). The sequence is cut into 2 x CP "
        "chunks and CP rank r holds chunks r and 2 x CP - 1 - r (equal causal work); attention passes keys and values "
        "around the CP ring. --seq-length must divide by 2 x CP", bounds=at_least(1))
    sequence_parallel: bool = option(False, "Megatron's sequence parallelism (TP > 1): the activations between the "
                                     "TP regions (LayerNorms, dropouts, residual adds) are split along the sequence "
                                     "over the TP group; same bytes as TP, about 1/TP of their memory. "
                                     "--seq-length must divide by the TP size")
    distributed_backend: str = option("auto", "torch.distributed backend; auto = nccl on GPU, gloo on CPU",
                                      choices=("auto", "nccl", "gloo"))
    distributed_timeout_minutes: float = option(10.0, "bound on every wait: forming the job (a node that "
                                                "never joins) and each collective (a peer that stopped)",
                                                bounds=Range(0, MAX_TIMEOUT_MINUTES, lo_open=True))


@dataclass
class TrainConfig:
    """Training: batch arithmetic, iterations, precision, checkpoints, evaluation."""

    micro_batch_size: int = option(4, "sequences per micro-batch per data-parallel rank", bounds=at_least(1))
    global_batch_size: int | None = option(None, "sequences per optimizer step over all ranks "
                                           "(default: micro batch x DP)", bounds=at_least(1))
    num_microbatches: int | None = option(None, "micro-batches per step per DP rank; optional, must equal "
                                          "global / (micro x DP)", bounds=at_least(1))
    seq_length: int = option(512, "tokens per training sequence", bounds=at_least(1))
    train_iters: int = option(100, "optimizer steps to train", bounds=at_least(1))
    seed: int = option(1234, "random seed (initialisation, data order, dropout)",
                       bounds=Range(0, 2**32 - 1))  # numpy's RandomState orders the data
    fp16: bool = option(False, "fp16 mixed precision with dynamic loss scaling (GPU)")
    bf16: bool = option(False, "bf16 mixed precision")
    checkpoint_activations: bool = option(False, "recompute each layer's activations in backward (= "
                                          "--recompute-granularity full)")
    recompute_granularity: str | None = option(None, "full: re-run whole layers in backward (see the two flags "
                                               "below); selective: re-run only cheap, memory-heavy parts "
                                               "(--recompute-modules)", choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = option(None, "full recompute: uniform = the stage's layers in units of "
                                          "--recompute-num-layers (default), block = only the first "
                                          "--recompute-num-layers layers of each stage", choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = option(None, "full recompute: layers per unit (uniform) or layers "
                                              "recomputed per stage (block), 1..--num-layers (default 1)")
    # (its range depends on --num-layers: recompute_from_args checks it)
    recompute_modules: list[str] | None = option(None, "selective recompute: any of core_attn (the attention "
                                                 "core, default), mlp_act (the MLP activation's output), layernorm "
                                                 "(the LayerNorm outputs)")
    save: str | None = option(None, "directory to save checkpoints to; one run's: when it holds a run ('latest'), "
                              "that run is resumed (without --load, or a --load of the same run), or the start is "
                              "refused, never overwritten (see --start-over)")
    load: str | None = option(None, "directory to resume from (its 'latest' checkpoint; default: --save when it "
                              "holds a run)")
    start_over: bool = option(False, "start a new run in a --save that holds one (from scratch, or from --load): "
                              "its checkpoints, 'latest', config.yaml and metrics.jsonl are first moved into "
                              "<save>/previous-runs/N/, nothing deleted. For one launch: a requeued command that "
                              "keeps it starts over again")
    finetune: bool = option(False, "start a new run from the model weights of --load only (a training, universal or "
                            "weights-only checkpoint): the iteration, consumed samples, optimizer and LR schedule start "
                            "afresh and the random streams from --seed (--no-load-optim and --no-load-rng are implied). "
                            "A relaunch of the same command resumes instead: when --save already holds a checkpoint "
                            "(this run saved before it stopped), that one is restored in full and --load is ignored; "
                            "one line says so. --save must differ from --load")
    no_load_optim: bool = option(False, "with --load, restore everything but the optimizer state: Adam's moments "
                                 "and step count start afresh, ZeRO's fp32 master weights are rebuilt from the loaded "
                                 "weights; the iteration, consumed samples and LR schedule continue. A training "
                                 "checkpoint saved at another data-parallel size then loads too")
    no_load_rng: bool = option(False, "with --load, restore everything but the random-number states: dropout and "
                               "the other random streams start from --seed")
    save_interval: int | None = option(None, "save every N iterations (and always at the end when --save; 0: only "
                                        "at the end)", bounds=at_least(0))
    keep_last_n_checkpoints: int | None = option(None, "keep the N newest complete checkpoints in --save: after each "
                                                 "save the older ones are removed, never the one 'latest' names nor "
                                                 "one a tool is reading (default: keep all)", bounds=at_least(1))
    keep_every_n_iterations: int | None = option(None, "with --keep-last-n-checkpoints, also keep for good every "
                                                 "checkpoint whose iteration is a multiple of M (a multiple of "
                                                 "--save-interval)", bounds=at_least(1))
    eval_interval: int = option(1000, "evaluate on the validation split every N iterations (0: never)",
                                bounds=at_least(0))
    eval_iters: int = option(10, "validation batches per evaluation (0: no validation or test)", bounds=at_least(0))
    eval_humaneval_interval: int | None = option(None, "greedy HumanEval pass@1 every N iterations, on the first "
                                                 "--eval-humaneval-tasks problems (PP 1)", bounds=at_least(1))
    eval_humaneval_tasks: int = option(20, "HumanEval problems scored by --eval-humaneval-interval",
                                       bounds=Range(1, 164))
    eval_humaneval_max_new_tokens: int = option(128, "tokens generated per problem by --eval-humaneval-interval",
                                                bounds=at_least(1))
    eval_humaneval_languages: tuple[str, ...] = option(
        ("python",), "the languages --eval-humaneval-interval scores, each on its first --eval-humaneval-tasks "
        "problems: python (HumanEval; humaneval_pass@1) and HumanEval-X's cpp, java, js, go "
        "(humaneval_<lang>_pass@1; their compilers: make humaneval-x-deps)")
    eval_humaneval_problems: str | None = option(None, "HumanEval-X problems for --eval-humaneval-languages: a "
                                                 "directory laid out as the CodeGeeX repository's "
                                                 "codegeex/benchmark/humaneval-x (default: python's shipped "
                                                 "HumanEval, THUDM/humaneval-x from the Hugging Face hub)")
    unsafe_no_sandbox: bool = option(False, "run --eval-humaneval-interval's samples without bubblewrap (no kernel "
                                     "isolation: the model's code can read and write what this user can); the "
                                     "humaneval records then say \"sandbox\": \"none (--unsafe-no-sandbox)\"")
    eval_infilling_interval: int | None = option(None, "greedy HumanEval-infilling pass@1 every N iterations, on "
                                                 "--eval-infilling-tasks problems of --eval-infilling-benchmark "
                                                 "(needs --fim-rate above 0; PP 1)", bounds=at_least(1))
    eval_infilling_benchmark: str = option("single-line", "the HumanEval-infilling benchmark "
                                           "--eval-infilling-interval scores", choices=INFILLING_BENCHMARKS)
    eval_infilling_problems: str | None = option(None, "its file (github.com/openai/human-eval-infilling's "
                                                 "data/HumanEval-*Infilling*.jsonl.gz) or a clone of that repository "
                                                 "(default: loubnabnl/humaneval_infilling from the Hugging Face hub)")
    eval_infilling_tasks: int = option(20, "problems scored by --eval-infilling-interval, spread evenly through the "
                                       "benchmark", bounds=at_least(1))
    eval_infilling_max_new_tokens: int = option(64, "tokens generated per middle by --eval-infilling-interval",
                                                bounds=at_least(1))
    deepspeed_config: str | None = option(None, "a DeepSpeed JSON to start from; the flags fill in and must "
                                          "agree with batch sizes, clipping, precision and ZeRO stage")
    zero_stage: int = option(2, "DeepSpeed ZeRO stage", choices=(0, 1, 2))
    exit_interval: int | None = option(None, "stop after this many iterations of this run (for tests)",
                                        bounds=at_least(1))
    async_save: bool = option(False, "with --save: each rank copies its checkpoint to host memory (pinned on GPU) and "
                              "training goes on while a background thread writes the same files; 'latest' moves at "
                              "a later step boundary, once every rank's files are synced. At most one save in "
                              "flight; the end of training waits for it. A failed write stops the run at a step "
                              "boundary (exit 1, one error line, 'latest' unchanged). Costs host memory of one "
                              "checkpoint share per rank")
    exit_signal_handler: bool = option(False, "on SIGTERM (preemption) finish the iteration, save a checkpoint "
                                       "(with --save; --async-save: a save being written completes instead) and exit "
                                       "0; all ranks stop at the same iteration")
    exit_duration_in_mins: float | None = option(None, "stop the same way once this run has taken this many "
                                                 "minutes (set it below the job's wall-clock limit)",
                                                 bounds=above(0))
    check_for_nan_in_loss_and_grad: bool = option(True, "stop with an error (exit 1, nothing saved) at the first "
                                                  "iteration whose loss or gradient norm is NaN or Inf, checked "
                                                  "every iteration (one all-reduce of a few integers and a host "
                                                  "sync); with --no-check-for-nan-in-loss-and-grad only at "
                                                  "iterations that log or save (never a checkpoint unchecked)")
    max_consecutive_skipped_iterations: int = option(20, "fp16: stop with an error when more than this many steps "
                                                     "in a row are skipped by dynamic loss scaling (0: no limit)",
                                                     bounds=at_least(0))
    skip_memory_check: bool = option(False, "start even when the memory estimate (model state, activations, sample "
                                     "index; checked before anything is built) exceeds what this host or GPU has "
                                     "free")
    dry_run: bool = option(False, "run every check a launch runs (flags, tokenizer and data files, the layout at "
                           "the launcher's WORLD_SIZE ranks, the DeepSpeed config, --load, memory), print the "
                           "resolved config and exit 0; no process group, nothing written. GPU ranks checked on a "
                           "host without a GPU skip the GPU memory check, saying so")
    dry_run_skip_data: bool = option(False, "with --dry-run: skip the data-file check, for data that is built "
                                     "before the launch (scripts/pretrain_codegen.sh's default corpus)")

    def check_retention(self) -> None:
        """--async-save, --keep-last-n-checkpoints and --keep-every-n-iterations against --save and --save-interval."""
        if self.async_save and not self.save:
            raise ConfigError("--async-save writes --save's checkpoints in the background, and there is no --save: "
                              "give --save DIR, or drop it")
        if self.keep_last_n_checkpoints is not None and not self.save:
            raise ConfigError(f"--keep-last-n-checkpoints {self.keep_last_n_checkpoints} without --save: it keeps "
                              f"the newest checkpoints of --save; give --save DIR, or drop it")
        every, interval = self.keep_every_n_iterations, self.save_interval
        if every is not None and self.keep_last_n_checkpoints is None:
            raise ConfigError(f"--keep-every-n-iterations {every} goes with --keep-last-n-checkpoints N: without it "
                              f"no checkpoint is removed, so every one is kept already")
        if every is not None and interval and every % interval:
            common = every * interval // math.gcd(every, interval)
            raise ConfigError(f"--keep-every-n-iterations {every} is not a multiple of --save-interval {interval}: "
                              f"a save lands on one of its multiples only every {common} iterations; use a multiple "
                              f"of {interval}")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = option("adam", "adam = AdamW (decoupled weight decay), or sgd", choices=("adam", "sgd"))
    lr: float = option(3e-4, "peak learning rate", flags=("--lr", "--learning-rate"), bounds=at_least(0))
    min_lr: float = option(0.0, "learning rate at the end of the decay", bounds=at_least(0))
    lr_decay_style: str = option("cosine", "decay after warm-up", choices=("constant", "linear", "cosine"))
    lr_decay_iters: int | None = option(None, "iterations of warm-up plus decay (default: --train-iters)",
                                         bounds=at_least(1))
    lr_warmup_iters: int = option(0, "linear warm-up iterations", bounds=at_least(0))
    lr_warmup_fraction: float | None = option(None, "warm-up as a fraction of --lr-decay-iters "
                                              "(instead of --lr-warmup-iters)", bounds=Range(0, 1))
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and norms)", bounds=at_least(0))
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0 disables)", bounds=at_least(0))
    adam_beta1: float = option(0.9, "Adam beta1", bounds=UNIT_OPEN)
    adam_beta2: float = option(0.999, "Adam beta2", bounds=UNIT_OPEN)
    adam_eps: float = option(1e-8, "Adam epsilon", bounds=above(0))
    sgd_momentum: float = option(0.9, "SGD momentum", bounds=UNIT_OPEN)
    # On resume the checkpoint's schedule must equal the flags' unless one of these decides (config/lr_schedule.py).
    override_opt_param_scheduler: bool = option(False, "on resume, the LR schedule of these flags (--lr, --min-lr, "
                                                "warm-up, decay, global batch) replaces the checkpoint's; its "
                                                "position is kept", flags=("--override-opt_param-scheduler",
                                                                          "--override-opt-param-scheduler"))
    use_checkpoint_opt_param_scheduler: bool = option(False, "on resume, the LR schedule the checkpoint records "
                                                      "replaces these flags' (--lr, --min-lr, warm-up, decay)",
                                                      flags=("--use-checkpoint-opt_param-scheduler",
                                                             "--use-checkpoint-opt-param-scheduler"))

    @property
    def schedule_policy(self) -> SchedulePolicy:
        if self.override_opt_param_scheduler:
            return SchedulePolicy.OVERRIDE
        return SchedulePolicy.USE_CHECKPOINT if self.use_checkpoint_opt_param_scheduler else SchedulePolicy.CHECK


@dataclass
class DataConfig:
    """Data: indexed datasets, splits, tokenizer."""

    data_path: list[str] | None = option(None, "PREFIX of a .bin/.idx pair, or a blend 'W1 PREFIX1 W2 PREFIX2'")
    train_data_path: list[str] | None = option(None, "separate training data (instead of --split)")
    valid_data_path: list[str] | None = option(None, "separate validation data")
    test_data_path: list[str] | None = option(None, "separate test data")
    split: str = option("969,30,1", "train,valid,test proportions of the documents of --data-path")
    # The tokenizer flags, declared in tokenizer_flags.py (the tools generate theirs from there too).
    tokenizer_type: str | None = tokenizer_field("tokenizer_type")
    tokenizer_model: str | None = tokenizer_field("tokenizer_model")
    vocab_file: str | None = tokenizer_field("vocab_file")
    merge_file: str | None = tokenizer_field("merge_file")
    whitespace_encoding: bool = tokenizer_field("whitespace_encoding")
    num_workers: int = option(2, "DataLoader worker processes (0: load in the training process)",
                              bounds=at_least(0))
    # Document masking (Megatron's flags): packed samples hold several EOD-separated documents.
    reset_position_ids: bool = option(False, "restart position ids at 0 after every EOD of a packed sample")
    reset_attention_mask: bool = option(False, "attention never crosses an EOD of a packed sample: a token sees "
                                        "only its own document (the EOD belongs to the document it ends)")
    eod_mask_loss: bool = option(False, "no loss where the input token is EOD (the prediction of the next "
                                 "document's first token from nothing of it)")
    # Fill-in-the-middle (Megatron's flags), applied to the stored tokens as samples are read.
    fim_rate: float = option(0.0, "fraction of documents (or fragments) turned into fill-in-the-middle examples "
                             "(0: left-to-right only; 0.5 as StarCoder)", bounds=Range(0, 1))
    fim_spm_rate: float = option(0.5, "of the FIM examples, the fraction in suffix-prefix-middle order (the rest "
                                 "prefix-suffix-middle)", bounds=Range(0, 1))
    fim_split_sample: str | None = option(None, "with --fim-rate: a token (e.g. the repository documents' file "
                                          "separator <file_sep>) that splits a document into fragments, each "
                                          "FIM-transformed on its own")
    fim_fragment_rate: float | None = option(None, "with --fim-split-sample: the FIM rate of each fragment "
                                             "(default: --fim-rate)", bounds=Range(0, 1))


@dataclass
class LoggingConfig:
    """Logging: console, a JSON-lines metrics file and wandb."""

    log_interval: int = option(10, "log one line every N iterations", bounds=at_least(1))
    metrics_file: str | None = option(None, "JSON-lines metrics (default: <save>/metrics.jsonl)")
    wandb_project: str | None = option(None, "log to this wandb project (offline when no key or network)")
    wandb_name: str | None = option(None, "wandb run name")
    wandb_dir: str | None = option(None, "where wandb writes its files (default: <save> or the cwd)")
    progress_bar: bool = option(True, "show a progress bar on the logging rank")
    peak_tflops: float | None = option(None, "the device's peak dense TFLOP/s at the training precision, to "
                                       "report MFU (e.g. 989 for an H100 SXM in bf16)", bounds=above(0))
    # TensorBoard (Megatron's flags): the records of metrics.jsonl, less what the switches below turn off.
    tensorboard_dir: str | None = option(None, "write TensorBoard event files here (the logging rank): the scalars "
                                         "of metrics.jsonl, named as in wandb (train/loss, valid/ppl, ...)")
    tensorboard_log_interval: int = option(1, "TensorBoard gets the train records of iterations divisible by N (a "
                                           "record exists every --log-interval)", bounds=at_least(1))
    tensorboard_queue_size: int = option(1000, "events TensorBoard's writer holds before writing them to disk",
                                         bounds=at_least(1))
    # Megatron spells its off switch --no-log-learnig-rate-to-tensorboard; both spellings are taken.
    log_learning_rate_to_tensorboard: bool = option(True, "the learning rate in TensorBoard", flags=(
        "--log-learning-rate-to-tensorboard", "--log-learnig-rate-to-tensorboard"))
    log_loss_scale_to_tensorboard: bool = option(True, "the loss scale in TensorBoard")
    log_gradient_norm_to_tensorboard: bool = option(True, "the gradient norm in TensorBoard")
    # Profiling (docs/profiling.md). Iterations are numbered as logged; Megatron's window: start+1..end.
    profile: bool = option(False, "trace iterations --profile-step-start+1 .. --profile-step-end with torch.profiler "
                           "into <tensorboard-dir or save>/profile/ (Chrome trace JSON: Perfetto, TensorBoard)")
    profile_step_start: int = option(10, "profiling starts after this iteration", bounds=at_least(0))
    profile_step_end: int = option(12, "profiling stops after this iteration", bounds=at_least(1))
    profile_ranks: list[int] = option(help="the global ranks that profile and record memory history",
                                      default_factory=lambda: [0], bounds=at_least(0))
    record_memory_history: bool = option(False, "GPUs: record CUDA allocations from the start, and dump a snapshot "
                                         "(pytorch.org/memory_viz) after --profile-step-end; on CPU a warning")
    memory_snapshot_path: str | None = option(None, "the snapshot file (default: <tensorboard-dir or save>/profile/"
                                              "memory_snapshot_rank<R>.pickle); with several --profile-ranks, "
                                              "_rank<R> goes before its extension")

    def check(self, world_size: int, save: str | None) -> None:
        """The sinks' directories and the profiling flags against the run, before any process group; ConfigError
        naming the flag."""
        self.check_sink_dirs(save)
        if not (self.profile or self.record_memory_history):
            if self.memory_snapshot_path is not None:
                raise ConfigError("--memory-snapshot-path goes with --record-memory-history")
            return
        if self.profile_step_start >= self.profile_step_end:
            raise ConfigError(f"--profile-step-start {self.profile_step_start} must be below --profile-step-end "
                              f"{self.profile_step_end} (profiling covers iterations start+1 .. end)")
        absent = [str(r) for r in self.profile_ranks if r >= world_size]
        if absent:
            raise ConfigError(f"--profile-ranks {' '.join(absent)}: this run has ranks 0..{world_size - 1} (world "
                              f"size {world_size})")
        if not (self.tensorboard_dir or save) and (self.profile or self.memory_snapshot_path is None):
            flag = "--profile" if self.profile else "--record-memory-history"
            raise ConfigError(f"{flag} writes into <tensorboard-dir or save>/profile/: pass --tensorboard-dir DIR or "
                              f"--save DIR" + ("" if self.profile else " (or --memory-snapshot-path FILE)"))

    def check_sink_dirs(self, save: str | None) -> None:
        """TensorBoard's event files and profiles go to a local directory (a URL needs a file-system package and ends
        in a traceback on the logging rank); wandb's directory is written, unredacted, into wandb's own logs, so it
        must not hold a credential (config/redaction.py). Messages show paths redacted."""
        if self.tensorboard_dir and "://" in self.tensorboard_dir:
            raise ConfigError(f"--tensorboard-dir {redact_secrets(self.tensorboard_dir)} is a URL: TensorBoard writes "
                              f"to a local (or mounted) directory here; give one, and copy it to the bucket afterwards")
        wandb_dir = os.path.abspath(self.wandb_dir or save or os.curdir)
        if self.wandb_project and redact_secrets(wandb_dir) != wandb_dir:
            where = "--wandb-dir" if self.wandb_dir else "--save (the default --wandb-dir)" if save else \
                "the current directory (the default --wandb-dir)"
            raise ConfigError(f"--wandb-project: {where} {redact_secrets(wandb_dir)} holds a credential, and wandb "
                              f"writes its directory unredacted into its own logs and run file: give --wandb-dir a "
                              f"directory without it")
    log_level: str = option("info", "console messages at this level and above (rank 0's; see --log-all-ranks); "
                            "Megatron's numbers too: 10 debug, 20 info, 30 warning, 40 error",
                            choices=tuple(LOG_LEVELS))
    log_all_ranks: bool = option(False, "every rank logs at --log-level, each line prefixed [rank N] (default: rank "
                                 "0 only; the other ranks say warnings and errors, prefixed)")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
}


@dataclass
class Args:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    optim: OptimConfig
    data: DataConfig
    logging: LoggingConfig


USAGE = "python -m codegeex_train.pretrain [FLAGS]    (or under deepspeed / torchrun / srun: see the examples)"

DESCRIPTION = """\
Pretrain a CodeGeeX-style GPT code model: Megatron tensor (TP) and pipeline (PP) parallelism, DeepSpeed ZeRO data
parallelism over the other ranks. Flags are Megatron-LM's; docs/megatron-flags.md maps the Megatron flags we take
under another name and the ones we refuse. Every flag is checked before training starts.

examples:
  # CPU, one process: the demo corpus (the Python stdlib) and the shipped tokenizer
  python tools/preprocess_data.py --input default --output-prefix data/stdlib --whitespace-encoding --append-eod
  DS_ACCELERATOR=cpu python -m codegeex_train.pretrain --data-path data/stdlib_text_document --save ckpt

  # one node, 8 GPUs: TP 8, bf16
  deepspeed --num_gpus 8 --module codegeex_train.pretrain --tensor-model-parallel-size 8 --bf16 \\
      --data-path data/code_text_document --micro-batch-size 4 --global-batch-size 1536 --save ckpt

  # a cluster (hostfile; pdsh + ssh): CodeGeeX-13B, TP 8 x PP 4, through the script
  CONFIG=codegeex-13b DEVICE=gpu HOSTFILE=hostfile TP=8 PP=4 DATA_PATH=data/code_text_document \\
      TOKENIZER_ARGS="--tokenizer-type CodeGeeXTokenizer --tokenizer-model gpt-j-tokenizer/" \\
      bash scripts/pretrain_codegen.sh --decoder-last-pipeline-num-layers 9"""


def parser() -> FlagParser:
    p = build_parser(SECTIONS, DESCRIPTION, usage=USAGE)
    # Listed first in --help (argparse's own group); parse_args replaces it by the file's flags before parsing.
    p.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="start from this config file (configs/*.yaml, or a run's <save>/config.yaml): its sections "
                        "hold the flags below by field name; flags on the command line override it "
                        "(docs/config-files.md)")
    # The deepspeed launcher appends --local_rank=N; torchrun sets LOCAL_RANK instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p._option_string_actions["--log-level"].type = level_name  # a name, or Megatron's number (--logging-level)
    add_foreign_flags(p, megatron_flags.PRETRAIN, megatron_flags.ORIGIN, megatron_flags.SEE)
    return p


def parse_args(argv: list[str] | None = None) -> Args:
    p = parser()
    try:
        argv = config_file.expand(p, argv, SECTIONS)
    except config_file.ConfigFileError as e:
        p.error(str(e))
    ns = p.parse_args(argv)
    return Args(**{name: dataclass_from_args(cls, ns) for name, cls in SECTIONS.items()})


def recompute_from_args(args: Args) -> Recompute:
    """The run's Recompute from --checkpoint-activations and the --recompute-* flags; ConfigError when they clash."""
    t = args.train
    granularity = t.recompute_granularity
    if t.checkpoint_activations:
        if granularity == "selective":
            raise ConfigError("--checkpoint-activations (full recompute) and --recompute-granularity selective "
                              "clash: keep one")
        granularity = "full"
    if granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        raise ConfigError("--recompute-method and --recompute-num-layers go with --recompute-granularity full "
                          "(or --checkpoint-activations)")
    if granularity != "selective" and t.recompute_modules is not None:
        raise ConfigError("--recompute-modules goes with --recompute-granularity selective")
    if t.recompute_num_layers is not None and not 1 <= t.recompute_num_layers <= args.model.num_layers:
        raise ConfigError(f"--recompute-num-layers {t.recompute_num_layers} must be within 1..--num-layers "
                          f"{args.model.num_layers}")
    unknown = sorted(set(t.recompute_modules or ()) - set(RECOMPUTE_MODULES))
    if unknown:
        raise ConfigError(f"--recompute-modules {' '.join(unknown)}: choose from {', '.join(RECOMPUTE_MODULES)}")
    return Recompute(granularity, t.recompute_method or "uniform", t.recompute_num_layers or 1,
                     tuple(dict.fromkeys(t.recompute_modules or ("core_attn",))))


def check_ranges(args: Args) -> None:
    """Every flag against the range its field declares (``option(bounds=...)``), and --split; one ConfigError
    listing every value out of range, so a script is fixed in one go."""
    problems = [p for name in SECTIONS for p in out_of_range(getattr(args, name))]
    split = split_problem(args.data.split)
    if split:
        problems.append(split)
    if problems:
        raise ConfigError("; ".join(problems))


def split_problem(split: str) -> str | None:
    """What is wrong with a --split (Megatron's 'train,valid,test' weights, ',' or '/' between them; missing
    trailing ones are 0, as in Megatron), or None."""
    parts = split.split("/" if "/" in split else ",")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    # (a NaN fails `>= 0`, an infinity makes the sum infinite; an empty entry, '1,,2', is refused, not skipped)
    if not 1 <= len(weights) <= 3 or not all(w >= 0 for w in weights) or not 0 < sum(weights) < math.inf:
        return (f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum, the train,valid,test "
                f"proportions of the documents, e.g. 969,30,1 or 98,2")
    return None


def check_save_dir(save: str) -> None:
    """--save must be a directory this process can write, or creatable: checked by making (and removing) a
    directory in it or in its nearest existing parent, so nothing is left behind. (Root ignores permission bits,
    not a read-only or immutable file system: a real write is the one test that holds for both.)"""
    path = os.path.abspath(save)
    existing = path
    while not os.path.lexists(existing):  # (a dangling link counts: nothing can be created in its place)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is not a directory" if existing == path else f"is under {existing}, which is not a directory"
        raise ConfigError(f"--save {save} {where}: give a directory (it is created when missing)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".codegeex-write-test-", dir=existing))
    except OSError as e:
        where = "it" if existing == path else f"{existing}, its nearest existing parent"
        raise ConfigError(f"--save {save}: cannot write in {where} ({e.strerror}): choose a directory this user "
                          f"can write to, or make it writable") from None


def check_context_parallel(args: Args, dims: ParallelDims) -> None:
    """The features that wait for CP > 1 say so (how CP splits the sequence is the plan's rule:
    ``ParallelPlan.derive``)."""
    t, d, cp = args.train, args.data, dims.cp_size
    if d.reset_attention_mask:
        # The ring's blocks would each need their slice of the block-causal mask, and a document crossing a chunk
        # edge would make the balanced blocks unequal again: it waits until a varlen ring attention is worth it.
        raise ConfigError(f"--reset-attention-mask with --context-parallel-size {cp}: document masking inside the "
                          f"CP ring is not supported; drop one (--reset-position-ids and --eod-mask-loss work with CP)")
    for flag, value in (("--eval-humaneval-interval", t.eval_humaneval_interval),
                        ("--eval-infilling-interval", t.eval_infilling_interval)):
        if value is not None:
            raise ConfigError(f"{flag} needs --context-parallel-size 1 (generation decodes whole sequences on one "
                              f"rank); this run has {cp}: evaluate its checkpoints with tools/evaluate_humaneval.py")


def validate(args: Args, world_size: int, model: ModelConfig | None = None) -> ParallelPlan:
    """Every flag's range, then every rule that spans sections, in order; raises ConfigError naming the flags.
    Returns the run's plan. ``model``: ``args.model`` with the tokenizer's vocabulary (``with_vocab``), checked in
    full; None: ``args.model``, whose vocabulary-dependent checks wait for it when it has none."""
    t, o, d = args.train, args.optim, args.data
    model = args.model if model is None else model
    check_ranges(args)
    recompute = recompute_from_args(args)  # the one place the --recompute-* flags are read; raises ConfigError
    p = args.parallel
    try:
        plan = ParallelPlan.derive(
            ParallelDims(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                         p.context_parallel_size),
            micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
            num_microbatches=t.num_microbatches, num_layers=model.num_layers,
            decoder_first_pipeline_num_layers=p.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=p.decoder_last_pipeline_num_layers,
            num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups if model.group_query_attention else None,
            sequence_parallel=p.sequence_parallel,
            recompute=recompute, seq_length=t.seq_length, hidden_size=model.hidden_size,
            dtype="bf16" if t.bf16 else "fp16" if t.fp16 else "fp32")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    dims, num_microbatches = plan.dims, plan.num_microbatches
    if dims.pp_size > 1 and t.zero_stage == 0:
        # Without ZeRO, DeepSpeed's own clipping does not skip the tied copy (measured: 3e-5 off by step 4).
        raise ConfigError(f"--pipeline-model-parallel-size {dims.pp_size} needs --zero-stage 1 or 2 (the stages' "
                          f"gradient norm is exact only through ZeRO's mpu-aware path); --zero-stage 0 is PP = 1 only")
    if 1 < dims.pp_size and num_microbatches < dims.pp_size:
        bubble = (dims.pp_size - 1) / (num_microbatches + dims.pp_size - 1)
        warnings.warn(f"{num_microbatches} micro-batch(es) per step for {dims.pp_size} pipeline stages: the bubble "
                      f"((p - 1) / (m + p - 1) = {bubble:.0%} of each step idle) dominates; raise "
                      f"--global-batch-size or lower --micro-batch-size so that m >= p (ideally m >> p)",
                      stacklevel=2)
    if t.fp16 and t.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive: choose one")
    try:
        model.check_sequence_length(t.seq_length)
        model.check_rotary()
        model.check_architecture()
        if model.vocab_size:  # the rest waits for the tokenizer's vocab (the heads per TP rank are the plan's)
            model.validate(dims.tp_size)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    if not (d.data_path or d.train_data_path):
        raise ConfigError("no data: pass --data-path PREFIX (from tools/preprocess_data.py) or --train-data-path")
    if d.data_path and d.train_data_path:
        raise ConfigError("--data-path and --train-data-path are exclusive: use --split with the first")
    if o.lr_warmup_fraction is not None and o.lr_warmup_iters:
        raise ConfigError("--lr-warmup-iters and --lr-warmup-fraction are exclusive")
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} is above --lr {o.lr}")
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        raise ConfigError(f"{OVERRIDE_FLAG} (the flags' LR schedule) and {USE_CHECKPOINT_FLAG} (the checkpoint's) "
                          f"are exclusive: choose one")
    if plan.sequence_parallel and not plan.sp:
        warnings.warn("--sequence-parallel with --tensor-model-parallel-size 1 does nothing (no TP group to split "
                      "the sequence over)", stacklevel=2)
    if dims.cp_size > 1:
        check_context_parallel(args, dims)
    if t.eval_humaneval_interval is not None:
        unknown = [lang for lang in t.eval_humaneval_languages if lang not in HUMANEVAL_LANGUAGES]
        if unknown:
            raise ConfigError(f"--eval-humaneval-languages {' '.join(unknown)}: expected some of "
                              f"{' '.join(HUMANEVAL_LANGUAGES)}")
        if dims.pp_size > 1:
            raise ConfigError(f"--eval-humaneval-interval needs --pipeline-model-parallel-size 1 (generation runs on "
                              f"one stage); this run has {dims.pp_size}: evaluate its checkpoints with "
                              f"tools/evaluate_humaneval.py after gathering them to PP 1")
    if t.eval_infilling_interval is not None:
        if d.fim_rate == 0:
            raise ConfigError("--eval-infilling-interval needs --fim-rate above 0: a model trained without "
                              "fill-in-the-middle cannot infill")
        if dims.pp_size > 1:
            raise ConfigError(f"--eval-infilling-interval needs --pipeline-model-parallel-size 1 (generation runs on "
                              f"one stage); this run has {dims.pp_size}: evaluate its checkpoints with "
                              f"tools/evaluate_humaneval.py --benchmark after gathering them to PP 1")
    if d.fim_rate == 0 and (d.fim_split_sample is not None or d.fim_fragment_rate is not None):
        raise ConfigError("--fim-split-sample and --fim-fragment-rate go with --fim-rate above 0 (fill-in-the-middle "
                          "is off at --fim-rate 0)")
    if d.fim_fragment_rate is not None and d.fim_split_sample is None:
        raise ConfigError("--fim-fragment-rate needs --fim-split-sample (the token that splits documents into "
                          "fragments)")
    if t.load is not None and not os.path.isdir(t.load):
        raise ConfigError(f"--load {t.load}: no such directory")
    if t.save is not None:
        check_save_dir(t.save)
    return plan
