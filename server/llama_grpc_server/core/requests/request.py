"""Request values (what a caller asked for), the live Request the scheduler mutates, and the events
a request emits. Pure Python: no llama_cpp, no grpc."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.reasoning.budget import ReasoningParams
from llama_grpc_server.core.requests.embedding import EmbeddingParams, Vectors
from llama_grpc_server.core.tools.types import ToolCall, ToolCallDelta
from llama_grpc_server.errors import ServiceError


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    MAX_TOKENS = "max_tokens"
    CONTEXT_LENGTH = "context_length"
    TIME_LIMIT = "time_limit"
    EMBEDDED = "embedded"  # an embedding request: its vectors are made (Finished.embedding)
    # A chat request with tools ended its turn after tool calls (set by core.tools.stream, never
    # by the scheduler: the engine sees an end of generation)
    TOOL_CALLS = "tool_calls"


class Priority(enum.IntEnum):
    """Queue order within a tenant; waiting raises it (aging), so LOW is never starved."""

    LOW = 0
    NORMAL = 1
    HIGH = 2


class RequestState(enum.Enum):
    QUEUED = "queued"
    RESTORING = "restoring"  # admitted, waiting for its KV cache from the disk tier's I/O thread
    PREFILLING = "prefilling"
    GENERATING = "generating"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampler settings; temperature <= 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """When generation ends. max_tokens_is_default marks a server-chosen limit (clamped to fit)."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    time_limit_ms: int | None = None
    max_tokens_is_default: bool = False
    # Until this many tokens are generated, end-of-generation and stop tokens cannot be sampled
    # and stop strings are not looked for (vLLM's min_tokens).
    min_tokens: int = 0


@dataclass(frozen=True, slots=True)
class OutputParams:
    """Extra per-token output: top_logprobs > 0 implies logprobs."""

    logprobs: bool = False
    top_logprobs: int = 0
    # Special tokens whose text the output must show (llama.cpp renders special tokens as
    # nothing): the markers of a tool-call format, e.g. Llama 3's <|python_tag|>, that its
    # parser reads. (token id, text) pairs.
    shown_specials: tuple[tuple[int, str], ...] = ()

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


class SpeculativeMode(enum.Enum):
    """Prompt-lookup speculative decoding of one request (core.speculation.speculator)."""

    OFF = "off"
    AUTO = "auto"  # draft when the measured tick costs and the request's acceptance say it pays
    ON = "on"  # draft whatever the n-gram lookup finds, every tick


MAX_DRAFT_TOKENS = 32  # draft_max at most (a request's, and the server's)
MAX_NGRAM = 16  # ngram_max at most


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculation settings, resolved: a request's own (SpeculativeParams) over the server's."""

    mode: SpeculativeMode = SpeculativeMode.OFF
    draft_max: int = 16  # draft tokens per tick at most
    ngram_min: int = 2  # shortest suffix of the tokens that may match earlier tokens
    ngram_max: int = 4  # longest (tried first)


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """What a request asked for; None takes the server's value (SpeculativeConfig)."""

    mode: SpeculativeMode | None = None
    draft_max: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None

    def resolve(self, defaults: SpeculativeConfig) -> SpeculativeConfig:
        return SpeculativeConfig(
            mode=defaults.mode if self.mode is None else self.mode,
            draft_max=defaults.draft_max if self.draft_max is None else self.draft_max,
            ngram_min=defaults.ngram_min if self.ngram_min is None else self.ngram_min,
            ngram_max=defaults.ngram_max if self.ngram_max is None else self.ngram_max,
        )


@dataclass(frozen=True, slots=True)
class Constraint:
    """A GBNF grammar the output must match (a JSON Schema arrives converted to one); `field`
    is where an error about it points. With `triggers` the grammar is lazy (a structural tag,
    core/constrained/structural_tag.py): the output is free until one of these strings appears, and
    the grammar applies from there on, starting with one of `starts`."""

    gbnf: str
    root: str = "root"
    field: str = "params.grammar.gbnf"
    triggers: tuple[str, ...] = ()
    starts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, ready for the scheduler. Deadlines are time.monotonic() seconds."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stopping: StoppingParams = StoppingParams()
    session_id: str = ""
    cache_scope: str = ""
    cache_prompt: bool = True
    deadline: float | None = None
    output: OutputParams = OutputParams()
    constraint: Constraint | None = None
    num_truncated: int = 0  # prompt tokens dropped to fit the context (truncate_left)
    # Who asked ("" = anonymous: no authentication configured). Requests are keyed by
    # (tenant, request_id), so tenants' x-request-ids never collide; cache_scope already
    # carries the tenant (rpc layer), so tenants never share cache entries.
    tenant: str = ""
    priority: Priority = Priority.NORMAL
    # False: the response cache (core.response_cache) neither answers nor stores this request.
    cache_response: bool = True
    # Prompt-lookup speculative decoding (core.speculation.speculator); unset fields take the
    # server's.
    speculative: SpeculativeParams = SpeculativeParams()
    # An embedding request (core.requests.embedding): prefill only, every prompt token's output
    # pooled into Finished.embedding; nothing is sampled or generated.
    embedding: EmbeddingParams | None = None
    # A thinking request with a reasoning budget (core.reasoning.budget; None: no budget)
    reasoning: ReasoningParams | None = None
    # LoRA adapters applied for the whole answer (core.adapters; (): the base model). The rpc
    # layer has put them in cache_scope too (core.adapters.scoped).
    adapters: AdapterSet = ()
    # A resumed answer (params.resume, docs/api.md#resumable-streams): the tokens of the answer
    # its caller already has. They follow the prompt as a prefix to compute (or find cached),
    # and count as the answer's first tokens: the text state, stop strings, min_tokens,
    # max_tokens and the sampler (penalties, grammar, reasoning budget, the seeded draws'
    # positions) are where they would be after generating them; nothing is sent for them, and
    # the first delta's index is their count. Usage counts them as completion tokens.
    resumed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # An embedding request needs every token's output, so no prefix KV is reused (reused
        # cells have none) and its KV is not kept as a prefix cache; the response cache keys
        # generation settings, not embedding ones.
        if self.embedding is not None:
            object.__setattr__(self, "cache_prompt", False)
            object.__setattr__(self, "cache_response", False)

    @property
    def key(self) -> str:
        return request_key(self.tenant, self.request_id)

    @property
    def is_embedding(self) -> bool:
        return self.embedding is not None


def request_key(tenant: str, request_id: str) -> str:
    """The engine's id of a request, unique among those in flight (a tenant's own request ids
    are): samplers, text state and streams are keyed by it, so two tenants' requests sharing an
    x-request-id never mix. The request id itself for the anonymous tenant. NUL never occurs in
    a request id (the rpc layer takes printable ones only), so no two pairs share a key."""
    return f"{tenant}\0{request_id}" if tenant else request_id


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    truncated_prompt_tokens: int = 0
    cached_response: bool = False  # replayed from the response cache: nothing was computed
    # Speculative decoding: tokens drafted (fed for verification) and drafted tokens the sampler
    # agreed with (each became an output token, or ended the request).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative at a generation step."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its step."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output: token ids generated since the last delta and the text that is safe to show;
    logprobs has one entry per token id when the request asked for them. `index` is the
    position in the answer of its first token (for a delta without tokens, the number of tokens
    before it: only the end of an answer has such deltas, the text held back until then)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    # The request's prompt tokens served from cache (known once its prefill is done; 0 on a
    # delta that only flushes held-back text).
    cached_prompt_tokens: int = 0
    # Tool-call pieces parsed out of the text (a chat request with tools: core.tools.stream)
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # Thinking split from the text (a chat request of a thinking model: core.reasoning.stream)
    reasoning: str = ""
    index: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a request that ended normally."""

    reason: FinishReason
    usage: Usage
    timings: Timings
    seed: int
    matched_stop: str = ""
    matched_token_id: int | None = None
    slot_id: int = -1
    # An embedding request's vectors (one, or one per token with pooling none); None otherwise.
    embedding: Vectors | None = None
    # A chat request with tools: its complete tool calls (core.tools.stream)
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The last event of a request that ended with an error."""

    error: ServiceError


@dataclass(frozen=True, slots=True)
class Resumed:
    """The first event of a resumed request (GenerationRequest.resumed): the text its resumed
    tokens released when they were generated, which the caller already has (nothing is sent
    for it). The rpc layer's chat transforms (thinking split, tool calls) read it, so they go on
    where the cut stream left off; every other consumer skips it."""

    text: str


Event = TokenDelta | Finished | Failed | Resumed


@dataclass(slots=True)
class ReaderProgress:
    """How far the consumer of a request's stream has read. Shared by two threads, each
    writing its own field: the consumer counts the tokens it took (num_read); the scheduler
    sets is_paused before it compares that count with what it sent, so a consumer that reads
    after the comparison sees the flag and wakes the engine (streams.EngineStream)."""

    num_read: int = 0
    is_paused: bool = False


def _ms(start_ns: int, end_ns: int) -> float:
    return max(0.0, (end_ns - start_ns) / 1e6)


@dataclass(slots=True)
class Request:
    """A request inside the scheduler. Only the engine thread mutates it.

    Tokens are one list, prompt then output; `num_computed` counts those whose KV the slot holds,
    so prefill, decode and resume after preemption are one rule: feed tokens[num_computed:].
    """

    spec: GenerationRequest
    arrival_ns: int = 0  # set by whoever receives it; 0 = when the scheduler queues it
    state: RequestState = RequestState.QUEUED
    tokens: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_computed: int = 0
    num_cached_prompt: int = 0
    slot_id: int = -1
    seed: int = 0
    admitted_ns: int = 0
    first_token_ns: int = 0
    last_served_tick: int = 0
    num_preemptions: int = 0
    # Waiting for a busy slot to finish computing a shared prefix, then copying it (seq_cp).
    wait_slot_id: int = -1
    wait_key: str = ""  # the donor request's key
    wait_tokens: int = 0
    restoring_tokens: int = 0  # > 0 while a RAM-tier restore of this many tokens is in flight
    # The disk tier: a read was asked for (never twice), the read in flight (0: none), and the
    # saved state it brought (tokens, blob) until the request is placed with it.
    disk_tried: bool = False
    disk_ticket: int = 0
    disk_loaded: tuple[list[int], bytes] | None = None
    # Back-pressure: the consumer's progress (None: nobody reads, e.g. scheduler tests), the
    # tokens sent in deltas, and since when the scheduler skips the request for a slow reader.
    reader: ReaderProgress | None = None
    num_sent: int = 0
    paused_since_ns: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for it
    num_accepted_draft: int = 0  # ... and accepted
    # spec.key, computed once: the scheduler and the loop compare it for every token of a tick
    key: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.tokens = list(self.spec.prompt_tokens)
        self.num_prompt = len(self.tokens)
        self.tokens += self.spec.resumed  # a resumed answer: its tokens so far
        self.key = self.spec.key

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def is_waiting(self) -> bool:
        return self.wait_slot_id >= 0

    @property
    def is_blocked(self) -> bool:
        """Holds a slot but gets no tokens yet (waiting for a shared prefix or a restore)."""
        return self.wait_slot_id >= 0 or self.restoring_tokens > 0

    @property
    def num_output(self) -> int:
        """The answer's tokens so far: resumed ones (GenerationRequest.resumed) included."""
        return len(self.tokens) - self.num_prompt

    @property
    def num_resumed(self) -> int:
        return len(self.spec.resumed)

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_output > 0

    def deadline_passed(self, now: float) -> bool:
        return self.spec.deadline is not None and now >= self.spec.deadline

    def time_limit_passed(self, now_ns: int) -> bool:
        limit = self.spec.stopping.time_limit_ms
        return limit is not None and (now_ns - self.arrival_ns) >= limit * 1_000_000

    def usage(self) -> Usage:
        return Usage(
            self.num_prompt,
            self.num_output,
            self.num_cached_prompt,
            self.spec.num_truncated,
            draft_tokens=self.num_draft_tokens,
            accepted_draft_tokens=self.num_accepted_draft,
        )

    def timings(self, now_ns: int) -> Timings:
        admitted = self.admitted_ns or now_ns
        first = self.first_token_ns or now_ns
        return Timings(
            queue_ms=_ms(self.arrival_ns, admitted),
            ttft_ms=_ms(self.arrival_ns, first),
            prefill_ms=_ms(admitted, first),
            decode_ms=_ms(first, now_ns),
            total_ms=_ms(self.arrival_ns, now_ns),
        )


Emitted = list[tuple[Request, Event]]
"""Events to deliver, each with its request, in order (what a scheduler step returns)."""
