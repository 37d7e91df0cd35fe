"""Back-pressure for slow readers, with the fake runner (no model): a request whose reader has
stream_buffer_tokens unread is not planned, keeps its KV, and resumes exactly where it left off
when the reader reads (output identical to an unpaused run); a reader that reads nothing for
stalled_reader_s meanwhile ends its request with RESOURCE_EXHAUSTED (STALLED_READER); through
the EngineLoop, the read wakes the sleeping engine."""

from __future__ import annotations

import asyncio
import sys

from llama_grpc_server.core.requests.request import (
    Emitted,
    Failed,
    Finished,
    GenerationRequest,
    ReaderProgress,
    Request,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeEngine, FakeRunner, encode
from tests.support.scheduler import PIECES, Clock, alone, finals, outputs, req

BOUND = 4


def make(clock: Clock | None = None, stall_s: float = 0.0) -> Scheduler:
    clock = clock or Clock()
    limits = SchedulerLimits(
        2, 512, 64, 16, 8, stream_buffer_tokens=BOUND, stalled_reader_s=stall_s
    )
    return Scheduler(
        limits,
        pieces=PIECES,
        eog_ids=frozenset(),
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )


def reading(request: Request) -> Request:
    request.reader = ReaderProgress()
    return request


def tick(s: Scheduler, runner: FakeRunner) -> tuple[set[str], Emitted]:
    """One tick: the requests it fed, and its events."""
    plan, events = s.schedule()
    if plan is None:
        return set(), events
    fed = {c.request_id for c in plan.chunks}
    return fed, events + s.update(plan, runner.execute(plan))


def run_until_paused(
    clock: Clock, max_tokens: int
) -> tuple[Scheduler, FakeRunner, Request, Emitted]:
    """A request whose reader reads nothing (stalled_reader_s 5), ticked until it pauses."""
    s, runner = make(clock, stall_s=5.0), FakeRunner()
    slow = reading(req("slow", 20, max_tokens))
    s.add(slow)
    events: Emitted = []
    while s.has_work:
        events += tick(s, runner)[1]
    return s, runner, slow, events


def unread(request: Request) -> int:
    assert request.reader is not None
    return request.num_sent - request.reader.num_read


def test_a_paused_request_is_not_planned_and_resumes_exactly_where_it_left_off() -> None:
    s, runner = make(), FakeRunner()
    slow, fast = reading(req("slow", 20, 12)), reading(req("fast-one", 20, 12))
    s.add(slow)
    s.add(fast)
    events: Emitted = []
    paused_ticks = 0
    while s.has_work:
        fed, got = tick(s, runner)
        events += got
        assert fast.reader is not None
        fast.reader.num_read = fast.num_sent  # a reader that keeps up
        assert unread(slow) <= BOUND
        if unread(slow) == BOUND and fast.state.value != "finished":
            paused_ticks += "slow" not in fed
    assert paused_ticks > 0, "the fast request ran on while the slow one was paused"
    assert isinstance(finals(events)["fast-one"], Finished)
    assert "slow" not in finals(events), "paused, not ended"
    assert outputs(events)["slow"] == alone(20, 12, "slow")[:BOUND]
    assert s.snapshot(512).paused_streams == 1
    assert s.snapshot(512).slots[slow.slot_id].buffered_tokens == BOUND
    kv_before = list(runner.kv[slow.slot_id])
    assert s.schedule() == (None, []), "nothing to plan: the engine may sleep"
    assert runner.kv[slow.slot_id] == kv_before, "its KV is kept"

    assert slow.reader is not None
    while not isinstance(finals(events).get("slow"), Finished):
        slow.reader.num_read = slow.num_sent  # the reader takes everything sent so far
        assert s.has_work
        while s.has_work:
            events += tick(s, runner)[1]
            assert unread(slow) <= BOUND
    assert outputs(events)["slow"] == alone(20, 12, "slow")
    assert outputs(events)["fast-one"] == alone(20, 12, "fast-one")
    assert runner.fed["slow"] == 20 + 12 - 1, "nothing recomputed after a pause"
    assert s.counters.reader_pauses == 2  # at 4 and 8 unread of 12 tokens


def test_a_reader_that_reads_nothing_for_stalled_reader_s_ends_resource_exhausted() -> None:
    clock = Clock()
    s, runner, slow, events = run_until_paused(clock, 12)
    assert unread(slow) == BOUND and not s.has_work
    wait = s.idle_wait_s()
    assert wait is not None and 4.9 < wait <= 5.0, "the sleeping engine wakes for the stall"
    clock.ns += 5_000_000_000
    assert s.has_work
    events += tick(s, runner)[1]
    (event,) = [e for r, e in events if isinstance(e, Failed)]
    assert event.error.code == "RESOURCE_EXHAUSTED" and event.error.reason == "STALLED_READER"
    assert "read nothing for 5 s with 4 tokens waiting" in event.error.message
    assert all(slot.is_idle for slot in s.slots), "its slot is free"
    snap = s.snapshot(512)
    assert (snap.stalled_readers, snap.paused_streams, snap.requests_failed) == (1, 0, 1)


def test_a_reader_that_reads_in_time_is_not_ended() -> None:
    clock = Clock()
    s, runner, slow, events = run_until_paused(clock, 8)
    while not finals(events):
        while s.has_work:
            events += tick(s, runner)[1]
        clock.ns += 4_000_000_000  # reads every 4 s: under the 5 s stall bound
        assert slow.reader is not None
        slow.reader.num_read = slow.num_sent
    assert isinstance(finals(events)["slow"], Finished)
    assert outputs(events)["slow"] == alone(20, 8, "slow")


async def test_the_engine_sleeps_while_a_reader_is_behind_and_its_read_wakes_it() -> None:
    """Through the EngineLoop: a consumer that stops reading leaves the engine idle (no tick
    runs for the paused request, the unread tokens stay at the bound); reading wakes it and the
    output is complete and exact."""
    engine = FakeEngine(stream_buffer_tokens=BOUND)
    try:
        prompt = encode("abcdefghijklmnop")
        spec = GenerationRequest(
            "r", (1, *prompt), stopping=StoppingParams(max_tokens=16, ignore_eos=True)
        )
        stream = engine.submit(spec)
        events = aiter(stream)
        first = await anext(events)  # then the consumer stops reading
        for _ in range(500):
            if engine.stats().paused_streams == 1:
                break
            await asyncio.sleep(0.01)
        snap = engine.stats()
        assert snap.paused_streams == 1 and snap.slots[0].buffered_tokens == BOUND
        ticks = len(engine.runner.plans)
        await parked(engine)
        assert engine.loop._scheduler.idle_wait_s() is None, "asleep until something arrives"
        assert len(engine.runner.plans) == ticks, "no tick for the paused request"
        got = list(first.token_ids)  # type: ignore[union-attr]
        async for event in events:
            got += getattr(event, "token_ids", ())
        assert got == list(reversed(prompt))
        assert engine.stats().stream_pauses >= 1
    finally:
        engine.close()


async def parked(engine: FakeEngine) -> None:
    """Until the engine thread sleeps on its condition variable (polled, bounded)."""
    thread = engine.loop._thread
    for _ in range(500):
        frame = sys._current_frames().get(thread.ident or -1)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names[:2] == ["wait", "_sleep_while_idle"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine thread never went to sleep")
