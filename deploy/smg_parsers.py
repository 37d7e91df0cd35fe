"""Which of SMG's tool-call and reasoning parsers a model needs, read off its chat template.

SMG picks its parsers from the model id it is given (`Qwen3*` -> `qwen`, `deepseek-r1*` ->
`deepseek_r1`, ...). A llama-grpc model id is whatever the file or `--model NAME=` says
(`model`, `tiny-qwen`, `my-finetune`), so that guess misses or errs. The chat template is what
the model was trained to emit, so `make gateway` reads the markers the template writes for a
tool call or for thinking and passes `--tool-call-parser` / `--reasoning-parser` to SMG
explicitly; `GATEWAY_TOOL_PARSER=` / `GATEWAY_REASONING_PARSER=` (deploy.gateway's
`--tool-call-parser` / `--reasoning-parser`) override the choice, and `none` passes neither.

Tool calls with `tool_choice` "required" or a named function do not depend on the parser:
SMG then sends a JSON schema (a structural tag for its `mistral`, `kimik2`, `kimi_k3` and
`inkling` parsers) and reads the constrained JSON itself. The parser matters for
`tool_choice` "auto", where the model's own format must be recognised in free text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Parsers:
    tool: str | None  # SMG --tool-call-parser; None: leave it to SMG
    reasoning: str | None  # SMG --reasoning-parser; None: leave it to SMG
    why: str  # what in the template decided it, for the start-up line

    def smg_args(self) -> list[str]:
        args = []
        if self.tool:
            args += ["--tool-call-parser", self.tool]
        if self.reasoning:
            args += ["--reasoning-parser", self.reasoning]
        return args


# (marker in the template, SMG tool parser, what the family is), the first match wins: the
# more specific markers first (Qwen 3.5 / Qwen3-Coder write <tool_call><function=...> XML;
# Qwen 2.5 / 3 and Hermes write <tool_call>{json}).
_TOOL_MARKERS = (
    ("<function=", "qwen_xml", "Qwen 3.5 / Qwen3-Coder XML tool calls (<function=...>)"),
    ("<tool_call>", "qwen", "Qwen / Hermes tool calls (<tool_call>{...})"),
    ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "deepseek", "DeepSeek tool calls"),
    ("[TOOL_CALLS]", "mistral", "Mistral tool calls ([TOOL_CALLS])"),
    ("<|tool_call>", "gemma4", "Gemma 4 tool calls (<|tool_call>)"),
    ("<|python_tag|>", "llama", "Llama 3.1 tool calls (<|python_tag|> / JSON)"),
)
# Llama 3.2 / 3.3 templates have no <|python_tag|> but write {"name": ..., "parameters": ...}
_LLAMA3_HEADER = "<|start_header_id|>"

_REASONING_MARKERS = (
    ("<\uff5cAssistant\uff5c>", "<think>", "deepseek_r1", "DeepSeek R1 thinking (<think>)"),
    ("<|im_start|>", "<think>", "qwen3", "Qwen 3 thinking (<think>)"),
    ("<|channel>", "<|channel>", "gemma4", "Gemma 4 thinking (<|channel>)"),
)


def choose(chat_template: str | None) -> Parsers:
    """SMG's parsers for a model whose chat template is `chat_template` (None: it has none).
    A template without a known tool-call marker gets SMG's generic `json` parser."""
    template = chat_template or ""
    reasons = []
    tool = None
    for marker, parser, what in _TOOL_MARKERS:
        if marker in template:
            tool = parser
            reasons.append(what)
            break
    if tool is None:
        if _LLAMA3_HEADER in template and "parameters" in template:
            tool = "llama"
            reasons.append("Llama 3.2 tool calls (JSON with parameters)")
        else:
            tool = "json"
            reasons.append("no tool-call format in the template: generic JSON")
    reasoning = None
    for family, marker, parser, what in _REASONING_MARKERS:
        if family in template and marker in template:
            reasoning = parser
            reasons.append(what)
            break
    if reasoning is None:
        # an explicit no-op: SMG would otherwise guess a reasoning parser from the model id
        reasoning = "passthrough"
        reasons.append("no thinking markers: passthrough")
    return Parsers(tool, reasoning, "; ".join(reasons))


def with_overrides(chosen: Parsers, tool: str | None, reasoning: str | None) -> Parsers:
    """`chosen` with the user's choices (None: keep; "none": pass no flag, SMG decides)."""

    def pick(given: str | None, default: str | None) -> str | None:
        if given is None:
            return default
        return None if given == "none" else given

    new_tool, new_reasoning = pick(tool, chosen.tool), pick(reasoning, chosen.reasoning)
    if (new_tool, new_reasoning) == (chosen.tool, chosen.reasoning):
        return chosen
    return Parsers(new_tool, new_reasoning, chosen.why + "; overridden")
