"""HumanEval (and HumanEval-X, ``--eval-humaneval-languages``) inside a training run
(``--eval-humaneval-interval``), and HumanEval-infilling for a model trained with fill-in-the-middle
(``--eval-infilling-interval``), each handed to the loop as a callback by pretrain.py: the loop calls it and logs
what it returns, and imports neither evaluation nor generation."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from codegeex_train.distributed.topology import Topology
from codegeex_train.evaluation.humaneval import evaluate_humaneval, select_tasks
from codegeex_train.evaluation.infilling import (
    evaluate_infilling,
    generate_infilling_samples,
    infilling_params,
    read_infilling_problems,
    spread_tasks,
)
from codegeex_train.evaluation.languages import get_language
from codegeex_train.evaluation.problems import read_problems
from codegeex_train.evaluation.sandbox import UNSAFE, Sandbox, SandboxConfig
from codegeex_train.evaluation.toolchains import Toolchain, find_tools
from codegeex_train.generation import FimFormat, Generator, SamplingParams
from codegeex_train.tokenization.code_tokens import held_code_tokens, trained_order

logger = logging.getLogger(__name__)


def training_sandbox(unsafe_no_sandbox: bool) -> Sandbox:
    """The sandbox in-loop evaluation runs samples in; raises ``SandboxError`` (what to install or allow) where
    it cannot be set up, unless ``unsafe_no_sandbox`` (``--unsafe-no-sandbox``). pretrain.py builds one on every
    rank before any process group, so that a machine without it stops the run at once, not at the first
    evaluation hours later."""
    return Sandbox(SandboxConfig(timeout=3.0, unsafe_no_sandbox=unsafe_no_sandbox))


def humaneval_problems(languages: Sequence[str], problems: str | None, tasks: int) -> dict[str, dict]:
    """language -> its first ``tasks`` problems (from the directory ``problems``, else the defaults), the
    compilers and libraries they need checked: ``ProblemsError``, ``ToolchainError`` or ValueError otherwise.
    pretrain.py calls it before any process group too."""
    chosen = {lang: select_tasks(read_problems(problems, lang), tasks) for lang in languages}
    for lang, lang_problems in chosen.items():
        find_tools(lang, lang_problems.values())
    return chosen


def warn_if_unsafe(sandbox, what: str, records: str) -> None:
    if sandbox is not None and sandbox.unsafe:
        logger.warning(f"--unsafe-no-sandbox: {what} samples run without isolation (sandbox: {UNSAFE}); the "
                       f"{records} records say so")


def humaneval_callback(engine, tokenizer, device, topology: Topology, *, tasks: int, max_new_tokens: int,
                       execute: bool, unsafe_no_sandbox: bool = False, languages: Sequence[str] = ("python",),
                       problems: str | None = None) -> Callable[[int], dict | None]:
    """iteration -> greedy pass@1 on the first ``tasks`` problems of each of ``languages`` (HumanEval's for
    python, HumanEval-X's for the others; ``problems``: a directory in CodeGeeX's layout), or None.

    Generation is collective over TP only, so DP rank 0's TP group generates (the others go on and wait for it
    in the next step's collectives); only the rank with ``execute`` (the logging rank) runs the completions in
    the sandbox, each sample as soon as it is generated (``evaluate_generated``), and returns the metrics (with the
    generation and execution seconds, and ``"sandbox": "none (--unsafe-no-sandbox)"`` when unsafe). Prompts
    the model cannot take (e.g. longer than its positions) skip the evaluation with a warning, the same on every
    rank."""
    problems_by = humaneval_problems(languages, problems, tasks)
    params = {lang: SamplingParams(max_new_tokens=max_new_tokens, stop=get_language(lang).stop)
              for lang in problems_by}
    sandbox = training_sandbox(unsafe_no_sandbox) if execute and topology.dp_rank == 0 else None
    # Built once (Go compiles testify here, a few seconds), for the run's lifetime.
    toolchains = {lang: Toolchain(lang, problems_by[lang].values()) for lang in problems_by
                  if lang != "python"} if sandbox is not None else {}
    warn_if_unsafe(sandbox, "HumanEval", "humaneval")

    def evaluate(iteration: int) -> dict | None:
        if topology.dp_rank != 0:
            return None
        generator = Generator(engine.module, tokenizer, device)  # puts the module in eval mode
        metrics: dict = {}
        try:
            for lang, lang_problems in problems_by.items():
                try:
                    metrics.update(evaluate_humaneval(generator, lang_problems, num_samples=1, ks=(1,),
                                                      params=params[lang], execute=execute, sandbox=sandbox,
                                                      language=lang, toolchain=toolchains.get(lang)) or {})
                except ValueError as e:
                    if topology.rank == 0:
                        which = "" if lang == "python" else f" {lang}"
                        logger.warning(f"--eval-humaneval-interval skipped{which} at iteration {iteration}: {e}")
        finally:
            engine.train()
        return metrics or None

    return evaluate


def infilling_problems(benchmark: str, problems: str | None, tasks: int) -> dict[str, dict]:
    """``tasks`` problems of the HumanEval-infilling ``benchmark`` spread evenly through it (``problems``: its file
    or a clone of the repository; None: the hub): ``ProblemsError`` or ValueError otherwise. pretrain.py calls it
    before any process group."""
    return spread_tasks(read_infilling_problems(problems, benchmark), tasks)


def infilling_callback(engine, tokenizer, device, topology: Topology, *, benchmark: str, problems: str | None,
                       tasks: int, max_new_tokens: int, fim_spm_rate: float, execute: bool,
                       unsafe_no_sandbox: bool = False) -> Callable[[int], dict | None]:
    """iteration -> greedy pass@1 on ``tasks`` problems of the HumanEval-infilling ``benchmark``
    (``infilling_<benchmark>_pass@1``, split ``infilling``), or None; the model is prompted in the order it trains
    with (``fim_spm_rate``: ``--fim-spm-rate``; ``generation/infill.py``). Who generates and who executes as in
    ``humaneval_callback``; an evaluation whose prompts the model cannot take is skipped with a warning.

    ``tokenizer`` is the run's, already holding the FIM sentinels (the run trains with ``--fim-rate`` > 0); one
    without them is a ValueError here, before training starts."""
    chosen = infilling_problems(benchmark, problems, tasks)
    tokens = held_code_tokens(tokenizer)
    if tokens is None:
        raise ValueError("--eval-infilling-interval: the run's tokenizer lacks the FIM sentinels (it trains without "
                         "--fim-rate above 0?): a model never shown them cannot infill")
    fim = FimFormat(trained_order(fim_spm_rate), tokens)
    params = infilling_params(max_new_tokens=max_new_tokens)
    sandbox = training_sandbox(unsafe_no_sandbox) if execute and topology.dp_rank == 0 else None
    warn_if_unsafe(sandbox, "infilling", "infilling")

    def evaluate(iteration: int) -> dict | None:
        if topology.dp_rank != 0:
            return None
        generator = Generator(engine.module, tokenizer, device)  # puts the module in eval mode
        try:
            samples = generate_infilling_samples(generator, chosen, fim, num_samples=1, params=params)
            if not execute:
                return None
            return evaluate_infilling(chosen, samples, benchmark=benchmark, ks=(1,), sandbox=sandbox).metrics()
        except ValueError as e:
            if topology.rank == 0:
                logger.warning(f"--eval-infilling-interval skipped at iteration {iteration}: {e}")
            return None
        finally:
            engine.train()

    return evaluate
