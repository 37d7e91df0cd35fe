"""Chat rendering: role/content messages -> a prompt string, with the model's GGUF template or a
built-in one, in llama-cpp-python's sandboxed Jinja environment (Jinja2ChatFormatter). Thread-safe
after construction: each template is compiled once, rendering keeps no state."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, GGUF_TEMPLATE, ChatMessage

MAX_MESSAGE_CHARS = 300


class ChatTemplateError(ValueError):
    """The template could not render these messages (its own raise_exception, or a Jinja error);
    str() says why."""


class ChatRenderer:
    """Named templates: the built-ins and, when the model has one, "gguf"."""

    def __init__(self, gguf_template: str, *, bos_token: str, eos_token: str) -> None:
        self._sources = dict(BUILTIN_TEMPLATES)
        if gguf_template:
            self._sources[GGUF_TEMPLATE] = gguf_template
        self._bos, self._eos = bos_token, eos_token
        self._formatters: dict[str, Jinja2ChatFormatter] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._sources)

    def render(self, messages: Sequence[ChatMessage], name: str) -> str:
        """The prompt for `messages`, ending with the opening of the assistant's turn."""
        formatter = self._formatter(name)
        payload = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return str(formatter(messages=payload).prompt)  # type: ignore[arg-type]  # TypedDicts
        except Exception as exc:  # a template may raise anything; all mean "cannot render"
            raise ChatTemplateError(f"chat template {name!r}: {exc}"[:MAX_MESSAGE_CHARS]) from None

    def _formatter(self, name: str) -> Jinja2ChatFormatter:
        with self._lock:
            formatter = self._formatters.get(name)
            if formatter is None:
                source = self._sources.get(name)
                if source is None:
                    raise ChatTemplateError(f"no chat template named {name!r}")
                try:
                    formatter = Jinja2ChatFormatter(source, self._eos, self._bos)
                except Exception as exc:  # a broken GGUF template fails to compile
                    raise ChatTemplateError(f"chat template {name!r}: {exc}") from None
                self._formatters[name] = formatter
            return formatter
