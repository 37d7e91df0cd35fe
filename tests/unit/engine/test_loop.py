"""EngineLoop on its real thread, driven by the fake runner: engine death is contained (every
caller gets a status, new work is refused, stats and listeners say why) and stats are published
by the engine thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.strategies import Allocation, BatchView, DecodeMaximal
from llama_grpc_server.engine import inbox
from llama_grpc_server.engine.burst import LONE_STARTS_TO_SKIP, BurstDetector
from llama_grpc_server.engine.loop import IDLE_RELEASE_S, EngineLoop, EngineState
from llama_grpc_server.observability.telemetry import configure_logging
from llama_grpc_server.testing import FakeRunner
from tests.support.loop import last_event, make_loop
from tests.support.scheduler import req

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


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll condition() every 5 ms until it holds (TimeoutError after timeout_s)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def crashing() -> AsyncIterator[EngineLoop]:
    engine = make_loop(CrashOnCall(2))
    yield engine
    await asyncio.to_thread(engine.close)


async def final(engine: EngineLoop, spec: GenerationRequest) -> Event:
    events = [event async for event in engine.submit(spec)]
    return events[-1]


def open_gate(engine: EngineLoop) -> None:
    strategy = engine._scheduler.passes.strategy
    assert isinstance(strategy, CrashOnCall)
    strategy.gate.set()


async def test_engine_death_fails_in_flight_and_queued_requests(crashing: EngineLoop) -> None:
    """Two running requests, one queued and one still in the inbox when the strategy raises:
    all four end with INTERNAL naming the cause."""
    streams = [crashing.submit(req(f"r{i}", 20, 50).spec) for i in range(3)]
    strategy = crashing._scheduler.passes.strategy
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
    stats = crashing.stats()  # the four count as failed (GetStats, /metrics), not lost
    assert (stats.engine_state, stats.requests_failed, stats.requests_cancelled) == ("failed", 4, 0)


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


async def test_ticks_publish_stats_on_changes_and_counters_are_read_live() -> None:
    """A tick publishes a snapshot only when a request was admitted, ended or preempted, or
    PUBLISH_EVERY_S passed; meanwhile GetStats reads the counters live, so they are exact."""
    engine = make_loop()
    publishes: list[int] = []
    snapshot = engine._scheduler.snapshot

    def counting_snapshot(kv_cells_total: int) -> Any:
        publishes.append(kv_cells_total)
        return snapshot(kv_cells_total)

    engine._scheduler.snapshot = counting_snapshot  # type: ignore[method-assign]
    received, behind = 0, []
    try:
        async for event in engine.submit(req("a", 20, 60).spec):
            received += len(getattr(event, "token_ids", ()))
            if engine.stats().generated_tokens < received:
                behind.append(received)
        stats = engine.stats()
    finally:
        await asyncio.to_thread(engine.close)
    assert not behind, "the counters are never older than what the caller holds"
    assert stats.generated_tokens == received == 60 and stats.ticks >= 60
    assert len(publishes) < stats.ticks / 2


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
    assert (stats.queue_depth, stats.requests_deadline_exceeded, stats.requests_failed) == (0, 1, 0)


# -- admission window ------------------------------------------------------------------------------


async def first_plan_requests(window_s: float, gap_s: float) -> set[str]:
    """Submit two requests gap_s apart to an idle engine whose passes take 50 ms; the request
    ids in its first forward pass."""
    runner = FakeRunner()
    runner.delay_s = 0.05
    engine = make_loop(n_parallel=2, runner=runner, admission_window_s=window_s)
    try:
        first = engine.submit(req("a", 4, 3).spec)
        await asyncio.sleep(gap_s)
        second = engine.submit(req("b", 4, 3).spec)
        finals = await asyncio.wait_for(asyncio.gather(last_event(first), last_event(second)), 5)
    finally:
        await asyncio.to_thread(engine.close)
    assert all(isinstance(f, Finished) for f in finals)
    plans = [p for p in runner.plans if p.chunks]
    return {chunk.request_id for chunk in plans[0].chunks}


async def test_without_window_a_burst_straggles_into_a_later_pass() -> None:
    assert await first_plan_requests(0.0, 0.01) == {"a"}


async def test_admission_window_starts_a_burst_as_one_batch() -> None:
    """The second request arrives 10 ms after the first, within the 200 ms window (it need
    not wait out the window: the arrivals pause, and the pass starts)."""
    assert await first_plan_requests(0.2, 0.01) == {"a", "b"}


async def test_a_caller_sending_one_at_a_time_stops_paying_the_window() -> None:
    """Three lone starts that each waited a whole window for nothing: the fourth start does not
    wait, so a request sent right after it rides in a later pass (with the window, both would
    start together); that arrival, which the window would have caught, turns the window back
    on: the next burst starts as one batch again. Each start is an idle one: a request that
    arrives while the engine still finishes the last one is not (no window then at all)."""
    runner = FakeRunner()
    runner.delay_s = 0.05
    engine = make_loop(n_parallel=2, runner=runner, admission_window_s=0.5)

    async def idle() -> None:
        for _ in range(1000):
            if not engine._scheduler.has_work:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the engine never went idle")

    def first_pass(request_id: str) -> set[str] | None:
        """The requests in the first pass that fed request_id (None: none yet)."""
        for plan in list(runner.plans):
            ids = {chunk.request_id for chunk in plan.chunks}
            if request_id in ids:
                return ids
        return None

    async def burst(tag: str) -> set[str] | None:
        await idle()
        first, start = engine.submit(req(f"{tag}a", 4, 3).spec), time.monotonic()
        # until its first pass has started, or for 400 ms of the 500 ms window
        while first_pass(f"{tag}a") is None and time.monotonic() - start < 0.4:
            await asyncio.sleep(0.002)
        second = engine.submit(req(f"{tag}b", 4, 3).spec)
        finals = await asyncio.wait_for(asyncio.gather(last_event(first), last_event(second)), 5)
        assert all(isinstance(f, Finished) for f in finals)
        return first_pass(f"{tag}a")

    try:
        for i in range(LONE_STARTS_TO_SKIP):
            await idle()
            final = await asyncio.wait_for(last_event(engine.submit(req(f"lone{i}", 4, 2).spec)), 5)
            assert isinstance(final, Finished)
        assert await burst("x") == {"xa"}  # started at once: the second came too late for it
        assert await burst("y") == {"ya", "yb"}  # the window is on again
    finally:
        await asyncio.to_thread(engine.close)


@pytest.mark.parametrize(
    ("events", "waits"),
    [
        # (gathered n | arrived after s), then whether the next start waits
        ([], True),
        ([("gathered", 1)] * LONE_STARTS_TO_SKIP, False),
        ([("gathered", 1)] * (LONE_STARTS_TO_SKIP - 1), True),
        ([("gathered", 1), ("gathered", 1), ("gathered", 2), ("gathered", 1)], True),
        ([("gathered", 1)] * LONE_STARTS_TO_SKIP + [("skip", 0), ("arrived", 0.005)], True),
        ([("gathered", 1)] * LONE_STARTS_TO_SKIP + [("skip", 0), ("arrived", 0.5)], False),
    ],
)
def test_burst_detector(events: list[tuple[str, float]], waits: bool) -> None:
    """Lone starts in a row turn the window off; an arrival within the horizon (10 ms) of a
    start that skipped it turns it back on; a later one (a new request, not a straggler) not."""
    detector, now = BurstDetector(horizon_s=0.01), 100.0
    for kind, value in events:
        if kind == "gathered":
            detector.gathered(int(value))
        elif kind == "skip":
            assert not detector.should_wait(now)
        else:
            detector.arrived(now + value)
    assert detector.should_wait(now + 1.0) is waits


async def test_admission_window_never_holds_back_work_while_busy() -> None:
    """A request arriving while another runs joins at the next pass: no window then (the
    window is 100 ms, five 20 ms passes)."""
    runner = FakeRunner()
    runner.delay_s = 0.02
    engine = make_loop(n_parallel=2, runner=runner, admission_window_s=0.1)
    try:
        first = engine.submit(req("a", 4, 40).spec)
        while not runner.plans:
            await asyncio.sleep(0.005)
        submitted_at = len(runner.plans)
        finals = await asyncio.wait_for(
            asyncio.gather(last_event(first), last_event(engine.submit(req("b", 4, 2).spec))), 5
        )
    finally:
        await asyncio.to_thread(engine.close)
    assert all(isinstance(f, Finished) for f in finals)
    joined_at = next(
        i for i, p in enumerate(runner.plans) if any(c.request_id == "b" for c in p.chunks)
    )
    assert joined_at - submitted_at <= 2, (submitted_at, joined_at)


# -- coalescing ------------------------------------------------------------------------------------


async def read_all(stream: Any, *, after: asyncio.Event | None = None) -> list[Event]:
    if after is not None:
        await after.wait()
    return [event async for event in stream]


async def test_a_consumer_that_keeps_up_gets_one_delta_per_token() -> None:
    runner = FakeRunner()
    runner.delay_s = 0.05  # each pass leaves the consumer ample time
    engine = make_loop(runner=runner)
    try:
        events = await asyncio.wait_for(read_all(engine.submit(req("a", 4, 5).spec)), 5)
    finally:
        await asyncio.to_thread(engine.close)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [len(d.token_ids) for d in deltas] == [1] * 5
    assert isinstance(events[-1], Finished)


async def test_deltas_that_piled_up_go_out_as_one_and_lose_nothing() -> None:
    """A consumer that reads only after the request finished (a stalled client) gets the five
    tokens in one delta, then Finished: the same ids and text as one delta per token."""
    runner = FakeRunner()
    runner.delay_s = 0.05
    engine = make_loop(runner=runner)
    try:
        fast = await asyncio.wait_for(read_all(engine.submit(req("a", 4, 5).spec)), 5)
        stream = engine.submit(req("a", 4, 5).spec)
        while engine.stats().requests_finished < 2:  # polls another thread
            await asyncio.sleep(0.01)
        slow = await asyncio.wait_for(read_all(stream), 5)
    finally:
        await asyncio.to_thread(engine.close)
    fast_deltas = [e for e in fast if isinstance(e, TokenDelta)]
    slow_deltas = [e for e in slow if isinstance(e, TokenDelta)]
    assert len(slow_deltas) == 1 < len(fast_deltas)
    assert slow_deltas[0].token_ids == tuple(t for d in fast_deltas for t in d.token_ids)
    assert slow_deltas[0].text == "".join(d.text for d in fast_deltas)
    assert isinstance(slow[-1], Finished) and len(slow) == 2


async def test_close_during_the_admission_window_ends_the_waiting_request() -> None:
    """Shutdown does not wait out the window: the request still in it ends at once (close()
    cancels what is left, as it does without a window)."""
    engine = make_loop(admission_window_s=30.0)
    stream = engine.submit(req("a", 4, 3).spec)
    await asyncio.sleep(0.05)  # the engine thread is inside the 30 s window now
    await asyncio.wait_for(asyncio.to_thread(engine.close), 5)
    event = await asyncio.wait_for(last_event(stream), 5)
    assert isinstance(event, Failed), event
    assert event.error.code == "CANCELLED", event.error


# -- tenants ---------------------------------------------------------------------------------------


async def test_two_tenants_run_the_same_request_id_and_cancel_only_their_own() -> None:
    """x-request-id is the caller's own: another tenant's request with the same id runs beside
    it (its own sampler and stream) and cancelling one leaves the other running; within a
    tenant a second one in flight is still refused."""
    runner = FakeRunner()
    runner.delay_s = 0.002
    engine = make_loop(n_parallel=2, runner=runner)
    spec = req("same", 20, 40).spec
    try:
        a = engine.submit(dataclasses.replace(spec, tenant="a"))
        b = engine.submit(dataclasses.replace(spec, tenant="b"))
        with pytest.raises(errors.DuplicateRequest):
            engine.submit(dataclasses.replace(spec, tenant="a"))
        b_events = b.__aiter__()
        firsts = await asyncio.wait_for(asyncio.gather(anext(a.__aiter__()), anext(b_events)), 5)
        a.cancel()
        rest = await asyncio.wait_for(read_all(b_events), 5)
        stats = engine.stats()
    finally:
        await asyncio.to_thread(engine.close)
    assert all(isinstance(e, TokenDelta) for e in firsts)  # both were running
    assert isinstance(rest[-1], Finished) and rest[-1].usage.completion_tokens == 40
    assert (stats.requests_cancelled, stats.requests_finished) == (1, 1)


async def test_a_clear_cache_whose_caller_gave_up_does_not_kill_the_engine() -> None:
    """ClearCache's caller cancelled (a deadline) while the engine thread was busy: the engine
    finds the cancelled future, skips the clear and keeps serving (it once set a result on the
    cancelled future, raised InvalidStateError and died)."""
    runner = FakeRunner()
    runner.delay_s = 0.2  # the engine thread sits in a forward pass while the caller gives up
    engine = make_loop(runner=runner)
    try:
        # 10 tokens: however late the first delta is read, the engine is still mid-request
        running = engine.submit(req("a", 4, 10).spec)
        first = await asyncio.wait_for(anext(aiter(running)), 5)
        # The delta is posted just before the engine thread drains its inbox between two
        # passes: a clear sent at once can still make that drain (it failed 1 run in 6). Once
        # the runner has a plan more, the drain is behind it and the thread is in a 200 ms pass.
        num_plans = len(runner.plans)
        await until(lambda: len(runner.plans) > num_plans)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.clear_cache(), 0.01)
        rest = await asyncio.wait_for(read_all(running), 10)
        after = await asyncio.wait_for(final(engine, req("b", 4, 2).spec), 5)
        cleared = await asyncio.wait_for(engine.clear_cache(), 5)
    finally:
        await asyncio.to_thread(engine.close)
    assert isinstance(first, TokenDelta)
    assert isinstance(rest[-1], Finished)
    assert isinstance(after, Finished)
    assert engine.stats().engine_state != "failed"
    assert cleared.cleared_slots >= 1


async def test_an_idle_engine_calls_on_idle_once_per_idle_period() -> None:
    """on_idle (engine/openmp.py: release llama.cpp's helper threads) runs on the engine thread
    once the engine has had nothing to do for IDLE_RELEASE_S: once per idle period, never while
    a request runs, and again once the next request is done."""
    calls: list[tuple[str, float]] = []
    runner = FakeRunner()
    runner.delay_s = 0.02  # 10 tokens: ~200 ms of passes, 4 x IDLE_RELEASE_S

    def on_idle() -> None:
        calls.append((threading.current_thread().name, time.monotonic()))

    engine = make_loop(runner=runner, on_idle=on_idle)
    try:
        await until(lambda: len(calls) >= 1)
        await asyncio.sleep(IDLE_RELEASE_S * 3)  # time for a (wrong) second call
        assert len(calls) == 1  # idle since the start: once, not every IDLE_RELEASE_S
        events = await asyncio.wait_for(read_all(engine.submit(req("a", 4, 10).spec)), 5)
        ended = time.monotonic()
        assert isinstance(events[-1], Finished)
        assert len(calls) == 1
        await until(lambda: len(calls) >= 2)
        await asyncio.sleep(IDLE_RELEASE_S * 3)  # time for a (wrong) third call
        assert len(calls) == 2 and calls[1][1] >= ended - IDLE_RELEASE_S
    finally:
        await asyncio.to_thread(engine.close)
    assert {name for name, _ in calls} == {"llama-engine"}


# -- overlap_decode: a tick's events go out while the next forward pass runs ---------------------


class RecordingRunner(FakeRunner):
    """Logs each launch and each collect (by tick) next to the loop's posts to the event loop."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.log = log

    def launch(self, plan: Any) -> Any:
        self.log.append(("launch", plan.tick))
        result = FakeRunner.execute(self, plan)

        def collect() -> Any:
            self.log.append(("collect", plan.tick))
            return result

        return collect

    def execute(self, plan: Any) -> Any:
        return self.launch(plan)()


async def run_streams(overlap: bool, log: list[tuple[str, int]] | None = None) -> list[Any]:
    """Four requests of different lengths (two slots, so two wait for a free one); each one's
    events, in order. The log gets ("post", 1) for a post holding a first token or an end,
    ("post", 0) for one of later tokens only."""
    runner = RecordingRunner(log if log is not None else [])
    engine = make_loop(n_parallel=2, runner=runner, overlap_decode=overlap)
    post = engine._post

    def recording_post(by_loop: Any) -> None:
        pairs = [pair for batch in by_loop.values() for pair in batch]
        urgent = any(
            isinstance(event, Finished) or stream.request.num_output == len(event.token_ids)
            for stream, event in pairs
        )
        runner.log.append(("post", int(urgent)))
        post(by_loop)

    engine._post = recording_post  # type: ignore[method-assign]
    try:
        streams = [engine.submit(req(f"r{i}", 10 + 3 * i, 3 + 2 * i).spec) for i in range(4)]
        return list(await asyncio.wait_for(asyncio.gather(*(read_all(s) for s in streams)), 5))
    finally:
        await asyncio.to_thread(engine.close)


def tokens_and_ends(events: list[Event]) -> tuple[list[int], Any]:
    ids = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    end = events[-1]
    assert isinstance(end, Finished)
    return ids, (end.reason, end.usage.completion_tokens)


async def test_overlap_decode_changes_no_output() -> None:
    plain = [tokens_and_ends(events) for events in await run_streams(False)]
    overlapped = [tokens_and_ends(events) for events in await run_streams(True)]
    assert overlapped == plain
    assert [len(ids) for ids, _ in plain] == [3, 5, 7, 9]


def posts_by_place(log: list[tuple[str, int]]) -> dict[str, list[int]]:
    """Each post's urgency, by where it happened: inside a forward pass (after a launch,
    before its collect) or between passes."""
    out: dict[str, list[int]] = {"inside": [], "between": []}
    last = ""
    for kind, value in log:
        if kind == "post":
            out["inside" if last == "launch" else "between"].append(value)
        else:
            last = kind
    return out


async def test_overlap_decode_posts_later_tokens_during_the_next_pass() -> None:
    """Off: every post comes between passes. On: later tokens go out during the next pass
    (after its launch, before its collect: when a GPU computes), while first tokens and ends
    still go out right after their own pass."""
    log: list[tuple[str, int]] = []
    await run_streams(False, log)
    off = posts_by_place(log)
    assert not off["inside"] and len(off["between"]) > 5
    log = []
    await run_streams(True, log)
    on = posts_by_place(log)
    # 24 tokens on 2 slots: the ticks without a first token or an end (7 here) are held
    assert len(on["inside"]) >= 5
    assert on["inside"] == [0] * len(on["inside"])  # never a first token or an end
    assert sum(on["between"]) >= 4  # each request's first token and end, at once


async def test_overlap_decode_publishes_stats_before_delivering() -> None:
    """As without the overlap: a caller holding Finished reads stats that include it."""
    engine = make_loop(overlap_decode=True)
    try:
        streams = [engine.submit(req(rid, 20, n).spec) for rid, n in (("a", 3), ("b", 9))]
        events = []
        async for event in streams[0]:
            events.append(event)
        stats = engine.stats()
        await asyncio.wait_for(read_all(streams[1]), 5)
    finally:
        await asyncio.to_thread(engine.close)
    assert isinstance(events[-1], Finished)
    assert stats.requests_finished >= 1  # "a" ended while "b" was still generating


def test_an_inbox_call_answers_its_caller_and_raises_what_fails_the_engine() -> None:
    """inbox.Call on the engine thread: a result or a ServiceError is the caller's answer;
    anything else is also raised on (the engine dies of it) after the caller heard why."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    inbox.Call(lambda: 7, done).run()
    assert done.result() == 7

    def refuse() -> int:
        raise errors.InvalidRequest("no", field="name")

    done = concurrent.futures.Future()
    inbox.Call(refuse, done).run()
    assert isinstance(done.exception(), errors.InvalidRequest)

    def crash() -> int:
        raise ZeroDivisionError("bug\nmore")

    done = concurrent.futures.Future()
    with pytest.raises(ZeroDivisionError):
        inbox.Call(crash, done).run()
    failed = done.exception()
    assert isinstance(failed, errors.EngineFailed)
    assert failed.message == "the engine failed: ZeroDivisionError: bug"

    cancelled: concurrent.futures.Future[Any] = concurrent.futures.Future()
    cancelled.cancel()
    inbox.Call(crash, cancelled).run()  # the caller gave up: nothing runs, nothing raises


def test_a_dead_engine_refuses_the_commands_still_waiting() -> None:
    """inbox.refuse: the callers waiting on an answer hear the error; commands without an
    answer, and answers already given, are left alone."""
    waiting: concurrent.futures.Future[Any] = concurrent.futures.Future()
    cleared: concurrent.futures.Future[Any] = concurrent.futures.Future()
    answered: concurrent.futures.Future[Any] = concurrent.futures.Future()
    answered.set_result(1)
    error = errors.EngineUnavailable("the engine has failed: x")
    inbox.refuse(
        [
            inbox.Call(lambda: 1, waiting),
            inbox.ClearCache(cleared),
            inbox.Call(lambda: 1, answered),
            inbox.Cancel("r", "t"),
            inbox.EndAll(error),
        ],
        error,
    )
    assert waiting.exception() is error and cleared.exception() is error
    assert answered.result() == 1


def test_describe_names_an_exception_in_one_bounded_line() -> None:
    """errors.describe, the cause the engine's death and a model's failed load report."""
    assert errors.describe(ValueError("first\nsecond")) == "ValueError: first"
    assert errors.describe(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert len(errors.describe(RuntimeError("x" * 1000))) == errors.MAX_CAUSE_CHARS
