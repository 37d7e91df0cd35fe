"""A reasoning budget: at most `budget` thinking tokens, then the end of the section is forced
token by token (llama-server's --reasoning-budget, PR #20297, does the same).

The engine's sampler asks `forced()` before each token (a token id to emit instead of
sampling, or None) and tells `observe()` every token it emitted, with its piece (bytes as the
grammar sees them: special tokens as their text). The section is open from the start (the
prompt opened it) or opens when the output starts with the opener; a closer the model writes
itself ends it. At the budget the forced end (`ReasoningParams.forced_end_ids`: an optional
message, the closer) follows at once, unless the thinking ends inside a UTF-8 character: the
tokens that complete the character come first (at most 3), so a forced end never splits one.
A budget of 0 forces the end at once (or a whole empty section, `forced_empty_ids`, for a model
that opens its section itself). Pure."""

from __future__ import annotations

import codecs
import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningParams:
    """A thinking request's section: its markers, whether the prompt opened it, and the
    budget with the token ids that end a section (None: no budget)."""

    opener: str
    closer: str
    opened: bool
    budget: int | None = None
    forced_end_ids: tuple[int, ...] = ()
    forced_empty_ids: tuple[int, ...] = ()


class _State(enum.Enum):
    WAITING = "waiting"  # the model may still open its section
    THINKING = "thinking"
    FORCING = "forcing"
    DONE = "done"


class ThinkingBudget:
    __slots__ = (
        "_budget",
        "_closer",
        "_count",
        "_decoder",
        "_end_ids",
        "_forced",
        "_opener",
        "_seen",
        "_state",
    )

    def __init__(self, params: ReasoningParams) -> None:
        self._budget = params.budget if params.budget is not None else -1
        self._opener = params.opener.encode("utf-8")
        self._closer = params.closer.encode("utf-8")
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._count = 0  # thinking tokens so far
        self._seen = b""  # the output while WAITING; the tail that may hold a closer after
        self._forced: list[int] = []
        self._end_ids = params.forced_end_ids
        self._state = _State.THINKING if params.opened else _State.WAITING
        if self._budget == 0:
            self._force(params.forced_end_ids if params.opened else params.forced_empty_ids)

    @property
    def is_done(self) -> bool:
        return self._state is _State.DONE

    def forced(self) -> int | None:
        """The token to emit next instead of sampling, if the end is being forced."""
        return self._forced[0] if self._state is _State.FORCING and self._forced else None

    def observe(self, piece: bytes) -> None:
        """The emitted token's piece (forced or sampled)."""
        if self._state is _State.FORCING:
            self._forced.pop(0)
            if not self._forced:
                self._state = _State.DONE
            return
        if self._state is _State.WAITING:
            self._seen += piece
            text = self._seen.lstrip()
            if text.startswith(self._opener):
                self._state = _State.THINKING
                self._seen = text[len(self._opener) :]
                self._decoder.decode(self._seen)
            elif not self._opener.startswith(text):
                self._state = _State.DONE
            return
        if self._state is not _State.THINKING:
            return
        self._count += 1
        tail = self._seen + piece
        if self._closer in tail:
            self._state = _State.DONE
            return
        self._seen = tail[-(len(self._closer) - 1) :] if len(self._closer) > 1 else b""
        self._decoder.decode(piece)
        if 0 <= self._budget <= self._count and not self._decoder.getstate()[0]:
            self._force(self._end_ids)

    def _force(self, ids: tuple[int, ...]) -> None:
        self._forced = list(ids)
        self._state = _State.FORCING if ids else _State.DONE
