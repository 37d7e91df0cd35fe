"""Drafts: what a planned tick's decode chunks carry beyond their one token. Speculating
requests take their drafts (core.speculation.speculator proposes them), as far as the batch, the
free KV cells and the readers' stream buffers have room; then a decode-only pass may take pad rows
where the measured costs say the larger batch is cheaper. A draft or a pad never preempts anyone or
evicts a cache: a pass with them that finds no KV slot pauses them (pause()) and is retried
without. Pure Python; the Scheduler calls it on the engine thread once per planned tick."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llama_grpc_server.core.kv.manager import KvCacheManager
from llama_grpc_server.core.requests.request import Request, SpeculativeMode
from llama_grpc_server.core.scheduling.plan import MAX_PAD_ROWS, Chunk
from llama_grpc_server.core.scheduling.slot import Slot
from llama_grpc_server.core.speculation.policy import MIN_GAIN
from llama_grpc_server.core.speculation.speculator import Speculator
from llama_grpc_server.core.stats import Counters

PAD_FROM_ROWS = 3  # one logits row takes llama.cpp's matrix-vector path: never padded
DRAFT_PAUSE_TICKS = 16  # ticks without drafts after drafts did not fit the KV cache


@dataclasses.dataclass(frozen=True, slots=True)
class DraftLimits:
    """The parts of SchedulerLimits drafts and pads obey."""

    n_ctx: int
    n_batch: int
    pad_decode_batches: bool
    stream_buffer_tokens: int


@dataclasses.dataclass(slots=True)
class Drafts:
    limits: DraftLimits
    spec: Speculator
    slots: Sequence[Slot]
    kv: KvCacheManager
    counters: Counters
    pause_ticks: int = 0  # > 0: recent drafts did not fit the KV cache
    # Requests in slots whose speculative mode is not OFF (by key): none, and the tick skips the
    # per-chunk speculation scan (the default with speculation off).
    speculating: set[str] = dataclasses.field(default_factory=set)

    def admitted(self, request: Request) -> None:
        if self.spec.mode(request) is not SpeculativeMode.OFF:
            self.speculating.add(request.key)

    def forget(self, key: str) -> None:
        self.speculating.discard(key)
        self.spec.forget(key)

    def pause(self) -> None:
        """A pass with drafts found no KV slot: the next DRAFT_PAUSE_TICKS ticks go without."""
        self.pause_ticks = DRAFT_PAUSE_TICKS

    def add(self, chunks: list[Chunk]) -> list[Chunk]:
        """The tick's chunks with the drafts and pads they take."""
        if self.pause_ticks > 0:
            self.pause_ticks -= 1
            return chunks
        if self.speculating:
            chunks = self._speculate(chunks)
        return self._pad(chunks)

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
        model_ms, model_cpu_ms = self.spec.model_ms, self.spec.model_cpu_ms
        drafts = self.spec.propose(
            requests,
            num_rows=num_decode,
            room=room,
            n_ctx=self.limits.n_ctx,
            has_prefill=num_decode < len(chunks),
        )
        # a draft model's pass is llama_decode time too (GetStats' decode seconds)
        self.counters.decode_ms += self.spec.model_ms - model_ms
        self.counters.decode_cpu_ms += self.spec.model_cpu_ms - model_cpu_ms
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
        """pad_decode_batches: up to MAX_PAD_ROWS rows more where the measured costs say they
        make a decode-only pass cheaper by MIN_GAIN: llama.cpp's tiled CPU matmul of the output
        layer makes some row counts dearer than a larger one (x86-64-v3 build: 3 rows 42.8 ms,
        4 rows 34.6; AVX-512 build: 6 rows 54.4 ms, 8 rows 47.5; core.speculation.policy), so the
        cheapest of N .. N + 3 rows is taken. The pad repeats a plain decode's token at the next
        positions; its logits are never sampled and its KV cells are removed after the pass,
        like a rejected draft's (causal attention: no other row sees them). Requests of every
        speculative mode, OFF included: nothing is drafted."""
        is_decode_only = bool(chunks) and all(c.is_decode for c in chunks)
        if not (self.limits.pad_decode_batches and is_decode_only):
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
