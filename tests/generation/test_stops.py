"""Incremental stop strings (generation/stops.py): checked as each token arrives, a stop string is found at the token
that completes it, also when it is made only of multi-byte characters, each spread over several byte-level tokens
(a window of c tokens for a stop of c characters would miss those)."""

from __future__ import annotations

import pytest

from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.generation.stops import StopStrings

PROMPT = "def f():\n"
BODY = "    return 1  # " * 6  # longer than any window: only the newest tokens are decoded


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def first_hit(stops: StopStrings, prompt_ids: list[int], completion_ids: list[int]) -> int | None:
    """How many completion tokens had arrived when ``stops`` first hit (None: never), asked after each token as
    the generator asks."""
    return next((n for n in range(1, len(completion_ids) + 1) if stops.hit(prompt_ids, completion_ids[:n])), None)


@pytest.mark.parametrize("stop", ["数据", "😀😀", "ß€", "\n数"])
def test_a_stop_of_multi_byte_characters_is_found_at_the_token_completing_it(tokenizer, stop):
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    prompt_ids, body_ids, stop_ids = (tokenizer.encode(t) for t in (PROMPT, BODY, stop))
    assert len(stop_ids) > len(stop)  # bytes spread over more tokens than characters: what the window must allow
    completion_ids = body_ids + stop_ids + tokenizer.encode("x = 2\n")
    stops = StopStrings([stop], lambda prompt, completion: decode(completion), decode)
    assert len(body_ids) > stops.window  # so the window, not the whole text, decides
    assert first_hit(stops, prompt_ids, completion_ids) == len(body_ids) + len(stop_ids)


def test_no_stop_is_found_where_there_is_none(tokenizer):
    ids = tokenizer.encode(BODY * 3)
    stops = StopStrings(["数据", "\ndef"], lambda prompt, completion: tokenizer.decode(completion), tokenizer.decode)
    assert first_hit(stops, [], ids) is None
