"""Progress: what a chunk the runner computed does to its request. Its prompt tokens count as
computed; an embedding request whose input is all fed ends with the pooled vectors; a sampled
token goes through Outputs.judge (stop strings, stop tokens, limits, logprobs) and ends the
request when it finishes it; a speculative chunk's tokens are verified and go through the same
path one by one, the KV of the rejected tail discarded; a token the runner could not sample ends
the request. Pure Python; the Scheduler's update() calls it per chunk on the engine thread."""

from __future__ import annotations

from collections.abc import Callable

from llama_grpc_server.core.kv.manager import KvCacheManager
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import Emitted, FinishReason, Request, RequestState
from llama_grpc_server.core.scheduling.endings import Endings
from llama_grpc_server.core.scheduling.plan import Chunk, SampledLogprob, StepResult
from llama_grpc_server.core.speculation.speculator import Speculator
from llama_grpc_server.core.stats import Counters


class Progress:
    def __init__(  # noqa: PLR0917  # the parts a computed token touches
        self,
        outputs: Outputs,
        endings: Endings,
        spec: Speculator,
        kv: KvCacheManager,
        counters: Counters,
        clock_ns: Callable[[], int],
    ) -> None:
        self._outputs = outputs
        self._endings = endings
        self._spec = spec
        self._kv = kv
        self._counters = counters
        self._clock_ns = clock_ns

    def apply(self, request: Request, chunk: Chunk, result: StepResult) -> Emitted:
        """The chunk of `request` (still in its slot) was computed: the events that follow."""
        if chunk.embedding is not None:
            return self._embedded(request, chunk, result)
        if chunk.num_draft:
            return self._accept_draft(request, chunk, result)
        request.num_computed += len(chunk.tokens)
        if chunk.wants_logits and chunk.slot_id in result.failed:
            return self._fail_sample(request, chunk.slot_id, result)
        if not chunk.wants_logits:
            return []
        logprob = result.logprobs.get(chunk.slot_id)
        out = self._accept(request, result.sampled[chunk.slot_id], logprob)
        self._spec.observe_tokens(request)
        return out

    def _embedded(self, request: Request, chunk: Chunk, result: StepResult) -> Emitted:
        """An embedding request whose last input token was fed ends with the vectors the
        runner pooled (its slot's KV is cleared: embedding requests leave no prefix cache)."""
        request.num_computed += len(chunk.tokens)
        if request.num_pending:
            return []
        request.first_token_ns = self._clock_ns()
        vectors = result.embeddings[chunk.slot_id]
        return self._endings.finish(request, FinishReason.EMBEDDED, embedding=vectors)

    def _accept_draft(self, request: Request, chunk: Chunk, result: StepResult) -> Emitted:
        """A speculative decode: the sampled tokens go one by one through the normal accept
        path (stop strings, stop tokens, limits and logprobs per token; what follows a finish
        is dropped), the KV of every token after the last one kept is discarded."""
        tokens = result.tokens_of(chunk.slot_id)
        logprobs = result.logprobs_of(chunk.slot_id)
        num_accepted = chunk.num_accepted(tokens)
        if not chunk.is_pad:
            if self._spec.verified(request, chunk.num_draft, num_accepted):
                self._counters.spec_model_draft_tokens += chunk.num_draft
                self._counters.spec_model_accepted_tokens += num_accepted
            request.num_draft_tokens += chunk.num_draft
        request.num_computed = chunk.start_pos + 1
        out: Emitted = []
        for i, token in enumerate(tokens):
            request.num_computed = chunk.start_pos + 1 + i  # the tokens fed before this one
            if i < num_accepted:
                request.num_accepted_draft += 1
                self._counters.spec_accepted_tokens += 1
            out += self._accept(request, token, logprobs[i])
            if request.state is RequestState.FINISHED:
                break
        if request.state is not RequestState.FINISHED:
            if chunk.slot_id in result.failed or not tokens:
                out += self._fail_sample(request, chunk.slot_id, result)
            else:
                self._spec.observe_tokens(request)
        if request.num_computed < chunk.start_pos + len(chunk.tokens):
            self._kv.discard_tail(chunk.slot_id, request.num_computed)
        return out

    def _fail_sample(self, request: Request, slot_id: int, result: StepResult) -> Emitted:
        """The runner sampled nothing for the request: its constraint allows no token (or
        refused one of its resumed tokens)."""
        field = result.failed_field.get(slot_id)
        return self._endings.fail_constraint(request, result.failed[slot_id], field=field)

    def _accept(self, request: Request, token: int, logprob: SampledLogprob | None) -> Emitted:
        now_ns = self._clock_ns()
        if request.first_token_ns == 0:
            request.first_token_ns = now_ns
        request.state = RequestState.GENERATING
        verdict = self._outputs.judge(request, token, logprob)
        out: Emitted = []
        if verdict.delta is not None:
            self._counters.generated_tokens += 1
            if request.spec.adapters:
                self._counters.count_adapters(request.spec.adapters, tokens=1)
            request.num_sent += len(verdict.delta.token_ids)
            out.append((request, verdict.delta))
        reason = verdict.reason
        if reason is None and request.time_limit_passed(now_ns):
            reason = FinishReason.TIME_LIMIT
        if reason is not None:
            out += self._endings.finish(
                request,
                reason,
                matched_stop=verdict.matched_stop,
                matched_token_id=verdict.matched_token_id,
            )
        return out
