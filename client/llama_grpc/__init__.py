"""llama-grpc client: Client / AsyncClient, frozen results and typed errors.

Generated messages and stubs stay importable from `llama_grpc.v1` for raw access.
"""

from __future__ import annotations

from llama_grpc.client import (
    DEFAULT_TARGET,
    AsyncClient,
    AsyncStream,
    CallOptions,
    Client,
    GenerationParams,
    Stream,
    TokenGenerationParams,
)
from llama_grpc.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KvCacheFullError,
    LlamaGrpcError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    RequestIdInFlightError,
    ResourceExhaustedError,
    UnavailableError,
)
from llama_grpc.types import (
    ChatMessage,
    Delta,
    Done,
    GenerateResult,
    ModelInfo,
    SlotStats,
    Stats,
    StreamEvent,
    Timings,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "AsyncStream",
    "CallOptions",
    "ChatMessage",
    "Client",
    "ContextLengthExceededError",
    "DeadlineExceededError",
    "Delta",
    "Done",
    "FailedPreconditionError",
    "GenerateResult",
    "GenerationParams",
    "InternalError",
    "InvalidArgumentError",
    "KvCacheFullError",
    "LlamaGrpcError",
    "ModelInfo",
    "ModelNotFoundError",
    "QueueFullError",
    "RequestCancelledError",
    "RequestIdInFlightError",
    "ResourceExhaustedError",
    "SlotStats",
    "Stats",
    "Stream",
    "StreamEvent",
    "Timings",
    "TokenGenerationParams",
    "TokenLogprob",
    "TokenizeResult",
    "TopLogprob",
    "UnavailableError",
    "Usage",
]
