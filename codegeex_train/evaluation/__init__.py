"""Code evaluation: HumanEval problems, the unbiased pass@k estimator, and a sandbox that runs each generated
program in its own guarded interpreter (``sandbox.py`` says exactly which guards hold as root and otherwise).

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
from codegeex_train.evaluation.pass_at_k import estimate_pass_at_k, parse_ks, pass_at_k
from codegeex_train.evaluation.problems import (
    ProblemsError,
    humaneval_data_path,
    read_jsonl,
    read_problems,
    read_samples,
    write_jsonl,
)
from codegeex_train.evaluation.sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError, default_workers

__all__ = [
    "HUMANEVAL_STOP", "Evaluation", "build_program", "default_params", "evaluate_humaneval", "evaluate_samples",
    "generate_samples", "humaneval_record", "log_humaneval_metrics", "select_tasks",
    "estimate_pass_at_k", "parse_ks", "pass_at_k",
    "ProblemsError", "humaneval_data_path", "read_jsonl", "read_problems", "read_samples", "write_jsonl",
    "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "default_workers",
]
