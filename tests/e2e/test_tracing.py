"""OpenTelemetry tracing end to end: a real server exports over OTLP/HTTP to a receiver made of a
few lines of http.server; a call that carries a W3C traceparent produces a SERVER span in that
trace, child of the caller's span, with GenAI attributes and the engine's queue / prefill /
decode phases as child spans; the access log names the trace; without an endpoint nothing is
sent."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from structlog.testing import capture_logs

from llama_grpc import AsyncClient
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.server import start_server

from .conftest import settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@dataclass
class Receiver:
    """An OTLP/HTTP traces endpoint that keeps every span it is sent."""

    url: str
    spans: list[Any] = field(default_factory=list)
    posts: int = 0

    def by_name(self, name: str) -> list[Any]:
        return [s for s in self.spans if s.name == name]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            got.posts += 1
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    got.spans.extend(scope.spans)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{http.server_address[1]}/v1/traces"
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield got
    http.shutdown()


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out


async def test_a_traced_call_continues_the_callers_trace(receiver: Receiver) -> None:
    conf = settings(n_parallel=2)
    conf = replace(conf, server=replace(conf.server, otlp_endpoint=receiver.url))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        assert running.tracing is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            request = pb.GenerateRequest(
                prompt="The capital of France is",
                params=pb.GenerationParams(
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True),
                ),
            )
            traceparent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
            with capture_logs() as logs:
                reply = await pb_grpc.LlmServiceStub(channel).Generate(
                    request, metadata=(("traceparent", traceparent),)
                )
        await asyncio.to_thread(running.tracing.flush)
    [server_span] = receiver.by_name("llama_grpc.v1.LlmService/Generate")
    assert server_span.trace_id.hex() == TRACE_ID
    assert server_span.parent_span_id.hex() == CALLER_SPAN
    assert server_span.kind == server_span.SPAN_KIND_SERVER
    got = attributes(server_span)
    assert got["rpc.system"] == "grpc" and got["rpc.grpc.status_code"] == "OK"
    assert got["gen_ai.operation.name"] == "text_completion"
    assert got["gen_ai.request.model"] == "gemma-3-270m-q4_k_m"
    assert got["gen_ai.request.max_tokens"] == 6
    assert got["gen_ai.request.temperature"] == 0.0
    assert got["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert got["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens == 6
    assert got["gen_ai.response.finish_reasons"] == ["max_tokens"]
    assert got["llama_grpc.cached_prompt_tokens"] == reply.usage.cached_prompt_tokens
    assert got["llama_grpc.queue_ms"] >= 0
    phases = {s.name: s for s in receiver.spans if s.parent_span_id == server_span.span_id}
    assert set(phases) == {"queue", "prefill", "decode"}
    queue, prefill, decode = phases["queue"], phases["prefill"], phases["decode"]
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano > prefill.start_time_unix_nano
    took_ms = (decode.end_time_unix_nano - queue.start_time_unix_nano) / 1e6
    assert took_ms == pytest.approx(reply.timings.total_ms, abs=0.01)
    assert attributes(prefill)["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert "capital" not in str(got) and reply.text not in str(got)  # no content in spans
    access = [e for e in logs if e.get("event") == "rpc"]
    assert access and access[0]["trace_id"] == TRACE_ID
    assert got["llama_grpc.request_id"] == reply.request_id == access[0]["request_id"]


async def test_the_client_sends_the_active_trace_context(
    receiver: Receiver, tiny_model_path: Path
) -> None:
    """A traced Python caller: the server's span is a child of the caller's current span."""
    conf = settings(str(tiny_model_path), n_parallel=1)
    conf = replace(conf, server=replace(conf.server, otlp_endpoint=receiver.url))
    tracer = TracerProvider().get_tracer("caller")
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        assert running.tracing is not None
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=60) as client:
            with tracer.start_as_current_span("caller") as caller:
                await client.tokenize("Hello")
        await asyncio.to_thread(running.tracing.flush)
    [span] = receiver.by_name("llama_grpc.v1.LlmService/Tokenize")
    context = caller.get_span_context()
    assert span.trace_id.hex() == format(context.trace_id, "032x")
    assert span.parent_span_id.hex() == format(context.span_id, "016x")


async def test_without_an_endpoint_nothing_is_traced(
    receiver: Receiver, tiny_model_path: Path
) -> None:
    conf = settings(str(tiny_model_path), n_parallel=1)
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        assert running.tracing is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with capture_logs() as logs:
                await pb_grpc.LlmServiceStub(channel).Tokenize(
                    pb.TokenizeRequest(text="Hi"),
                    metadata=(("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),),
                )
    assert receiver.posts == 0
    assert all("trace_id" not in e for e in logs if e.get("event") == "rpc")
