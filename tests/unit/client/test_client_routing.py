"""Client routing against real grpc.aio servers on 127.0.0.1:0 around the FakeEngine: the
x-session-id / x-cache-scope headers a proxy hashes on, and one client balancing over several
servers (gRPC's round_robin with client-side health checking) without a proxy."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from llama_grpc import AsyncClient, Client, TlsConfig, UnavailableError, cli
from llama_grpc.routing import BALANCED_SERVICE_CONFIG, LLM_SERVICE_NAME, balanced_target
from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.rpc.plumbing import wiring
from llama_grpc_server.rpc.plumbing.health import NOT_SERVING, SERVING
from llama_grpc_server.rpc.plumbing.interceptors import RequestInterceptor
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.testing import FakeEngine, encode
from tests.support.certs import make_pki, openssl_available

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

    monkeypatch.setattr(wiring, "RequestInterceptor", RecordingInterceptor)
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


# -- one channel over several servers --------------------------------------------------------------

CALLS = 20


class Replica:
    """A started server, its engine and its address."""

    def __init__(self, running: RunningServer, engine: FakeEngine) -> None:
        self.running, self.engine = running, engine
        self.address = f"127.0.0.1:{running.port}"

    @property
    def started(self) -> int:
        """Generation requests this server's engine has started."""
        return self.engine.stats().requests_started

    async def set_health(self, status: Any) -> None:
        await self.running.health.set(LLM_SERVICE_NAME, status)


@contextlib.asynccontextmanager
async def _two_replicas(settings: Settings) -> AsyncIterator[tuple[Replica, Replica]]:
    async with contextlib.AsyncExitStack() as stack:
        pair = []
        for _ in range(2):
            engine = FakeEngine()
            running = await stack.enter_async_context(start_server(settings, lambda e=engine: e))
            assert await running.wait_loaded()
            pair.append(Replica(running, engine))
        yield pair[0], pair[1]


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[Replica, Replica]]:
    """Two servers, each with its own FakeEngine, both SERVING."""
    async with _two_replicas(SETTINGS) as pair:
        yield pair


async def _counts(client: AsyncClient, replicas: tuple[Replica, ...], calls: int) -> list[int]:
    """How many of `calls` generate() calls each replica served."""
    before = [replica.started for replica in replicas]
    for _ in range(calls):
        await client.generate("ab")
    return [replica.started - start for replica, start in zip(replicas, before, strict=True)]


async def test_a_target_list_spreads_calls_over_every_server(
    replicas: tuple[Replica, Replica],
) -> None:
    """Both SERVING: round robin gives each server a fair share (not all to the first, as
    gRPC's default pick_first would)."""
    async with AsyncClient([r.address for r in replicas], timeout=10) as client:
        counts = await _counts(client, replicas, CALLS)
    assert sum(counts) == CALLS
    assert min(counts) >= CALLS // 4, counts  # a server may connect a little later than the other


async def test_a_not_serving_server_gets_no_calls(replicas: tuple[Replica, Replica]) -> None:
    """Client-side health checking: with one server's LlmService NOT_SERVING, every call lands
    on the other."""
    first, second = replicas
    await first.set_health(NOT_SERVING)
    async with AsyncClient([first.address, second.address], timeout=10) as client:
        assert await _counts(client, replicas, CALLS) == [0, CALLS]


async def test_the_sync_client_balances_the_same(replicas: tuple[Replica, Replica]) -> None:
    """Client (sync) takes a list too: the NOT_SERVING server is skipped."""
    first, second = replicas
    await second.set_health(NOT_SERVING)

    def calls() -> None:
        with Client([first.address, second.address], timeout=10) as client:
            for _ in range(CALLS):
                client.generate("ab")

    await asyncio.to_thread(calls)
    assert (first.started, second.started) == (CALLS, 0)


async def _until_only(client: AsyncClient, replicas: tuple[Replica, ...], index: int) -> None:
    """Call until a call lands on replicas[index] alone (health updates arrive asynchronously)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        counts = await _counts(client, replicas, 2)
        if counts[index] == 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"calls did not move to replica {index} within 5 s")


async def test_health_changes_move_calls_while_the_channel_is_open(
    replicas: tuple[Replica, Replica],
) -> None:
    """A server turning NOT_SERVING (draining, engine dead) stops getting calls on the open
    channel, and gets them again once SERVING."""
    first, second = replicas
    async with AsyncClient([first.address, second.address], timeout=10) as client:
        await _counts(client, replicas, 4)
        await first.set_health(NOT_SERVING)
        await _until_only(client, replicas, 1)
        assert await _counts(client, replicas, CALLS) == [0, CALLS]
        await first.set_health(SERVING)
        deadline = time.monotonic() + 5
        while (await _counts(client, replicas, 2))[0] == 0:
            assert time.monotonic() < deadline, "the server did not get calls again"
            await asyncio.sleep(0.05)


async def test_no_serving_server_fails_at_once(replicas: tuple[Replica, Replica]) -> None:
    """With every server NOT_SERVING a call fails UNAVAILABLE at once ("backend unhealthy")."""
    for replica in replicas:
        await replica.set_health(NOT_SERVING)
    async with AsyncClient([r.address for r in replicas], timeout=10) as client:
        with pytest.raises(UnavailableError, match="unhealthy"):
            await client.generate("ab")


async def test_balance_applies_to_a_dns_target(replicas: tuple[Replica, Replica]) -> None:
    """balance=True puts the same policy on a dns: target: its NOT_SERVING server is skipped
    (so the call fails), while without balance gRPC's pick_first calls it anyway."""
    first, _ = replicas
    await first.set_health(NOT_SERVING)
    async with AsyncClient(f"dns:///{first.address}", timeout=10, balance=True) as client:
        with pytest.raises(UnavailableError, match="unhealthy"):
            await client.generate("ab")
    async with AsyncClient(f"dns:///{first.address}", timeout=10) as client:
        assert (await client.generate("ab")).text == "ba"


async def test_tls_over_a_target_list_checks_the_server_name(tmp_path: Path) -> None:
    """Over TLS every replica's certificate is checked against TlsConfig.server_name (the list
    itself names no host), and calls still spread over both."""
    if not openssl_available():
        pytest.skip("needs the openssl command line tool")
    pki = make_pki(tmp_path)
    server = dataclasses.replace(
        SETTINGS.server, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)
    )
    async with _two_replicas(dataclasses.replace(SETTINGS, server=server)) as replicas:
        tls = TlsConfig(ca=pki.ca_cert, server_name="localhost")
        async with AsyncClient([r.address for r in replicas], tls=tls, timeout=10) as client:
            counts = await _counts(client, replicas, CALLS)
    assert min(counts) >= CALLS // 4, counts


@pytest.mark.parametrize(
    ("addresses", "uri"),
    [
        (["10.0.0.1:50051", "10.0.0.2:50052"], "ipv4:10.0.0.1:50051,10.0.0.2:50052"),
        (("[::1]:1", "[fd00::2]:2"), "ipv6:[::1]:1,[fd00::2]:2"),
        (["127.0.0.1:50051"], "ipv4:127.0.0.1:50051"),
    ],
)
def test_ip_lists_become_one_target_uri(addresses: list[str], uri: str) -> None:
    """IP:PORT addresses (IPv6 in brackets) join into one ipv4: or ipv6: target."""
    assert balanced_target(addresses) == uri


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        (["10.0.0.1:1", "db.example:50051"], "pass target='dns:///db.example:50051' with balance"),
        (["10.0.0.1:1", "[::1]:2"], "all IPv4 or all IPv6"),
        (["10.0.0.1"], "not IP:PORT"),
        (["10.0.0.1:0"], "not IP:PORT"),
        (["::1:50051"], r"\[ADDRESS\]:PORT"),
        (["dns:///db.example:50051"], "goes alone"),
        ([], "empty"),
    ],
)
def test_target_lists_take_ip_addresses_only(addresses: list[str], message: str) -> None:
    """A host name (never resolved in a list) or a malformed address is a ValueError that says
    what to pass instead."""
    with pytest.raises(ValueError, match=message):
        balanced_target(addresses)


def test_the_service_config_is_round_robin_with_health_checking() -> None:
    """The channel option the client adds, as gRPC reads it."""
    assert json.loads(BALANCED_SERVICE_CONFIG) == {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "llama_grpc.v1.LlmService"},
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": ["10.0.0.1:1"], "balance": False}, "always balanced"),
        ({"target": ["10.0.0.1:1"], "tls": True}, "server_name"),
        ({"target": ["10.0.0.1:1"], "tls": TlsConfig()}, "server_name"),
        ({"balance": True, "options": [("grpc.service_config", "{}")]}, "your own service config"),
        ({"target": ["10.0.0.1:1"], "channel": True}, "not to `channel`"),
        ({"balance": True, "channel": True}, "not to `channel`"),
    ],
)
async def test_contradictory_balancing_arguments_are_refused(
    kwargs: dict[str, Any], message: str
) -> None:
    """Arguments that cannot hold together fail at construction, naming the way out."""
    with contextlib.ExitStack() as stack:
        if kwargs.get("channel"):
            kwargs["channel"] = stack.enter_context(grpc.insecure_channel("127.0.0.1:1"))
        with pytest.raises(ValueError, match=message):
            Client(**kwargs)
    async with contextlib.AsyncExitStack() as astack:
        if kwargs.get("channel"):
            kwargs["channel"] = await astack.enter_async_context(
                grpc.aio.insecure_channel("127.0.0.1:1")
            )
        with pytest.raises(ValueError, match=message):
            AsyncClient(**kwargs)


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "target"),
    [
        ("127.0.0.1:1", "127.0.0.1:1"),
        ("10.0.0.1:1, 10.0.0.2:2", ["10.0.0.1:1", "10.0.0.2:2"]),
        ("ipv4:10.0.0.1:1,10.0.0.2:2", "ipv4:10.0.0.1:1,10.0.0.2:2"),
        ("dns:///llm.internal:50051", "dns:///llm.internal:50051"),
    ],
)
def test_cli_target_lists_split_on_commas(value: str, target: str | list[str]) -> None:
    """A comma-separated --target is a list of replicas unless it is a URI with its own scheme."""
    assert cli.target_of(value) == target


async def test_cli_calls_the_serving_replica_of_a_list(
    replicas: tuple[Replica, Replica], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--target A,B` balances like Client([A, B]): the NOT_SERVING replica gets nothing."""
    first, second = replicas
    await first.set_health(NOT_SERVING)
    argv = ["generate", "ab", "--target", f"{first.address},{second.address}", "--timeout", "10"]
    for _ in range(3):
        assert await asyncio.to_thread(cli.main, argv) == 0
    lines = capsys.readouterr().out.splitlines()  # the servers' access log shares stdout
    assert lines.count("ba") == 3
    assert (first.started, second.started) == (0, 3)


def test_cli_refuses_a_host_name_in_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    """A host name in a --target list is a usage error that points to dns:///."""
    argv = ["stats", "--target", "127.0.0.1:1,llm.internal:50051"]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "dns:///llm.internal:50051" in capsys.readouterr().err
