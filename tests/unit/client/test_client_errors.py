"""Status codes and google.rpc details -> typed client errors, for sync and aio calls."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import grpc_testing
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llama_grpc import (
    AsyncClient,
    Client,
    ContextLengthExceededError,
    DeadlineExceededError,
    Delta,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KvCacheFullError,
    LlamaGrpcError,
    ModelNotFoundError,
    PermissionDeniedError,
    QueueFullError,
    RequestCancelledError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["LlmService"]
Code = grpc.StatusCode


def _error_info(reason: str, domain: str = "llama-grpc", **metadata: str) -> Message:
    return error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)


def _status(code: grpc.StatusCode, message: str, *details: Message) -> Any:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    return status_pb2.Status(code=code.value[0], message=message, details=packed)


@pytest.fixture
def scripted() -> Iterator[tuple[Client, Any, ThreadPoolExecutor]]:
    """A sync Client over a grpc_testing channel, plus a thread for its blocking call."""
    channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
    with ThreadPoolExecutor(max_workers=1) as pool, Client(channel=channel) as client:
        yield client, channel, pool


def _fail_tokenize(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
    code: grpc.StatusCode,
    message: str,
    *details: Message,
    trailing: tuple[tuple[str, str | bytes], ...] = (),
    status_code: grpc.StatusCode | None = None,
) -> LlamaGrpcError:
    """Make tokenize() fail with `code`; the rich status may claim `status_code` instead."""
    client, channel, pool = scripted
    future = pool.submit(client.tokenize, "x")
    _, _, rpc = channel.take_unary_unary(SERVICE.methods_by_name["Tokenize"])
    if details or status_code is not None:
        rich = _status(status_code or code, message, *details)
        trailing = trailing + tuple(rpc_status.to_status(rich).trailing_metadata)
    rpc.terminate(pb.TokenizeResponse(), trailing, code, message)
    error = future.exception(timeout=5)
    assert isinstance(error, LlamaGrpcError)
    return error


@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [
        (Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", InvalidArgumentError),
        (Code.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED", ContextLengthExceededError),
        (Code.NOT_FOUND, "MODEL_NOT_FOUND", ModelNotFoundError),
        (Code.FAILED_PRECONDITION, "FAILED_PRECONDITION", FailedPreconditionError),
        (Code.RESOURCE_EXHAUSTED, "QUEUE_FULL", QueueFullError),
        (Code.RESOURCE_EXHAUSTED, "KV_CACHE_FULL", KvCacheFullError),
        (Code.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", DeadlineExceededError),
        (Code.UNAVAILABLE, "SHUTTING_DOWN", UnavailableError),
        (Code.INTERNAL, "ENGINE_ERROR", InternalError),
        (Code.CANCELLED, "CANCELLED", RequestCancelledError),
        (Code.INTERNAL, "INTERNAL", InternalError),
    ],
)
def test_error_info_reason_picks_the_class(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
    code: grpc.StatusCode,
    reason: str,
    expected: type[LlamaGrpcError],
) -> None:
    """Each llama-grpc ErrorInfo reason maps to its own exception class."""
    error = _fail_tokenize(scripted, code, "boom", _error_info(reason))
    assert type(error) is expected
    assert (error.code, error.reason, error.message) == (code.name, reason, "boom")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (Code.INVALID_ARGUMENT, InvalidArgumentError),
        (Code.NOT_FOUND, ModelNotFoundError),
        (Code.FAILED_PRECONDITION, FailedPreconditionError),
        (Code.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (Code.DEADLINE_EXCEEDED, DeadlineExceededError),
        (Code.CANCELLED, RequestCancelledError),
        (Code.UNAVAILABLE, UnavailableError),
        (Code.UNAUTHENTICATED, UnauthenticatedError),
        (Code.PERMISSION_DENIED, PermissionDeniedError),
        (Code.INTERNAL, InternalError),
        (Code.UNKNOWN, LlamaGrpcError),
        (Code.UNIMPLEMENTED, LlamaGrpcError),
    ],
)
def test_status_code_alone_picks_the_class(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
    code: grpc.StatusCode,
    expected: type[LlamaGrpcError],
) -> None:
    """Without details the status code decides; the reason is the code's name."""
    error = _fail_tokenize(scripted, code, "plain")
    assert type(error) is expected
    assert (error.code, error.reason, error.field, error.retry_after_s) == (
        code.name,
        code.name,
        None,
        None,
    )


def test_bad_request_names_the_field_and_error_info_metadata_is_kept(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """BadRequest's first violation gives .field; ErrorInfo.metadata gives .metadata."""
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="params.stopping.max_tokens", description="too many"
            )
        ]
    )
    info = _error_info("CONTEXT_LENGTH_EXCEEDED", prompt_tokens="900", max_context="512")
    error = _fail_tokenize(scripted, Code.INVALID_ARGUMENT, "prompt too long", info, bad)
    assert isinstance(error, ContextLengthExceededError)
    assert isinstance(error, InvalidArgumentError)
    assert error.field == "params.stopping.max_tokens"
    assert error.metadata == {"prompt_tokens": "900", "max_context": "512"}
    assert str(error) == "INVALID_ARGUMENT CONTEXT_LENGTH_EXCEEDED: prompt too long"


def test_retry_info_gives_retry_after_seconds(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """RetryInfo.retry_delay becomes .retry_after_s in seconds."""
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=1, nanos=5 * 10**8)
    )
    error = _fail_tokenize(
        scripted, Code.RESOURCE_EXHAUSTED, "queue full", _error_info("QUEUE_FULL"), retry
    )
    assert isinstance(error, QueueFullError)
    assert isinstance(error, ResourceExhaustedError)
    assert error.retry_after_s == pytest.approx(1.5)
    assert str(error) == "RESOURCE_EXHAUSTED QUEUE_FULL: queue full"


def test_request_id_comes_from_request_info_first(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """RequestInfo.request_id wins over the x-request-id trailer."""
    info = error_details_pb2.RequestInfo(request_id="from-details")
    error = _fail_tokenize(
        scripted,
        Code.INTERNAL,
        "engine failed",
        _error_info("ENGINE_ERROR"),
        info,
        trailing=(("x-request-id", "from-trailer"),),
    )
    assert error.request_id == "from-details"


def test_request_id_falls_back_to_metadata(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """Without RequestInfo, the x-request-id trailer identifies the request."""
    error = _fail_tokenize(
        scripted, Code.INTERNAL, "x", trailing=(("x-request-id", "from-trailer"),)
    )
    assert error.request_id == "from-trailer"


def test_foreign_domain_reason_does_not_pick_the_class(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """An ErrorInfo from another domain (a proxy) keeps its reason but the code decides."""
    error = _fail_tokenize(
        scripted, Code.RESOURCE_EXHAUSTED, "rate limited", _error_info("QUEUE_FULL", "proxy.io")
    )
    assert type(error) is ResourceExhaustedError
    assert error.reason == "QUEUE_FULL"


def test_inconsistent_rich_status_falls_back_to_the_code(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """Details whose code disagrees with the status are ignored instead of crashing."""
    error = _fail_tokenize(
        scripted,
        Code.UNAVAILABLE,
        "draining",
        _error_info("QUEUE_FULL"),
        status_code=Code.RESOURCE_EXHAUSTED,
    )
    assert type(error) is UnavailableError
    assert error.reason == "UNAVAILABLE"


def test_errors_are_not_grpc_types(scripted: tuple[Client, Any, ThreadPoolExecutor]) -> None:
    """Callers catch LlamaGrpcError; the grpc error is only the chained cause."""
    error = _fail_tokenize(scripted, Code.INTERNAL, "x")
    assert not isinstance(error, grpc.RpcError)
    assert isinstance(error.__cause__, grpc.RpcError)


def test_unreachable_server_is_unavailable() -> None:
    """A connection refused surfaces as UnavailableError."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Client(f"127.0.0.1:{port}", timeout=5) as client, pytest.raises(UnavailableError):
        client.stats()


# --- aio errors from a real grpc.aio server ---------------------------------------------------


class FailingServicer(pb_grpc.LlmServiceServicer):
    """Aborts with rich statuses, the way the real server reports failures."""

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        """Reject the prompt as too long, with a field violation and the request id."""
        bad = error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field="prompt")]
        )
        status = _status(
            Code.INVALID_ARGUMENT,
            "prompt too long",
            _error_info("CONTEXT_LENGTH_EXCEEDED", n_ctx="512"),
            bad,
            error_details_pb2.RequestInfo(request_id="rid-9"),
        )
        await context.abort_with_status(rpc_status.to_status(status))
        raise AssertionError("abort_with_status returned")

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """One delta, then QUEUE_FULL with RetryInfo; the prompt "slow" just hangs."""
        yield pb.StreamGenerateResponse(delta=pb.GenerationDelta(text="a", token_ids=[1]))
        if request.prompt == "slow":
            await asyncio.sleep(30)
        retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2))
        status = _status(Code.RESOURCE_EXHAUSTED, "full", _error_info("QUEUE_FULL"), retry)
        await context.abort_with_status(rpc_status.to_status(status))


@pytest.fixture
async def failing_target() -> AsyncIterator[str]:
    """A grpc.aio server on 127.0.0.1:0 whose servicer always fails."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_LlmServiceServicer_to_server(FailingServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_aio_unary_error_carries_details(failing_target: str) -> None:
    """An AioRpcError with rich details maps like a sync one: class, field, metadata, id."""
    async with AsyncClient(failing_target) as client:
        with pytest.raises(ContextLengthExceededError) as caught:
            await client.generate("long")
    error = caught.value
    assert (error.code, error.reason, error.field) == (
        "INVALID_ARGUMENT",
        "CONTEXT_LENGTH_EXCEEDED",
        "prompt",
    )
    assert error.metadata == {"n_ctx": "512"}
    assert error.request_id == "rid-9"


async def test_aio_stream_error_after_a_delta(failing_target: str) -> None:
    """A mid-stream abort arrives after the delta, as QueueFullError with retry_after_s."""
    async with AsyncClient(failing_target) as client:
        stream = client.stream("p")
        assert await anext(stream) == Delta("a", (1,))
        with pytest.raises(QueueFullError) as caught:
            await anext(stream)
    assert caught.value.retry_after_s == 2.0


async def test_aio_deadline_is_deadline_exceeded(failing_target: str) -> None:
    """A call that outlives its timeout raises DeadlineExceededError."""
    async with AsyncClient(failing_target, timeout=0.2) as client:
        stream = client.stream("slow")
        with pytest.raises(DeadlineExceededError):
            async for _ in stream:
                pass


async def test_sync_stream_error_over_a_real_channel(failing_target: str) -> None:
    """The sync stream maps a real mid-stream rich status too."""

    def consume() -> tuple[list[Any], LlamaGrpcError | None]:
        events: list[Any] = []
        with Client(failing_target, timeout=5) as client:
            try:
                events.extend(client.stream("p"))
            except LlamaGrpcError as error:
                return events, error
        return events, None

    events, error = await asyncio.to_thread(consume)
    assert events == [Delta("a", (1,))]
    assert isinstance(error, QueueFullError)
    assert error.retry_after_s == 2.0


def test_a_proxy_reset_stream_is_unavailable(
    scripted: tuple[Client, Any, ThreadPoolExecutor],
) -> None:
    """Envoy resets a stream whose replica died mid-way; grpc calls that INTERNAL "Stream
    removed (RST_STREAM ...)". No server said INTERNAL: it is typed as retryable UnavailableError
    (the code stays what grpc reported). A server's own INTERNAL stays InternalError."""
    reset = "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"
    error = _fail_tokenize(scripted, Code.INTERNAL, reset)
    assert type(error) is UnavailableError
    assert error.code == "INTERNAL"
    plain = _fail_tokenize(scripted, Code.INTERNAL, "internal error (request_id=r)")
    assert type(plain) is InternalError
