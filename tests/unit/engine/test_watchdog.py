"""The tick watchdog (watchdog.py) and EngineLoop with it, on real threads with the fake
runner: a forward pass that never returns ends every caller with UNAVAILABLE (ENGINE_HUNG), the
listeners hear it once, stats count the trip, the engine thread's stack is logged; a slow but
legitimate engine never trips it. With bounds that follow the pass (--watchdog-s auto): their
arithmetic, a hang in a short decode pass declared at the floor, a long prompt pass whose time
follows its tokens never cut, the first pass of a kind given the start bound."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from llama_grpc_server import errors
from llama_grpc_server.core.requests.embedding import EmbeddingParams
from llama_grpc_server.core.requests.request import Failed, Finished
from llama_grpc_server.core.scheduling.plan import Chunk, SeqOp, SeqOpKind, StepPlan, StepResult
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.testing import FakeRunner, HangingRunner
from llama_grpc_server.watchdog import (
    Basis,
    PassBounds,
    PassShape,
    TickWatchdog,
    pass_shape,
    start_bound_s,
    tick_bounds,
)
from tests.support.loop import last_event, make_loop
from tests.support.scheduler import req

BOUND_S = 0.5


DECODE_1 = PassShape(is_prefill=False, tokens=1)
DECODE_2 = PassShape(is_prefill=False, tokens=2)
PREFILL_512 = PassShape(is_prefill=True, tokens=512)
PREFILL_2048 = PassShape(is_prefill=True, tokens=2048)


@pytest.mark.parametrize(
    ("configured", "n_batch", "prefill_token_ms", "start_s", "fixed"),
    [
        ("auto", 2048, 0.5, 30.0, False),  # 1.02 s a full batch: the start bound's minimum
        ("auto", 2048, 5.0, 102.4, False),  # 10.24 s a full batch, ten times
        ("auto", 512, 0.0, 30.0, False),  # nothing measured: the minimum
        (2.5, 2048, 5.0, 2.5, True),  # configured: as it is, for every tick
    ],
)
def test_bounds_are_configured_or_start_from_the_measured_batch(
    configured: float | str, n_batch: int, prefill_token_ms: float, start_s: float, fixed: bool
) -> None:
    bounds = tick_bounds(configured, n_batch, prefill_token_ms)
    assert bounds is not None
    assert bounds.start_s == pytest.approx(start_s)
    assert bounds.fixed is fixed
    assert bounds.floor_s == (2.5 if fixed else 5.0)


def test_a_bound_of_zero_is_no_watchdog() -> None:
    assert tick_bounds(0.0, 2048, 5.0) is None


def test_start_bound_is_ten_full_batches_at_least_thirty_seconds() -> None:
    assert start_bound_s(4096, 1.0) == pytest.approx(40.96)
    assert start_bound_s(1, 1000.0) == 30.0


def test_the_bound_follows_the_pass_at_its_measured_cost_per_token() -> None:
    """Exact values: the start bound until a pass of the kind is timed, then margin x tokens x
    the estimate of its kind (a slower pass sets it at once, a faster one moves it a tenth of
    the way), never under the floor; the floor for a tick without a pass."""
    bounds = PassBounds(79.0)
    assert (bounds.floor_s, bounds.margin) == (5.0, 10.0)  # FLOOR_S, MARGIN
    assert bounds.for_pass(None, 0.0) == (5.0, Basis(None, "floor"))
    assert bounds.for_pass(DECODE_1, 0.0) == (79.0, Basis(DECODE_1, "unmeasured"))
    bounds.observe(DECODE_2, 0.040, now=100.0)  # 20 ms a token
    assert bounds.ms_per_token == {False: pytest.approx(20.0)}
    bound, basis = bounds.for_pass(DECODE_2, 101.0)  # 10 x 2 x 20 ms = 0.4 s: the floor
    assert basis is not None
    assert (bound, basis.shape, basis.reason) == (5.0, DECODE_2, "measured")
    assert basis.ms_per_token == pytest.approx(20.0)
    assert bounds.for_pass(PassShape(False, 64), 101.0)[0] == pytest.approx(12.8)
    assert bounds.for_pass(PREFILL_512, 101.0) == (79.0, Basis(PREFILL_512, "unmeasured"))
    bounds.observe(DECODE_1, 0.010, now=102.0)  # 10 ms: a tenth of the way down
    assert bounds.ms_per_token[False] == pytest.approx(19.0)
    bounds.observe(DECODE_1, 0.050, now=103.0)  # 50 ms: at once
    assert bounds.ms_per_token[False] == pytest.approx(50.0)
    bounds.observe(PREFILL_512, 1.024, now=104.0)  # 2 ms a prompt token
    assert bounds.for_pass(PREFILL_2048, 105.0)[0] == pytest.approx(40.96)  # 10 x 4.096 s
    assert bounds.for_pass(PassShape(True, 100), 105.0)[0] == 5.0  # 2 s: the floor
    assert bounds.for_pass(DECODE_1, 105.0)[0] == 5.0  # 0.5 s: the floor


def test_cold_and_state_passes_and_no_pass_keep_what_they_should() -> None:
    """The first pass after COLD_AFTER_S without one, and a pass that saves or restores a
    sequence's state, get the start bound; a tick without a pass teaches nothing."""
    bounds = PassBounds(40.0)
    bounds.observe(DECODE_1, 0.02, now=10.0)
    assert bounds.for_pass(DECODE_1, 70.0)[0] == 5.0  # 60 s after: still warm
    assert bounds.for_pass(DECODE_1, 70.5) == (40.0, Basis(DECODE_1, "cold"))
    saving = PassShape(False, 1, keeps_state=True)
    assert bounds.for_pass(saving, 11.0) == (40.0, Basis(saving, "state"))
    bounds.observe(saving, 3.0, now=12.0)  # learns nothing, but it was a pass
    bounds.observe(None, 9.0, now=80.0)  # no pass: neither
    assert bounds.ms_per_token == {False: pytest.approx(20.0)}
    assert bounds.for_pass(DECODE_1, 72.0)[0] == 5.0


def test_a_constant_bound_is_the_same_for_every_tick_and_learns_nothing() -> None:
    bounds = PassBounds.constant(2.5)
    assert bounds.floor_s == 2.5
    for shape in (None, DECODE_1, PREFILL_2048, PassShape(True, 4, keeps_state=True)):
        assert bounds.for_pass(shape, 0.0) == (2.5, None)
    bounds.observe(DECODE_1, 9.0, now=1.0)
    assert bounds.ms_per_token == {}
    assert bounds.describe(None) == ""


def test_the_hang_message_says_how_the_bound_was_derived() -> None:
    bounds = PassBounds(79.0)
    bounds.observe(DECODE_2, 0.0246, now=1.0)
    _, measured = bounds.for_pass(DECODE_2, 2.0)
    assert bounds.describe(measured) == "a decode pass of 2 tokens: 2 x 12.3 ms x 10, at least 5 s"
    assert bounds.describe(bounds.for_pass(PREFILL_512, 2.0)[1]) == (
        "a prefill pass of 512 tokens, none of its kind timed yet: the start bound"
    )
    assert bounds.describe(bounds.for_pass(DECODE_1, 200.0)[1]) == (
        "a decode pass of 1 token, none for over 60 s: the start bound"
    )
    assert bounds.describe(Basis(None, "floor")) == "no forward pass: the floor"


def test_pass_shape_counts_every_row_and_whether_any_is_a_prompt_token() -> None:
    decode = Chunk(0, "a", 20, (5,), True)
    draft = Chunk(1, "b", 30, (6, 7, 8), True, num_draft=2)
    prompt = Chunk(2, "c", 0, tuple(range(16)), False)
    assert pass_shape(StepPlan(1, (decode, draft))) == PassShape(False, 4)
    assert pass_shape(StepPlan(1, (decode, prompt))) == PassShape(True, 17)
    embed = Chunk(0, "e", 0, (1, 2, 3), True, embedding=EmbeddingParams(), num_input=3)
    assert pass_shape(StepPlan(1, (embed,), is_embedding=True)) == PassShape(True, 3)
    assert pass_shape(StepPlan(1)) is None
    assert pass_shape(StepPlan(1, seq_ops=(SeqOp(SeqOpKind.REMOVE, 0),))) is None
    saving = StepPlan(1, seq_ops=(SeqOp(SeqOpKind.SAVE, 0),))
    assert pass_shape(saving) == PassShape(False, 0, keeps_state=True)


def test_watchdog_trips_once_for_a_tick_that_does_not_end() -> None:
    trips: list[tuple[float, float, str]] = []
    tripped = threading.Event()

    def on_trip(seconds: float, bound: float, basis: Basis | None) -> None:
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


def test_watchdog_trips_at_the_bound_the_running_tick_expects() -> None:
    """A tick's bound raised once its pass is known (expect): the trip comes at that bound, with
    the basis the engine gave."""
    trips: list[tuple[float, float, Basis | None]] = []
    tripped = threading.Event()

    def on_trip(seconds: float, bound: float, basis: Basis | None) -> None:
        trips.append((seconds, bound, basis))
        tripped.set()

    watchdog = TickWatchdog(0.1, on_trip)
    basis = Basis(DECODE_2, "measured", 1.0)
    watchdog.tick_started(Basis(None, "floor"))
    watchdog.expect(0.4, basis)
    assert tripped.wait(5)
    assert len(trips) == 1
    seconds, bound, got = trips[0]
    assert (bound, got) == (0.4, basis) and seconds >= 0.4


def test_a_pass_inside_the_tick_adds_its_bound_to_the_time_run_so_far() -> None:
    """expect_more (a draft model's pass before the tick's own): the bound is the tick's time so
    far plus the pass's, so a tick that spent its floor drafting is not taken for a hang."""
    trips: list[tuple[float, float, Basis | None]] = []
    tripped = threading.Event()

    def on_trip(seconds: float, bound: float, basis: Basis | None) -> None:
        trips.append((seconds, bound, basis))
        tripped.set()

    watchdog = TickWatchdog(0.3, on_trip)
    basis = Basis(DECODE_2, "measured", 1.0)
    watchdog.tick_started(Basis(None, "floor"))
    time.sleep(0.2)
    watchdog.expect_more(0.3, basis)
    assert tripped.wait(5)
    seconds, bound, got = trips[0]
    assert got == basis and bound >= 0.5 and seconds >= bound


def test_watchdog_stops_at_once_and_rejects_a_bound_of_zero() -> None:
    watchdog = TickWatchdog(60.0, lambda s, b, w: None)
    watchdog.stop()
    watchdog._thread.join(1)  # sleeping for a quarter bound, it wakes on stop()
    assert not watchdog._thread.is_alive()
    with pytest.raises(ValueError, match="positive"):
        TickWatchdog(0.0, lambda s, b, w: None)


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
        assert engine._guard.watchdog is not None and engine._guard.watchdog._thread.is_alive()
    finally:
        await asyncio.to_thread(engine.close)
    assert engine._guard.watchdog is not None
    await asyncio.to_thread(engine._guard.watchdog._thread.join, 2)
    assert not engine._guard.watchdog._thread.is_alive(), "close() stopped the watchdog"


# -- bounds that follow the pass, on the engine thread ------------------------------------------

FLOOR_S = 0.5  # a test's floor: the real one (watchdog.FLOOR_S) is seconds


class TokenPacedRunner(FakeRunner):
    """A FakeRunner whose forward pass takes token_s for each token it feeds: slow, but in
    proportion to its work, as a real prefill is."""

    def __init__(self, token_s: float) -> None:
        super().__init__()
        self.token_s = token_s
        self.longest_s = 0.0

    def execute(self, plan: StepPlan) -> StepResult:
        pass_s = self.token_s * sum(len(chunk.tokens) for chunk in plan.chunks)
        time.sleep(pass_s)
        self.longest_s = max(self.longest_s, pass_s)
        return super().execute(plan)


async def test_a_hang_in_a_short_decode_pass_is_declared_at_the_floor() -> None:
    """A start bound far beyond the test's patience: a request's two prompt chunks (16 and 4
    tokens) and two decode passes are timed, the sixth pass (a decode of one token) never
    returns: both callers end UNAVAILABLE (ENGINE_HUNG) with the decode pass's bound, the
    floor, and how it was derived; the listeners hear it once, the stats count it."""
    runner = HangingRunner(hang_at=6)
    engine = make_loop(n_parallel=2, runner=runner, watchdog_s=PassBounds(600.0, floor_s=FLOOR_S))
    told: list[str] = []
    engine.on_failure(told.append)
    try:
        streams = [engine.submit(req("a", 20, 50).spec)]
        assert await asyncio.to_thread(runner.hanging.wait, 5)
        streams.append(engine.submit(req("b", 20, 50).spec))
        finals = await asyncio.wait_for(asyncio.gather(*(last_event(s) for s in streams)), 10)
        derived = re.escape("past the watchdog's 0.5 s (a decode pass of 1 token: 1 x ") + (
            r"[0-9.e+-]+ ms x 10, at least 0\.5 s\)$"
        )
        for final in finals:
            assert isinstance(final, Failed) and isinstance(final.error, errors.EngineHung)
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "ENGINE_HUNG")
            assert re.search(derived, final.error.message), final.error.message
        assert len(told) == 1 and re.search(derived, told[0])
        stats = engine.stats()
        assert (stats.engine_state, stats.watchdog_trips, stats.requests_failed) == ("failed", 1, 2)
    finally:
        runner.release.set()
        await asyncio.to_thread(engine._thread.join, 5)
    assert not engine._thread.is_alive()


async def test_the_first_pass_of_a_kind_keeps_the_start_bound() -> None:
    """Nothing timed yet: a hang in the first prompt pass is declared at the start bound."""
    runner = HangingRunner(hang_at=1)
    engine = make_loop(runner=runner, watchdog_s=PassBounds(0.8, floor_s=0.2))
    try:
        final = await asyncio.wait_for(last_event(engine.submit(req("a", 20, 5).spec)), 10)
        assert isinstance(final, Failed) and isinstance(final.error, errors.EngineHung)
        assert final.error.message.endswith(
            "past the watchdog's 0.8 s (a prefill pass of 16 tokens, none of its kind timed "
            "yet: the start bound)"
        )
    finally:
        runner.release.set()
        await asyncio.to_thread(engine._thread.join, 5)


async def test_a_long_prompt_pass_slower_than_the_floor_is_not_cut() -> None:
    """Every pass takes 40 ms a token: a short request teaches the cost, then a 48-token prompt
    runs in three 16-token passes of 0.64 s, past the floor, each within its own bound (10 x 16
    x >= 40 ms): it finishes, nothing trips."""
    runner = TokenPacedRunner(token_s=0.04)
    bounds = PassBounds(600.0, floor_s=FLOOR_S)
    engine = make_loop(n_parallel=1, runner=runner, watchdog_s=bounds)
    try:
        short = await asyncio.wait_for(last_event(engine.submit(req("short", 2, 3).spec)), 30)
        assert isinstance(short, Finished), short
        final = await asyncio.wait_for(last_event(engine.submit(req("long", 48, 2).spec)), 30)
        assert isinstance(final, Finished), final
        assert runner.longest_s > FLOOR_S  # 16 x 40 ms
        assert bounds.ms_per_token[True] >= 40.0
        stats = engine.stats()
        assert (stats.engine_state, stats.watchdog_trips, stats.requests_finished) == (
            "running",
            0,
            2,
        )
    finally:
        await asyncio.to_thread(engine.close)
