"""Scheduler: the queue, the slots and the per-tick decisions. schedule() turns them into a
StepPlan, update() applies the runner's StepResult and returns the events to deliver. KV edits
belong to the KvCacheManager, counters and snapshots to core.stats, the token budget split to
the batch strategy, which queued request goes next to core.tenants. Only the engine thread
calls it. Pure Python: no llama_cpp, no grpc, no clock of its own."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llama_grpc_server import errors
from llama_grpc_server.core import context_fit, prefix_cache, stats
from llama_grpc_server.core.api import CacheCleared, StatsSnapshot
from llama_grpc_server.core.kv_events import KvEventLog, KvEventPublisher, LoadRecord
from llama_grpc_server.core.kv_manager import DiskTier, KvCacheManager, Loaded
from llama_grpc_server.core.outputs import Outputs
from llama_grpc_server.core.plan import (
    DECODE_KV_FULL,
    DECODE_OK,
    MAX_PAD_ROWS,
    Chunk,
    SampledLogprob,
    SamplerSpec,
    StepPlan,
    StepResult,
)
from llama_grpc_server.core.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Request,
    RequestState,
    SpeculativeConfig,
    SpeculativeMode,
    TokenDelta,
    request_key,
)
from llama_grpc_server.core.slot import Slot
from llama_grpc_server.core.spec_policy import MIN_GAIN
from llama_grpc_server.core.speculative import Speculator
from llama_grpc_server.core.strategies import (
    BatchStrategy,
    BatchView,
    DecodeMaximal,
    SlotView,
    TickCosts,
)
from llama_grpc_server.core.tenants import FairShare, TenantLimits

Emitted = list[tuple[Request, Event]]


def _nothing() -> None:
    """Scheduler.wakeup without an engine thread to wake (tests driving schedule() directly)."""


PAD_FROM_ROWS = 3  # one logits row takes llama.cpp's matrix-vector path: never padded
DRAFT_PAUSE_TICKS = 16  # ticks without drafts after drafts did not fit the KV cache


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """What the scheduler runs with, resolved against the loaded model (config.py's
    SchedulerSettings are what the operator asked for)."""

    n_parallel: int
    n_ctx: int
    n_batch: int
    chunk_size: int = 512
    max_queue: int = 64
    supports_partial_removal: bool = True
    ram_cache_bytes: int = 0  # 0 = no RAM tier
    ram_min_tokens: int = 64  # smaller caches are not worth saving
    session_idle_s: float = 0.0  # an idle session's cache goes to the disk tier after this
    session_live_s: float = 0.0  # a session's idle history is kept over others' this long (0: ever)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)  # others: TenantLimits()
    # Speculative decoding for requests that do not choose (core.speculative).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    pad_odd_ticks: bool = True  # _pad
    # the model's BOS when it adds one: KV events also announce each sequence without it, as a
    # router that leaves it out of its ids chunks them (core.kv_events.KvEventPublisher)
    kv_events_bos: int | None = None
    # Back-pressure (_behind): a request whose reader has this many tokens unread is not
    # planned until it reads (0 = unbounded); one that reads nothing for stalled_reader_s
    # meanwhile is ended with StalledReader (0 = never).
    stream_buffer_tokens: int = 0
    stalled_reader_s: float = 0.0


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
        self.strategy: BatchStrategy = strategy if strategy is not None else DecodeMaximal()
        self.slots = [Slot(i) for i in range(limits.n_parallel)]
        self.queue: deque[Request] = deque()  # in arrival order; fair_share picks from it
        self.fair_share = FairShare(limits.tenants, limits.n_parallel, clock_ns)
        self.counters = stats.Counters()
        self.costs = TickCosts()
        self.spec = Speculator(limits.speculative)
        self._draft_pause_ticks = 0  # > 0: recent drafts did not fit the KV cache
        self.kv = KvCacheManager(
            self.slots,
            count_cached=self._count_cached,
            supports_partial_removal=limits.supports_partial_removal,
            ram_cache_bytes=limits.ram_cache_bytes,
            ram_min_tokens=limits.ram_min_tokens,
            disk=disk,
            session_idle_ns=int(limits.session_idle_s * 1e9),
            events=KvEventPublisher(bos=limits.kv_events_bos),
        )
        self.outputs = Outputs(pieces, eog_ids, limits.n_ctx)
        self._clock_ns = clock_ns
        self._monotonic = monotonic
        self._samplers_to_open: list[SamplerSpec] = []
        self._samplers_to_close: list[str] = []
        self._tick = 0
        self._is_admission_paused = False
        self._started_ns = clock_ns()
        self._session_live_ns = int(limits.session_live_s * 1e9)
        self._stall_ns = int(limits.stalled_reader_s * 1e9)
        # Requests waiting for the disk tier's I/O thread (RESTORING), by key: they hold no
        # slot. Its answers arrive on that thread: _disk_done (with _disk_lock), then wakeup()
        # (the EngineLoop sets it to wake the engine thread).
        self.restoring: dict[str, Request] = {}
        self._disk_done: list[tuple[int, str, Loaded | None]] = []
        self._disk_lock = threading.Lock()
        self._disk_tickets = 0
        self.wakeup: Callable[[], None] = _nothing

    # -- intake ---------------------------------------------------------------------------------

    def check_fits(self, spec: GenerationRequest) -> None:
        """Reject at once what can never fit the context (the numbers are in the message)."""
        context_fit.check_fits(len(spec.prompt_tokens), spec.stopping.max_tokens, self.limits.n_ctx)

    def add(self, request: Request) -> None:
        """Queue a request. Raises PromptTooLong, or Overloaded when the queue or the tenant's
        part of it is full, without queueing it."""
        try:
            self.check_fits(request.spec)
            waiting = len(self.queue) - sum(1 for s in self.slots if s.is_idle)
            if self.limits.max_queue > 0 and waiting >= self.limits.max_queue:
                raise errors.Overloaded(
                    f"queue is full ({waiting} waiting, max_queue={self.limits.max_queue})",
                    retry_after_s=1.0,
                )
            self._check_tenant_queue(request.spec.tenant)
        except errors.ServiceError:
            self.counters.rejected += 1
            raise
        if request.arrival_ns == 0:
            request.arrival_ns = self._clock_ns()
        seed = request.spec.sampling.seed
        request.seed = seed if seed is not None else random.getrandbits(32)
        self.queue.append(request)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Replace every tenant's limits (SIGHUP reloaded the tokens file). They govern the
        next admission and the next add(): running requests keep their slots and queued ones
        their place, even where they now exceed a lowered max_concurrent or max_queued."""
        self.limits = dataclasses.replace(self.limits, tenants=dict(limits))
        self.fair_share.set_limits(limits)

    def _check_tenant_queue(self, tenant: str) -> None:
        limits = self.fair_share.limits(tenant)
        if limits.max_queued <= 0:
            return
        queued = sum(1 for r in self.queue if r.spec.tenant == tenant)
        idle = sum(1 for s in self.slots if s.is_idle)
        waiting = limits.num_waiting(queued, self._running()[tenant], idle)
        if waiting >= limits.max_queued:
            raise errors.Overloaded(
                f"tenant {tenant!r} has {waiting} requests waiting "
                f"(max_queued={limits.max_queued})",
                retry_after_s=1.0,
            )

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
        for request in self.queue:
            if request.key == key:
                self.queue.remove(request)
                return self._end_failed(request, error)
        for slot in self.slots:
            if slot.request is not None and slot.request.key == key:
                return self._end_failed(slot.request, error)
        restoring = self.restoring.pop(key, None)
        if restoring is not None:  # its read's answer, when it comes, is dropped
            return self._end_failed(restoring, error)
        return []

    def clear_cache(self) -> CacheCleared:
        """Forget the idle slots' prefix caches, the RAM tier and the disk tier (an admin's
        ClearCache)."""
        return self.kv.clear_idle()

    def idle_wait_s(self) -> float | None:
        """How long the idle engine may sleep before an idle session is due for the disk tier
        or a waiting request's deadline passes (None: until something arrives)."""
        due = self.kv.next_persist_ns()
        waits = [self._timer_s()]
        if due is not None:
            waits.append(max(0.0, (due - self._clock_ns()) / 1e9))
        return min((w for w in waits if w is not None), default=None)

    def _timer_s(self) -> float | None:
        """Seconds until the earliest deadline, time limit or reader stall of a request that
        waits for something other than the engine (a disk read, a slow reader), or None."""
        waiting = [*self.restoring.values(), *self._paused()]
        if not waiting:
            return None
        now, now_ns = self._monotonic(), self._clock_ns()
        waits = [r.spec.deadline - now for r in waiting if r.spec.deadline is not None]
        for request in waiting:
            limit_ms = request.spec.stopping.time_limit_ms
            if limit_ms is not None:
                waits.append((request.arrival_ns + limit_ms * 1_000_000 - now_ns) / 1e9)
            if request.paused_since_ns and self._stall_ns:
                waits.append((request.paused_since_ns + self._stall_ns - now_ns) / 1e9)
        return max(0.0, min(waits)) if waits else None

    # -- back-pressure ----------------------------------------------------------------------------

    def _behind(self, request: Request) -> bool:
        """Whether the request's reader has stream_buffer_tokens or more unread: then it is not
        planned (its KV stays; KV pressure may preempt it like any request) until the reader
        takes them, which wakes the engine (ReaderProgress.is_paused)."""
        reader, limit = request.reader, self.limits.stream_buffer_tokens
        if reader is None or limit <= 0:
            return False
        reader.is_paused = True  # first: a read after the comparison below sees it
        if request.num_sent - reader.num_read < limit:
            reader.is_paused = False
            request.paused_since_ns = 0
            return False
        if not request.paused_since_ns:
            request.paused_since_ns = self._clock_ns()
            self.counters.reader_pauses += 1
        return True

    def _paused(self) -> list[Request]:
        return [s.request for s in self.slots if s.request is not None and self._behind(s.request)]

    def _stalled(self, request: Request, now_ns: int) -> bool:
        return bool(
            self._stall_ns
            and self._behind(request)
            and now_ns - request.paused_since_ns >= self._stall_ns
        )

    def persist_idle(self, *, everything: bool = False) -> bool:
        """Queue the disk-tier saves that are due (all of them at shutdown); True if any (the
        next schedule() carries them)."""
        return self.kv.persist_idle(self._clock_ns(), everything=everything)

    def fail_all(self, error: errors.ServiceError) -> Emitted:
        """Fail everything queued or running (engine shutdown)."""
        out: Emitted = []
        while self.queue:
            out += self._end_failed(self.queue.popleft(), error)
        while self.restoring:
            out += self._end_failed(self.restoring.popitem()[1], error)
        for slot in self.slots:
            if slot.request is not None:
                out += self._end_failed(slot.request, error)
        return out

    @property
    def has_work(self) -> bool:
        """Whether a tick would do something now (a request waiting for the disk or for its
        reader is not work until the answer arrives, the reader reads or a timer is due)."""
        timer = self._timer_s()
        return bool(
            self.queue
            or self.kv.has_ops
            or self._samplers_to_close
            or self._disk_done
            or (timer is not None and timer <= 0.0)
            or any(s.request is not None and not self._behind(s.request) for s in self.slots)
        )

    # -- schedule ---------------------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan | None, Emitted]:
        """Expire, admit, let the strategy split the budget; returns the plan (None if idle)."""
        self._tick += 1
        self._take_disk_reads()
        events = self._expire()
        self._admit()
        self.kv.resolve_waits()
        self.kv.persist_idle(self._clock_ns())
        plan = StepPlan(
            tick=self._tick,
            chunks=tuple(self._chunks()),
            seq_ops=self.kv.take_ops(),
            open_samplers=tuple(self._samplers_to_open),
            close_samplers=tuple(self._samplers_to_close),
        )
        self._samplers_to_open, self._samplers_to_close = [], []
        if not (plan.chunks or plan.seq_ops or plan.open_samplers or plan.close_samplers):
            return None, events
        computed = {s.slot_id: s.request.num_computed for s in self.slots if s.request is not None}
        plan.check(self.limits.n_batch, self.limits.chunk_size, computed)
        return plan, events

    def _expire(self) -> Emitted:
        now, now_ns = self._monotonic(), self._clock_ns()
        out: Emitted = []
        for queued in [r for r in self.queue if r.deadline_passed(now)]:
            self.queue.remove(queued)
            out += self._end_failed(queued, errors.DeadlineExceeded("deadline passed in queue"))
        for request in [s.request for s in self.slots if s.request is not None]:
            if request.deadline_passed(now):
                out += self._end_failed(request, errors.DeadlineExceeded("deadline exceeded"))
            elif request.time_limit_passed(now_ns):
                out += self._finish(request, FinishReason.TIME_LIMIT)
            elif self._stalled(request, now_ns):
                self.counters.reader_stalls += 1
                unread = request.num_sent - (request.reader.num_read if request.reader else 0)
                stalled = errors.StalledReader(
                    f"the caller read nothing for {self.limits.stalled_reader_s:g} s with "
                    f"{unread} tokens waiting (--stalled-reader-s)",
                    metadata={"unread_tokens": str(unread)},
                )
                out += self._end_failed(request, stalled)
        for restoring in [r for r in self.restoring.values() if r.deadline_passed(now)]:
            del self.restoring[restoring.key]  # its read's answer, when it comes, is dropped
            error = errors.DeadlineExceeded(
                "deadline exceeded while reading the request's KV cache from the disk tier"
            )
            out += self._end_failed(restoring, error)
        return out

    # -- the disk tier's reads ----------------------------------------------------------------

    def _read_from_disk(self, request: Request, num_cached: int) -> bool:
        """Start a disk-tier read for a request being placed (kv.start_disk_read); True if it
        now waits for it (RESTORING, no slot held) instead of being placed."""
        self._disk_tickets += 1
        ticket, key = self._disk_tickets, request.key

        def done(loaded: Loaded | None) -> None:  # on the I/O thread
            with self._disk_lock:
                self._disk_done.append((ticket, key, loaded))
            self.wakeup()

        if not self.kv.start_disk_read(request, num_cached, done):
            return False
        request.disk_ticket = ticket
        request.state = RequestState.RESTORING
        self.restoring[key] = request
        return True

    def _take_disk_reads(self) -> None:
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

    def _admit(self) -> None:
        if self._is_admission_paused and any(s.request is not None for s in self.slots):
            return
        self._is_admission_paused = False
        while self.queue and any(s.is_idle for s in self.slots):
            request = self._next_queued()
            if request is None:
                return  # every tenant with queued requests is at its max_concurrent
            self._place(request)

    def _next_queued(self) -> Request | None:
        """A preempted request, or one back from a disk read, at the head keeps its place (it
        was admitted fairly once, and its tenant's count dropped when it left its slot); else
        the fair share picks."""
        if self.queue[0].num_preemptions or self.queue[0].disk_tried:
            return self.queue.popleft()
        sessions = {s.session_id for s in self.slots if s.is_idle and s.session_id}
        request = self.fair_share.pick(self.queue, self._running(), sessions)
        if request is not None:
            self.queue.remove(request)
        return request

    def _running(self) -> Counter[str]:
        """Requests in slots, by tenant."""
        return Counter(s.request.spec.tenant for s in self.slots if s.request is not None)

    def _place(self, request: Request) -> None:
        spec = request.spec
        placement = prefix_cache.place(
            self.slots,
            request.tokens,
            spec.cache_scope,
            spec.session_id,
            now_ns=self._clock_ns(),
            live_ns=self._session_live_ns,
        )
        if self._read_from_disk(request, placement.num_cached):
            return  # placed again when the read's answer arrives
        slot = self.slots[placement.slot_id]
        kept = self.kv.prepare(slot, request, placement)
        slot.request, slot.idle_cache, slot.persisted_tokens = request, [], 0
        slot.cache_scope, slot.session_id = spec.cache_scope, spec.session_id
        request.slot_id, request.num_computed = slot.slot_id, kept
        request.state = RequestState.PREFILLING
        request.last_served_tick = self._tick
        if request.num_preemptions == 0:
            request.admitted_ns = self._clock_ns()
            self.outputs.open(request)
            self._samplers_to_open.append(
                SamplerSpec(
                    request.key,
                    spec.sampling,
                    request.seed,
                    spec.output,
                    spec.constraint,
                    min_tokens=spec.stopping.min_tokens,
                    suppressed=self.outputs.suppressed_until_min_tokens(spec.stopping),
                )
            )
            self.counters.started += 1
            self.counters.prompt_tokens += request.num_prompt
        if request.restoring_tokens:
            return  # counted when the runner reports the restore
        if not (spec.cache_prompt and self.kv.wait_for_shared_prefix(request, slot)):
            self._count_cached(request, kept)

    def _count_cached(self, request: Request, num_cached: int) -> None:
        """Set a request's cached prompt tokens (a resumed preempted request counts no more)."""
        if request.num_preemptions == 0:
            self.counters.cached_prompt_tokens += num_cached - request.num_cached_prompt
            request.num_cached_prompt = num_cached

    def _chunks(self) -> list[Chunk]:
        active = [
            r
            for s in self.slots
            if (r := s.request) is not None and not r.is_blocked and not self._behind(r)
        ]
        if not active:
            return []
        view = BatchView(
            tick=self._tick,
            budget=self.limits.n_batch,
            chunk_size=self.limits.chunk_size,
            queue_depth=len(self.queue),
            slots=tuple(
                SlotView(r.slot_id, r.num_pending, r.is_decoding, r.last_served_tick)
                for r in active
            ),
            prefill_allowance=self.costs.prefill_allowance(self.limits.chunk_size),
        )
        allocation = self.strategy.allocate(view)
        chunks: list[Chunk] = []
        for request in active:
            n = allocation.get(request.slot_id, 0)
            if n <= 0:
                continue
            start = request.num_computed
            end = start + min(n, request.num_pending)
            chunks.append(
                Chunk(
                    slot_id=request.slot_id,
                    request_id=request.key,
                    start_pos=start,
                    tokens=tuple(request.tokens[start:end]),
                    wants_logits=end == len(request.tokens),
                )
            )
            request.last_served_tick = self._tick
        return self._add_drafts(chunks)

    def _add_drafts(self, chunks: list[Chunk]) -> list[Chunk]:
        """Speculative decoding: decode chunks of speculating requests take their drafts, as
        far as the batch and the free KV cells have room (a draft never preempts anyone); then
        an odd decode-only tick may take a pad."""
        if self._draft_pause_ticks > 0:
            self._draft_pause_ticks -= 1
            return chunks
        return self._pad(self._speculate(chunks))

    def _speculate(self, chunks: list[Chunk]) -> list[Chunk]:
        requests = [
            r
            for c in chunks
            if c.is_decode
            and (r := self.slots[c.slot_id].request) is not None
            and self.spec.mode(r) is not SpeculativeMode.OFF
        ]
        if not requests:
            return chunks
        used = sum(len(c.tokens) for c in chunks)
        free_cells = self.limits.n_ctx - self.kv.num_used_cells() - used
        room = min(self.limits.n_batch - used, free_cells)
        if room <= 0:
            return chunks
        num_decode = sum(1 for c in chunks if c.is_decode)
        drafts = self.spec.propose(
            requests,
            num_rows=num_decode,
            room=room,
            n_ctx=self.limits.n_ctx,
            has_prefill=num_decode < len(chunks),
        )
        drafts = self._within_buffers(drafts)
        return [
            dataclasses.replace(
                c, tokens=c.tokens + drafts[c.slot_id], num_draft=len(drafts[c.slot_id])
            )
            if drafts.get(c.slot_id)
            else c
            for c in chunks
        ]

    def _within_buffers(self, drafts: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """Drafts cut so that a request accepting all of them still has no more than
        stream_buffer_tokens unread."""
        limit = self.limits.stream_buffer_tokens
        if limit <= 0:
            return drafts
        for slot_id, draft in drafts.items():
            request = self.slots[slot_id].request
            if request is not None and request.reader is not None:
                room = limit - (request.num_sent - request.reader.num_read) - 1
                drafts[slot_id] = draft[: max(0, room)]
        return drafts

    def _pad(self, chunks: list[Chunk]) -> list[Chunk]:
        """Up to MAX_PAD_ROWS rows more where the measured costs say they make a decode-only
        tick cheaper by MIN_GAIN: llama.cpp's tiled CPU matmul of the output layer makes some
        row counts dearer than a larger one (x86-64-v3 build: 3 rows 42.8 ms, 4 rows 34.6;
        AVX-512 build: 6 rows 54.4 ms, 8 rows 47.5; core.spec_policy). The pad repeats a plain
        decode's token at the next positions; its logits are never sampled and its KV cells
        are removed after the pass, like a rejected draft's (causal attention: no other row
        sees them). Requests of every speculative mode, OFF included: nothing is drafted."""
        if not self.limits.pad_odd_ticks or not chunks or not all(c.is_decode for c in chunks):
            return chunks
        rows = sum(c.num_outputs for c in chunks)
        now = self.spec.costs.tick_ms(rows) if rows >= PAD_FROM_ROWS else None
        if now is None:
            return chunks
        best, best_ms = 0, now / MIN_GAIN
        for k in range(1, MAX_PAD_ROWS + 1):
            ms = self.spec.costs.tick_ms(rows + k)
            if ms is not None and ms < best_ms:
                best, best_ms = k, ms
        if not best:
            return chunks
        used = sum(len(c.tokens) for c in chunks)
        free = self.limits.n_ctx - self.kv.num_used_cells()
        if used + best > self.limits.n_batch or free < used + best:
            return chunks
        for i, chunk in enumerate(chunks):
            if not chunk.num_draft and chunk.start_pos + 1 + best <= self.limits.n_ctx:
                padded_chunk = dataclasses.replace(
                    chunk,
                    tokens=chunk.tokens + chunk.tokens[-1:] * best,
                    num_draft=best,
                    is_pad=True,
                )
                self.counters.pad_rows += best
                return [*chunks[:i], padded_chunk, *chunks[i + 1 :]]
        return chunks

    # -- update -----------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> Emitted:
        """Apply one tick's outcome; returns (request, event) pairs in order."""
        self.kv.apply(result)
        if result.status == DECODE_KV_FULL:
            return self._relieve_kv_pressure(plan)
        if result.status != DECODE_OK:
            return self._fail_batch(plan, result.status)
        chunks = [c for c in plan.chunks if c.slot_id not in result.reset]
        if chunks:  # a plan of KV edits only is no forward pass
            self._observe_tick(chunks, result)
        out: Emitted = []
        for chunk in chunks:
            request = self.slots[chunk.slot_id].request
            if request is None or request.key != chunk.request_id:
                continue
            self.kv.computed(chunk)
            if chunk.num_draft:
                out += self._accept_draft(request, chunk, result)
                continue
            request.num_computed += len(chunk.tokens)
            if chunk.wants_logits and chunk.slot_id in result.failed:
                out += self._fail_constraint(request, result.failed[chunk.slot_id])
            elif chunk.wants_logits:
                logprob = result.logprobs.get(chunk.slot_id)
                out += self._accept(request, result.sampled[chunk.slot_id], logprob)
                self.spec.observe_tokens(request)
        return out

    def _observe_tick(self, chunks: Sequence[Chunk], result: StepResult) -> None:
        """Counters and the measured costs of a forward pass (decode-only ticks, with or
        without drafts, teach the speculation cost model)."""
        num_decode = sum(1 for c in chunks if c.is_decode)
        num_draft = sum(c.num_draft for c in chunks)  # rows: pads included
        num_tokens = sum(len(c.tokens) for c in chunks)
        num_prefill = num_tokens - num_decode - num_draft
        if num_draft == 0:
            self.costs.observe(num_decode, num_prefill, result.eval_ms)
        if num_prefill == 0:
            self.spec.costs.observe(num_decode + num_draft, result.eval_ms)
        self.counters.ticks += 1
        self.counters.batch_tokens += num_tokens
        self.counters.decode_ms += result.eval_ms
        self.counters.decode_cpu_ms += result.eval_cpu_ms
        num_spec = num_draft - sum(c.num_pad for c in chunks)
        if num_spec:
            self.counters.spec_ticks += 1
            self.counters.spec_draft_tokens += num_spec

    def _accept_draft(self, request: Request, chunk: Chunk, result: StepResult) -> Emitted:
        """A speculative decode: the sampled tokens go one by one through the normal accept
        path (stop strings, stop tokens, limits and logprobs per token; what follows a finish
        is dropped), the KV of every token after the last one kept is discarded."""
        tokens = result.tokens_of(chunk.slot_id)
        logprobs = result.logprobs_of(chunk.slot_id)
        num_accepted = chunk.num_accepted(tokens)
        if not chunk.is_pad:
            self.spec.verified(request, chunk.num_draft, num_accepted)
            request.num_draft_tokens += chunk.num_draft
        request.num_computed = chunk.start_pos + 1
        out: Emitted = []
        for i, token in enumerate(tokens):
            request.num_computed = chunk.start_pos + 1 + i  # the tokens fed before this one
            if i < num_accepted:
                request.num_accepted_draft += 1
                self.counters.spec_accepted_tokens += 1
            out += self._accept(request, token, logprobs[i])
            if request.state is RequestState.FINISHED:
                break
        if request.state is not RequestState.FINISHED:
            if chunk.slot_id in result.failed or not tokens:
                out += self._fail_constraint(request, result.failed[chunk.slot_id])
            else:
                self.spec.observe_tokens(request)
        if request.num_computed < chunk.start_pos + len(chunk.tokens):
            self.kv.discard_tail(self.slots[chunk.slot_id], request.num_computed)
        return out

    def _fail_constraint(self, request: Request, why: str) -> Emitted:
        """The runner found no token the request's constraint allows: end it with the reason."""
        constraint = request.spec.constraint
        error = errors.InvalidRequest(
            f"{why} (after {request.num_output} generated tokens)",
            field=constraint.field if constraint is not None else None,
        )
        return self._end_failed(request, error)

    def _accept(self, request: Request, token: int, logprob: SampledLogprob | None) -> Emitted:
        now_ns = self._clock_ns()
        if request.first_token_ns == 0:
            request.first_token_ns = now_ns
        request.state = RequestState.GENERATING
        verdict = self.outputs.judge(request, token, logprob)
        out: Emitted = []
        if verdict.delta is not None:
            self.counters.generated_tokens += 1
            request.num_sent += len(verdict.delta.token_ids)
            out.append((request, verdict.delta))
        reason = verdict.reason
        if reason is None and request.time_limit_passed(now_ns):
            reason = FinishReason.TIME_LIMIT
        if reason is not None:
            out += self._finish(
                request,
                reason,
                matched_stop=verdict.matched_stop,
                matched_token_id=verdict.matched_token_id,
            )
        return out

    # -- endings ----------------------------------------------------------------------------------

    def _release(self, request: Request, *, keep_cache: bool) -> None:
        """Free the request's slot; its computed KV stays as prefix cache when allowed."""
        if request.slot_id >= 0:
            slot = self.slots[request.slot_id]
            if slot.request is request:
                slot.request = None
                slot.last_used_ns = self._clock_ns()
                if keep_cache and request.spec.cache_prompt:
                    slot.idle_cache = request.tokens[: request.num_computed]
                else:
                    slot.idle_cache = []
                    self.kv.clear(slot)
        if self.outputs.close(request.key):
            self._samplers_to_close.append(request.key)
        self.spec.forget(request.key)
        request.state = RequestState.FINISHED
        self._is_admission_paused = False

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        matched_stop: str = "",
        matched_token_id: int | None = None,
    ) -> Emitted:
        out: Emitted = []
        if reason is not FinishReason.STOP_SEQUENCE:
            tail = self.outputs.flush(request.key)
            if tail:
                out.append((request, TokenDelta((), tail)))
        slot_id = request.slot_id
        self._release(request, keep_cache=True)
        now_ns = self._clock_ns()
        self.counters.finished += 1
        self.counters.finish_reasons[reason.value] = (
            self.counters.finish_reasons.get(reason.value, 0) + 1
        )
        done = Finished(
            reason=reason,
            usage=request.usage(),
            timings=request.timings(now_ns),
            seed=request.seed,
            matched_stop=matched_stop,
            matched_token_id=matched_token_id,
            slot_id=slot_id,
        )
        return [*out, (request, done)]

    def _end_failed(self, request: Request, error: errors.ServiceError) -> Emitted:
        """End a request with `error`, counted as cancelled, deadline exceeded or failed."""
        self._release(request, keep_cache=not isinstance(error, errors.EngineError))
        if isinstance(error, errors.Cancelled):
            self.counters.cancelled += 1
        elif isinstance(error, errors.DeadlineExceeded):
            self.counters.deadline_exceeded += 1
        else:
            self.counters.failed += 1
        return [(request, Failed(error))]

    def _fail_batch(self, plan: StepPlan, status: int) -> Emitted:
        """A decode error fails only the requests of that batch; their KV is dropped."""
        out: Emitted = []
        for chunk in plan.chunks:
            request = self.slots[chunk.slot_id].request
            if request is not None:
                error = errors.EngineError(f"llama_decode failed with status {status}")
                out += self._end_failed(request, error)
        return out

    def _relieve_kv_pressure(self, plan: StepPlan) -> Emitted:
        """llama_decode found no KV slot and restored memory. Drop an idle cache (of no live
        session first, least recently used first: prefix_cache.eviction_order); else preempt
        the youngest running request; fail a request only if it alone cannot fit.
        A tick with drafts is first retried without them: speculation never evicts a cache
        or preempts a request."""
        if plan.num_draft:
            self._draft_pause_ticks = DRAFT_PAUSE_TICKS
            return []
        idle = [s for s in self.slots if s.is_idle and s.idle_cache]
        if idle:
            self.kv.drop_cache(
                prefix_cache.eviction_order(idle, self._clock_ns(), self._session_live_ns)[0]
            )
            return []
        active = [s.request for s in self.slots if s.request is not None]
        holding = [r for r in active if r.num_computed > 0]
        if len(active) > 1 and holding:
            self._preempt(max(holding, key=lambda r: r.arrival_ns))
            return []
        out: Emitted = []
        for request in active:
            error = errors.KvCacheFull(
                f"request needs {len(request.tokens)} + {plan.num_tokens} tokens of KV but the "
                f"cache ({self.limits.n_ctx} cells) cannot fit it",
                metadata={"tokens": str(len(request.tokens)), "n_ctx": str(self.limits.n_ctx)},
            )
            out += self._end_failed(request, error)
        return out

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV and put it back at the head of the queue; it resumes by
        re-prefilling prompt + output so far (its sampler and text state are kept)."""
        slot = self.slots[request.slot_id]
        slot.request, slot.idle_cache = None, []
        self.kv.clear(slot)
        request.num_computed = 0
        request.slot_id = -1
        request.state = RequestState.QUEUED
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.queue.appendleft(request)
        self._is_admission_paused = True

    # -- observation ------------------------------------------------------------------------------

    @property
    def kv_events(self) -> KvEventLog:
        return self.kv.events.log

    def load_record(self) -> LoadRecord:
        return LoadRecord(
            running=sum(1 for s in self.slots if s.request is not None),
            waiting=len(self.queue),
            used_cells=self.kv.num_used_cells(),
            total_cells=self.limits.n_ctx,
            max_running=self.limits.n_parallel,
        )

    def publish_kv_events(self, timestamp: float) -> None:
        """Hand the KV blocks each tier gained or lost since the last call, with the load, to
        the event log (SubscribeKvEvents); the engine thread calls it with each stats snapshot."""
        self.kv.sync_events()
        self.kv.events.flush(self.load_record(), timestamp)

    @property
    def ram(self) -> prefix_cache.RamTier | None:
        return self.kv.ram

    def snapshot(self, kv_cells_total: int) -> StatsSnapshot:
        return stats.snapshot(
            self.slots,
            len(self.queue) + len(self.restoring),
            self.counters,
            self.kv.num_used_cells(),
            kv_cells_total,
            self.strategy.name,
            self.kv.ram,
            (self._clock_ns() - self._started_ns) / 1e9,
            self.kv.disk.stats() if self.kv.disk is not None else None,
        )
