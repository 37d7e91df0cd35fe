"""Per-RPC plumbing for every method, unary or streaming: the request id (x-request-id in and out,
a contextvar, structlog context), the caller (rpc.plumbing.access: refused with UNAUTHENTICATED or
PERMISSION_DENIED before the handler runs; its tenant in a contextvar, the access log and the
metric labels), one access-log line, and RpcRecorder metric hooks; a request
protobuf cannot parse is answered INVALID_ARGUMENT (rpc.plumbing.decoding) rather than grpc's
UNKNOWN.
Knows nothing of LlmService messages; logs payloads only when asked to (log_payloads, for
debugging)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import structlog
from google.protobuf import text_format
from google.protobuf.message import Message

from llama_grpc_server import errors
from llama_grpc_server.auth import ANONYMOUS, Principal
from llama_grpc_server.observability.tracing import RpcSpan, Tracing, bind_rpc_span, unbind_rpc_span
from llama_grpc_server.rpc.plumbing import decoding
from llama_grpc_server.rpc.plumbing.access import AccessControl
from llama_grpc_server.rpc.plumbing.status import abort

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_LENGTH = 128
MAX_PAYLOAD_LOG_CHARS = 4096
# A call cancelled this close to its deadline (or after it) ended by its deadline (deadline_expired)
DEADLINE_SLACK_S = 0.1

log = structlog.get_logger("llama_grpc.rpc")

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "principal", default=ANONYMOUS
)

Behavior = Callable[..., Any]

if TYPE_CHECKING:  # generic only in grpc-stubs; the runtime classes take no parameters
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]
    RpcFactory = Callable[[Context, bool, Any], "_Rpc"]
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor

_ERROR_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})


def current_request_id() -> str:
    """The request id of the RPC being handled, or "" outside one."""
    return _request_id.get()


def current_principal() -> Principal:
    """The caller of the RPC being handled; ANONYMOUS outside one."""
    return _principal.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


def _incoming_request_id(metadata: Any) -> str:
    """The caller's x-request-id when it is sane (short, printable), else a fresh one."""
    for key, value in metadata or ():
        is_sane = isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_LENGTH
        if key == REQUEST_ID_KEY and is_sane and value.isprintable():
            return str(value)
    return new_request_id()


class RpcRecorder(Protocol):
    """Where per-RPC metrics go; telemetry plugs Prometheus in here. `code` is a status name;
    `tenant` is one of the tokens file's tenants or "" (a bounded label)."""

    def rpc_started(self, method: str, tenant: str) -> None: ...

    def rpc_handled(self, method: str, code: str, seconds: float, tenant: str) -> None: ...


class NullRecorder:
    """Records nothing."""

    def rpc_started(self, method: str, tenant: str) -> None:
        pass

    def rpc_handled(self, method: str, code: str, seconds: float, tenant: str) -> None:
        pass


def deadline_expired(context: Context) -> bool:
    """Whether the call ended because its deadline passed. grpc.aio ends such a call by
    cancelling its handler, as it does when the client cancels, so the time left tells them
    apart. Within DEADLINE_SLACK_S of it counts as the deadline: the client's own deadline
    fires at the same moment and its cancellation (on the wire, the same RST_STREAM as an
    explicit cancel) may arrive a few ms before the server's timer (seen: 2-9 ms)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def status_name(context: Context, error: BaseException | None) -> str:
    """The status an RPC ended with, as seen from inside the server.

    A call grpc has already ended (its deadline, the client's cancel) before the handler
    noticed can still see the handler raise something else: an abort of a call that is done
    fails to send its status (grpc's ExecuteBatchError). That happens when the engine ends the
    request for its deadline in the same ms as grpc's own timer (seen once in a full test run:
    a stream logged UNKNOWN at 5,001 ms of a 5 s deadline, while its caller got
    DEADLINE_EXCEEDED). The caller saw what grpc sent, so that is what is logged."""
    raised = error is not None and not isinstance(error, grpc.aio.AbortError)
    if isinstance(error, asyncio.CancelledError | GeneratorExit) or (raised and context.done()):
        return "DEADLINE_EXCEEDED" if deadline_expired(context) else "CANCELLED"
    if raised:
        return "UNKNOWN"
    code: grpc.StatusCode | None = context.code()
    if code is None:
        return "OK" if error is None else "UNKNOWN"
    return code.name


def payload_text(message: Any) -> str:
    """A message as one line of protobuf text, cut at MAX_PAYLOAD_LOG_CHARS (debug logging)."""
    if isinstance(message, Message):
        text = text_format.MessageToString(message, as_one_line=True, as_utf8=True)
    else:
        text = type(message).__name__  # a request iterator (client streaming)
    return text[:MAX_PAYLOAD_LOG_CHARS]


class _Rpc:
    """One call, from entry to its access-log line. An async context manager around the handler.
    `request` is the request message when payloads are logged, else None."""

    def __init__(  # noqa: PLR0917  # built in one place, by RequestInterceptor
        self,
        method: str,
        metadata: Any,
        context: Context,
        server: RequestInterceptor,
        is_stream: bool,
        request: Any = None,
    ) -> None:
        self.method = method
        self.request_id = _incoming_request_id(metadata)
        self.context = context
        # Read the peer while the call is alive: context.peer() on a call that grpc has already
        # torn down (a cancelled stream's access line) segfaulted once in a full test run.
        self.peer = context.peer()
        self.recorder = server.recorder
        self.is_stream = is_stream
        self.request = request
        self.num_messages = 0
        self.start_ns = time.perf_counter_ns()
        self.first_message_ns = 0
        self.refusal: errors.ServiceError | None = None
        self.principal = ANONYMOUS
        try:
            self.principal = server.access.principal(method, metadata, context.auth_context())
        except (errors.Unauthenticated, errors.PermissionDenied) as exc:
            self.refusal = exc
        self.tenant_label = server.access.metric_label(self.principal)
        self.rpc_span: RpcSpan | None = None
        if server.tracing is not None:
            self.rpc_span = server.tracing.start_rpc(method, metadata, self.request_id)
        self._span_token: contextvars.Token[RpcSpan | None] | None = None
        self._tokens: (
            tuple[contextvars.Token[str], contextvars.Token[Principal], Mapping[str, Any]] | None
        ) = None

    async def __aenter__(self) -> _Rpc:
        self.recorder.rpc_started(self.method, self.tenant_label)
        bound = structlog.contextvars.bind_contextvars(request_id=self.request_id)
        self._tokens = (_request_id.set(self.request_id), _principal.set(self.principal), bound)
        if self.rpc_span is not None:
            self._span_token = bind_rpc_span(self.rpc_span)
        return self

    async def check_access(self) -> None:
        """Refuse the call (before its handler runs) when its caller may not make it."""
        if self.refusal is not None:
            await abort(self.context, self.refusal, self.request_id)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        code = status_name(self.context, exc)
        seconds = (time.perf_counter_ns() - self.start_ns) / 1e9
        self._log(code, seconds)
        self.recorder.rpc_handled(self.method, code, seconds, self.tenant_label)
        if self.rpc_span is not None:
            self.rpc_span.end(code)
        self._reset()

    async def send_request_id(self) -> None:
        """The response headers, with the id: sent with the first message (or the unary
        response), never before. A call refused before any (a full queue, a draining server, a
        model still loading) is then answered trailers-only (the id in its trailers, see
        rpc.plumbing.status.abort): the status arrives without response headers, which is what
        lets a router (SMG, Envoy's retry_on, grpc's own retry policy) try another replica."""
        await self.context.send_initial_metadata(((REQUEST_ID_KEY, self.request_id),))

    async def on_message(self, message: Any) -> None:
        if self.num_messages == 0:
            self.first_message_ns = time.perf_counter_ns()
            await self.send_request_id()
        self.num_messages += 1
        if self.request is not None:
            log.info("rpc_message", method=self.method, index=self.num_messages - 1,
                     message=payload_text(message))  # fmt: skip

    def _log(self, code: str, seconds: float) -> None:
        fields: dict[str, Any] = {
            "method": self.method,
            "code": code,
            "duration_ms": round(seconds * 1000, 3),
            "messages_sent": self.num_messages,
            "peer": self.peer,
            "request_id": self.request_id,
        }
        if self.rpc_span is not None:
            fields["trace_id"] = self.rpc_span.trace_id
        if self.principal is not ANONYMOUS:
            fields["tenant"] = self.principal.tenant
            fields["auth"] = self.principal.via
        if self.is_stream and self.first_message_ns:
            fields["first_message_ms"] = round((self.first_message_ns - self.start_ns) / 1e6, 3)
        if self.request is not None:
            fields["request"] = payload_text(self.request)
        if code in _ERROR_CODES:
            log.error("rpc", **fields)
        else:
            log.info("rpc", **fields)

    def _reset(self) -> None:
        if self._tokens is None:
            return
        token, principal, bound = self._tokens
        self._tokens = None
        if self._span_token is not None:
            unbind_rpc_span(self._span_token)
            self._span_token = None
        try:
            _request_id.reset(token)
            _principal.reset(principal)
            structlog.contextvars.reset_contextvars(**bound)
        except ValueError:  # finalized from another context (a GC'd stream): nothing to undo
            pass


async def _refuse_undecodable(request: Any, rpc: _Rpc) -> None:
    """Abort the call when its caller may not make it, or when its request could not be parsed
    (see rpc.plumbing.decoding)."""
    await rpc.check_access()
    if isinstance(request, decoding.Undecodable):
        await abort(rpc.context, request.error, rpc.request_id)


def _wrap_unary_response(behavior: Behavior, start: RpcFactory) -> Behavior:
    async def unary_response(request: Any, context: Context) -> Any:
        async with start(context, False, request) as rpc:
            await _refuse_undecodable(request, rpc)
            response = await behavior(request, context)
            await rpc.on_message(response)
            return response

    return unary_response


def _wrap_written_stream(behavior: Behavior, start: RpcFactory) -> Behavior:
    """A streaming handler written as a coroutine using context.write (the aio health Watch)."""

    async def written_stream(request: Any, context: Context) -> None:
        async with start(context, True, request) as rpc:
            await rpc.send_request_id()  # context.write sends its messages: headers first
            await _refuse_undecodable(request, rpc)
            await behavior(request, context)

    return written_stream


def _wrap_yielded_stream(behavior: Behavior, start: RpcFactory) -> Behavior:
    async def yielded_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        async with start(context, True, request) as rpc:
            await _refuse_undecodable(request, rpc)
            async with aclosing(behavior(request, context)) as messages:
                async for message in messages:
                    await rpc.on_message(message)
                    yield message

    return yielded_stream


# (request_streaming, response_streaming) -> the behaviour's attribute, its handler builder
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., Any]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _rebuild(handler: Handler, start: RpcFactory) -> Handler:
    """The handler with its behaviour wrapped for its arity; sync behaviours stay as they are.
    A single request message is deserialized tolerantly (rpc.plumbing.decoding)."""
    name, build = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior: Behavior = getattr(handler, name)
    deserializer = handler.request_deserializer
    if not handler.request_streaming:
        deserializer = decoding.tolerant(deserializer)
    if inspect.isasyncgenfunction(behavior):
        wrapped = _wrap_yielded_stream(behavior, start)
    elif not inspect.iscoroutinefunction(behavior):
        return handler
    elif handler.response_streaming:
        wrapped = _wrap_written_stream(behavior, start)
    else:
        wrapped = _wrap_unary_response(behavior, start)
    rebuilt: Handler = build(wrapped, deserializer, handler.response_serializer)
    return rebuilt


class RequestInterceptor(_ServerInterceptor):
    """Request id + access log + metric hooks around every RPC of the server. With
    `log_payloads` the access line carries the request and each sent message gets a line."""

    def __init__(
        self,
        recorder: RpcRecorder | None = None,
        *,
        log_payloads: bool = False,
        access: AccessControl | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.recorder: RpcRecorder = recorder or NullRecorder()
        self.access = access if access is not None else AccessControl()
        self.tracing = tracing
        self._log_payloads = log_payloads

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata

        log_payloads = self._log_payloads

        def start(context: Context, is_stream: bool, request: Any) -> _Rpc:
            logged = request if log_payloads else None
            return _Rpc(method, metadata, context, self, is_stream, logged)

        return _rebuild(handler, start)
