"""Completion text: stop strings cut where they should (and end a row's decoding), whitespace tokens come out
as spaces, the end-of-document id ends a row. A scripted model plays a known continuation per row."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import tiny_config

from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.tokenization.whitespace import whitespace_token
from codegeex_train.generation import (
    HUMANEVAL_STOP,
    Generator,
    SamplingParams,
    decode_whitespace_tokens,
    truncate_at_stop,
)
from codegeex_train.model import CodeGeeXModel


@pytest.mark.parametrize("text, expected", [
    ("    return x\n\ndef g():\n    pass", "    return x\n"),
    ("    return x\nclass A:", "    return x"),
    ("    if x:\n        return 1\n    return 2\nif __name__", "    if x:\n        return 1\n    return 2"),
    ("    return x\n# comment\ndef g()", "    return x"),  # the earliest stop string wins
    ("    print(x)\nprint(y)", "    print(x)"),
    ("\ndef f()", ""),
    ("    return x  # no stop", "    return x  # no stop"),
    ("    return x\n    # an indented comment stays", "    return x\n    # an indented comment stays"),
])
def test_truncate_at_humaneval_stops(text, expected):
    assert truncate_at_stop(text, HUMANEVAL_STOP) == expected


def test_truncate_without_stops():
    assert truncate_at_stop("a\ndef b", ()) == "a\ndef b"


def test_whitespace_tokens_as_spaces():
    text = f"def f():\n{whitespace_token(4)}return 1{whitespace_token(10)}<|extratoken_9|><|extratoken_19|>"
    assert decode_whitespace_tokens(text) == "def f():\n    return 1" + " " * 10 + "<|extratoken_9|><|extratoken_19|>"


class ScriptedGenerator(Generator):
    """Plays ``script[i]`` on every sample of prompt i (then the end-of-document id) whatever the model computes;
    the real forwards still run (and cache), their widths recorded in ``fed``."""

    def __init__(self, tokenizer, script: list[list[int]]):
        config = tiny_config(vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=128)
        super().__init__(CodeGeeXModel(config, None, None, seed=1), tokenizer)
        self.script, self.fed = script, []

    def _logits(self, tokens, positions, real, cache):
        self.fed.append(tokens.shape[1])
        return super()._logits(tokens, positions, real, cache)

    def choose(self, logits, params, rows):
        script = [self.script[row.prompt] for row in rows]
        return torch.tensor([s[len(row.tokens)] if len(row.tokens) < len(s) else self.tokenizer.eod
                             for s, row in zip(script, rows)])


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()  # whitespace encoding on: runs of spaces are single tokens


def test_stop_strings_end_rows_and_cut_text(tokenizer):
    completions = ["\n    return a + b\n\ndef main():\n    pass\n", "\n    x = 1\n    return x\n# done\n", "ok"]
    script = [tokenizer.encode(c) for c in completions]
    gen = ScriptedGenerator(tokenizer, script)
    params = SamplingParams(max_new_tokens=40, stop=HUMANEVAL_STOP)
    out = gen.generate(["def add(a, b):", "def one():", "# x"], params)
    assert out == ["\n    return a + b\n", "\n    x = 1\n    return x", "ok"]

    gen = ScriptedGenerator(tokenizer, script)
    ids = gen.generate_ids(tokenizer.encode_batch(["def add(a, b):", "def one():", "# x"]), params)
    # Each row stops at the token that completes its first stop string (kept), the third at the end of document.
    for row, completion, full in zip(ids, completions[:2], script[:2]):
        text = tokenizer.decode(row)
        assert row == full[:len(row)] and len(row) < len(full)
        before = tokenizer.decode(row[:-1])
        assert any(s in text for s in HUMANEVAL_STOP) and not any(s in before for s in HUMANEVAL_STOP)
    assert ids[2] == script[2]  # the end-of-document id is not part of the completion
    # One prefill per prompt, then one new token per row and step; no forward after the last row stopped: the
    # third row chooses its tokens and the end of document, the others stop on a token of theirs.
    prompts = tokenizer.encode_batch(["def add(a, b):", "def one():", "# x"])
    assert gen.fed[:3] == [len(p) for p in prompts] and set(gen.fed[3:]) == {1}
    assert len(gen.fed) - 3 == max(len(ids[0]), len(ids[1]), len(ids[2]) + 1) - 1


def test_whitespace_tokens_decode_to_spaces(tokenizer):
    body = "\n        if x:\n            return  1\n"
    script = [tokenizer.encode(body)]
    ws_ids = {tokenizer.encode(" " * n)[0] for n in (8, 10)}
    assert ws_ids & set(script[0])  # the script really holds whitespace tokens
    assert ScriptedGenerator(tokenizer, script).generate(["def f(x):"], SamplingParams(max_new_tokens=50)) == [body]
    # A tokenizer without the whitespace wrapper prints the extra tokens; the generator still gives spaces.
    plain = default_tokenizer(whitespace_encoding=False)
    assert "<|extratoken_" in plain.decode(script[0])
    assert ScriptedGenerator(plain, script).generate(["def f(x):"], SamplingParams(max_new_tokens=50)) == [body]


def test_max_new_tokens_ends_rows(tokenizer):
    script = [tokenizer.encode("a b c d e f g h i j k l")]
    ids = ScriptedGenerator(tokenizer, script).generate_ids([[5]], SamplingParams(max_new_tokens=4))
    assert ids == [script[0][:4]]


def test_generate_needs_a_tokenizer():
    gen = Generator(CodeGeeXModel(tiny_config(), None, None, seed=1), None)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate(["x"], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        gen.generate_ids([[1]], SamplingParams(stop=("\n",)))
