"""`mistral`: Mistral's `[TOOL_CALLS]` (a special token) in its two generations:
`[TOOL_CALLS][{"name": "NAME", "arguments": {...}, "id": "..."}, ...]` (Mistral Nemo, 7B v0.3:
mistralai-Mistral-Nemo-Instruct-2407.jinja) and `[TOOL_CALLS]NAME[ARGS]{...}`, one
`[TOOL_CALLS]` per call, maybe `[CALL_ID]ID` before `[ARGS]` (Mistral Small 3.2, Devstral,
Ministral 3: their templates; llama.cpp's parsers/ministral3.cpp; vLLM's mistral_tool_parser.py).
A single object after `[TOOL_CALLS]` is read too. Other keys of the objects ("id") are
skipped; the name form's NAME is everything before `[ARGS]`/`[CALL_ID]`, stripped, and must hold
no whitespace or bracket."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..streaming import Step, StreamParser, dumps, is_json_object
from ..types import ToolCallParser, ToolSpec

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[^\s\[\]{}\"]+")


class MistralParser(StreamParser):
    openers = (TOOL_CALLS,)
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def _section(self, opener: str) -> Step[None]:
        first = yield from self._peek_past_ws()
        if first == "[":
            yield from self._skip_ws()
            self._pos += 1
            if not (yield from self._call_array()):
                yield from self._resync()
        elif first == "{":
            yield from self._skip_ws()
            if (yield from self._call_object()) is None:
                yield from self._resync()
        elif first:
            yield from self._named_call()

    def _named_call(self) -> Step[None]:
        name, stop = yield from self._read_until((ARGS, CALL_ID))
        name = name.strip()
        if stop is None:
            return
        if not _NAME.fullmatch(name):
            yield from self._resync()
            return
        if stop == CALL_ID:
            _, stop = yield from self._read_until((ARGS,), keep=False)
            if stop is None:
                return
        self._open_call(name)
        yield from self._skip_ws()
        if (yield from self._peek()) != "{":
            yield from self._resync()
            return
        arguments = yield from self._json_value(self._add_args)
        if arguments is not None and is_json_object(arguments):
            self._close_call()
        else:
            yield from self._resync()


class MistralFormat:
    name = "mistral"
    markers: tuple[str, ...] = (TOOL_CALLS, ARGS, CALL_ID)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return TOOL_CALLS in template

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return MistralParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return f'{TOOL_CALLS}[{{"name": {dumps(name)}, "arguments": ', "}]"


FORMAT = MistralFormat()
