"""Runner: executes a StepPlan — samplers, KV edits, one llama_decode, sampling. Decides nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import llama_cpp
import numpy as np

from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.requests.embedding import Vectors
from llama_grpc_server.core.scheduling.plan import (
    DECODE_KV_FULL,
    DECODE_OK,
    Chunk,
    Collect,
    SampledLogprob,
    SamplerSpec,
    SeqOpKind,
    StepPlan,
    StepResult,
)
from llama_grpc_server.core.speculation import acceptance
from llama_grpc_server.engine import cpu_share
from llama_grpc_server.engine.adapters import LoraAdapters
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.embedding import Embedder
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.logprobs import LogprobComputer
from llama_grpc_server.engine.sampler import NO_TOKEN, Candidates, RequestSampler, logits_rows


@dataclass(slots=True)
class _Sampled:
    """One tick's sampling, by slot id (StepResult's fields of the same names)."""

    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, SampledLogprob] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    failed_field: dict[int, str] = field(default_factory=dict)
    draft_sampled: dict[int, tuple[int, ...]] = field(default_factory=dict)
    draft_logprobs: dict[int, tuple[SampledLogprob, ...]] = field(default_factory=dict)


class _Decoded(NamedTuple):
    """One llama_decode (Runner._decode)."""

    status: int
    t0: int  # perf_counter_ns when it started
    t1: int  # and when it returned
    eval_cpu_ms: float  # the engine thread's CPU time in it
    has_spare: bool  # the batch's spare row was decoded (not dropped for want of a KV cell)


def _done(result: StepResult) -> Collect:
    """A launch that ran no forward pass: its result is known already."""
    return lambda: result


class Runner:
    """Owns the batch and the per-request samplers; used only by the engine thread."""

    def __init__(self, model: LlamaModel, adapters: LoraAdapters | None = None) -> None:
        self.model = model
        self.adapters = adapters  # the model's LoRA adapters (None: it serves none)
        self.batch = Batch(model.n_batch)
        self.samplers: dict[str, RequestSampler] = {}
        self.top_logprobs: dict[str, int] = {}  # request_id -> k, only for those asking
        self.logprobs = LogprobComputer(model.n_vocab)
        self._candidates: Candidates | None = None  # allocated for the first constraint
        self._threads = model.threads  # what the context decodes with now
        self.embedder = Embedder()  # embedding requests' outputs until their last chunk

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan)()

    def launch(self, plan: StepPlan) -> Collect:
        """Everything up to llama_decode; the returned function samples. With a GPU backend
        llama_decode returns while the GPU still computes (the first read of the logits waits
        for it), so the engine thread may do other work before calling it."""
        for request_id in plan.close_samplers:
            sampler = self.samplers.pop(request_id, None)
            if sampler is not None:
                sampler.close()
            self.top_logprobs.pop(request_id, None)
            self.embedder.forget(request_id)
        for spec in plan.open_samplers:
            self.samplers[spec.request_id] = self._open_sampler(spec)
            if spec.output.wants_logprobs:
                self.top_logprobs[spec.request_id] = spec.output.top_logprobs
        saved: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        reset = self._edit_kv(plan, saved, restored)
        chunks = (
            plan.chunks if not reset else tuple(c for c in plan.chunks if c.slot_id not in reset)
        )
        if not chunks:
            return _done(StepResult(saved=saved, restored=restored, reset=reset))
        self._apply_adapters(plan.adapters)
        if plan.is_embedding:
            return _done(self._embed(chunks, saved, restored, reset))
        outputs = self.batch.fill(chunks)
        spare = None
        if self.model.batch_invariant:  # engine/llama.py: no micro-batch of one row
            spare = self.batch.add_spare_row(self.model.n_ubatch, self.model.n_ctx)
        status, t0, t1, eval_cpu_ms, has_spare = self._decode(has_spare=spare is not None)
        if spare is not None and has_spare and status == DECODE_OK:
            self.model.seq_remove(spare[0], spare[1], spare[1] + 1)
        if status != DECODE_OK:
            return _done(
                StepResult(
                    status,
                    saved=saved,
                    restored=restored,
                    eval_ms=(t1 - t0) / 1e6,
                    reset=reset,
                    eval_cpu_ms=eval_cpu_ms,
                )
            )

        def collect() -> StepResult:
            t_sample = time.perf_counter_ns()
            got = self._sample(chunks, outputs)
            t2 = time.perf_counter_ns()
            return StepResult(
                DECODE_OK,
                got.sampled,
                saved,
                restored,
                (t1 - t0) / 1e6,
                (t2 - t_sample) / 1e6,
                logprobs=got.logprobs,
                failed=got.failed,
                failed_field=got.failed_field,
                reset=reset,
                eval_cpu_ms=eval_cpu_ms,
                draft_sampled=got.draft_sampled,
                draft_logprobs=got.draft_logprobs,
            )

        return collect

    def _decode(self, *, has_spare: bool) -> _Decoded:
        """One llama_decode of the batch under the CPU share (the context's threads follow it:
        fewer while another model loads, engine/cpu_share.py). `has_spare`: the batch ends
        with a spare row (batch-invariant mode), dropped and the pass decoded again if no KV
        cell is left for it."""
        with cpu_share.forward_pass(self.model.threads) as threads:
            if threads != self._threads:
                self.model.set_threads(*threads)
                self._threads = threads
            cpu0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            status = int(llama_cpp.llama_decode(self.model.ctx, self.batch.struct))
            if has_spare and status == DECODE_KV_FULL:  # no cell left for the spare
                self.batch.drop_spare_row()
                status = int(llama_cpp.llama_decode(self.model.ctx, self.batch.struct))
                has_spare = False
            t1 = time.perf_counter_ns()
            eval_cpu_ms = (time.thread_time_ns() - cpu0) / 1e6
        return _Decoded(status, t0, t1, eval_cpu_ms, has_spare)

    def _apply_adapters(self, adapters: AdapterSet) -> None:
        """The pass's adapter set on the context (llama.cpp rebuilds its graph after a switch)."""
        if self.adapters is not None:
            self.adapters.apply(adapters)
        elif adapters:
            raise RuntimeError("a plan with LoRA adapters for a model that serves none")

    def _embed(
        self,
        chunks: Sequence[Chunk],
        saved: dict[int, bytes],
        restored: dict[int, bool],
        reset: frozenset[int],
    ) -> StepResult:
        """An embedding pass: every token an output, embeddings on for this llama_decode only
        (llama_set_embeddings, as llama-server does per batch), the embedding chunks' rows
        copied out (with pooling NONE llama.cpp keeps them contiguous in batch order:
        llama_get_embeddings). Decode rows riding in the pass are sampled from the logits
        llama.cpp computes for every token of it (row i = batch index i)."""
        outputs = self.batch.fill(chunks, every_output=True)
        llama_cpp.llama_set_embeddings(self.model.ctx, True)
        try:
            status, t0, t1, eval_cpu_ms, _ = self._decode(has_spare=False)
            embeddings: dict[int, Vectors] = {}
            got = _Sampled()
            t2 = t1
            if status == DECODE_OK:
                embeddings = self._take_embeddings(chunks)
                got = self._sample(chunks, outputs, every_output=True)
                t2 = time.perf_counter_ns()
        finally:
            llama_cpp.llama_set_embeddings(self.model.ctx, False)
        return StepResult(
            status,
            got.sampled,
            saved,
            restored,
            (t1 - t0) / 1e6,
            (t2 - t1) / 1e6,
            logprobs=got.logprobs,
            failed=got.failed,
            failed_field=got.failed_field,
            reset=reset,
            eval_cpu_ms=eval_cpu_ms,
            draft_sampled=got.draft_sampled,
            draft_logprobs=got.draft_logprobs,
            embeddings=embeddings,
        )

    def _take_embeddings(self, chunks: Sequence[Chunk]) -> dict[int, Vectors]:
        """The embedding chunks' per-token outputs to the Embedder; the vectors of the inputs
        whose last chunk this was, by slot id."""
        n_tokens, n_embd = int(self.batch.struct.n_tokens), self.model.n_embd
        pointer = llama_cpp.llama_get_embeddings(self.model.ctx)
        rows = np.ctypeslib.as_array(pointer, shape=(n_tokens, n_embd))
        out: dict[int, Vectors] = {}
        start = 0
        for chunk in chunks:
            end = start + len(chunk.tokens)
            if chunk.embedding is not None:
                vectors = self.embedder.add(chunk, rows[start:end])
                if vectors is not None:
                    out[chunk.slot_id] = vectors
            start = end
        return out

    def _sample(
        self, chunks: Sequence[Chunk], outputs: Sequence[int], *, every_output: bool = False
    ) -> _Sampled:
        """The tokens of every chunk with outputs, by slot id (a speculative decode's first in
        `sampled`, the rest in `draft_sampled`). `every_output`: a pass whose every token was
        an output (an embedding pass), so a chunk's logits rows start at its batch index."""
        out = _Sampled()
        ctx = self.model.ctx
        rows = None  # every output's logits, viewed once if a plain greedy request needs them
        ordinal = 0  # output rows before the chunk's first
        for chunk, index in zip(chunks, outputs, strict=True):
            if index < 0:
                continue
            sampler = self.samplers[chunk.request_id]
            chunk_rows = None
            if every_output:
                ordinal = index
            if sampler.is_plain_greedy:
                if rows is None:
                    n_outputs = (
                        sum(len(c.tokens) for c in chunks)
                        if every_output
                        else sum(
                            c.num_outputs for c, i in zip(chunks, outputs, strict=True) if i >= 0
                        )
                    )
                    rows = logits_rows(ctx, n_outputs, self.model.n_vocab)
                chunk_rows = rows[ordinal : ordinal + chunk.num_outputs]
            ordinal += chunk.num_outputs
            self._sample_chunk(chunk, index, sampler, chunk_rows, out)
        return out

    def _sample_chunk(
        self,
        chunk: Chunk,
        index: int,
        sampler: RequestSampler,
        rows: Any,
        out: _Sampled,
    ) -> None:
        """Sample a chunk's outputs in order; a speculative decode stops at the first token that
        differs from its draft (the sampler never sees a position it would not have reached)."""
        ctx = self.model.ctx
        k = self.top_logprobs.get(chunk.request_id)
        tokens: list[int] = []
        logprobs: list[SampledLogprob] = []
        for i in range(chunk.num_outputs):
            token = sampler.sample(ctx, index + i, None if rows is None else rows[i])
            if token == NO_TOKEN:
                out.failed[chunk.slot_id] = sampler.error
                if sampler.error_field:
                    out.failed_field[chunk.slot_id] = sampler.error_field
                break
            tokens.append(token)
            if k is not None:
                logprobs.append(self.logprobs.compute(ctx, index + i, token, k))
            if not acceptance.accepts(chunk, i, token):
                break
        if not tokens:
            return
        out.sampled[chunk.slot_id] = tokens[0]
        if logprobs:
            out.logprobs[chunk.slot_id] = logprobs[0]
        if len(tokens) > 1:
            out.draft_sampled[chunk.slot_id] = tuple(tokens[1:])
            if logprobs:
                out.draft_logprobs[chunk.slot_id] = tuple(logprobs[1:])

    def time_decode(self, chunks: Sequence[Chunk]) -> float:
        """One forward pass of `chunks` without sampling (calibration): llama_decode's wall
        milliseconds. RuntimeError if it fails."""
        self.batch.fill(chunks)
        t0 = time.perf_counter_ns()
        status = int(llama_cpp.llama_decode(self.model.ctx, self.batch.struct))
        elapsed_ms = (time.perf_counter_ns() - t0) / 1e6
        if status != DECODE_OK:
            raise RuntimeError(f"llama_decode failed with status {status} while calibrating")
        return elapsed_ms

    def _edit_kv(
        self, plan: StepPlan, saved: dict[int, bytes], restored: dict[int, bool]
    ) -> frozenset[int]:
        """Apply the plan's KV edits in order. llama_memory_seq_rm may refuse a partial removal
        (recurrent and hybrid memory do; the unified KV cache does not): such a sequence is
        emptied instead, later edits into it (or copies from it) are skipped and it is returned,
        so its request re-prefills from scratch rather than decoding over a stale cache."""
        reset: set[int] = set()
        for op in plan.seq_ops:
            if op.seq_id in reset:
                continue
            if op.kind is SeqOpKind.REMOVE:
                if not self.model.seq_remove(op.seq_id, op.p0, op.p1):
                    self._empty(op.seq_id)
                    reset.add(op.seq_id)
            elif op.kind is SeqOpKind.COPY:
                if op.src_seq_id in reset:
                    self._empty(op.seq_id)
                    reset.add(op.seq_id)
                else:
                    self.model.seq_copy(op.src_seq_id, op.seq_id, op.p0, op.p1)
            elif op.kind is SeqOpKind.SAVE:
                saved[op.seq_id] = self.model.seq_save(op.seq_id)
            else:
                restored[op.seq_id] = self.model.seq_restore(op.seq_id, op.data)
        return frozenset(reset)

    def _empty(self, seq_id: int) -> None:
        if not self.model.seq_remove(seq_id, 0, -1):  # a whole-sequence removal never fails
            raise RuntimeError(f"llama_memory_seq_rm could not empty sequence {seq_id}")

    def _open_sampler(self, spec: SamplerSpec) -> RequestSampler:
        if spec.constraint is None:
            return RequestSampler(
                spec.params,
                spec.seed,
                self.model.n_vocab,
                vocab=self.model.vocab,
                min_tokens=spec.min_tokens,
                suppressed=spec.suppressed,
                reasoning=spec.reasoning,
                resumed=spec.resumed,
            )
        if self._candidates is None:
            self._candidates = Candidates(self.model.n_vocab)
        return RequestSampler(
            spec.params,
            spec.seed,
            self.model.n_vocab,
            constraint=spec.constraint,
            vocab=self.model.vocab,
            candidates=self._candidates,
            min_tokens=spec.min_tokens,
            suppressed=spec.suppressed,
            reasoning=spec.reasoning,
            resumed=spec.resumed,
        )

    def close(self) -> None:
        for sampler in self.samplers.values():
            sampler.close()
        self.samplers.clear()
        self.top_logprobs.clear()
        self.embedder.clear()
