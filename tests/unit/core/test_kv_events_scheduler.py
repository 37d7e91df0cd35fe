"""KV cache events against the scheduler with the fake runner: for random traffic with
preemption, eviction to the RAM and disk tiers, cancels and ClearCache, the blocks a subscriber
rebuilds from the events equal, after every tick, the blocks the KV manager holds, per tier; a
subscriber that falls behind the bounded log gets a reset and a correct state (no model)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_grpc_server import errors
from llama_grpc_server.core.kv.disk import KvDiskStore
from llama_grpc_server.core.kv.events import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlocksStored,
    KvEventLog,
    Tier,
    chain,
)
from llama_grpc_server.core.requests.request import GenerationRequest, Request, StoppingParams
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeRunner
from tests.support.kv_events import Blocks, Subscriber
from tests.support.scheduler import GREEDY, PIECES, Clock


def held(scope: str, tokens: Sequence[int], into: dict[int, tuple[int, ...]]) -> None:
    for block in chain(scope, tokens):
        into[block.hash] = block.tokens


def truth(s: Scheduler, disk: KvDiskStore | None) -> Blocks:
    """The blocks the KV manager holds, per tier, computed from scratch."""
    out: Blocks = {tier: {} for tier in Tier}
    for slot in s.slots:
        held(slot.cache_scope, slot.kv_tokens(), out[Tier.DEVICE])
    if s.kv.ram is not None:
        for scope, tokens in s.kv.ram.held():
            held(scope, tokens, out[Tier.HOST])
    if disk is not None:
        for scope, tokens in disk.held():
            held(scope, tokens, out[Tier.DISK])
    return out


def check(s: Scheduler, disk: KvDiskStore | None, sub: Subscriber) -> None:
    if disk is not None:
        disk.flush()  # the writer thread's files are indexed (and reported) by now
    s.publish_kv_events(0.0)
    sub.catch_up()
    assert sub.blocks == truth(s, disk)
    for parents in sub.parents.values():  # a parent outlives its children in every tier
        assert all(p is None or p in parents for p in parents.values())


# -- against the scheduler ----------------------------------------------------------------------

PREFIXES = [tuple((i * 7 + k) % 90 + 1 for i in range(40)) for k in range(3)]
action = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, 2),  # shared prefix
        st.integers(0, 50),  # tokens after it
        st.integers(1, 12),  # max_tokens
        st.sampled_from(["", "5:alice:"]),  # scope (tenant-prefixed)
        st.sampled_from(["", "s1", "s2"]),  # session
    ),
    st.tuples(st.just("tick"), st.integers(1, 6)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("clear")),
)


def make(root: Path | None, ram_bytes: int) -> tuple[Scheduler, KvDiskStore | None]:
    clock = Clock()
    disk = KvDiskStore(root, {"model_sha256": "fake"}, 2500) if root is not None else None
    limits = SchedulerLimits(
        3, 256, 64, 16, 8, ram_cache_bytes=ram_bytes, ram_min_tokens=16, session_idle_s=0.05
    )
    s = Scheduler(
        limits,
        pieces=PIECES,
        eog_ids=frozenset(),
        disk=disk,
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )
    return s, disk


def run_traffic(
    actions: Sequence[tuple[object, ...]], root: Path | None, ram_bytes: int
) -> tuple[Scheduler, Subscriber]:
    s, disk = make(root, ram_bytes)
    runner = FakeRunner(kv_cells=200)  # fewer cells than 3 slots can use: KV pressure
    sub = Subscriber(s.kv.events.log)
    check(s, disk, sub)
    ids: list[str] = []
    for n, act in enumerate(actions):
        if act[0] == "add":
            _, k, extra, max_tokens, scope, session = act
            prompt = PREFIXES[int(k)] + tuple(range(1, int(extra) + 1))  # type: ignore[call-overload]
            spec = GenerationRequest(
                f"r{n}",
                prompt,
                GREEDY,
                StoppingParams(max_tokens=int(max_tokens)),  # type: ignore[call-overload]
                cache_scope=str(scope),
                session_id=str(session),
            )
            try:
                s.add(Request(spec))
                ids.append(spec.request_id)
            except errors.ServiceError:
                pass
        elif act[0] == "cancel" and ids:
            s.cancel(ids[int(act[1]) % len(ids)])  # type: ignore[call-overload]
        elif act[0] == "clear":
            s.kv.clear_idle()
        steps = int(act[1]) if act[0] == "tick" else 1  # type: ignore[call-overload]
        for _ in range(steps):
            s.kv.persist_idle(s.clock_ns())
            plan, _events = s.schedule()
            if plan is not None:
                s.update(plan, runner.execute(plan))
            check(s, disk, sub)
    for _ in range(500):  # run everything to its end, checking every tick
        if not s.has_work:
            break
        plan, _events = s.schedule()
        if plan is not None:
            s.update(plan, runner.execute(plan))
        check(s, disk, sub)
    if disk is not None:
        disk.close()
    return s, sub


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(action, min_size=1, max_size=40), st.sampled_from([0, 1200, 4000]))
def test_a_subscriber_rebuilds_every_tier_exactly_at_every_tick(
    actions: list[tuple[object, ...]], ram_bytes: int
) -> None:
    """Random traffic over 3 slots sharing 200 cells (preemption, idle caches dropped under
    pressure), a small RAM tier evicting to a small disk tier (which evicts by its byte budget),
    sessions written to disk when idle, cancels and ClearCache: after every tick the subscriber's
    blocks per tier are exactly what the KV manager holds, with their token ids."""
    with tempfile.TemporaryDirectory() as root:
        run_traffic(actions, Path(root), ram_bytes)


def test_traffic_reaches_every_tier_and_event() -> None:
    """The scenario the property test relies on really happens: blocks on every tier, removals
    of each kind, preemption, and a ClearCache with a request still running."""
    actions: list[tuple[object, ...]] = [
        ("add", 0, 30, 12, "", "s1"),
        ("add", 1, 40, 12, "", "s2"),
        ("add", 2, 50, 12, "5:alice:", ""),
        ("tick", 6),
        ("add", 0, 45, 12, "", ""),
        ("add", 1, 5, 12, "", "s1"),
        ("tick", 6),
        ("add", 2, 20, 12, "", ""),
        ("add", 1, 50, 12, "", "s2"),
        ("tick", 30),
        ("add", 0, 40, 12, "", "s1"),
        ("tick", 30),
        ("add", 1, 50, 12, "", ""),
        ("clear",),
        ("tick", 3),
        ("add", 0, 50, 12, "5:alice:", ""),
        ("tick", 6),
    ]
    with tempfile.TemporaryDirectory() as root:
        s, _sub = run_traffic(actions, Path(root), 600)
    kinds = {
        (type(e).__name__, getattr(e, "tier", None))
        for batch in s.kv.events.log.read(1).batches
        for e in batch.events
    }
    assert s.counters.preemptions >= 1
    for tier in Tier:
        assert ("BlocksStored", tier) in kinds
        assert ("BlocksRemoved", tier) in kinds
    cleared = [
        b for b in s.kv.events.log.read(1).batches if isinstance(b.events[0], AllBlocksCleared)
    ]
    assert len(cleared) == 1  # ClearCache's (read(1): after the engine's first batch)
    assert any(isinstance(e, BlocksStored) for e in cleared[0].events)  # the running request's


def test_a_restart_announces_the_disk_tier_again() -> None:
    """Blocks written to disk by one engine are announced by the next one, with the same
    hashes, in its first batch (after its AllBlocksCleared)."""
    with tempfile.TemporaryDirectory() as root:
        s, disk = make(Path(root), 0)
        assert disk is not None
        runner = FakeRunner()
        s.add(
            Request(GenerationRequest("a", PREFIXES[0] * 2, GREEDY, StoppingParams(max_tokens=4)))
        )
        while s.has_work:
            plan, _events = s.schedule()
            if plan is not None:
                s.update(plan, runner.execute(plan))
        s.kv.persist_idle(s.clock_ns(), everything=True)
        plan, _events = s.schedule()
        assert plan is not None
        s.update(plan, runner.execute(plan))
        disk.close()
        before = truth(s, disk)[Tier.DISK]
        assert len(before) == 5  # 84 tokens: 5 whole blocks

        s2, disk2 = make(Path(root), 0)
        sub = Subscriber(s2.kv.events.log)
        check(s2, disk2, sub)
        assert sub.blocks[Tier.DISK] == before
        assert s2.kv.events.log.seq == 1  # one batch: AllBlocksCleared, then the files' blocks


def test_a_slow_subscriber_gets_a_reset_and_never_holds_the_engine_up() -> None:
    """A subscriber that stops reading costs the engine nothing: the log stays within its bounds
    while traffic goes on, and the subscriber's next read is a reset to exactly what is held
    (what a flush costs per tick: bench/kv_events_tick.py)."""
    s, _ = make(None, 4000)
    s.kv.events.log = log = KvEventLog(max_batches=8, max_blocks=256)
    runner = FakeRunner(kv_cells=200)
    slow = Subscriber(log)
    slow.catch_up()
    for n in range(60):
        prompt = PREFIXES[n % 3] + tuple(range(1, n % 40 + 2))
        s.add(Request(GenerationRequest(f"r{n}", prompt, GREEDY, StoppingParams(max_tokens=8))))
        for _ in range(4):
            plan, _events = s.schedule()
            if plan is not None:
                s.update(plan, runner.execute(plan))
            s.publish_kv_events(0.0)
            assert log.num_batches <= 8
            assert log.num_logged_blocks <= 256 + 3 * 256 // BLOCK_SIZE
    read = slow.catch_up()
    assert read.is_reset
    assert slow.blocks == truth(s, None)
