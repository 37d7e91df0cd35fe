"""Admission: the way into the slots. Intake checks what may queue (the context fit, the queue
bound, the tenant's bound) and stamps arrival and seed; the queue keeps arrival order; next()
says which queued request a free slot goes to (core.scheduling.tenants.FairShare: tenants' shares,
priority, aging); a request whose KV the disk tier is reading waits in `restoring`, holding no
slot, and re-enters at the head of the queue when the I/O thread answers; a preempted one
re-enters at the head (requeue), and admissions pause until a request ends (ended). The queue,
`restoring`, `timed` and the pause change here only. Pure Python; the Scheduler owns it on the
engine thread (only the disk answers arrive from elsewhere)."""

from __future__ import annotations

import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping

from llama_grpc_server import errors
from llama_grpc_server.core.kv import prefix_cache
from llama_grpc_server.core.kv.disk import Loaded
from llama_grpc_server.core.kv.manager import KvCacheManager
from llama_grpc_server.core.requests import context_fit, embedding
from llama_grpc_server.core.requests.request import GenerationRequest, Request, RequestState
from llama_grpc_server.core.scheduling.limits import SchedulerLimits
from llama_grpc_server.core.scheduling.slot import SlotTable
from llama_grpc_server.core.scheduling.tenants import FairShare, TenantLimits
from llama_grpc_server.core.stats import Counters


def _nothing() -> None:
    """Admission.wakeup without an engine thread to wake (tests driving schedule() directly)."""


class Admission:
    def __init__(
        self,
        limits: SchedulerLimits,
        slots: SlotTable,
        kv: KvCacheManager,
        counters: Counters,
        clock_ns: Callable[[], int],
    ) -> None:
        self.queue: deque[Request] = deque()  # in arrival order; fair_share picks from it
        self.fair_share = FairShare(limits.tenants, len(slots), clock_ns)
        self.session_live_ns = int(limits.session_live_s * 1e9)
        self._n_ctx = limits.n_ctx
        self._encoder = limits.encoder
        self._max_queue = limits.max_queue
        self._slots = slots
        self._kv = kv
        self._counters = counters
        self._clock_ns = clock_ns
        # Requests waiting for the disk tier's I/O thread (RESTORING), by key. Its answers
        # arrive on that thread: _disk_done (with _disk_lock), then wakeup() (the EngineLoop
        # sets it to wake the engine thread).
        self.restoring: dict[str, Request] = {}
        self._disk_done: list[tuple[int, str, Loaded | None]] = []
        self._disk_lock = threading.Lock()
        self._disk_tickets = 0
        self.wakeup: Callable[[], None] = _nothing
        self._is_paused = False  # a preemption stops admissions until a request ends
        # Keys of live requests with a deadline or a time limit (the Scheduler skips its expiry
        # scan while there are none and no stall bound); ended() forgets them.
        self.timed: set[str] = set()

    # -- intake -----------------------------------------------------------------------------------

    def check_fits(self, spec: GenerationRequest) -> None:
        """Reject at once what can never fit the context (the numbers are in the message), and
        generation on an encoder-only model."""
        if spec.is_embedding:
            context_fit.check_embedding_fits(len(spec.prompt_tokens), self._n_ctx)
            return
        if self._encoder:
            raise embedding.refuse_generation(architecture=self._encoder)
        context_fit.check_fits(len(spec.prompt_tokens), spec.stopping.max_tokens, self._n_ctx)

    def add(self, request: Request) -> None:
        """Queue a request. Raises PromptTooLong, or Overloaded when the queue or the tenant's
        part of it is full, without queueing it."""
        try:
            self.check_fits(request.spec)
            waiting = len(self.queue) - sum(1 for s in self._slots if s.is_idle)
            if self._max_queue > 0 and waiting >= self._max_queue:
                raise errors.Overloaded(
                    f"queue is full ({waiting} waiting, max_queue={self._max_queue})",
                    retry_after_s=1.0,
                )
            self._check_tenant_queue(request.spec.tenant)
        except errors.ServiceError:
            self._counters.rejected += 1
            raise
        if request.arrival_ns == 0:
            request.arrival_ns = self._clock_ns()
        seed = request.spec.sampling.seed
        request.seed = seed if seed is not None else random.getrandbits(32)
        if request.spec.deadline is not None or request.spec.stopping.time_limit_ms is not None:
            self.timed.add(request.key)
        self.queue.append(request)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        self.fair_share.set_limits(limits)

    def _check_tenant_queue(self, tenant: str) -> None:
        limits = self.fair_share.limits(tenant)
        if limits.max_queued <= 0:
            return
        queued = sum(1 for r in self.queue if r.spec.tenant == tenant)
        idle = sum(1 for s in self._slots if s.is_idle)
        waiting = limits.num_waiting(queued, self.running()[tenant], idle)
        if waiting >= limits.max_queued:
            raise errors.Overloaded(
                f"tenant {tenant!r} has {waiting} requests waiting "
                f"(max_queued={limits.max_queued})",
                retry_after_s=1.0,
            )

    def take(self, key: str) -> Request | None:
        """The queued or restoring request of that key, taken out (a restoring one's read
        answer, when it comes, is dropped); None if it is neither."""
        for request in self.queue:
            if request.key == key:
                self.queue.remove(request)
                return request
        return self.restoring.pop(key, None)

    def take_all(self) -> list[Request]:
        """Every queued and restoring request, taken out (queue order, then restoring)."""
        out = [*self.queue, *self.restoring.values()]
        self.queue.clear()
        self.restoring.clear()
        return out

    # -- who goes next ----------------------------------------------------------------------------

    def next(self) -> Request | None:
        """The queued request a free slot goes to, taken from the queue. A preempted request,
        or one back from a disk read, at the head keeps its place (it was admitted fairly once,
        and its tenant's count dropped when it left its slot); else the fair share picks. None:
        every tenant with queued requests is at its max_concurrent."""
        if self.queue[0].num_preemptions or self.queue[0].disk_tried:
            return self.queue.popleft()
        sessions = {s.session_id for s in self._slots if s.is_idle and s.session_id}
        request = self.fair_share.pick(self.queue, self.running(), sessions)
        if request is not None:
            self.queue.remove(request)
        return request

    def place(self, request: Request, tick: int) -> bool:
        """Put a request into the slot whose cache serves it best (prefix_cache.place), with
        the KV it keeps (kv.prepare) or a wait for a shared prefix a busy slot is computing;
        False when it waits for a disk read instead (placed again when the answer arrives)."""
        spec = request.spec
        placement = prefix_cache.place(
            self._slots,
            request.tokens,
            spec.cache_scope,
            spec.session_id,
            now_ns=self._clock_ns(),
            live_ns=self.session_live_ns,
        )
        if self.read_from_disk(request, placement.num_cached):
            return False
        slot = self._slots[placement.slot_id]
        kept = self._kv.prepare(slot, request, placement)
        self._slots.assign(slot, request)
        request.num_computed = kept
        request.state = RequestState.PREFILLING
        request.last_served_tick = tick
        if request.restoring_tokens:
            return True  # its cached tokens are counted when the runner reports the restore
        if not (spec.cache_prompt and self._kv.wait_for_shared_prefix(request, slot)):
            self._counters.count_cached(request, kept)
        return True

    def requeue(self, request: Request) -> None:
        """A preempted request (its slot evicted, its KV dropped) back at the head of the queue:
        it resumes by re-prefilling prompt + output so far (its sampler and text state are
        kept). Admissions pause until a request ends: the same pressure would return."""
        request.num_computed = 0
        request.state = RequestState.QUEUED
        request.num_preemptions += 1
        self._counters.preemptions += 1
        self.queue.appendleft(request)
        self._is_paused = True

    def ended(self, request: Request) -> None:
        """A request ended (finished, failed or cancelled): it has no deadline to watch, and
        its slot (if it held one) may be taken again."""
        self.timed.discard(request.key)
        self._is_paused = False

    def is_open(self) -> bool:
        """Whether queued requests may take idle slots now: not after a preemption while any
        request still runs (the same pressure would return), until one ends (ended)."""
        if self._is_paused and self._slots.requests():
            return False
        self._is_paused = False
        return True

    def running(self) -> Counter[str]:
        """Requests in slots, by tenant."""
        return Counter(s.request.spec.tenant for s in self._slots if s.request is not None)

    # -- the disk tier's reads --------------------------------------------------------------------

    def read_from_disk(self, request: Request, num_cached: int) -> bool:
        """Start a disk-tier read for a request being placed (kv.start_disk_read); True if it
        now waits for it (RESTORING, no slot held) instead of being placed."""
        self._disk_tickets += 1
        ticket, key = self._disk_tickets, request.key

        def done(loaded: Loaded | None) -> None:  # on the I/O thread
            with self._disk_lock:
                self._disk_done.append((ticket, key, loaded))
            self.wakeup()

        if not self._kv.start_disk_read(request, num_cached, done):
            return False
        request.disk_ticket = ticket
        request.state = RequestState.RESTORING
        self.restoring[key] = request
        return True

    @property
    def has_disk_answers(self) -> bool:
        return bool(self._disk_done)

    def take_disk_reads(self) -> None:
        """The reads that came back: each one's request goes back to the head of the queue
        with its state (or, when the read failed, to compute its prompt). An answer for a
        request that ended meanwhile (cancelled, deadline) is dropped."""
        if not self._disk_done:
            return
        with self._disk_lock:
            done, self._disk_done = self._disk_done, []
        for ticket, key, loaded in reversed(done):  # appendleft: the first answer ends first
            request = self.restoring.get(key)
            if request is None or request.disk_ticket != ticket:
                continue
            del self.restoring[key]
            request.disk_ticket, request.disk_loaded = 0, loaded
            request.state = RequestState.QUEUED
            self.queue.appendleft(request)
