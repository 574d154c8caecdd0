"""HumanEval-infilling (OpenAI's fill-in-the-middle benchmark, Bavarian et al. 2022): fill a span of a HumanEval
canonical solution back in, given the code before and after it, and run HumanEval's tests on the result.

The problems are read from where users get them, never copied here:

=================  ==============================================  =====  ===========================================
benchmark          file in github.com/openai/human-eval-infilling   tasks  the middle
=================  ==============================================  =====  ===========================================
single-line        data/HumanEval-SingleLineInfilling.jsonl.gz      1033   each non-blank line of a canonical solution
multi-line         data/HumanEval-MultiLineInfilling.jsonl.gz       5815   each span of consecutive non-blank lines
random-span        data/HumanEval-RandomSpanInfilling.jsonl.gz      1640   random character spans, 10 per problem
random-span-light  data/HumanEval-RandomSpanInfillingLight.jsonl.gz  164   one random span per problem
=================  ==============================================  =====  ===========================================

(1033 and 5815 are the counts of the 164 HumanEval solutions' non-blank lines and of their spans, n(n+1)/2 per
solution; the first two are InCoder's benchmarks, the last two the FIM paper's.) ``--problems`` takes one of those
files or a clone of the repository; without it the dataset ``loubnabnl/humaneval_infilling`` (configs
``HumanEval-SingleLineInfilling`` ...) is loaded through ``datasets`` from the Hugging Face hub.

A problem holds ``task_id``, ``entry_point``, ``prompt`` (the prefix: HumanEval's prompt and the solution before
the middle), ``suffix`` (the solution after it), ``canonical_solution`` (the middle) and ``test``. A sample's
``completion`` is a middle, and the program run is the benchmark's own::

    prompt + middle + suffix + "\\n" + test + "\\n" + "check(entry_point)"

in the same sandbox and with the same pass@k as HumanEval (``humaneval.py``: it is HumanEval's program with
``middle + suffix`` as the completion). Metrics go in records of split ``infilling``:
``infilling_single_line_pass@1``, ``infilling_single_line_tasks``, ...

Generation prompts a FIM-trained model with the prefix and suffix (``Generator.infill``, in the order the model
was trained with) and takes what it writes until the end of the document (EOD), with no stop strings: a middle of
several lines may well hold ``\\nif`` or ``\\ndef``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from codegeex_train.evaluation import languages
from codegeex_train.evaluation.humaneval import Evaluation, evaluate_samples, generate_samples, log_humaneval_metrics
from codegeex_train.evaluation.problems import ProblemsError, problems_by_task, read_jsonl
from codegeex_train.evaluation.sandbox import ExecResult, Sandbox, SandboxConfig

__all__ = ["BENCHMARKS", "HUB_DATASET", "SPLIT", "InfillingBenchmark", "InfillingEvaluation", "evaluate_infilling",
           "generate_infilling_samples", "infilling_params", "infilling_program", "log_infilling_metrics",
           "read_infilling_problems", "spread_tasks"]

SPLIT = "infilling"
HUB_DATASET = "loubnabnl/humaneval_infilling"
REPOSITORY = "github.com/openai/human-eval-infilling"
FIELDS = ("task_id", "entry_point", "prompt", "suffix", "canonical_solution", "test")


@dataclass(frozen=True)
class InfillingBenchmark:
    name: str  # --benchmark
    file: str  # in the repository's data/
    tasks: int  # how many the published file holds

    @property
    def hub_config(self) -> str:
        return self.file.removesuffix(".jsonl.gz")

    @property
    def metric_prefix(self) -> str:
        return f"{SPLIT}_{self.name.replace('-', '_')}"


BENCHMARKS: dict[str, InfillingBenchmark] = {b.name: b for b in (
    InfillingBenchmark("single-line", "HumanEval-SingleLineInfilling.jsonl.gz", 1033),
    InfillingBenchmark("multi-line", "HumanEval-MultiLineInfilling.jsonl.gz", 5815),
    InfillingBenchmark("random-span", "HumanEval-RandomSpanInfilling.jsonl.gz", 1640),
    InfillingBenchmark("random-span-light", "HumanEval-RandomSpanInfillingLight.jsonl.gz", 164),
)}
# The names the repository's own data.py uses for the random-span files, accepted in a clone too.
_OTHER_NAMES = {"random-span": "HumanEval-RandomSpan.jsonl.gz",
                "random-span-light": "HumanEval-RandomSpanLight.jsonl.gz"}


def get_benchmark(name: str) -> InfillingBenchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"infilling benchmark {name!r}: expected one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def _local_copy(bench: InfillingBenchmark) -> str:
    return f"pass --problems FILE, a copy of {REPOSITORY}'s data/{bench.file} (or a clone of the repository)"


def benchmark_file(path: str | os.PathLike, bench: InfillingBenchmark) -> Path:
    """``path`` itself when it is not a directory; else the benchmark's file in it or in its ``data/`` (a clone)."""
    path = Path(path)
    if not path.is_dir():
        return path
    names = [bench.file] + ([_OTHER_NAMES[bench.name]] if bench.name in _OTHER_NAMES else [])
    for root in (path, path / "data"):
        for name in names:
            for candidate in (root / name, root / name.removesuffix(".gz")):
                if candidate.is_file():
                    return candidate
    raise ProblemsError(f"{path}: no {bench.file} in it or in its data/ (the layout of {REPOSITORY})")


def _hub_rows(bench: InfillingBenchmark) -> list[tuple[int, dict]]:
    try:
        import datasets  # first: importing it sets the hub's log level
    except ImportError as e:
        raise ProblemsError(f"cannot load {HUB_DATASET} without datasets ({e}): {_local_copy(bench)}") from None
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # offline, its retries would each print a warning before our one line
    try:
        rows = datasets.load_dataset(HUB_DATASET, bench.hub_config, split="test")
        return [(i, dict(row)) for i, row in enumerate(rows, 1)]
    except Exception as e:  # noqa: BLE001 - offline, a dataset script this datasets no longer runs, ...
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProblemsError(f"cannot load {HUB_DATASET} ({bench.hub_config}) with datasets ({why}): "
                            f"{_local_copy(bench)}") from None
    finally:
        hub_log.setLevel(level)


def read_infilling_problems(path: str | os.PathLike | None, benchmark: str) -> dict[str, dict]:
    """task_id -> problem of ``benchmark``, in file order: from ``path`` (a file, or a directory holding the
    benchmark's file), else from the hub. ProblemsError naming the file and line for anything unusable."""
    bench = get_benchmark(benchmark)
    where = f"{HUB_DATASET} ({bench.hub_config})" if path is None else benchmark_file(path, bench)
    rows = _hub_rows(bench) if path is None else read_jsonl(where)

    def check(number: int, problem: dict) -> None:
        missing = [k for k in FIELDS if not isinstance(problem.get(k), str)]
        if missing:
            raise ProblemsError(f"{where}:{number}: an infilling problem needs string fields {', '.join(missing)} "
                                f"(HumanEval-infilling's format: {', '.join(FIELDS)})")

    return problems_by_task(where, rows, check)


def spread_tasks(problems: Mapping[str, dict], tasks: int | None) -> dict[str, dict]:
    """``tasks`` problems evenly spaced through the file (all when None): the files list a HumanEval problem's
    spans together, so the first K would all come from the first few problems."""
    if tasks is None or tasks >= len(problems):
        return dict(problems)
    if tasks < 1:
        raise ValueError(f"tasks {tasks}: must be >= 1")
    items = list(problems.items())
    return dict(items[i * len(items) // tasks] for i in range(tasks))


def as_completion(problem: Mapping[str, str], middle: str) -> str:
    """What follows the prompt once ``middle`` is filled in: HumanEval's completion."""
    return middle + problem["suffix"]


def infilling_program(problem: Mapping[str, str], middle: str) -> str:
    """The program that tests ``middle`` (what ``evaluate_infilling`` runs): HumanEval's, with ``middle + suffix``
    as the completion."""
    return languages.build_program("python", problem, as_completion(problem, middle))


@dataclass
class InfillingEvaluation(Evaluation):
    """An ``Evaluation`` whose samples are middles; its metrics are named after the benchmark."""

    benchmark: str = "single-line"

    def metrics(self) -> dict:
        """``{"infilling_single_line_pass@1": ..., "infilling_single_line_tasks": K, ..._samples_per_task: n}`` (and
        the sandbox warning as HumanEval's)."""
        prefix = BENCHMARKS[self.benchmark].metric_prefix
        return {prefix + k.removeprefix("humaneval") if k.startswith("humaneval_") else k: v
                for k, v in super().metrics().items()}

    def summary(self) -> str:
        return f"HumanEval-infilling {self.benchmark}" + super().summary().removeprefix("HumanEval")


def evaluate_infilling(problems: Mapping[str, dict], samples: Sequence[Mapping], *, benchmark: str,
                       ks: Sequence[int] = (1, 10, 100), sandbox: Sandbox | None = None,
                       config: SandboxConfig | None = None, workers: int | None = None,
                       on_result: Callable[[int, ExecResult], None] | None = None) -> InfillingEvaluation:
    """Run every sample (``{"task_id", "completion": middle}``) against its problem, as ``evaluate_samples``
    does HumanEval's (every problem needs a sample); the results hold the middles."""
    get_benchmark(benchmark)
    joined = [{**s, "completion": as_completion(problems[s["task_id"]], s["completion"])} if s["task_id"] in problems
              else s for s in samples]  # an unknown task: evaluate_samples says so
    evaluation = evaluate_samples(problems, joined, ks=ks, sandbox=sandbox, config=config, workers=workers,
                                  on_result=on_result)
    for result, sample in zip(evaluation.results, samples):
        result["completion"] = sample["completion"]
    return InfillingEvaluation(**{f.name: getattr(evaluation, f.name) for f in dataclasses.fields(Evaluation)},
                               benchmark=benchmark)


class _Infiller:
    """``stream(task_ids, params, num_samples=, batch_size=)`` -> (index, middle): lets ``generate_samples``
    (ordering, seeds, progress) drive ``Generator.infill``, its "prompts" being task ids. ``infill`` returns all
    middles at once, so infilling does not overlap generation with execution."""

    def __init__(self, generator, problems: Mapping[str, dict], fim):
        self.generator, self.problems, self.fim = generator, problems, fim

    def stream(self, task_ids: list[str], params, *, num_samples: int, batch_size: int | None):
        chosen = [self.problems[t] for t in task_ids]
        return enumerate(self.generator.infill([p["prompt"] for p in chosen], [p["suffix"] for p in chosen], params,
                                               self.fim, num_samples=num_samples, batch_size=batch_size))


def generate_infilling_samples(generator, problems: Mapping[str, dict], fim, *, num_samples: int, params,
                               batch_size: int | None = None, progress: bool = False) -> list[dict]:
    """``num_samples`` middles per problem from one ``generator.infill`` call over all of them in the FIM format
    ``fim``, ordered and seeded as ``generate_samples`` (task i's sample j: ``row_seed(params.seed, i, j)``)."""
    return generate_samples(_Infiller(generator, problems, fim), {task: {"prompt": task} for task in problems},
                            num_samples=num_samples, params=params, batch_size=batch_size, progress=progress)


def infilling_params(num_samples: int = 1, *, max_new_tokens: int = 128, temperature: float | None = None,
                     top_p: float = 0.95, top_k: int = 0, seed: int = 1234):
    """Greedy for one sample per task, else temperature (default 0.8) and nucleus sampling; no stop strings (the
    middle ends at EOD)."""
    from codegeex_train.generation import SamplingParams

    if num_samples == 1 and temperature is None:
        return SamplingParams(max_new_tokens=max_new_tokens, seed=seed)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8 if temperature is None else temperature,
                          top_k=top_k, top_p=top_p, seed=seed)


def log_infilling_metrics(run_dir: str | os.PathLike, iteration: int, metrics: Mapping, **wandb) -> dict:
    """``log_humaneval_metrics`` with the record in split ``infilling`` (the metrics' own ``split`` wins)."""
    return log_humaneval_metrics(run_dir, iteration, {"split": SPLIT, **metrics}, **wandb)
