"""The ServiceError tree: every failure a caller can see, and describe(), the one line that names
any exception as the cause in their messages. No grpc here; rpc/ maps them to status."""

from __future__ import annotations

from typing import ClassVar

# A cause named in a message or stats (an engine's death, a model's failed load): at most this long
MAX_CAUSE_CHARS = 300


def describe(exc: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:MAX_CAUSE_CHARS]


class ServiceError(Exception):
    """A failure reported to the caller with a status code name and an ErrorInfo reason."""

    code: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        metadata: dict[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.metadata = dict(metadata or {})
        self.retry_after_s = retry_after_s


class InvalidRequest(ServiceError):
    """A field of the request is malformed or out of range."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class PromptTooLong(InvalidRequest):
    """prompt + max_tokens can never fit the context."""

    reason = "CONTEXT_LENGTH_EXCEEDED"


class ModelNotFound(ServiceError):
    """The request named a model that is not loaded."""

    code = "NOT_FOUND"
    reason = "MODEL_NOT_FOUND"


class FailedPrecondition(ServiceError):
    """The request needs something the server is not configured with."""

    code = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"


class ModelNotLoaded(FailedPrecondition):
    """The request reads the state of a model that is not resident (GetStats, ClearCache); a
    generation request would load it, LoadModel does."""

    reason = "MODEL_NOT_LOADED"


class ModelBusy(FailedPrecondition):
    """UnloadModel without force on a model with requests in flight, or one still loading."""

    reason = "MODEL_BUSY"


class ModelLoadFailed(ServiceError):
    """Loading the requested model failed (the message says why); the next request tries
    again."""

    code = "UNAVAILABLE"
    reason = "MODEL_LOAD_FAILED"


class ModelUnloaded(ServiceError):
    """An admin unloaded the model with force while this request ran or waited; retrying loads
    it again."""

    code = "UNAVAILABLE"
    reason = "MODEL_UNLOADED"


class DuplicateRequest(ServiceError):
    """A request with this id is still in flight (ids key the engine's per-request state)."""

    code = "ALREADY_EXISTS"
    reason = "REQUEST_ID_IN_FLIGHT"


class Unauthenticated(ServiceError):
    """No credentials, or credentials the server does not know."""

    code = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    """The caller is known but its role may not do this."""

    code = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class Overloaded(ServiceError):
    """The queue is full; retry later."""

    code = "RESOURCE_EXHAUSTED"
    reason = "QUEUE_FULL"


class KvCacheFull(ServiceError):
    """The request alone cannot fit the KV cache."""

    code = "RESOURCE_EXHAUSTED"
    reason = "KV_CACHE_FULL"


class StalledReader(ServiceError):
    """The caller read none of its stream's output for --stalled-reader-s while the output
    buffer was full: the request was ended to free its slot. RESOURCE_EXHAUSTED (gRPC's code
    for flow-control limits), not DEADLINE_EXCEEDED: the caller's own deadline had not passed,
    and that count must stay the callers' deadlines."""

    code = "RESOURCE_EXHAUSTED"
    reason = "STALLED_READER"


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it could be served."""

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class ShuttingDown(ServiceError):
    """The server is draining and accepts no new work."""

    code = "UNAVAILABLE"
    reason = "SHUTTING_DOWN"


class EngineError(ServiceError):
    """llama.cpp failed while serving this request; the engine keeps serving others."""

    code = "INTERNAL"
    reason = "ENGINE_ERROR"


class EngineFailed(ServiceError):
    """The engine thread died while this request was in flight or queued."""

    code = "INTERNAL"
    reason = "ENGINE_FAILED"


class EngineUnavailable(ServiceError):
    """The engine thread has died: nothing is served until the server is restarted."""

    code = "UNAVAILABLE"
    reason = "ENGINE_FAILED"


class EngineHung(ServiceError):
    """A tick of the engine ran past the watchdog's bound (--watchdog-s): the engine is stuck
    and the server exits to be replaced; another replica can serve the request."""

    code = "UNAVAILABLE"
    reason = "ENGINE_HUNG"


class Cancelled(ServiceError):
    """The caller went away."""

    code = "CANCELLED"
    reason = "CANCELLED"
