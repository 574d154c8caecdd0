"""HumanEval-X in five languages on our own small problem files (tests/evaluation/data/humaneval_x, three tasks per
language in HumanEval-X's format): through the real sandbox every reference solution passes, also cut at the stop
string as a model's completion is, and wrong, crashing or uncompilable completions fail. Then the pure parts:
program assembly, the closing braces, where problems come from, missing toolchains, metric names, the tool and
the in-training callback."""

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

from codegeex_train.evaluation import (
    Sandbox,
    SandboxConfig,
    evaluate_samples,
    read_problems,
    read_samples,
)
from codegeex_train.evaluation.languages import (
    LANGUAGES,
    build_program,
    close,
    parse_languages,
)
from codegeex_train.evaluation.problems import ProblemsError
from codegeex_train.evaluation.toolchains import Toolchain, ToolchainError
from codegeex_train.generation.text import truncate_at_stop
from tests.harness import read_metrics, run_process_group

DATA = Path(__file__).parent / "data" / "humaneval_x"
ROOT = Path(__file__).resolve().parents[2]
# A wrong answer every task of the language compiles with (C++'s {} is 0 or ""), and a build failure.
WRONG = {"python": "    return None\n", "cpp": "    return {};\n}\n",
         "java": "        throw new UnsupportedOperationException();\n    }\n}\n",
         "js": "  return undefined\n}\n",  # the test's console.assert prints, exits 0: output is the failure
         "go": "    panic(\"not implemented\")\n}\n"}
BROKEN = "    this is not code in any of them (\n"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(timeout=60.0), workers=2)


class Toolchains(dict):
    """language -> its Toolchain, made on first use (Go compiles testify once for the module, into the build
    cache every job copies; a run of the fast tier, without Go, does not pay for it)."""

    def __missing__(self, lang):
        self[lang] = Toolchain(lang, read_problems(DATA, lang).values())
        return self[lang]


@pytest.fixture(scope="module")
def toolchains():
    chains = Toolchains()
    yield chains
    for chain in chains.values():
        chain.close()


@pytest.mark.parametrize("lang", [pytest.param(lang, marks=pytest.mark.slow) if lang in ("java", "go") else lang
                                  for lang in LANGUAGES])
def test_references_pass_and_stubs_fail(lang, sandbox, toolchains):
    problems = read_problems(DATA, lang)
    assert list(problems) == [f"{LANGUAGES[lang].task_prefix}/{i}" for i in range(3)]
    cases = []  # (task, what, completion)
    for task, problem in problems.items():
        reference = problem["canonical_solution"]
        generated = truncate_at_stop(reference, LANGUAGES[lang].stop)  # what the generator returns
        cases += [(task, "reference", reference), (task, "as generated", generated), (task, "wrong", WRONG[lang])]
    cases.append((next(iter(problems)), "broken", BROKEN))
    toolchain = None if lang == "python" else toolchains[lang]
    evaluation = evaluate_samples(problems, [{"task_id": t, "completion": c} for t, _, c in cases], ks=(1,),
                                  sandbox=sandbox, language=lang, toolchain=toolchain)
    outcome = {(t, what): r["result"] for (t, what, _), r in zip(cases, evaluation.results)}
    for (task, what), result in outcome.items():
        assert (result == "passed") == (what in ("reference", "as generated")), (task, what, result)
    assert not any(r == "timed out" for r in outcome.values()), outcome
    if lang in ("cpp", "java"):
        assert outcome[(f"{LANGUAGES[lang].task_prefix}/0", "broken")].endswith("compilation error")
    prefix = "humaneval" if lang == "python" else f"humaneval_{lang}"
    assert set(evaluation.metrics()) == {f"{prefix}_pass@1", f"{prefix}_tasks", f"{prefix}_samples_per_task"}


def test_js_reaches_js_md5_offline(sandbox, toolchains):
    """HumanEval-X's JavaScript/162 requires js-md5: the toolchain gives it through NODE_PATH, read-only."""
    program = ("const md5 = require('js-md5')\n"
               "console.assert(md5('Hello world') === '3e25960a79dbc69b674cd4ec67a72c62')\n")
    assert sandbox.run_command(toolchains["js"].job(program)).passed


def test_closing_braces_the_stop_string_cut():
    assert close("cpp", "    return x;") == "    return x;\n}"
    assert close("cpp", "    return x;\n}\n") == "    return x;\n}\n"  # a reference or CodeGeeX generation
    assert close("java", "        return x;\n    }") == "        return x;\n    }\n}"  # method closed, class not
    assert close("java", "        return x;") == "        return x;\n}\n}"
    assert close("go", "    if x {\n        return 1\n    }\n    return 0") .endswith("return 0\n}")
    assert close("python", "    return {\n") == "    return {\n"


def test_program_assembly_follows_codegeex():
    cpp = {"prompt": "#include<string>\nint f(){\n", "test": "int main(){}\n"}
    program = build_program("cpp", cpp, "    return 1;")
    assert program.count("#include<string>") == 1 and "#include<vector>\n" in program  # helpers the prompt lacks
    assert program.endswith("int f(){\n    return 1;\n}\nint main(){}\n")
    go = read_problems(DATA, "go")["Go/2"]
    program = build_program("go", go, go["canonical_solution"])
    # The prompt's own import block goes; the helper packages the completion uses come back, once.
    assert '"strings"' in go["prompt"] and program.count('"strings"') == 1
    assert '"strings"' not in build_program("go", go, "    return 0\n}\n")
    python = read_problems(DATA, "python")["Python/0"]
    program = build_program("python", python, "    return x + y\nprint('after the function')\n")
    assert "after the function" not in program and program.startswith("import math\n")
    assert "numpy" not in program  # samples run without site-packages
    human_eval = {"prompt": "def f():\n", "test": "def check(c): pass\n", "entry_point": "f"}
    assert build_program("python", human_eval, "    pass\n").endswith("check(f)\n")


def test_languages_flag():
    assert parse_languages("all") == ["python", "cpp", "java", "js", "go"]
    assert parse_languages("go,python") == ["python", "go"]
    with pytest.raises(ValueError, match="rust"):
        parse_languages("rust")


def test_config_knows_the_same_languages():
    from codegeex_train.config.arguments import HUMANEVAL_LANGUAGES

    assert HUMANEVAL_LANGUAGES == tuple(LANGUAGES)


def test_problem_locations(tmp_path):
    """CodeGeeX's folder, a clone of the repository, one file plain or gzipped; a file of another language."""
    assert list(read_problems(DATA, "cpp")) == ["CPP/0", "CPP/1", "CPP/2"]
    clone = tmp_path / "CodeGeeX" / "codegeex" / "benchmark" / "humaneval-x" / "java" / "data"
    clone.mkdir(parents=True)
    data = (DATA / "java" / "data" / "humaneval_java.jsonl").read_bytes()
    (clone / "humaneval_java.jsonl.gz").write_bytes(gzip.compress(data))
    assert list(read_problems(tmp_path / "CodeGeeX", "java")) == ["Java/0", "Java/1", "Java/2"]
    assert list(read_problems(clone / "humaneval_java.jsonl.gz", "java")) == ["Java/0", "Java/1", "Java/2"]
    with pytest.raises(ProblemsError, match="not a HumanEval-X go task"):
        read_problems(clone / "humaneval_java.jsonl.gz", "go")
    with pytest.raises(ProblemsError, match="no js/data/humaneval_js.jsonl.gz in it"):
        read_problems(tmp_path / "CodeGeeX", "js")
    (tmp_path / "lfs.jsonl.gz").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    with pytest.raises(ProblemsError, match="Git LFS pointer"):
        read_problems(tmp_path / "lfs.jsonl.gz", "cpp")
    (tmp_path / "short.jsonl").write_text(json.dumps({"task_id": "Go/0", "prompt": "p", "test": "t"}) + "\n")
    with pytest.raises(ProblemsError, match="short.jsonl:1: a problem needs string fields import, test_setup"):
        read_problems(tmp_path / "short.jsonl", "go")


def test_the_hub_offline_says_to_pass_a_local_copy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ProblemsError, match=r"cannot load THUDM/humaneval-x \(cpp\).*pass --problems DIR"):
        read_problems(language="cpp")


def test_codegeex_samples_use_the_generation_field(tmp_path):
    (tmp_path / "s.jsonl").write_text(json.dumps({"task_id": "CPP/0", "generation": "    return x+y;\n}\n"}) + "\n")
    assert read_samples(tmp_path / "s.jsonl")[0]["completion"] == "    return x+y;\n}\n"


def test_a_missing_toolchain_is_one_line_naming_the_package(monkeypatch, tmp_path):
    problems = read_problems(DATA, "js").values()
    need_md5 = [{"prompt": "", "test": "", "canonical_solution": "require('js-md5')"}]
    Toolchain("js", problems, node_modules=tmp_path)  # no task of ours needs js-md5
    with pytest.raises(ToolchainError, match=r"HumanEval-X js needs js-md5.*make humaneval-x-deps.*npm install"):
        Toolchain("js", need_md5, node_modules=tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ToolchainError, match=r"needs javac, java.*apt-get install openjdk-17-jdk-headless\)$"):
        Toolchain("java")


def run_tool(*args, timeout=300, **kwargs):
    cmd = [sys.executable, str(ROOT / "tools" / "evaluate_humaneval.py"), *map(str, args)]
    return run_process_group(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


def test_tool_scores_several_languages(tmp_path):
    """--language python,js on our files: per-language pass@k lines, one record with both languages' keys."""
    samples = [{"task_id": t, "completion": p["canonical_solution"] if i else WRONG[lang]}
               for lang in ("python", "js") for i, (t, p) in enumerate(read_problems(DATA, lang).items())]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    result = run_tool("--samples", tmp_path / "samples.jsonl", "--language", "python,js", "--problems", DATA,
                      "--run-dir", tmp_path / "run", "--output", tmp_path / "results.jsonl", "--workers", 2)
    assert result.returncode == 0, result.stderr
    assert "python pass@1: 0.6667" in result.stdout and "js pass@1: 0.6667" in result.stdout, result.stdout
    assert "HumanEval-X js: 3 tasks" in result.stdout
    [record] = read_metrics(tmp_path / "run")
    assert record["humaneval_pass@1"] == record["humaneval_js_pass@1"] == pytest.approx(2 / 3)
    assert record["humaneval_js_tasks"] == 3 and record["split"] == "humaneval"
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 6


def test_tool_canonical_scores_the_problems_own_solutions(tmp_path):
    """--canonical: each task's canonical_solution as its sample (the check run on CodeGeeX's data)."""
    result = run_tool("--canonical", "--language", "python,js", "--problems", DATA, "--workers", 2)
    assert result.returncode == 0, result.stderr
    assert "python pass@1: 1.0000" in result.stdout and "js pass@1: 1.0000" in result.stdout, result.stdout
    both = run_tool("--canonical", "--samples", tmp_path / "s.jsonl", "--language", "js", "--problems", DATA)
    assert both.returncode == 2 and "give exactly one of --load" in both.stderr, both.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--language", "rust"], "--language language 'rust'"),
    (["--language", "all", "--problems", "{d}/cpp/data/humaneval_cpp.jsonl"], "a file holds one language"),
    (["--language", "cpp"], "cannot load THUDM/humaneval-x (cpp)"),
    (["--language", "go", "--problems", "{d}/cpp/data/humaneval_cpp.jsonl"], "not a HumanEval-X go task"),
])
def test_tool_bad_language_input_is_one_error_line(tmp_path, args, fragment):
    (tmp_path / "s.jsonl").write_text('{"task_id": "CPP/0", "completion": ""}\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = run_tool("--samples", tmp_path / "s.jsonl", *[a.format(d=DATA) for a in args], env=env, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("evaluate_humaneval.py: error: ") and fragment in lines[-1], lines[-1]


def test_training_callback_scores_each_language(monkeypatch):
    """--eval-humaneval-languages python js: each language's prompts and stop strings, one merged record."""
    from codegeex_train.evaluation import during_training

    problems = {lang: read_problems(DATA, lang) for lang in ("python", "js")}
    seen = []

    class Answers:  # the references, as a model cut at the stop strings would give them
        def __init__(self, *args):
            pass

        def stream(self, prompts, params, *, num_samples=1, batch_size=None):
            seen.append(params.stop)
            by_prompt = {p["prompt"]: p["canonical_solution"] for lang in problems for p in problems[lang].values()}
            return enumerate(truncate_at_stop(by_prompt[prompt], params.stop) for prompt in prompts)

    class Engine:
        module = None

        def train(self):
            pass

    class Topology:
        dp_rank = rank = 0

    monkeypatch.setattr(during_training, "Generator", Answers)
    evaluate = during_training.humaneval_callback(Engine(), None, "cpu", Topology(), tasks=2, max_new_tokens=8,
                                                  execute=True, languages=("python", "js"), problems=str(DATA))
    metrics = evaluate(10)
    timings = {key: metrics.pop(key) for key in list(metrics) if key.endswith("_seconds")}
    assert sorted(timings) == sorted(f"humaneval{lang}_{t}_seconds" for lang in ("", "_js")
                                     for t in ("generation", "execution", "execution_tail", "sandbox"))
    assert metrics == {"humaneval_pass@1": 1.0, "humaneval_tasks": 2, "humaneval_samples_per_task": 1,
                       "humaneval_js_pass@1": 1.0, "humaneval_js_tasks": 2, "humaneval_js_samples_per_task": 1}
    assert seen == [LANGUAGES["python"].stop, ("\n}",)]


def test_training_flags_are_checked_before_anything_starts(tiny_data, tmp_path, monkeypatch):
    from codegeex_train import pretrain
    from codegeex_train.config.arguments import ConfigError
    from tests.harness import tiny_pretrain_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = tiny_pretrain_args(tiny_data, str(tmp_path / "run"), 4, "--eval-humaneval-interval", "2",
                              "--eval-humaneval-tasks", "2", "--eval-humaneval-languages", "python", "js",
                              "--eval-humaneval-problems", str(DATA))
    assert list(pretrain.prepare(argv).args.train.eval_humaneval_languages) == ["python", "js"]
    with pytest.raises(ConfigError, match="--eval-humaneval-languages rust: expected some of python cpp"):
        pretrain.prepare(argv + ["--eval-humaneval-languages", "rust"])
    with pytest.raises(ConfigError, match="tasks 5: there are only 3 problems"):
        pretrain.prepare(argv + ["--eval-humaneval-tasks", "5"])
    with pytest.raises(ConfigError, match="no go/data/humaneval_go.jsonl.gz"):
        pretrain.prepare(argv + ["--eval-humaneval-languages", "go", "--eval-humaneval-problems", str(tmp_path)])
