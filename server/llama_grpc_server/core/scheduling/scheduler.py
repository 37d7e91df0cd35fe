"""Scheduler: the queue, the slots and the per-tick decisions, in that order: admission
(core.scheduling.admission) fills free slots from the queue, schedule() turns the slots into a
StepPlan (the batch strategy splits the token budget, core.speculation.drafts adds drafts and pads),
update() applies the runner's StepResult and returns the events to deliver. KV edits belong to the
KvCacheManager (callers reach it as .kv), counters and snapshots to core.stats, slow readers to
core.scheduling.backpressure. Only the engine thread calls it. Pure Python: no llama_cpp, no grpc,
no clock of its own."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from llama_grpc_server import errors
from llama_grpc_server.core import stats
from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.api import CacheCleared, StatsSnapshot
from llama_grpc_server.core.kv import prefix_cache
from llama_grpc_server.core.kv.events import KvEventLog, KvEventPublisher, LoadRecord
from llama_grpc_server.core.kv.manager import DiskTier, KvCacheManager
from llama_grpc_server.core.requests import embedding
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import (
    Event,
    FinishReason,
    GenerationRequest,
    Request,
    RequestState,
    Resumed,
    request_key,
)
from llama_grpc_server.core.scheduling import expiry
from llama_grpc_server.core.scheduling.admission import Admission
from llama_grpc_server.core.scheduling.backpressure import BackPressure
from llama_grpc_server.core.scheduling.endings import Endings
from llama_grpc_server.core.scheduling.limits import SchedulerLimits
from llama_grpc_server.core.scheduling.plan import (
    DECODE_KV_FULL,
    DECODE_OK,
    Chunk,
    SampledLogprob,
    SamplerSpec,
    StepPlan,
    StepResult,
)
from llama_grpc_server.core.scheduling.slot import Slot
from llama_grpc_server.core.scheduling.strategies import (
    BatchStrategy,
    BatchView,
    DecodeMaximal,
    SlotView,
    TickCosts,
)
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.core.speculation.drafts import DraftLimits, Drafts
from llama_grpc_server.core.speculation.policy import PriorShape
from llama_grpc_server.core.speculation.speculator import Speculator

Emitted = list[tuple[Request, Event]]
__all__ = [
    "Emitted",
    "Scheduler",
    "SchedulerLimits",
]  # SchedulerLimits lives in core.scheduling.limits


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
        self.counters = stats.Counters()
        self.costs = TickCosts()
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
        self.back_pressure = BackPressure(
            limits.stream_buffer_tokens, limits.stalled_reader_s, self.counters, clock_ns
        )
        self.outputs = Outputs(pieces, eog_ids, limits.n_ctx)
        self.endings = Endings(
            self.slots, self.kv, self.outputs, self.drafts, self.admission, self.counters, clock_ns
        )
        self.clock_ns = clock_ns  # KV-tier timing (kv.persist_idle) runs on this clock too
        self._monotonic = monotonic
        self._samplers_to_open: list[SamplerSpec] = []
        self._tick = 0
        self._last_pass_embedded = False  # while a generation prompt waits, the passes alternate
        # LoRA adapter sets take turns (_adapter_turn): the tick each set last had a pass, and
        # the set of the last forward pass (a change is a switch, counted).
        self._set_served: dict[AdapterSet, int] = {}
        self._last_adapters: AdapterSet = ()
        self.embedding_costs = embedding.PassCosts()
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
        request = self.admission.take(key) or next(
            (s.request for s in self.slots if s.request is not None and s.request.key == key), None
        )
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
        for request in [*self.admission.take_all(), *(s.request for s in self.slots)]:
            if request is not None:
                out += self.endings.end_failed(request, error)
        return out

    def adapter_users(self, name: str) -> int:
        """Requests queued, waiting for the disk or running that apply the adapter `name`."""
        requests = [*self.queue, *self.restoring.values(), *(s.request for s in self.slots)]
        return sum(
            1 for r in requests if r is not None and any(a.name == name for a in r.spec.adapters)
        )

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
            or any(
                s.request is not None and not self.back_pressure.behind(s.request)
                for s in self.slots
            )
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
        chunks, is_embedding, adapters = self._chunks()
        plan = StepPlan(
            tick=self._tick,
            chunks=tuple(chunks),
            seq_ops=self.kv.take_ops(),
            open_samplers=tuple(self._samplers_to_open),
            close_samplers=tuple(self.endings.samplers_to_close),
            is_embedding=is_embedding,
            adapters=adapters,
        )
        self._samplers_to_open, self.endings.samplers_to_close = [], []
        if not (plan.chunks or plan.seq_ops or plan.open_samplers or plan.close_samplers):
            return None, events
        computed = {s.slot_id: s.request.num_computed for s in self.slots if s.request is not None}
        plan.check(self.limits.n_batch, self.limits.chunk_size, computed)
        return plan, events

    def _expire(self) -> Emitted:
        """End what expired (core.scheduling.expiry); skipped while no request has a deadline, a
        time limit or a stall bound."""
        if not (self.admission.timed or self.back_pressure.stall_ns):
            return []
        out: Emitted = []
        now, now_ns = self._monotonic(), self.clock_ns()
        q, slots, restoring, bp = self.queue, self.slots, self.restoring, self.back_pressure
        for request, end in expiry.expired(q, slots, restoring, bp, now, now_ns):
            if isinstance(end, FinishReason):
                out += self.endings.finish(request, end)
            else:
                out += self.endings.end_failed(request, end)
        return out

    def _admit(self) -> Emitted:
        out: Emitted = []
        if self.admission.is_paused and any(s.request is not None for s in self.slots):
            return out
        self.admission.is_paused = False
        while self.queue and any(s.is_idle for s in self.slots):
            request = self.admission.next()
            if request is None:
                return out  # every tenant with queued requests is at its max_concurrent
            if not request.spec.is_embedding and not self.outputs.is_open(request.key):
                events, has_ended = self._open(request)
                out += events
                if has_ended:
                    continue
            if self.admission.place(request, self._tick) and request.num_preemptions == 0:
                self._start(request)
        return out

    def _open(self, request: Request) -> tuple[Emitted, bool]:
        """A generation request's outputs and sampler, before its first placement; a resumed
        one's tokens replayed (Outputs.replay, then its Resumed event). True when that ends it
        already, with no sampler opened and no token computed: its resumed tokens end the
        answer (finished at once), or run past its end (InvalidRequest)."""
        sampler = self.outputs.open(request)
        if not request.spec.resumed:
            self._samplers_to_open.append(sampler)
            return [], False
        try:
            replay = self.outputs.replay(request)
        except errors.ServiceError as exc:
            self._count_start(request)
            self.outputs.close(request.key)  # no sampler to close either
            return self.endings.end_failed(request, exc), True
        events: Emitted = [(request, Resumed(replay.text))]
        if replay.reason is None:
            self._samplers_to_open.append(sampler)
            return events, False
        self._count_start(request)
        # (the finish asks the runner to close a sampler it never opened: a no-op there)
        events += self.endings.finish(
            request,
            replay.reason,
            matched_stop=replay.matched_stop,
            matched_token_id=replay.matched_token_id,
        )
        return events, True

    def _start(self, request: Request) -> None:
        """A request's first placement: its speculation (none for an embedding request: it
        samples nothing), its counts."""
        if not request.spec.is_embedding:
            self.drafts.admitted(request)
        self._count_start(request)

    def _count_start(self, request: Request) -> None:
        request.admitted_ns = self.clock_ns()
        self.counters.started += 1
        self.counters.prompt_tokens += request.num_prompt
        self.counters.count_adapters(request.spec.adapters, requests=1)

    def _chunks(self) -> tuple[list[Chunk], bool, AdapterSet]:
        """The tick's chunks, whether they make an embedding pass, and the pass's adapter set
        (_adapter_turn; an embedding pass runs the base model). llama.cpp turns
        embeddings on for a whole pass, and then computes every token's logits too: so an
        embedding pass carries the embedding requests' tokens and the decoding requests' rows
        (sampled from those logits), never a generation prompt chunk (its every token's logits
        would be paid for). While generation prompts wait, embedding and generation passes
        alternate; otherwise every pass is an embedding pass while embeddings wait, its
        embedding tokens costing the streams about half a decode tick (core.requests.embedding)."""
        active = [
            r
            for s in self.slots
            if (r := s.request) is not None
            and not r.is_blocked
            and not self.back_pressure.behind(r)
        ]
        embedding_requests = [r for r in active if r.spec.is_embedding]
        active = [r for r in active if not r.spec.is_embedding]
        # adapter streams cannot ride in an embedding pass (the base model's): they alternate
        is_waiting = any(not r.is_decoding or r.spec.adapters for r in active)
        if not embedding_requests or (is_waiting and self._last_pass_embedded):
            self._last_pass_embedded = False
            turn, adapters = self._adapter_turn(active)
            return self._generation_chunks(turn), False, adapters
        self._last_pass_embedded = True
        decoding = [r for r in active if r.is_decoding and not r.spec.adapters]
        for request in decoding:
            request.last_served_tick = self._tick
        rows = [
            Chunk(r.slot_id, r.key, r.num_computed, (r.tokens[r.num_computed],), True)
            for r in decoding
        ]
        embedding_chunks = self._embedding_chunks(embedding_requests, is_generating=bool(active))
        return rows + embedding_chunks, True, ()

    def _adapter_turn(self, active: list[Request]) -> tuple[list[Request], AdapterSet]:
        """The requests this pass serves and their LoRA adapter set. llama.cpp applies adapters
        to the whole context, so a pass runs one set: with several sets running, the set whose
        last pass is oldest goes next (never served first; then the set of the earliest
        arrival), so the sets take strict turns and none starves. A request's set is fixed, so
        its answer never changes adapters midway."""
        earliest: dict[AdapterSet, int] = {}
        for r in active:
            earliest[r.spec.adapters] = min(
                earliest.get(r.spec.adapters, r.arrival_ns), r.arrival_ns
            )
        sets = set(earliest)
        if len(sets) <= 1:
            chosen = next(iter(sets), ())
        else:
            chosen = min(sets, key=lambda a: (self._set_served.get(a, -1), earliest[a]))
            active = [r for r in active if r.spec.adapters == chosen]
        if active:
            self._set_served[chosen] = self._tick
            for gone in [a for a in self._set_served if a not in sets]:
                del self._set_served[gone]
        return active, chosen

    def _embedding_chunks(self, requests: list[Request], *, is_generating: bool) -> list[Chunk]:
        """Prompt tokens of embedding requests, least recently served first, within the
        pass's budget (core.requests.embedding.PassCosts: while generation requests run, what costs
        their streams half a decode tick); no logits asked: the runner reads every token's
        output."""
        requests.sort(key=lambda r: r.last_served_tick)
        pending = [(r.slot_id, r.num_pending) for r in requests]
        if self.limits.encoder:
            allocation = embedding.share_whole(pending, self.limits.n_batch)
        else:
            costs, decode_ms = self.embedding_costs, self.costs.decode_tick_ms
            budget = costs.budget(decode_ms, is_generating=is_generating)
            allocation = embedding.share_pass(pending, budget, self.limits.chunk_size)
        chunks: list[Chunk] = []
        for request in requests:
            n = allocation.get(request.slot_id, 0)
            if n <= 0:
                continue
            start = request.num_computed
            tokens = tuple(request.tokens[start : start + n])
            chunks.append(
                Chunk(
                    request.slot_id,
                    request.key,
                    start,
                    tokens,
                    wants_logits=False,
                    embedding=request.spec.embedding,
                    num_input=request.num_prompt,
                )
            )
            request.last_served_tick = self._tick
        return chunks

    def _generation_chunks(self, active: list[Request]) -> list[Chunk]:
        if not active:
            return []
        view = BatchView(
            tick=self._tick,
            budget=self.limits.n_batch,
            chunk_size=self.limits.chunk_size,
            queue_depth=len(self.queue),
            slots=tuple(
                SlotView(r.slot_id, r.num_pending, r.is_decoding, r.last_served_tick, r.arrival_ns)
                for r in active
            ),
            prefill_allowance=self.costs.prefill_allowance(
                self.limits.chunk_size, self.limits.prefill_stall
            ),
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
        return self.drafts.add(chunks)

    # -- update -----------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> Emitted:
        """Apply one tick's outcome; returns (request, event) pairs in order."""
        self.kv.apply(result)
        if result.status == DECODE_KV_FULL:
            return self._relieve_kv_pressure(plan)
        if result.status != DECODE_OK and plan.is_embedding:
            return self._fail_embedding_pass(plan, result.status)
        if result.status != DECODE_OK:
            return self._fail_batch(plan, result.status)
        chunks = [c for c in plan.chunks if c.slot_id not in result.reset]
        out: Emitted = []
        if plan.is_embedding:
            out += self._update_embedding(chunks, result)
            chunks = [c for c in chunks if c.embedding is None]  # the decode rows riding along
        elif chunks:  # a plan of KV edits only is no forward pass
            self._observe_tick(chunks, result)
        if chunks:
            self._observe_adapters(plan.adapters)
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
                out += self._fail_sample(request, chunk.slot_id, result)
            elif chunk.wants_logits:
                logprob = result.logprobs.get(chunk.slot_id)
                out += self._accept(request, result.sampled[chunk.slot_id], logprob)
                self.spec.observe_tokens(request)
        self.kv.num_used_cells()  # the tick's one count (GetStats reads it live: CellMap)
        return out

    def _update_embedding(self, chunks: Sequence[Chunk], result: StepResult) -> Emitted:
        """An embedding pass's embedding chunks: a request whose last input token was fed ends
        with the vectors the runner pooled (its slot's KV is cleared: embedding requests leave
        no prefix cache). The pass is counted, and teaches the embedding cost (not the prefill
        or decode costs: it computes every token's logits): its time less a decode tick's when
        decode rows rode along."""
        num_tokens = sum(len(c.tokens) for c in chunks)
        num_embedding = sum(len(c.tokens) for c in chunks if c.embedding is not None)
        if chunks:
            self.counters.count_pass(num_tokens, 0, result.eval_ms, result.eval_cpu_ms)
            if num_embedding == num_tokens:
                self.embedding_costs.observe(num_embedding, result.eval_ms)
            elif self.costs.decode_tick_ms > 0:
                marginal_ms = result.eval_ms - self.costs.decode_tick_ms
                self.embedding_costs.observe(num_embedding, marginal_ms, is_marginal=True)
        out: Emitted = []
        for chunk in chunks:
            request = self.slots[chunk.slot_id].request
            if chunk.embedding is None or request is None or request.key != chunk.request_id:
                continue
            self.kv.computed(chunk)
            request.num_computed += len(chunk.tokens)
            if request.num_pending == 0:
                request.first_token_ns = self.clock_ns()
                vectors = result.embeddings[chunk.slot_id]
                out += self.endings.finish(request, FinishReason.EMBEDDED, embedding=vectors)
        self.kv.num_used_cells()
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
        num_spec = num_draft - sum(c.num_pad for c in chunks)
        self.counters.count_pass(num_tokens, num_spec, result.eval_ms, result.eval_cpu_ms)

    def _observe_adapters(self, adapters: AdapterSet) -> None:
        """A forward pass of this adapter set: counted per adapter, and as a switch when the
        pass before ran another set."""
        self.counters.count_adapters(adapters, passes=1)
        if adapters != self._last_adapters:
            self.counters.adapter_switches += 1
            self._last_adapters = adapters

    def _accept_draft(self, request: Request, chunk: Chunk, result: StepResult) -> Emitted:
        """A speculative decode: the sampled tokens go one by one through the normal accept
        path (stop strings, stop tokens, limits and logprobs per token; what follows a finish
        is dropped), the KV of every token after the last one kept is discarded."""
        tokens = result.tokens_of(chunk.slot_id)
        logprobs = result.logprobs_of(chunk.slot_id)
        num_accepted = chunk.num_accepted(tokens)
        if not chunk.is_pad:
            if self.spec.verified(request, chunk.num_draft, num_accepted):
                self.counters.spec_model_draft_tokens += chunk.num_draft
                self.counters.spec_model_accepted_tokens += num_accepted
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
                out += self._fail_sample(request, chunk.slot_id, result)
            else:
                self.spec.observe_tokens(request)
        if request.num_computed < chunk.start_pos + len(chunk.tokens):
            self.kv.discard_tail(self.slots[chunk.slot_id], request.num_computed)
        return out

    def _fail_sample(self, request: Request, slot_id: int, result: StepResult) -> Emitted:
        """The runner sampled nothing for the request: its constraint allows no token (or
        refused one of its resumed tokens)."""
        field = result.failed_field.get(slot_id)
        return self.endings.fail_constraint(request, result.failed[slot_id], field=field)

    def _accept(self, request: Request, token: int, logprob: SampledLogprob | None) -> Emitted:
        now_ns = self.clock_ns()
        if request.first_token_ns == 0:
            request.first_token_ns = now_ns
        request.state = RequestState.GENERATING
        verdict = self.outputs.judge(request, token, logprob)
        out: Emitted = []
        if verdict.delta is not None:
            self.counters.generated_tokens += 1
            if request.spec.adapters:
                self.counters.count_adapters(request.spec.adapters, tokens=1)
            request.num_sent += len(verdict.delta.token_ids)
            out.append((request, verdict.delta))
        reason = verdict.reason
        if reason is None and request.time_limit_passed(now_ns):
            reason = FinishReason.TIME_LIMIT
        if reason is not None:
            out += self.endings.finish(
                request,
                reason,
                matched_stop=verdict.matched_stop,
                matched_token_id=verdict.matched_token_id,
            )
        return out

    def _fail_batch(self, plan: StepPlan, status: int) -> Emitted:
        """A decode error fails only the requests of that batch; their KV is dropped."""
        out: Emitted = []
        for chunk in plan.chunks:
            request = self.slots[chunk.slot_id].request
            if request is not None:
                out += self.endings.end_failed(request, _decode_failed(status))
        return out

    def _fail_embedding_pass(self, plan: StepPlan, status: int) -> Emitted:
        """A failed embedding pass fails its embedding requests only. The decode rows that rode
        in it are fed again in a later pass: nothing was sampled for them, their requests are
        where they were, and their KV from that position on is dropped (llama.cpp removes a
        failed ubatch's positions itself; this covers a pass split into ubatches of which an
        earlier one was computed)."""
        out: Emitted = []
        for chunk in plan.chunks:
            request = self.slots[chunk.slot_id].request
            if request is None or request.key != chunk.request_id:
                continue
            if chunk.embedding is not None:
                out += self.endings.end_failed(request, _decode_failed(status))
            else:
                self.kv.discard_tail(self.slots[chunk.slot_id], request.num_computed)
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
            self.kv.drop_cache(
                prefix_cache.eviction_order(idle, self.clock_ns(), self.admission.session_live_ns)[
                    0
                ]
            )
            return []
        active = [s.request for s in self.slots if s.request is not None]
        holding = [r for r in active if r.num_computed > 0]
        if len(active) > 1 and holding:
            self.endings.preempt(max(holding, key=lambda r: r.arrival_ns))
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

    # -- observation ------------------------------------------------------------------------------

    def publish_kv_events(self, timestamp: float) -> None:
        """Hand the KV blocks each tier gained or lost since the last call, with the load, to
        the event log (SubscribeKvEvents); the engine thread calls it with each stats snapshot."""
        self.kv.sync_events()
        used = self.kv.num_used_cells()  # the tick's count, not another (CellMap)
        running = [s for s in self.slots if s.request is not None]
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
            self.strategy.name,
            self.kv.ram,
            (self.clock_ns() - self._started_ns) / 1e9,
            self.kv.disk.stats() if self.kv.disk is not None else None,
        )

    # --- the engine loop's view (engine/loop*) ---

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """What the disk tier's I/O thread calls when a read comes back: wake the engine thread."""
        self.admission.wakeup = wake

    def set_pass_prior(self, prior: PriorShape) -> None:
        """The llama.cpp build's shape of a pass's cost by its rows (core.speculation.policy)."""
        self.spec.costs.prior = prior

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


def _decode_failed(status: int) -> errors.EngineError:
    return errors.EngineError(f"llama_decode failed with status {status}")
