"""Deduplication and decontamination (tools/preprocess_data.py --dedup, --decontaminate) on a generated corpus:
a slice of the stdlib with planted exact duplicates, near duplicates (whitespace, comments and a few identifiers
changed, their exact Jaccard above the threshold) and HumanEval's canonical solutions. Every planted item is found;
the false positive rate on the rest is measured against the exact Jaccard (an independent reference: Python sets,
no MinHash) and printed."""

import gzip
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from codegeex_train.preprocessing.decontaminate import (
    DEFAULT_MIN_CHARS,
    normalize,
    problem_strings,
    prompt_docstring,
)
from codegeex_train.preprocessing.dedup import DEFAULT_THRESHOLD, Deduplicator, Fingerprint, jaccard, shingles
from codegeex_train.preprocessing.default_corpus import default_corpus_files, stdlib_source_dir
from codegeex_train.preprocessing.file_filters import FileFilter, FilterSpec
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
from codegeex_train.preprocessing.source_files import SourceFile
from codegeex_train.evaluation.problems import read_problems

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
SPEC = TokenizerSpec(whitespace_encoding=True)
N_EXACT = N_NEAR = 12


def _near_copy(text: str) -> str:
    """Indentation as tabs, trailing spaces, three comment lines rewritten, three rarely used identifiers renamed."""
    lines = [re.sub(r"^((?:    )+)", lambda m: "\t" * (len(m.group(1)) // 4), line) + "  " for line in text.split("\n")]
    comments = [i for i, line in enumerate(lines) if line.lstrip().startswith("#")][:3]
    for i in comments:
        lines[i] = lines[i][:lines[i].index("#")] + "# reworded by the copier"
    text = "\n".join(lines)
    counts = Counter(re.findall(r"\b[a-z_][a-z0-9_]{5,}\b", text))
    for name in sorted(n for n, c in counts.items() if 2 <= c <= 4)[:3]:
        text = re.sub(rf"\b{name}\b", name + "_renamed", text)
    return text


@pytest.fixture(scope="module")
def planted():
    """(files in corpus order, the planted items as {origin: what it copies}, the unplanted originals)."""
    root = stdlib_source_dir()
    base = [SourceFile(p.read_text(), "stdlib", p.relative_to(root).as_posix(), "Python", str(p))
            for p in default_corpus_files(4 << 20)]
    big = [f for f in base if len(shingles(f.content)) >= 1500]
    step = len(big) // (N_EXACT + N_NEAR)
    exact = {f"planted/exact/{i}": big[2 * i * step] for i in range(N_EXACT)}
    near = {f"planted/near/{i}": big[(2 * i + 1) * step] for i in range(N_NEAR)}
    files = list(base)
    files += [SourceFile(f.content, "copier", f.path, "Python", origin) for origin, f in exact.items()]
    files += [SourceFile(_near_copy(f.content), "copier", f.path, "Python", origin) for origin, f in near.items()]
    # HumanEval: a canonical solution long enough to be searched for alone, re-indented with tabs, in a file of
    # its own; a short one (29 of them) with its prompt, whose docstring is then what is found.
    benchmark = {}
    for task_id, problem in read_problems(None, "python").items():
        solution = problem["canonical_solution"]
        origin = f"planted/humaneval/{task_id}"
        if len(normalize(solution)) >= DEFAULT_MIN_CHARS:
            text = f"import math\n\n\ndef solve(*args):\n{solution.replace('    ', chr(9))}\n"
            benchmark[origin] = (task_id, "canonical_solution")
        else:
            text = problem["prompt"] + solution
            benchmark[origin] = (task_id, "docstring")
        files.append(SourceFile(text, "leaky", f"{task_id}.py", "Python", origin))
    return files, exact, near, benchmark, base


def test_planted_near_copies_are_above_the_threshold_by_exact_jaccard(planted):
    files, _, near, _, _ = planted
    copies = {f.origin: f for f in files}
    similarities = [jaccard(shingles(copies[o].content), shingles(f.content)) for o, f in near.items()]
    assert all(DEFAULT_THRESHOLD < s < 1.0 for s in similarities), similarities  # changed, yet near


def test_every_planted_item_is_found_and_the_rest_is_kept(planted):
    files, exact, near, benchmark, base = planted
    humaneval = problem_strings("humaneval", read_problems(None, "python"))
    file_filter = FileFilter(FilterSpec(dedup="near", benchmarks=tuple(humaneval)))
    kept = list(file_filter.filtered(files, lambda texts: map(file_filter.inspect, texts), 16))
    removed = {r["file"]: r for r in file_filter.dedup.removed}
    dropped = {d["file"]: d for d in file_filter.decontaminator.dropped}
    for origin, original in exact.items():
        assert (removed[origin]["kind"], removed[origin]["duplicate_of"]) == ("exact", original.origin)
    for origin, original in near.items():  # some originals are near copies within the stdlib, dropped themselves
        assert (removed[origin]["kind"], removed[origin]["duplicate_of"]) == ("near", original.origin)
    for origin, (task_id, field) in benchmark.items():
        assert (dropped[origin]["task_id"], dropped[origin]["field"]) == (task_id, field)
    assert len(kept) == len(files) - len(removed) - len(dropped)
    # The rest (the stdlib has near copies of its own: codec tables and stubs): a removal is false when the exact
    # Jaccard to the file it copies is below the threshold; any contamination found in it is false.
    contents = {f.origin: f.content for f in files}
    rest = [f.origin for f in base]
    removed_rest = [dict(r, jaccard=jaccard(shingles(contents[r["file"]]), shingles(contents[r["duplicate_of"]])))
                    for r in (removed[o] for o in rest if o in removed)]
    false = [r for r in removed_rest if r["jaccard"] < DEFAULT_THRESHOLD]
    contaminated = [dropped[o] for o in rest if o in dropped]
    below = ", ".join(f"{r['jaccard']:.3f}" for r in false) or "-"
    print(f"\nplanted and found: {N_EXACT} exact, {N_NEAR} near duplicates, {len(benchmark)} HumanEval solutions; "
          f"the rest: {len(rest)} stdlib files, {len(removed_rest) - len(false)} removed as true duplicates of one "
          f"another, {len(false)} removed below the threshold (exact Jaccard {below}), {len(contaminated)} taken for "
          f"contaminated: false positive rate {(len(false) + len(contaminated)) / len(rest):.4f}")
    assert not contaminated, contaminated
    # MinHash estimates the Jaccard within 1/sqrt(256) = 0.06 (two standard errors): a pair further below the
    # threshold than that would be a fault, not the estimate's noise.
    assert all(r["jaccard"] >= DEFAULT_THRESHOLD - 0.06 for r in false), false


def test_exact_dedup_removes_only_identical_files(planted):
    files, exact, near, _, _ = planted
    dedup = Deduplicator("exact")
    kinds = {f.origin: dedup.check(f.origin, dedup.fingerprint(f.content)) for f in files}
    assert all(kinds[o] is not None for o in exact) and all(kinds[o] is None for o in near)
    contents = {f.origin: f.content for f in files}
    assert all(contents[r["file"]] == contents[r["duplicate_of"]] for r in dedup.removed)


@pytest.mark.parametrize("num_perm,agree", [(256, 179), (256, 192), (128, 112), (16, 12)])
def test_a_pair_exactly_at_the_threshold_is_a_near_duplicate(num_perm, agree):
    """--dedup-threshold is inclusive (estimated Jaccard >= J): a pair agreeing on exactly ``agree`` of ``num_perm``
    hash values is dropped at J = agree / num_perm (a float that holds it exactly), kept one step above. The
    signatures are built by hand, differing only in their last positions, so the LSH's first band holds the pair
    whatever bands it picks: only the confirming compare decides."""
    rng = np.random.default_rng(agree)
    first = rng.integers(0, 1 << 32, num_perm, dtype=np.uint64)
    second = first.copy()
    second[agree:] += np.uint64(1)  # differ in the last num_perm - agree positions only
    pair = Fingerprint(b"a" * 16, first), Fingerprint(b"b" * 16, second)
    threshold = agree / num_perm
    for at, dropped in ((threshold, True), (threshold + 1 / num_perm, False)):
        dedup = Deduplicator("near", at, num_perm)
        assert dedup.check("first.py", pair[0]) is None
        found = dedup.check("second.py", pair[1])
        assert (found is not None) == dropped, (at, found)
    assert (found_at := Deduplicator("near", threshold, num_perm)).check("first.py", pair[0]) is None
    assert found_at.check("second.py", pair[1]).similarity == threshold


@pytest.mark.parametrize("num_perm,threshold,top", [(256, 0.99, 0.989), (256, 1.0, 0.989), (16, 0.87, 0.863)])
def test_the_dedup_threshold_range_follows_the_permutation_count(tmp_path, capsys, num_perm, threshold, top):
    """Above ``top`` datasketch finds fewer than 2 LSH bands: one error line naming both flags and ``top``, which
    itself works (and 0.001 more does not), instead of datasketch's traceback."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.py").write_text("x = 1\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(["--input", str(tmp_path / "in"), "--output-prefix", str(out / "p"), "--dedup", "near",
                      "--dedup-threshold", str(threshold), "--dedup-num-perm", str(num_perm)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith("preprocess_data.py: error: ") and len(lines) == 1, lines
    assert (f"--dedup-threshold {threshold} is too high for --dedup-num-perm {num_perm}" in lines[0]
            and f"lower --dedup-threshold to {top} or less" in lines[0]), lines
    assert not out.exists()
    Deduplicator("near", top, num_perm)
    FilterSpec(dedup="near", threshold=top, num_perm=num_perm).validate()
    with pytest.raises(ValueError, match="too high for --dedup-num-perm"):
        FilterSpec(dedup="near", threshold=round(top + 0.001, 3), num_perm=num_perm).validate()


def test_docstrings_of_every_prompt_style():
    assert prompt_docstring('def f():\n    """ Add.\n    >>> f()\n    """\n') == "Add.\n    >>> f()"
    assert prompt_docstring('def g():\n    """One."""\n\ndef f():\n    """Two."""\n') == "Two."
    assert prompt_docstring("/*\nReturn the sum.\n*/\n#include<stdio.h>\nint f(){\n") == "Return the sum."
    assert prompt_docstring("import (\n)\n// Sum them.\n// >>> Sum(1)\nfunc Sum(x int) int {\n") == (
        "// Sum them.\n// >>> Sum(1)")
    assert prompt_docstring("int f(){\n") == "int f(){"


def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _humaneval_x(root: Path) -> Path:
    """One problem a language, laid out as the CodeGeeX repository's codegeex/benchmark/humaneval-x folder."""
    doc = "Check if in given list of numbers, are any two numbers closer to each other than given threshold."
    prompts = {"cpp": f"/*\n{doc}\n*/\n#include<vector>\nbool has_close(vector<float> n){{\n",
               "java": f"class Solution {{\n    /**\n    {doc}\n     */\n    public boolean hasClose() {{\n",
               "js": f"/* {doc}\n*/\nconst hasClose = (n) => {{\n",
               "go": "import (\n)\n" + "".join(f"// {w}\n" for w in doc.split(", ")) + "func HasClose() bool {\n",
               "python": f'def has_close(n):\n    """ {doc}\n    """\n'}
    for language, prompt in prompts.items():
        problem = {"task_id": f"{dict(cpp='CPP', go='Go', java='Java', js='JavaScript').get(language, 'Python')}/0",
                   "prompt": prompt, "declaration": "", "canonical_solution": "return false;\n", "test": "",
                   "example_test": "", "import": "", "test_setup": ""}
        path = root / language / "data" / f"humaneval_{language}.jsonl.gz"
        path.parent.mkdir(parents=True)
        with gzip.open(path, "wt") as f:
            f.write(json.dumps(problem) + "\n")
    return root


def test_cli_reports_what_it_removed_and_why(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    original = "def area(width, height):\n    # the area of a rectangle\n    return width * height\n" * 30
    (corpus / "a.py").write_text(original)
    (corpus / "b.py").write_text(original)  # exact
    (corpus / "c.py").write_text(original.replace("    ", "\t") + "\n")  # near (only whitespace changed)
    (corpus / "d.py").write_text("x = 1\n# Write a function to find the shared elements from the given two lists.\n")
    (corpus / "e.java").write_text("class A {\n  /* Check if in given list of numbers, are any two numbers closer to"
                                   " each other\n  than given threshold. */\n}\n")
    (corpus / "f.py").write_text("print('unrelated')\n")
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 2, "text": "Write a function to find the shared elements from the given "
                                "two lists.", "code": "def similar_elements(a, b):\n    return set(a) & set(b)\n",
                                "test_list": []}) + "\n")
    prefix = tmp_path / "out" / "p"
    _tool().main(["--input", str(corpus), "--extensions", ".py", ".java", "--output-prefix", str(prefix),
                  "--dedup", "near", "--decontaminate", "humaneval-x,mbpp", "--decontaminate-data",
                  f"humaneval-x={_humaneval_x(tmp_path / 'hx')}", "--decontaminate-data", f"mbpp={mbpp}"])
    assert "removed 2 duplicate and 2 contaminated files" in capsys.readouterr().out
    dedup = json.loads(Path(f"{prefix}_dedup.json").read_text())
    assert [(r["file"][-4:], r["kind"], r["duplicate_of"][-4:]) for r in dedup["removed_files"]] == [
        ("b.py", "exact", "a.py"), ("c.py", "near", "a.py")]
    report = json.loads(Path(f"{prefix}_decontamination.json").read_text())
    assert [(Path(d["file"]).name, d["benchmark"], d["task_id"]) for d in report["dropped_files"]] == [
        ("d.py", "mbpp", "MBPP/2"), ("e.java", "humaneval-x", "Python/0")]  # every language's docstring: the first
    assert report["strings"] == {"humaneval-x": 5, "mbpp": 2}  # the five docstrings; solutions and code too short
    assert len(MMapIndexedDataset(f"{prefix}_text_document")) == 2


def test_workers_drop_the_same_files_and_write_the_same_bytes(tmp_path, planted):
    files, exact, near, _, _ = planted
    corpus = tmp_path / "corpus.jsonl"
    small = [f for f in files if len(f.content) < 8000]
    chosen = small[:30] + small[:3] + small[-20:]  # stdlib files, three exact copies, HumanEval solutions
    corpus.write_text("".join(json.dumps({"content": f.content, "max_stars_repo_name": f.repo,
                                          "max_stars_repo_path": f.path}) + "\n" for f in chosen))
    humaneval = tuple(problem_strings("humaneval", read_problems(None, "python")))
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        summary = preprocess([str(corpus)], str(prefix), SPEC, json_keys=["content"], workers=workers,
                             progress=False, filters=FilterSpec(dedup="near", benchmarks=humaneval))
        outputs.append((Path(f"{prefix}_content_document.bin").read_bytes(),
                        Path(f"{prefix}_dedup.json").read_text().replace(str(corpus), ""),
                        Path(f"{prefix}_decontamination.json").read_text(), summary.duplicates, summary.contaminated))
    assert outputs[0] == outputs[1] and outputs[0][3] > 0 and outputs[0][4] > 0


def test_missing_benchmark_and_everything_removed_are_one_line_and_leave_nothing(tmp_path, capsys):
    line = "total = sum(value * weight for value, weight in pairs)\n"  # 55 characters: searched for
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.py").write_text(line)
    (tmp_path / "in" / "b.py").write_text("x = 1\n" + line.upper())  # case does not hide it
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 7, "text": "Sum the weighted values.", "code": line}) + "\n")
    out = tmp_path / "out"
    for argv, fragment in (
        (["--decontaminate", "mbpp"], "--decontaminate mbpp: cannot load google-research-datasets/mbpp with "
                                      "datasets"),
        (["--decontaminate", "humaneval-x"], "pass --decontaminate-data humaneval-x=DIR, a copy of the CodeGeeX"),
        (["--decontaminate", "humaneval", "--decontaminate-data", f"humaneval={tmp_path / 'none.jsonl'}"],
         "none.jsonl: no such file"),
        (["--decontaminate-data", "mbpp=x"], "--decontaminate-data mbpp=...: mbpp is not in --decontaminate"),
        (["--dedup", "near", "--dedup-threshold", "0"], "--dedup-threshold 0.0: must be in (0, 1]"),
        (["--dedup", "near", "--dedup-num-perm", "4"], "--dedup-num-perm 4: must be in 16..1024"),
        (["--decontaminate", "humaneval,apps"], "unknown benchmark apps"),
        (["--decontaminate", "mbpp", "--decontaminate-data", f"mbpp={mbpp}"],
         "no documents left in [" + repr(str(tmp_path / "in")) + "] (field 'text'): all 2 were removed"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _tool().main(["--input", str(tmp_path / "in"), "--output-prefix", str(out / "p"), *argv])
        lines = capsys.readouterr().err.strip().splitlines()  # a progress bar may come first
        errors = [line for line in lines if line.startswith("preprocess_data.py: error: ")]
        assert exit_info.value.code == 2 and errors == lines[-1:] and fragment in lines[-1], (fragment, lines)
        assert not out.exists() or list(out.iterdir()) == []  # no dataset, report or .tmp
