"""Endings: how a request leaves its slot for good. finish() and end_failed() end it (its computed
KV stays as prefix cache unless an engine error makes it suspect; its sampler closes in the next
plan; it counts as finished, cancelled, deadline exceeded or failed); fail_pass() ends the
requests of a forward pass llama_decode failed. (A preempted request leaves its slot but not the
engine: SlotTable.evict, Admission.requeue.) Pure Python; the Scheduler's, on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llama_grpc_server import errors
from llama_grpc_server.core.kv.manager import KvCacheManager
from llama_grpc_server.core.requests.embedding import Vectors
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import (
    Emitted,
    Failed,
    Finished,
    FinishReason,
    Request,
    RequestState,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.admission import Admission
from llama_grpc_server.core.scheduling.plan import StepPlan
from llama_grpc_server.core.scheduling.slot import SlotTable
from llama_grpc_server.core.speculation.drafts import Drafts
from llama_grpc_server.core.stats import Counters


@dataclass(slots=True)
class Endings:
    """Where an ending request's state lives, each told to let it go (the slot table frees its
    slot, the KV manager drops KV not kept, outputs, drafts and admission forget it), and the
    samplers it leaves to close."""

    slots: SlotTable
    kv: KvCacheManager
    outputs: Outputs
    drafts: Drafts
    admission: Admission
    counters: Counters
    clock_ns: Callable[[], int]
    samplers_to_close: list[str] = field(default_factory=list)  # for the next plan

    def release(self, request: Request, *, keep_cache: bool) -> None:
        """Free the request's slot; its computed KV stays as prefix cache when allowed."""
        keep = keep_cache and request.spec.cache_prompt
        slot = self.slots.free(request, keep_cache=keep)
        if slot is not None and not keep:
            self.kv.clear(slot)
        if self.outputs.close(request.key) or request.spec.is_embedding:
            self.samplers_to_close.append(request.key)  # an embedding's rows in the runner
        self.drafts.forget(request.key)
        self.admission.ended(request)
        request.state = RequestState.FINISHED

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

    def take_samplers(self) -> tuple[str, ...]:
        """The samplers of requests ended since the last plan, for the next one to close."""
        keys, self.samplers_to_close = tuple(self.samplers_to_close), []
        return keys

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

    def fail_pass(self, plan: StepPlan, status: int) -> Emitted:
        """llama_decode failed: the requests of the pass end with an EngineError (their KV is
        dropped). A failed embedding pass fails its embedding requests only: the decode rows
        that rode in it are fed again in a later pass (nothing was sampled for them, their
        requests are where they were) and their KV from that position on is dropped (llama.cpp
        removes a failed ubatch's positions itself; this covers a pass split into ubatches of
        which an earlier one was computed)."""
        out: Emitted = []
        for chunk in plan.chunks:
            request = self.slots[chunk.slot_id].request
            if request is None or (plan.is_embedding and request.key != chunk.request_id):
                continue
            if plan.is_embedding and chunk.embedding is None:
                self.kv.discard_tail(chunk.slot_id, request.num_computed)
            else:
                error = errors.EngineError(f"llama_decode failed with status {status}")
                out += self.end_failed(request, error)
        return out
