"""metrics: Prometheus series from telemetry events, from the engine's StatsSnapshot and from
RPCs; /metrics over HTTP from a real server with the fake engine (no model)."""

from __future__ import annotations

import asyncio
import socket
import sys
import types
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest
from deploy.cluster import free_port

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import cli
from llama_grpc_server.config import ServerSettings, Settings, loading
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.observability.metrics import Metrics, serve_metrics, split_method
from llama_grpc_server.observability.telemetry import RequestEvent, TickEvent
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.plumbing.wiring import ServerStartError
from llama_grpc_server.testing import FakeEngine
from tests.support.convert import make_snapshot

from ...conftest import samples, scrape, value


def done_event(**overrides: Any) -> RequestEvent:
    fields: dict[str, Any] = {
        "request_id": "r", "slot": 0, "prompt_tokens": 40, "generated_tokens": 8,
        "prefix_cache_tokens": 10, "prefix_cache_ratio": 0.25, "queue_ms": 20.0,
        "duration_ms": 900.0, "ttft_ms": 120.0, "prompt_eval_rate": 300.0,
        "generation_rate": 9.0, "finish_reason": "eos", "model": "m",
    }  # fmt: skip
    return RequestEvent(**(fields | overrides))


def tick(**overrides: Any) -> TickEvent:
    fields: dict[str, Any] = {
        "tick": 1, "batch_size": 40, "decode_tokens": 2, "prefill_tokens": 38,
        "num_sequences": 3, "active_slots": 3, "queue_depth": 1, "eval_ms": 30.0,
        "sample_ms": 2.0, "is_ok": True, "inter_token_ms": (30.0, 45.0), "model": "m",
    }  # fmt: skip
    return TickEvent(**(fields | overrides))


def test_request_events_feed_latency_histograms() -> None:
    """request_done observes TTFT, e2e, queue, prefill, decode and token counts (in seconds and
    tokens) and counts the finish reason; request_failed observes nothing."""
    metrics = Metrics()
    metrics.on_request(done_event())
    metrics.on_request(done_event(finish_reason="max_tokens", ttft_ms=None))
    metrics.on_request(done_event(finish_reason="", error_reason="CANCELLED"))
    got = samples(metrics.render())
    assert value(got, "llama_grpc:request_success_total", model="m", finished_reason="eos") == 1
    assert (
        value(got, "llama_grpc:request_success_total", model="m", finished_reason="max_tokens") == 1
    )
    assert value(got, "llama_grpc:time_to_first_token_seconds_count", model="m") == 1
    assert value(got, "llama_grpc:time_to_first_token_seconds_sum", model="m") == pytest.approx(
        0.12
    )
    assert value(got, "llama_grpc:time_to_first_token_seconds_bucket", model="m", le="0.25") == 1
    assert value(got, "llama_grpc:time_to_first_token_seconds_bucket", model="m", le="0.1") == 0
    assert value(got, "llama_grpc:e2e_request_latency_seconds_count", model="m") == 2
    assert value(got, "llama_grpc:e2e_request_latency_seconds_sum", model="m") == pytest.approx(1.8)
    assert value(got, "llama_grpc:request_queue_time_seconds_sum", model="m") == pytest.approx(0.04)
    assert value(got, "llama_grpc:request_prefill_time_seconds_sum", model="m") == pytest.approx(
        0.1
    )
    assert value(got, "llama_grpc:request_decode_time_seconds_sum", model="m") == pytest.approx(
        0.78
    )
    assert value(got, "llama_grpc:request_prompt_tokens_sum", model="m") == 80
    assert value(got, "llama_grpc:request_generation_tokens_sum", model="m") == 16


def test_tick_events_feed_batch_and_inter_token_series() -> None:
    """A tick adds its batch size (tokens and sequences), its inter-token gaps and its decode and
    sampling time; a failed decode only adds time."""
    metrics = Metrics()
    metrics.on_tick(tick())
    metrics.on_tick(tick(is_ok=False, inter_token_ms=()))
    got = samples(metrics.render())
    assert value(got, "llama_grpc:iteration_tokens_total_count", model="m") == 1
    assert value(got, "llama_grpc:iteration_tokens_total_sum", model="m") == 40
    assert value(got, "llama_grpc:iteration_tokens_total_bucket", model="m", le="64.0") == 1
    assert value(got, "llama_grpc:iteration_sequences_sum", model="m") == 3
    assert value(got, "llama_grpc:inter_token_latency_seconds_count", model="m") == 2
    assert value(got, "llama_grpc:inter_token_latency_seconds_sum", model="m") == pytest.approx(
        0.075
    )
    assert value(got, "llama_grpc:eval_seconds_total", model="m") == pytest.approx(0.06)
    assert value(got, "llama_grpc:sample_seconds_total", model="m") == pytest.approx(0.004)


def test_snapshot_series_equal_the_engine_stats() -> None:
    """Gauges and cumulative counters are read from engine.stats() at scrape time: the same
    numbers GetStats returns (every field distinct, so a swapped series fails)."""
    stats = replace(make_snapshot(), engine_state="running", engine_error="")
    metrics = Metrics()
    assert not any(name.startswith("llama_grpc:num_") for name, _ in samples(metrics.render()))
    metrics.watch(lambda: {"m": stats})
    got = samples(metrics.render())
    expected = {
        "llama_grpc:requests_started_total": stats.requests_started,
        "llama_grpc:requests_finished_total": stats.requests_finished,
        "llama_grpc:requests_cancelled_total": stats.requests_cancelled,
        "llama_grpc:requests_deadline_exceeded_total": stats.requests_deadline_exceeded,
        "llama_grpc:requests_failed_total": stats.requests_failed,
        "llama_grpc:requests_rejected_total": stats.requests_rejected,
        "llama_grpc:prompt_tokens_total": stats.prompt_tokens,
        "llama_grpc:generation_tokens_total": stats.generated_tokens,
        "llama_grpc:prefix_cache_queries_total": stats.prompt_tokens,
        "llama_grpc:prefix_cache_hits_total": stats.cached_prompt_tokens,
        "llama_grpc:num_preemptions_total": stats.preemptions,
        "llama_grpc:engine_ticks_total": stats.ticks,
        "llama_grpc:engine_watchdog_trips_total": stats.watchdog_trips,
        "llama_grpc:num_requests_running": stats.active_slots,
        "llama_grpc:num_requests_waiting": stats.queue_depth,
        "llama_grpc:response_cache_entries": stats.response_cache_entries,
        "llama_grpc:response_cache_bytes": stats.response_cache_bytes,
        "llama_grpc:response_cache_hits_total": stats.response_cache_hits,
        "llama_grpc:response_cache_misses_total": stats.response_cache_misses,
        "llama_grpc:response_cache_evictions_total": stats.response_cache_evictions,
    }
    assert {name: value(got, name, model="m") for name in expected} == expected
    assert stats.disk_cache is not None
    disk_failures = value(got, "llama_grpc:disk_cache_write_failures_total", model="m")
    assert disk_failures == stats.disk_cache.write_failures
    kv_use = stats.kv_cells_used / stats.kv_cells_total
    assert value(got, "llama_grpc:kv_cache_usage_perc", model="m") == pytest.approx(kv_use)
    assert value(got, "llama_grpc:num_slots", model="m", state="idle") == stats.idle_slots
    assert value(got, "llama_grpc:engine_up", model="m") == 1


def test_engine_up_is_zero_once_the_engine_failed() -> None:
    metrics = Metrics()
    metrics.watch(lambda: {"m": make_snapshot()})  # engine_state "failed"
    assert value(samples(metrics.render()), "llama_grpc:engine_up", model="m") == 0


def test_rpc_series_use_grpc_prometheus_names() -> None:
    """grpc_server_started/handled totals and the handling-seconds histogram, labelled by
    service, method and code, plus the tenant."""
    metrics = Metrics()
    metrics.rpc_started("/llama_grpc.v1.LlmService/Generate", "team-a")
    metrics.rpc_handled("/llama_grpc.v1.LlmService/Generate", "INVALID_ARGUMENT", 0.002, "team-a")
    got = samples(metrics.render())
    labels = {
        "grpc_service": "llama_grpc.v1.LlmService",
        "grpc_method": "Generate",
        "tenant": "team-a",
    }
    assert value(got, "grpc_server_started_total", **labels) == 1
    assert value(got, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **labels) == 1
    assert value(got, "grpc_server_handling_seconds_count", **labels) == 1


def test_split_method() -> None:
    """A full method name splits into service and method."""
    assert split_method("/grpc.health.v1.Health/Check") == ("grpc.health.v1.Health", "Check")


def test_two_registries_in_one_process() -> None:
    """Each Metrics has its own registry: creating two is fine and they count separately."""
    first, second = Metrics(), Metrics()
    first.on_tick(tick())
    assert value(samples(first.render()), "llama_grpc:iteration_tokens_total_count", model="m") == 1
    assert not any(
        name.startswith("llama_grpc:iteration_tokens") for name, _ in samples(second.render())
    )


def test_serve_metrics_over_http() -> None:
    """serve_metrics on port 0 picks a free port and serves the exposition until closed."""
    metrics = Metrics()
    metrics.on_tick(tick())
    served = serve_metrics(metrics, "127.0.0.1", 0)
    try:
        got = scrape(served.port)
        assert value(got, "llama_grpc:iteration_tokens_total_count", model="m") == 1
    finally:
        served.close()
    with pytest.raises(urllib.error.URLError):
        scrape(served.port)


# What Prometheus 2.42 sends when it scrapes (scrape.go's acceptHeader): OpenMetrics first.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_a_prometheus_scrape_gets_the_names_with_their_colons() -> None:
    """Asked the way Prometheus asks, /metrics answers in the text format with every sample
    named as the dashboards query it (llama_grpc:...): prometheus_client's OpenMetrics output
    escapes the colons of sample names to underscores (client_python#1177), which left every
    engine series of the dashboard empty in a real Prometheus."""
    metrics = Metrics()
    metrics.on_tick(tick())
    served = serve_metrics(metrics, "127.0.0.1", 0)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{served.port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            content_type = response.headers["Content-Type"]
            got = samples(response.read())
    finally:
        served.close()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert value(got, "llama_grpc:iteration_tokens_total_count", model="m") == 1
    assert not [name for name, _ in got if name.startswith("llama_grpc_")]


def server_settings(metrics_port: int) -> Settings:
    return Settings(
        server=ServerSettings(host="127.0.0.1", port=0, metrics_port=metrics_port, grace_s=0.2)
    )


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    engine = FakeEngine()
    settings = server_settings(free_port())
    async with start_server(settings, lambda: engine, metrics=Metrics()) as running:
        assert await running.wait_loaded()
        yield running, engine


async def test_server_serves_rpc_and_engine_series(
    served: tuple[RunningServer, FakeEngine],
) -> None:
    """start_server(metrics=...) with --metrics-port: /metrics shows the RPCs just made (by
    code) and the engine counters GetStats reports."""
    running, _ = served
    assert running.metrics_port is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        await stub.Generate(pb.GenerateRequest(prompt="abc"))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Generate(pb.GenerateRequest(prompt=""))
        stats = await stub.GetStats(pb.GetStatsRequest())
    got = await asyncio.to_thread(scrape, running.metrics_port)
    labels = {"grpc_service": "llama_grpc.v1.LlmService", "grpc_method": "Generate", "tenant": ""}
    assert value(got, "grpc_server_started_total", **labels) == 2
    assert value(got, "grpc_server_handled_total", grpc_code="OK", **labels) == 1
    assert value(got, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **labels) == 1
    model = {"model": DEFAULT_MODEL_NAME}  # the pool's name of the default model
    assert value(got, "llama_grpc:requests_finished_total", **model) == stats.requests_finished
    assert value(got, "llama_grpc:prompt_tokens_total", **model) == stats.prompt_tokens == 4
    assert stats.requests_finished == 1
    assert value(got, "llama_grpc:model_loaded", **model) == 1
    assert value(got, "llama_grpc:model_loads_total", **model) == 1
    assert value(got, "llama_grpc:model_requests_waiting", **model) == 0


async def test_metrics_port_in_use_fails_the_start() -> None:
    """A taken --metrics-port stops the start with ServerStartError naming /metrics."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = server_settings(taken.getsockname()[1])
        with pytest.raises(ServerStartError, match="/metrics"):
            async with start_server(settings, FakeEngine, metrics=Metrics()):
                pass


async def test_no_metrics_port_no_http() -> None:
    """Without --metrics-port nothing listens for /metrics."""
    settings = server_settings(0)
    async with start_server(settings, FakeEngine, metrics=Metrics()) as running:
        assert running.metrics_port is None


def test_cli_run_passes_metrics_only_with_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """run() hands serve() a Metrics when --metrics-port is set, and None otherwise."""
    seen: list[object] = []

    async def serve(settings: Settings, factory: Callable[[], object], **kw: object) -> int:
        seen.append(kw.get("metrics"))
        return 0

    monkeypatch.setitem(
        sys.modules, "llama_grpc_server.rpc.plumbing.server", types.SimpleNamespace(serve=serve)
    )
    base = loading.load_settings([], {})
    cli.run(base)
    cli.run(replace(base, server=replace(base.server, metrics_port=9)))
    assert seen[0] is None and isinstance(seen[1], Metrics)
