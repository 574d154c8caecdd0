"""The script runs the code of the checkout it is in (issue 43, case 14), whatever copy of codegeex_train the
environment would resolve: every python it starts (the config reader, the dry run's check, the preprocessing, the
ranks, the plots) imports this checkout's package, on one node and through a hostfile.

The other copy here is a decoy package first on the caller's PYTHONPATH: ahead of anything a venv's site-packages
(a second checkout's `pip install -e`, whose finder comes after every path entry) would supply, so a script that
beats it beats those too. The fake `$PYTHON` and `deepspeed` stand for each real call with a probe: the real
interpreter, in the environment that call gets and with the sys.path its own `python FILE` would have (FILE's
directory first), imports codegeex_train and records which one. The decoy records any import of itself.
"""

from __future__ import annotations

import ast
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.test_pretrain_script import READER, ROOT, Script, _executable

# `probe FILE`: which codegeex_train `python FILE` would import in this environment (appended to $PROBES).
PROBE = (f'{shlex.quote(sys.executable)} -c "import os, sys; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[1]));'
         ' import codegeex_train; open(os.environ[\'PROBES\'], \'a\').write(sys.argv[1] + \' \' + codegeex_train.__file__'
         ' + chr(10))"')


class Probed(Script):
    """The script with probing fakes and a decoy codegeex_train first on the caller's PYTHONPATH."""

    def __init__(self, tmp_path: Path):
        super().__init__(tmp_path)
        self.probes, self.decoy_imported = tmp_path / "probes", tmp_path / "decoy-imported"
        decoy = tmp_path / "other-checkout" / "codegeex_train"
        decoy.mkdir(parents=True)
        (decoy / "__init__.py").write_text(f"open({str(self.decoy_imported)!r}, 'a').write('imported\\n')\n")
        self.decoy_root = decoy.parent
        # $PYTHON: the reader runs for real; any other call is probed with its script (pretrain.py's check, the
        # preprocessing, the plots), and passes.
        _executable(self.bin / "fake-python", f'#!/bin/sh\n{READER}{PROBE} "$1"\nexit 0\n')
        # deepspeed: a rank runs `python -u .../pretrain.py` in the launcher's environment
        _executable(self.bin / "deepspeed", '#!/bin/sh\nfor word in "$@"; do case "$word" in *pretrain.py) '
                                            f'{PROBE} "$word" ;; esac; done\nenv -0 > "$FAKE_CALLS.env"\nexit 0\n')

    def run(self, *args: str, dry: bool = True, **variables: str) -> subprocess.CompletedProcess:
        return super().run(*args, dry=dry, PROBES=str(self.probes), PYTHONPATH=str(self.decoy_root), **variables)

    def imported(self) -> dict[str, str]:
        """{script run: the codegeex_train/__init__.py it imported}."""
        lines = self.probes.read_text().splitlines() if self.probes.exists() else []
        return dict(line.rsplit(" ", 1) for line in lines)


@pytest.fixture
def probed(tmp_path) -> Probed:
    return Probed(tmp_path)


OURS = str(ROOT / "codegeex_train" / "__init__.py")


def test_every_python_the_script_runs_imports_this_checkout(probed, tmp_path):
    """A dry run (the reader, pretrain.py's check), then a real run (the preprocessing if the default corpus is not
    built yet, the ranks, the plots): each imports this checkout's package, never the other copy."""
    proc = probed.run(OUTPUT_DIR=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert probed.imported() == {f"{ROOT}/codegeex_train/pretrain.py": OURS}  # the dry run's check
    probed.probes.unlink()
    proc = probed.run(dry=False, OUTPUT_DIR=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    imported = probed.imported()
    assert {f"{ROOT}/codegeex_train/pretrain.py", f"{ROOT}/tools/plot_metrics.py"} <= set(imported)  # ranks, plots
    assert set(imported.values()) == {OURS} and not probed.decoy_imported.exists(), imported


def test_a_hostfile_launch_sends_this_checkout_to_every_node(probed, tmp_path):
    """Through a hostfile the other nodes get PYTHON* variables from DeepSpeed's pdsh runner (its EXPORT_ENVS): the
    launcher's PYTHONPATH starts with this checkout. The runner also puts its working directory first on that
    PYTHONPATH: a working directory holding another codegeex_train is refused in one line."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-01 slots=2\nnode-02 slots=2\n")
    proc = probed.run(dry=False, DEVICE="cpu", HOSTFILE=str(hostfile), OUTPUT_DIR=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(item.split("=", 1) for item in (tmp_path / "calls.env").read_bytes().decode().split("\0") if item)
    assert env["PYTHONPATH"].split(":")[:2] == [str(ROOT), str(probed.decoy_root)]
    assert set(probed.imported().values()) == {OURS} and not probed.decoy_imported.exists()
    assert any("PYTHONPATH".startswith(prefix) for prefix in deepspeed_export_envs())
    # launched from inside another checkout (DeepSpeed would put it first on the nodes' PYTHONPATH)
    (probed.cwd / "codegeex_train").mkdir()
    (probed.cwd / "codegeex_train" / "__init__.py").write_text("")
    probed.calls.unlink(missing_ok=True)
    proc = probed.run(DEVICE="cpu", HOSTFILE=str(hostfile), OUTPUT_DIR=str(tmp_path / "out"))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "holds another copy of codegeex_train" in lines[0], lines
    assert not probed.calls.exists()


def deepspeed_export_envs() -> list[str]:
    """DeepSpeed's multi-node runner's EXPORT_ENVS (the variable-name prefixes pdsh exports to every node), read from
    its source: importing it would import torch and all of DeepSpeed."""
    spec = importlib.util.find_spec("deepspeed")
    runner = Path(spec.submodule_search_locations[0]) / "launcher" / "runner.py"
    for node in ast.parse(runner.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXPORT_ENVS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no EXPORT_ENVS in {runner}")
