"""A completion that exits 0 before the tests run, or during them, fails under our (strict) scoring in every
language, and passes under CodeGeeX's (``scoring="codegeex"``): exit status 0 is all CodeGeeX asks of C++, Java
and Go, and silence all it asks of JavaScript. The exits are made in the function body and before main (a static
initializer, Go's ``init()``), through the real bubblewrap sandbox on our own problems (that the reference
solutions pass under strict scoring, the default, test_humaneval_x.py shows). Python fails both ways: CodeGeeX
runs it through human-eval's exec, where an exit is a failure too. Then the verdict check itself, byte by byte."""

from pathlib import Path

import pytest

from codegeex_train.evaluation import Sandbox, SandboxConfig, evaluate_samples, read_problems
from codegeex_train.evaluation.sandbox import _reported
from codegeex_train.evaluation.toolchains import Toolchain

DATA = Path(__file__).parent / "data" / "humaneval_x"

# language -> (the early exits: in the body of task 0, and before main), each a completion that compiles in
# CodeGeeX's program too. Go's completion cannot import os (the prompt's imports are dropped); testing.Main from
# init() runs no test and exits 0, which is all `go test` looks at. (os.Exit(0) inside a test already fails
# `go test`: -test.paniconexit0.)
EARLY_EXITS = {
    "python": ("    raise SystemExit(0)\n", "    import os\n    os._exit(0)\n"),
    "cpp": ("    std::exit(0);\n}\n",
            "    return x+y;\n}\nstatic int codegeex_early_ = (std::_Exit(0), 0);\n"),
    "java": ("        System.exit(0);\n        return 0;\n    }\n}\n",
             "        return x + y;\n    }\n    static { Runtime.getRuntime().halt(0); }\n}\n"),
    "js": ("  process.exit(0)\n}\n",
           "  return x + y\n}\nprocess.exit(0)\n"),
    "go": ("    return x + y\n}\n\nfunc init() {\n"
           "    testing.Main(func(pattern, name string) (bool, error) { return true, nil }, nil, nil, nil)\n}\n",),
}


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(timeout=60.0), workers=2)


@pytest.mark.parametrize("lang", list(EARLY_EXITS))
def test_early_exit_fails_strict_and_passes_codegeex(lang, sandbox):
    problems = read_problems(DATA, lang)
    task = next(iter(problems))
    problem = {task: problems[task]}
    early = [{"task_id": task, "completion": c} for c in EARLY_EXITS[lang]]
    toolchain = None if lang == "python" else Toolchain(lang, problem.values())
    try:
        strict = evaluate_samples(problem, early, ks=(1,), sandbox=sandbox, language=lang, toolchain=toolchain)
        codegeex = evaluate_samples(problem, early, ks=(1,), sandbox=sandbox, language=lang, toolchain=toolchain,
                                    scoring="codegeex")
    finally:
        if toolchain is not None:
            toolchain.close()
    why = "failed: " if lang == "python" else "failed: exited before the tests finished"  # Python: SystemExit: 0
    assert all(r["result"].startswith(why) for r in strict.results), strict.results
    assert [r["passed"] for r in codegeex.results] == [lang != "python"] * len(early), codegeex.results
    assert codegeex.metrics()["scoring"] == "codegeex" and "scoring" not in strict.metrics()
    assert all(r["scoring"] == "codegeex" for r in codegeex.results)


def test_the_verdict_is_the_last_line():
    token = "0123abcd"
    assert _reported(b"PASS\n\n0123abcd\n", token, only=False)
    assert _reported(b"0123abcd\n", token, only=False) and _reported(b"0123abcd\n", token, only=True)
    assert not _reported(b"0123abcd\nprinted after the verdict\n", token, only=False)
    assert not _reported(b"x0123abcd\n", token, only=False)  # a line of its own
    assert not _reported(b"0123abcd", token, only=False)  # the whole line, its newline included
    assert not _reported(b"Assertion failed\n0123abcd\n", token, only=True)  # JavaScript: nothing else
    assert not _reported(b"", token, only=False) and _reported(b"", None, only=True)
