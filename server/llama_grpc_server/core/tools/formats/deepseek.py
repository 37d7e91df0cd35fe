"""`deepseek`: DeepSeek V3, R1 and the R1 distills, and V3.1. The markers are special tokens
spelled with FULLWIDTH VERTICAL LINE (U+FF5C) for the bars and U+2581 for the spaces: below,
`<|tool calls begin|>` stands for "<", U+FF5C, "tool", U+2581, "calls", U+2581, "begin",
U+FF5C, ">" (`CALLS_BEGIN`), and so on:

    <|tool calls begin|><|tool call begin|>function<|tool sep|>NAME
    ```json
    {...}
    ```<|tool call end|>
    <|tool call begin|>...<|tool call end|><|tool calls end|>

(deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja; vLLM's deepseekv3_tool_parser.py) and V3.1's
`<|tool call begin|>NAME<|tool sep|>{...}<|tool call end|>` (deepseek-ai-DeepSeek-V3.1.jinja;
vLLM's deepseekv31_tool_parser.py). Which form a call is in is told by what follows the
separator: a JSON object (V3.1: the name came before it) or the name (V3: the type "function"
came before it). The fence around V3's arguments is optional, and so is `<|tool calls begin|>`
before the first call. V3.2's and V4's DSML markup is not read."""

from __future__ import annotations

from collections.abc import Sequence

from ..streaming import Step, StreamParser, is_json_object
from ..types import ToolCallParser, ToolSpec

_BAR = "\uff5c"  # FULLWIDTH VERTICAL LINE
_SPACE = "\u2581"  # ▁ LOWER ONE EIGHTH BLOCK (SentencePiece's space)


def _token(words: str) -> str:
    return f"<{_BAR}{words.replace(' ', _SPACE)}{_BAR}>"


CALLS_BEGIN = _token("tool calls begin")
CALLS_END = _token("tool calls end")
CALL_BEGIN = _token("tool call begin")
CALL_END = _token("tool call end")
SEP = _token("tool sep")
FENCE = "```"


class DeepSeekParser(StreamParser):
    openers = (CALLS_BEGIN, CALL_BEGIN)
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _section(self, opener: str) -> Step[None]:
        if opener == CALLS_BEGIN and not (yield from self._accept_past_ws(CALL_BEGIN)):
            yield from self._accept_past_ws(CALLS_END)
            return
        while True:
            if not (yield from self._call()):
                self._drop_call()
                yield from self._resync((CALL_END,))
            if not (yield from self._accept_past_ws(CALL_BEGIN)):
                break
        yield from self._accept_past_ws(CALLS_END)

    def _call(self) -> Step[bool]:
        """Just after CALL_BEGIN: one call, either form."""
        prefix, stop = yield from self._read_until((SEP, CALL_END))
        if stop != SEP:
            if stop is not None:
                self._pos -= len(stop)  # the resync consumes it
            return False
        if (yield from self._peek_past_ws()) == "{":
            name = prefix.strip()
        else:
            raw, stop = yield from self._read_until(("\n", FENCE, "{"), consume=False)
            if stop is None:
                return False
            name = raw.strip()
        if not name:
            return False
        self._open_call(name)
        yield from self._skip_ws()
        if (yield from self._accept(FENCE)):
            yield from self._read_word()
            yield from self._skip_ws()
        if (yield from self._peek()) != "{":
            return False
        arguments = yield from self._json_value(self._add_args)
        if arguments is None or not is_json_object(arguments):
            return False
        self._close_call()
        yield from self._accept_past_ws(FENCE)
        yield from self._accept_past_ws(CALL_END)
        return True


class DeepSeekFormat:
    name = "deepseek"
    markers: tuple[str, ...] = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return CALL_BEGIN in template and SEP in template

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return DeepSeekParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        head = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n{FENCE}json\n"
        return head, f"\n{FENCE}{CALL_END}{CALLS_END}"


FORMAT = DeepSeekFormat()
