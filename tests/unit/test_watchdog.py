"""The tick watchdog (watchdog.py) and EngineLoop with it, on real threads with the fake
runner: a forward pass that never returns ends every caller with UNAVAILABLE (ENGINE_HUNG), the
listeners hear it once, stats count the trip, the engine thread's stack is logged; a slow but
legitimate engine never trips it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import Failed, Finished
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.testing import FakeRunner, HangingRunner
from llama_grpc_server.watchdog import TickWatchdog, auto_bound_s, bound_s
from tests.support.loop import last_event, make_loop
from tests.support.scheduler import req

BOUND_S = 0.5


@pytest.mark.parametrize(
    ("configured", "n_batch", "prefill_token_ms", "expected"),
    [
        ("auto", 2048, 0.5, 30.0),  # 1.02 s a full batch: the floor
        ("auto", 2048, 5.0, 102.4),  # 10.24 s a full batch, ten times
        ("auto", 512, 0.0, 30.0),  # nothing measured: the floor
        (2.5, 2048, 5.0, 2.5),  # configured: as it is
        (0.0, 2048, 5.0, 0.0),  # off
    ],
)
def test_bound_is_configured_or_derived_from_the_measured_batch(
    configured: float | str, n_batch: int, prefill_token_ms: float, expected: float
) -> None:
    assert bound_s(configured, n_batch, prefill_token_ms) == pytest.approx(expected)


def test_auto_bound_is_ten_full_batches_at_least_thirty_seconds() -> None:
    assert auto_bound_s(4096, 1.0) == pytest.approx(40.96)
    assert auto_bound_s(1, 1000.0) == 30.0


def test_watchdog_trips_once_for_a_tick_that_does_not_end() -> None:
    trips: list[tuple[float, float, str]] = []
    tripped = threading.Event()

    def on_trip(seconds: float, bound: float) -> None:
        trips.append((seconds, bound, threading.current_thread().name))
        tripped.set()

    watchdog = TickWatchdog(0.3, on_trip)
    started = time.monotonic()
    watchdog.tick_started()
    assert tripped.wait(5)
    assert time.monotonic() - started >= 0.3
    watchdog._thread.join(5)  # it stops watching after a trip
    assert not watchdog._thread.is_alive()
    assert len(trips) == 1
    seconds, bound, thread = trips[0]
    assert bound == 0.3 and seconds >= 0.3 and thread == "llama-watchdog"


def test_watchdog_stops_at_once_and_rejects_a_bound_of_zero() -> None:
    watchdog = TickWatchdog(60.0, lambda s, b: None)
    watchdog.stop()
    watchdog._thread.join(1)  # sleeping for a quarter bound, it wakes on stop()
    assert not watchdog._thread.is_alive()
    with pytest.raises(ValueError, match="positive"):
        TickWatchdog(0.0, lambda s, b: None)


@pytest.fixture
async def hung() -> AsyncIterator[tuple[EngineLoop, HangingRunner]]:
    """Two slots; the third forward pass never returns until the test ends."""
    runner = HangingRunner(hang_at=3)
    engine = make_loop(n_parallel=2, runner=runner, watchdog_s=BOUND_S)
    yield engine, runner
    runner.release.set()
    await asyncio.to_thread(engine._thread.join, 5)
    assert not engine._thread.is_alive(), "the tick came back and the thread ended"


async def test_hung_tick_ends_every_caller_unavailable(
    hung: tuple[EngineLoop, HangingRunner],
) -> None:
    """Two running requests, one queued, one still in the inbox when the pass hangs: all four
    end with UNAVAILABLE, reason ENGINE_HUNG, naming the bound; later submissions are refused
    the same way; the stats count the trip and the four requests."""
    engine, runner = hung
    told: list[tuple[str, str]] = []
    engine.on_failure(lambda cause: told.append((cause, threading.current_thread().name)))
    with capture_logs() as logs:
        streams = [engine.submit(req(f"r{i}", 20, 50).spec) for i in range(3)]
        assert await asyncio.to_thread(runner.hanging.wait, 5)
        streams.append(engine.submit(req("r3", 20, 50).spec))
        finals = await asyncio.wait_for(asyncio.gather(*(last_event(s) for s in streams)), 10)
    errs = [f.error for f in finals if isinstance(f, Failed)]
    assert len(errs) == 4
    for error in errs:
        assert isinstance(error, errors.EngineHung)
        assert (error.code, error.reason) == ("UNAVAILABLE", "ENGINE_HUNG")
        assert "past the watchdog's 0.5 s" in error.message
    assert len(told) == 1 and told[0][1] == "llama-watchdog"
    assert told[0][0].startswith("a tick has run for ")
    stats = engine.stats()
    assert (stats.engine_state, stats.watchdog_trips, stats.requests_failed) == ("failed", 1, 4)
    with pytest.raises(errors.EngineHung, match="the engine has hung"):
        engine.submit(req("late", 20, 5).spec)
    hangs = [e for e in logs if e["event"] == "engine_hung"]
    assert len(hangs) == 1 and hangs[0]["log_level"] == "error"
    assert "in execute" in hangs[0]["stack"] and "self.release.wait()" in hangs[0]["stack"]
    assert engine._thread.is_alive(), "still stuck in the pass"


async def test_close_of_a_hung_engine_returns_at_once(
    hung: tuple[EngineLoop, HangingRunner],
) -> None:
    """close() does not wait for (nor free the model under) the stuck engine thread."""
    engine, runner = hung
    stream = engine.submit(req("a", 20, 50).spec)
    assert await asyncio.to_thread(runner.hanging.wait, 5)
    final = await asyncio.wait_for(last_event(stream), 10)
    assert isinstance(final, Failed) and isinstance(final.error, errors.EngineHung)
    started = time.monotonic()
    await asyncio.to_thread(engine.close)
    assert time.monotonic() - started < 1.0
    assert engine._thread.is_alive()


async def test_slow_but_legitimate_ticks_never_trip() -> None:
    """Every pass takes 60 % of the bound, for many bounds in all: every request finishes, the
    engine keeps running, nothing is counted."""
    runner = FakeRunner()
    runner.delay_s = 0.6 * BOUND_S
    engine = make_loop(n_parallel=2, runner=runner, watchdog_s=BOUND_S)
    try:
        streams = [engine.submit(req(f"s{i}", 8, 6).spec) for i in range(3)]
        finals = await asyncio.wait_for(asyncio.gather(*(last_event(s) for s in streams)), 30)
        assert all(isinstance(f, Finished) for f in finals), finals
        stats = engine.stats()
        assert stats.ticks * runner.delay_s > 3 * BOUND_S
        assert (stats.engine_state, stats.watchdog_trips, stats.requests_finished) == (
            "running",
            0,
            3,
        )
        assert engine._watchdog is not None and engine._watchdog._thread.is_alive()
    finally:
        await asyncio.to_thread(engine.close)
    assert engine._watchdog is not None
    await asyncio.to_thread(engine._watchdog._thread.join, 2)
    assert not engine._watchdog._thread.is_alive(), "close() stopped the watchdog"
