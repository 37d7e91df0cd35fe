"""Typed client errors, mapped from a gRPC status plus its google.rpc details.

The one place that reads grpc.RpcError (sync and aio); callers only ever see LlamaGrpcError.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

import grpc
from google.rpc import (
    error_details_pb2,
    status_pb2,
)
from grpc_status import rpc_status

ERROR_DOMAIN = "llama-grpc"
REQUEST_ID_KEY = "x-request-id"


class LlamaGrpcError(Exception):
    """A failed call: status code name, ErrorInfo reason, message and the details sent with it."""

    default_code: ClassVar[str] = "UNKNOWN"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        field: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.reason = reason or self.code
        self.field = field
        self.metadata = dict(metadata or {})
        self.retry_after_s = retry_after_s
        self.request_id = request_id

    def __str__(self) -> str:
        head = self.code if self.reason == self.code else f"{self.code} {self.reason}"
        return f"{head}: {self.message}"


class InvalidArgumentError(LlamaGrpcError):
    """A field of the request is malformed or out of range; `.field` names it when known."""

    default_code = "INVALID_ARGUMENT"


class ContextLengthExceededError(InvalidArgumentError):
    """The prompt plus max_tokens can never fit the model's context."""


class ModelNotFoundError(LlamaGrpcError):
    """The request named a model the server has not loaded."""

    default_code = "NOT_FOUND"


class RequestIdInFlightError(LlamaGrpcError):
    """Another call with the same x-request-id is still in flight; `.field` is "x-request-id".

    Send a fresh id, or retry once the first call has ended."""

    default_code = "ALREADY_EXISTS"


class FailedPreconditionError(LlamaGrpcError):
    """The request needs something the server is not configured with."""

    default_code = "FAILED_PRECONDITION"


class ModelNotLoadedError(FailedPreconditionError):
    """GetStats or ClearCache named a model that is not loaded (a generation request or
    load_model() loads it)."""


class ModelBusyError(FailedPreconditionError):
    """unload_model() without force on a model with requests in flight (or still loading)."""


class ResourceExhaustedError(LlamaGrpcError):
    """The server is out of capacity; `.retry_after_s` says when to retry, when known."""

    default_code = "RESOURCE_EXHAUSTED"


class QueueFullError(ResourceExhaustedError):
    """The server's request queue is full."""


class KvCacheFullError(ResourceExhaustedError):
    """The request alone cannot fit the server's KV cache."""


class DeadlineExceededError(LlamaGrpcError):
    """The call's deadline passed before it finished."""

    default_code = "DEADLINE_EXCEEDED"


class RequestCancelledError(LlamaGrpcError):
    """The call was cancelled."""

    default_code = "CANCELLED"


class UnavailableError(LlamaGrpcError):
    """The server cannot be reached, is starting or is shutting down; retrying is safe."""

    default_code = "UNAVAILABLE"


class UnauthenticatedError(LlamaGrpcError):
    """The call carried no credentials the server accepts: a missing or unknown bearer token
    (Client(token=...)) on a server that requires one."""

    default_code = "UNAUTHENTICATED"


class PermissionDeniedError(LlamaGrpcError):
    """The caller is known but not allowed this operation (e.g. a user token on an admin call)."""

    default_code = "PERMISSION_DENIED"


class InternalError(LlamaGrpcError):
    """The server failed while serving the request."""

    default_code = "INTERNAL"


_BY_REASON: dict[str, type[LlamaGrpcError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "CONTEXT_LENGTH_EXCEEDED": ContextLengthExceededError,
    "MODEL_NOT_FOUND": ModelNotFoundError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "MODEL_NOT_LOADED": ModelNotLoadedError,
    "MODEL_BUSY": ModelBusyError,
    "REQUEST_ID_IN_FLIGHT": RequestIdInFlightError,
    "QUEUE_FULL": QueueFullError,
    "KV_CACHE_FULL": KvCacheFullError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "SHUTTING_DOWN": UnavailableError,
    "NOT_READY": UnavailableError,
    "ENGINE_ERROR": InternalError,
    "CANCELLED": RequestCancelledError,
    "INTERNAL": InternalError,
}

_BY_CODE: dict[str, type[LlamaGrpcError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgumentError,
        ModelNotFoundError,
        RequestIdInFlightError,
        FailedPreconditionError,
        ResourceExhaustedError,
        DeadlineExceededError,
        RequestCancelledError,
        UnavailableError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
    )
}


class _Details:
    """What the google.rpc details of one status say (all optional)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.domain: str | None = None
        self.metadata: dict[str, str] = {}
        self.field: str | None = None
        self.retry_after_s: float | None = None
        self.request_id: str | None = None

    def add(self, status: status_pb2.Status) -> None:
        """Unpack the ErrorInfo, BadRequest, RetryInfo and RequestInfo details of `status`."""
        info = error_details_pb2.ErrorInfo()
        bad = error_details_pb2.BadRequest()
        retry = error_details_pb2.RetryInfo()
        request = error_details_pb2.RequestInfo()
        for detail in status.details:
            if detail.Unpack(info):
                self.reason, self.domain = info.reason, info.domain
                self.metadata = dict(info.metadata)
            elif detail.Unpack(bad) and bad.field_violations:
                self.field = bad.field_violations[0].field
            elif detail.Unpack(retry):
                self.retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
            elif detail.Unpack(request):
                self.request_id = request.request_id or None


def _rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    try:
        status: status_pb2.Status | None = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        # A status whose details disagree with its code, or an error that is not a Call:
        # fall back to the bare code.
        return None
    return status


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _call_value(error: grpc.RpcError, accessor: str, default: object) -> object:
    method = getattr(error, accessor, None)
    if method is None:
        return default
    try:
        return method()
    except (NotImplementedError, ValueError, TypeError):
        return default


def _request_id(error: grpc.RpcError, details: _Details) -> str | None:
    if details.request_id:
        return details.request_id
    if details.metadata.get("request_id"):
        return details.metadata["request_id"]
    for accessor in ("initial_metadata", "trailing_metadata"):
        metadata = _call_value(error, accessor, None)
        found = _metadata_value(metadata, REQUEST_ID_KEY)  # type: ignore[arg-type]
        if found:
            return found
    return None


# A proxy (Envoy) that loses its upstream mid-stream resets the client's stream; grpc reports
# that reset as INTERNAL "Stream removed (RST_STREAM ...)" although no server answered INTERNAL
# (llama-grpc's own INTERNAL always carries details). It is a transport failure like a dropped
# connection, so it is typed as UnavailableError: retry elsewhere.
_TRANSPORT_RESET = "RST_STREAM"


def _error_class(code: str, details: _Details, message: str = "") -> type[LlamaGrpcError]:
    if details.domain == ERROR_DOMAIN and details.reason in _BY_REASON:
        return _BY_REASON[details.reason]
    if code == "INTERNAL" and details.reason is None and _TRANSPORT_RESET in message:
        return UnavailableError
    return _BY_CODE.get(code, LlamaGrpcError)


def from_rpc_error(error: grpc.RpcError) -> LlamaGrpcError:
    """Map a sync or aio RpcError, with or without rich details, to its typed error."""
    status_code = _call_value(error, "code", grpc.StatusCode.UNKNOWN)
    code = status_code.name if isinstance(status_code, grpc.StatusCode) else "UNKNOWN"
    message = str(_call_value(error, "details", "") or "")
    details = _Details()
    rich = _rich_status(error)
    if rich is not None:
        details.add(rich)
    cls = _error_class(code, details, message)
    return cls(
        message or code,
        code=code,
        reason=details.reason,
        field=details.field,
        metadata=details.metadata,
        retry_after_s=details.retry_after_s,
        request_id=_request_id(error, details),
    )
