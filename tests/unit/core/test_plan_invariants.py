"""StepPlan.check: the invariants every tick's plan keeps, each violation caught; and a
randomized run of the scheduler (arrivals, cancels, tiny KV) whose every plan keeps them."""

from __future__ import annotations

import random

import pytest

from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, finals, make

N_BATCH, CHUNK = 64, 16


def check(*chunks: Chunk, computed: dict[int, int]) -> None:
    StepPlan(tick=1, chunks=chunks).check(N_BATCH, CHUNK, computed)


def test_a_valid_plan_passes() -> None:
    check(Chunk(0, "a", 10, (1,), True), Chunk(1, "b", 0, (2,) * 16, False), computed={0: 10, 1: 0})


@pytest.mark.parametrize(
    ("chunks", "computed", "why"),
    [
        ((Chunk(0, "a", 0, (1,) * 65, False),), {0: 0}, "exceeds n_batch"),
        ((Chunk(0, "a", 0, (1,), False), Chunk(0, "a", 1, (2,), True)), {0: 0}, "bad chunk"),
        ((Chunk(3, "x", 0, (1,), True),), {0: 0}, "bad chunk"),  # an idle slot
        ((Chunk(0, "a", 0, (), False),), {0: 0}, "bad chunk"),  # empty
        ((Chunk(0, "a", 5, (1,), True),), {0: 4}, "non-contiguous"),
        ((Chunk(0, "a", 0, (1,) * 17, False),), {0: 0}, "over chunk_size"),
    ],
)
def test_each_violation_raises(
    chunks: tuple[Chunk, ...], computed: dict[int, int], why: str
) -> None:
    with pytest.raises(RuntimeError, match=why):
        check(*chunks, computed=computed)


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_every_plan_valid_and_finishes_everything(seed: int) -> None:
    """Arrivals, cancels and a KV cache small enough to force preemption: the scheduler checks
    every plan itself (a violation raises); afterwards every request ended exactly once and no
    slot, sampler or cell is left behind."""
    rng = random.Random(seed)
    s = make(n_parallel=3, n_ctx=400, n_batch=N_BATCH, chunk=CHUNK, max_queue=0)
    runner = FakeRunner(kv_cells=90)  # one request fits (<= 59 + 29 tokens), three do not
    ids = [f"r{i}" for i in range(12)]
    arrivals = dict(zip(rng.sample(range(12), len(ids)), ids, strict=True))
    cancels = dict(zip(rng.sample(range(60), 3), rng.sample(ids, 3), strict=True))
    events: list[tuple[Request, Event]] = []
    for tick in range(5000):
        if tick in arrivals:
            prompt = tuple(rng.randrange(1, 90) for _ in range(rng.randrange(20, 60)))
            stopping = StoppingParams(max_tokens=rng.randrange(1, 30))
            s.add(Request(GenerationRequest(arrivals[tick], prompt, GREEDY, stopping)))
        if tick in cancels:
            events += s.cancel(cancels[tick])
        plan, expired = s.schedule()
        events += expired
        if plan is not None:
            events += s.update(plan, runner.execute(plan))
        if tick > max(arrivals) and not s.has_work:
            break
    endings = [r.request_id for r, e in events if isinstance(e, Finished | Failed)]
    assert sorted(endings) == sorted(ids), "every request ended exactly once"
    failed = {rid for rid, e in finals(events).items() if isinstance(e, Failed)}
    assert failed <= set(cancels.values()), "only cancelled requests fail"
    assert all(slot.request is None for slot in s.slots) and not s.queue
    assert not runner.samplers
    assert s.counters.preemptions > 0, "the run exercised KV pressure"
    # what the scheduler believes each sequence holds is exactly what the "KV cache" holds
    assert [slot.idle_cache for slot in s.slots] == [runner.kv[slot.slot_id] for slot in s.slots]
    used = s.snapshot(400).kv_cells_used  # shared prefixes (seq_cp) count once
    assert max(map(len, runner.kv.values())) <= used <= sum(map(len, runner.kv.values()))
