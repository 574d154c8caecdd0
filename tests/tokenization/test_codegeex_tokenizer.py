"""CodeGeeX's tokenizer (--tokenizer-type CodeGeeXTokenizer) against the codegeex 1.0 package's own
CodeGeeXTokenizer (codegeex/tokenizer/tokenizer.py) on the same files.

GPT-2's vocabulary cannot be downloaded here, so the files are a small GPT-2-style byte-level BPE with GPT-2's
structure, laid out as EleutherAI/gpt-j-6B's tokenizer directory (what CodeGeeX loads with
``AutoTokenizer.from_pretrained``): vocab.json (byte alphabet, merges, then ``<|endoftext|>`` as the last id),
merges.txt, added_tokens.json (``<|extratoken_X|>`` at ``<|endoftext|>``'s id + X, X = 1..143),
special_tokens_map.json, tokenizer_config.json. The package is a test dependency (``make env``); without it
these tests fail, they do not skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegeex_train.config.arguments import parse_args
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.tokenization.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    TokenizerError,
    build_tokenizer,
    codegeex_extra_tokens,
    load_tokenizer,
)
from codegeex_train.tokenization.whitespace import split_whitespace_runs, whitespace_token
from tests.harness import codegeex_reference

THEIR_TOKENIZER = "codegeex.tokenizer.tokenizer"  # the original package's tokenizer: the reference

EXTRA = 143
CODE = ('import os\n\n\nclass Walker:\n    """Walk  a tree."""\n\n    def __init__(self, root):\n'
        '        self.root = root  # two  spaces\n        if root:\n            for name in os.listdir(root):\n'
        '                print(name,   "x" * 3)\n\t\treturn None\n    \n' + " " * 23 + "deep = [1,  2]\n"
        "x = 'é ü  ☃'\r\n  \n" + " " * 10 + "end" + " " * 11 + "\n")


@pytest.fixture(scope="module")
def gptj_dir(tmp_path_factory) -> Path:
    """A GPT-2-style vocabulary laid out as EleutherAI/gpt-j-6B's tokenizer files."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("gptj")
    texts = [p.read_text(encoding="utf-8") for p in default_corpus_files(limit_bytes=60_000)]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=[], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(out))  # vocab.json + merges.txt ("#version: 0.2" header, as GPT-2's)
    vocab = json.loads((out / "vocab.json").read_text())
    eod = vocab["<|endoftext|>"] = len(vocab)  # GPT-2: 50256, the last id
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "added_tokens.json").write_text(json.dumps({t: eod + i for i, t in enumerate(codegeex_extra_tokens(), 1)}))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special))
    (out / "tokenizer_config.json").write_text(json.dumps({**special, "add_prefix_space": False,
                                                           "model_max_length": 2048,
                                                           "tokenizer_class": "GPT2Tokenizer"}))
    return out


@pytest.fixture(scope="module")
def theirs(gptj_dir):
    """The package's tokenizer, loaded its own way (AutoTokenizer.from_pretrained of the directory)."""
    return codegeex_reference(THEIR_TOKENIZER).CodeGeeXTokenizer(tokenizer_path=str(gptj_dir))


@pytest.fixture(scope="module")
def fast_json(gptj_dir, tmp_path_factory) -> Path:
    """The same tokenizer as one tokenizer.json (what save_pretrained of GPT-J's tokenizer writes)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("gptj_fast")
    AutoTokenizer.from_pretrained(str(gptj_dir)).save_pretrained(str(out))
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def from_directory(gptj_dir):
    return build_tokenizer("CodeGeeXTokenizer", tokenizer_model=str(gptj_dir))


SOURCES = ["vocab_merge_files", "hf_directory", "tokenizer_json", "directory_with_tokenizer_json"]


def ours(source: str, gptj_dir: Path, fast_json: Path):
    if source == "vocab_merge_files":
        return build_tokenizer("CodeGeeXTokenizer", vocab_file=str(gptj_dir / "vocab.json"),
                               merge_file=str(gptj_dir / "merges.txt"))
    path = {"hf_directory": gptj_dir, "tokenizer_json": fast_json, "directory_with_tokenizer_json": fast_json.parent}
    return build_tokenizer("CodeGeeXTokenizer", tokenizer_model=str(path[source]))


@pytest.mark.parametrize("source", SOURCES)
def test_encodes_and_decodes_code_exactly_like_codegeex(source, gptj_dir, fast_json, theirs):
    tok = ours(source, gptj_dir, fast_json)
    for text in (CODE, CODE.replace("    ", "  "), "", " ", "  ", "a" + " " * 21 + "b", "\n" * 3 + "  x"):
        ids = tok.encode(text)
        assert ids == theirs.encode_code(text), repr(text)
        assert tok.decode(ids) == theirs.decode_code(ids) == text, repr(text)
    assert tok.encode_batch([CODE, "  x"]) == [theirs.encode_code(CODE), theirs.encode_code("  x")]


@pytest.mark.parametrize("source", SOURCES)
def test_vocabulary_layout_is_gpt_j_s(source, gptj_dir, fast_json, theirs):
    tok = ours(source, gptj_dir, fast_json)
    eod = theirs.eos_token_id
    assert tok.eod == eod and tok.vocab_size == eod + 1 + EXTRA == len(theirs.tokenizer)
    hf = theirs.tokenizer
    assert hf.convert_tokens_to_ids(codegeex_extra_tokens()) == list(range(eod + 1, eod + 1 + EXTRA))
    # Runs of 2..10 spaces are <|extratoken_10|>..<|extratoken_18|> = eod + 10 .. eod + 18.
    assert [tok.encode(" " * n) for n in range(2, 11)] == [[eod + 8 + n] for n in range(2, 11)]
    assert [whitespace_token(n) for n in range(2, 11)] == codegeex_extra_tokens()[9:18]


def test_codegeex_13b_vocabulary_pads_to_52224():
    # GPT-2's 50,257 ids + 143 extra tokens = 50,400 (GPT-J's); CodeGeeX-13B's word table has 52,224 rows.
    config = ModelConfig(vocab_size=50257 + EXTRA, make_vocab_size_divisible_by=52224)
    assert config.padded_vocab_size == 52224 and 52224 % 8 == 0
    assert ModelConfig(vocab_size=50257 + EXTRA).padded_vocab_size == 50432  # the default 128 does not


def test_pretraining_flags_load_it(gptj_dir, theirs):
    args = parse_args(["--tokenizer-type", "CodeGeeXTokenizer", "--vocab-file", str(gptj_dir / "vocab.json"),
                       "--merge-file", str(gptj_dir / "merges.txt"), "--data-path", "unused"])
    tok = load_tokenizer(args.data)
    assert tok.encode(CODE) == theirs.encode_code(CODE) and tok.decode(tok.encode(CODE)) == CODE
    args = parse_args(["--tokenizer-type", "CodeGeeXTokenizer", "--tokenizer-model", str(gptj_dir),
                       "--whitespace-encoding", "--data-path", "unused"])  # already on: not applied twice
    assert load_tokenizer(args.data).encode(CODE) == theirs.encode_code(CODE)


# --- The whitespace encoding itself ---------------------------------------------------------------------

def _rendered(text: str) -> str:
    """Our split of ``text`` into pieces and runs, written out as CodeGeeX's encode_whitespaces writes it."""
    return "".join(p if isinstance(p, str) else whitespace_token(p) for p in split_whitespace_runs(text, 10))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from([" ", " ", " ", "a", "\n", "\t", "é", "<"]), max_size=80))
def test_whitespace_runs_split_exactly_as_codegeex_replaces_them(text):
    assert _rendered(text) == codegeex_reference(THEIR_TOKENIZER).encode_whitespaces(text, 10, 10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([" ", " ", "x", "if", "(", ")", ":", "\n", "\t", "é", "#"]), max_size=60).map("".join))
def test_random_code_like_text_gives_codegeex_s_ids(from_directory, theirs, text):
    assert from_directory.encode(text) == theirs.encode_code(text)
    assert from_directory.decode(from_directory.encode(text)) == text


def test_text_spelling_out_a_special_token_stays_text(gptj_dir, theirs):
    # The one deliberate difference: CodeGeeX's tokenizer reads a literal "<|extratoken_12|>" or "<|endoftext|>"
    # in a document as that token (so its decode turns the first into spaces); ours encodes them as text, so a
    # document can neither fake a document boundary nor lose its exact round trip.
    tok = build_tokenizer("CodeGeeXTokenizer", tokenizer_model=str(gptj_dir))
    text = "s = '<|extratoken_12|>'  # <|endoftext|>"
    assert tok.eod not in tok.encode(text) and tok.decode(tok.encode(text)) == text
    assert theirs.eos_token_id in theirs.encode_code(text) and theirs.decode_code(theirs.encode_code(text)) != text


# --- Errors ---------------------------------------------------------------------------------------------

def test_a_vocabulary_without_codegeex_s_layout_is_refused(tmp_path, gptj_dir):
    with pytest.raises(TokenizerError, match="not CodeGeeX's vocabulary"):
        build_tokenizer("CodeGeeXTokenizer", tokenizer_model=DEFAULT_TOKENIZER_PATH)  # ours: 8192 ids, no extras
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (shifted / name).write_bytes((gptj_dir / name).read_bytes())
    table = json.loads((gptj_dir / "added_tokens.json").read_text())
    (shifted / "added_tokens.json").write_text(json.dumps({t: i + 1 for t, i in table.items()}))  # a hole at eod+1
    with pytest.raises(TokenizerError, match="added_tokens.json.*should have id"):
        build_tokenizer("CodeGeeXTokenizer", tokenizer_model=str(shifted))
    with pytest.raises(TokenizerError, match="needs --vocab-file and --merge-file.*or --tokenizer-model"):
        build_tokenizer("CodeGeeXTokenizer")
    with pytest.raises(TokenizerError, match="needs --merge-file"):
        build_tokenizer("CodeGeeXTokenizer", vocab_file=str(gptj_dir / "vocab.json"))
    with pytest.raises(TokenizerError, match="without tokenizer.json or vocab.json"):
        build_tokenizer("CodeGeeXTokenizer", tokenizer_model=str(tmp_path))
