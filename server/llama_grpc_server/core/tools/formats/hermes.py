"""`hermes`: Qwen 2.5, Qwen 3, QwQ, Hermes 2 Pro / 3, whose templates ask

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

once per call (Qwen-Qwen3-0.6B.jinja, Qwen-Qwen2.5-7B-Instruct.jinja,
NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja; vLLM's hermes_tool_parser.py). Several calls
follow one another, whitespace between them dropped. The call object may put "arguments" first
(held until the name is known), call it "parameters", or carry other keys (skipped); without
arguments they are "{}". A `<tool_call>` holding Qwen XML `<function=...>` blocks is read too
(the parser is qwen_xml's, without its bare `<function=NAME>` opener). Qwen 2.5 Coder's bare or
fenced JSON calls are the bare JSON rule's (streaming.StreamParser).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..streaming import dumps
from ..types import ToolCallParser, ToolSpec
from .qwen_xml import FUNCTION, TOOL_CALL, TOOL_CALL_END, ToolCallTagParser


class HermesParser(ToolCallTagParser):
    function_openers = False


class HermesFormat:
    name = "hermes"
    markers: tuple[str, ...] = (TOOL_CALL, TOOL_CALL_END)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        # GLM's and Ling's `<arg_key>`, MiniMax's `<invoke name=` inside <tool_call> are other
        # formats: generic keeps their calls as text rather than dropping them as broken.
        others = (FUNCTION, "<arg_key>", "<invoke name=")
        return TOOL_CALL in template and not any(other in template for other in others)

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return HermesParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return f'{TOOL_CALL}\n{{"name": {dumps(name)}, "arguments": ', f"}}\n{TOOL_CALL_END}"


FORMAT = HermesFormat()
