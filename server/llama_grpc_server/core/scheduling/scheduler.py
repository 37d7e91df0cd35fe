"""Scheduler: the queue, the slots and the per-tick decisions, in that order: admission
(core.scheduling.admission, core.scheduling.starts) fills free slots from the queue, schedule()
turns the slots into a StepPlan (core.scheduling.passes composes the pass: the batch strategy
splits the token budget, core.speculation.drafts adds drafts and pads), update() applies the
runner's StepResult (core.scheduling.progress, per chunk) and returns the events to deliver. Each
state change has one owner: the SlotTable assigns and frees slots, Admission owns the queue, the
KvCacheManager (callers reach it as .kv) every KV edit, Endings how requests end, core.stats the
counters and snapshots, core.scheduling.backpressure slow readers. Only the engine thread calls
it. Pure Python: no llama_cpp, no grpc, no clock of its own."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from llama_grpc_server import errors
from llama_grpc_server.core import stats
from llama_grpc_server.core.api import CacheCleared, StatsSnapshot
from llama_grpc_server.core.kv import prefix_cache
from llama_grpc_server.core.kv.events import KvEventLog, KvEventPublisher, LoadRecord
from llama_grpc_server.core.kv.manager import DiskTier, KvCacheManager
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import (
    Emitted,
    FinishReason,
    GenerationRequest,
    Request,
    request_key,
)
from llama_grpc_server.core.scheduling import expiry
from llama_grpc_server.core.scheduling.admission import Admission
from llama_grpc_server.core.scheduling.backpressure import BackPressure
from llama_grpc_server.core.scheduling.endings import Endings
from llama_grpc_server.core.scheduling.limits import SchedulerLimits
from llama_grpc_server.core.scheduling.passes import Passes
from llama_grpc_server.core.scheduling.plan import DECODE_KV_FULL, DECODE_OK, StepPlan, StepResult
from llama_grpc_server.core.scheduling.progress import Progress
from llama_grpc_server.core.scheduling.slot import SlotTable
from llama_grpc_server.core.scheduling.starts import Starts
from llama_grpc_server.core.scheduling.strategies import BatchStrategy, DecodeMaximal
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.core.speculation.draft_model import DraftSource
from llama_grpc_server.core.speculation.drafts import DraftLimits, Drafts
from llama_grpc_server.core.speculation.policy import PriorShape, TickCostModel
from llama_grpc_server.core.speculation.speculator import Speculator

__all__ = ["Scheduler", "SchedulerLimits"]  # SchedulerLimits lives in core.scheduling.limits


class Scheduler:
    """Continuous batching over a slot pool sharing one unified KV cache."""

    def __init__(
        self,
        limits: SchedulerLimits,
        *,
        pieces: Sequence[bytes],
        eog_ids: frozenset[int],
        strategy: BatchStrategy | None = None,
        disk: DiskTier | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.slots = SlotTable(limits.n_parallel, clock_ns)
        self.counters = stats.Counters()
        self.spec = Speculator(limits.speculative)
        self.kv = KvCacheManager(
            self.slots,
            count_cached=self.counters.count_cached,
            supports_partial_removal=limits.supports_partial_removal,
            ram_cache_bytes=limits.ram_cache_bytes,
            ram_min_tokens=limits.ram_min_tokens,
            disk=disk,
            session_idle_ns=int(limits.session_idle_s * 1e9),
            events=KvEventPublisher(bos=limits.kv_events_bos),
        )
        self.admission = Admission(limits, self.slots, self.kv, self.counters, clock_ns)
        self.queue: deque[Request] = self.admission.queue
        self.restoring: dict[str, Request] = self.admission.restoring  # waiting for the disk
        draft_limits = DraftLimits(
            limits.n_ctx, limits.n_batch, limits.pad_decode_batches, limits.stream_buffer_tokens
        )
        self.drafts = Drafts(draft_limits, self.spec, self.slots, self.kv, self.counters)
        self.passes = Passes(limits, strategy or DecodeMaximal(), self.drafts, self.counters)
        self.back_pressure = BackPressure(
            limits.stream_buffer_tokens, limits.stalled_reader_s, self.counters, clock_ns
        )
        self.outputs = Outputs(pieces, eog_ids, limits.n_ctx)
        self.endings = Endings(
            self.slots, self.kv, self.outputs, self.drafts, self.admission, self.counters, clock_ns
        )
        self.starts = Starts(self.outputs, self.endings, self.drafts, self.counters, clock_ns)
        self.progress = Progress(
            self.outputs, self.endings, self.spec, self.kv, self.counters, clock_ns
        )
        self.clock_ns = clock_ns  # KV-tier timing (kv.persist_idle) runs on this clock too
        self._monotonic = monotonic
        self._tick = 0
        self._started_ns = clock_ns()

    def add(self, request: Request) -> None:
        """Queue a request (Admission.add: what it refuses, it raises)."""
        self.admission.add(request)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Replace every tenant's limits (SIGHUP reloaded the tokens file). They govern the
        next admission and the next add(): running requests keep their slots and queued ones
        their place, even where they now exceed a lowered max_concurrent or max_queued."""
        self.limits = dataclasses.replace(self.limits, tenants=dict(limits))
        self.admission.set_tenant_limits(limits)

    def cancel(
        self, request_id: str, tenant: str = "", *, deadline_exceeded: bool = False
    ) -> Emitted:
        """Drop a tenant's request now: a queued one leaves the queue, an active one frees its
        slot (its computed KV stays as prefix cache) and its sampler is closed in the next plan.
        `deadline_exceeded`: the caller left because its deadline passed, so the request ends
        with DeadlineExceeded and counts as such, not as cancelled."""
        key = request_key(tenant, request_id)
        error: errors.ServiceError = (
            errors.DeadlineExceeded("deadline exceeded")
            if deadline_exceeded
            else errors.Cancelled("cancelled")
        )
        request = self.admission.take(key) or self.slots.find(key)
        return self.endings.end_failed(request, error) if request is not None else []

    def idle_wait_s(self) -> float | None:
        """How long the idle engine may sleep before an idle session is due for the disk tier
        or a waiting request's deadline passes (None: until something arrives)."""
        due = self.kv.next_persist_ns()
        waits = [self._timer_s()]
        if due is not None:
            waits.append(max(0.0, (due - self.clock_ns()) / 1e9))
        return min((w for w in waits if w is not None), default=None)

    def _timer_s(self) -> float | None:
        """Seconds until the earliest deadline, time limit or reader stall of a request that
        waits for something other than the engine (a disk read, a slow reader), or None."""
        waiting = [*self.restoring.values(), *self.back_pressure.paused(self.slots)]
        if not waiting:
            return None
        stall_ns = self.back_pressure.stall_ns
        return expiry.timer_s(waiting, self._monotonic(), self.clock_ns(), stall_ns)

    def fail_all(self, error: errors.ServiceError) -> Emitted:
        """Fail everything queued or running (engine shutdown)."""
        out: Emitted = []
        for request in [*self.admission.take_all(), *self.slots.requests()]:
            out += self.endings.end_failed(request, error)
        return out

    def adapter_users(self, name: str) -> int:
        """Requests queued, waiting for the disk or running that apply the adapter `name`."""
        requests = [*self.queue, *self.restoring.values(), *self.slots.requests()]
        return sum(1 for r in requests if any(a.name == name for a in r.spec.adapters))

    @property
    def has_work(self) -> bool:
        """Whether a tick would do something now (a request waiting for the disk or for its
        reader is not work until the answer arrives, the reader reads or a timer is due)."""
        timer = self._timer_s()
        return bool(
            self.queue
            or self.kv.has_ops
            or self.endings.samplers_to_close
            or self.admission.has_disk_answers
            or (timer is not None and timer <= 0.0)
            or any(not self.back_pressure.behind(r) for r in self.slots.requests())
        )

    # -- schedule ---------------------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan | None, Emitted]:
        """Expire, admit, let the strategy split the budget; returns the plan (None if idle)."""
        self._tick += 1
        self.admission.take_disk_reads()
        events = self._expire()
        events += self._admit()
        self.kv.resolve_waits()
        self.kv.persist_idle(self.clock_ns())
        active = [
            r
            for r in self.slots.requests()
            if not r.is_blocked and not self.back_pressure.behind(r)
        ]
        chunks, is_embedding, adapters = self.passes.compose(active, self._tick, len(self.queue))
        plan = StepPlan(
            tick=self._tick,
            chunks=tuple(chunks),
            seq_ops=self.kv.take_ops(),
            open_samplers=self.starts.take_samplers(),
            close_samplers=self.endings.take_samplers(),
            is_embedding=is_embedding,
            adapters=adapters,
        )
        if not (plan.chunks or plan.seq_ops or plan.open_samplers or plan.close_samplers):
            return None, events
        computed = {r.slot_id: r.num_computed for r in self.slots.requests()}
        plan.check(self.limits.n_batch, self.limits.chunk_size, computed)
        return plan, events

    def _expire(self) -> Emitted:
        """End what expired (core.scheduling.expiry); skipped while no request has a deadline, a
        time limit or a stall bound."""
        if not (self.admission.timed or self.back_pressure.stall_ns):
            return []
        out: Emitted = []
        now, now_ns = self._monotonic(), self.clock_ns()
        for request, end in expiry.expired(
            self.admission, self.slots, self.back_pressure, now, now_ns
        ):
            if isinstance(end, FinishReason):
                out += self.endings.finish(request, end)
            else:
                out += self.endings.end_failed(request, end)
        return out

    def _admit(self) -> Emitted:
        """Fill idle slots from the queue (Admission.next picks, Admission.place places); a
        generation request's outputs open first (Starts.open), which may end a resumed one."""
        out: Emitted = []
        if not self.admission.is_open():
            return out
        while self.queue and self.slots.has_idle:
            request = self.admission.next()
            if request is None:
                return out  # every tenant with queued requests is at its max_concurrent
            if not request.spec.is_embedding and not self.outputs.is_open(request.key):
                events, has_ended = self.starts.open(request)
                out += events
                if has_ended:
                    continue
            if self.admission.place(request, self._tick) and request.num_preemptions == 0:
                self.starts.start(request)
        return out

    # -- update -----------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> Emitted:
        """Apply one tick's outcome; returns (request, event) pairs in order."""
        self.kv.apply(result)
        if result.status == DECODE_KV_FULL:
            return self._relieve_kv_pressure(plan)
        if result.status != DECODE_OK:
            return self.endings.fail_pass(plan, result.status)
        chunks = [c for c in plan.chunks if c.slot_id not in result.reset]
        self.passes.observe(plan, chunks, result)
        out: Emitted = []
        # an embedding pass's embedding chunks first, then the decode rows riding along
        embedded = [c for c in chunks if c.embedding is not None]
        for chunk in [*embedded, *(c for c in chunks if c.embedding is None)]:
            request = self.slots[chunk.slot_id].request
            if request is None or request.key != chunk.request_id:
                continue
            self.kv.computed(chunk)
            out += self.progress.apply(request, chunk, result)
        self.kv.num_used_cells()  # the tick's one count (GetStats reads it live: CellMap)
        return out

    def _relieve_kv_pressure(self, plan: StepPlan) -> Emitted:
        """llama_decode found no KV slot and restored memory. Drop an idle cache (of no live
        session first, least recently used first: prefix_cache.eviction_order); else preempt
        the youngest running request; fail a request only if it alone cannot fit.
        A tick with drafts is first retried without them: speculation never evicts a cache
        or preempts a request."""
        if plan.num_draft:
            self.drafts.pause()
            return []
        idle = [s for s in self.slots if s.is_idle and s.idle_cache]
        if idle:
            live_ns = self.admission.session_live_ns
            self.kv.drop_cache(prefix_cache.eviction_order(idle, self.clock_ns(), live_ns)[0])
            return []
        active = self.slots.requests()
        holding = [r for r in active if r.num_computed > 0]
        if len(active) > 1 and holding:
            self.preempt(max(holding, key=lambda r: r.arrival_ns))
            return []
        out: Emitted = []
        for request in active:
            error = errors.KvCacheFull(
                f"request needs {len(request.tokens)} + {plan.num_tokens} tokens of KV but the "
                f"cache ({self.limits.n_ctx} cells) cannot fit it",
                metadata={"tokens": str(len(request.tokens)), "n_ctx": str(self.limits.n_ctx)},
            )
            out += self.endings.end_failed(request, error)
        return out

    def preempt(self, request: Request) -> None:
        """Take a running request out of its slot under KV pressure: its KV is dropped and it
        waits at the head of the queue (Admission.requeue), to resume by re-prefilling."""
        self.kv.clear(self.slots.evict(request))
        self.admission.requeue(request)

    # -- observation ------------------------------------------------------------------------------

    def publish_kv_events(self, timestamp: float) -> None:
        """Hand the KV blocks each tier gained or lost since the last call, with the load, to
        the event log (SubscribeKvEvents); the engine thread calls it with each stats snapshot."""
        self.kv.sync_events()
        used = self.kv.num_used_cells()  # the tick's count, not another (CellMap)
        running = [s for s in self.slots if not s.is_idle]
        load = LoadRecord(
            running=len(running),
            waiting=len(self.queue),
            used_cells=used,
            total_cells=self.limits.n_ctx,
            max_running=self.limits.n_parallel,
            active_cells=min(used, sum(s.num_kv_tokens for s in running)),
        )
        self.kv.events.flush(load, timestamp)

    def snapshot(self, kv_cells_total: int) -> StatsSnapshot:
        return stats.snapshot(
            self.slots,
            len(self.queue) + len(self.restoring),
            self.counters,
            self.kv.num_used_cells(),
            kv_cells_total,
            self.passes.strategy.name,
            self.kv.ram,
            (self.clock_ns() - self._started_ns) / 1e9,
            self.kv.disk.stats() if self.kv.disk is not None else None,
        )

    # --- the engine's view (engine/loop*, engine/build.py) ---

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """What the disk tier's I/O thread calls when a read comes back: wake the engine thread."""
        self.admission.wakeup = wake

    def set_pass_prior(self, prior: PriorShape) -> None:
        """The llama.cpp build's shape of a pass's cost by its rows (core.speculation.policy)."""
        self.spec.costs.prior = prior

    def set_drafter(self, drafter: DraftSource | None, token_ms: float | None = None) -> None:
        """The draft model (--draft-model) the speculator drafts with, and a drafted token's
        first price (ms, measured at warm-up) before any draft pass teaches it."""
        self.spec.drafter = drafter
        if token_ms is not None:
            self.spec.draft_costs.calibrate(token_ms)

    @property
    def pass_costs(self) -> TickCostModel:
        """The speculator's cost model of a pass by its rows, which the warm-up times."""
        return self.spec.costs

    def check_fits(self, spec: GenerationRequest) -> None:
        """On the submitting thread: reject at once what can never fit (Admission.check_fits)."""
        self.admission.check_fits(spec)

    @property
    def num_changes(self) -> int:
        """Admissions, endings and preemptions so far: a published snapshot is stale once this
        moved."""
        return self.counters.num_changes

    def live_stats(self, published: StatsSnapshot) -> StatsSnapshot:
        """Any thread: `published` with the counters and KV cells in use as they are now, and the
        disk tier's figures (its I/O threads save, fail and read between ticks)."""
        snapshot = stats.live(published, self.counters, self.kv.cells.last_num_used)
        disk = self.kv.disk
        return dataclasses.replace(snapshot, disk_cache=disk.stats() if disk is not None else None)

    @property
    def kv_event_log(self) -> KvEventLog:
        return self.kv.events.log

    def persist_idle(self, *, everything: bool = False) -> bool:
        """Queue the disk tier's saves of idle caches due (of all, `everything`); True if any."""
        return self.kv.persist_idle(self.clock_ns(), everything=everything)

    def clear_idle_cache(self) -> CacheCleared:
        """Forget every idle slot's prefix cache and the RAM tier (KvCacheManager.clear_idle)."""
        return self.kv.clear_idle()
