"""Runner: executes a StepPlan — samplers, KV edits, one llama_decode, sampling. Decides nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence

import llama_cpp

from llama_grpc_server.core.plan import (
    DECODE_OK,
    Chunk,
    SampledLogprob,
    SamplerSpec,
    SeqOpKind,
    StepPlan,
    StepResult,
)
from llama_grpc_server.engine import cpu_share
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.logprobs import LogprobComputer
from llama_grpc_server.engine.sampler import NO_TOKEN, Candidates, RequestSampler, logits_rows


class Runner:
    """Owns the batch and the per-request samplers; used only by the engine thread."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.batch = Batch(model.n_batch)
        self.samplers: dict[str, RequestSampler] = {}
        self.top_logprobs: dict[str, int] = {}  # request_id -> k, only for those asking
        self.logprobs = LogprobComputer(model.n_vocab)
        self._candidates: Candidates | None = None  # allocated for the first constraint
        self._threads = model.threads  # what the context decodes with now

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.close_samplers:
            sampler = self.samplers.pop(request_id, None)
            if sampler is not None:
                sampler.close()
            self.top_logprobs.pop(request_id, None)
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
            return StepResult(saved=saved, restored=restored, reset=reset)
        outputs = self.batch.fill(chunks)
        with cpu_share.forward_pass(self.model.threads) as threads:
            if threads != self._threads:  # fewer while another model loads (cpu_share)
                self.model.set_threads(*threads)
                self._threads = threads
            cpu0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            status = int(llama_cpp.llama_decode(self.model.ctx, self.batch.struct))
            t1 = time.perf_counter_ns()
            eval_cpu_ms = (time.thread_time_ns() - cpu0) / 1e6
        if status != DECODE_OK:
            return StepResult(
                status,
                saved=saved,
                restored=restored,
                eval_ms=(t1 - t0) / 1e6,
                reset=reset,
                eval_cpu_ms=eval_cpu_ms,
            )
        sampled, logprobs, failed = self._sample(chunks, outputs)
        t2 = time.perf_counter_ns()
        return StepResult(
            DECODE_OK,
            sampled,
            saved,
            restored,
            (t1 - t0) / 1e6,
            (t2 - t1) / 1e6,
            logprobs=logprobs,
            failed=failed,
            reset=reset,
            eval_cpu_ms=eval_cpu_ms,
        )

    def _sample(
        self, chunks: Sequence[Chunk], outputs: Sequence[int]
    ) -> tuple[dict[int, int], dict[int, SampledLogprob], dict[int, str]]:
        """One token per chunk with an output: (sampled, logprobs, failed) by slot id."""
        sampled: dict[int, int] = {}
        logprobs: dict[int, SampledLogprob] = {}
        failed: dict[int, str] = {}
        ctx = self.model.ctx
        rows = None  # every output's logits, viewed once if a plain greedy request needs them
        ordinal = -1
        for chunk, index in zip(chunks, outputs, strict=True):
            if index < 0:
                continue
            ordinal += 1
            sampler = self.samplers[chunk.request_id]
            row = None
            if sampler.is_plain_greedy:
                if rows is None:
                    n_outputs = sum(1 for i in outputs if i >= 0)
                    rows = logits_rows(ctx, n_outputs, self.model.n_vocab)
                row = rows[ordinal]
            token = sampler.sample(ctx, index, row)
            if token == NO_TOKEN:
                failed[chunk.slot_id] = sampler.error
                continue
            sampled[chunk.slot_id] = token
            k = self.top_logprobs.get(chunk.request_id)
            if k is not None:
                logprobs[chunk.slot_id] = self.logprobs.compute(ctx, index, token, k)
        return sampled, logprobs, failed

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
            return RequestSampler(spec.params, spec.seed, self.model.n_vocab)
        if self._candidates is None:
            self._candidates = Candidates(self.model.n_vocab)
        return RequestSampler(
            spec.params,
            spec.seed,
            self.model.n_vocab,
            constraint=spec.constraint,
            vocab=self.model.vocab,
            candidates=self._candidates,
        )

    def close(self) -> None:
        for sampler in self.samplers.values():
            sampler.close()
        self.samplers.clear()
        self.top_logprobs.clear()
