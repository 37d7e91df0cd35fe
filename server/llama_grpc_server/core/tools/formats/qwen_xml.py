"""`qwen_xml`: Qwen 3.5 and Qwen3-Coder (also Nemotron Nano 3, StepFun 3.5), whose templates ask

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

(the templates' own example, and llama.cpp's common/chat parsers/qwen3-coder.cpp, vLLM's
qwen3coder_tool_parser.py). A value is the text between `<parameter=KEY>` and `</parameter>`
less one newline at each end; it ends early at the next `<parameter=`, `</function>` or
`</tool_call>` when `</parameter>` is missing. Typed by the tool's schema (`schema.typed_text`):
a string stays a string (even "123"), other types are parsed as JSON when they parse. The
arguments are re-serialized as a JSON object and streamed a parameter at a time: '{"k": v' for
the first, ', "k2": v2' for the next, '}' at `</function>` ("{}" when there were none).

Also read: several `<function=...>` blocks in one `<tool_call>`; a `<tool_call>` holding the
hermes JSON body instead (models mix the two); `<function=NAME>` without `<tool_call>` for an
offered NAME (Qwen3-Coder drops the tag at times; llama.cpp triggers on it too). The parser is
shared with `hermes`, which does not take the bare `<function=NAME>` opener.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..arg_types import param_types, typed_text
from ..streaming import Step, StreamParser, dumps
from ..types import ToolCallParser, ToolSpec

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


class ToolCallTagParser(StreamParser):
    """`<tool_call>` ... `</tool_call>` holding a JSON call object or `<function=...>` blocks."""

    openers = (TOOL_CALL,)
    markers = (TOOL_CALL, TOOL_CALL_END)
    function_openers = True

    def _openers(self) -> tuple[str, ...]:
        if not self.function_openers:
            return self.openers
        return self.openers + tuple(f"{FUNCTION}{name}>" for name in self.tools)

    def _section(self, opener: str) -> Step[None]:
        if opener != TOOL_CALL:  # <function=NAME> without <tool_call>
            if (yield from self._function(opener[len(FUNCTION) : -1])):
                yield from self._accept_past_ws(TOOL_CALL_END)
            else:
                yield from self._resync((TOOL_CALL_END,))
            return
        first = yield from self._peek_past_ws()
        if first == "{":
            yield from self._skip_ws()
            if (yield from self._call_object()) is None:
                yield from self._resync((TOOL_CALL_END,))
            else:
                yield from self._accept_past_ws(TOOL_CALL_END)
            return
        if (yield from self._accept_past_ws(FUNCTION)):
            while True:
                name, stop = yield from self._read_until((">",))
                if stop is None or not (yield from self._function(name.strip())):
                    yield from self._resync((TOOL_CALL_END,))
                    return
                if not (yield from self._accept_past_ws(FUNCTION)):
                    break
            yield from self._accept_past_ws(TOOL_CALL_END)
        elif first:
            yield from self._resync((TOOL_CALL_END,))  # no call in it: dropped, closer included

    def _function(self, name: str) -> Step[bool]:
        """Just after `<function=NAME>`: its parameters up to `</function>`. False when broken
        or cut short."""
        if not name:
            return False
        self._open_call(name)
        tool = self.tools.get(name)
        count = 0
        stops = (PARAMETER_END, PARAMETER, FUNCTION_END, TOOL_CALL_END)
        while True:
            yield from self._skip_ws()
            if (yield from self._accept(PARAMETER)):
                key, stop = yield from self._read_until((">",))
                if stop is None:
                    return False
                value, stop = yield from self._read_until(stops, consume=False)
                if stop is None:
                    return False
                if stop == PARAMETER_END:
                    self._pos += len(stop)
                value = value.removeprefix("\n").removesuffix("\n")
                key = key.strip()
                typed = typed_text(value, param_types(tool, key))
                self._add_args(("{" if count == 0 else ", ") + f"{dumps(key)}: {dumps(typed)}")
                count += 1
                continue
            ended = yield from self._accept(FUNCTION_END)
            if ended or (yield from self._looking_at(TOOL_CALL_END)):
                self._add_args("}" if count else "{}")
                self._close_call()
                return True
            if (yield from self._peek()) == "":
                return False
            # stray text between parameters: skipped
            self._pos += 1
            yield from self._read_until(stops[1:], consume=False, keep=False)


class QwenXmlParser(ToolCallTagParser):
    pass


class QwenXmlFormat:
    name = "qwen_xml"
    markers: tuple[str, ...] = (TOOL_CALL, TOOL_CALL_END)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return FUNCTION in template and PARAMETER in template

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return QwenXmlParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return None


FORMAT = QwenXmlFormat()
