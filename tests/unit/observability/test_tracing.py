"""tracing.py without a collector: endpoint resolution, and a failing span never fails a call."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from llama_grpc_server.core.requests.request import (
    Finished,
    FinishReason,
    GenerationRequest,
    Timings,
    Usage,
)
from llama_grpc_server.observability import tracing


def test_endpoint_from_flag_and_standard_environment() -> None:
    assert tracing.endpoint_from("", {}) == ""
    assert tracing.endpoint_from("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert tracing.endpoint_from("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318/"}
    assert tracing.endpoint_from("", base) == "http://b:4318/v1/traces"
    both = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x"}
    assert tracing.endpoint_from("", both) == "http://t:9/x"
    assert tracing.endpoint_from("http://f:1", both) == "http://f:1/v1/traces"  # the flag wins


class BrokenSpan:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"exporter bug in {name}")


def test_a_failing_span_is_logged_and_the_call_goes_on() -> None:
    rpc_span = tracing.RpcSpan(tracing=None, span=BrokenSpan())  # type: ignore[arg-type]
    finished = Finished(
        FinishReason.MAX_TOKENS, Usage(3, 2, 0), Timings(1.0, 2.0, 1.0, 3.0, 5.0), seed=1
    )
    token = tracing.bind_rpc_span(rpc_span)
    try:
        with capture_logs() as logs:
            tracing.record_generation(
                GenerationRequest("r", (1, 2, 3)),
                finished,
                model="m",
                operation="text_completion",
                submitted_unix_ns=0,
            )
            rpc_span.end("OK")
    finally:
        tracing.unbind_rpc_span(token)
    assert [e["event"] for e in logs] == ["tracing_failed", "tracing_failed"]
