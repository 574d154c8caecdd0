"""Code evaluation: HumanEval problems, the unbiased pass@k estimator, and a sandbox that runs each generated
program in its own guarded interpreter (``sandbox.py`` says exactly which guards hold as root and otherwise).

Nothing here imports torch or the model: scoring already generated samples needs only the standard library
(``evaluate_humaneval`` imports ``codegeex_train.generation`` when it builds default sampling parameters).
"""

from .humaneval import (HUMANEVAL_STOP, Evaluation, build_program, default_params, evaluate_humaneval,
                        evaluate_samples, generate_samples, humaneval_record, log_humaneval_metrics, select_tasks)
from .pass_at_k import estimate_pass_at_k, parse_ks, pass_at_k
from .problems import ProblemsError, humaneval_data_path, read_jsonl, read_problems, read_samples, write_jsonl
from .sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError, default_workers

__all__ = [
    "HUMANEVAL_STOP", "Evaluation", "build_program", "default_params", "evaluate_humaneval", "evaluate_samples",
    "generate_samples", "humaneval_record", "log_humaneval_metrics", "select_tasks",
    "estimate_pass_at_k", "parse_ks", "pass_at_k",
    "ProblemsError", "humaneval_data_path", "read_jsonl", "read_problems", "read_samples", "write_jsonl",
    "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "default_workers",
]
