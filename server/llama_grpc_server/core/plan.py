"""Frozen values passed between scheduler, strategy and runner for one tick."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from llama_grpc_server.core.request import Constraint, OutputParams, SamplingParams


class SeqOpKind(enum.Enum):
    REMOVE = "remove"  # llama_memory_seq_rm(seq_id, p0, -1)
    COPY = "copy"  # llama_memory_seq_cp(src_seq_id, seq_id, 0, p1)
    SAVE = "save"  # llama_state_seq_get_data(seq_id) -> StepResult.saved[seq_id]
    RESTORE = "restore"  # llama_state_seq_set_data(data, seq_id) -> StepResult.restored


@dataclass(frozen=True, slots=True)
class SeqOp:
    """A KV-cache edit applied before the tick's decode, in plan order."""

    kind: SeqOpKind
    seq_id: int
    p0: int = 0
    p1: int = -1
    src_seq_id: int = -1
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class SamplerSpec:
    """A sampler to create for a request before its first sample."""

    request_id: str  # the request's key (GenerationRequest.key), unique across tenants
    params: SamplingParams
    seed: int
    output: OutputParams = field(default_factory=OutputParams)
    constraint: Constraint | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one slot fed in this tick at positions start_pos.. ; logits only for the last."""

    slot_id: int
    request_id: str  # the request's key, as in SamplerSpec
    start_pos: int
    tokens: tuple[int, ...]
    wants_logits: bool

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and self.wants_logits and self.start_pos > 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the runner does in one tick: free/open samplers, edit KV, one llama_decode."""

    tick: int
    chunks: tuple[Chunk, ...] = ()
    seq_ops: tuple[SeqOp, ...] = ()
    open_samplers: tuple[SamplerSpec, ...] = ()
    close_samplers: tuple[str, ...] = ()  # request keys

    @property
    def num_decode(self) -> int:
        """Slots fed their one next token (decode) in this forward pass."""
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill(self) -> int:
        """Prompt tokens (chunks that are not decodes) in this forward pass."""
        return sum(len(c.tokens) for c in self.chunks if not c.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def check(self, n_batch: int, chunk_size: int, computed: Mapping[int, int]) -> None:
        """The invariants every plan keeps (checked each tick: a broken plan would corrupt KV
        or abort llama.cpp): at most n_batch tokens, one non-empty chunk per busy slot starting
        where its computed KV ends (`computed`: slot_id -> tokens computed), prompt chunks of
        at most chunk_size. RuntimeError otherwise (the engine fails loudly)."""
        if self.num_tokens > n_batch:
            raise RuntimeError(f"plan exceeds n_batch: {self.num_tokens} > {n_batch}")
        seen: set[int] = set()
        for chunk in self.chunks:
            if chunk.slot_id in seen or chunk.slot_id not in computed or not chunk.tokens:
                raise RuntimeError(f"bad chunk for slot {chunk.slot_id}")
            if chunk.start_pos != computed[chunk.slot_id]:
                raise RuntimeError(f"non-contiguous chunk for slot {chunk.slot_id}")
            if not chunk.is_decode and len(chunk.tokens) > chunk_size:
                raise RuntimeError(f"chunk over chunk_size for slot {chunk.slot_id}")
            seen.add(chunk.slot_id)


DECODE_OK = 0
DECODE_KV_FULL = 1


@dataclass(frozen=True, slots=True)
class SampledLogprob:
    """The model's log-probability of a sampled token and the top alternatives, most likely
    first, as (token id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the runner observed: llama_decode's status and one sampled token per logits chunk."""

    status: int = DECODE_OK
    sampled: dict[int, int] = field(default_factory=dict)  # slot_id -> token
    saved: dict[int, bytes] = field(default_factory=dict)  # seq_id -> state (SAVE ops)
    restored: dict[int, bool] = field(default_factory=dict)  # seq_id -> ok (RESTORE ops)
    eval_ms: float = 0.0
    sample_ms: float = 0.0
    # The engine thread's own CPU time inside llama_decode (its helper threads not included).
    eval_cpu_ms: float = 0.0
    logprobs: dict[int, SampledLogprob] = field(default_factory=dict)  # slot_id -> (asked for)
    failed: dict[int, str] = field(default_factory=dict)  # slot_id -> why nothing was sampled
    # Sequences the runner emptied because a partial removal failed; their chunks were skipped.
    reset: frozenset[int] = frozenset()


class StepRunner(Protocol):
    """Executes plans (engine.runner.Runner over llama.cpp; testing.FakeRunner in tests)."""

    def execute(self, plan: StepPlan) -> StepResult: ...
