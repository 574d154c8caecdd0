"""The tokenizer files of a Hugging Face export (formats/huggingface/tokenizer.py) against our own tokenizer as reference.

For each tokenizer kind we can build offline (the shipped default with whitespace encoding and FIM sentinels, the
default without whitespace encoding, GPT-2-style vocab.json + merges.txt with whitespace encoding, CodeGeeX's layout
from such files with FIM on its extra tokens): ``transformers.AutoTokenizer.from_pretrained`` of the written
directory, no remote code, must encode 300 stdlib files and the hostile strings below to exactly our ids and decode
them to exactly our text; ``hf_tokenizer_settings`` of the directory, loaded back as tools/generate.py loads a
checkpoint's tokenizer (``load_tokenizer(DataConfig(**settings))``), must give the same ids again. SentencePiece is
refused with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from codegeex_train.checkpoint.files import tokenizer_settings
from codegeex_train.formats.huggingface.tokenizer import hf_tokenizer_settings, save_hf_tokenizer
from codegeex_train.config.arguments import DataConfig
from codegeex_train.tokenization.code_tokens import SENTINELS, code_tokens
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, TokenizerError, load_tokenizer
from codegeex_train.tokenization.whitespace import whitespace_token

FIM = {"fim_rate": 0.5, "fim_spm_rate": 0.5, "fim_split_sample": None, "fim_fragment_rate": None}
# Runs of every length 1..100, alone and between text; indented lines around the run limits; tabs, line ends, other
# spaces, unicode, control characters; text spelling out eod, the sentinels and CodeGeeX's extra tokens.
HOSTILE = ([f"x{' ' * n}y" for n in range(1, 101)] + [" " * n for n in range(1, 101)]
           + [f"{' ' * n}def f():\n{' ' * n}\treturn  1{' ' * n}" for n in (1, 9, 10, 11, 19, 20, 21, 33)]
           + ["\t\t  \t", "a\r\n  b\r\n\r\n   ", "\u00a0 \u3000  \u2003", "é ü  ☃  😀 中文  x", "\x00 \x1b[0m  \x7f",
              "<|endoftext|>", "a<|endoftext|>  b", "  ".join(SENTINELS), "<|extratoken_1|> <|extratoken_143|>",
              whitespace_token(2) + whitespace_token(10), "<fim_prefix>  <fim_suffix>" + " " * 12 + "<fim_middle>",
              ""])


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """300 files spread over the stdlib, the first 2,000 characters of each (0.5 MB)."""
    files = default_corpus_files()
    return [p.read_text(encoding="utf-8")[:2000] for p in files[::len(files) // 300][:300]]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> Path:
    """A small GPT-2-style vocab.json + merges.txt: byte-level BPE, ``<|endoftext|>`` as the last id (GPT-2: 50256)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("gpt2")
    texts = [p.read_text(encoding="utf-8") for p in default_corpus_files(limit_bytes=60_000)]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=[], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(out))
    vocab = json.loads((out / "vocab.json").read_text())
    vocab["<|endoftext|>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab))
    return out


def _flags(**given) -> DataConfig:
    return DataConfig(**{"tokenizer_type": None, "tokenizer_model": None, "vocab_file": None, "merge_file": None,
                         "whitespace_encoding": False, **given})


# (flags, {"eos"/"bos": eod id, "sentinels": FIM sentinel names or None}, the model's config.json or None).
def _kinds(gpt2: Path) -> dict:
    files = {"vocab_file": str(gpt2 / "vocab.json"), "merge_file": str(gpt2 / "merges.txt")}
    extra = {"model_type": "codegeex", "auto_map": {"AutoConfig": "configuration_codegeex.CodeGeeXConfig"}}
    return {
        "default_whitespace_fim": (_flags(**FIM), 0, list(SENTINELS), extra),
        "default_plain": (_flags(tokenizer_type="HFTokenizer", tokenizer_model=DEFAULT_TOKENIZER_PATH), 0, None,
                          None),
        "gpt2_files_whitespace": (_flags(tokenizer_type="GPT2BPETokenizer", whitespace_encoding=True, **files),
                                  600, None, {"model_type": "gpt2"}),
        "codegeex_fim": (_flags(tokenizer_type="CodeGeeXTokenizer", **files, **FIM), 600,
                         [f"<|extratoken_{i}|>" for i in range(1, 7)], None),
    }


@pytest.mark.parametrize("kind", ["default_whitespace_fim", "default_plain", "gpt2_files_whitespace", "codegeex_fim"])
def test_auto_tokenizer_gives_our_ids_and_text(kind, corpus, gpt2_files, tmp_path):
    from transformers import AutoTokenizer

    flags, eod, sentinels, model_config = _kinds(gpt2_files)[kind]
    settings = tokenizer_settings(flags)
    ours = load_tokenizer(flags)
    assert ours.eod == eod
    if model_config is not None:  # what the model export writes beside it must not change the tokenizer's class
        (tmp_path / "config.json").write_text(json.dumps(model_config))
    assert save_hf_tokenizer(settings, tmp_path, 1024) == {"eos_token_id": eod, "bos_token_id": eod,
                                                           "pad_token_id": None}
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id) == (eod, eod, None)
    assert theirs.model_max_length == 1024 and len(theirs) == ours.vocab_size
    if sentinels is not None:  # present with the ids training gave them
        ids = [theirs.convert_tokens_to_ids(name) for name in sentinels]
        assert ids == list(vars(code_tokens(ours)).values())
        assert sorted(theirs.all_special_ids) == sorted({eod, *ids})

    texts = corpus + HOSTILE
    expected = ours.encode_batch(texts)
    got = theirs(texts, add_special_tokens=False)["input_ids"]
    assert got == expected  # (compared whole first: a failure shows the text, below)
    assert theirs(HOSTILE)["input_ids"] == expected[-len(HOSTILE):]  # no BOS/EOS added either (as GPT-2's)
    decoded = theirs.batch_decode(expected)
    assert decoded == [ours.decode(ids) for ids in expected]
    assert decoded == texts  # byte-level BPE: exact
    assert theirs.decode(expected[0], skip_special_tokens=True) == texts[0]  # the run tokens are not special
    assert theirs.decode(expected[0] + [eod]) == texts[0] + "<|endoftext|>" == ours.decode(expected[0] + [eod])
    rng = np.random.default_rng(0)  # any ids, split UTF-8 sequences and special tokens included
    noise = [rng.integers(0, ours.vocab_size, size=rng.integers(1, 40)).tolist() for _ in range(300)]
    assert theirs.batch_decode(noise) == [ours.decode(ids) for ids in noise]

    back = hf_tokenizer_settings(tmp_path)
    assert back["tokenizer_type"] == "HFTokenizer" and not back["whitespace_encoding"]
    assert {k: back.get(k) for k in FIM} == ({k: settings[k] for k in FIM} if "fim_rate" in settings else
                                             {k: None for k in FIM})
    reloaded = load_tokenizer(DataConfig(**back))  # as tools/generate.py loads a checkpoint's tokenizer
    assert (reloaded.eod, reloaded.vocab_size) == (eod, ours.vocab_size)
    assert reloaded.encode_batch(texts[-len(HOSTILE) - 50:]) == expected[-len(HOSTILE) - 50:]
    assert [reloaded.decode(ids) for ids in expected[-len(HOSTILE):]] == HOSTILE


def test_no_tokenizer_or_no_eod_gives_no_settings(tmp_path):
    assert hf_tokenizer_settings(tmp_path) is None  # a foreign model without tokenizer.json: the user's flags
    backend = json.loads(Path(DEFAULT_TOKENIZER_PATH).read_text())
    backend["added_tokens"] = [t for t in backend["added_tokens"] if t["content"] != "<|endoftext|>"]
    backend["model"]["vocab"]["</s>"] = backend["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(backend))
    assert hf_tokenizer_settings(tmp_path) is None  # its eos is not our eod: we would append a new, untrained one


def test_a_vocabulary_spelling_a_space_run_is_refused(tmp_path):
    backend = json.loads(Path(DEFAULT_TOKENIZER_PATH).read_text())
    backend["added_tokens"].append({"id": 8192, "content": "   ", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tok.json").write_text(json.dumps(backend))
    flags = _flags(tokenizer_type="HFTokenizer", tokenizer_model=str(tmp_path / "tok.json"), whitespace_encoding=True)
    with pytest.raises(TokenizerError, match="already has a token spelled as 3 spaces"):
        save_hf_tokenizer(tokenizer_settings(flags), tmp_path / "hf", 1024)
    assert not (tmp_path / "hf").exists()


def test_sentencepiece_is_refused(tmp_path):
    import sentencepiece

    lines = [line for p in default_corpus_files(limit_bytes=20_000) for line in p.read_text().splitlines() if line]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=200, minloglevel=2)
    flags = _flags(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    with pytest.raises(TokenizerError, match="cannot write a Hugging Face tokenizer.json for a SentencePiece"):
        save_hf_tokenizer(tokenizer_settings(flags), tmp_path / "hf", 1024)
    assert not (tmp_path / "hf").exists()
