"""The declared import layers (.importlinter) hold on this tree, and lint-imports really catches the ways they can
break: an upward import (the training loop importing evaluation), a cycle inside a package, and the training step
importing accounting (which the layers alone would allow)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).parent / "lint-imports")  # installed with the dev extras, beside this Python


def lint(tree: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: lint-imports reads the package at `tree`, not the installed (editable) one.
    return subprocess.run([LINT, "--config", str(tree / ".importlinter")], cwd=tree, capture_output=True, text=True,
                          timeout=120, env={"PATH": str(Path(LINT).parent), "PYTHONPATH": str(tree)})


def test_the_tree_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("training/trainer.py", "import codegeex_train.evaluation.humaneval", "codegeex_train.training is not allowed to "
                                                                          "import codegeex_train.evaluation"),
    ("checkpoint/files.py", "import codegeex_train.checkpoint.resume", "No cycles are allowed in "
                                                                      "codegeex_train.checkpoint"),
    # accounting sits below training in the layers: only the forbidden contract keeps the step free of it
    ("training/engine_stage.py", "import codegeex_train.accounting.memory", "codegeex_train.training is not allowed to "
                                                                     "import codegeex_train.accounting"),
    # a type named from above is an arrow up all the same (exclude_type_checking_imports = False)
    ("pipeline/p2p.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import codegeex_train.config.arguments",
     "codegeex_train.pipeline is not allowed to import codegeex_train.config"),
], ids=["upward", "cycle", "accounting-in-the-step", "type-only-upward"])
def test_a_deliberate_violation_is_caught(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "codegeex_train", tmp_path / "codegeex_train",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    path = tmp_path / "codegeex_train" / module
    path.write_text(path.read_text().replace("from __future__ import annotations\n",
                                             f"from __future__ import annotations\n\n{line}\n", 1))
    result = lint(tmp_path)
    assert result.returncode != 0 and broken in " ".join(result.stdout.split()), result.stdout
