"""Fair share between tenants: FairShare alone (weights, newcomers, max_concurrent)."""

from __future__ import annotations

import pytest

from llama_grpc_server.core.request import GenerationRequest, Request
from llama_grpc_server.core.tenants import FairShare, TenantLimits

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
