"""Suite-wide environment (CPU DeepSpeed with a per-checkout JIT cache, nothing from the network) and the
fixture every end-to-end test uses: a tiny preprocessed corpus (a slice of the Python stdlib with the shipped
tokenizer). DeepSpeed's one CPU JIT op (an inference-only all-reduce) is never built: pretrain.py skips it."""

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

# Spawned ranks inherit these. Any DeepSpeed JIT build (none in training) would land in this checkout's cache.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# gloo binds to the address the host name resolves to unless told otherwise: keep every test on loopback.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    from codegeex_train.data.default_corpus import default_corpus_files  # after the environment above
    from codegeex_train.data.preprocess import TokenizerSpec, preprocess

    out = tmp_path_factory.mktemp("data") / "stdlib"
    files = default_corpus_files()[:60]
    summary = preprocess(files, str(out), TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1,
                         progress=False)
    return summary.output_prefixes[0]
