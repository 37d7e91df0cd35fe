"""rpc.plumbing.status: ServiceError -> status code + google.rpc details, and the error boundary."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]  # no stubs
from grpc_status import rpc_status
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.rpc.plumbing import status


def all_error_types() -> list[type[errors.ServiceError]]:
    found: list[type[errors.ServiceError]] = [errors.ServiceError]
    for cls in found:
        found.extend(cls.__subclasses__())
    return found


def unpack(message: status_pb2.Status, detail_type: Any) -> Any:
    """The first detail of `detail_type`, or None."""
    for detail in message.details:
        value = detail_type()
        if detail.Unpack(value):
            return value
    return None


class AbortingContext:
    """Just enough of a grpc.aio.ServicerContext: abort records its arguments and raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]] | None = None

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self.aborted = (code, details, tuple(trailing_metadata))
        raise grpc.aio.AbortError()


@pytest.mark.parametrize("error_type", all_error_types(), ids=lambda cls: cls.__name__)
def test_every_error_code_is_in_the_table(error_type: type[errors.ServiceError]) -> None:
    """Each ServiceError subclass maps to the gRPC status of its code name, never by accident."""
    assert error_type.code in status.STATUS_CODES
    assert status.status_code(error_type("x")) == grpc.StatusCode[error_type.code]


def test_unknown_code_name_is_internal() -> None:
    """A code name missing from the table is sent as INTERNAL."""

    class Odd(errors.ServiceError):
        code = "NOT_A_CODE"

    assert status.status_code(Odd("x")) == grpc.StatusCode.INTERNAL


def test_error_info_always_present() -> None:
    """ErrorInfo carries the reason, the llama-grpc domain and the metadata."""
    error = errors.PromptTooLong("too long", metadata={"n_ctx": "8192"})
    built = status.build_status(error)
    info = unpack(built, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain) == ("CONTEXT_LENGTH_EXCEEDED", "llama-grpc")
    assert dict(info.metadata) == {"n_ctx": "8192"}
    assert built.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert built.message == "too long"


def test_bad_request_only_with_a_field() -> None:
    """BadRequest names the field and repeats the message; without a field there is none."""
    with_field = status.build_status(errors.InvalidRequest("bad top_p", field="params.top_p"))
    violation = unpack(with_field, error_details_pb2.BadRequest).field_violations[0]
    assert (violation.field, violation.description) == ("params.top_p", "bad top_p")
    assert (
        unpack(status.build_status(errors.EngineError("x")), error_details_pb2.BadRequest) is None
    )


def test_retry_info_only_with_a_delay() -> None:
    """RetryInfo carries retry_after_s as a Duration; errors without it have none."""
    built = status.build_status(errors.Overloaded("full", retry_after_s=1.5))
    retry = unpack(built, error_details_pb2.RetryInfo)
    assert retry.retry_delay.ToNanoseconds() == 1_500_000_000
    assert (
        unpack(status.build_status(errors.Overloaded("full")), error_details_pb2.RetryInfo) is None
    )


def test_request_info_carries_the_request_id() -> None:
    """The request id travels as RequestInfo when known."""
    built = status.build_status(errors.EngineError("x"), request_id="abc123")
    assert unpack(built, error_details_pb2.RequestInfo).request_id == "abc123"


def test_status_survives_the_trailer_round_trip() -> None:
    """to_status puts the details in grpc-status-details-bin, which parses back unchanged."""
    built = status.build_status(errors.KvCacheFull("kv", retry_after_s=2.0), request_id="r")
    wire = rpc_status.to_status(built)
    assert wire.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = dict(wire.trailing_metadata)["grpc-status-details-bin"]
    assert status_pb2.Status.FromString(raw) == built


async def test_service_error_becomes_its_status() -> None:
    """Inside ErrorsToStatus a ServiceError aborts with its code, message and details."""
    context = AbortingContext()
    with pytest.raises(grpc.aio.AbortError):
        async with status.ErrorsToStatus(cast(Any, context), "rid-1"):
            raise errors.ModelNotFound("no such model", field="model")
    assert context.aborted is not None
    code, details, trailers = context.aborted
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "no such model")
    sent = status_pb2.Status.FromString(dict(trailers)["grpc-status-details-bin"])
    assert unpack(sent, error_details_pb2.ErrorInfo).reason == "MODEL_NOT_FOUND"


async def test_unknown_exception_is_internal_without_its_text() -> None:
    """A bug becomes INTERNAL naming the request id; the traceback is logged, never sent."""
    context = AbortingContext()
    with capture_logs() as logs, pytest.raises(grpc.aio.AbortError):
        async with status.ErrorsToStatus(cast(Any, context), "rid-2"):
            raise KeyError("secret internals")
    assert context.aborted is not None
    code, details, _ = context.aborted
    assert code == grpc.StatusCode.INTERNAL
    assert details == "internal error (request_id=rid-2)"
    assert "secret" not in details
    [entry] = [e for e in logs if e["event"] == "rpc_internal_error"]
    assert entry["request_id"] == "rid-2"
    assert isinstance(entry["exc_info"], KeyError)


async def test_cancellation_passes_through() -> None:
    """CancelledError is not turned into a status: grpc handles client cancel and deadlines."""
    context = AbortingContext()
    with pytest.raises(asyncio.CancelledError):
        async with status.ErrorsToStatus(cast(Any, context), "rid-3"):
            raise asyncio.CancelledError
    assert context.aborted is None


async def test_abort_inside_is_not_wrapped_again() -> None:
    """An AbortError raised inside (an abort already done) passes through untouched."""
    context = AbortingContext()
    with pytest.raises(grpc.aio.AbortError):
        async with status.ErrorsToStatus(cast(Any, context), "rid-4"):
            raise grpc.aio.AbortError()
    assert context.aborted is None
