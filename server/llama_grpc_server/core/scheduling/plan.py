"""Frozen values passed between scheduler, strategy and runner for one tick."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.reasoning.budget import ReasoningParams
from llama_grpc_server.core.requests.embedding import EmbeddingParams, Vectors
from llama_grpc_server.core.requests.request import (
    MAX_DRAFT_TOKENS,
    Constraint,
    OutputParams,
    SamplingParams,
)
from llama_grpc_server.core.speculation import acceptance

MAX_PAD_ROWS = 3  # enough to reach the next multiple of 4 rows (the AVX-512 build's cheap counts)


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
    # Tokens the sampler may not pick until it has sampled min_tokens tokens (end-of-generation
    # and stop tokens of a request with StoppingParams.min_tokens).
    min_tokens: int = 0
    suppressed: tuple[int, ...] = ()
    reasoning: ReasoningParams | None = None  # a reasoning budget to keep (core.reasoning)
    # A resumed answer's tokens (GenerationRequest.resumed): the sampler takes them as its own
    # before its first sample (penalty history, grammar state, reasoning budget, min_tokens
    # count, the position of its next seeded draw).
    resumed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one slot fed in this tick at positions start_pos.. ; logits only for the last.

    A speculative decode (num_draft > 0) is [the last sampled token, d1 .. dk]: logits for its
    last k + 1 positions; the runner samples position i only while the tokens it sampled so far
    equal d1 .. di (exact-match verification). A pad (is_pad, num_draft 1 .. MAX_PAD_ROWS) is a
    decode with tokens more whose logits are computed and never sampled: rows that make the pass
    cheaper (core.speculation.drafts: llama.cpp's tiled matmul makes some row counts dearer than a
    larger one), removed from the KV cache like a rejected draft."""

    slot_id: int
    request_id: str  # the request's key, as in SamplerSpec
    start_pos: int
    tokens: tuple[int, ...]
    wants_logits: bool
    num_draft: int = 0  # draft tokens after the decode token (speculative decoding)
    is_pad: bool = False  # the draft token is a pad: never sampled, never accepted
    # An embedding request's chunk (StepPlan.is_embedding): what it asked for, and its whole
    # input's length (the runner pools its outputs once the chunk ending there is fed; one
    # starting at 0 starts the input afresh, as after a preemption).
    embedding: EmbeddingParams | None = None
    num_input: int = 0

    @property
    def is_decode(self) -> bool:
        """One slot's next token (with its draft, if any): a decode row, not a prompt chunk."""
        return len(self.tokens) == 1 + self.num_draft and self.wants_logits and self.start_pos > 0

    @property
    def num_pad(self) -> int:
        """Pad rows (0 .. MAX_PAD_ROWS): counted in num_draft as rows, never as drafted tokens."""
        return self.num_draft if self.is_pad else 0

    @property
    def num_outputs(self) -> int:
        """Positions with logits."""
        return self.num_draft + 1 if self.wants_logits else 0

    def num_accepted(self, sampled: Sequence[int]) -> int:
        """Draft tokens the sampled ones (sampled[i] at the position after tokens[i]) agree
        with, up to the first disagreement (core.speculation.acceptance)."""
        return acceptance.num_accepted(self, sampled)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the runner does in one tick: free/open samplers, edit KV, one llama_decode."""

    tick: int
    chunks: tuple[Chunk, ...] = ()
    seq_ops: tuple[SeqOp, ...] = ()
    open_samplers: tuple[SamplerSpec, ...] = ()
    close_samplers: tuple[str, ...] = ()  # request keys
    # An embedding pass (core.requests.embedding): the chunks are embedding requests' prompt tokens,
    # every token an output, llama.cpp's embeddings read instead of logits sampled (the
    # runner turns llama_set_embeddings on for this pass only). Never mixed with generation.
    is_embedding: bool = False
    # The LoRA adapters of every chunk's request (core.adapters): llama.cpp applies adapters to
    # the whole context, so a pass runs one set; the runner switches the context to it first.
    adapters: AdapterSet = ()

    @property
    def num_decode(self) -> int:
        """Slots fed their one next token (decode) in this forward pass."""
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill(self) -> int:
        """Prompt tokens (chunks that are not decodes, so never draft tokens) in this pass."""
        return sum(len(c.tokens) for c in self.chunks if not c.is_decode)

    @property
    def num_draft(self) -> int:
        """Draft tokens of speculative decodes in this forward pass (pads included: rows)."""
        return sum(c.num_draft for c in self.chunks)

    @property
    def num_pad(self) -> int:
        """Pad rows in this forward pass (Chunk.is_pad)."""
        return sum(c.num_pad for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def check(self, n_batch: int, chunk_size: int, computed: Mapping[int, int]) -> None:
        """The invariants every plan keeps (checked each tick: a broken plan would corrupt KV
        or abort llama.cpp): at most n_batch tokens, one non-empty chunk per busy slot starting
        where its computed KV ends (`computed`: slot_id -> tokens computed), prompt chunks of
        at most chunk_size, drafts only on decodes and of at most MAX_DRAFT_TOKENS.
        RuntimeError otherwise (the engine fails loudly)."""
        if self.num_tokens > n_batch:
            raise RuntimeError(f"plan exceeds n_batch: {self.num_tokens} > {n_batch}")
        seen: set[int] = set()
        for chunk in self.chunks:
            if chunk.slot_id in seen or chunk.slot_id not in computed or not chunk.tokens:
                raise RuntimeError(f"bad chunk for slot {chunk.slot_id}")
            if chunk.start_pos != computed[chunk.slot_id]:
                raise RuntimeError(f"non-contiguous chunk for slot {chunk.slot_id}")
            if chunk.num_draft and (not chunk.is_decode or chunk.num_draft > MAX_DRAFT_TOKENS):
                raise RuntimeError(f"bad draft for slot {chunk.slot_id}")
            if chunk.is_pad and not 1 <= chunk.num_draft <= MAX_PAD_ROWS:
                raise RuntimeError(f"bad draft (a pad) for slot {chunk.slot_id}")
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
    """What the runner observed: llama_decode's status and one sampled token per logits chunk
    (a speculative decode's further tokens in draft_sampled)."""

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
    # slot_id -> the request field a failure points at when it is not the constraint's (a
    # resumed token the constraint refuses: params.resume.token_ids[i])
    failed_field: dict[int, str] = field(default_factory=dict)
    # Sequences the runner emptied because a partial removal failed; their chunks were skipped.
    reset: frozenset[int] = frozenset()
    # A speculative decode's tokens sampled after `sampled[slot]`, at its draft positions: the
    # i-th was sampled after draft token i, which the one before it agreed with. The last one
    # may disagree with the draft (the sampler's own choice there). With their logprobs, when
    # the request asked for them.
    draft_sampled: dict[int, tuple[int, ...]] = field(default_factory=dict)
    draft_logprobs: dict[int, tuple[SampledLogprob, ...]] = field(default_factory=dict)
    # An embedding pass's finished inputs: slot_id -> the request's vectors (for chunks that
    # fed an input's last token).
    embeddings: dict[int, Vectors] = field(default_factory=dict)

    def tokens_of(self, slot_id: int) -> tuple[int, ...]:
        """Every token sampled for a slot, in order (none when it sampled nothing)."""
        first = self.sampled.get(slot_id)
        if first is None:
            return ()
        return (first, *self.draft_sampled.get(slot_id, ()))

    def logprobs_of(self, slot_id: int) -> tuple[SampledLogprob | None, ...]:
        """The logprobs of tokens_of(slot_id), one each (None when not asked for)."""
        first = self.logprobs.get(slot_id)
        more = self.draft_logprobs.get(slot_id, ())
        n = len(self.draft_sampled.get(slot_id, ()))
        return (first, *(more[i] if i < len(more) else None for i in range(n)))


# What StepRunner.launch returns: call it to sample and get the tick's result.
Collect = Callable[[], StepResult]


class StepRunner(Protocol):
    """Executes plans (engine.runner.Runner over llama.cpp; testing.FakeRunner in tests).
    execute(plan) is launch(plan)(): launch runs the forward pass up to llama_decode (which
    returns before a GPU has finished), the function it returns samples."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def launch(self, plan: StepPlan) -> Collect: ...
