"""The EngineApi methods that only forward to the model's Vocabulary (tokenizing, templates,
grammars): any thread may call them, none touches what the engine thread owns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_grpc_server.core.api import Vocabulary
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.tools.types import ToolSpec


class VocabularyFacade:
    """EngineLoop's vocabulary half."""

    def __init__(self, tokenizer: Vocabulary) -> None:
        self._tokenizer = tokenizer

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self._tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str:
        return self._tokenizer.detokenize(token_ids, render_special=render_special)

    def token_piece(self, token_id: int) -> str:
        return self._tokenizer.special_piece(token_id).decode("utf-8", errors="replace")

    def check_grammar(self, gbnf: str, root: str) -> None:
        self._tokenizer.check_grammar(gbnf, root)

    def json_schema_to_grammar(self, schema: str) -> str:
        return self._tokenizer.json_schema_to_grammar(schema)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        return self._tokenizer.render_chat(messages, template, tools, variables)

    def tool_format(self, template: str) -> str:
        return self._tokenizer.tool_format(template)

    def reasoning_format(self, template: str) -> str:
        return self._tokenizer.reasoning_format(template)
