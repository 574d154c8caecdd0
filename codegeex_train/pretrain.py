"""Pretrain a CodeGeeX model: Megatron tensor parallelism inside nodes, 1F1B pipeline stages across them,
DeepSpeed ZeRO-2 data parallelism over the rest.

    # one node, 8 GPUs, TP 8 (CodeGeeX's layout), bf16:
    deepspeed --num_gpus 8 codegeex_train/pretrain.py --tensor-model-parallel-size 8 --bf16 \
        --data-path data/code_text_document --micro-batch-size 4 --global-batch-size 1536 ...
    # a cluster (pdsh + passwordless ssh; list non-PYTHON* variables in .deepspeed_env), TP 8 x PP 4:
    deepspeed --hostfile hostfile codegeex_train/pretrain.py --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 9 --num-layers 39 ...
    # the same under torchrun, or as a module:
    torchrun --nproc_per_node 2 -m codegeex_train.pretrain ...
    deepspeed --num_gpus 2 --module codegeex_train.pretrain ...
    # CPU (DS_ACCELERATOR=cpu, gloo), as scripts/pretrain_codegen.sh does by default:
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 codegeex_train/pretrain.py --data-path ...
    # every check of a 64-rank launch, on this host and with no process group (e.g. before an srun):
    WORLD_SIZE=64 python -m codegeex_train.pretrain --tensor-model-parallel-size 8 ... --dry-run

Every flag is checked before any process group exists; a bad one exits with one ``error:`` line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from codegeex_train.accounting import CommCounter, Workload, comm_bytes_per_step, expected_memory_report
from codegeex_train.accounting.fit import Host, check_run_memory
from codegeex_train.accounting.memory import StepMemory
from codegeex_train.checkpoint.files import check_same_tokenizer, tokenizer_settings
from codegeex_train.checkpoint.manager import CheckpointManager
from codegeex_train.checkpoint.resume import Resume, preflight_load, restore
from codegeex_train.checkpoint.run_dir import ARCHIVE_DIR, holds_run
from codegeex_train.checkpoint.save_lock import SaveLockError
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.arguments import Args, ConfigError, ParallelConfig, parse_args, validate
from codegeex_train.config.config_file import dump_resolved, write_resolved
from codegeex_train.config.deepspeed import build_deepspeed_config, load_user_config
from codegeex_train.config.lr_schedule import LRScheduleShape, SchedulePolicy
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.config.redaction import redact_secrets
from codegeex_train.data.token_range import TokenIdError
from codegeex_train.tokenization.tokenizer import Tokenizer, load_tokenizer
from codegeex_train.distributed.cluster import (
    ClusterError,
    cluster_report,
    gather_places,
    join_process_group,
    rank_env_from_slurm,
)
from codegeex_train.distributed.log import setup_logging
from codegeex_train.distributed.malloc import fix_malloc_thresholds
from codegeex_train.distributed.topology import Topology
from codegeex_train.layout.dims import ParallelDims, rank_seed
from codegeex_train.data.fim import FIM, fim_from_flags
from codegeex_train.evaluation.during_training import (
    humaneval_callback,
    humaneval_problems,
    infilling_callback,
    infilling_problems,
    training_sandbox,
)
from codegeex_train.evaluation.sandbox import SandboxError
from codegeex_train.metrics import MetricsLogger
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.model.summary import model_summary
from codegeex_train.pipeline import mark_shared_embedding_copy
from codegeex_train.tensor_parallel import model_parallel_seed
from codegeex_train.training.batches import DocumentMasking, build_datasets, loader, num_samples, preflight_data
from codegeex_train.training.engine import build_engine
from codegeex_train.training.exit_conditions import ExitConditions
from codegeex_train.training.fault_injection import step_context_from_environment
from codegeex_train.training.profiling import Profiling
from codegeex_train.training.trainer import Measurement, Run, train

# By name: run as a script (as the launchers run it) __name__ is "__main__", outside the package's loggers.
log = logging.getLogger("codegeex_train.pretrain")  # (`logger` in main is the metrics logger)


@dataclass
class Prepared:
    """What ``prepare`` checked and derived before any process group exists."""

    args: Args  # as parsed (under --use-checkpoint-opt_param-scheduler, the LR schedule a resume restores)
    model: ModelConfig  # args.model with the tokenizer's vocabulary
    plan: ParallelPlan
    ds_config: dict
    resume: Resume | None  # None: a fresh start
    tokenizer: Tokenizer
    fim: FIM | None  # the training split's FIM transform (--fim-rate), built once here; None: left to right


def prepare(argv: list[str] | None) -> Prepared:
    """Parse and check everything that can be checked without a process group. The vocabulary is resolved first
    (the tokenizer, with FIM's sentinels when --fim-rate asks for them), so that ``validate`` runs once, on the whole
    run, and the parsed ``args`` are never changed."""
    args = parse_args(argv)
    setup_logging(args.logging.log_level, global_rank(), args.logging.log_all_ranks, redact=redact_secrets)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        tokenizer = load_tokenizer(args.data)
        fim = fim_from_flags(args.data, tokenizer)  # --fim-split-sample must be one token of this tokenizer
    except ValueError as e:  # TokenizerError
        raise ConfigError(str(e)) from None
    model = args.model.with_vocab(tokenizer.vocab_size)
    plan = validate(args, world_size, model)
    args.logging.check(world_size, args.train.save)  # --profile-* and --record-memory-history
    args.train.check_retention()
    if args.train.dry_run_skip_data and not args.train.dry_run:
        raise ConfigError("--dry-run-skip-data goes with --dry-run only: a launch always checks its data files")
    if args.train.dry_run_skip_data:
        log.info("dry run: data-file check skipped (--dry-run-skip-data: the data is built before the launch)")
    else:
        preflight_data(args.data, model.padded_vocab_size, tokenizer, fim)
    ds_config = build_deepspeed_config(args, plan, load_user_config(args.train.deepspeed_config))
    if gpu_ranks_checked_without_gpu(args):
        log.info("dry run: GPU memory check skipped: this host has no GPU to measure (the ranks run "
                 "--distributed-backend nccl); a dry run on a GPU node checks it")
    elif not args.train.skip_memory_check:  # what cannot fit is refused before anything is allocated
        check_run_memory(model, plan, args.train, args.data, ds_config, num_samples(args.train, plan),
                         Host.from_env(world_size, "cuda" if uses_cuda() else "cpu"))
    schedule = LRScheduleShape.from_flags(args.optim, args.train.train_iters, plan.global_batch_size)
    resume = preflight_load(args.train, model, plan, schedule, args.optim.schedule_policy)
    if resume is not None:  # the tokenizer the checkpoint was trained with (its fingerprint), if it records one
        check_same_tokenizer(resume.meta.get("tokenizer"), tokenizer, args.data, f"--load {resume.load_dir} "
                             f"({resume.tag})")
    if (args.optim.schedule_policy is SchedulePolicy.USE_CHECKPOINT and resume is not None
            and resume.schedule is not None and not resume.finetune):  # the run's schedule is the checkpoint's
        args = dataclasses.replace(args, optim=dataclasses.replace(args.optim, **resume.schedule.flags()))
    if args.train.eval_humaneval_interval:  # a machine that cannot isolate samples stops the run now
        try:
            training_sandbox(args.train.unsafe_no_sandbox)
            humaneval_problems(args.train.eval_humaneval_languages, args.train.eval_humaneval_problems,
                               args.train.eval_humaneval_tasks)  # readable, and their compilers installed
        except (SandboxError, ValueError, RuntimeError) as e:  # + ProblemsError, ToolchainError
            raise ConfigError(f"--eval-humaneval-interval: {e}") from None
    if args.train.eval_infilling_interval:  # the sandbox and the problems, before anything starts
        try:
            training_sandbox(args.train.unsafe_no_sandbox)
            infilling_problems(args.train.eval_infilling_benchmark, args.train.eval_infilling_problems,
                               args.train.eval_infilling_tasks)
        except (SandboxError, ValueError, RuntimeError) as e:  # + ProblemsError
            raise ConfigError(f"--eval-infilling-interval: {e}") from None
    return Prepared(args, model, plan, ds_config, resume, tokenizer, fim)


def skip_inference_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (40-75 s on a fresh checkout)
    that only its inference path (``inference_all_reduce``) calls; training collectives go through
    torch.distributed. Marking the op unavailable lets a fresh checkout start training at once."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


def global_rank() -> int:
    """This process's rank, before its process group exists too (the launchers set RANK; SLURM's is mapped)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def uses_cuda() -> bool:
    """Whether this rank trains on its GPU (DS_ACCELERATOR=cpu keeps it on the CPU)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def gpu_ranks_checked_without_gpu(args: Args) -> bool:
    """A dry run for GPU ranks (NCCL, DS_ACCELERATOR not cpu) on a host without a GPU, e.g. a login node: the GPU
    memory the memory check measures is not here."""
    return (args.train.dry_run and args.parallel.distributed_backend == "nccl" and not torch.cuda.is_available()
            and os.environ.get("DS_ACCELERATOR") != "cpu")


def warn_if_cpu_beside_gpus() -> None:
    """DS_ACCELERATOR=cpu on a host with CUDA GPUs trains on the CPU (gloo): allowed, but rarely meant; rank 0 says
    so in one line."""
    if os.environ.get("DS_ACCELERATOR") == "cpu" and torch.cuda.is_available() and global_rank() == 0:
        log.warning("DS_ACCELERATOR=cpu: training on the CPU although this host has CUDA GPUs; unset DS_ACCELERATOR "
                    "to train on them")


def start_description(prepared: Prepared) -> str:
    """Where the run starts, in words (the dry run's report)."""
    resume, t = prepared.resume, prepared.args.train
    if resume is None:
        start = "from scratch"
    else:
        start = f"--load {resume.load_dir} ({resume.tag}, {resume.kind.value})"
        start += f": {resume.note}" if resume.note else ""
    if t.start_over and holds_run(t.save):
        start += (f"; --start-over: the run in --save {t.save} is first moved to "
                  f"{os.path.join(t.save, ARCHIVE_DIR)}/N/")
    return start


def dry_run_report(prepared: Prepared) -> str:
    """What ``--dry-run`` prints once every check has passed."""
    plan, start = prepared.plan, start_description(prepared)
    return (f"dry run: every check passed at {plan.world_size} ranks ({plan.dims.describe()}), start {start}; no "
            f"process group was created and nothing was written. The resolved config (pretrain --config takes "
            f"it):\n{dump_resolved(prepared.args)}")


def init_distributed(parallel: ParallelConfig, dims: ParallelDims) -> tuple[Topology, torch.device]:
    """Join (or create) the default process group, every wait bounded by --distributed-timeout-minutes; then
    build the topology's groups (the plan's ``dims``)."""
    import deepspeed

    use_cuda = uses_cuda()
    backend = parallel.distributed_backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")  # a plain `python -m codegeex_train.pretrain` is a world of one
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        join_process_group(backend, timeout, device)
    skip_inference_comm_op()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    return Topology(dims, timeout=timeout), device




def report_cluster(topology: Topology) -> dict:
    """Logs the layout the ranks report; every rank returns it (run metadata)."""
    text, meta = cluster_report(gather_places(), topology.dims)
    log.info(text)
    return meta


def main(argv: list[str] | None = None) -> TrainState | None:
    """Train; None after a --dry-run."""
    start_time = time.time()  # --exit-duration-in-mins counts from here, as Megatron's does
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        fix_malloc_thresholds()  # CPU: RSS stays flat (distributed/malloc.py); MALLOC_*_ set at launch win
    if not dist.is_initialized():
        rank_env_from_slurm()
    try:
        prepared = prepare(argv)
    except ConfigError as e:
        log.error(e)
        raise SystemExit(2) from None
    warn_if_cpu_beside_gpus()
    if prepared.args.train.dry_run:  # every check has run, before any process group or file
        # the command's result: shown whatever --log-level says
        print(redact_secrets(dry_run_report(prepared)), flush=True)
        return None
    args, model_config, plan, ds_config = prepared.args, prepared.model, prepared.plan, prepared.ds_config
    try:  # one writer per --save: global rank 0 holds its lock as long as `checkpoints` lives (until main returns);
        # --start-over moves the old run aside before anything new is written
        checkpoints = CheckpointManager.for_run(args.train, rank=global_rank())
    except SaveLockError as e:
        log.error(e)
        raise SystemExit(2) from None
    owns_process_group = not dist.is_initialized()
    try:
        topology, device = init_distributed(args.parallel, plan.dims)
    except ClusterError as e:
        log.error(e)
        raise SystemExit(1) from None
    cluster = report_cluster(topology)
    t = args.train
    if t.save and topology.rank == 0 and not getattr(t, "dry_run", False):
        write_resolved(args, t.save)  # <save>/config.yaml: `--config` of it reproduces this run
    profiling = Profiling.from_config(args.logging, t.save, topology.rank, device)
    if profiling:
        profiling.begin()  # before the model is built: its allocations belong in a memory snapshot
    # The default stream as the rank's place gives it (layout.dims.rank_seed), and a per-TP-rank stream for sharded
    # dropout.
    tracker = model_parallel_seed(rank_seed(t.seed, topology.coords), topology.tp_rank, device)
    model = CodeGeeXModel.for_rank(model_config, plan, topology, tracker, seed=t.seed, device=device)
    mark_shared_embedding_copy(model, topology)
    workload = Workload.from_run(model_config, plan, ds_config, device.type)
    log.info(model_summary(model, model_config, topology.tp_size, topology.pp_size))
    if plan.num_chunks > 1:
        log.info(f"interleaved 1F1B: {plan.num_chunks} model chunks per pipeline rank; " + "; ".join(
            f"rank {r}: layers " + " + ".join(f"{c[0]}-{c[-1]}" for c in chunks)
            for r, chunks in enumerate(plan.chunk_layers)))
    log.info(expected_memory_report(workload))
    engine, state = restore(prepared.resume, model, topology, tracker, plan,
                            lambda m: build_engine(m, args.optim, t.train_iters, ds_config, topology,
                                                   plan.global_batch_size))

    if state.iteration >= t.train_iters:
        schedule = prepared.resume.schedule
        keep = f" with --lr-decay-iters {schedule.decay_iters} (its LR schedule as it was)" if schedule else ""
        log.info(f"--load {prepared.resume.load_dir} is at iteration {state.iteration} of --train-iters "
                 f"{t.train_iters}: nothing to train; to continue it, raise --train-iters{keep}")
        return state  # (the process group goes with the process)
    train_ds, valid_ds, test_ds = build_datasets(args.data, t, plan, topology.rank, model_config.padded_vocab_size,
                                                fim=prepared.fim)
    sizes = num_samples(t, plan)
    train_loader = loader(train_ds, state.consumed_train_samples, plan, topology.dp_rank, args.data.num_workers,
                          sizes[0])
    valid_loader = valid_ds and loader(valid_ds, 0, plan, topology.dp_rank, 0, sizes[1])
    test_loader = test_ds and loader(test_ds, 0, plan, topology.dp_rank, 0, sizes[2])

    logging_rank = topology.is_logging_rank
    run_config = {name: dataclasses.asdict(getattr(args, name)) for name in ("parallel", "train", "optim", "data")}
    logger = MetricsLogger(args.logging, enabled=logging_rank, save_dir=t.save,
                           run_config={"model": dataclasses.asdict(model_config), **run_config, "cluster": cluster},
                           train_iters=t.train_iters, start_iteration=state.iteration,
                           resume_wandb_id=state.wandb_run_id)
    logger.log_metadata({"iteration": state.iteration, "cluster": cluster})
    flops = model_flops_per_iteration(model_config, plan.global_batch_size, plan.seq_length, plan.recompute.is_full)
    peak = args.logging.peak_tflops * 1e12 if args.logging.peak_tflops else None
    exit_conditions = ExitConditions(signal_handler=t.exit_signal_handler, duration_mins=t.exit_duration_in_mins,
                                     start_time=start_time, device=device)
    humaneval = humaneval_callback(engine, prepared.tokenizer, device, topology, tasks=t.eval_humaneval_tasks,
                                   max_new_tokens=t.eval_humaneval_max_new_tokens, execute=logger.enabled,
                                   unsafe_no_sandbox=t.unsafe_no_sandbox, languages=t.eval_humaneval_languages,
                                   problems=t.eval_humaneval_problems) if t.eval_humaneval_interval else None
    infilling = infilling_callback(engine, prepared.tokenizer, device, topology, benchmark=t.eval_infilling_benchmark,
                                   problems=t.eval_infilling_problems, tasks=t.eval_infilling_tasks,
                                   max_new_tokens=t.eval_infilling_max_new_tokens,
                                   fim_spm_rate=args.data.fim_spm_rate, execute=logger.enabled,
                                   unsafe_no_sandbox=t.unsafe_no_sandbox) if t.eval_infilling_interval else None
    # Accounting measures the loop from outside it: bytes by group, and at the run's second step memory by part.
    measurement = Measurement(comm=CommCounter(topology.named_groups()),
                              comm_theory=comm_bytes_per_step(workload, topology.pp_rank),
                              memory=lambda: StepMemory(engine.module, workload, topology.pp_rank, device))
    checkpoints.attach(engine, model_config, topology, tracker, num_chunks=plan.num_chunks,
                       tokenizer=tokenizer_settings(args.data, prepared.tokenizer), resolved_config=dump_resolved(args),
                       wandb_run_id=logger.wandb_run_id)
    run = Run(plan, model_config, t, args.logging, topology, engine, tracker, device, logger, flops, peak,
              exit_conditions=exit_conditions,
              measurement=measurement, evaluate_humaneval=humaneval, evaluate_infilling=infilling,
              masking=DocumentMasking.from_config(args.data, prepared.tokenizer.eod),
              step_context=step_context_from_environment(engine.module), profiling=profiling,
              checkpoints=checkpoints)
    try:
        state = train(run, state, train_loader, valid_loader, test_loader)
    except TokenIdError as e:  # data changed or damaged after the start-up scan: one line, the launcher ends the rest
        log.error(e.one_line())
        raise SystemExit(1) from None
    finally:
        exit_conditions.close()
        logger.close()
        if profiling:
            profiling.close()  # a window cut short (an error, a preemption stop) still writes its trace
    if owns_process_group:
        dist.barrier()
        dist.destroy_process_group()
    return state


if __name__ == "__main__":
    main()
