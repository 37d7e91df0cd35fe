"""Chat values: a message, the built-in chat templates (Jinja source, rendered sandboxed by
engine/chat.py) and which template a request gets. Pure Python: no llama_cpp, no grpc."""

from __future__ import annotations

from dataclasses import dataclass

from llama_grpc_server.core.tools.types import ToolCall

GGUF_TEMPLATE = "gguf"
"""The name reported (and accepted per request) for the template embedded in the model file."""

# Gemma's turn format (as in Gemma 3's own template): a system message is folded into the first
# user turn, "assistant" is spelled "model", and the prompt ends by opening the model's turn.
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('roles must alternate user/assistant/user/... after an optional system message') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""  # noqa: E501  # Jinja source reads best unwrapped

CHATML = """{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}"""

BUILTIN_TEMPLATES: dict[str, str] = {"gemma": GEMMA, "chatml": CHATML}
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a "tool" message: the call it answers
    name: str = ""  # a "tool" message: the function's name
    reasoning_content: str = ""  # an assistant turn's thinking


# The built-in a model without a template of its own gets, by its architecture
# (general.architecture): Gemma's turn format is the same for every Gemma generation with one
# (the embedded Gemma 3 270M is a base model and ships none). Other families get none: a guess
# of a template the model was not trained on would answer, wrongly; a refusal names the fix.
FAMILY_TEMPLATES: dict[str, str] = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
}  # fmt: skip


def template_in_use(configured: str, has_model_template: bool, architecture: str = "") -> str:
    """The server's template: the configured built-in, else the model's own, else its family's
    built-in (FAMILY_TEMPLATES), else "" (none)."""
    if configured:
        return configured
    if has_model_template:
        return GGUF_TEMPLATE
    return FAMILY_TEMPLATES.get(architecture, "")


def template_origin(configured: str, has_model_template: bool, architecture: str = "") -> str:
    """Why template_in_use chose what it chose, for the start-up log."""
    if configured:
        return "configured (--chat-template)"
    if has_model_template:
        return "the model file's own"
    if architecture in FAMILY_TEMPLATES:
        return (
            f"built-in, the {architecture} family's: the model file has none "
            "(--chat-template overrides it)"
        )
    return "none: the model file has none and its family no built-in (see --chat-template)"
