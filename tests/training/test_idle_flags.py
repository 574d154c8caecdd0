"""Flags that would act on nothing in the data are refused before any process group (training/batches.py's
preflight, docs/bad-input.md): document masking on documents that hold no end-of-document token (preprocessed
without --append-eod), FIM on repository documents without --fim-split-sample (FIM leaves a segment holding a
sentinel whole: about 1 sample in 15 was transformed)."""

import functools

import pytest

from codegeex_train import pretrain
from codegeex_train.preprocessing.preprocess import DocumentSpec, TokenizerSpec, preprocess
from tests.harness import fails_with, tiny_model_args, write_indexed_dataset

MASKING = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
RUN = tiny_model_args() + ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--dry-run"]


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("repos")
    for r in range(3):
        (root / f"repo{r}" / "pkg").mkdir(parents=True)
        for f in range(4):
            (root / f"repo{r}" / "pkg" / f"m{f}.py").write_text(f"def f{f}(x):\n    return x * {f} + {r}\n" * 3)
    return [str(root / f"repo{r}") for r in range(3)]


@pytest.fixture(scope="module")
def data(repos, tmp_path_factory):
    """(level, repo format, --append-eod) -> the --data-path (and tokenizer) flags of ``repos`` preprocessed so."""
    out = tmp_path_factory.mktemp("data")

    @functools.cache
    def made(level: str, repo_format: str = "starcoder2", append_eod: bool = True) -> list[str]:
        prefix = out / f"{level}_{repo_format}_{int(append_eod)}"
        summary = preprocess(repos, str(prefix), TokenizerSpec(), append_eod=append_eod, progress=False,
                             documents=DocumentSpec(level, repo_format))
        tokenizer = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", summary.tokenizer_file] if (
            summary.tokenizer_file) else []
        return ("--data-path", summary.output_prefixes[0], *tokenizer)
    return made


@pytest.mark.parametrize("flags", [[flag] for flag in MASKING] + [MASKING])
def test_document_masking_on_data_without_an_end_of_document_token_is_refused(capsys, data, flags):
    line = fails_with(capsys, RUN + [*data("file", append_eod=False)] + flags, *flags, "would change nothing",
                      "no end-of-document token", "--append-eod")
    assert all(flag in line for flag in flags) and not any(f in line for f in MASKING if f not in flags)
    pretrain.prepare(RUN + [*data("file")] + flags)  # the same documents, each ending with EOD


def test_document_masking_on_ids_holding_eod_inside_documents_is_accepted(tmp_path):
    """Ids tokenized elsewhere may keep several documents in one, EOD between them but not at the end."""
    eod = TokenizerSpec().build().eod
    write_indexed_dataset(tmp_path / "packed", [[5, 6, eod, 7, 8], [9, eod, 10]])
    pretrain.prepare(RUN + ["--data-path", str(tmp_path / "packed"), *MASKING])


@pytest.mark.parametrize("repo_format", ["starcoder2", "codegeex4"])
def test_fim_on_repository_documents_without_a_split_sample_is_refused(capsys, data, repo_format):
    repo = [*data("repo", repo_format)]
    fails_with(capsys, RUN + repo + ["--fim-rate", "0.5"], "--fim-rate 0.5 would transform almost nothing",
               "repository documents", "--fim-split-sample <file_sep>")
    pretrain.prepare(RUN + repo + ["--fim-rate", "0.5", "--fim-split-sample", "<file_sep>"])
    pretrain.prepare(RUN + [*data("file")] + ["--fim-rate", "0.5"])  # file documents: FIM works on each
