"""Tokenizers: round trips, whitespace encoding, the three file formats, errors, training tool."""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegeex_train.preprocessing.default_corpus import default_corpus_files, stdlib_source_dir
from codegeex_train.tokenization.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    EOD_TOKEN,
    TOKENIZER_TYPES,
    build_tokenizer,
    check_tokenizer_fits_vocab,
    default_tokenizer,
    load_tokenizer,
)
from codegeex_train.tokenization.whitespace import (
    split_whitespace_runs,
    whitespace_token,
    whitespace_tokens,
)

REPO = Path(__file__).resolve().parents[2]
CODE = 'def f(x):\n    if x:\n        return "a  b"\n    return None\n\n\nclass A:\n    pass\n'


def _load_train_tool():
    path = REPO / "tools" / "train_tokenizer.py"
    spec = importlib.util.spec_from_file_location("train_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_tokenizer", module)
    spec.loader.exec_module(module)
    return module


train_tool = _load_train_tool()


@pytest.fixture(scope="module")
def small_corpus() -> list[str]:
    """About 150 kB of stdlib Python: enough for a 400-id BPE in well under a second."""
    return [str(p) for p in default_corpus_files(limit_bytes=150_000)]


@pytest.fixture(scope="module")
def plain_bpe_path(tmp_path_factory, small_corpus) -> str:
    """A tiny tokenizer.json without the whitespace tokens."""
    path = str(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
    train_tool.train_bpe_tokenizer(
        small_corpus, 400, path, whitespace_tokens_max_run=None, show_progress=False
    )
    return path


# ---- whitespace splitting (pure) ----


@pytest.mark.parametrize(
    "text, parts",
    [
        ("", []),
        ("a b", ["a b"]),
        ("a  b", ["a", 2, "b"]),
        ("    x", [4, "x"]),
        ("x" + " " * 11 + "y", ["x", 10, " y"]),
        ("x" + " " * 12, ["x", 10, 2]),
        (" " * 21, [10, 10, " "]),
        ("\t  \n", ["\t", 2, "\n"]),
    ],
)
def test_split_whitespace_runs(text, parts):
    assert split_whitespace_runs(text, max_run=10) == parts


@given(st.text(alphabet=" \n\ta", max_size=60), st.integers(2, 12))
def test_split_whitespace_runs_joins_back(text, max_run):
    parts = split_whitespace_runs(text, max_run)
    assert "".join(p if isinstance(p, str) else " " * p for p in parts) == text
    assert all(2 <= p <= max_run for p in parts if isinstance(p, int))


def test_whitespace_tokens_match_codegeex():
    assert whitespace_token(2) == "<|extratoken_10|>"
    assert whitespace_tokens()[-1] == "<|extratoken_18|>"
    with pytest.raises(ValueError):
        split_whitespace_runs("a", max_run=1)


# ---- the shipped default tokenizer ----


def test_default_tokenizer_file():
    assert os.path.getsize(DEFAULT_TOKENIZER_PATH) < 1_000_000
    tok = default_tokenizer()
    plain = default_tokenizer(whitespace_encoding=False)
    # The file already holds <|endoftext|> and the whitespace tokens: nothing is appended.
    assert tok.vocab_size == plain.vocab_size == 8192
    added = {t["content"]: t["id"] for t in json.load(open(DEFAULT_TOKENIZER_PATH))["added_tokens"]}
    assert added.keys() == {EOD_TOKEN, *whitespace_tokens()}
    assert tok.eod == plain.eod == added[EOD_TOKEN]
    assert tok.encode("a    b")[1] == added[whitespace_token(4)]


# Literal special-token strings too: they must stay plain text.
TEXT = st.lists(
    st.sampled_from([*" \n\tabxyz_:é🚀", EOD_TOKEN, whitespace_token(3)]), max_size=80
).map("".join)


@pytest.fixture(scope="module")
def default_pair():
    return default_tokenizer(), default_tokenizer(whitespace_encoding=False)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_default_tokenizer_round_trip(default_pair, text):
    for tok in default_pair:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_token_text_is_plain_text():
    tok = default_tokenizer()
    text = f"a{EOD_TOKEN}  b{whitespace_token(2)}"
    ids = tok.encode(text)
    (two_spaces,) = tok.encode("  ")
    assert tok.eod not in ids and ids.count(two_spaces) == 1
    assert tok.decode(ids) == text
    assert tok.decode([tok.eod]) == EOD_TOKEN


def test_eod_and_sentinels_are_special_whatever_the_file_says(tmp_path):
    """A tokenizer.json whose <|endoftext|> and sentinels are added tokens marked non-special (the file's flag): their
    text in a document stays text, so it can fake neither a document boundary nor a FIM or repository sentinel."""
    backend = json.loads(Path(DEFAULT_TOKENIZER_PATH).read_text(encoding="utf-8"))
    backend["added_tokens"][0]["special"] = False  # <|endoftext|>
    names = ["<fim_prefix>", "<repo_name>", "<file_sep>", "<|extratoken_1|>"]
    backend["added_tokens"] += [{"id": 8192 + k, "content": name, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False}
                                for k, name in enumerate(names)]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(backend), encoding="utf-8")
    tok = build_tokenizer("HFTokenizer", str(path), whitespace_encoding=True)
    text = f"x = '{EOD_TOKEN}'\n# <fim_prefix> <repo_name>a<file_sep>b <|extratoken_1|>\n"
    ids = tok.encode(text)
    assert tok.eod == 0 and not {0, 8192, 8193, 8194, 8195} & set(ids), ids
    assert tok.decode(ids) == text and tok.vocab_size == 8196  # the file's ids kept
    assert [tok.decode([i]) for i in (0, 8192, 8195)] == [EOD_TOKEN, "<fim_prefix>", "<|extratoken_1|>"]


def test_whitespace_encoding_on_real_python_source():
    tok, plain = default_tokenizer(), default_tokenizer(whitespace_encoding=False)
    root = stdlib_source_dir()
    names = ("argparse.py", "textwrap.py", "json/decoder.py")
    sources = [(root / name).read_text(encoding="utf-8") for name in names]
    sources.append(Path(__file__).read_text(encoding="utf-8"))  # code the tokenizer never saw
    encoded = tok.encode_batch(sources)
    for text, ids in zip(sources, encoded):
        assert tok.decode(ids) == text
        assert plain.decode(plain.encode(text)) == text
        assert len(ids) < 0.9 * len(plain.encode(text))
    assert encoded == [tok.encode(text) for text in sources]


def test_whitespace_encoding_appends_missing_tokens(plain_bpe_path):
    plain = build_tokenizer("HFTokenizer", tokenizer_model=plain_bpe_path)
    tok = build_tokenizer(
        "HFTokenizer", plain_bpe_path, whitespace_encoding=True, max_whitespace_run=6
    )
    assert plain.vocab_size == 400
    assert tok.vocab_size == 400 + 5  # runs of 2..6
    ids = tok.encode(CODE + " " * 13 + "z")
    assert max(ids) >= 400
    assert tok.decode(ids) == CODE + " " * 13 + "z"


@pytest.fixture(scope="module")
def tiny_ws_tokenizer(plain_bpe_path):
    return build_tokenizer("HFTokenizer", tokenizer_model=plain_bpe_path, whitespace_encoding=True)


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_tiny_tokenizer_whitespace_round_trip(tiny_ws_tokenizer, text):
    assert tiny_ws_tokenizer.decode(tiny_ws_tokenizer.encode(text)) == text


# ---- GPT-2 files and SentencePiece ----


def test_gpt2_bpe_files_match_tokenizer_json(tmp_path, plain_bpe_path):
    import tokenizers

    original = tokenizers.Tokenizer.from_file(plain_bpe_path)
    vocab_file, merge_file = original.model.save(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    reference = build_tokenizer("HFTokenizer", tokenizer_model=plain_bpe_path)
    assert tok.encode(CODE) == reference.encode(CODE)
    assert tok.decode(tok.encode(CODE + "é🚀")) == CODE + "é🚀"
    assert tok.eod == reference.eod and tok.vocab_size == reference.vocab_size
    ws = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file, whitespace_encoding=True
    )
    assert ws.decode(ws.encode(CODE)) == CODE


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    try:
        import sentencepiece
    except ImportError as err:  # a dev dependency: fail, never skip, so CI cannot pass without it
        pytest.fail(f"sentencepiece is not importable ({err}); `make env` installs it (pip install -e .[dev])",
                    pytrace=False)
    root = tmp_path_factory.mktemp("sp")
    files = default_corpus_files(limit_bytes=60_000)
    lines = [line for p in files for line in p.read_text().splitlines() if line.strip()]
    (root / "corpus.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"),
        model_prefix=str(root / "sp"),
        vocab_size=400,
        # Keep whitespace as is, so whitespace encoding can round-trip exactly.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        byte_fallback=True,
        minloglevel=2,
    )
    return str(root / "sp.model")


def test_sentencepiece_tokenizer(sentencepiece_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert tok.vocab_size == 400
    assert tok.eod == 2  # SentencePiece's </s>
    ids = tok.encode("return x")
    assert tok.decode(ids) == "return x" and max(ids) < 400
    assert tok.encode_batch(["a", "return x"])[1] == ids
    ws = build_tokenizer("SentencePieceTokenizer", sentencepiece_model, whitespace_encoding=True)
    assert ws.vocab_size == 409
    ids = ws.encode(CODE)
    assert ws.decode(ids) == CODE and max(ids) < 409


# ---- errors ----


def test_unknown_tokenizer_type_lists_valid_ones():
    with pytest.raises(ValueError, match="BertWordPiece") as err:
        build_tokenizer("BertWordPiece")
    assert all(name in str(err.value) for name in TOKENIZER_TYPES)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(tokenizer_type="HFTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="GPT2BPETokenizer", merge_file="m.txt"), "--vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=__file__), "--merge-file"),
    ],
)
def test_tokenizer_file_not_given(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        build_tokenizer(**kwargs)


def test_tokenizer_file_missing(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model") as err:
        build_tokenizer("HFTokenizer", tokenizer_model=missing)
    assert missing in str(err.value)
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=DEFAULT_TOKENIZER_PATH, merge_file=missing)


def test_a_hugging_face_tokenizer_directory_is_a_tokenizer_model(tmp_path, sentencepiece_model):
    """--tokenizer-model takes the directory save_pretrained writes (tokenizer.json beside its configs) wherever it
    takes a tokenizer file: the ids are the file's."""
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (hf / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    by_dir = build_tokenizer("HFTokenizer", str(hf), whitespace_encoding=True)
    assert by_dir.encode(CODE) == default_tokenizer().encode(CODE) and by_dir.vocab_size == 8192
    flags = SimpleNamespace(tokenizer_type="HFTokenizer", tokenizer_model=str(hf), vocab_file=None, merge_file=None,
                            whitespace_encoding=True, fim_rate=0.5)
    assert load_tokenizer(flags).vocab_size == 8198  # training's, with FIM's sentinels
    sp = tmp_path / "sp"
    sp.mkdir()
    shutil.copy(sentencepiece_model, sp / "tokenizer.model")
    assert build_tokenizer("SentencePieceTokenizer", str(sp)).encode(CODE) == build_tokenizer(
        "SentencePieceTokenizer", sentencepiece_model).encode(CODE)
    with pytest.raises(ValueError, match=f"--tokenizer-model {tmp_path}: a directory without tokenizer.json"):
        build_tokenizer("HFTokenizer", str(tmp_path))


def test_check_tokenizer_fits_vocab():
    tok = default_tokenizer()
    check_tokenizer_fits_vocab(tok, 8192)
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by") as err:
        check_tokenizer_fits_vocab(tok, 8000)
    assert "8192" in str(err.value) and "8000" in str(err.value)


def test_train_tool_main(tmp_path, capsys):
    lines = [json.dumps({"content": CODE.replace("x", w)}) for w in ("alpha", "beta", "gamma")]
    (tmp_path / "code.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out" / "tok.json"
    train_tool.main(["--input", str(tmp_path / "code.jsonl"), "--json-key", "content",
                     "--vocab-size", "300", "--output", str(out), "--min-frequency", "1"])
    summary = capsys.readouterr().out
    assert "vocab size 300" in summary and "3 documents" in summary and " MB" in summary
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(out), whitespace_encoding=True)
    assert tok.vocab_size == 300
    assert tok.decode(tok.encode(CODE)) == CODE


def test_train_bpe_tokenizer_summary(tmp_path, small_corpus):
    path = str(tmp_path / "t.json")
    summary = train_tool.train_bpe_tokenizer(small_corpus[:3], 320, path, show_progress=False)
    assert summary.vocab_size == 320
    assert summary.documents == 3
    assert summary.file_bytes == os.path.getsize(path)
    assert summary.corpus_bytes == sum(len(Path(p).read_bytes()) for p in small_corpus[:3])
