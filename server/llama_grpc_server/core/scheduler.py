"""Scheduler: queue, slots and every mutable scheduling fact. schedule() turns them into a
StepPlan, update() applies the runner's StepResult and returns the events to deliver.
Only the engine thread calls it. Pure Python: no llama_cpp, no grpc, no clock of its own."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llama_grpc_server import errors
from llama_grpc_server.core import prefix_cache
from llama_grpc_server.core.api import SlotSnapshot, StatsSnapshot
from llama_grpc_server.core.kv_cells import CellMap
from llama_grpc_server.core.plan import (
    DECODE_KV_FULL,
    DECODE_OK,
    Chunk,
    SampledLogprob,
    SamplerSpec,
    SeqOp,
    SeqOpKind,
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
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from llama_grpc_server.core.slot import Slot
from llama_grpc_server.core.strategies import BatchStrategy, BatchView, DecodeMaximal, SlotView
from llama_grpc_server.core.text import TextAssembler

Emitted = list[tuple[Request, Event]]

MIN_SHARED_WAIT_TOKENS = 32
"""A request waits for a busy slot's prefill only to share at least this many more tokens."""


@dataclass(slots=True)
class Counters:
    """Cumulative since start; read by GetStats and the metrics exporter."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    ticks: int = 0
    batch_tokens: int = 0
    preemptions: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    n_parallel: int
    n_ctx: int
    n_batch: int
    chunk_size: int = 512
    max_queue: int = 64
    supports_partial_removal: bool = True
    ram_cache_bytes: int = 0  # 0 = no RAM tier
    ram_min_tokens: int = 64  # smaller caches are not worth saving


@dataclass(slots=True)
class TickCosts:
    """Moving averages of measured llama_decode times: a decode-only tick, and a prompt token in
    a prefill-heavy tick. They turn "at most ~2x a decode tick" into a token count."""

    decode_tick_ms: float = 0.0
    prefill_token_ms: float = 0.0

    def observe(self, num_decode: int, num_prefill: int, eval_ms: float) -> None:
        if eval_ms <= 0:
            return
        if num_prefill == 0 and num_decode > 0:
            self.decode_tick_ms = _ema(self.decode_tick_ms, eval_ms)
        elif num_prefill >= MIN_COST_SAMPLE_TOKENS:
            self.prefill_token_ms = _ema(
                self.prefill_token_ms, eval_ms / (num_prefill + num_decode)
            )

    def prefill_allowance(self, chunk_size: int) -> int:
        """Prompt tokens that add about one decode tick to a tick (0 = not measured yet)."""
        if self.decode_tick_ms <= 0 or self.prefill_token_ms <= 0:
            return 0
        n = int(ALLOWANCE_SHARE * self.decode_tick_ms / self.prefill_token_ms)
        return max(MIN_PREFILL_ALLOWANCE, min(chunk_size, n))


def _ema(old: float, new: float, alpha: float = 0.2) -> float:
    return new if old <= 0 else old + alpha * (new - old)


MIN_COST_SAMPLE_TOKENS = 32  # prompt tokens in a tick for it to measure the per-token cost
MIN_PREFILL_ALLOWANCE = 8  # prompts always progress, however slow a prompt token is
ALLOWANCE_SHARE = 0.8  # keep below one extra decode tick: the p95 target is 2x


class Scheduler:
    """Continuous batching over a slot pool sharing one unified KV cache."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        pieces: Sequence[bytes],
        eog_ids: frozenset[int],
        strategy: BatchStrategy | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.strategy: BatchStrategy = strategy if strategy is not None else DecodeMaximal()
        self.slots = [Slot(i) for i in range(config.n_parallel)]
        self.queue: deque[Request] = deque()
        self.counters = Counters()
        self._pieces = pieces
        self._eog_ids = eog_ids
        self._clock_ns = clock_ns
        self._monotonic = monotonic
        self._texts: dict[str, TextAssembler] = {}
        self._seq_ops: list[SeqOp] = []
        self._open: list[SamplerSpec] = []
        self._close: list[str] = []
        self._tick = 0
        self._is_admission_paused = False
        self._started_ns = clock_ns()
        self.costs = TickCosts()
        self.ram = prefix_cache.RamTier(config.ram_cache_bytes) if config.ram_cache_bytes else None
        self._saving: dict[int, tuple[str, list[int]]] = {}
        self.cells = CellMap()  # cells shared through seq_cp count once in kv_cells_used

    # -- intake ---------------------------------------------------------------------------------

    def check_fits(self, spec: GenerationRequest) -> None:
        """Reject at once what can never fit the context (the numbers are in the message)."""
        n_prompt, n_ctx = len(spec.prompt_tokens), self.config.n_ctx
        max_tokens = spec.stopping.max_tokens
        if n_prompt >= n_ctx or n_prompt + max_tokens > n_ctx:
            raise errors.PromptTooLong(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"({n_ctx} tokens)",
                field="params.stopping.max_tokens" if n_prompt < n_ctx else "prompt",
                metadata={
                    "prompt_tokens": str(n_prompt),
                    "max_tokens": str(max_tokens),
                    "n_ctx": str(n_ctx),
                },
            )

    def add(self, request: Request) -> None:
        """Queue a request (FIFO). Raises PromptTooLong or Overloaded without queueing it."""
        try:
            self.check_fits(request.spec)
            waiting = len(self.queue) - sum(1 for s in self.slots if s.is_idle)
            if self.config.max_queue > 0 and waiting >= self.config.max_queue:
                raise errors.Overloaded(
                    f"queue is full ({waiting} waiting, max_queue={self.config.max_queue})",
                    retry_after_s=1.0,
                )
        except errors.ServiceError:
            self.counters.rejected += 1
            raise
        if request.arrival_ns == 0:
            request.arrival_ns = self._clock_ns()
        seed = request.spec.sampling.seed
        request.seed = seed if seed is not None else random.getrandbits(32)
        self.queue.append(request)

    def cancel(self, request_id: str) -> Emitted:
        """Drop a request now: a queued one leaves the queue, an active one frees its slot (its
        computed KV stays as prefix cache) and its sampler is closed in the next plan."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                return self._end_failed(request, errors.Cancelled("cancelled"), cancelled=True)
        for slot in self.slots:
            if slot.request is not None and slot.request.request_id == request_id:
                return self._end_failed(slot.request, errors.Cancelled("cancelled"), cancelled=True)
        return []

    def fail_all(self, error: errors.ServiceError) -> Emitted:
        """Fail everything queued or running (engine shutdown)."""
        out: Emitted = []
        while self.queue:
            out += self._end_failed(self.queue.popleft(), error)
        for slot in self.slots:
            if slot.request is not None:
                out += self._end_failed(slot.request, error)
        return out

    @property
    def has_work(self) -> bool:
        return bool(
            self.queue
            or self._seq_ops
            or self._close
            or any(s.request is not None for s in self.slots)
        )

    # -- schedule ---------------------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan | None, Emitted]:
        """Expire, admit, let the strategy split the budget; returns the plan (None if idle)."""
        self._tick += 1
        events = self._expire()
        self._admit()
        self._resolve_waits()
        chunks = self._chunks()
        plan = StepPlan(
            tick=self._tick,
            chunks=tuple(chunks),
            seq_ops=tuple(self._seq_ops),
            open_samplers=tuple(self._open),
            close_samplers=tuple(self._close),
            num_decode=sum(1 for c in chunks if c.is_decode),
            num_prefill=sum(len(c.tokens) for c in chunks if not c.is_decode),
        )
        self._seq_ops, self._open, self._close = [], [], []
        if not (plan.chunks or plan.seq_ops or plan.open_samplers or plan.close_samplers):
            return None, events
        self._check(plan)
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
        return out

    def _admit(self) -> None:
        if self._is_admission_paused and any(s.request is not None for s in self.slots):
            return
        self._is_admission_paused = False
        while self.queue and any(s.is_idle for s in self.slots):
            self._place(self._next_queued())

    def _next_queued(self) -> Request:
        """FIFO, except that a request whose session's slot is idle goes first: it reuses its
        conversation's cache at once instead of another request evicting it. A preempted
        request at the head keeps its place."""
        sessions = {s.session_id for s in self.slots if s.is_idle and s.session_id}
        if sessions and not self.queue[0].num_preemptions:
            for request in self.queue:
                if request.spec.session_id in sessions:
                    self.queue.remove(request)
                    return request
        return self.queue.popleft()

    def _place(self, request: Request) -> None:
        spec = request.spec
        placement = prefix_cache.place(
            self.slots, request.tokens, spec.cache_scope, spec.session_id
        )
        slot = self.slots[placement.slot_id]
        restore_keep = self._try_restore(slot, request, placement.num_cached)
        kept = 0 if restore_keep else self._reuse(slot, placement if spec.cache_prompt else None)
        slot.request, slot.cached_tokens = request, []
        slot.cache_scope, slot.session_id = spec.cache_scope, spec.session_id
        request.slot_id, request.num_computed = slot.slot_id, kept
        request.state = RequestState.PREFILLING
        request.last_served_tick = self._tick
        if request.num_preemptions == 0:
            request.admitted_ns = self._clock_ns()
            self._texts[request.request_id] = TextAssembler(self._pieces, spec.stopping.stop)
            self._open.append(
                SamplerSpec(
                    request.request_id, spec.sampling, request.seed, spec.output, spec.constraint
                )
            )
            self.counters.started += 1
            self.counters.prompt_tokens += request.num_prompt
        if restore_keep:
            request.restore_keep = restore_keep
        elif not (spec.cache_prompt and self._wait_for_shared_prefix(request, slot)):
            self._count_cached(request, kept)

    def _try_restore(self, slot: Slot, request: Request, num_cached: int) -> int:
        """Restore a saved state from the RAM tier when it beats what the slots offer; returns
        the prefix length it will provide (0 = no restore)."""
        if self.ram is None or not request.spec.cache_prompt or request.num_preemptions:
            return 0
        key, n = self.ram.best(request.spec.cache_scope, request.tokens)
        if key < 0 or n < num_cached + MIN_SHARED_WAIT_TOKENS:
            self.ram.misses += 1
            return 0
        entry = self.ram.take(key)
        self._drop_cache(slot)
        self._queue(SeqOp(SeqOpKind.RESTORE, slot.slot_id, data=entry.data), len(entry.tokens))
        if len(entry.tokens) > n:
            self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, n, -1))
        return n

    def _drop_cache(self, slot: Slot, keep: int = 0) -> None:
        """Remove an idle slot's KV from `keep` on, saving it to the RAM tier first if it is
        worth keeping."""
        held = slot.cached_tokens if slot.is_idle else slot.kv_tokens()
        if not held or len(held) <= keep:
            return
        if (
            self.ram is not None
            and slot.is_idle
            and len(held) >= self.config.ram_min_tokens
            and len(held) - keep >= MIN_SHARED_WAIT_TOKENS
        ):
            self._saving[slot.slot_id] = (slot.cache_scope, list(held))
            self._queue(SeqOp(SeqOpKind.SAVE, slot.slot_id))
        self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, keep, -1))
        if slot.is_idle:
            slot.cached_tokens = held[:keep]

    def _queue(self, op: SeqOp, restored_tokens: int = 0) -> None:
        """Queue a KV edit for the next plan and mirror it in the cell map."""
        self._seq_ops.append(op)
        if op.kind is SeqOpKind.REMOVE:
            self.cells.removed(op.seq_id, op.p0, op.p1)
        elif op.kind is SeqOpKind.COPY:
            self.cells.copied(op.src_seq_id, op.seq_id, op.p1)
        elif op.kind is SeqOpKind.RESTORE:
            self.cells.restored(op.seq_id, restored_tokens)

    def _count_cached(self, request: Request, num_cached: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_prompt = num_cached
            self.counters.cached_prompt_tokens += num_cached

    def _wait_for_shared_prefix(self, request: Request, slot: Slot) -> bool:
        """If a busy slot is still prefilling a longer shared prefix (a system prompt sent by
        requests arriving together), wait for it and copy its KV instead of computing it twice."""
        best_slot, best_n = None, request.num_computed + MIN_SHARED_WAIT_TOKENS
        for other in self.slots:
            donor = other.request
            if donor is None or other is slot or other.cache_scope != slot.cache_scope:
                continue
            n = prefix_cache.common_prefix_length(donor.tokens[: donor.num_prompt], request.tokens)
            n = min(n, len(request.tokens) - 1)
            if n > best_n and donor.num_computed < n:
                best_slot, best_n = other, n
        if best_slot is None or best_slot.request is None:
            return False
        if request.num_computed:
            self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, 0, -1))
            request.num_computed = 0
        request.wait_slot_id = best_slot.slot_id
        request.wait_request_id = best_slot.request.request_id
        request.wait_tokens = best_n
        return True

    def _resolve_waits(self) -> None:
        """Copy a shared prefix once its donor has computed it; if the donor went away, copy the
        best prefix any slot still holds (or compute from scratch)."""
        for slot in self.slots:
            request = slot.request
            if request is None or not request.is_waiting:
                continue
            donor = self.slots[request.wait_slot_id]
            if donor.request is not None and donor.request.request_id == request.wait_request_id:
                if donor.request.num_computed < request.wait_tokens:
                    continue
                src, n = donor.slot_id, request.wait_tokens
            else:
                src, n = -1, 0
                for other in self.slots:
                    m = (
                        0
                        if other is slot
                        else prefix_cache.usable_prefix(other, request.tokens, slot.cache_scope)
                    )
                    if m > n:
                        src, n = other.slot_id, m
            if n:
                self._queue(SeqOp(SeqOpKind.COPY, slot.slot_id, 0, n, src_seq_id=src))
            request.num_computed = n
            request.wait_slot_id = -1
            self._count_cached(request, n)

    def _reuse(self, slot: Slot, placement: prefix_cache.Placement | None) -> int:
        """Queue the seq_rm / seq_cp that make `slot` hold exactly the reused prefix."""
        if placement is None or placement.num_cached == 0:
            self._drop_cache(slot)
            return 0
        if placement.donor_slot_id >= 0:
            self._drop_cache(slot)
            self._queue(
                SeqOp(
                    SeqOpKind.COPY,
                    slot.slot_id,
                    0,
                    placement.donor_tokens,
                    src_seq_id=placement.donor_slot_id,
                )
            )
            return placement.donor_tokens
        keep = placement.keep
        if slot.num_kv_tokens > keep and not self.config.supports_partial_removal:
            self._drop_cache(slot)
            return 0
        self._drop_cache(slot, keep)
        return keep

    def _chunks(self) -> list[Chunk]:
        active = [
            s.request for s in self.slots if s.request is not None and not s.request.is_blocked
        ]
        if not active:
            return []
        view = BatchView(
            tick=self._tick,
            budget=self.config.n_batch,
            chunk_size=self.config.chunk_size,
            queue_depth=len(self.queue),
            slots=tuple(
                SlotView(r.slot_id, r.num_pending, r.is_decoding, r.last_served_tick)
                for r in active
            ),
            prefill_allowance=self.costs.prefill_allowance(self.config.chunk_size),
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
                    request_id=request.request_id,
                    start_pos=start,
                    tokens=tuple(request.tokens[start:end]),
                    wants_logits=end == len(request.tokens),
                )
            )
            request.last_served_tick = self._tick
        return chunks

    def _check(self, plan: StepPlan) -> None:
        """Plan invariants, every tick: a broken plan would corrupt KV or abort llama.cpp."""
        if plan.num_tokens > self.config.n_batch:
            raise RuntimeError(f"plan exceeds n_batch: {plan.num_tokens} > {self.config.n_batch}")
        seen: set[int] = set()
        for chunk in plan.chunks:
            request = self.slots[chunk.slot_id].request
            if chunk.slot_id in seen or request is None or not chunk.tokens:
                raise RuntimeError(f"bad chunk for slot {chunk.slot_id}")
            if chunk.start_pos != request.num_computed:
                raise RuntimeError(f"non-contiguous chunk for slot {chunk.slot_id}")
            if not chunk.is_decode and len(chunk.tokens) > self.config.chunk_size:
                raise RuntimeError(f"chunk over chunk_size for slot {chunk.slot_id}")
            seen.add(chunk.slot_id)

    # -- update -----------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> Emitted:
        """Apply one tick's outcome; returns (request, event) pairs in order."""
        self._apply_resets(result.reset)
        self._apply_ram_results(result)
        if result.status == DECODE_KV_FULL:
            return self._relieve_kv_pressure(plan)
        if result.status != DECODE_OK:
            return self._fail_batch(plan, result.status)
        chunks = [c for c in plan.chunks if c.slot_id not in result.reset]
        if chunks:  # a plan of KV edits only is no forward pass
            self.costs.observe(plan.num_decode, plan.num_prefill, result.eval_ms)
            self.counters.ticks += 1
            self.counters.batch_tokens += sum(len(c.tokens) for c in chunks)
        out: Emitted = []
        for chunk in chunks:
            request = self.slots[chunk.slot_id].request
            if request is None or request.request_id != chunk.request_id:
                continue
            self.cells.computed(chunk.slot_id, chunk.start_pos, len(chunk.tokens))
            request.num_computed += len(chunk.tokens)
            if chunk.wants_logits and chunk.slot_id in result.failed:
                out += self._fail_constraint(request, result.failed[chunk.slot_id])
            elif chunk.wants_logits:
                logprob = result.logprobs.get(chunk.slot_id)
                out += self._accept(request, result.sampled[chunk.slot_id], logprob)
        return out

    def _fail_constraint(self, request: Request, why: str) -> Emitted:
        """The runner found no token the request's constraint allows: end it with the reason."""
        constraint = request.spec.constraint
        error = errors.InvalidRequest(
            f"{why} (after {request.num_output} generated tokens)",
            field=constraint.field if constraint is not None else None,
        )
        return self._end_failed(request, error)

    def _apply_resets(self, reset: frozenset[int]) -> None:
        """A partial seq_rm failed and the runner emptied the sequence instead: its request
        re-prefills from position 0 (never reuses a stale cache); an idle slot holds nothing."""
        for seq_id in reset:
            self.cells.cleared(seq_id)
            slot = self.slots[seq_id]
            request = slot.request
            if request is None:
                slot.cached_tokens = []
                continue
            if request.num_preemptions == 0 and request.num_cached_prompt:
                self.counters.cached_prompt_tokens -= request.num_cached_prompt
                request.num_cached_prompt = 0
            request.num_computed = 0
            request.restore_keep = 0

    def _apply_ram_results(self, result: StepResult) -> None:
        for seq_id, data in result.saved.items():
            scope, tokens = self._saving.pop(seq_id, ("", []))
            if self.ram is not None and tokens:
                self.ram.put(scope, tokens, data)
        for seq_id, ok in result.restored.items():
            request = self.slots[seq_id].request
            if request is None or not request.restore_keep:
                continue
            n = request.restore_keep if ok else 0
            if not ok:
                self._queue(SeqOp(SeqOpKind.REMOVE, seq_id, 0, -1))
            request.num_computed, request.restore_keep = n, 0
            self._count_cached(request, n)

    def _accept(self, request: Request, token: int, logprob: SampledLogprob | None) -> Emitted:
        now_ns = self._clock_ns()
        if request.first_token_ns == 0:
            request.first_token_ns = now_ns
        request.state = RequestState.GENERATING
        stopping = request.spec.stopping
        if token in self._eog_ids and not stopping.ignore_eos:
            return self._finish(request, FinishReason.EOS, matched_token_id=token)
        if token in stopping.stop_token_ids:
            return self._finish(request, FinishReason.STOP_TOKEN, matched_token_id=token)
        request.tokens.append(token)
        self.counters.generated_tokens += 1
        text, matched = self._texts[request.request_id].push(token)
        logprobs = () if logprob is None else (self._token_logprob(token, logprob),)
        out: Emitted = [(request, TokenDelta((token,), text, logprobs))]
        if matched:
            return out + self._finish(request, FinishReason.STOP_SEQUENCE, matched_stop=matched)
        reason = self._length_reason(request)
        if reason is None and request.time_limit_passed(now_ns):
            reason = FinishReason.TIME_LIMIT
        if reason is not None:
            out += self._finish(request, reason)
        return out

    def _piece(self, token: int) -> str:
        return self._pieces[token].decode("utf-8", errors="replace")

    def _token_logprob(self, token: int, sampled: SampledLogprob) -> TokenLogprob:
        top = tuple(TopLogprob(t, self._piece(t), lp) for t, lp in sampled.top)
        return TokenLogprob(token, self._piece(token), sampled.logprob, top)

    def _length_reason(self, request: Request) -> FinishReason | None:
        stopping = request.spec.stopping
        at_context = len(request.tokens) >= self.config.n_ctx
        if request.num_output >= stopping.max_tokens:
            if at_context and stopping.max_tokens_is_default:
                return FinishReason.CONTEXT_LENGTH
            return FinishReason.MAX_TOKENS
        return FinishReason.CONTEXT_LENGTH if at_context else None

    # -- endings ----------------------------------------------------------------------------------

    def _release(self, request: Request, *, keep_cache: bool) -> None:
        """Free the request's slot; its computed KV stays as prefix cache when allowed."""
        if request.slot_id >= 0:
            slot = self.slots[request.slot_id]
            if slot.request is request:
                slot.request = None
                slot.last_used_ns = self._clock_ns()
                if keep_cache and request.spec.cache_prompt:
                    slot.cached_tokens = request.tokens[: request.num_computed]
                else:
                    slot.cached_tokens = []
                    self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, 0, -1))
        if request.request_id in self._texts:
            del self._texts[request.request_id]
            self._close.append(request.request_id)
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
        text = self._texts.get(request.request_id)
        if text is not None and reason is not FinishReason.STOP_SEQUENCE:
            tail = text.flush()
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

    def _end_failed(
        self, request: Request, error: errors.ServiceError, *, cancelled: bool = False
    ) -> Emitted:
        self._release(request, keep_cache=not isinstance(error, errors.EngineError))
        if cancelled:
            self.counters.cancelled += 1
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
        """llama_decode found no KV slot and restored memory. Drop the LRU idle cache; else
        preempt the youngest running request; fail a request only if it alone cannot fit."""
        idle = [s for s in self.slots if s.is_idle and s.cached_tokens]
        if idle:
            self._drop_cache(min(idle, key=lambda s: s.last_used_ns))
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
                f"cache ({self.config.n_ctx} cells) cannot fit it",
                metadata={"tokens": str(len(request.tokens)), "n_ctx": str(self.config.n_ctx)},
            )
            out += self._end_failed(request, error)
        return out

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV and put it back at the head of the queue; it resumes by
        re-prefilling prompt + output so far (its sampler and text state are kept)."""
        slot = self.slots[request.slot_id]
        slot.request, slot.cached_tokens = None, []
        self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, 0, -1))
        request.num_computed = 0
        request.slot_id = -1
        request.state = RequestState.QUEUED
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.queue.appendleft(request)
        self._is_admission_paused = True

    # -- observation ------------------------------------------------------------------------------

    def snapshot(self, kv_cells_total: int) -> StatsSnapshot:
        slots = tuple(
            SlotSnapshot(
                s.slot_id,
                s.state,
                s.request.request_id if s.request is not None else "",
                s.num_kv_tokens,
            )
            for s in self.slots
        )
        c, ram = self.counters, self.ram
        states = [s.state for s in slots]
        return StatsSnapshot(
            n_parallel=len(self.slots),
            active_slots=sum(1 for st in states if st != "idle"),
            idle_slots=states.count("idle"),
            prefilling_slots=states.count("prefilling"),
            generating_slots=states.count("generating"),
            queue_depth=len(self.queue),
            kv_cells_used=min(kv_cells_total, self.cells.num_used()),
            kv_cells_total=kv_cells_total,
            requests_started=c.started,
            requests_finished=c.finished,
            requests_failed=c.failed,
            requests_cancelled=c.cancelled,
            requests_rejected=c.rejected,
            prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens,
            ticks=c.ticks,
            avg_batch_size=c.batch_tokens / c.ticks if c.ticks else 0.0,
            preemptions=c.preemptions,
            uptime_s=(self._clock_ns() - self._started_ns) / 1e9,
            slots=slots,
            batch_strategy=self.strategy.name,
            prefix_cache_hit_rate=c.cached_prompt_tokens / c.prompt_tokens
            if c.prompt_tokens
            else 0.0,
            ram_cache_entries=ram.num_entries if ram is not None else 0,
            ram_cache_bytes=ram.num_bytes if ram is not None else 0,
            ram_cache_hits=ram.hits if ram is not None else 0,
            ram_cache_misses=ram.misses if ram is not None else 0,
            ram_cache_evictions=ram.evictions if ram is not None else 0,
        )
