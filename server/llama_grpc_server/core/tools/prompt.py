"""Tools in the prompt: what a chat template can render (probed once per template, as llama.cpp's
minja capabilities are), the messages a template is handed, and the generic tool prompt a
template without tool support gets (as llama-server gives one).

A template is probed by rendering small conversations and looking for what it was handed:
- `tools`: the tools list appears (a probe tool's name is in the output);
- `tool_calls`: an assistant message's calls appear; `object_arguments` when they appear with
  the arguments as an object (Qwen 2.5, Llama 3.2: `arguments | tojson`; Gemma 4 and Qwen 3.5
  write each value in their own syntax), not printed as a Python dict (DeepSeek R1 prints the
  arguments as they are: JSON text);
- `tool_responses`: a "tool" message's content appears.
What the template cannot render is rewritten into what it can: a generic tool prompt in the
system message, calls as bare JSON in the assistant's text, results as a user turn. Pure."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.tools.types import ToolCall, ToolSpec

PROBE_TOOL = "probe_tool_7f3a"
PROBE_ARGUMENT = "probe_argument_7f3a"
PROBE_VALUE = "probe_value_7f3a"
PROBE_RESULT = "probe_result_7f3a"
PROBE_ID = "call7f3a0"  # nine letters and digits: Mistral's templates insist on that

GENERIC_PROMPT = """You can call these tools (JSON Schema of each one's arguments):
{tools}

To call a tool, answer with only a JSON object {{"name": <the tool's name>, "arguments": \
<an object of its arguments>}}; to call several, write one such object per line. Otherwise \
answer normally. A tool's result comes back as {{"tool_response": {{"name": ..., "content": \
...}}}}."""

Render = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None], str]
"""Render (messages, tools or None) with the template, adding the generation prompt."""


@dataclass(frozen=True, slots=True)
class TemplateCaps:
    tools: bool = False
    tool_calls: bool = False
    tool_responses: bool = False
    object_arguments: bool = False
    null_content: bool = False  # a turn of calls only is rendered with content None, not ""

    @property
    def native(self) -> bool:
        """The template renders tools, calls and results itself."""
        return self.tools and self.tool_calls and self.tool_responses


def _try(render: Render, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    try:
        return render(messages, tools)
    except Exception:  # a template may refuse the probe any way it likes: not supported
        return ""


def probe(render: Render) -> TemplateCaps:
    """What the template renders (see the module doc)."""
    user = {"role": "user", "content": "hello"}
    spec = ToolSpec(PROBE_TOOL, "a probe", {"type": "object", "properties": {}})
    tools = PROBE_TOOL in _try(render, [user], [openai_tool(spec)])
    thanks = {"role": "user", "content": "thanks"}
    caps = TemplateCaps(tools)
    # an empty content first (Qwen 3 refuses None), then None (DeepSeek renders the calls of
    # a turn without content only)
    for content in ("", None):
        object_call = _assistant_call({PROBE_ARGUMENT: PROBE_VALUE}, content)
        object_text = _try(render, [user, object_call, thanks], None)
        text_call = _assistant_call(json.dumps({PROBE_ARGUMENT: PROBE_VALUE}), content)
        text_text = _try(render, [user, text_call, thanks], None)
        # JSON as written: an object through tojson, or the JSON text printed as it is; an
        # object printed as a Python dict ('...') is not (Qwen 3.5 writes values bare, in XML)
        # Objects when they render (as HuggingFace passes them: Gemma 4 prints JSON text
        # inside its own braces), else JSON text
        object_arguments = PROBE_VALUE in object_text and f"'{PROBE_VALUE}'" not in object_text
        if not (object_arguments or PROBE_ARGUMENT in text_text):
            continue
        call = object_call if object_arguments else text_call
        result = {"role": "tool", "content": PROBE_RESULT, "tool_call_id": PROBE_ID}
        responses = PROBE_RESULT in _try(render, [user, call, result | {"name": PROBE_TOOL}], None)
        return TemplateCaps(tools, True, responses, object_arguments, content is None)
    result = {"role": "tool", "content": PROBE_RESULT, "tool_call_id": PROBE_ID, "name": PROBE_TOOL}
    responses = PROBE_RESULT in _try(render, [user, _assistant_call("{}", ""), result], None)
    return dataclasses.replace(caps, tool_responses=responses)


def _assistant_call(arguments: object, content: str | None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": PROBE_ID,
                "type": "function",
                "function": {"name": PROBE_TOOL, "arguments": arguments},
            }
        ],
    }


def openai_tool(spec: ToolSpec) -> dict[str, Any]:
    """A tool the way chat templates expect it (OpenAI's shape)."""
    function: dict[str, Any] = {"name": spec.name}
    if spec.description:
        function["description"] = spec.description
    function["parameters"] = dict(spec.parameters) or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def generic_prompt(tools: Sequence[ToolSpec]) -> str:
    """The system prompt that tells a model without a tool format how to call."""
    listed = [
        {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}
        for t in tools
    ]
    return GENERIC_PROMPT.format(tools=json.dumps(listed, ensure_ascii=False, indent=1))


def bare_json_call(call: ToolCall) -> str:
    """A call as the generic format writes it: {"name": ..., "arguments": {...}}."""
    arguments = call.arguments.strip() or "{}"
    return f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {arguments}}}'


def template_messages(
    messages: Sequence[ChatMessage], caps: TemplateCaps, tools: Sequence[ToolSpec]
) -> list[dict[str, Any]]:
    """The messages as the template is handed them (see the module doc): a template that does
    not render `tools` gets the generic prompt at the top of the system message; calls it does
    not render become bare JSON text of the assistant; results it does not render become a
    user turn (consecutive ones merged, so user and assistant still alternate)."""
    out: list[dict[str, Any]] = []
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    merged_results = False  # the last entry is a user turn of tool results
    for message in messages:
        if message.role == "tool" and not caps.tool_responses:
            name = message.name or names.get(message.tool_call_id, "")
            text = json.dumps(
                {"tool_response": {"name": name, "content": message.content}}, ensure_ascii=False
            )
            if merged_results:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            merged_results = True
            continue
        merged_results = False
        out.append(_entry(message, caps, names))
    if tools and not caps.tools:
        prompt = generic_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{prompt}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _entry(message: ChatMessage, caps: TemplateCaps, names: Mapping[str, str]) -> dict[str, Any]:
    """One message as the template gets it (a tool result the template renders itself)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if caps.tool_calls:
            entry["tool_calls"] = [_template_call(c, caps) for c in message.tool_calls]
            if caps.null_content and not message.content:
                entry["content"] = None
        else:
            calls = "\n".join(bare_json_call(c) for c in message.tool_calls)
            entry["content"] = f"{message.content}\n{calls}" if message.content else calls
    if message.reasoning_content:
        entry["reasoning_content"] = message.reasoning_content
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id
        entry["name"] = message.name or names.get(message.tool_call_id, "")
    elif message.name:
        entry["name"] = message.name  # a participant's name
    return entry


def _template_call(call: ToolCall, caps: TemplateCaps) -> dict[str, Any]:
    arguments: object = call.arguments
    if caps.object_arguments:
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:  # checked on arrival; kept as text if it ever is not JSON
            arguments = call.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
