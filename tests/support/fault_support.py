"""Support for the fault-injection tests: a real in-process server whose engine reports, through
build_engine's own hooks, where each request was when it ended (queued, prefilling, decoding) and
at which tick; collecting streams; and comparing a greedy output with a solo run only where the
comparison is sound (the solo run's top-2 margin is wide enough that batching numerics cannot
flip the argmax)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llama_grpc import AsyncClient, Delta, Done, LlamaGrpcError, Stats
from llama_grpc_server import errors
from llama_grpc_server.config import Settings
from llama_grpc_server.core.requests.request import Event, Failed, Request
from llama_grpc_server.core.scheduling.plan import StepPlan, StepResult
from llama_grpc_server.core.scheduling.scheduler import Scheduler
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server

# llama.py measured logits moving by up to ~1.0 with the batch/cache layout: a top-2 logprob gap
# of 2.0 cannot close, so greedy tokens before the first narrower gap are layout-independent.
SOUND_MARGIN = 2.0
POLL_S = 0.05
POLLS = 200  # 10 s of polling at most

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ended:
    """A request as the engine released it (read on the engine thread, in its on_done hook)."""

    request_id: str
    error: errors.ServiceError | None  # None: it finished normally
    num_prompt: int
    num_computed: int  # KV positions computed for it when it ended
    num_output: int
    was_admitted: bool  # it held a slot at some point (False: it only ever waited in the queue)
    preemptions: int
    tick: int  # forward passes so far (GetStats' `ticks`) when it was released


@dataclass
class EngineProbe:
    """Builds the engine for a test server with on_done/on_tick hooks and a spy on cancel()."""

    ended: dict[str, Ended] = field(default_factory=dict)
    cancel_ticks: dict[str, int] = field(default_factory=dict)  # `ticks` when cancel() was called
    preempted_at: dict[str, list[int]] = field(default_factory=dict)  # num_output at preemption
    _engine: EngineLoop | None = None

    def build(self, conf: Settings) -> EngineLoop:
        engine = build_engine(conf, on_tick=self._on_tick, on_done=self._on_done)
        cancel = engine.cancel

        # Everything but the request id is forwarded as given, so the spy keeps accepting what
        # EngineLoop.cancel accepts (a spy without its deadline_exceeded keyword raised
        # TypeError in every stream's cancel: no cancellation reached the engine).
        def spy(request_id: str, *args: Any, **kwargs: Any) -> None:  # on the event loop
            self.cancel_ticks.setdefault(request_id, engine.stats().ticks)
            cancel(request_id, *args, **kwargs)

        engine.cancel = spy  # type: ignore[method-assign]
        self._engine = engine
        return engine

    def _on_done(self, request: Request, event: Event) -> None:
        assert self._engine is not None
        error = event.error if isinstance(event, Failed) else None
        self.ended[request.request_id] = Ended(
            request.request_id,
            error,
            request.num_prompt,
            request.num_computed,
            request.num_output,
            request.admitted_ns > 0,
            request.num_preemptions,
            self._engine.stats().ticks,
        )

    def _on_tick(self, plan: StepPlan, result: StepResult, scheduler: Scheduler) -> None:
        for request in scheduler.queue:  # a preempted request waits at the head, output kept
            points = self.preempted_at.setdefault(request.request_id, [])
            if request.num_preemptions > len(points):
                points.append(request.num_output)


@dataclass
class ProbedServer:
    running: RunningServer
    probe: EngineProbe
    client: AsyncClient

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.running.port}"


@contextlib.asynccontextmanager
async def probed_server(conf: Settings) -> AsyncIterator[ProbedServer]:
    probe = EngineProbe()
    async with start_server(conf, lambda: probe.build(conf)) as running:
        assert await running.wait_loaded()
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=120) as client:
            yield ProbedServer(running, probe, client)


# -- streams --------------------------------------------------------------------------------------

_ids = itertools.count()


def request_id(label: str) -> str:
    """A unique x-request-id, so a test can find its request in GetStats and in the probe."""
    return f"{label}-{next(_ids)}"


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    done: Done | None = None
    error: LlamaGrpcError | None = None


async def collect(stream: Any, into: Outcome | None = None) -> Outcome:
    """Iterate a stream to its end, filling `into` as events arrive; a status error is
    recorded, not raised."""
    out = into if into is not None else Outcome()
    try:
        async for event in stream:
            if isinstance(event, Delta):
                out.token_ids += event.token_ids
            else:
                out.done = event
    except LlamaGrpcError as error:
        out.error = error
    return out


async def poll(
    client: AsyncClient, condition: Callable[[Stats], bool], polls: int = POLLS
) -> Stats:
    """GetStats until `condition` holds (at most `polls` short sleeps); the last stats."""
    stats = await client.stats()
    for _ in range(polls):
        if condition(stats):
            return stats
        await asyncio.sleep(POLL_S)
        stats = await client.stats()
    return stats


def is_idle(stats: Stats) -> bool:
    return stats.active_slots == 0 and stats.queue_depth == 0


def busy_request_ids(stats: Stats) -> set[str]:
    return {s.request_id for s in stats.slots if s.request_id}


async def gather_bounded(*calls: Awaitable[T], timeout_s: float = 240.0) -> list[T]:
    """Await every call; a hang fails the test instead of blocking the suite."""
    return list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))


# -- solo references ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reference:
    """A request's greedy output run alone, with each step's top-2 logprob margin, read up to
    its first narrow step (see `sound`): the tokens after it are never compared. `length` is
    the whole output's (max_tokens, EOS ignored)."""

    token_ids: tuple[int, ...]
    margins: tuple[float, ...]
    length: int

    @property
    def sound(self) -> int:
        """How many leading tokens any correct run must reproduce exactly: those before the first
        step whose margin is narrow enough for batching numerics to flip."""
        for i, margin in enumerate(self.margins):
            if margin < SOUND_MARGIN:
                return i
        return len(self.margins)

    def check(self, got: list[int]) -> None:
        """Same length, and the sound prefix token for token."""
        n = self.sound
        assert len(got) == self.length, (len(got), self.length)
        assert got[:n] == list(self.token_ids[:n]), (n, got, self.token_ids)


async def reference(
    client: AsyncClient, prompt: str, max_tokens: int, model: str | None = None
) -> Reference:
    """The solo run (nothing else on the server) of `prompt`, greedy, EOS ignored, streamed
    until its first narrow step, then cancelled (and the engine idle again before this
    returns): nothing after that step is compared, and a story prompt's comes within a few
    dozen tokens, where reading all 160 of the back-pressure test's took seconds of solo
    decoding no assertion used. A prompt whose every step is wide is read to the end."""
    tokens: list[int] = []
    margins: list[float] = []
    stream = client.stream(
        prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, top_logprobs=2,
        model=model,
    )  # fmt: skip
    try:
        async for event in stream:
            if not isinstance(event, Delta):
                assert isinstance(event, Done) and len(tokens) == max_tokens, event
                break
            for token, lp in zip(event.token_ids, event.logprobs, strict=True):
                assert lp.top[0].token_id == token, "greedy takes the top token"
                tokens.append(token)
                margins.append(lp.top[0].logprob - lp.top[1].logprob)
            if margins and min(margins) < SOUND_MARGIN:
                break
    finally:
        await stream.aclose()
    for _ in range(POLLS):  # the cancelled request leaves its slot within a tick
        if is_idle(await client.stats(model=model)):
            break
        await asyncio.sleep(POLL_S)
    return Reference(tuple(tokens), tuple(margins), max_tokens)


@dataclass
class Running:
    """A stream being collected in a task; `outcome` fills as its events arrive."""

    outcome: Outcome
    task: asyncio.Task[Outcome]


async def start(stream: Any) -> Running:
    """Wait for the stream's first token (its request holds a slot by then), then collect the
    rest in a task."""
    first = await anext(stream)
    assert isinstance(first, Delta), first
    out = Outcome(list(first.token_ids))
    return Running(out, asyncio.create_task(collect(stream, out)))


async def until(predicate: Callable[[], bool], polls: int = POLLS) -> bool:
    """Wait (at most `polls` short sleeps) for something another task or thread records."""
    for _ in range(polls):
        if predicate():
            return True
        await asyncio.sleep(POLL_S)
    return predicate()
