"""Suite-wide environment (CPU DeepSpeed with a per-checkout JIT cache, nothing from the network, wandb's files in a
temporary directory of this session instead of under HOME) and the fixture every end-to-end test uses: a tiny
preprocessed corpus (a slice of the Python stdlib with the shipped tokenizer). DeepSpeed's one CPU JIT op (an
inference-only all-reduce) is never built: pretrain.py skips it. The harness the tests share is tests/harness.py."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
# The suite's harness is `tests.harness` (tests/harness.py), imported from the checkout's root: `python -m pytest` run
# there puts it on sys.path, a bare `pytest` does not. Spawned ranks get this sys.path.
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# Spawned ranks inherit these. Any DeepSpeed JIT build (none in training) would land in this checkout's cache.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# transformers copies an export's remote code (trust_remote_code) here, not into ~/.cache/huggingface/modules.
os.environ.setdefault("HF_MODULES_CACHE", str(_ROOT / ".cache" / "hf_modules"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# gloo binds to the address the host name resolves to unless told otherwise: keep every test on loopback.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# wandb keeps settings, caches, staging and artifacts under HOME (~/.config/wandb, ~/.cache/wandb,
# ~/.local/share/wandb) unless told otherwise: into this session's own directory, set before anything imports wandb
# (and overriding the caller's, which a test run must not touch either). Runs' own files go to their --save dirs.
_WANDB_ROOT = Path(tempfile.mkdtemp(prefix="codegeex-train-tests-wandb-"))
for _name, _sub in (("WANDB_DIR", "runs"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                    ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
    (_WANDB_ROOT / _sub).mkdir()
    os.environ[_name] = str(_WANDB_ROOT / _sub)


def pytest_unconfigure(config):
    shutil.rmtree(_WANDB_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    from codegeex_train.preprocessing.default_corpus import default_corpus_files  # after the environment above
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess

    out = tmp_path_factory.mktemp("data") / "stdlib"
    files = default_corpus_files()[:60]
    summary = preprocess(files, str(out), TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1,
                         progress=False)
    return summary.output_prefixes[0]


# --- Two tiers ------------------------------------------------------------------------------------------------
# `make test` (CI) runs everything. `make test-fast` (`pytest -m "not slow"`, < 5 min here) leaves out the tests
# marked `@pytest.mark.slow` where they are defined (a whole file: `pytestmark`; some cases of a parametrized test:
# `pytest.param(..., marks=pytest.mark.slow)`): the ones that take over ~4 s here (launchers, several gloo ranks
# training, whole-tool runs) except one end-to-end case of every feature, which stays fast: pipeline parity at
# (TP, PP, DP) = (1, 2, 1) and the broken tied-gradient hook, exact resume, the step against plain PyTorch at TP 1,
# the NaN stop at PP 2, one universal resume pair, HumanEval on a few tasks, a fine-tuning start and its relaunch, the
# tokenizer a checkpoint records, sequence-parallel parity at (2, 1, 1) with every recompute mode and the model at
# TP 2 with SP. `pytest --collect-only -q -m slow tests` lists the slow tier.


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast); see tests/conftest.py")

