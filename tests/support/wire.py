"""What a generation stream's calls carried on the wire, under the client's resumption: a grpc.aio
interceptor that records, for every call of GenerateTokens / StreamGenerate, the index and
token count of each delta the server sent and the status the call ended with. The client lines
a resumed call up with what the caller had by GenerationDelta.index and drops positions sent
again, so its output alone cannot show a server that repeats or skips positions; this can.
Calls are grouped by their request's prompt (a test gives each stream its own)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from llama_grpc.errors import LlamaGrpcError, from_rpc_error


@dataclass
class Call:
    """One call of a stream: (index, token count, arrival time) of each delta, and its end."""

    deltas: list[tuple[int, int, float]] = field(default_factory=list)
    resumed_from: int = 0  # len(params.resume.token_ids) of the request
    error: LlamaGrpcError | None = None  # None: ended OK (or not yet)

    @property
    def first_at(self) -> float | None:
        """When its first delta with tokens arrived (time.monotonic())."""
        return next((at for _, n, at in self.deltas if n), None)


@dataclass
class WireRecorder(grpc.aio.UnaryStreamClientInterceptor):
    """Records every generation call by its prompt (token ids, or text)."""

    calls: dict[Any, list[Call]] = field(default_factory=dict)

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        call = await continuation(client_call_details, request)
        if not hasattr(request, "params"):
            return call
        record = Call(resumed_from=len(request.params.resume.token_ids))
        self.calls.setdefault(key_of(request), []).append(record)

        async def messages() -> AsyncIterator[Any]:
            try:
                async for message in call:
                    if message.WhichOneof("event") == "delta":
                        delta = message.delta
                        record.deltas.append((delta.index, len(delta.token_ids), time.monotonic()))
                    yield message
            except grpc.RpcError as error:
                record.error = from_rpc_error(error)
                raise

        return messages()


def key_of(request: Any) -> Any:
    """A request's prompt: its token ids (GenerateTokens) or its text."""
    if hasattr(request, "token_ids"):
        return tuple(request.token_ids)
    return request.prompt


def positions(calls: list[Call]) -> list[int]:
    """Every position the calls carried, in the order they came."""
    return [index + i for call in calls for index, n, _ in call.deltas for i in range(n)]


def check_once_each(calls: list[Call], n: int) -> None:
    """The calls carried positions 0..n-1, each exactly once, in order: each call's deltas are
    contiguous, and each call after a cut goes on at the position after everything received
    before (its resume's length): nothing lost, nothing repeated."""
    had = 0
    for number, call in enumerate(calls):
        assert call.resumed_from == had, (number, call.resumed_from, had)
        for index, count, _ in call.deltas:
            if count:
                assert index == had, (number, index, had)
            had += count
    assert positions(calls) == list(range(n))
