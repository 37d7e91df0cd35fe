"""Fair share between tenants: FairShare alone (weights, newcomers, max_concurrent), then the
scheduler with tenant limits (max_queued, max_concurrent, a flood against a quiet tenant,
priority and aging within a tenant, preemption) driven by the fake runner."""

from __future__ import annotations

import dataclasses

import pytest

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    Priority,
    Request,
    RequestState,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.scheduling.tenants import FairShare, TenantLimits
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, PIECES, Clock, alone, drive, finals, outputs, req

# -- FairShare alone ------------------------------------------------------------------------------


def picks(fair: FairShare, queue: list[Request], n: int) -> str:
    """The tenants of n picks for a single slot (each admitted request finishes before the
    next pick)."""
    out = ""
    for _ in range(n):
        chosen = fair.pick(queue, {}, frozenset())
        assert chosen is not None
        queue.remove(chosen)
        out += chosen.spec.tenant
    return out


def flood(tenant: str, n: int) -> list[Request]:
    return [Request(GenerationRequest(f"{tenant}{i}", (1, 2), tenant=tenant)) for i in range(n)]


def test_one_slot_alternates_between_equal_tenants() -> None:
    fair = FairShare({}, 1, clock_ns=lambda: 0)
    assert picks(fair, flood("a", 10) + flood("b", 10), 8) == "abababab"


def test_one_slot_is_split_by_weight() -> None:
    fair = FairShare({"a": TenantLimits(weight=2.0)}, 1, clock_ns=lambda: 0)
    order = picks(fair, flood("a", 30) + flood("b", 30), 30)
    assert order.count("a") == 20, order


def test_a_tenant_arriving_late_is_owed_nothing_for_its_time_away() -> None:
    """After ten picks of a alone, b takes turns with a; it does not get ten in a row."""
    fair = FairShare({}, 1, clock_ns=lambda: 0)
    queue = flood("a", 20)
    assert picks(fair, queue, 10) == "a" * 10
    queue += flood("b", 10)
    assert picks(fair, queue, 6) == "bababa"


def test_a_tenant_at_max_concurrent_gets_no_slot() -> None:
    fair = FairShare({"a": TenantLimits(max_concurrent=2)}, 4, clock_ns=lambda: 0)
    queue = flood("a", 3)
    assert fair.pick(queue, {"a": 2}, frozenset()) is None
    assert fair.pick(queue, {"a": 1}, frozenset()) is queue[0]


@pytest.mark.parametrize(
    "limits",
    [{"weight": 0.0}, {"weight": -1.0}, {"max_concurrent": -1}, {"max_queued": -1}],
)
def test_invalid_tenant_limits_are_refused(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="invalid tenant limits"):
        TenantLimits(**limits)  # type: ignore[arg-type]


# -- the scheduler ---------------------------------------------------------------------------------


SECOND_NS = 1_000_000_000


def tenant_req(
    tenant: str, rid: str, max_tokens: int = 4, priority: Priority = Priority.NORMAL
) -> Request:
    """A request with a prompt no other request shares (no prefix cache between them)."""
    prompt = (sum(map(ord, rid)) % 90 + 1, *range(40, 47))
    stopping = StoppingParams(max_tokens=max_tokens)
    spec = GenerationRequest(rid, prompt, GREEDY, stopping, tenant=tenant, priority=priority)
    return Request(spec)


def make_fair(
    n_parallel: int = 2,
    tenants: dict[str, TenantLimits] | None = None,
    clock: Clock | None = None,
) -> Scheduler:
    clock = clock or Clock()
    return Scheduler(
        SchedulerLimits(n_parallel, 512, 64, 16, 64, tenants=tenants or {}),
        pieces=PIECES,
        eog_ids=frozenset(),
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )


def step(s: Scheduler, runner: FakeRunner) -> None:
    plan, _ = s.schedule()
    assert plan is not None
    s.update(plan, runner.execute(plan))


def admitted(requests: list[Request]) -> list[str]:
    """Request ids in the order they first took a slot."""
    started = sorted((r for r in requests if r.admitted_ns), key=lambda r: r.admitted_ns)
    return [r.request_id for r in started]


def test_max_queued_rejects_the_tenants_next_request_naming_the_limit() -> None:
    s = make_fair(n_parallel=1, tenants={"a": TenantLimits(max_queued=2)})
    s.add(tenant_req("a", "a0"))
    s.schedule()  # a0 takes the slot
    s.add(tenant_req("a", "a1"))
    s.add(tenant_req("a", "a2"))
    with pytest.raises(errors.Overloaded) as info:
        s.add(tenant_req("a", "a3"))
    assert info.value.message == "tenant 'a' has 2 requests waiting (max_queued=2)"
    assert info.value.retry_after_s is not None
    assert s.counters.rejected == 1
    s.add(tenant_req("b", "b0"))  # another tenant is not held to a's limit
    assert [r.request_id for r in s.queue] == ["a1", "a2", "b0"]


@pytest.mark.parametrize(
    ("limits", "accepted"),
    [
        (TenantLimits(max_queued=1), 3),  # two go to the idle slots, one waits
        (TenantLimits(max_queued=1, max_concurrent=1), 2),  # one may run, one waits
    ],
)
def test_max_queued_counts_what_would_still_wait(limits: TenantLimits, accepted: int) -> None:
    """A burst into idle slots is not waiting; beyond max_concurrent it is."""
    s = make_fair(n_parallel=2, tenants={"a": limits})
    for i in range(accepted):
        s.add(tenant_req("a", f"a{i}"))
    with pytest.raises(errors.Overloaded, match=r"has 1 requests waiting \(max_queued=1\)"):
        s.add(tenant_req("a", "late"))


def test_max_concurrent_keeps_a_tenants_extra_requests_queued() -> None:
    """a may hold one slot: b's later request gets the second slot and the third stays idle
    while a1 and a2 wait; everything still finishes."""
    s, runner = make_fair(n_parallel=3, tenants={"a": TenantLimits(max_concurrent=1)}), FakeRunner()
    requests = [tenant_req("a", f"a{i}", max_tokens=20) for i in range(3)]
    requests.append(tenant_req("b", "b0", max_tokens=2))
    for r in requests:
        s.add(r)
    plan, _ = s.schedule()
    assert plan is not None
    assert [slot.request.request_id if slot.request else "" for slot in s.slots] == ["a0", "b0", ""]
    assert [r.request_id for r in s.queue] == ["a1", "a2"]
    s.update(plan, runner.execute(plan))
    most = 0

    def watch(tick: int) -> None:
        nonlocal most
        most = max(most, sum(1 for sl in s.slots if sl.request and sl.request.spec.tenant == "a"))

    events = drive(s, runner, between=watch)
    assert most == 1
    assert all(isinstance(e, Finished) for e in finals(events).values()) and not s.queue


def test_a_quiet_tenant_goes_before_a_flood_at_the_first_turnover() -> None:
    """a queued 20 requests; b's one request takes the first slot that frees up."""
    s, runner = make_fair(n_parallel=2), FakeRunner()
    requests = [tenant_req("a", f"a{i}") for i in range(20)]
    for r in requests:
        s.add(r)
    step(s, runner)  # a0 and a1 take both slots
    requests.append(tenant_req("b", "b0"))
    s.add(requests[-1])
    drive(s, runner)
    assert admitted(requests)[:3] == ["a0", "a1", "b0"]


@pytest.mark.parametrize(
    ("weights", "n_parallel", "share"),
    [
        ((1.0, 1.0), 1, 1 / 2),
        ((1.0, 1.0), 2, 1 / 2),
        ((1.0, 1.0), 3, 1 / 2),
        ((2.0, 1.0), 1, 2 / 3),
        ((2.0, 1.0), 2, 2 / 3),
        ((2.0, 1.0), 3, 2 / 3),
    ],
)
def test_two_flooding_tenants_share_the_slots_by_weight(
    weights: tuple[float, float], n_parallel: int, share: float
) -> None:
    """a queues 30 requests, then b 30 (same lengths): of the first 30 admissions, while both
    still have requests waiting, a gets its weight's share within one."""
    tenants = {"a": TenantLimits(weight=weights[0]), "b": TenantLimits(weight=weights[1])}
    s, runner = make_fair(n_parallel, tenants), FakeRunner()
    requests = [tenant_req(t, f"{t}{i}") for t in "ab" for i in range(30)]
    for r in requests:
        s.add(r)
    drive(s, runner)
    first = admitted(requests)[:30]
    assert abs(sum(rid[0] == "a" for rid in first) - share * 30) <= 1, first


def test_one_tenant_at_one_priority_is_first_come_first_served() -> None:
    s, runner = make_fair(n_parallel=2, tenants={"a": TenantLimits(weight=3.0)}), FakeRunner()
    requests = [tenant_req("a", f"a{i}", max_tokens=2 + i % 3) for i in range(10)]
    for r in requests:
        s.add(r)
    drive(s, runner)
    assert admitted(requests) == [f"a{i}" for i in range(10)]


def test_priority_orders_a_tenants_queue() -> None:
    """HIGH first, LOW last, first come first served within NORMAL."""
    s, runner = make_fair(n_parallel=1), FakeRunner()
    busy = tenant_req("a", "busy")
    s.add(busy)
    step(s, runner)
    requests = [
        tenant_req("a", "low", priority=Priority.LOW),
        tenant_req("a", "normal"),
        tenant_req("a", "high", priority=Priority.HIGH),
        tenant_req("a", "normal2"),
    ]
    for r in requests:
        s.add(r)
    drive(s, runner)
    assert admitted([busy, *requests]) == ["busy", "high", "normal", "normal2", "low"]


@pytest.mark.parametrize(
    ("waited_s", "order"), [(19, ["busy", "high", "low"]), (21, ["busy", "low", "high"])]
)
def test_aging_lets_a_long_waiting_low_request_outrank_a_fresh_high_one(
    waited_s: int, order: list[str]
) -> None:
    """A level of priority per 10 s waited: LOW after 21 s is above a fresh HIGH, not after 19."""
    clock = Clock()
    s, runner = make_fair(n_parallel=1, clock=clock), FakeRunner()
    busy = tenant_req("a", "busy")
    s.add(busy)
    step(s, runner)
    low = tenant_req("a", "low", priority=Priority.LOW)
    s.add(low)
    clock.ns += waited_s * SECOND_NS
    high = tenant_req("a", "high", priority=Priority.HIGH)
    s.add(high)
    drive(s, runner)
    assert admitted([busy, low, high]) == order


def test_a_preempted_request_resumes_first_whatever_the_fair_share() -> None:
    """a2 is preempted while b, of weight 3, waits with two requests: when a1 finishes, two
    slots are free and the fair share alone would give both to b; a2 resumes in one of them."""
    s, runner = make_fair(n_parallel=3, tenants={"b": TenantLimits(weight=3.0)}), FakeRunner()
    a0, a1, a2 = (tenant_req("a", f"a{i}", max_tokens=n) for i, n in enumerate((30, 2, 30)))
    for r in (a0, a1, a2):
        s.add(r)
    step(s, runner)
    s.add(tenant_req("b", "b0"))
    s.add(tenant_req("b", "b1"))
    s.preempt(a2)  # as KV pressure does: back to the head of the queue
    while a1.state is not RequestState.FINISHED:
        step(s, runner)
    step(s, runner)
    assert a2.slot_id >= 0 and [r.request_id for r in s.queue] == ["b1"]


def test_preempted_requests_of_two_tenants_resume_identically() -> None:
    """Under KV pressure a preempted request keeps its place at the head whatever the fair
    share says, and every request still produces exactly its solo output."""
    ids = {"a": ["a0", "a1"], "b": ["b0"]}
    expected = {rid: alone(40, 30, rid) for rids in ids.values() for rid in rids}
    s, runner = make_fair(n_parallel=3), FakeRunner(kv_cells=150)
    for tenant, rids in ids.items():
        for rid in rids:
            s.add(Request(dataclasses.replace(req(rid, 40, 30).spec, tenant=tenant)))
    events = drive(s, runner)
    assert s.counters.preemptions >= 1
    assert all(isinstance(e, Finished) for e in finals(events).values())
    assert outputs(events) == expected


def test_a_tenant_of_long_requests_holds_no_more_than_its_share_of_slots() -> None:
    """a's requests run 20 times longer than b's: admitting them in turn would leave a almost
    every slot; instead each holds half of them while both have requests waiting."""
    s, runner = make_fair(n_parallel=4), FakeRunner()
    for i in range(12):
        s.add(tenant_req("a", f"a{i}", max_tokens=40))
        s.add(tenant_req("b", f"b{i}", max_tokens=2))
    held: set[int] = set()

    def watch(tick: int) -> None:
        if tick > 0 and {r.spec.tenant for r in s.queue} == {"a", "b"}:
            held.add(sum(1 for sl in s.slots if sl.request and sl.request.spec.tenant == "a"))

    drive(s, runner, between=watch)
    assert held == {2}


def test_stats_name_the_tenant_of_each_slot() -> None:
    s = make_fair(n_parallel=2)
    s.add(tenant_req("a", "a0"))
    s.schedule()
    slots = s.snapshot(512).slots
    assert [(v.request_id, v.tenant) for v in slots] == [("a0", "a"), ("", "")]


def test_new_limits_govern_the_next_add_and_admission() -> None:
    """set_tenant_limits (a reloaded tokens file): the next add() is judged by the new max_queued
    and the next admission by the new max_concurrent; requests already in slots or queued keep
    their place."""
    s, runner = make_fair(n_parallel=2), FakeRunner()
    s.add(tenant_req("a", "a0"))
    s.add(tenant_req("a", "a1"))
    s.add(tenant_req("a", "a2"))
    step(s, runner)  # a0 and a1 take both slots, a2 waits
    s.set_tenant_limits({"a": TenantLimits(max_concurrent=1, max_queued=1)})
    assert s.limits.tenants == {"a": TenantLimits(max_concurrent=1, max_queued=1)}
    with pytest.raises(errors.Overloaded) as info:
        s.add(tenant_req("a", "a3"))
    assert info.value.message == "tenant 'a' has 1 requests waiting (max_queued=1)"
    assert [r.request_id for r in s.queue] == ["a2"]
    s.cancel("a0", "a")
    step(s, runner)  # a slot is free, but a still runs a1: at max_concurrent=1, a2 waits
    assert [r.request_id for r in s.queue] == ["a2"]
    s.set_tenant_limits({})
    step(s, runner)
    assert not s.queue
