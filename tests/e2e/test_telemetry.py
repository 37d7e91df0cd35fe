"""Telemetry end to end with the embedded model: /metrics scraped over HTTP after real requests,
the JSON access log, GetStats agreeing with Prometheus, and bus handlers on the engine thread."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest_asyncio
import structlog
from deploy.cluster import free_port

from llama_grpc import AsyncClient, Delta
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.observability.telemetry import (
    Bus,
    RequestEvent,
    Telemetry,
    TelemetryEvent,
    TickEvent,
    configure_logging,
)
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server

from ..conftest import Samples, scrape, value
from .conftest import settings

PROMPT = "The history of the printing press begins"
MODEL = DEFAULT_MODEL_NAME  # the `model` label of every engine series


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, TelemetryEvent]] = []

    def __call__(self, name: str, event: TelemetryEvent) -> None:
        self.seen.append((name, event))

    def requests(self) -> dict[str, RequestEvent]:
        return {e.request_id: e for _, e in self.seen if isinstance(e, RequestEvent)}

    def ticks(self) -> list[TickEvent]:
        return [e for _, e in self.seen if isinstance(e, TickEvent)]


@dataclass
class Observed:
    running: RunningServer
    bus: Bus
    recorder: Recorder
    log: io.StringIO
    client: AsyncClient

    @property
    def metrics_port(self) -> int:
        assert self.running.metrics_port is not None
        return self.running.metrics_port

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines() if line]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def observed() -> AsyncIterator[Observed]:
    """A real server with every telemetry output on: JSON logs into a buffer, Prometheus on a
    free port, a recording handler on a private bus."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    log = io.StringIO()
    configure_logging("json", "info", stream=log, cache_loggers=False)
    bus, recorder, metrics = Bus(), Recorder(), Metrics()
    for name in ("tick", "request_done", "request_failed"):
        bus.attach(name, recorder)
    hooks = Telemetry(bus=bus, sink=metrics, model=MODEL)
    base = settings(n_parallel=4)
    conf = replace(base, server=replace(base.server, metrics_port=free_port()))

    def factory() -> Any:
        return build_engine(conf, on_tick=hooks.on_tick, on_done=hooks.on_done)

    try:
        async with start_server(conf, factory, metrics=metrics) as running:
            assert await running.wait_loaded()
            async with AsyncClient(f"127.0.0.1:{running.port}", timeout=120) as client:
                yield Observed(running, bus, recorder, log, client)
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)


def total(got: Samples, name: str) -> float:
    return sum(v for (n, _), v in got.items() if n == name)


async def stream_text(client: AsyncClient, prompt: str, max_tokens: int) -> str:
    text = ""
    async for event in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        if isinstance(event, Delta):
            text += event.text
    return text


async def test_metrics_after_real_requests(observed: Observed) -> None:
    """After concurrent streams and a repeated prompt, /metrics holds the vLLM-style series
    with plausible values, and its counters equal GetStats'."""
    client = observed.client
    await asyncio.gather(*(stream_text(client, f"{PROMPT} {i}", 8) for i in range(3)))
    await client.generate(PROMPT + " in Mainz", max_tokens=6, ignore_eos=True)
    await client.generate(PROMPT + " in Mainz", max_tokens=6, ignore_eos=True)  # prefix hit
    stats = await client.stats()
    got = await asyncio.to_thread(scrape, observed.metrics_port)

    assert (
        value(got, "llama_grpc:generation_tokens_total", model=MODEL)
        == stats.generated_tokens
        >= 36
    )
    assert value(got, "llama_grpc:prompt_tokens_total", model=MODEL) == stats.prompt_tokens > 0
    assert value(got, "llama_grpc:prefix_cache_queries_total", model=MODEL) == stats.prompt_tokens
    assert (
        value(got, "llama_grpc:prefix_cache_hits_total", model=MODEL)
        == stats.cached_prompt_tokens
        > 0
    )
    assert (
        value(got, "llama_grpc:requests_finished_total", model=MODEL)
        == stats.requests_finished
        >= 5
    )
    assert total(got, "llama_grpc:request_success_total") == stats.requests_finished
    assert value(got, "llama_grpc:num_preemptions_total", model=MODEL) == stats.preemptions == 0
    assert value(got, "llama_grpc:num_requests_running", model=MODEL) == stats.active_slots == 0
    assert value(got, "llama_grpc:num_requests_waiting", model=MODEL) == 0
    assert (
        0 < value(got, "llama_grpc:kv_cache_usage_perc", model=MODEL) <= 1
    )  # finished slots keep KV

    finished = stats.requests_finished
    ttft_sum = value(got, "llama_grpc:time_to_first_token_seconds_sum", model=MODEL)
    e2e_sum = value(got, "llama_grpc:e2e_request_latency_seconds_sum", model=MODEL)
    assert value(got, "llama_grpc:time_to_first_token_seconds_count", model=MODEL) == finished
    assert value(got, "llama_grpc:e2e_request_latency_seconds_count", model=MODEL) == finished
    assert 0 < ttft_sum < e2e_sum
    assert (
        value(got, "llama_grpc:request_generation_tokens_sum", model=MODEL)
        == stats.generated_tokens
    )
    gaps = value(got, "llama_grpc:inter_token_latency_seconds_count", model=MODEL)
    assert gaps >= stats.generated_tokens - finished  # one per token after each first
    assert value(got, "llama_grpc:inter_token_latency_seconds_sum", model=MODEL) > 0
    assert 0 < value(got, "llama_grpc:iteration_tokens_total_count", model=MODEL) <= stats.ticks
    assert value(got, "llama_grpc:eval_seconds_total", model=MODEL) > 0

    labels = {
        "grpc_service": "llama_grpc.v1.LlmService",
        "grpc_method": "StreamGenerate",
        "tenant": "",  # no authentication: the anonymous caller
    }
    assert value(got, "grpc_server_handled_total", grpc_code="OK", **labels) >= 3
    assert value(got, "grpc_server_started_total", **labels) >= 3
    assert value(got, "grpc_server_handling_seconds_count", **labels) >= 3
    assert value(got, "process_resident_memory_bytes") > 0


async def test_request_events_have_real_values(observed: Observed) -> None:
    """request_done for a real request: counts match the response, TTFT within the duration,
    positive rates; a repeated prompt reports its cached prefix."""
    client = observed.client
    prompt = PROMPT + " and spreads across Europe"
    first = await client.generate(prompt, max_tokens=5, ignore_eos=True)
    second = await client.generate(prompt, max_tokens=5, ignore_eos=True)
    events = observed.recorder.requests()
    one, two = events[first.request_id], events[second.request_id]
    assert (one.prompt_tokens, one.generated_tokens) == (first.usage.prompt_tokens, 5)
    assert one.finish_reason == "max_tokens" and not one.is_failed
    assert one.ttft_ms is not None
    assert 0 <= one.queue_ms <= one.ttft_ms <= one.duration_ms
    assert one.prompt_eval_rate > 0 and one.generation_rate > 0
    assert 0 <= one.slot < 4
    assert two.prefix_cache_tokens == second.usage.cached_prompt_tokens > 0
    assert two.prefix_cache_ratio == two.prefix_cache_tokens / two.prompt_tokens
    ticks = observed.recorder.ticks()
    assert ticks and all(
        t.batch_size == t.decode_tokens + t.prefill_tokens + t.draft_tokens + t.pad_tokens
        for t in ticks
    )
    assert any(t.eval_ms > 0 for t in ticks)


async def test_access_log_carries_the_request_id(observed: Observed) -> None:
    """The JSON access line of a call has the x-request-id sent in metadata, the method, the
    code and the messages sent, and no prompt or completion text."""
    secret = "Zanzibar-quartz-prompt"
    rid = "e2e-telemetry-42"
    text = ""
    stream = observed.client.stream(
        secret, max_tokens=4, ignore_eos=True, metadata=(("x-request-id", rid),)
    )
    async for event in stream:
        if isinstance(event, Delta):
            text += event.text
    for _ in range(200):  # the line is written just after the client sees the end
        lines = [d for d in observed.log_lines() if d.get("request_id") == rid]
        if any(d["event"] == "rpc" for d in lines):
            break
        await asyncio.sleep(0.01)
    [line] = [d for d in lines if d["event"] == "rpc"]
    assert line["method"] == "/llama_grpc.v1.LlmService/StreamGenerate"
    assert line["code"] == "OK" and line["level"] == "info"
    assert line["messages_sent"] == 5  # four deltas and the done message
    assert 0 <= line["first_message_ms"] <= line["duration_ms"]
    assert line["peer"].startswith("ipv4:127.0.0.1")
    assert text  # something was generated, and none of the logs carries the prompt
    assert secret not in observed.log.getvalue()


async def test_getstats_counters_move(observed: Observed) -> None:
    """One more request moves GetStats' cumulative counters by exactly its own numbers, and
    /metrics moves with them."""
    client = observed.client
    before = await client.stats()
    result = await client.generate(PROMPT + " with movable type", max_tokens=7, ignore_eos=True)
    after = await client.stats()
    assert after.requests_started == before.requests_started + 1
    assert after.requests_finished == before.requests_finished + 1
    assert after.prompt_tokens == before.prompt_tokens + result.usage.prompt_tokens
    assert after.generated_tokens == before.generated_tokens + 7
    assert after.ticks > before.ticks
    got = await asyncio.to_thread(scrape, observed.metrics_port)
    assert value(got, "llama_grpc:requests_started_total", model=MODEL) == after.requests_started
    assert value(got, "llama_grpc:generation_tokens_total", model=MODEL) == after.generated_tokens


async def test_raising_handler_is_detached_and_serving_continues(observed: Observed) -> None:
    """A handler that raises on the engine thread is detached after its first call, logged,
    and requests keep being served (and reported to the other handlers)."""
    calls: list[str] = []

    def broken(name: str, event: TelemetryEvent) -> None:
        calls.append(name)
        raise RuntimeError("bug in an embedder's handler")

    observed.bus.attach("tick", broken)
    observed.bus.attach("request_done", broken)
    first = await observed.client.generate(PROMPT + " in Venice", max_tokens=4, ignore_eos=True)
    second = await observed.client.generate(PROMPT + " in Paris", max_tokens=4, ignore_eos=True)
    assert first.usage.completion_tokens == second.usage.completion_tokens == 4
    assert sorted(calls) == ["request_done", "tick"]
    assert broken not in observed.bus.handlers("tick")
    assert broken not in observed.bus.handlers("request_done")
    detached = [d for d in observed.log_lines() if d["event"] == "telemetry_handler_detached"]
    assert {d["telemetry_event"] for d in detached} == {"tick", "request_done"}
    assert all(d["level"] == "error" and "RuntimeError" in json.dumps(d) for d in detached)
    assert second.request_id in observed.recorder.requests()
