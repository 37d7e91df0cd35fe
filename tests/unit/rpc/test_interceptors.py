"""rpc.plumbing.interceptors: request ids, the access log and metric hooks, through a real
server."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.auth import ANONYMOUS, AuthTable, Principal, Role
from llama_grpc_server.config import ServerSettings, Settings
from llama_grpc_server.core.requests.request import GenerationRequest
from llama_grpc_server.rpc.plumbing import interceptors
from llama_grpc_server.rpc.plumbing.access import AccessControl
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.plumbing.status import abort
from llama_grpc_server.testing import FakeEngine, reversed_prompt

SETTINGS = Settings(server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.2))
GENERATE = "/llama_grpc.v1.LlmService/Generate"
STREAM = "/llama_grpc.v1.LlmService/StreamGenerate"


class ListRecorder:
    """An RpcRecorder that remembers its calls."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.handled: list[tuple[str, str, float]] = []
        self.tenants: list[str] = []

    def rpc_started(self, method: str, tenant: str) -> None:
        self.started.append(method)

    def rpc_handled(self, method: str, code: str, seconds: float, tenant: str) -> None:
        self.handled.append((method, code, seconds))
        self.tenants.append(tenant)


@pytest.fixture
def recorder() -> ListRecorder:
    return ListRecorder()


@pytest.fixture
async def server(engine: FakeEngine, recorder: ListRecorder) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine, recorder=recorder) as running:
        assert await running.wait_loaded()
        yield running


async def eventually(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait until predicate() holds: some log lines are written after the client sees the end."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def drain(call: Any) -> None:
    async for _ in call:
        pass


def access_lines(logs: Sequence[Mapping[str, Any]], method: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == "rpc" and e["method"] == method]


async def test_unary_access_line(stub: Any, engine: FakeEngine) -> None:
    """One 'rpc' line per unary call with method, OK, request id, one message, peer, and a
    duration covering the two 10 ms tokens, within what the caller measured around the call."""
    engine.token_delay_s = 0.01
    with capture_logs() as logs:
        start = time.perf_counter()
        await stub.Generate(pb.GenerateRequest(prompt="ab"), metadata=(("x-request-id", "u-1"),))
        caller_ms = (time.perf_counter() - start) * 1000
        await eventually(lambda: bool(access_lines(logs, GENERATE)))
    [line] = access_lines(logs, GENERATE)
    assert line["code"] == "OK"
    assert line["request_id"] == "u-1"
    assert line["messages_sent"] == 1
    assert line["peer"].startswith("ipv4:127.0.0.1")
    assert 2 * 10 <= line["duration_ms"] <= caller_ms
    assert "first_message_ms" not in line
    assert line["log_level"] == "info"


async def test_stream_access_line_has_ttft_and_count(stub: Any, engine: FakeEngine) -> None:
    """A stream's line counts every message and reports the time to the first one (tokens
    50 ms apart: one delta each, none merged)."""
    engine.token_delay_s = 0.05
    with capture_logs() as logs:
        messages = [m async for m in stub.StreamGenerate(pb.StreamGenerateRequest(prompt="abc"))]
        await eventually(lambda: bool(access_lines(logs, STREAM)))
    [line] = access_lines(logs, STREAM)
    assert line["messages_sent"] == len(messages) == 4
    assert 0 <= line["first_message_ms"] <= line["duration_ms"]


async def test_error_code_is_logged(stub: Any) -> None:
    """An aborted call logs the status it ended with."""
    with capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Generate(pb.GenerateRequest(prompt=""))
        # the status can reach the client before the server's handler has logged its line
        await eventually(lambda: bool(access_lines(logs, GENERATE)))
    [line] = access_lines(logs, GENERATE)
    assert line["code"] == "INVALID_ARGUMENT"
    assert line["messages_sent"] == 0


async def test_client_cancel_is_logged_as_cancelled(stub: Any, engine: FakeEngine) -> None:
    """A stream the client cancels logs CANCELLED."""
    engine.token_delay_s = 0.05
    with capture_logs() as logs:
        call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 40))
        await call.read()
        call.cancel()
        await eventually(lambda: bool(access_lines(logs, STREAM)))
    assert access_lines(logs, STREAM)[0]["code"] == "CANCELLED"


async def test_deadline_is_logged_as_deadline_exceeded(stub: Any, engine: FakeEngine) -> None:
    """A stream whose deadline expires logs DEADLINE_EXCEEDED, not CANCELLED."""
    engine.token_delay_s = 0.05
    with capture_logs() as logs:
        call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 40), timeout=0.2)
        with pytest.raises(grpc.aio.AioRpcError):
            await drain(call)
        await eventually(lambda: bool(access_lines(logs, STREAM)))
    assert access_lines(logs, STREAM)[0]["code"] == "DEADLINE_EXCEEDED"


async def test_prompt_text_is_never_logged(stub: Any) -> None:
    """No log entry of a call carries the prompt or the generated text."""
    prompt = "TOP-SECRET-PROMPT"
    with capture_logs() as logs:
        await stub.Generate(pb.GenerateRequest(prompt=prompt))
        await eventually(lambda: bool(access_lines(logs, GENERATE)))
    assert logs
    text = repr(logs)
    assert prompt not in text
    assert prompt[::-1] not in text


async def test_recorder_sees_start_and_end(stub: Any, recorder: ListRecorder) -> None:
    """rpc_started then rpc_handled with the method, the status name and the seconds taken."""
    await stub.Generate(pb.GenerateRequest(prompt="ab"))
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Generate(pb.GenerateRequest(prompt="ab", model="other"))
    # the status can reach the client before the server's handler has recorded its end
    await eventually(lambda: len(recorder.handled) == 2)
    assert recorder.started == [GENERATE, GENERATE]
    assert [(m, c) for m, c, _ in recorder.handled] == [(GENERATE, "OK"), (GENERATE, "NOT_FOUND")]
    assert all(seconds > 0 for _, _, seconds in recorder.handled)


async def test_request_id_is_bound_for_the_handler(stub: Any, engine: FakeEngine) -> None:
    """Inside the handler the id is in the contextvar and the structlog context."""
    seen: dict[str, Any] = {}

    def spy(request: GenerationRequest) -> list[int]:
        seen["current"] = interceptors.current_request_id()
        seen["structlog"] = structlog.contextvars.get_contextvars().get("request_id")
        return list(reversed_prompt(request))

    engine.script = spy
    await stub.Generate(pb.GenerateRequest(prompt="ab"), metadata=(("x-request-id", "ctx-7"),))
    assert seen == {"current": "ctx-7", "structlog": "ctx-7"}
    assert interceptors.current_request_id() == ""


@pytest.mark.parametrize("bad_id", ["x" * 129, ""])
async def test_unreasonable_request_id_is_replaced(stub: Any, bad_id: str) -> None:
    """An over-long or empty x-request-id is replaced by a generated one."""
    call = stub.Generate(pb.GenerateRequest(prompt="ab"), metadata=(("x-request-id", bad_id),))
    response = await call
    echoed = dict(await call.initial_metadata())["x-request-id"]
    assert echoed != bad_id
    assert len(echoed) == 32
    assert response.request_id == echoed


async def test_request_id_reaches_error_responses(stub: Any) -> None:
    """A call refused before its first message is answered trailers-only (no response headers,
    so a router may retry it elsewhere) with x-request-id in its trailers."""
    call = stub.Generate(pb.GenerateRequest(prompt=""), metadata=(("x-request-id", "err-1"),))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert "x-request-id" not in dict(caught.value.initial_metadata())
    assert dict(caught.value.trailing_metadata())["x-request-id"] == "err-1"


async def test_health_watch_works_through_the_interceptor(channel: grpc.aio.Channel) -> None:
    """The aio health Watch (a coroutine writing with context.write) is wrapped correctly."""
    health = health_pb2_grpc.HealthStub(channel)
    with capture_logs() as logs:
        call = health.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await call.read()
        metadata = await call.initial_metadata()
        call.cancel()
        method = "/grpc.health.v1.Health/Watch"
        await eventually(lambda: bool(access_lines(logs, method)))
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    assert "x-request-id" in dict(metadata)
    assert access_lines(logs, method)[0]["code"] == "CANCELLED"


async def test_unknown_method_stays_unimplemented(channel: grpc.aio.Channel) -> None:
    """A method the server lacks still gets UNIMPLEMENTED from grpc."""
    call = channel.unary_unary("/llama_grpc.v1.LlmService/Nope", None, None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


class StubContext:
    """code() and time_remaining() as a finished call would report them."""

    def __init__(
        self, code: grpc.StatusCode | None, remaining: float | None = None, done: bool = False
    ) -> None:
        self._code = code
        self._remaining = remaining
        self._done = done

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:
        return self._remaining

    def done(self) -> bool:
        return self._done


@pytest.mark.parametrize(
    ("code", "remaining", "done", "error", "expected"),
    [
        (None, None, False, None, "OK"),
        (grpc.StatusCode.NOT_FOUND, None, False, None, "NOT_FOUND"),
        (grpc.StatusCode.INTERNAL, None, False, grpc.aio.AbortError(), "INTERNAL"),
        (None, None, False, asyncio.CancelledError(), "CANCELLED"),
        (None, 5.0, False, GeneratorExit(), "CANCELLED"),
        (None, 0.0, False, asyncio.CancelledError(), "DEADLINE_EXCEEDED"),
        (None, 0.009, False, asyncio.CancelledError(), "DEADLINE_EXCEEDED"),  # client's first
        (None, 0.2, False, asyncio.CancelledError(), "CANCELLED"),
        (None, None, False, ValueError("bug"), "UNKNOWN"),
        # grpc ended the call before the handler's error (an abort that could not be sent)
        (None, 0.0, True, RuntimeError("execute_batch"), "DEADLINE_EXCEEDED"),
        (None, 3.0, True, RuntimeError("execute_batch"), "CANCELLED"),
    ],
)
def test_status_name(  # one parameter per column
    code: grpc.StatusCode | None,
    remaining: float | None,
    done: bool,
    error: BaseException | None,
    expected: str,
) -> None:
    """The logged code follows the handler's outcome."""
    context = cast(Any, StubContext(code, remaining, done))
    assert interceptors.status_name(context, error) == expected


async def test_abort_after_grpc_ended_the_call_is_its_deadline(recorder: ListRecorder) -> None:
    """A real server whose handler aborts with DEADLINE_EXCEEDED after grpc's own deadline
    ended the call (the loop was busy when the timer fired, as when the engine's deadline and
    grpc's coincide): the abort cannot be sent (grpc raises ExecuteBatchError), the client gets
    DEADLINE_EXCEEDED, and that, not UNKNOWN, is what the server records."""

    async def late(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        time.sleep(0.4)  # blocks the loop past the 0.2 s deadline on purpose
        await abort(context, errors.DeadlineExceeded("deadline exceeded"), "late-1")

    server = grpc.aio.server(interceptors=[interceptors.RequestInterceptor(recorder)])
    identity = bytes  # (de)serializer: the bytes as they are
    handler = grpc.unary_stream_rpc_method_handler(late, identity, identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.S/M")(b"", timeout=0.2)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await drain(call)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: bool(recorder.handled))
        assert [(method, code) for method, code, _ in recorder.handled] == [
            ("/t.S/M", "DEADLINE_EXCEEDED")
        ]
    finally:
        await server.stop(None)


# -- the wrappers driven directly, in the test's own task -----------------------------------------


class FakeContext:
    """The parts of a grpc.aio ServicerContext the interceptor uses."""

    def __init__(self, remaining: float | None = None) -> None:
        self.sent_metadata: list[tuple[tuple[str, str], ...]] = []
        self._code: grpc.StatusCode | None = None
        self._remaining = remaining

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.sent_metadata.append(metadata)

    async def abort(self, code: grpc.StatusCode, details: str, *trailing: Any) -> None:
        self._code = code
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:
        return self._remaining

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"transport_security_type": [b"insecure"]}


async def intercepted(
    handler: Any, recorder: ListRecorder, request_id: str = "direct-1", **options: Any
) -> Any:
    """`handler` as the interceptor rebuilds it for a call carrying x-request-id."""
    details = cast(
        grpc.HandlerCallDetails,
        SimpleNamespace(method=GENERATE, invocation_metadata=(("x-request-id", request_id),)),
    )

    async def continuation(_: grpc.HandlerCallDetails) -> Any:
        return handler

    interceptor = interceptors.RequestInterceptor(recorder, **options)
    return await interceptor.intercept_service(continuation, details)


def seen_ids() -> dict[str, str]:
    return {
        "current": interceptors.current_request_id(),
        "structlog": structlog.contextvars.get_contextvars().get("request_id", ""),
    }


@pytest.fixture
def outer_binding() -> Iterator[None]:
    """A structlog binding made before the call, which the call must restore."""
    structlog.contextvars.bind_contextvars(request_id="outer")
    yield
    structlog.contextvars.clear_contextvars()


async def test_unary_binds_ids_and_restores_them(
    recorder: ListRecorder, outer_binding: None
) -> None:
    """Inside a unary call the id is bound; afterwards the caller's context is as before; the
    id went out in initial metadata; OK is recorded."""
    inside: list[dict[str, str]] = []

    async def behavior(request: str, context: Any) -> str:
        inside.append(seen_ids())
        return request.upper()

    handler = await intercepted(grpc.unary_unary_rpc_method_handler(behavior), recorder)
    context = FakeContext()
    with capture_logs() as logs:
        assert await handler.unary_unary("hi", context) == "HI"
    assert inside == [{"current": "direct-1", "structlog": "direct-1"}]
    assert seen_ids() == {"current": "", "structlog": "outer"}
    assert context.sent_metadata == [(("x-request-id", "direct-1"),)]
    assert [(m, c) for m, c, _ in recorder.handled] == [(GENERATE, "OK")]
    [line] = access_lines(logs, GENERATE)
    assert (line["code"], line["messages_sent"], line["request_id"]) == ("OK", 1, "direct-1")


async def test_stream_counts_messages_and_restores_ids(recorder: ListRecorder) -> None:
    """A server stream: every yielded message counted, the id bound while it runs (also between
    messages), reset once it ends."""
    inside: list[dict[str, str]] = []

    async def behavior(request: str, context: Any) -> AsyncIterator[str]:
        for char in request:
            inside.append(seen_ids())
            yield char

    handler = await intercepted(grpc.unary_stream_rpc_method_handler(behavior), recorder, "s-1")
    with capture_logs() as logs:
        got = [m async for m in handler.unary_stream("abc", FakeContext())]
    assert got == ["a", "b", "c"]
    assert inside == [{"current": "s-1", "structlog": "s-1"}] * 3
    assert seen_ids() == {"current": "", "structlog": ""}
    [line] = access_lines(logs, GENERATE)
    assert (line["code"], line["messages_sent"]) == ("OK", 3)
    assert 0 <= line["first_message_ms"] <= line["duration_ms"]
    assert [(m, c) for m, c, _ in recorder.handled] == [(GENERATE, "OK")]


async def test_aborted_call_records_its_code_and_resets(recorder: ListRecorder) -> None:
    """context.abort(...) inside the handler: the abort propagates to grpc, its status is
    recorded and logged, and the ids are reset."""

    async def behavior(request: str, context: Any) -> str:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        return "unreachable"

    handler = await intercepted(grpc.unary_unary_rpc_method_handler(behavior), recorder)
    with capture_logs() as logs, pytest.raises(grpc.aio.AbortError):
        await handler.unary_unary("hi", FakeContext())
    assert [(m, c) for m, c, _ in recorder.handled] == [(GENERATE, "RESOURCE_EXHAUSTED")]
    assert access_lines(logs, GENERATE)[0]["log_level"] == "info"
    assert seen_ids() == {"current": "", "structlog": ""}


async def test_cancelled_stream_records_cancelled_and_resets(recorder: ListRecorder) -> None:
    """A stream whose task is cancelled mid-way (client gone) records CANCELLED, logs the
    messages sent so far and resets the ids."""
    release = asyncio.Event()

    async def behavior(request: str, context: Any) -> AsyncIterator[str]:
        yield "first"
        await release.wait()
        yield "never"

    handler = await intercepted(grpc.unary_stream_rpc_method_handler(behavior), recorder)

    async def run_call() -> None:
        async for _ in handler.unary_stream("x", FakeContext(remaining=30.0)):
            pass

    with capture_logs() as logs:
        task = asyncio.create_task(run_call())
        await eventually(lambda: bool(recorder.started))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [(m, c) for m, c, _ in recorder.handled] == [(GENERATE, "CANCELLED")]
    [line] = access_lines(logs, GENERATE)
    assert (line["code"], line["messages_sent"]) == ("CANCELLED", 1)
    assert seen_ids() == {"current": "", "structlog": ""}


async def test_crashing_handler_is_unknown_and_logged_as_error(recorder: ListRecorder) -> None:
    """An exception that is not an abort reaches grpc (UNKNOWN) and the line is an error."""

    async def behavior(request: str, context: Any) -> str:
        raise ZeroDivisionError

    handler = await intercepted(grpc.unary_unary_rpc_method_handler(behavior), recorder)
    with capture_logs() as logs, pytest.raises(ZeroDivisionError):
        await handler.unary_unary("hi", FakeContext())
    [line] = access_lines(logs, GENERATE)
    assert (line["code"], line["log_level"]) == ("UNKNOWN", "error")


async def test_payloads_are_logged_only_when_asked(recorder: ListRecorder) -> None:
    """log_payloads=True puts the request in the access line and logs each sent message."""

    async def behavior(request: Any, context: Any) -> Any:
        return pb.TokenizeResponse(token_ids=[7, 8])

    handler = grpc.unary_unary_rpc_method_handler(behavior)
    quiet = await intercepted(handler, recorder)
    loud = await intercepted(handler, recorder, log_payloads=True)
    request = pb.TokenizeRequest(text="SECRET-TEXT")
    with capture_logs() as quiet_logs:
        await quiet.unary_unary(request, FakeContext())
    with capture_logs() as loud_logs:
        await loud.unary_unary(request, FakeContext())
    assert "SECRET-TEXT" not in repr(quiet_logs)
    [line] = access_lines(loud_logs, GENERATE)
    assert line["request"] == 'text: "SECRET-TEXT"'
    [message] = [e for e in loud_logs if e["event"] == "rpc_message"]
    assert (message["index"], message["message"]) == (0, "token_ids: 7 token_ids: 8")


def test_payload_text_is_bounded() -> None:
    """A huge message is cut for the log."""
    text = interceptors.payload_text(pb.TokenizeRequest(text="x" * 10_000))
    assert len(text) == interceptors.MAX_PAYLOAD_LOG_CHARS


async def test_unknown_caller_is_refused_before_the_handler(recorder: ListRecorder) -> None:
    """With a tokens file, a call without a known token ends UNAUTHENTICATED without running
    its handler; a known one runs with its principal bound, its tenant logged and recorded."""
    table = AuthTable(
        tokens=((hashlib.sha256(b"t" * 16).digest(), Principal("a", Role.USER, "token")),)
    )
    seen: list[str] = []

    async def behavior(request: str, context: Any) -> str:
        seen.append(interceptors.current_principal().tenant)
        return request

    access = AccessControl(table)
    handler = await intercepted(
        grpc.unary_unary_rpc_method_handler(behavior), recorder, access=access
    )
    context = FakeContext()
    with capture_logs() as logs, pytest.raises(grpc.aio.AbortError):
        await handler.unary_unary("hi", context)
    assert context.code() == grpc.StatusCode.UNAUTHENTICATED
    assert seen == []
    assert access_lines(logs, GENERATE)[0]["code"] == "UNAUTHENTICATED"

    details = cast(
        grpc.HandlerCallDetails,
        SimpleNamespace(
            method=GENERATE, invocation_metadata=(("authorization", "Bearer " + "t" * 16),)
        ),
    )

    async def continuation(_: grpc.HandlerCallDetails) -> Any:
        return grpc.unary_unary_rpc_method_handler(behavior)

    interceptor = interceptors.RequestInterceptor(recorder, access=access)
    handler = await interceptor.intercept_service(continuation, details)
    with capture_logs() as logs:
        assert await handler.unary_unary("hi", FakeContext()) == "hi"
    assert seen == ["a"]
    assert access_lines(logs, GENERATE)[0]["tenant"] == "a"
    assert recorder.tenants == ["", "a"]  # the refused call had no tenant yet
    assert interceptors.current_principal() is ANONYMOUS
