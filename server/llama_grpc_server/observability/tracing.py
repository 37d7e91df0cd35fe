"""OpenTelemetry tracing, off unless --otlp-endpoint (or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)
is set: one SERVER span per RPC continuing the caller's W3C `traceparent`, named and attributed
after the gRPC and GenAI semantic conventions, with child spans for the request's time in the
queue, its prefill and its decode. Those three come from the engine thread's own timings of the
request (core.requests.request.Timings), anchored at the wall-clock time the servicer submitted it;
the event loop guesses nothing.

Spans are exported by the SDK's BatchSpanProcessor on its own thread (OTLP over HTTP/protobuf),
never on the engine thread, and carry no prompt or output text. When tracing is off, nothing
here is imported beyond this module and every hook returns at its first line.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from llama_grpc_server.core.requests.request import Finished, GenerationRequest

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_NAME = "llama-grpc"
TRACES_PATH = "/v1/traces"

log = structlog.get_logger("llama_grpc.tracing")


def endpoint_from(flag: str, environ: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL: the flag, else the standard environment variables ("" = off).
    A base endpoint (the generic variable or a flag without a path) gets /v1/traces."""
    if flag:
        return flag if flag.rstrip("/").endswith(TRACES_PATH) else flag.rstrip("/") + TRACES_PATH
    if environ.get(ENDPOINT_ENVS[0]):
        return environ[ENDPOINT_ENVS[0]]
    base = environ.get(ENDPOINT_ENVS[1], "")
    return base.rstrip("/") + TRACES_PATH if base else ""


@dataclass(eq=False)
class Tracing:
    """A tracer provider of one server (not the process-global one, so servers in one process
    stay apart) exporting to `endpoint`."""

    endpoint: str
    provider: Any
    tracer: Any

    @classmethod
    def start(cls, endpoint: str, service_name: str = SERVICE_NAME) -> Tracing:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME", service_name)
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(endpoint, provider, provider.get_tracer("llama_grpc_server"))

    def flush(self) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()

    # -- one RPC -----------------------------------------------------------------------------------

    def start_rpc(
        self, method: str, metadata: Sequence[tuple[str, Any]] | None, request_id: str
    ) -> RpcSpan:
        """The SERVER span of one call, child of the caller's traceparent when it sent one; it
        names the call's x-request-id (the access log names the trace: either finds the other)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        parent = TraceContextTextMapPropagator().extract(carrier)
        service, _, name = method.lstrip("/").rpartition("/")
        span = self.tracer.start_span(
            f"{service}/{name}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": name,
                "llama_grpc.request_id": request_id,
            },
        )
        return RpcSpan(self, span)


@dataclass(eq=False)
class RpcSpan:
    tracing: Tracing
    span: Any

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def end(self, code: str) -> None:
        """End the span with the call's status; a failure here is logged, never raised."""
        from opentelemetry.trace import Status, StatusCode

        try:
            self.span.set_attribute("rpc.grpc.status_code", code)
            if code not in ("OK", "CANCELLED"):
                self.span.set_status(Status(StatusCode.ERROR, code))
            self.span.end()
        except Exception:
            log.exception("tracing_failed")


_span_of_rpc: contextvars.ContextVar[RpcSpan | None] = contextvars.ContextVar(
    "rpc_span", default=None
)


def bind_rpc_span(rpc_span: RpcSpan) -> contextvars.Token[RpcSpan | None]:
    return _span_of_rpc.set(rpc_span)


def unbind_rpc_span(token: contextvars.Token[RpcSpan | None]) -> None:
    with contextlib.suppress(ValueError):  # finalized from another context (a GC'd stream)
        _span_of_rpc.reset(token)


def record_generation(
    spec: GenerationRequest,
    finished: Finished,
    *,
    model: str,
    operation: str,
    submitted_unix_ns: int,
) -> None:
    """GenAI attributes on the RPC's span, and queue / prefill / decode child spans placed by the
    engine's timings from the moment the request was submitted. No-op without tracing; a
    failure here is logged, never the caller's problem."""
    rpc_span = _span_of_rpc.get()
    if rpc_span is None:
        return
    try:
        _record(rpc_span, spec, finished, model, operation, submitted_unix_ns)
    except Exception:
        log.exception("tracing_failed")


def _record(  # noqa: PLR0917  # record_generation's arguments, passed on
    rpc_span: RpcSpan,
    spec: GenerationRequest,
    finished: Finished,
    model: str,
    operation: str,
    submitted_unix_ns: int,
) -> None:
    from opentelemetry import trace

    span, timings, usage = rpc_span.span, finished.timings, finished.usage
    span.set_attributes(
        {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "llama_cpp",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": spec.stopping.max_tokens,
            "gen_ai.request.temperature": spec.sampling.temperature,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.response.finish_reasons": [finished.reason.value],
            "llama_grpc.cached_prompt_tokens": usage.cached_prompt_tokens,
            "llama_grpc.cached_response": usage.cached_response,
            "llama_grpc.slot": finished.slot_id,
            "llama_grpc.queue_ms": timings.queue_ms,
        }
    )
    parent = trace.set_span_in_context(span)
    ms = 1_000_000
    marks = (0.0, timings.queue_ms, timings.ttft_ms, timings.total_ms)
    prefill = {
        "llama_grpc.cached_prompt_tokens": usage.cached_prompt_tokens,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
    }
    decode = {"gen_ai.usage.output_tokens": usage.completion_tokens}
    for name, start, end, attributes in (
        ("queue", marks[0], marks[1], {}),
        ("prefill", marks[1], marks[2], prefill),
        ("decode", marks[2], marks[3], decode),
    ):
        child = rpc_span.tracing.tracer.start_span(
            name,
            context=parent,
            start_time=submitted_unix_ns + round(start * ms),
            attributes=attributes,
        )
        child.end(end_time=submitted_unix_ns + round(max(start, end) * ms))
