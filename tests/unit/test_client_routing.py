"""Client routing against real grpc.aio servers on 127.0.0.1:0 around the FakeEngine: the
x-session-id / x-cache-scope headers a proxy hashes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest

from llama_grpc import AsyncClient, Client
from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.rpc import server as server_module
from llama_grpc_server.rpc.interceptors import RequestInterceptor
from llama_grpc_server.rpc.server import RunningServer, start_server
from llama_grpc_server.testing import FakeEngine, encode

SETTINGS = Settings(
    scheduler=SchedulerSettings(default_max_tokens=8),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
)
GENERATION_METHODS = ("Generate", "StreamGenerate", "Generate", "StreamGenerate", "GenerateTokens")
ROUTING_KEYS = ("x-session-id", "x-cache-scope")

Metadata = tuple[tuple[str, str], ...]
Seen = list[tuple[str, Metadata]]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """(method name, invocation metadata) of every RPC the servers started after this receive,
    recorded by the server's own interceptor class, extended."""
    calls: Seen = []

    class RecordingInterceptor(RequestInterceptor):
        async def intercept_service(
            self,
            continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            handler_call_details: grpc.HandlerCallDetails,
        ) -> Any:
            metadata = tuple(
                (key, value) for key, value in handler_call_details.invocation_metadata or ()
            )
            calls.append((handler_call_details.method.rsplit("/", 1)[-1], metadata))
            return await super().intercept_service(continuation, handler_call_details)

    monkeypatch.setattr(server_module, "RequestInterceptor", RecordingInterceptor)
    return calls


@pytest.fixture
async def server(seen: Seen) -> AsyncIterator[RunningServer]:
    engine = FakeEngine()
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        yield running


def _generation_calls(seen: Seen) -> Seen:
    return [(method, metadata) for method, metadata in seen if method in GENERATION_METHODS]


def _routing(metadata: Metadata) -> dict[str, str]:
    """The routing headers among `metadata`; a key sent twice fails the test."""
    pairs = [(key, value) for key, value in metadata if key in ROUTING_KEYS]
    assert len({key for key, _ in pairs}) == len(pairs), pairs
    return dict(pairs)


async def _every_generation_call(client: AsyncClient, **params: Any) -> None:
    await client.generate("ab", **params)
    async with client.stream("ab", **params) as stream:
        [event async for event in stream]
    await client.chat([("user", "hi")], chat_template="chatml", **params)
    async with client.stream_chat(
        [("user", "hi")], chat_template="chatml", **params
    ) as chat_stream:
        [event async for event in chat_stream]
    async with client.generate_tokens(encode("ab"), **params) as token_stream:
        [event async for event in token_stream]


def _every_generation_call_sync(client: Client, **params: Any) -> None:
    client.generate("ab", **params)
    with client.stream("ab", **params) as stream:
        list(stream)
    client.chat([("user", "hi")], chat_template="chatml", **params)
    with client.stream_chat([("user", "hi")], chat_template="chatml", **params) as chat_stream:
        list(chat_stream)
    with client.generate_tokens(encode("ab"), **params) as token_stream:
        list(token_stream)


@pytest.fixture
def sync_client(server: RunningServer) -> Iterator[Client]:
    with Client(f"127.0.0.1:{server.port}", timeout=10) as client:
        yield client


@pytest.fixture
async def async_client(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        yield client


# -- routing headers -------------------------------------------------------------------------------


async def test_every_async_generation_call_sends_session_and_scope_headers(
    async_client: AsyncClient, seen: Seen
) -> None:
    """generate, stream, chat, stream_chat and generate_tokens all carry both headers."""
    await _every_generation_call(async_client, session_id="conv-7", cache_scope="team-a")
    calls = _generation_calls(seen)
    assert [method for method, _ in calls] == list(GENERATION_METHODS)
    for _, metadata in calls:
        assert _routing(metadata) == {"x-session-id": "conv-7", "x-cache-scope": "team-a"}


async def test_every_sync_generation_call_sends_session_and_scope_headers(
    sync_client: Client, seen: Seen
) -> None:
    """The sync client does the same (run in a thread: the servers share this event loop)."""
    await asyncio.to_thread(
        _every_generation_call_sync, sync_client, session_id="conv-8", cache_scope="team-b"
    )
    calls = _generation_calls(seen)
    assert [method for method, _ in calls] == list(GENERATION_METHODS)
    for _, metadata in calls:
        assert _routing(metadata) == {"x-session-id": "conv-8", "x-cache-scope": "team-b"}


async def test_only_the_fields_given_become_headers(async_client: AsyncClient, seen: Seen) -> None:
    """An empty or left-out session_id / cache_scope sends no header; other RPCs send none."""
    await _every_generation_call(async_client, session_id="only-session")
    await _every_generation_call(async_client, session_id="", cache_scope="")
    await async_client.tokenize("ab")
    await async_client.stats()
    calls = _generation_calls(seen)
    assert [_routing(metadata) for _, metadata in calls] == (
        [{"x-session-id": "only-session"}] * 5 + [{}] * 5
    )
    others = [metadata for method, metadata in seen if method in ("Tokenize", "GetStats")]
    assert len(others) == 2
    assert all(_routing(metadata) == {} for metadata in others)


async def test_values_outside_printable_ascii_are_percent_encoded(
    async_client: AsyncClient, sync_client: Client, seen: Seen
) -> None:
    """A session id with non-ASCII text or spaces still makes a valid call (a raw header value
    would fail with INTERNAL "Invalid metadata"); the header is its UTF-8, percent-encoded."""
    result = await async_client.generate("ab", session_id="café 1", cache_scope="a%b")
    await asyncio.to_thread(sync_client.generate, "ab", session_id="café 1", cache_scope="a%b")
    assert result.text == "ba"
    for _, metadata in _generation_calls(seen):
        assert _routing(metadata) == {"x-session-id": "caf%C3%A9%201", "x-cache-scope": "a%25b"}


async def test_the_callers_own_header_wins(async_client: AsyncClient, seen: Seen) -> None:
    """Metadata the caller passes with the same key is sent instead, not twice."""
    await async_client.generate("ab", session_id="body", metadata={"x-session-id": "mine"})
    [(_, metadata)] = _generation_calls(seen)
    assert _routing(metadata) == {"x-session-id": "mine"}
