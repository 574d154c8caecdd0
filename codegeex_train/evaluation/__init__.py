"""Code evaluation: HumanEval problems and HumanEval-X's C++, Java, JavaScript and Go (``languages.py``: prompts,
stop strings, program assembly; ``toolchains.py``: their compilers), the unbiased pass@k estimator, and a sandbox that runs each generated
program (or a compiled language's build-and-run command) in a bubblewrap sandbox of its own (``sandbox.py`` says
what the kernel enforces).

Scoring already generated samples (``evaluate_samples``) needs no model; ``during_training.py`` is the
callback pretrain.py hands the training loop for ``--eval-humaneval-interval``.

May import: ``generation``, ``metrics``, ``distributed`` and below; training does not import it.
"""

from codegeex_train.evaluation.humaneval import (
    HUMANEVAL_STOP,
    Evaluation,
    build_program,
    default_params,
    evaluate_humaneval,
    evaluate_samples,
    generate_samples,
    humaneval_record,
    log_humaneval_metrics,
    select_tasks,
)
from codegeex_train.evaluation.languages import LANGUAGES, SCORINGS, Language, parse_languages
from codegeex_train.evaluation.pass_at_k import estimate_pass_at_k, parse_ks, pass_at_k
from codegeex_train.evaluation.problems import (
    ProblemsError,
    humaneval_data_path,
    read_jsonl,
    read_numbered_samples,
    read_problems,
    read_samples,
    write_jsonl,
)
from codegeex_train.evaluation.sandbox import (
    UNSAFE,
    CommandJob,
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    default_workers,
)
from codegeex_train.evaluation.toolchains import Toolchain, ToolchainError

__all__ = [
    "HUMANEVAL_STOP", "Evaluation", "build_program", "default_params", "evaluate_humaneval", "evaluate_samples",
    "generate_samples", "humaneval_record", "log_humaneval_metrics", "select_tasks",
    "estimate_pass_at_k", "parse_ks", "pass_at_k",
    "ProblemsError", "humaneval_data_path", "read_jsonl", "read_numbered_samples", "read_problems", "read_samples",
    "write_jsonl",
    "UNSAFE", "CommandJob", "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "default_workers",
    "LANGUAGES", "SCORINGS", "Language", "parse_languages", "Toolchain", "ToolchainError",
]
