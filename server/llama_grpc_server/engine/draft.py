"""DraftModel: the draft model of --draft-model, loaded beside the target with its own llama
context (the target's n_ctx and sequences, its own KV), and the batched draft pass the
Speculator asks for (core.speculation.draft_model.DraftSource): for every drafting slot the
draft KV is brought in step with the slot's tokens (kept prefix, removed tail, missing tokens
fed: core.speculation.draft_model explains why that alone makes cancel, preemption, prefix
reuse and resume correct), then k greedy steps, each one llama_decode over all the slots still
drafting. Engine thread only."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.core.scheduling.plan import DECODE_KV_FULL, DECODE_OK, Chunk
from llama_grpc_server.core.speculation.draft_model import (
    DraftPass,
    DraftWant,
    catch_up,
    feed_passes,
    vocab_mismatch,
)
from llama_grpc_server.engine import cpu_share
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.llama import LlamaModel, ModelLoadError

WARM_UP_STEPS = 3  # timed one-row draft steps at the warm-up; the fastest is the first price


class DraftModel:
    """The draft model, its context, and per slot the tokens whose KV that context holds."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.batch = Batch(model.n_batch)
        self.held: dict[int, list[int]] = {}  # slot id -> tokens whose draft KV is held
        self._threads = model.threads
        # Told of each draft llama_decode before it runs (is_prefill, tokens): the engine's
        # watchdog extends the tick's bound by it (EngineLoop.expect_inner_pass)
        self.before_pass: Callable[[bool, int], None] | None = None

    @classmethod
    def load(
        cls, settings: ModelSettings, path: str, n_seq_max: int, target: LlamaModel
    ) -> DraftModel:
        """The draft model at `path` with the target's context settings, its vocabulary checked
        against the target's: ModelLoadError naming the first mismatch (nothing left loaded)."""
        model = LlamaModel(settings, path, n_seq_max)
        name = Path(path).name
        if model.is_encoder:
            model.close()
            raise ModelLoadError(f"--draft-model {name}: an encoder cannot draft")
        problem = vocab_mismatch(target.vocab_view(), model.vocab_view())
        if problem is not None:
            model.close()
            raise ModelLoadError(
                f"--draft-model {name} cannot draft for {Path(target.path).name}: {problem}"
            )
        return cls(model)

    def draft(self, wants: Sequence[DraftWant]) -> DraftPass:
        """k greedy draft tokens for every wanted slot (fewer, or none, for a slot whose pass
        failed: drafting is optional)."""
        t0 = time.perf_counter_ns()
        cpu0 = time.thread_time_ns()
        chunks = [self._step_in(want) for want in wants if want.k > 0 and want.tokens]
        drafts: dict[int, list[int]] = {c.slot_id: [] for c in chunks}
        k_of = {w.slot_id: w.k for w in wants}
        num_fed = sum(len(c.tokens) for c in chunks)
        for part in feed_passes(chunks, self.model.n_batch):
            if not self._decode(part, drafts, keep={c.slot_id for c in chunks}):
                drafts = {}
                break
        while True:
            step = [
                Chunk(s, "", len(self.held[s]), (d[-1],), True)
                for s, d in drafts.items()
                if d and len(d) < k_of[s]
            ]
            if not step:
                break
            num_fed += len(step)
            if not self._decode(step, drafts, keep=set(drafts)):
                drafts = {}
                break
        ms = (time.perf_counter_ns() - t0) / 1e6
        cpu_ms = (time.thread_time_ns() - cpu0) / 1e6
        return DraftPass({s: tuple(d) for s, d in drafts.items() if d}, ms, cpu_ms, num_fed)

    def _step_in(self, want: DraftWant) -> Chunk:
        """The slot's draft KV cut to its common prefix with the slot's tokens; the chunk that
        feeds the rest (logits for its last token)."""
        held = self.held.get(want.slot_id, [])
        keep, feed = catch_up(held, want.tokens)
        if keep < len(held) and not self.model.seq_remove(want.slot_id, keep, -1):
            self.model.seq_remove(want.slot_id, 0, -1)  # a partial removal refused: start over
            keep, feed = 0, tuple(want.tokens)
        self.held[want.slot_id] = list(want.tokens[:keep])
        return Chunk(want.slot_id, "", keep, feed, True)

    def _decode(
        self, chunks: Sequence[Chunk], drafts: dict[int, list[int]], keep: set[int]
    ) -> bool:
        """One llama_decode of the chunks; each chunk with logits appends its argmax to its
        slot's draft. A full draft KV drops the slots not in `keep` and tries once more; a pass
        that fails forgets the chunks' slots (their KV is emptied) and returns False."""
        outputs = self.batch.fill(chunks)
        if self.before_pass is not None:
            tokens = sum(len(c.tokens) for c in chunks)
            self.before_pass(tokens > len(chunks), tokens)
        status = self._run()
        if status == DECODE_KV_FULL:
            for slot_id in [s for s in self.held if s not in keep]:
                self.forget(slot_id)
            outputs = self.batch.fill(chunks)
            status = self._run()
        if status != DECODE_OK:
            for slot_id in {c.slot_id for c in chunks} | keep:
                self.forget(slot_id)
            return False
        n_vocab = self.model.n_vocab
        for chunk, index in zip(chunks, outputs, strict=True):
            self.held.setdefault(chunk.slot_id, []).extend(chunk.tokens)
            if index >= 0:
                pointer = llama_cpp.llama_get_logits_ith(self.model.ctx, index)
                row = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
                drafts[chunk.slot_id].append(int(np.argmax(row)))
        return True

    def _run(self) -> int:
        with cpu_share.forward_pass(self.model.threads) as threads:
            if threads != self._threads:
                self.model.set_threads(*threads)
                self._threads = threads
            return int(llama_cpp.llama_decode(self.model.ctx, self.batch.struct))

    def forget(self, slot_id: int) -> None:
        """The slot's draft KV emptied (it catches up from scratch when it drafts again)."""
        self.model.seq_remove(slot_id, 0, -1)
        self.held.pop(slot_id, None)

    def warm_up(self, tokens: Sequence[int]) -> float:
        """A decode so the first draft pays no lazy allocation, then WARM_UP_STEPS timed
        one-row steps after `tokens`: the fastest one's milliseconds (a drafted token's first
        price). The draft KV is left empty."""
        self.forget(0)
        best = float("inf")
        if self._decode([Chunk(0, "", 0, tuple(tokens), True)], {0: []}, keep={0}):
            for i in range(WARM_UP_STEPS):
                t0 = time.perf_counter_ns()
                chunk = Chunk(0, "", len(tokens) + i, (tokens[-1],), True)
                if not self._decode([chunk], {0: []}, keep={0}):
                    break
                best = min(best, (time.perf_counter_ns() - t0) / 1e6)
        self.forget(0)
        return best if best != float("inf") else 0.0

    def close(self) -> None:
        self.held.clear()
        self.model.close()
