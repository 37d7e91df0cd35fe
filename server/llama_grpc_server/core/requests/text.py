"""Incremental detokenization: token pieces (bytes) -> UTF-8-safe text with stop-string hold-back.
Pure: the engine hands in the vocabulary's piece table once."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def held_back_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextAssembler:
    """Turns generated tokens into text that never ends inside a character or a possible stop."""

    __slots__ = ("_decoder", "_pending", "_pieces", "_stops")

    def __init__(self, pieces: Sequence[bytes], stops: Sequence[str] = ()) -> None:
        self._pieces = pieces
        self._stops = tuple(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def push(self, token_id: int, *, find_stops: bool = True) -> tuple[str, str]:
        """Add one token; returns (text safe to emit now, matched stop string or ""). With
        find_stops=False nothing is held back or matched: a stop string completed by later
        tokens is only looked for in the text after this token."""
        self._pending += self._decoder.decode(self._pieces[token_id])
        if not self._stops or not find_stops:
            out, self._pending = self._pending, ""
            return out, ""
        first_at, matched = -1, ""
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (first_at < 0 or at < first_at):
                first_at, matched = at, stop
        if matched:
            out, self._pending = self._pending[:first_at], ""
            return out, matched
        keep = held_back_length(self._pending, self._stops)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, ""

    def flush(self) -> str:
        """Everything still held back, including an incomplete character (as U+FFFD)."""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out
