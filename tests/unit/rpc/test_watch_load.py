"""WatchLoad behind a real grpc.aio server with the FakeEngine: the first report at once and
equal to GetStats, one report per interval, interval_ms checked, a drain ending the stream with
serving=false without holding the grace period, and the client's LoadStream wrappers."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from llama_grpc import AsyncClient, AsyncLoadStream, Client, InvalidArgumentError, LoadReport
from llama_grpc.types import load_report_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.testing import FakeEngine, encode
from tests.support.servicer_fake import SETTINGS, collect, details, read_all

LONG_S = 60_000  # ms: no second report within a test


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        yield running


async def first_report(stub: Any, interval_ms: int = LONG_S) -> tuple[pb.LoadReport, float]:
    """The first report of a fresh watch and the seconds it took; the watch is cancelled."""
    started = time.monotonic()
    call = stub.WatchLoad(pb.WatchLoadRequest(interval_ms=interval_ms))
    report = await asyncio.wait_for(call.read(), 5)
    elapsed = time.monotonic() - started
    call.cancel()
    return report, elapsed


async def reports_within(stub: Any, interval_ms: int, window_s: float) -> list[pb.LoadReport]:
    """What a watch receives in `window_s` seconds; then the client cancels it."""
    received: list[pb.LoadReport] = []
    call = stub.WatchLoad(pb.WatchLoadRequest(interval_ms=interval_ms))

    async def read() -> None:
        async for report in call:
            received.append(report)

    reader = asyncio.create_task(read())
    await asyncio.sleep(window_s)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    return received


async def test_first_report_is_immediate_and_matches_get_stats(stub: Any) -> None:
    """With a 60 s interval the first report still comes at once; idle after two requests (one
    a repeat, so the prefix cache hit), every figure equals GetStats'."""
    for _ in range(2):
        await stub.Generate(pb.GenerateRequest(prompt="hello there"))
    stats = await stub.GetStats(pb.GetStatsRequest())
    before_ms = time.time() * 1000
    report, elapsed = await first_report(stub)
    after_ms = time.time() * 1000
    assert elapsed < 2.0
    assert stats.kv_cells_used > 0
    assert stats.prefix_cache_hit_rate > 0
    same = ("queue_depth", "active_slots", "n_parallel", "kv_cells_used", "kv_cells_total")
    assert {f: getattr(report, f) for f in same} == {f: getattr(stats, f) for f in same}
    assert report.prefix_cache_hit_rate == stats.prefix_cache_hit_rate
    assert report.kv_cache_usage == pytest.approx(stats.kv_cells_used / stats.kv_cells_total)
    assert report.requests_running == stats.active_slots
    assert (report.engine_state, report.serving) == ("running", True)
    assert before_ms - 1 <= report.timestamp_unix_ms <= after_ms + 1


async def test_a_busy_server_reports_its_queue_and_running_requests(
    stub: Any, engine: FakeEngine
) -> None:
    """Five long requests on four slots: the report says 4 running, 1 queued, KV in use."""
    engine.token_delay_s = 0.05
    engine.script = lambda request: encode("y") * 100  # 5 s per request
    calls = [stub.StreamGenerate(pb.StreamGenerateRequest(prompt=f"request {i}")) for i in range(5)]
    try:
        for _ in range(200):
            stats = await stub.GetStats(pb.GetStatsRequest())
            if (stats.active_slots, stats.queue_depth) == (4, 1):
                break
            await asyncio.sleep(0.02)
        report, _ = await first_report(stub)
    finally:
        for call in calls:
            call.cancel()
    assert (report.active_slots, report.requests_running, report.queue_depth) == (4, 4, 1)
    assert report.n_parallel == 4
    assert 0 < report.kv_cells_used <= report.kv_cells_total
    assert report.kv_cache_usage == pytest.approx(report.kv_cells_used / report.kv_cells_total)
    assert 0 < report.kv_cache_usage < 1


async def test_one_report_per_interval(stub: Any) -> None:
    """100 ms for 0.55 s: the first at once and one every 100 ms (6; 5 to 7 allowed for a slow
    machine), never a burst; interval_ms 0 is the 1 s default: only the first in that time."""
    fast, default = await asyncio.gather(
        reports_within(stub, 100, 0.55), reports_within(stub, 0, 0.55)
    )
    assert 5 <= len(fast) <= 7
    stamps = [r.timestamp_unix_ms for r in fast]
    assert all(later - earlier >= 50 for earlier, later in itertools.pairwise(stamps))
    assert len(default) == 1


@pytest.mark.parametrize("interval_ms", [1, 99])
async def test_too_short_an_interval_is_invalid_argument(stub: Any, interval_ms: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.WatchLoad(pb.WatchLoadRequest(interval_ms=interval_ms)).read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "interval_ms must be at least 100" in (caught.value.details() or "")
    assert details(caught.value)["BadRequest"].field_violations[0].field == "interval_ms"


async def test_client_cancel_ends_the_handler(stub: Any) -> None:
    """A cancelled watch is over on the server too: its access line says CANCELLED."""
    with capture_logs() as logs:
        await first_report(stub)
        for _ in range(1000):  # up to 20 s: on a loaded box 2 s was not always enough
            access = [e for e in logs if e.get("event") == "rpc"]
            if access:
                break
            await asyncio.sleep(0.02)
    assert [(e["method"], e["code"]) for e in access] == [
        ("/llama_grpc.v1.LlmService/WatchLoad", "CANCELLED")
    ]


async def test_a_drain_ends_the_watch_with_serving_false_at_once(engine: FakeEngine) -> None:
    """stop(grace 5 s) with a watch open (60 s interval): the watch gets one last report with
    serving=false and ends OK, and stop() returns well before the grace period is over."""
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub: Any = pb_grpc.LlmServiceStub(channel)
            call = stub.WatchLoad(pb.WatchLoadRequest(interval_ms=LONG_S))
            first = await call.read()
            started = time.monotonic()
            stopping = asyncio.create_task(running.stop(grace_s=5))
            rest = await asyncio.wait_for(collect(read_all(call)), 10)
            await stopping
            stop_s = time.monotonic() - started
    assert first.serving
    assert len(rest) == 1
    assert not rest[0].serving
    assert rest[0].engine_state == "running"  # the engine closes after the drain
    assert await call.code() == grpc.StatusCode.OK
    assert stop_s < 2.0
    assert engine.is_closed


async def test_not_ready_while_the_model_loads() -> None:
    """Before the engine has loaded a watch is UNAVAILABLE with reason NOT_READY."""
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        release.wait(10)
        return FakeEngine()

    async with (
        start_server(SETTINGS, slow_factory) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        stub: Any = pb_grpc.LlmServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.WatchLoad(pb.WatchLoadRequest()).read()
        release.set()
        assert await running.wait_loaded()
        report, _ = await first_report(stub)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert details(caught.value)["ErrorInfo"].reason == "NOT_READY"
    assert report.serving


# -- the client's wrappers -------------------------------------------------------------------------


async def test_async_client_watch_load(server: RunningServer) -> None:
    """AsyncClient.watch_load yields LoadReport values every interval; aclose() cancels; a too
    short interval is InvalidArgumentError naming the field."""
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        stream = client.watch_load(interval_s=0.1)
        assert isinstance(stream, AsyncLoadStream)
        first, second = await anext(stream), await anext(stream)
        await stream.aclose()
        assert [r async for r in stream] == []
        with pytest.raises(InvalidArgumentError) as caught:
            await anext(client.watch_load(interval_s=0.05))
    assert isinstance(first, LoadReport)
    assert (first.n_parallel, first.engine_state, first.serving) == (4, "running", True)
    assert 50 <= second.timestamp_unix_ms - first.timestamp_unix_ms < 1000
    assert caught.value.field == "interval_ms"


async def test_async_client_watch_ends_when_the_server_drains(engine: FakeEngine) -> None:
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=1) as client:
            async with client.watch_load(interval_s=60) as stream:
                first = await anext(stream)
                stopping = asyncio.create_task(running.stop(grace_s=5))
                rest = [report async for report in stream]
            await stopping
    assert first.serving
    assert [r.serving for r in rest] == [False]


async def test_sync_client_watch_load(server: RunningServer) -> None:
    """Client.watch_load in a thread: two reports, then close() stops the iteration."""

    def watch() -> list[LoadReport]:
        with Client(f"127.0.0.1:{server.port}", timeout=0.05) as client:
            stream = client.watch_load(interval_s=0.1)
            reports = [next(stream), next(stream)]  # the default timeout does not apply
            stream.close()
            assert list(stream) == []
            return reports

    reports = await asyncio.wait_for(asyncio.to_thread(watch), 10)
    assert [r.serving for r in reports] == [True, True]
    assert reports[1].timestamp_unix_ms > reports[0].timestamp_unix_ms


def test_load_report_has_every_proto_field() -> None:
    assert set(LoadReport.__dataclass_fields__) == set(pb.LoadReport.DESCRIPTOR.fields_by_name)
    report = load_report_from_proto(pb.LoadReport(kv_cache_usage=0.5, serving=True))
    assert (report.kv_cache_usage, report.serving, report.queue_depth) == (0.5, True, 0)


@pytest.mark.parametrize("interval_s", [0.0, -1.0, 0.0004, float("nan"), float("inf")])
def test_client_refuses_a_non_positive_interval(interval_s: float) -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match="interval_s"):
        client.watch_load(interval_s=interval_s)
