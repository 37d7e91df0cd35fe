"""ServiceError -> gRPC status with google.rpc details: the one table of status codes.

Unknown exceptions become INTERNAL "internal error (request_id=...)"; their traceback is logged,
never sent. Imports grpc and errors; nothing from core/ or engine/.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import (
    error_details_pb2,
    status_pb2,
)
from grpc_status import rpc_status

from llama_grpc_server import errors

ERROR_DOMAIN = "llama-grpc"

log = structlog.get_logger("llama_grpc.rpc")

# ServiceError.code -> the status sent. A code missing here is a bug and is sent as INTERNAL.
STATUS_CODES: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


def status_code(error: errors.ServiceError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.code, grpc.StatusCode.INTERNAL)


def internal_error(request_id: str) -> errors.ServiceError:
    """What the caller sees of an unexpected exception: nothing but the request id."""
    return errors.ServiceError(f"internal error (request_id={request_id})")


def _packed(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _retry_delay(seconds: float) -> duration_pb2.Duration:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(seconds * 1e9))
    return delay


def build_status(error: errors.ServiceError, request_id: str = "") -> status_pb2.Status:
    """google.rpc.Status: ErrorInfo always; BadRequest with a field; RetryInfo with a delay;
    RequestInfo with the request id."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    details = [_packed(info)]
    if error.field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.message
        )
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if error.retry_after_s is not None:
        retry = error_details_pb2.RetryInfo(retry_delay=_retry_delay(error.retry_after_s))
        details.append(_packed(retry))
    if request_id:
        details.append(_packed(error_details_pb2.RequestInfo(request_id=request_id)))
    code = status_code(error).value[0]
    return status_pb2.Status(code=code, message=error.message, details=details)


async def abort(
    context: grpc.aio.ServicerContext[Any, Any], error: errors.ServiceError, request_id: str = ""
) -> NoReturn:
    """End the RPC with the error's status and details (works mid-stream too); x-request-id in
    the trailers, since a call refused before its first message has no response headers."""
    status = rpc_status.to_status(build_status(error, request_id))
    sendable = request_id.isascii() and request_id.isprintable() and bool(request_id)
    trailers = (*status.trailing_metadata, *((("x-request-id", request_id),) if sendable else ()))
    # Same as context.abort_with_status(status), which grpc-stubs does not declare.
    await context.abort(status.code, status.details, trailers)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


class ErrorsToStatus:
    """`async with ErrorsToStatus(context, request_id):` turns a ServiceError raised inside into
    its status, anything else into INTERNAL. Cancellation (a BaseException) passes untouched.
    A class rather than @asynccontextmanager so type checkers know it never swallows."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], request_id: str) -> None:
        self._context = context
        self._request_id = request_id

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not isinstance(exc, Exception) or isinstance(exc, grpc.aio.AbortError):
            return
        if isinstance(exc, errors.ServiceError):
            await abort(self._context, exc, self._request_id)
        log.error("rpc_internal_error", request_id=self._request_id, exc_info=exc)
        await abort(self._context, internal_error(self._request_id), self._request_id)
