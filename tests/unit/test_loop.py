"""EngineLoop on its real thread, driven by the fake runner: engine death is contained (every
caller gets a status, new work is refused, stats and listeners say why) and stats are published
by the engine thread."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.core.request import Event, Failed, Finished, GenerationRequest
from llama_grpc_server.core.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.strategies import Allocation, BatchView, DecodeMaximal
from llama_grpc_server.loop import EngineLoop, EngineState
from llama_grpc_server.telemetry import configure_logging
from llama_grpc_server.testing import FakeRunner, fake_model_info

from .test_scheduler import PIECES, req

SECRET = "the-secret-prompt-text"


class CrashOnCall:
    """A strategy that raises on its nth allocate() call (a buggy custom strategy)."""

    name = "crash_on_call"

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0
        self.gate = threading.Event()  # the nth call raises once the test opens it

    def allocate(self, view: BatchView) -> Allocation:
        self.calls += 1
        if self.calls == self.n:
            self.gate.wait(5)
            raise ZeroDivisionError("strategy bug")
        return DecodeMaximal().allocate(view)


def make_loop(strategy: Any = None, n_parallel: int = 2) -> EngineLoop:
    scheduler = Scheduler(
        SchedulerLimits(n_parallel, 512, 64, 16, 8),
        pieces=PIECES,
        eog_ids=frozenset(),
        strategy=strategy,
    )
    return EngineLoop(
        scheduler, FakeRunner(), fake_model_info(), tokenizer=None, kv_cells_total=512
    )


@pytest.fixture
async def crashing() -> AsyncIterator[EngineLoop]:
    engine = make_loop(CrashOnCall(2))
    yield engine
    await asyncio.to_thread(engine.close)


async def final(engine: EngineLoop, spec: GenerationRequest) -> Event:
    events = [event async for event in engine.submit(spec)]
    return events[-1]


async def last_event(stream: Any) -> Event:
    events = [event async for event in stream]
    return events[-1]


def open_gate(engine: EngineLoop) -> None:
    strategy = engine._scheduler.strategy
    assert isinstance(strategy, CrashOnCall)
    strategy.gate.set()


async def test_engine_death_fails_in_flight_and_queued_requests(crashing: EngineLoop) -> None:
    """Two running requests, one queued and one still in the inbox when the strategy raises:
    all four end with INTERNAL naming the cause."""
    streams = [crashing.submit(req(f"r{i}", 20, 50).spec) for i in range(3)]
    strategy = crashing._scheduler.strategy
    assert isinstance(strategy, CrashOnCall)
    while strategy.calls < 2:  # the engine thread is inside the crashing call
        await asyncio.sleep(0.01)
    streams.append(crashing.submit(req("r3", 20, 50).spec))
    open_gate(crashing)
    finals = await asyncio.wait_for(asyncio.gather(*(last_event(s) for s in streams)), 5)
    assert all(isinstance(f, Failed) for f in finals)
    errs = [f.error for f in finals if isinstance(f, Failed)]
    assert all(isinstance(e, errors.EngineFailed) and e.code == "INTERNAL" for e in errs)
    assert all("ZeroDivisionError: strategy bug" in e.message for e in errs)


async def test_after_death_submit_is_unavailable_and_stats_say_why(crashing: EngineLoop) -> None:
    told: list[str] = []
    told_thread: list[str] = []

    def listener(cause: str) -> None:
        told.append(cause)
        told_thread.append(threading.current_thread().name)

    crashing.on_failure(listener)
    open_gate(crashing)
    await asyncio.wait_for(final(crashing, req("a", 20, 50).spec), 5)
    with pytest.raises(errors.EngineUnavailable, match="strategy bug") as caught:
        crashing.submit(req("b", 20, 5).spec)
    assert caught.value.code == "UNAVAILABLE"
    assert told == ["ZeroDivisionError: strategy bug"] and told_thread == ["llama-engine"]
    late: list[str] = []
    crashing.on_failure(late.append)  # registered after the death: told at once
    assert late == told
    stats = crashing.stats()
    assert (stats.engine_state, stats.engine_error) == ("failed", told[0])
    assert crashing.state is EngineState.FAILED


async def test_death_is_logged_once_with_traceback_but_no_request_content() -> None:
    engine = make_loop(CrashOnCall(3))
    open_gate(engine)
    spec = req("a", 20, 50).spec
    secret_spec = GenerationRequest(
        "secret", spec.prompt_tokens, spec.sampling, spec.stopping, session_id=SECRET
    )
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(final(engine, secret_spec), 5)
    finally:
        await asyncio.to_thread(engine.close)
    failures = [entry for entry in logs if entry["event"] == "engine_failed"]
    assert len(failures) == 1 and failures[0]["log_level"] == "error"
    assert "in allocate" in failures[0]["traceback"]
    assert SECRET not in repr(logs)


def _log_exception_with_locals(stream: io.StringIO, log_format: str) -> str:
    configure_logging(log_format, "info", stream=stream, cache_loggers=False)
    try:
        prompt = SECRET  # a local of the failing frame, like a request in the engine
        raise RuntimeError(f"failed after {len(prompt)} chars")
    except RuntimeError:
        structlog.get_logger("test").exception("boom")
    return stream.getvalue()


@pytest.mark.parametrize("log_format", ["json", "console"])
@pytest.mark.usefixtures("restore_logging")
def test_logged_tracebacks_never_render_frame_locals(log_format: str) -> None:
    out = _log_exception_with_locals(io.StringIO(), log_format)
    assert "RuntimeError" in out and "_log_exception_with_locals" in out
    assert SECRET not in out
    if log_format == "json":
        assert json.loads(out)["exception"]


async def test_stats_never_read_the_scheduler_off_the_engine_thread() -> None:
    """GetStats and /metrics read the snapshot the engine thread published after its last tick;
    the scheduler (which that thread mutates) is only ever read on the engine thread."""
    engine = make_loop()
    readers: list[str] = []
    snapshot = engine._scheduler.snapshot

    def recording_snapshot(kv_cells_total: int) -> Any:
        readers.append(threading.current_thread().name)
        return snapshot(kv_cells_total)

    engine._scheduler.snapshot = recording_snapshot  # type: ignore[method-assign]
    try:
        stream = engine.submit(req("a", 20, 3).spec)
        seen = [engine.stats()]
        events = []
        async for event in stream:
            events.append(event)
            seen.append(engine.stats())
    finally:
        await asyncio.to_thread(engine.close)
    assert isinstance(events[-1], Finished)
    assert readers and set(readers) == {"llama-engine"}
    # published before delivery: once the caller holds Finished, stats already agree
    assert seen[-1].requests_finished == 1 and seen[-1].active_slots == 0


async def test_stats_follow_a_request_that_expires_in_the_queue() -> None:
    """A tick that plans nothing but expires a queued request still publishes the stats."""
    engine = make_loop()
    expired = dataclasses.replace(req("late", 20, 5).spec, deadline=time.monotonic() - 1)
    try:
        last = await asyncio.wait_for(final(engine, expired), 5)
        stats = engine.stats()
    finally:
        await asyncio.to_thread(engine.close)
    assert isinstance(last, Failed) and isinstance(last.error, errors.DeadlineExceeded)
    assert (stats.queue_depth, stats.requests_failed) == (0, 1)
