"""A fake runner for scheduler tests: keeps per-sequence token lists like a KV cache, enforces
llama_decode's rules (contiguous positions, capacity) and samples a deterministic function of
the sequence's whole context, so a preempted-and-resumed request must produce the same tokens."""

from __future__ import annotations

from collections import defaultdict

from llama_grpc_server.core.plan import (
    DECODE_KV_FULL,
    SeqOpKind,
    StepPlan,
    StepResult,
)


class FakeRunner:
    def __init__(
        self, n_vocab: int = 97, kv_cells: int = 1_000_000, *, refuse_partial_removal: bool = False
    ) -> None:
        self.n_vocab = n_vocab
        self.kv_cells = kv_cells
        # Like recurrent memory: seq_rm(seq, p0 > 0) fails; the runner empties the sequence.
        self.refuse_partial_removal = refuse_partial_removal
        self.kv: dict[int, list[int]] = defaultdict(list)
        self.samplers: set[str] = set()
        self.plans: list[StepPlan] = []
        self.fed: dict[str, int] = defaultdict(int)  # request_id -> tokens fed

    def next_token(self, context: list[int]) -> int:
        return (sum(context) * 31 + len(context) * 7) % self.n_vocab

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for request_id in plan.close_samplers:
            self.samplers.discard(request_id)
        for spec in plan.open_samplers:
            assert spec.request_id not in self.samplers
            self.samplers.add(spec.request_id)
        saved: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        reset: set[int] = set()
        for op in plan.seq_ops:
            if op.seq_id in reset:
                continue
            if op.kind is SeqOpKind.REMOVE:
                is_partial = 0 < op.p0 < len(self.kv[op.seq_id])
                if is_partial and self.refuse_partial_removal:
                    self.kv[op.seq_id].clear()
                    reset.add(op.seq_id)
                del self.kv[op.seq_id][op.p0 :]
            elif op.kind is SeqOpKind.COPY and op.src_seq_id in reset:
                self.kv[op.seq_id].clear()
                reset.add(op.seq_id)
            elif op.kind is SeqOpKind.COPY:
                assert not self.kv[op.seq_id], "copy into a non-empty sequence"
                self.kv[op.seq_id] = list(self.kv[op.src_seq_id][: op.p1])
            elif op.kind is SeqOpKind.SAVE:
                saved[op.seq_id] = ",".join(map(str, self.kv[op.seq_id])).encode()
            else:
                assert not self.kv[op.seq_id], "restore into a non-empty sequence"
                self.kv[op.seq_id] = [int(t) for t in op.data.decode().split(",")]
                restored[op.seq_id] = True
        used = sum(len(v) for v in self.kv.values())
        if used + plan.num_tokens > self.kv_cells:
            return StepResult(
                status=DECODE_KV_FULL, saved=saved, restored=restored, reset=frozenset(reset)
            )
        sampled = {}
        for chunk in plan.chunks:
            if chunk.slot_id in reset:
                continue
            seq = self.kv[chunk.slot_id]
            assert chunk.start_pos == len(seq), "positions must continue the sequence"
            seq.extend(chunk.tokens)
            self.fed[chunk.request_id] += len(chunk.tokens)
            if chunk.wants_logits:
                assert chunk.request_id in self.samplers, "sampling without a sampler"
                sampled[chunk.slot_id] = self.next_token(seq)
        return StepResult(sampled=sampled, saved=saved, restored=restored, reset=frozenset(reset))
