"""A scheduler that speculates (make, ON) over a fake model that mostly repeats its context
(echo_model: drafts get accepted, but for a noisy position now and then), and its requests (req,
prompt_of). Shared by several test modules (until now in
tests/unit/core/test_speculative_scheduler.py)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    Request,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from tests.support.scheduler import PIECES, Clock

GREEDY = SamplingParams(temperature=0.0)


ON = SpeculativeParams(SpeculativeMode.ON)


EOS = 2


def make(
    n_parallel: int = 2,
    n_ctx: int = 1024,
    n_batch: int = 128,
    chunk: int = 32,
    *,
    default: SpeculativeConfig | None = None,
    eog: frozenset[int] = frozenset({EOS}),
) -> Scheduler:
    clock = Clock()
    limits = SchedulerLimits(
        n_parallel,
        n_ctx,
        n_batch,
        chunk,
        max_queue=0,
        speculative=default if default is not None else SpeculativeConfig(),
    )
    return Scheduler(
        limits, pieces=PIECES, eog_ids=eog, clock_ns=clock.tick_ns, monotonic=clock.monotonic
    )


def echo_model(period: int = 7, noise_every: int = 5) -> Callable[[list[int]], int]:
    """A fake model that repeats its context with a period (drafts get accepted), except every
    noise_every-th position, where the token depends on the whole context (drafts get rejected,
    and a KV sequence holding anything but the right tokens changes the output)."""

    def next_token(context: list[int]) -> int:
        n = len(context)
        if n % noise_every == 0:
            return (sum(context) * 31 + n) % 90 + 3
        return context[-period] if n >= period else 3

    return next_token


def prompt_of(seed: int, n: int = 24) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(3, 60) for _ in range(n))


def req(
    rid: str,
    prompt: Sequence[int],
    max_tokens: int = 40,
    speculative: SpeculativeParams = ON,
    **stopping: object,
) -> Request:
    stop = StoppingParams(max_tokens=max_tokens, **stopping)  # type: ignore[arg-type]
    spec = GenerationRequest(rid, tuple(prompt), GREEDY, stop, speculative=speculative)
    return Request(spec)
