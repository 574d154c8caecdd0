"""Stop strings found as each token arrives, without decoding the whole completion at every step.

A row stops once its completion text contains a stop string. Decoding the whole completion at each step costs
O(length) per token, O(length^2) per sample. A new occurrence must end in the text of the newest token, and a stop
string of c characters spans at most 4c tokens (a byte-level token carries at least one byte, a character at most
4), so decoding the last ``4 * longest + 8`` tokens alone finds it (the 8: the first characters of a window can
decode differently from in context, a character cut between tokens). A hit there is confirmed on the whole text,
so the answer is exactly "the completion contains a stop string" -- at O(1) decoding per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    """``hit(prompt_ids, completion_ids)``: does the completion (as ``completion_text`` spells it) contain one of
    ``stop``? ``decode(ids)`` spells a run of completion tokens alone, as ``completion_text`` would."""

    def __init__(self, stop: Sequence[str], completion_text: Callable[[list[int], list[int]], str],
                 decode: Callable[[list[int]], str]):
        self.stop = tuple(stop)
        self.window = 4 * max(map(len, self.stop), default=0) + 8
        self._completion_text, self._decode = completion_text, decode

    def __bool__(self) -> bool:
        return bool(self.stop)

    def _found(self, text: str) -> bool:
        return any(s in text for s in self.stop)

    def hit(self, prompt_ids: list[int], completion_ids: list[int]) -> bool:
        if not self.stop:
            return False
        if len(completion_ids) <= self.window:  # short: the whole text, as cheap as a window
            return self._found(self._completion_text(prompt_ids, completion_ids))
        return (self._found(self._decode(completion_ids[-self.window:]))
                and self._found(self._completion_text(prompt_ids, completion_ids)))
