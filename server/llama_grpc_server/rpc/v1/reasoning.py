"""v1's chat options for thinking models: a chat request's template variables
(chat_template_kwargs, enable_thinking) and reasoning budget, checked (INVALID_ARGUMENT naming
the field). What a thinking request needs from its model is rpc.shared.thinking's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.rpc.v1 import validation

TextRequest = pb.GenerateRequest | pb.StreamGenerateRequest


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """A chat request's extra template variables and reasoning budget (None: the server's)."""

    variables: dict[str, Any] = dataclasses.field(default_factory=dict)
    budget: int | None = None


def parse_chat_options(message: TextRequest) -> ChatOptions:
    """enable_thinking, chat_template_kwargs and reasoning_budget, checked."""
    variables: dict[str, Any] = {}
    if message.chat_template_kwargs.strip():
        variables = validation.json_object(
            "chat_template_kwargs", message.chat_template_kwargs, "chat_template_kwargs"
        )
    if message.HasField("enable_thinking"):
        variables["enable_thinking"] = message.enable_thinking
    budget = message.reasoning_budget if message.HasField("reasoning_budget") else None
    if budget is not None and budget < -1:
        raise errors.InvalidRequest(
            f"reasoning_budget must be -1 (no limit), 0 (no thinking) or more, got {budget}",
            field="reasoning_budget",
        )
    if (variables or budget is not None) and not message.messages:
        field = "reasoning_budget" if budget is not None else "chat_template_kwargs"
        if message.HasField("enable_thinking"):
            field = "enable_thinking"
        raise errors.InvalidRequest(f"{field} applies to messages only", field=field)
    return ChatOptions(variables, budget)
