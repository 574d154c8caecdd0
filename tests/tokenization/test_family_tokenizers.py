"""The tokenizers of the model families (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder) as Hugging Face directories
(tokenizer.json + tokenizer_config.json), built here small (a byte-level BPE trained on a slice of the stdlib) with
each family's special tokens at the end, as the published ones have them (no hub: the suite runs offline):

- ``--tokenizer-model DIR`` gives the family's eos as the end-of-document id (DeepSeek-Coder's
  ``<｜end▁of▁sentence｜>``; no ``<|endoftext|>`` appended) and finds the family's code sentinels by their names,
  appending only those the family lacks (DeepSeek-Coder: pad, repository and file tokens, StarCoder's names);
- FIM lays a document out in the family's sentinels (PSM and SPM), text spelling them stays text;
- repository documents open with the family's repository token and separate files with its file token
  (--repo-format qwen2.5-coder: Qwen2.5-Coder's documented layout), and preprocessing ends each with the family's
  eos, also through a tokenizer that grew (saved as a directory naming that eos);
- transformers' AutoTokenizer reads the same directory to the same ids; an import records the directory and, the
  family's FIM sentinels being there, infilling in PSM with them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from codegeex_train.config.arguments import DataConfig
from codegeex_train.data.fim import FIM
from codegeex_train.preprocessing.repo_documents import REPO_FORMATS, Repository, encode_repository
from codegeex_train.preprocessing.source_files import SourceFile
from codegeex_train.tokenization.code_tokens import SENTINELS, code_tokens, held_code_tokens, sentinel_family
from codegeex_train.tokenization.tokenizer import load_tokenizer
from tests.tokenization.family_tokenizers import FAMILIES, write_family_tokenizer

TEXT = "def add(a, b):\n    # the sum\n    return a + b\n\n\nclass Point:\n    x: int = 0\n"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family name, its directory, the file's own ids of its special tokens, the file's vocabulary size)."""
    import tokenizers

    directory = write_family_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = {t: raw.token_to_id(t) for t in FAMILIES[request.param][0]}
    return request.param, directory, ids, raw.get_vocab_size(with_added_tokens=True)


def flags(directory: Path, **fim) -> DataConfig:
    return DataConfig(tokenizer_type="HFTokenizer", tokenizer_model=str(directory), whitespace_encoding=False, **fim)


def test_the_directory_gives_the_family_eos_and_sentinels(family):
    name, directory, ids, vocab = family
    _, eos, names = FAMILIES[name]
    tok = load_tokenizer(flags(directory))
    assert tok.eod == ids[eos] and tok.vocab_size == vocab  # nothing appended: <|endoftext|> only where it is eos
    assert sentinel_family(tok) == (None if name == "starcoder2" else name)
    tokens = code_tokens(tok)
    for sentinel, field in zip(SENTINELS, ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad", "repo_name",
                                           "file_sep")):
        if sentinel in names:
            assert getattr(tokens, field) == ids[names[sentinel]], (name, sentinel)
    missing = [s for s in SENTINELS if s not in names]  # DeepSeek-Coder's: appended in order after its ids
    assert [getattr(tokens, s.strip("<>")) for s in missing] == list(range(vocab, vocab + len(missing)))
    assert tok.vocab_size == vocab + len(missing) and code_tokens(tok) == tokens  # idempotent
    # --fim-rate loads the same: the tokenizer training and preprocessing build agree on every id
    assert held_code_tokens(load_tokenizer(flags(directory, fim_rate=0.5))) == tokens


@pytest.mark.parametrize("order", ["psm", "spm"])
def test_fim_lays_a_document_out_in_the_family_sentinels(family, order):
    name, directory, ids, _ = family
    names = FAMILIES[name][2]
    tok = load_tokenizer(flags(directory, fim_rate=1.0))
    tokens = held_code_tokens(tok)
    prefix, middle, suffix = (ids[names[s]] for s in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"))
    document = tok.encode(TEXT) + [tok.eod]
    sample = np.array(document + [tok.eod] * 8)
    fim = FIM(tok, tokens, rate=1.0, spm_rate=1.0 if order == "spm" else 0.0)
    out = fim.apply(sample, np.random.default_rng(3)).tolist()
    end = out.index(tok.eod)
    assert out[0] == prefix and out.count(prefix) == out.count(suffix) == out.count(middle) == 1
    s, m = out.index(suffix), out.index(middle)
    if order == "psm":  # <prefix> P <suffix> S <middle> M <eod>
        p_ids, s_ids, m_ids = out[1:s], out[s + 1:m], out[m + 1:end]
        assert 0 < s < m
    else:  # <prefix> <suffix> S <middle> P M <eod>
        assert s == 1 and m > s
        s_ids, pm_ids = out[2:m], out[m + 1:end]
        p_ids, m_ids = [], pm_ids
    assert tok.decode(p_ids) + tok.decode(m_ids) + tok.decode(s_ids) == TEXT
    # a document spelling a sentinel keeps it as text: no id of the family's sentinels comes out of encode
    assert set(tok.encode(names["<fim_prefix>"] + " x")).isdisjoint({prefix, middle, suffix})


def test_repository_documents_use_the_family_tokens_and_end_with_its_eos(family, tmp_path):
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
    from codegeex_train.preprocessing.repo_documents import DocumentSpec
    from codegeex_train.data.indexed_dataset import MMapIndexedDataset

    name, directory, ids, vocab = family
    fmt = "qwen2.5-coder" if name == "qwen2.5-coder" else "starcoder2"
    tok = load_tokenizer(flags(directory))
    tokens = code_tokens(tok)
    files = (SourceFile("import b\n", "octo/cat", "a.py", "Python", "a.py"),
             SourceFile("x = 1\n", "octo/cat", "b.py", "Python", "b.py"))
    document = encode_repository(tok, tokens, REPO_FORMATS[fmt], Repository("octo/cat", files))
    if name != "deepseek-coder":  # the family's own tokens, at the file's ids
        repo_name, file_sep = (FAMILIES[name][2][s] for s in ("<repo_name>", "<file_sep>"))
        assert (tokens.repo_name, tokens.file_sep) == (ids[repo_name], ids[file_sep])
        spelled = tok.decode(document)
        assert spelled == {"qwen2.5-coder": f"{repo_name}octo/cat\n{file_sep}a.py\nimport b\n{file_sep}b.py\nx = 1\n",
                           "starcoder2": f"{repo_name}octo/cat{file_sep}a.py\nimport b\n{file_sep}b.py\nx = 1\n"}[name]

    for path, text in (("octo/a.py", "import b\n"), ("octo/b.py", "x = 1\n")):
        (tmp_path / "src" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / path).write_text(text)
    summary = preprocess([str(tmp_path / "src" / "octo")], str(tmp_path / "out"),
                         TokenizerSpec("HFTokenizer", str(directory)), append_eod=True, workers=1, progress=False,
                         documents=DocumentSpec(level="repo", repo_format=fmt))
    (stored,) = [MMapIndexedDataset(summary.output_prefixes[0])[i].tolist() for i in range(1)]
    assert stored[0] == tokens.repo_name and stored[-1] == ids[FAMILIES[name][1]]  # the family's eos ends it
    if name == "deepseek-coder":  # it grew (repository tokens): saved as a directory that keeps the eos
        assert Path(summary.tokenizer_file).is_dir()
        again = load_tokenizer(flags(Path(summary.tokenizer_file)))
        assert again.eod == tok.eod and code_tokens(again) == tokens
    else:
        assert summary.tokenizer_file is None


def test_transformers_reads_the_directory_to_our_ids(family):
    from transformers import AutoTokenizer

    name, directory, ids, _ = family
    ours = load_tokenizer(flags(directory))
    theirs = AutoTokenizer.from_pretrained(directory)
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert theirs.eos_token_id == ours.eod


def test_an_import_records_the_directory_and_psm_infilling_in_the_family_sentinels(family, tmp_path):
    from codegeex_train.formats.huggingface.tokenizer import copy_hf_tokenizer, hf_tokenizer_settings
    from codegeex_train.generation.infill import fim_format

    name, directory, ids, _ = family
    settings = hf_tokenizer_settings(directory)
    assert settings["tokenizer_model"] == str(directory.resolve()) and settings["fim_rate"] > 0
    copy = copy_hf_tokenizer(directory, tmp_path / "tokenizer")
    assert sorted(p.name for p in copy.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = load_tokenizer(DataConfig(**{**settings, "tokenizer_model": str(copy)}))
    fmt = fim_format({"tokenizer": settings}, tok)
    names = FAMILIES[name][2]
    assert fmt.order == "psm"
    assert fmt.prompt_ids(tok, "a = ", "\n") == [ids[names["<fim_prefix>"]], *tok.encode("a = "),
                                                 ids[names["<fim_suffix>"]], *tok.encode("\n"),
                                                 ids[names["<fim_middle>"]]]
