"""Running a request against the model pool, whichever protocol asked: the pool a servicer
serves (NOT_READY until the default model loads), a text tokenized off the event loop when
long, the call's deadline, and run_request, which submits a GenerationRequest and yields its
events, cancelling it in the engine when the caller leaves early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from llama_grpc_server import errors
from llama_grpc_server.core.api import EngineApi, RequestStream
from llama_grpc_server.core.requests.request import (
    Failed,
    Finished,
    GenerationRequest,
    Resumed,
    TokenDelta,
)
from llama_grpc_server.models.pool import ModelPool
from llama_grpc_server.observability import tracing
from llama_grpc_server.rpc.plumbing.interceptors import deadline_expired

# Short texts tokenize inline; only long ones are worth a thread hop.
TOKENIZE_INLINE_MAX_CHARS = 4096
NO_RESULT = "the engine ended the request without a result"

if TYPE_CHECKING:  # generic only in grpc-stubs
    Context = grpc.aio.ServicerContext[Any, Any]


class NotReady(errors.ServiceError):
    """The model is still loading; retry shortly (or elsewhere)."""

    code = "UNAVAILABLE"
    reason = "NOT_READY"


async def tokenize_text(
    engine: EngineApi, text: str, *, add_special: bool, parse_special: bool
) -> list[int]:
    """llama_tokenize releases the GIL and is thread-safe, so long texts go to a thread."""
    if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
        return engine.tokenize(text, add_special=add_special, parse_special=parse_special)
    return await asyncio.to_thread(
        engine.tokenize, text, add_special=add_special, parse_special=parse_special
    )


def deadline_from(time_remaining_s: float | None, now: float) -> float | None:
    """A gRPC time_remaining() (seconds or None) as an absolute time.monotonic() deadline."""
    return None if time_remaining_s is None else now + max(0.0, time_remaining_s)


def deadline_of(context: Context) -> float | None:
    """The call's deadline as a time.monotonic() time; None when it has none."""
    return deadline_from(context.time_remaining(), time.monotonic())


async def run_request(
    engine: EngineApi,
    spec: GenerationRequest,
    context: Context,
    operation: str = "text_completion",
    *,
    on_submit: Callable[[RequestStream], None] | None = None,
    on_resumed: Callable[[str], None] | None = None,
) -> AsyncGenerator[TokenDelta | Finished, None]:
    """Submit and yield deltas, then the Finished event. A Failed event raises its error.
    Leaving early (client cancel, deadline, closed stream) cancels the request in the engine,
    as a deadline exceeded when the call's deadline has passed (the access log's test too).
    With tracing on, the finished request's GenAI attributes and phases go on the RPC's span.
    `on_submit` is handed the engine's stream (to cancel it from elsewhere); `on_resumed` the
    text of a resumed request's resumed tokens (its Resumed event, never yielded: the caller
    has that text)."""
    submitted_unix_ns = time.time_ns()
    stream = engine.submit(spec)
    if on_submit is not None:
        on_submit(stream)
    is_done = False
    try:
        async for event in stream:
            if isinstance(event, Resumed):
                if on_resumed is not None:
                    on_resumed(event.text)
                continue
            if isinstance(event, Failed):
                is_done = True
                raise event.error
            if isinstance(event, Finished):
                is_done = True
                model = engine.model_info.model_name
                tracing.record_generation(
                    spec,
                    event,
                    model=model,
                    operation=operation,
                    submitted_unix_ns=submitted_unix_ns,
                )
                yield event
                return
            yield event
        raise errors.EngineError(NO_RESULT)
    finally:
        if not is_done:
            stream.cancel(deadline_exceeded=deadline_expired(context))


class PoolServicer:
    """A servicer of the model pool, which is attached once the default model has loaded (see
    rpc.plumbing.wiring); until then calls answer NOT_READY."""

    _pool: ModelPool | None = None

    def attach(self, pool: ModelPool) -> None:
        """Start serving: the default model is loaded."""
        self._pool = pool

    def _ready_pool(self) -> ModelPool:
        if self._pool is None:
            raise NotReady("the model is still loading; retry shortly")
        return self._pool
