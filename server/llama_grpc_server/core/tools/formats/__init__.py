"""The tool-call formats, one module each, and which one a chat template gets.

`FORMATS` is in match order: the first whose `matches(template)` is true is the template's
format (`format_for`), `generic` (the bare JSON rule only) last, matching everything. The most
specific tests come first: Gemma 4's `<|tool_call>call:`, DeepSeek's tokens, Mistral's
`[TOOL_CALLS]`, Qwen XML's `<function=`/`<parameter=` (before hermes, whose `<tool_call>` the
Qwen 3.5 template also holds), hermes, Phi-4-mini's `functools`/`<|tool_call|>` (before Llama 3,
whose header tokens Firefunction v2's template shares), Llama 3's headers."""

from __future__ import annotations

from ..types import ToolFormat
from . import deepseek, gemma4, generic, hermes, llama3_json, mistral, phi4_mini, qwen_xml

FORMATS: tuple[ToolFormat, ...] = (
    gemma4.FORMAT,
    deepseek.FORMAT,
    mistral.FORMAT,
    qwen_xml.FORMAT,
    hermes.FORMAT,
    phi4_mini.FORMAT,
    llama3_json.FORMAT,
    generic.FORMAT,
)

_BY_NAME = {fmt.name: fmt for fmt in FORMATS}


def format_for(template: str) -> ToolFormat:
    """The format of the first of FORMATS that matches `template` (`generic` at worst)."""
    return next(fmt for fmt in FORMATS if fmt.matches(template))


def format_named(name: str) -> ToolFormat:
    """The format called `name`; KeyError when there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no tool-call format {name!r} (known: {', '.join(_BY_NAME)})") from None
