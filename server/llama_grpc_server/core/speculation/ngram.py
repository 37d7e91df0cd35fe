"""NgramIndex: the prompt-lookup drafter. It finds the most recent earlier occurrence of a token
list's suffix (its last ngram_max tokens, then shorter ones down to ngram_min) and proposes the
tokens that followed it there. The index grows with the list (prompt, then output), one token at
a time, so a lookup costs microseconds however long the prompt. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Match(NamedTuple):
    """What NgramIndex.lookup found."""

    draft: tuple[int, ...]
    length: int  # tokens of the suffix matched (0: nothing found)
    is_ambiguous: bool = False  # the suffix matched was followed by other tokens elsewhere


NO_MATCH = Match((), 0)


class NgramIndex:
    """Where each n-gram of one growing token list last occurred, for n in [ngram_min,
    ngram_max]. An n-gram is indexed once a token follows it, so the list's own suffix never
    matches itself, and a later occurrence replaces an earlier one (most recent first). The
    list may only grow between calls (a request's tokens do: rejected drafts never enter it)."""

    __slots__ = (
        "_after",
        "_ambiguous",
        "_ends",
        "_ngram_max",
        "_ngram_min",
        "_num_indexed",
    )

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self._ngram_min = ngram_min
        self._ngram_max = ngram_max
        # n -> n-gram -> the index just past its most recent indexed occurrence
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }
        # n -> the n-grams that were followed by different tokens at different occurrences
        self._ambiguous: dict[int, set[tuple[int, ...]]] = {
            n: set() for n in range(ngram_min, ngram_max + 1)
        }
        self._num_indexed = 0  # n-grams ending before this index are indexed
        self._after: dict[int, int] = {}  # token -> the token that last followed it (filler)

    def draft(self, tokens: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to max_tokens tokens that followed the most recent earlier occurrence of the
        longest matching suffix of `tokens`; () when no suffix of ngram_min tokens or more
        occurred before."""
        return self.lookup(tokens, max_tokens).draft

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> Match:
        """draft(), the length of the suffix it matched (0 when it found none: the longer, the
        likelier the draft is right) and whether that suffix is ambiguous, followed by another
        token at some earlier occurrence than the draft's (then the draft is far less likely to
        be right: core.speculation.speculator)."""
        if max_tokens <= 0:
            return NO_MATCH
        self._extend(tokens)
        length = len(tokens)
        for n in range(min(self._ngram_max, length), self._ngram_min - 1, -1):
            suffix = tuple(tokens[length - n :])
            end = self._ends[n].get(suffix)
            if end is not None:
                draft = tuple(tokens[end : end + max_tokens])
                return Match(draft, n, suffix in self._ambiguous[n])
        return NO_MATCH

    def filler(self, tokens: Sequence[int]) -> int:
        """A one-token guess when draft() finds nothing: the token that last followed the last
        token, else the last token again. Nobody counts on it being accepted: it pads a forward
        pass to a cheaper number of rows (core.speculation.policy)."""
        self._extend(tokens)
        return self._after.get(tokens[-1], tokens[-1])

    def _extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that now have a following token (those ending before the last)."""
        last = len(tokens) - 1
        for end in range(max(self._num_indexed, 1), last + 1):
            self._after[tokens[end - 1]] = tokens[end]
            for n, ends in self._ends.items():
                if n > end:
                    break
                gram = tuple(tokens[end - n : end])
                before = ends.get(gram)
                if before is not None and tokens[before] != tokens[end]:
                    self._ambiguous[n].add(gram)
                ends[gram] = end
        self._num_indexed = max(self._num_indexed, last + 1)
