"""One request's output split into thinking and answer as it streams.

The section starts open (its prompt opened it) or may be opened by the output's first
non-blank text (the model writes the opener); any other first text means no thinking. Text that
may still become the opener or the closer is held back, so neither marker ever reaches either
side; blank lines at the section's edges and before the answer are dropped (the templates put
them there: `<think>\\n...\\n</think>\\n\\n`). An output that ends inside its section is all
thinking (no answer). Pure."""

from __future__ import annotations

import enum

from llama_grpc_server.core.reasoning.formats import ReasoningFormat


class _State(enum.Enum):
    BEFORE = "before"  # the opener may still come
    LABEL = "label"  # after the opener: its label (Gemma 4's "thought\n") may follow
    INSIDE = "inside"
    ANSWER = "answer"


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """push(text) -> (thinking, answer) releasable now; finish() releases the rest."""

    def __init__(self, fmt: ReasoningFormat, *, opened: bool) -> None:
        self._fmt = fmt
        self._state = _State.LABEL if opened else _State.BEFORE
        self._pending = ""  # held back: a possible marker or label, or blanks at an edge
        self._started = False  # some thinking was released (later blanks are kept)
        self._answered = False  # some answer was released

    @property
    def is_thinking(self) -> bool:
        return self._state in (_State.LABEL, _State.INSIDE)

    def push(self, text: str) -> tuple[str, str]:
        self._pending += text
        thinking, answer = [], []
        while True:
            before = (self._state, self._pending)
            if self._state is _State.BEFORE:
                self._before()
            elif self._state is _State.LABEL:
                self._label()
            elif self._state is _State.INSIDE:
                thinking.append(self._inside())
            else:
                answer.append(self._answer())
            if (self._state, self._pending) == before:
                break
        return "".join(thinking), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the output: what is held back is released as what it was becoming."""
        pending, self._pending = self._pending, ""
        if self._state is _State.BEFORE:
            return "", pending
        if self._state in (_State.LABEL, _State.INSIDE):
            return (pending.rstrip() if self._started else pending.strip()), ""
        return "", pending

    def _before(self) -> None:
        stripped = self._pending.lstrip()
        opener = self._fmt.opener
        if stripped.startswith(opener):
            self._pending = stripped[len(opener) :]
            self._state = _State.LABEL
        elif not opener.startswith(stripped):  # (an empty or blank text still may)
            self._state = _State.ANSWER

    def _label(self) -> None:
        label = self._fmt.label
        if self._pending.startswith(label):
            self._pending = self._pending[len(label) :]
            self._state = _State.INSIDE
        elif not (label and label.startswith(self._pending)):
            self._state = _State.INSIDE

    def _inside(self) -> str:
        closer = self._fmt.closer
        at = self._pending.find(closer)
        if at >= 0:
            body, self._pending = self._pending[:at], self._pending[at + len(closer) :]
            self._state = _State.ANSWER
            return self._release(body.rstrip())
        keep = _held(self._pending, closer)
        body = self._pending[: len(self._pending) - keep]
        stripped = body.rstrip()  # trailing blanks wait: they may be the section's last
        self._pending = body[len(stripped) :] + self._pending[len(body) :]
        return self._release(stripped)

    def _release(self, body: str) -> str:
        if not self._started:
            body = body.lstrip()
        if body:
            self._started = True
        return body

    def _answer(self) -> str:
        if self._answered:
            text, self._pending = self._pending, ""
            return text
        text = self._pending.lstrip()
        self._pending = ""
        if text:
            self._answered = True
        return text
