"""Chat rendering: messages (and tools) -> a prompt string, with the model's GGUF template or a
built-in one, in a sandboxed Jinja environment set up as HuggingFace transformers sets up its
own (trim_blocks, lstrip_blocks, loop controls, its `tojson`, `strftime_now`,
`raise_exception`), which is what the templates are written for. Tools go through
core.tools.prompt: each template is probed once for what it renders (tools, calls, results),
and what it cannot render is rewritten into what it can. Thread-safe after construction: each
template is compiled and probed once, rendering keeps no state."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llama_grpc_server.core.reasoning.formats import reasoning_format_for
from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, GGUF_TEMPLATE, ChatMessage
from llama_grpc_server.core.tools import formats, prompt
from llama_grpc_server.core.tools.types import ToolSpec

MAX_MESSAGE_CHARS = 300


class ChatTemplateError(ValueError):
    """The template could not render these messages (its own raise_exception, or a Jinja error);
    str() says why."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Template:
    """One compiled template, its capabilities probed on first use."""

    def __init__(self, source: str, bos: str, eos: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        self.source = source
        self._template = env.from_string(source)
        self._bos, self._eos = bos, eos
        self._caps: prompt.TemplateCaps | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        return str(
            self._template.render(
                **(variables or {}),
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
                raise_exception=_raise_exception,
                strftime_now=_strftime_now,
            )
        )

    @property
    def caps(self) -> prompt.TemplateCaps:
        if self._caps is None:  # racing threads probe alike: the same value either way
            self._caps = prompt.probe(self.render)
        return self._caps


class ChatRenderer:
    """Named templates: the built-ins and, when the model has one, "gguf"."""

    def __init__(self, gguf_template: str, *, bos_token: str, eos_token: str) -> None:
        self._sources = dict(BUILTIN_TEMPLATES)
        if gguf_template:
            self._sources[GGUF_TEMPLATE] = gguf_template
        self._bos, self._eos = bos_token, eos_token
        self._templates: dict[str, _Template] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._sources)

    def render(
        self,
        messages: Sequence[ChatMessage],
        name: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages` (offering `tools`, with more template `variables`),
        ending with the opening of the assistant's turn."""
        template = self._template(name)
        has_tool_parts = tools or any(m.tool_calls or m.role == "tool" for m in messages)
        caps = template.caps if has_tool_parts else prompt.TemplateCaps()
        payload = prompt.template_messages(messages, caps, tools)
        listed = [prompt.openai_tool(t) for t in tools] if tools and caps.tools else None
        try:
            return template.render(payload, listed, variables)
        except Exception as exc:  # a template may raise anything; all mean "cannot render"
            raise ChatTemplateError(f"chat template {name!r}: {exc}"[:MAX_MESSAGE_CHARS]) from None

    def tool_format(self, name: str) -> str:
        """The name of the tool-call format the template's model writes (core.tools.formats)."""
        return formats.format_for(self._template(name).source).name

    def reasoning_format(self, name: str) -> str:
        """The name of the template's thinking format (core.reasoning.formats), or ""."""
        found = reasoning_format_for(self._template(name).source)
        return "" if found is None else found.name

    def _template(self, name: str) -> _Template:
        with self._lock:
            template = self._templates.get(name)
            if template is None:
                source = self._sources.get(name)
                if source is None:
                    raise ChatTemplateError(f"no chat template named {name!r}")
                try:
                    template = _Template(source, self._bos, self._eos)
                except Exception as exc:  # a broken GGUF template fails to compile
                    raise ChatTemplateError(f"chat template {name!r}: {exc}") from None
                self._templates[name] = template
            return template
