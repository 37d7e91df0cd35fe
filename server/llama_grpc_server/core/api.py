"""What the rpc layer sees of the engine: the EngineApi protocol and the plain values it returns.
Pure Python; the real implementation is loop.EngineLoop, tests may use fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llama_grpc_server.core.adapters import AdapterCatalog, AdapterEntry, AdapterUsage
from llama_grpc_server.core.kv.events import KvEventLog
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import Event, GenerationRequest
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.core.tools.types import ToolSpec
from llama_grpc_server.errors import ServiceError


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts found when the model was loaded."""

    model_name: str
    model_path: str
    n_ctx_train: int
    n_ctx: int
    n_vocab: int
    bos_token_id: int | None
    eos_token_id: int | None
    eog_token_ids: tuple[int, ...]
    has_chat_template: bool
    n_parallel: int
    n_batch: int
    description: str
    size_bytes: int
    n_params: int
    add_bos: bool
    chat_template: str = ""  # the template in use for messages: a built-in, "gguf" or none
    chat_template_origin: str = ""  # why that one (core.requests.chat.template_origin), for the log
    n_embd: int = 0  # the dimension of its embeddings
    pooling: str = ""  # the GGUF's pooling_type ("mean", "cls", "last", "none", "rank"; "": none)
    architecture: str = ""  # general.architecture
    # An encoder-only model (BERT): it embeds and cannot generate
    # (core.requests.embedding.refuse_generation)
    is_encoder: bool = False


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    slot_id: int
    state: str  # "idle" | "prefilling" | "generating"
    request_id: str
    cached_tokens: int
    tenant: str = ""  # of the request in the slot: the rpc layer hides other tenants' ids
    buffered_tokens: int = 0  # sent to the request's stream, not yet read by its caller


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Live state plus cumulative counters since start."""

    n_parallel: int
    active_slots: int
    idle_slots: int
    prefilling_slots: int
    generating_slots: int
    queue_depth: int
    kv_cells_used: int
    kv_cells_total: int
    requests_started: int
    requests_finished: int
    requests_failed: int
    requests_cancelled: int
    requests_rejected: int
    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int
    ticks: int
    avg_batch_size: float
    preemptions: int
    uptime_s: float
    slots: tuple[SlotSnapshot, ...]
    batch_strategy: str
    prefix_cache_hit_rate: float
    ram_cache_entries: int = 0
    ram_cache_bytes: int = 0
    ram_cache_hits: int = 0
    ram_cache_misses: int = 0
    ram_cache_evictions: int = 0
    engine_state: str = "running"  # "starting" | "running" | "failed" | "stopped"
    engine_error: str = ""  # why the engine failed ("" unless engine_state is "failed")
    decode_seconds: float = 0.0  # wall time inside llama_decode since start
    decode_cpu_seconds: float = 0.0  # the engine thread's CPU time inside llama_decode
    disk_cache: DiskTierStats | None = None  # None = no disk tier
    # The response cache (core.response_cache), when it is on: filled in by its engine wrapper.
    response_cache_entries: int = 0
    response_cache_bytes: int = 0
    response_cache_hits: int = 0
    response_cache_misses: int = 0
    response_cache_evictions: int = 0
    # Speculative decoding since start: draft tokens verified, those accepted (accepted /
    # draft = acceptance rate) and forward passes that carried drafts.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_ticks: int = 0
    # ... of them the draft model's (--draft-model): draft tokens verified, those accepted
    spec_model_draft_tokens: int = 0
    spec_model_accepted_tokens: int = 0
    # Requests whose caller's deadline passed (in the queue, in a slot, or the RPC ended by it):
    # neither failed nor cancelled.
    requests_deadline_exceeded: int = 0
    # Back-pressure (--stream-buffer-tokens): requests not decoding now because their caller
    # has the whole buffer unread; since start, requests ended for reading nothing for
    # --stalled-reader-s, and times a request was paused.
    paused_streams: int = 0
    stalled_readers: int = 0
    stream_pauses: int = 0
    # Ticks the watchdog found running past its bound (--watchdog-s): 1 once the engine hung.
    watchdog_trips: int = 0
    # Per LoRA adapter since start (core.adapters), and passes that switched adapter sets.
    adapters: tuple[AdapterUsage, ...] = ()
    adapter_switches: int = 0


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """The KV disk tier (kv_disk.KvDiskStore): files of this engine's fingerprint and counters
    since start."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0  # restores from disk
    misses: int = 0  # lookups that restored nothing from disk
    writes: int = 0
    evictions: int = 0  # files deleted to fit the byte budget
    verify_failures: int = 0  # corrupt, truncated or mismatched files (skipped and deleted)
    read_seconds: float = 0.0  # reading + verifying files for restores, in all
    read_bytes: int = 0
    write_failures: int = 0  # writes that raised (a full, read-only or failing volume)
    # reads that brought nothing back (file gone, unreadable, corrupt, the read queue full):
    # the request computed its prompt instead
    read_failures: int = 0


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """What clearing the caches freed (ClearCache)."""

    cleared_slots: int = 0
    freed_kv_cells: int = 0
    freed_ram_entries: int = 0
    freed_ram_bytes: int = 0
    freed_disk_entries: int = 0
    freed_disk_bytes: int = 0
    freed_response_entries: int = 0
    freed_response_bytes: int = 0


class RequestStream(Protocol):
    """Events of one submitted request, ending with exactly one Finished or Failed."""

    def __aiter__(self) -> AsyncIterator[Event]: ...

    def cancel(self, *, deadline_exceeded: bool = False) -> None:
        """Ask the engine to drop the request at its next tick (idempotent). With
        `deadline_exceeded` the caller left because its deadline passed: the request ends as
        DeadlineExceeded (and is counted so), not as a cancellation."""
        ...


class GrammarCompiler(Protocol):
    """Checks constraints where the model's vocabulary lives (engine/), for validation."""

    def check_grammar(self, gbnf: str, root: str) -> None:
        """Raise ValueError with the parser's message unless the GBNF grammar compiles."""
        ...

    def json_schema_to_grammar(self, schema: str) -> str:
        """The GBNF of a JSON Schema (JSON text); ValueError when it is invalid or unsupported."""
        ...


class Vocabulary(GrammarCompiler, Protocol):
    """The model's vocabulary and templates, thread-safe (engine.llama.LlamaModel)."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str: ...

    def special_piece(self, token_id: int) -> bytes: ...

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str: ...

    def tool_format(self, template: str) -> str: ...

    def reasoning_format(self, template: str) -> str: ...


class EngineApi(Protocol):
    """The engine as the servicer uses it. Every method is safe to call from the event loop."""

    @property
    def model_info(self) -> ModelInfo: ...

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises ServiceError (PromptTooLong, Overloaded, ShuttingDown) now."""
        ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int], *, render_special: bool) -> str: ...

    def token_piece(self, token_id: int) -> str: ...

    def check_grammar(self, gbnf: str, root: str) -> None: ...

    def json_schema_to_grammar(self, schema: str) -> str: ...

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template: str,
        tools: Sequence[ToolSpec] = (),
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation offering `tools`, with more template `variables`
        (enable_thinking, ...); ValueError when the template cannot render it."""
        ...

    def reasoning_format(self, template: str) -> str:
        """The name of the template's thinking format (core.reasoning.formats), "" for a model
        that does not think; ValueError for an unknown template."""
        ...

    def tool_format(self, template: str) -> str:
        """The name of the tool-call format (core.tools.formats) the template's model writes;
        ValueError for an unknown template."""
        ...

    def stats(self) -> StatsSnapshot: ...

    @property
    def adapters(self) -> AdapterCatalog:
        """The model's loaded LoRA adapters, which requests are resolved against; any thread."""
        ...

    async def load_adapter(self, name: str, path: str, default_scale: float) -> AdapterEntry:
        """Check an adapter file against the model and load it (InvalidRequest naming the
        mismatch; FailedPrecondition for a name in use)."""
        ...

    async def unload_adapter(self, name: str) -> int:
        """Refuse the adapter to new requests and free it once its requests are done; how many
        queued or running requests use it now."""
        ...

    @property
    def kv_events(self) -> KvEventLog:
        """What the KV cache holds, as numbered block events (SubscribeKvEvents); any thread."""
        ...

    def end_all(self, error: ServiceError) -> None:
        """End every queued and running request with `error` (a drain's grace period is over)."""
        ...

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Every tenant's new limits (a reloaded tokens file), handed to the scheduler between
        two ticks; a request submitted after this call is already judged by them."""
        ...

    async def clear_cache(self) -> CacheCleared:
        """Forget idle slots' prefix caches and the RAM tier at the next tick boundary (and the
        stored responses, with the response cache on)."""
        ...

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(cause)` once if the engine dies (from any thread); at once if it has."""
        ...

    def close(self) -> None:
        """Stop the engine thread, fail what is still queued, free llama.cpp resources (blocks)."""
        ...
