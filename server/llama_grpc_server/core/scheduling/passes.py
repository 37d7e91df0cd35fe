"""Passes: what each forward pass carries, and what its measured time teaches. compose() turns the
requests the tick may serve into the pass's chunks: a generation pass (the batch strategy splits
the token budget among one LoRA adapter set's requests, core.speculation.drafts adds drafts and
pads) or an embedding pass (embedding prompt tokens within their budget, with the decode rows that
may ride along); observe() counts a pass and feeds its time to the cost models the next passes
are sized by. Pure Python; the Scheduler's, on the engine thread."""

from __future__ import annotations

from collections.abc import Sequence

from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.requests import embedding
from llama_grpc_server.core.requests.request import Request
from llama_grpc_server.core.scheduling.limits import SchedulerLimits
from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan, StepResult
from llama_grpc_server.core.scheduling.strategies import (
    BatchStrategy,
    BatchView,
    SlotView,
    TickCosts,
)
from llama_grpc_server.core.speculation.drafts import Drafts
from llama_grpc_server.core.stats import Counters


class Passes:
    def __init__(
        self, limits: SchedulerLimits, strategy: BatchStrategy, drafts: Drafts, counters: Counters
    ) -> None:
        self.limits = limits
        self.strategy = strategy
        self.costs = TickCosts()  # a generation pass's, by its decode rows and prompt tokens
        self.embedding_costs = embedding.PassCosts()
        self._drafts = drafts
        self._counters = counters
        self._last_pass_embedded = False  # while a generation prompt waits, the passes alternate
        # LoRA adapter sets take turns (_adapter_turn): the tick each set last had a pass, and
        # the set of the last forward pass (a change is a switch, counted).
        self._set_served: dict[AdapterSet, int] = {}
        self._last_adapters: AdapterSet = ()

    # -- composing a pass -------------------------------------------------------------------------

    def compose(
        self, active: list[Request], tick: int, queue_depth: int
    ) -> tuple[list[Chunk], bool, AdapterSet]:
        """The tick's chunks for the requests it may serve (in slot order), whether they make an
        embedding pass, and the pass's adapter set (_adapter_turn; an embedding pass runs the
        base model). llama.cpp turns embeddings on for a whole pass, and then computes every
        token's logits too: so an embedding pass carries the embedding requests' tokens and the
        decoding requests' rows (sampled from those logits), never a generation prompt chunk
        (its every token's logits would be paid for). While generation prompts wait, embedding
        and generation passes alternate; otherwise every pass is an embedding pass while
        embeddings wait, its embedding tokens costing the streams about half a decode tick
        (core.requests.embedding)."""
        embedding_requests = [r for r in active if r.spec.is_embedding]
        active = [r for r in active if not r.spec.is_embedding]
        # adapter streams cannot ride in an embedding pass (the base model's): they alternate
        is_waiting = any(not r.is_decoding or r.spec.adapters for r in active)
        if not embedding_requests or (is_waiting and self._last_pass_embedded):
            self._last_pass_embedded = False
            turn, adapters = self._adapter_turn(active, tick)
            return self._generation_chunks(turn, tick, queue_depth), False, adapters
        self._last_pass_embedded = True
        decoding = [r for r in active if r.is_decoding and not r.spec.adapters]
        for request in decoding:
            request.last_served_tick = tick
        rows = [
            Chunk(r.slot_id, r.key, r.num_computed, (r.tokens[r.num_computed],), True)
            for r in decoding
        ]
        embedding_chunks = self._embedding_chunks(embedding_requests, tick, bool(active))
        return rows + embedding_chunks, True, ()

    def _adapter_turn(self, active: list[Request], tick: int) -> tuple[list[Request], AdapterSet]:
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
            self._set_served[chosen] = tick
            for gone in [a for a in self._set_served if a not in sets]:
                del self._set_served[gone]
        return active, chosen

    def _embedding_chunks(
        self, requests: list[Request], tick: int, is_generating: bool
    ) -> list[Chunk]:
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
            request.last_served_tick = tick
        return chunks

    def _generation_chunks(self, active: list[Request], tick: int, queue_depth: int) -> list[Chunk]:
        if not active:
            return []
        view = BatchView(
            tick=tick,
            budget=self.limits.n_batch,
            chunk_size=self.limits.chunk_size,
            queue_depth=queue_depth,
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
            request.last_served_tick = tick
        return self._drafts.add(chunks)

    # -- what a pass teaches ----------------------------------------------------------------------

    def observe(self, plan: StepPlan, chunks: Sequence[Chunk], result: StepResult) -> None:
        """A pass that ran (`chunks`: the plan's, less those of sequences the runner emptied):
        counted, its time taught to the cost models, its adapter set counted (a plan of KV edits
        only is no forward pass)."""
        if plan.is_embedding:
            self._observe_embedding(chunks, result)
            chunks = [c for c in chunks if c.embedding is None]  # the decode rows riding along
        elif chunks:
            self._observe_generation(chunks, result)
        if chunks:
            self._counters.count_adapters(plan.adapters, passes=1)
            if plan.adapters != self._last_adapters:
                self._counters.adapter_switches += 1
                self._last_adapters = plan.adapters

    def _observe_embedding(self, chunks: Sequence[Chunk], result: StepResult) -> None:
        """An embedding pass teaches the embedding cost (not the prefill or decode costs: it
        computes every token's logits): its time less a decode tick's when decode rows rode
        along."""
        if not chunks:
            return
        num_tokens = sum(len(c.tokens) for c in chunks)
        num_embedding = sum(len(c.tokens) for c in chunks if c.embedding is not None)
        self._counters.count_pass(num_tokens, 0, result.eval_ms, result.eval_cpu_ms)
        if num_embedding == num_tokens:
            self.embedding_costs.observe(num_embedding, result.eval_ms)
        elif self.costs.decode_tick_ms > 0:
            marginal_ms = result.eval_ms - self.costs.decode_tick_ms
            self.embedding_costs.observe(num_embedding, marginal_ms, is_marginal=True)

    def _observe_generation(self, chunks: Sequence[Chunk], result: StepResult) -> None:
        """Decode-only passes, with or without drafts, teach the speculation cost model too."""
        num_decode = sum(1 for c in chunks if c.is_decode)
        num_draft = sum(c.num_draft for c in chunks)  # rows: pads included
        num_tokens = sum(len(c.tokens) for c in chunks)
        num_prefill = num_tokens - num_decode - num_draft
        if num_draft == 0:
            self.costs.observe(num_decode, num_prefill, result.eval_ms)
        if num_prefill == 0:
            self._drafts.spec.costs.observe(num_decode + num_draft, result.eval_ms)
        num_spec = num_draft - sum(c.num_pad for c in chunks)
        self._counters.count_pass(num_tokens, num_spec, result.eval_ms, result.eval_cpu_ms)
