"""One chat request's events with its thinking split from its text: each delta's `reasoning`
and `text` are what the splitter releases; what it holds at the end comes in one last delta
before the Finished event. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from llama_grpc_server.core.reasoning.split import ReasoningSplitter
from llama_grpc_server.core.requests.request import Finished, TokenDelta


async def with_reasoning(
    events: AsyncIterator[TokenDelta | Finished], splitter: ReasoningSplitter
) -> AsyncIterator[TokenDelta | Finished]:
    async for event in events:
        if isinstance(event, TokenDelta):
            thinking, answer = splitter.push(event.text)
            yield dataclasses.replace(event, text=answer, reasoning=thinking)
            continue
        thinking, answer = splitter.finish()
        if thinking or answer:
            index = event.usage.completion_tokens  # after the answer's last token
            yield TokenDelta((), answer, reasoning=thinking, index=index)
        yield event
        return
