"""A tokenizer's fingerprint (tokenization/record.py): what gives its ids their meaning, not where its file lies;
recorded beside each preprocessed dataset and in checkpoints, read back by the tools whether it is there or not."""

import json
import shutil
from types import SimpleNamespace

import pytest

from codegeex_train.checkpoint.files import check_same_tokenizer, checkpoint_tokenizer, tokenizer_settings
from codegeex_train.formats.huggingface.tokenizer import save_hf_tokenizer
from codegeex_train.config.arguments import ConfigError, DataConfig
from codegeex_train.tokenization.code_tokens import code_tokens
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.preprocessing.preprocess import DocumentSpec, TokenizerSpec, preprocess
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer, default_tokenizer, load_tokenizer
from codegeex_train.tokenization.record import (
    check_record,
    dataset_meta_path,
    fingerprint_record,
    mismatch,
    read_dataset_record,
    tokenizer_fingerprint,
)
from tests.harness import another_tokenizer


def _edited(tmp_path, change, name="tokenizer.json") -> str:
    backend = json.loads(open(DEFAULT_TOKENIZER_PATH, encoding="utf-8").read())
    change(backend)
    path = tmp_path / name
    path.write_text(json.dumps(backend), encoding="utf-8")
    return str(path)


def test_the_fingerprint_is_of_the_vocabulary_not_the_path(tmp_path):
    shipped = tokenizer_fingerprint(default_tokenizer())
    assert len(shipped) == 16 and int(shipped, 16) >= 0
    hf_dir = tmp_path / "somewhere" / "hf"
    hf_dir.mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER_PATH, hf_dir / "tokenizer.json")
    (hf_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    pretty = _edited(tmp_path, lambda b: None, "pretty.json")  # another file layout, the same tokenizer
    for same in (build_tokenizer("HFTokenizer", str(hf_dir), whitespace_encoding=True),
                 build_tokenizer("HFTokenizer", str(hf_dir / "tokenizer.json")),  # its whitespace tokens are in it
                 build_tokenizer("HFTokenizer", pretty)):
        assert tokenizer_fingerprint(same) == shipped


def test_every_difference_in_ids_merges_or_special_tokens_changes_it(tmp_path):
    shipped = tokenizer_fingerprint(default_tokenizer())

    def drop_merge(backend):
        backend["model"]["merges"].pop(100)

    def unspecial_extra(backend):  # a whitespace token (not a sentinel): the file's flag stands
        backend["added_tokens"][3]["special"] = False

    others = [another_tokenizer(tmp_path / "swapped"), _edited(tmp_path, drop_merge, "merges.json"),
              _edited(tmp_path, unspecial_extra, "special.json")]
    fingerprints = {tokenizer_fingerprint(build_tokenizer("HFTokenizer", path)) for path in others}
    assert len(fingerprints) == 3 and shipped not in fingerprints


def test_appended_tokens_leave_the_older_ids_fingerprint(tmp_path):
    """--fim-rate appends the sentinels after preprocessing: the data's ids still mean what they meant."""
    plain = build_tokenizer("HFTokenizer", DEFAULT_TOKENIZER_PATH)
    record = fingerprint_record(plain)
    assert record == {"fingerprint": tokenizer_fingerprint(plain), "vocab_size": 8192}
    code_tokens(plain)
    assert plain.vocab_size == 8198 and tokenizer_fingerprint(plain) != record["fingerprint"]
    assert mismatch(record, plain) is None
    assert mismatch(fingerprint_record(plain), default_tokenizer()) == "has only 8192 ids"
    other = build_tokenizer("HFTokenizer", another_tokenizer(tmp_path))
    assert mismatch(record, other) == f"has fingerprint {tokenizer_fingerprint(other)} over those ids"


def test_sentencepiece_fingerprint(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    root = tmp_path / "sp"
    root.mkdir()
    text = "\n".join(line for p in default_corpus_files(limit_bytes=30_000) for line in p.read_text().splitlines())
    (root / "corpus.txt").write_text(text)
    sentencepiece.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "tokenizer"),
                                             vocab_size=300, minloglevel=2)
    plain = build_tokenizer("SentencePieceTokenizer", str(root / "tokenizer.model"))
    by_dir = build_tokenizer("SentencePieceTokenizer", str(root))  # a Hugging Face directory holding tokenizer.model
    assert tokenizer_fingerprint(plain) == tokenizer_fingerprint(by_dir)
    with_ws = build_tokenizer("SentencePieceTokenizer", str(root), whitespace_encoding=True)  # ids reserved above
    assert mismatch(fingerprint_record(plain), with_ws) is None
    assert tokenizer_fingerprint(with_ws) != tokenizer_fingerprint(plain)


@pytest.mark.parametrize("record", [[], {"fingerprint": "xyz", "vocab_size": 8}, {"fingerprint": "0" * 16},
                                    {"fingerprint": "0" * 16, "vocab_size": True}])
def test_a_malformed_record_is_named(record):
    with pytest.raises(ValueError, match="where: its tokenizer record is malformed"):
        check_record(record, "where")
    assert check_record({"tokenizer_type": None}, "where") is None  # written before fingerprints


def test_preprocessing_records_the_tokenizer_beside_each_dataset(tmp_path):
    files = default_corpus_files()[:3]
    summary = preprocess(files, str(tmp_path / "file"), TokenizerSpec(whitespace_encoding=True), progress=False)
    record = read_dataset_record(summary.output_prefixes[0])
    assert record == {"tokenizer_type": "HFTokenizer", "tokenizer_model": DEFAULT_TOKENIZER_PATH, "vocab_file": None,
                      "merge_file": None, "whitespace_encoding": True, **fingerprint_record(default_tokenizer())}
    # Repository documents with a tokenizer lacking the sentinels: the record names the tokenizer saved with them
    plain = another_tokenizer(tmp_path / "tok")
    summary = preprocess(files, str(tmp_path / "repo"), TokenizerSpec(tokenizer_model=plain), progress=False,
                         documents=DocumentSpec(level="repo"))
    record = read_dataset_record(summary.output_prefixes[0])
    assert record["tokenizer_model"] == str(tmp_path / "repo_tokenizer.json") == summary.tokenizer_file
    assert mismatch(record, build_tokenizer("HFTokenizer", summary.tokenizer_file)) is None
    assert mismatch(record, build_tokenizer("HFTokenizer", plain)) == "has only 8192 ids"


def test_reading_a_dataset_record(tmp_path):
    prefix = str(tmp_path / "d")
    assert read_dataset_record(prefix) is None  # preprocessed before records: nothing to check
    for text, what in (("{", "not JSON"), ("[1]", "not a JSON object"), ('{"tokenizer": 3}', "malformed"),
                       (" " * (1 << 17), "larger than 64 KiB")):
        open(dataset_meta_path(prefix), "w").write(text)
        with pytest.raises(ValueError, match=what):
            read_dataset_record(prefix)


@pytest.mark.parametrize("fim", [0.0, 0.5])
def test_tools_read_new_and_legacy_checkpoint_records(tmp_path, fim):
    """tools/generate.py and evaluate_humaneval.py (checkpoint_tokenizer) and the Hugging Face export read a record
    with a fingerprint as one without."""
    flags = DataConfig(fim_rate=fim)
    tokenizer = load_tokenizer(flags)
    new = tokenizer_settings(flags, tokenizer)
    assert new["fingerprint"] == tokenizer_fingerprint(tokenizer) and new["vocab_size"] == tokenizer.vocab_size
    legacy = tokenizer_settings(flags)
    assert "fingerprint" not in legacy
    for settings in (new, legacy):
        chosen, _ = checkpoint_tokenizer("ckpt", {"tokenizer": settings}, {})
        assert tokenizer_fingerprint(load_tokenizer(SimpleNamespace(**chosen))) == new["fingerprint"]
        save_hf_tokenizer(settings, tmp_path / f"hf{'new' if settings is new else 'legacy'}", 64)


def test_the_resume_check(tmp_path):
    """check_same_tokenizer, which pretrain runs on what --load's checkpoint records: the same first ids pass (FIM's
    sentinels appended after them, when the padding has rows for them); fewer ids, other ids or a malformed record
    are one ConfigError naming the flags to pass; no fingerprint (an older or converted checkpoint) passes."""
    plain, fim = DataConfig(), DataConfig(fim_rate=0.5)
    recorded = tokenizer_settings(plain, load_tokenizer(plain))
    check_same_tokenizer(recorded, load_tokenizer(fim), fim, "--load ckpt (iter_0000002)")
    for legacy in (None, tokenizer_settings(plain)):
        check_same_tokenizer(legacy, build_tokenizer("HFTokenizer", another_tokenizer(tmp_path)), plain, "x")
    with pytest.raises(ConfigError, match=r"^--load ckpt \(iter_0000002\) was trained with another tokenizer than "
                                          r"this run's: the shipped default \(with whitespace encoding\), "
                                          r"fingerprint [0-9a-f]{16}, 8198 ids; this run's is the shipped default "
                                          r"\(with whitespace encoding\), which has only 8192 ids: pass no tokenizer "
                                          r"flags \(the shipped default\) with --fim-rate above 0 \(its FIM "
                                          r"sentinels\), as the run"):
        check_same_tokenizer(tokenizer_settings(fim, load_tokenizer(fim)), load_tokenizer(plain), plain,
                             "--load ckpt (iter_0000002)")
    with pytest.raises(ConfigError, match="where: its tokenizer record is malformed"):
        check_same_tokenizer({**recorded, "vocab_size": "8192"}, load_tokenizer(plain), plain, "where")
