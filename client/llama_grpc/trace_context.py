"""The caller's OpenTelemetry trace context as W3C `traceparent` / `tracestate` metadata, so a
traced service shows its model calls as child spans of its own (the server continues the trace
when it runs with --otlp-endpoint). Only when opentelemetry-api is installed
(`pip install 'llama-grpc[otel]'`) and a span is active; otherwise nothing is added."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


@functools.cache
def _injector() -> Callable[..., Any] | None:
    try:
        from opentelemetry import propagate
    except ImportError:
        return None
    return propagate.inject


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current context's propagation headers (none without an active trace)."""
    inject = _injector()
    if inject is None:
        return ()
    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple(carrier.items())
