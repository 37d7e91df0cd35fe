"""Driving a Scheduler over the fake runner, no model: make (a scheduler with a fake Clock), req (a
greedy request), drive (tick until idle), and reading the events (outputs, finals, alone: a
request's tokens when it runs by itself). Shared by several test modules (until now in
tests/unit/core/test_scheduler.py)."""

from __future__ import annotations

from collections.abc import Callable

from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    SamplingParams,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeRunner

PIECES = [f"<{i}>".encode() for i in range(97)]


GREEDY = SamplingParams(temperature=0.0)


class Clock:
    def __init__(self) -> None:
        self.ns = 0
        self.s = 0.0

    def tick_ns(self) -> int:
        self.ns += 1_000_000
        return self.ns

    def monotonic(self) -> float:
        return self.s


def make(  # noqa: PLR0917  # positional sizes keep the many call sites short
    n_parallel: int = 2,
    n_ctx: int = 512,
    n_batch: int = 64,
    chunk: int = 16,
    max_queue: int = 8,
    eog: frozenset[int] = frozenset(),
    clock: Clock | None = None,
    ram_cache_bytes: int = 0,
    **kw: object,
) -> Scheduler:
    clock = clock or Clock()
    return Scheduler(
        SchedulerLimits(
            n_parallel, n_ctx, n_batch, chunk, max_queue, ram_cache_bytes=ram_cache_bytes
        ),
        pieces=PIECES,
        eog_ids=eog,
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
        **kw,  # type: ignore[arg-type]
    )


def req(rid: str, n_prompt: int = 20, max_tokens: int = 8, **kw: object) -> Request:
    prompt = tuple((i * 13 + len(rid)) % 90 + 1 for i in range(n_prompt))
    stopping = StoppingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(GenerationRequest(rid, prompt, GREEDY, stopping))


def drive(
    s: Scheduler,
    runner: FakeRunner,
    max_ticks: int = 2000,
    between: Callable[[int], None] | None = None,
    after: Callable[[], None] | None = None,
) -> list[tuple[Request, Event]]:
    """Tick until nothing is left: `between(tick)` before each schedule, `after()` after each
    update (a check of the state every tick)."""
    out: list[tuple[Request, Event]] = []
    for tick in range(max_ticks):
        if between is not None:
            between(tick)
        plan, events = s.schedule()
        out += events
        if plan is not None:
            out += s.update(plan, runner.execute(plan))
        if after is not None:
            after()
        if not s.has_work:
            break
    return out


def outputs(events: list[tuple[Request, Event]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for request, event in events:
        if isinstance(event, TokenDelta):
            got.setdefault(request.request_id, []).extend(event.token_ids)
    return got


def finals(events: list[tuple[Request, Event]]) -> dict[str, Event]:
    return {r.request_id: e for r, e in events if isinstance(e, Finished | Failed)}


def alone(n_prompt: int, max_tokens: int, rid: str = "x") -> list[int]:
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req(rid, n_prompt, max_tokens))
    return outputs(drive(s, runner))[rid]
