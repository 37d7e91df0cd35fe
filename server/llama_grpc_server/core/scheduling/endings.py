"""Endings: how a request leaves its slot. finish() and end_failed() end it (its computed KV
stays as prefix cache unless an engine error makes it suspect; its sampler closes in the next
plan; it counts as finished, cancelled, deadline exceeded or failed); preempt() puts it back at
the head of the queue under KV pressure (it resumes by re-prefilling, its sampler and text state
kept). Pure Python; the Scheduler's, on the engine thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llama_grpc_server import errors
from llama_grpc_server.core.kv.manager import KvCacheManager
from llama_grpc_server.core.requests.embedding import Vectors
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    Request,
    RequestState,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.admission import Admission
from llama_grpc_server.core.scheduling.slot import Slot
from llama_grpc_server.core.speculation.drafts import Drafts
from llama_grpc_server.core.stats import Counters

Emitted = list[tuple[Request, Event]]


@dataclass(slots=True)
class Endings:
    """The scheduler's parts an ending touches, and the samplers it leaves to close."""

    slots: Sequence[Slot]
    kv: KvCacheManager
    outputs: Outputs
    drafts: Drafts
    admission: Admission
    counters: Counters
    clock_ns: Callable[[], int]
    samplers_to_close: list[str] = field(default_factory=list)  # for the next plan

    def release(self, request: Request, *, keep_cache: bool) -> None:
        """Free the request's slot; its computed KV stays as prefix cache when allowed."""
        if request.slot_id >= 0:
            slot = self.slots[request.slot_id]
            if slot.request is request:
                slot.request = None
                slot.last_used_ns = self.clock_ns()
                if keep_cache and request.spec.cache_prompt:
                    slot.idle_cache = request.tokens[: request.num_computed]
                else:
                    slot.idle_cache = []
                    self.kv.clear(slot)
        if self.outputs.close(request.key) or request.spec.is_embedding:
            self.samplers_to_close.append(request.key)  # an embedding's rows in the runner
        self.drafts.forget(request.key)
        self.admission.timed.discard(request.key)
        request.state = RequestState.FINISHED
        self.admission.is_paused = False

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        matched_stop: str = "",
        matched_token_id: int | None = None,
        embedding: Vectors | None = None,
    ) -> Emitted:
        out: Emitted = []
        if reason is not FinishReason.STOP_SEQUENCE:
            tail = self.outputs.flush(request.key)
            if tail:
                out.append((request, TokenDelta((), tail, index=request.num_output)))
        slot_id = request.slot_id
        self.release(request, keep_cache=True)
        now_ns = self.clock_ns()
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
            embedding=embedding,
        )
        return [*out, (request, done)]

    def end_failed(self, request: Request, error: errors.ServiceError) -> Emitted:
        """End a request with `error`, counted as cancelled, deadline exceeded or failed."""
        self.release(request, keep_cache=not isinstance(error, errors.EngineError))
        if isinstance(error, errors.Cancelled):
            self.counters.cancelled += 1
        elif isinstance(error, errors.DeadlineExceeded):
            self.counters.deadline_exceeded += 1
        else:
            self.counters.failed += 1
        return [(request, Failed(error))]

    def preempt(self, request: Request) -> None:
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
        self.admission.queue.appendleft(request)
        self.admission.is_paused = True  # until a request ends: the same pressure would return

    def fail_constraint(self, request: Request, why: str, *, field: str | None = None) -> Emitted:
        """The runner found no token the request's constraint allows: end it with the reason
        (pointing at `field`, else at the constraint)."""
        constraint = request.spec.constraint
        if field is None and constraint is not None:
            field = constraint.field
        error = errors.InvalidRequest(
            f"{why} (after {request.num_output} generated tokens)", field=field
        )
        return self.end_failed(request, error)
