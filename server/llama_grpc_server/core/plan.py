"""Frozen values passed between scheduler, strategy and runner for one tick."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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

    request_id: str
    params: SamplingParams
    seed: int
    output: OutputParams = field(default_factory=OutputParams)
    constraint: Constraint | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one slot fed in this tick at positions start_pos.. ; logits only for the last."""

    slot_id: int
    request_id: str
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
    close_samplers: tuple[str, ...] = ()
    num_decode: int = 0
    num_prefill: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_prefill


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
    logprobs: dict[int, SampledLogprob] = field(default_factory=dict)  # slot_id -> (asked for)
    failed: dict[int, str] = field(default_factory=dict)  # slot_id -> why nothing was sampled
    # Sequences the runner emptied because a partial removal failed; their chunks were skipped.
    reset: frozenset[int] = frozenset()
