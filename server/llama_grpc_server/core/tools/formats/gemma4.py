"""`gemma4`: Gemma 4, whose template writes a call as

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:5,flag:true,nested:{k:[1,<|"|>a<|"|>]}}<tool_call|>

(google-gemma-4-31B-it.jinja's `format_argument`; llama.cpp's common_chat_params_init_gemma4
grammar and gemma4_to_json; vLLM's gemma4_tool_parser.py): keys bare (a key in `<|"|>` or JSON
quotes is unquoted), strings between `<|"|>` delimiters (special tokens, taken verbatim: no
escapes), numbers, true, false, null, `{...}` and `[...]` as they are, comma-separated, calls
one after another with no separator. Converted to a JSON object and streamed a top-level
argument at a time ('{"k": v', ', "k2": v2', '}'), as qwen_xml does. A bare value (no
delimiters) is typed by the tool's schema where that is ambiguous: kept a string when the
parameter is a string, else parsed as JSON (a text that does not parse stays a string).

After its calls the template expects `<|tool_response>` with the tool's answer from the caller:
a model that writes that token goes on to invent the response, so the parser drops it and
everything after it (the servicer should make it a stop string)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..arg_types import param_types, typed_bare
from ..streaming import Step, StreamParser, dumps, loads
from ..types import ToolCallParser, ToolSpec

TOOL_CALL = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
QUOTE = '<|"|>'
TOOL_RESPONSE = "<|tool_response>"
_BROKEN = object()


class Gemma4Parser(StreamParser):
    openers = (TOOL_CALL, TOOL_RESPONSE)
    markers = (TOOL_CALL, TOOL_CALL_END, QUOTE, TOOL_RESPONSE)

    def _section(self, opener: str) -> Step[None]:
        if opener == TOOL_RESPONSE:
            yield from self._drain()
            return
        if not (yield from self._call()):
            self._drop_call()
            yield from self._resync((TOOL_CALL_END,))
            return
        yield from self._accept_past_ws(TOOL_CALL_END)

    def _call(self) -> Step[bool]:
        yield from self._skip_ws()
        yield from self._accept("call:")
        name, stop = yield from self._read_until(("{", TOOL_CALL_END), consume=False)
        name = name.strip()
        if stop != "{" or not name:
            return False
        self._open_call(name)
        self._pos += 1
        tool = self.tools.get(name)
        count = 0
        while True:
            yield from self._skip_ws()
            if (yield from self._accept("}")):
                self._add_args("}" if count else "{}")
                self._close_call()
                return True
            if count:
                if not (yield from self._accept(",")):
                    return False
                yield from self._skip_ws()
            key = yield from self._key()
            if key is None:
                return False
            yield from self._skip_ws()
            value = yield from self._value(param_types(tool, key))
            if value is _BROKEN:
                return False
            self._add_args(("{" if count == 0 else ", ") + f"{dumps(key)}: {dumps(value)}")
            count += 1

    def _key(self) -> Step[str | None]:
        raw, stop = yield from self._read_until((":", "}", ",", TOOL_CALL_END), consume=False)
        if stop != ":":
            return None
        self._pos += 1
        key = raw.strip()
        if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
            key = key[len(QUOTE) : -len(QUOTE)]
        elif len(key) > 1 and key[0] == key[-1] == '"':
            try:
                key = loads(key)
            except ValueError:
                return None
        return key or None

    def _value(  # noqa: PLR0911, PLR0912  # one branch per kind of value, read in one pass
        self, types: frozenset[str] = frozenset()
    ) -> Step[Any]:
        """One value, as a Python value; _BROKEN when malformed or cut short."""
        if (yield from self._accept(QUOTE)):
            text, stop = yield from self._read_until((QUOTE,))
            return text if stop is not None else _BROKEN
        first = yield from self._peek()
        if first == "{":
            self._pos += 1
            mapping: dict[str, Any] = {}
            while True:
                yield from self._skip_ws()
                if (yield from self._accept("}")):
                    return mapping
                if mapping:
                    if not (yield from self._accept(",")):
                        return _BROKEN
                    yield from self._skip_ws()
                key = yield from self._key()
                if key is None:
                    return _BROKEN
                yield from self._skip_ws()
                value = yield from self._value()
                if value is _BROKEN:
                    return _BROKEN
                mapping[key] = value
        if first == "[":
            self._pos += 1
            items: list[Any] = []
            while True:
                yield from self._skip_ws()
                if (yield from self._accept("]")):
                    return items
                if items:
                    if not (yield from self._accept(",")):
                        return _BROKEN
                    yield from self._skip_ws()
                value = yield from self._value()
                if value is _BROKEN:
                    return _BROKEN
                items.append(value)
        raw, stop = yield from self._read_until((",", "}", "]", TOOL_CALL_END), consume=False)
        if stop is None or not raw.strip():
            return _BROKEN
        return typed_bare(raw, types)


class Gemma4Format:
    name = "gemma4"
    markers: tuple[str, ...] = (TOOL_CALL, TOOL_CALL_END, QUOTE, TOOL_RESPONSE)
    # the model opens the result's turn after its calls: the answer ends there
    stops: tuple[str, ...] = (TOOL_RESPONSE,)

    def matches(self, template: str) -> bool:
        return f"{TOOL_CALL}call:" in template

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return Gemma4Parser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return None


FORMAT = Gemma4Format()
