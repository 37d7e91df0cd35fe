"""telemetry: the event bus, event fields computed from requests and ticks, and the EngineLoop
hooks driven by the real scheduler over a fake runner (no model)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import (
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Request,
    Timings,
    Usage,
)
from llama_grpc_server.core.scheduling.plan import StepPlan
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.observability import telemetry
from llama_grpc_server.observability.telemetry import (
    Bus,
    RequestEvent,
    Telemetry,
    TelemetryEvent,
    TickEvent,
)
from llama_grpc_server.testing import FakeRunner, fake_model_info
from tests.support.scheduler import PIECES, req

MS = 1_000_000  # ns


class Recorder:
    """A handler that keeps what it receives."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, TelemetryEvent]] = []

    def __call__(self, name: str, event: TelemetryEvent) -> None:
        self.seen.append((name, event))

    def of(self, name: str) -> list[Any]:
        return [e for n, e in self.seen if n == name]


def boom(name: str, event: TelemetryEvent) -> None:
    raise RuntimeError("handler bug")


def tick_event(**overrides: Any) -> TickEvent:
    fields: dict[str, Any] = {
        "tick": 1, "batch_size": 3, "decode_tokens": 1, "prefill_tokens": 2, "num_sequences": 2,
        "active_slots": 2, "queue_depth": 0, "eval_ms": 1.0, "sample_ms": 0.5, "is_ok": True,
    }  # fmt: skip
    return TickEvent(**(fields | overrides))


# -- the bus --------------------------------------------------------------------------------------


def test_attached_handler_receives_name_and_event() -> None:
    """emit() calls every handler attached to that event name, and only those."""
    bus, got, other = Bus(), Recorder(), Recorder()
    bus.attach("tick", got)
    bus.attach("request_done", other)
    event = tick_event()
    bus.emit("tick", event)
    assert got.seen == [("tick", event)]
    assert other.seen == []


def test_attach_twice_calls_once_and_detach_stops() -> None:
    """A handler attached twice runs once; after detach it is not called; detach says whether
    it was attached."""
    bus, got = Bus(), Recorder()
    bus.attach("tick", got)
    bus.attach("tick", got)
    bus.emit("tick", tick_event())
    assert len(got.seen) == 1
    assert bus.detach("tick", got) is True
    assert bus.detach("tick", got) is False
    bus.emit("tick", tick_event())
    assert len(got.seen) == 1
    assert not bus.has_handlers("tick")


def test_unknown_event_name_is_refused() -> None:
    """attach/detach name the valid events when given an unknown one."""
    bus = Bus()
    with pytest.raises(ValueError, match="request_done"):
        bus.attach("request_finished", Recorder())
    with pytest.raises(ValueError, match="unknown telemetry event"):
        bus.detach("tok", Recorder())


def test_raising_handler_is_detached_logged_and_others_still_run() -> None:
    """A handler that raises is detached and logged with its name; the handlers after it still
    get the event, and emit() itself never raises."""
    bus, after = Bus(), Recorder()
    bus.attach("tick", boom)
    bus.attach("tick", after)
    with capture_logs() as logs:
        bus.emit("tick", tick_event())
        bus.emit("tick", tick_event())
    assert len(after.seen) == 2
    assert bus.handlers("tick") == (after,)
    [line] = [e for e in logs if e["event"] == "telemetry_handler_detached"]
    assert line["handler"] == "boom"
    assert line["telemetry_event"] == "tick"
    assert line["log_level"] == "error"


@pytest.fixture
def global_bus() -> Iterator[Bus]:
    """The process-wide bus, emptied again afterwards."""
    yield telemetry.BUS
    for name in telemetry.EVENT_NAMES:
        for handler in telemetry.BUS.handlers(name):
            telemetry.BUS.detach(name, handler)


def test_module_functions_use_the_process_wide_bus(global_bus: Bus) -> None:
    """telemetry.attach/emit/detach work like :telemetry's, on telemetry.BUS."""
    got = Recorder()
    telemetry.attach("request_failed", got)
    assert global_bus.handlers("request_failed") == (got,)
    telemetry.emit("request_failed", tick_event())
    assert len(got.seen) == 1
    assert telemetry.detach("request_failed", got)


# -- request events -------------------------------------------------------------------------------


def live_request(n_prompt: int = 100, arrival_ns: int = 1_000 * MS, **fields: int) -> Request:
    request = Request(GenerationRequest("r-1", tuple(range(1, n_prompt + 1))), arrival_ns)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_done_event_fields_from_finished() -> None:
    """request_done: token counts, the cache share, and rates where the prompt rate counts only
    the evaluated (not cached) prompt tokens over the prefill time."""
    request = live_request(num_preemptions=1)
    finished = Finished(
        reason=FinishReason.MAX_TOKENS,
        usage=Usage(prompt_tokens=100, completion_tokens=11, cached_prompt_tokens=60),
        timings=Timings(
            queue_ms=5.0, ttft_ms=25.0, prefill_ms=20.0, decode_ms=100.0, total_ms=125.0
        ),
        seed=1,
        slot_id=3,
    )
    event = telemetry.request_event(request, finished, now_ns=0)
    assert event == RequestEvent(
        request_id="r-1",
        slot=3,
        prompt_tokens=100,
        generated_tokens=11,
        prefix_cache_tokens=60,
        prefix_cache_ratio=0.6,
        queue_ms=5.0,
        duration_ms=125.0,
        ttft_ms=25.0,
        prompt_eval_rate=2000.0,  # 40 evaluated tokens in 20 ms
        generation_rate=100.0,  # 10 tokens after the first in 100 ms
        finish_reason="max_tokens",
        error_reason="",
        preemptions=1,
    )
    assert not event.is_failed
    assert event.as_dict()["prefix_cache_ratio"] == 0.6


def test_an_embedding_has_no_ttft() -> None:
    """request_done of an embedding request: its reason, its prompt tokens and latency, but no
    time to first token (it generates none: the TTFT histograms stay generation's)."""
    finished = Finished(
        reason=FinishReason.EMBEDDED,
        usage=Usage(prompt_tokens=12, completion_tokens=0, cached_prompt_tokens=0),
        timings=Timings(queue_ms=1.0, ttft_ms=9.0, prefill_ms=8.0, decode_ms=0.0, total_ms=9.0),
        seed=0,
        slot_id=0,
    )
    event = telemetry.request_event(live_request(), finished, now_ns=0)
    assert (event.finish_reason, event.ttft_ms, event.duration_ms) == ("embedded", None, 9.0)
    assert (event.prompt_tokens, event.generated_tokens, event.prompt_eval_rate) == (12, 0, 0.0)


def test_failed_before_first_token_has_no_ttft() -> None:
    """request_failed for a request cancelled while queued: reason, no TTFT, no rates, the
    whole wait as queue time and duration."""
    request = live_request(arrival_ns=1_000 * MS)
    failed = Failed(errors.Cancelled("cancelled"))
    event = telemetry.request_event(request, failed, now_ns=1_040 * MS)
    assert event.is_failed and event.error_reason == "CANCELLED"
    assert event.finish_reason == ""
    assert event.ttft_ms is None
    assert event.prompt_eval_rate == 0.0 and event.generation_rate == 0.0
    assert event.queue_ms == event.duration_ms == 40.0
    assert event.slot == -1


def test_failed_while_generating_keeps_its_progress() -> None:
    """A request that fails after some tokens reports them, its TTFT from arrival and its slot."""
    request = live_request(
        n_prompt=10,
        arrival_ns=1_000 * MS,
        admitted_ns=1_010 * MS,
        first_token_ns=1_030 * MS,
        slot_id=2,
        num_cached_prompt=0,
    )
    request.tokens += [5, 6, 7]
    failed = Failed(errors.EngineError("llama_decode failed"))
    event = telemetry.request_event(request, failed, now_ns=1_050 * MS)
    assert event.error_reason == "ENGINE_ERROR"
    assert (event.ttft_ms, event.queue_ms, event.duration_ms) == (30.0, 10.0, 50.0)
    assert event.generated_tokens == 3 and event.slot == 2
    assert event.prompt_eval_rate == pytest.approx(500.0)  # 10 tokens in 20 ms
    assert event.generation_rate == pytest.approx(100.0)  # 2 tokens in 20 ms


# -- hooks over the real scheduler ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        self.ns += MS
        return self.ns


def scheduler(n_parallel: int = 2, n_batch: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerLimits(n_parallel, n_ctx=512, n_batch=n_batch, chunk_size=16, max_queue=8),
        pieces=PIECES,
        eog_ids=frozenset(),
    )


def run_ticks(s: Scheduler, hooks: Telemetry, max_ticks: int = 200) -> list[StepPlan]:
    """What EngineLoop does per tick, hooks included."""
    runner, plans = FakeRunner(), []
    for _ in range(max_ticks):
        plan, events = s.schedule()
        if plan is not None:
            result = runner.execute(plan)
            events += s.update(plan, result)
            if plan.chunks:
                hooks.on_tick(plan, result, s)
                plans.append(plan)
        for request, event in events:
            if isinstance(event, Finished | Failed):
                hooks.on_done(request, event)
        if not s.has_work:
            break
    return plans


def test_tick_events_describe_each_forward_pass() -> None:
    """One tick event per forward pass with the plan's token split, slots and queue after it."""
    s, bus, got = scheduler(n_parallel=2), Bus(), Recorder()
    bus.attach("tick", got)
    for i in range(3):
        s.add(req(f"r{i}", 20, 4))
    plans = run_ticks(s, Telemetry(bus=bus))
    ticks = got.of("tick")
    assert [t.tick for t in ticks] == [p.tick for p in plans]
    for tick, plan in zip(ticks, plans, strict=True):
        assert tick.batch_size == plan.num_tokens == tick.decode_tokens + tick.prefill_tokens
        assert (tick.decode_tokens, tick.prefill_tokens) == (plan.num_decode, plan.num_prefill)
        assert tick.num_sequences == len(plan.chunks)
        assert tick.is_ok
    first = ticks[0]
    assert (first.prefill_tokens, first.decode_tokens) == (32, 0)  # two 16-token chunks
    assert (first.active_slots, first.queue_depth) == (2, 1)
    assert (ticks[-1].active_slots, ticks[-1].queue_depth) == (0, 0)


def test_inter_token_gaps_follow_each_request() -> None:
    """Each request's tokens after its first give one inter-token gap, measured on the hooks'
    clock: here one clock step (1 ms) per tick."""
    s, bus, got = scheduler(n_parallel=2), Bus(), Recorder()
    bus.attach("tick", got)
    s.add(req("a", 10, 5))
    s.add(req("b", 10, 3))
    run_ticks(s, Telemetry(bus=bus, clock_ns=FakeClock()))
    gaps = [g for t in got.of("tick") for g in t.inter_token_ms]
    assert len(gaps) == (5 - 1) + (3 - 1)
    assert set(gaps) == {1.0}


def test_done_events_come_from_the_hooks() -> None:
    """Every finished request gives one request_done with its own counts and reason; a request
    cancelled in the queue gives request_failed."""
    s, bus, got = scheduler(n_parallel=1), Bus(), Recorder()
    for name in ("request_done", "request_failed"):
        bus.attach(name, got)
    hooks = Telemetry(bus=bus)
    s.add(req("a", 30, 6))
    s.add(req("b", 12, 2))
    s.add(req("c", 12, 2))
    for request, event in s.cancel("c"):
        hooks.on_done(request, event)
    run_ticks(s, hooks)
    done = {e.request_id: e for e in got.of("request_done")}
    assert {rid: (e.prompt_tokens, e.generated_tokens) for rid, e in done.items()} == {
        "a": (30, 6),
        "b": (12, 2),
    }
    assert all(e.finish_reason == "max_tokens" and e.slot == 0 for e in done.values())
    assert done["b"].queue_ms > 0  # it waited for the only slot
    [failed] = got.of("request_failed")
    assert (failed.request_id, failed.error_reason) == ("c", "CANCELLED")


def test_nobody_listening_costs_no_event() -> None:
    """Without a sink or handlers the hooks build nothing (they do not even read the clock)."""
    s, clock = scheduler(), FakeClock()
    s.add(req("a", 20, 4))
    run_ticks(s, Telemetry(bus=Bus(), clock_ns=clock))
    assert clock.calls == 0


class ListSink:
    def __init__(self) -> None:
        self.ticks: list[TickEvent] = []
        self.requests: list[RequestEvent] = []

    def on_tick(self, event: TickEvent) -> None:
        self.ticks.append(event)

    def on_request(self, event: RequestEvent) -> None:
        self.requests.append(event)


def test_sink_and_bus_get_the_same_events() -> None:
    """The sink (metrics) and bus handlers see the very same event objects."""
    s, bus, got, sink = scheduler(), Bus(), Recorder(), ListSink()
    for name in telemetry.EVENT_NAMES:
        bus.attach(name, got)
    s.add(req("a", 20, 3))
    run_ticks(s, Telemetry(bus=bus, sink=telemetry.Sinks(sink)))
    assert sink.ticks == got.of("tick") and sink.ticks
    assert sink.requests == got.of("request_done") and len(sink.requests) == 1


def test_log_sink_writes_debug_lines() -> None:
    """LogSink logs each event at debug with its fields."""
    with capture_logs() as logs:
        telemetry.LogSink().on_tick(tick_event(tick=7))
    assert logs == [{"event": "tick", "log_level": "debug", **tick_event(tick=7).as_dict()}]


# -- through the engine thread --------------------------------------------------------------------


class NullTokenizer:
    pass


async def consume(engine: EngineLoop, rid: str, n_prompt: int, max_tokens: int) -> Any:
    request = req(rid, n_prompt, max_tokens).spec
    events = [event async for event in engine.submit(request)]
    return events[-1]


def hooked_engine(hooks: Telemetry) -> EngineLoop:
    """A real engine thread (2 slots, the fake runner) calling `hooks`."""
    return EngineLoop(
        scheduler(n_parallel=2),
        FakeRunner(),
        fake_model_info(),
        tokenizer=NullTokenizer(),
        kv_cells_total=512,
        on_tick=hooks.on_tick,
        on_done=hooks.on_done,
    )


async def test_raising_handler_never_breaks_the_engine() -> None:
    """On the real engine thread a raising handler is detached after its first call and every
    request still finishes; a well-behaved handler sees them all."""
    bus, got = Bus(), Recorder()
    bus.attach("tick", boom)
    bus.attach("request_done", boom)
    bus.attach("request_done", got)
    hooks = Telemetry(bus=bus)
    engine = hooked_engine(hooks)
    try:
        with capture_logs() as logs:
            finals = await asyncio.gather(*(consume(engine, f"r{i}", 20, 5) for i in range(4)))
    finally:
        await asyncio.to_thread(engine.close)
    assert all(isinstance(f, Finished) for f in finals)
    assert sorted(e.request_id for e in got.of("request_done")) == ["r0", "r1", "r2", "r3"]
    assert not bus.has_handlers("tick")
    assert bus.handlers("request_done") == (got,)
    detached = [e["telemetry_event"] for e in logs if e["event"] == "telemetry_handler_detached"]
    assert sorted(detached) == ["request_done", "tick"]


class BrokenSink(ListSink):
    def on_tick(self, event: TickEvent) -> None:
        raise RuntimeError("metrics bug")


def test_raising_sink_is_dropped_and_handlers_go_on() -> None:
    """A sink that raises is logged once and dropped; the hooks never raise and bus handlers
    keep getting every event."""
    s, bus, got = scheduler(), Bus(), Recorder()
    bus.attach("tick", got)
    bus.attach("request_done", got)
    hooks = Telemetry(bus=bus, sink=BrokenSink())
    s.add(req("a", 20, 3))
    with capture_logs() as logs:
        plans = run_ticks(s, hooks)
    assert hooks.sink is None
    assert [e["telemetry_event"] for e in logs if e["event"] == "telemetry_sink_dropped"] == [
        "tick"
    ]
    assert len(got.of("tick")) == len(plans) - 1  # all but the tick the sink broke
    assert len(got.of("request_done")) == 1


def test_events_are_frozen_values() -> None:
    """Handlers cannot change what other handlers see."""
    event = tick_event()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.tick = 2  # type: ignore[misc]


def test_request_events_carry_the_tenant() -> None:
    """Telemetry events say who asked (the tenant of an authenticated caller)."""
    request = Request(GenerationRequest("r-1", (1, 2, 3), tenant="team-a"), 1_000 * MS)
    failed = Failed(errors.Cancelled("cancelled"))
    event = telemetry.request_event(request, failed, now_ns=1_001 * MS)
    assert event.tenant == "team-a"
    assert event.as_dict()["tenant"] == "team-a"
    assert telemetry.request_event(live_request(), failed, now_ns=1_001 * MS).tenant == ""


async def test_a_deadline_cancel_is_a_deadline_event_not_a_cancellation() -> None:
    """A request the rpc layer cancels because its call's deadline passed emits request_failed
    with error_reason DEADLINE_EXCEEDED; a client's cancel stays CANCELLED."""
    bus, got = Bus(), Recorder()
    bus.attach("request_failed", got)
    hooks = Telemetry(bus=bus)
    engine = hooked_engine(hooks)
    try:
        late = engine.submit(req("late", 20, 400).spec)
        left = engine.submit(req("left", 20, 400).spec)
        late.cancel(deadline_exceeded=True)
        left.cancel()
        for _ in range(500):
            if len(got.of("request_failed")) == 2:
                break
            await asyncio.sleep(0.01)
    finally:
        await asyncio.to_thread(engine.close)
    reasons = {e.request_id: e.error_reason for e in got.of("request_failed")}
    assert reasons == {"late": "DEADLINE_EXCEEDED", "left": "CANCELLED"}
