"""Fair share between tenants: each tenant's limits, and which queued request a free slot goes
to. Pure Python; the scheduler owns the queue and the slots, FairShare only chooses."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass

from llama_grpc_server.core.requests.request import Priority, Request

AGING_NS = 10 * 1_000_000_000  # waiting this long raises a request's priority by one level


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's share of the engine; a tenant without an entry gets the defaults."""

    max_concurrent: int = 0  # its requests in slots at once; 0 = no limit
    max_queued: int = 0  # its requests waiting for a slot; 0 = no limit
    weight: float = 1.0  # its share of the slots while tenants contend for them
    # The LoRA adapters its requests may apply (auth: carried by its principals); None: any.
    adapters: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent < 0 or self.max_queued < 0 or not self.weight > 0:
            raise ValueError(f"invalid tenant limits: {self}")

    def has_room(self, running: int) -> bool:
        """Whether one more of the tenant's requests may take a slot."""
        return self.max_concurrent <= 0 or running < self.max_concurrent

    def num_waiting(self, queued: int, running: int, idle_slots: int) -> int:
        """The tenant's queued requests that would still wait if it took every idle slot its
        max_concurrent allows (what max_queued bounds; a burst into idle slots is not waiting)."""
        room = idle_slots
        if self.max_concurrent > 0:
            room = min(room, max(0, self.max_concurrent - running))
        return max(0, queued - room)


class FairShare:
    """Which queued request a free slot goes to.

    The tenant, among those with queued requests and room under max_concurrent: first those
    below their fair number of slots (n_slots x weight / the weights of the tenants present,
    i.e. queued or running: so a flood cannot hold the slots a quieter tenant is owed); then
    the one with the least virtual time (admissions / weight: what splits the slots by weight
    over time, where slots are too few to split at once, down to a single slot); then the one
    admitted least recently (never first); then the one whose oldest queued request is oldest.
    A tenant with nothing queued or running is forgotten; one arriving starts at the least
    virtual time among those present, so it is owed nothing for its time away and owes nothing.

    Within the tenant: a request whose session's slot is idle first (it reuses its cached
    conversation at once instead of another request evicting it), else the highest effective
    priority, priority + waited / AGING_NS (so LOW is never starved), first come first served
    among equals. With one tenant and one priority that is the queue order."""

    def __init__(
        self, limits: Mapping[str, TenantLimits], n_slots: int, clock_ns: Callable[[], int]
    ) -> None:
        self._limits = limits
        self._n_slots = n_slots
        self._clock_ns = clock_ns  # the clock of Request.arrival_ns
        self._vtime: dict[str, float] = {}
        self._last_admitted: dict[str, int] = {}
        self._num_admitted = 0

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, _NO_LIMITS)

    def set_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """New limits (a reloaded tokens file) for every later choice; the tenants' virtual
        times and admission order are kept, so a reload neither owes nor charges anyone."""
        self._limits = dict(limits)

    def pick(
        self, queue: Iterable[Request], running: Mapping[str, int], idle_sessions: Set[str]
    ) -> Request | None:
        """The request the next free slot goes to, counted as admitted (the caller places it);
        None when every tenant with queued requests is at its max_concurrent. `running`: the
        tenants' requests in slots; `idle_sessions`: the session ids of idle slots."""
        queued: dict[str, list[Request]] = {}
        for request in queue:
            queued.setdefault(request.spec.tenant, []).append(request)
        present = queued.keys() | {t for t, n in running.items() if n > 0}
        self._track(present)
        eligible = [t for t in queued if self.limits(t).has_room(running.get(t, 0))]
        if not eligible:
            return None
        total_weight = sum(self.limits(t).weight for t in present)

        def rank(tenant: str) -> tuple[bool, float, int]:
            weight = self.limits(tenant).weight
            is_below_share = running.get(tenant, 0) * total_weight < self._n_slots * weight
            return not is_below_share, self._vtime[tenant], self._last_admitted.get(tenant, 0)

        tenant = min(eligible, key=rank)
        self._num_admitted += 1
        self._vtime[tenant] += 1 / self.limits(tenant).weight
        self._last_admitted[tenant] = self._num_admitted
        return self._within(queued[tenant], idle_sessions)

    def _track(self, present: Set[str]) -> None:
        for tenant in [t for t in self._vtime if t not in present]:
            del self._vtime[tenant]
            self._last_admitted.pop(tenant, None)
        start = min(self._vtime.values(), default=0.0)
        for tenant in present:
            self._vtime.setdefault(tenant, start)

    def _within(self, requests: list[Request], idle_sessions: Set[str]) -> Request:
        for request in requests:
            if request.spec.session_id in idle_sessions:
                return request
        heads: dict[Priority, Request] = {}  # the first queued of each priority
        for request in requests:
            heads.setdefault(request.spec.priority, request)
        if len(heads) == 1:
            return requests[0]
        now_ns = self._clock_ns()
        return max(heads.values(), key=lambda r: r.spec.priority * AGING_NS + now_ns - r.arrival_ns)


_NO_LIMITS = TenantLimits()
