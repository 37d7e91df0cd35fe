"""Frozen result values of the client and their conversion from llama_grpc.v1 messages.

Users see only these values; no grpc or protobuf type leaks out. Imports no grpc.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from google.protobuf.message import Message

from llama_grpc.v1 import llm_service_pb2 as pb

_FINISH_PREFIX = "FINISH_REASON_"
_MODEL_STATE_PREFIX = "MODEL_STATE_"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from the prefix cache instead of being computed (all of them
    # when cached_response is True).
    cached_prompt_tokens: int
    # Prompt tokens dropped by context_overflow="truncate_left" (not in prompt_tokens).
    truncated_prompt_tokens: int = 0
    # The whole result was replayed from the server's response cache (--response-cache-mb).
    cached_response: bool = False
    # Speculative decoding (speculative="auto"/"on"): draft tokens the server verified, and
    # those the sampler agreed with.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side timings of one request, in milliseconds from its arrival."""

    queue_ms: float
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema
    (an object schema, as a dict or as JSON text; None: no arguments).

    chat() also takes tools as OpenAI-shaped dicts ({"type": "function", "function": {...}})
    or as plain {"name", "description", "parameters"} dicts."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of the model: run `name` with `arguments` (JSON text of an object) and
    send the result back as result_message(...), which refers to `id`."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict ({} when empty); ValueError when they are not a JSON object
        (possible with tool_choice "auto", where nothing constrains what the model writes)."""
        if not self.arguments.strip():
            return {}
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"the arguments of {self.name} are not a JSON object: {value!r}")
        return value

    def result_message(self, content: object) -> ChatMessage:
        """The "tool" message answering this call: `content` as is when it is a str, else as
        JSON (a dict, a list, a number...)."""
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        return ChatMessage("tool", text, tool_call_id=self.id, name=self.name)

    def to_dict(self) -> dict[str, Any]:
        """The call in OpenAI's shape: {"id", "type": "function", "function": {"name",
        "arguments"}}."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call in a chat stream. A call's first piece has its `index` (0 for the
    answer's first call), `id` and `name`; later pieces of the same index append `arguments`
    fragments (id and name empty). ChatStream and StreamAccumulator join them into ToolCalls."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation: role "system", "user", "assistant" or "tool".

    An assistant turn may carry the `tool_calls` it made (its content may then be empty) and
    its thinking (`reasoning_content`: a result's `reasoning`, handed to the template, which may
    render or drop it); a "tool" turn is the result of the call whose id is `tool_call_id`
    (`name`: the function's, optional). ToolCall.result_message() builds one."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    reasoning_content: str = ""

    @classmethod
    def from_dict(cls, message: Mapping[str, Any]) -> ChatMessage:
        """A message in OpenAI's shape: role, content (a str, None, or a list of text parts),
        tool_calls ([{"id", "type": "function", "function": {"name", "arguments"}}], the
        arguments a str or a dict), tool_call_id, name, reasoning_content (or "reasoning", as
        some servers name it). ValueError for anything else."""
        if not isinstance(message.get("role"), str):
            raise ValueError(f"a chat message needs a role (a str): {dict(message)!r}")
        return cls(
            role=message["role"],
            content=_content_text(message.get("content")),
            tool_calls=tuple(tool_call_from_dict(c) for c in message.get("tool_calls") or ()),
            tool_call_id=str(message.get("tool_call_id") or ""),
            name=str(message.get("name") or ""),
            reasoning_content=str(
                message.get("reasoning_content") or message.get("reasoning") or ""
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The message in OpenAI's shape; fields left empty are left out (content stays)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


def _content_text(content: object) -> str:
    """OpenAI's content: a str, None (an assistant turn with only tool calls) or a list of
    parts, of which only text parts can be sent ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError(f"only text content parts can be sent, not {part!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"a message's content must be a str or a list of text parts: {content!r}")


def _arguments_text(arguments: object) -> str:
    if arguments is None:
        return ""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tool_call_from_dict(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    """A ToolCall, or a call in OpenAI's shape ({"id", "type": "function", "function":
    {"name", "arguments"}}) or flat ({"id", "name", "arguments"}); dict arguments become JSON."""
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping):
        raise ValueError(f"a tool call must be a ToolCall or a dict, not {call!r}")
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"a tool call needs a function name: {dict(call)!r}")
    return ToolCall(
        str(call.get("id") or ""), function["name"], _arguments_text(function.get("arguments"))
    )


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative at a generation step."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its step (most likely
    first). Log-probabilities are the model's, before logit_bias, penalties and temperature."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole completion: text, tokens, why it ended, usage and timings."""

    text: str
    token_ids: tuple[int, ...]
    # "eos", "stop_sequence", "stop_token", "max_tokens", "context_length", "time_limit" or
    # "tool_calls" (the answer ends with the calls in tool_calls).
    finish_reason: str
    matched_stop: str | None
    matched_token_id: int | None
    usage: Usage
    timings: Timings
    request_id: str
    seed: int
    # One per generated token when logprobs (or top_logprobs) was asked for.
    logprobs: tuple[TokenLogprob, ...] = ()
    # The prompt was truncated to fit the context (usage.truncated_prompt_tokens: by how much).
    truncated: bool = False
    # The answer's tool calls (a chat with tools); `text` is the rest of the answer.
    tool_calls: tuple[ToolCall, ...] = ()
    # A thinking model's thinking (a chat), apart from `text`; "" when it did not think.
    reasoning: str = ""

    def message(self) -> ChatMessage:
        """The answer as the assistant turn to append to the conversation (with its calls and
        its thinking as reasoning_content)."""
        return ChatMessage(
            "assistant", self.text, tool_calls=self.tool_calls, reasoning_content=self.reasoning
        )


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of streamed output: new text and the tokens generated since the last delta."""

    text: str
    token_ids: tuple[int, ...]
    # One per token in token_ids when logprobs (or top_logprobs) was asked for.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """New thinking text of a thinking model in a chat stream. All of the thinking comes before
    the answer's text; the tokens it was written with are in the Delta that follows it."""

    text: str


@dataclass(frozen=True, slots=True)
class Done:
    """The final event of a stream: why generation ended, usage and timings."""

    finish_reason: str
    matched_stop: str | None
    matched_token_id: int | None
    usage: Usage
    timings: Timings
    request_id: str
    seed: int
    # The prompt was truncated to fit the context (usage.truncated_prompt_tokens: by how much).
    truncated: bool = False


StreamEvent: TypeAlias = Delta | Done
# A chat stream's events (stream_chat()): thinking and tool-call pieces besides the text.
ChatStreamEvent: TypeAlias = ReasoningDelta | Delta | ToolCallDelta | Done


@dataclass(slots=True)
class _PartialCall:
    """A tool call being streamed: its id and name, and its argument fragments so far."""

    id: str = ""
    name: str = ""
    arguments: list[str] = dataclasses.field(default_factory=list)


class StreamAccumulator:
    """Joins a chat stream's events into the whole answer: its thinking (ReasoningDelta
    texts), its text, its tool calls (the ToolCallDelta pieces of each index joined into one
    ToolCall, in index order) and the Done.

        acc = StreamAccumulator()
        for event in client.stream_chat(messages, tools=tools):
            acc.add(event)
        messages.append(acc.message())
        for call in acc.tool_calls: ...

    ChatStream does this itself (its reasoning, text, tool_calls and message()); this is for events
    handled elsewhere (passed through a queue, merged from several streams...)."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, _PartialCall] = {}
        self.done: Done | None = None

    def add(self, event: ChatStreamEvent) -> None:
        """Take one event (a ReasoningDelta, a Delta, a ToolCallDelta or the Done)."""
        if isinstance(event, Delta):
            self._texts.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallDelta):
            call = self._calls.setdefault(event.index, _PartialCall())
            # The first piece names the call; an id or name in a later piece counts only where
            # the earlier ones left it empty.
            call.id = call.id or event.id
            call.name = call.name or event.name
            call.arguments.append(event.arguments)
        else:
            self.done = event

    @property
    def text(self) -> str:
        """The text so far (never call markup)."""
        return "".join(self._texts)

    @property
    def reasoning(self) -> str:
        """The thinking so far ("" from a model that did not think)."""
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls so far, in index order (the last one may still be incomplete until
        the Done has come)."""
        return tuple(
            ToolCall(call.id, call.name, "".join(call.arguments))
            for _, call in sorted(self._calls.items())
        )

    @property
    def finish_reason(self) -> str | None:
        """The Done's finish reason ("tool_calls" after calls), None before the Done."""
        return None if self.done is None else self.done.finish_reason

    def message(self) -> ChatMessage:
        """The answer as the assistant turn to append to the conversation (with its calls and
        its thinking as reasoning_content)."""
        return ChatMessage(
            "assistant", self.text, tool_calls=self.tool_calls, reasoning_content=self.reasoning
        )


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """Token ids of a text, with each token's text piece."""

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SlotStats:
    """One slot of the server's pool."""

    slot_id: int
    state: str
    request_id: str  # empty when idle or when the request is another tenant's
    cached_tokens: int
    tenant: str = ""  # the request's tenant (empty: idle, no authentication, another tenant)
    buffered_tokens: int = 0  # generated for the request, not yet read by its caller


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter a model serves (LoadAdapter, ListAdapters, Stats.adapters); requests
    apply it by name (lora=)."""

    name: str  # what requests put in `lora`
    path: str  # its GGUF file, on the server
    default_scale: float  # the scale a request naming it without one gets
    # Its rank and alpha (the update is scale * alpha / rank * B A), and the base model's
    # tensors it changes.
    rank: int
    alpha: float
    num_tensors: int
    size_bytes: int
    # The first 16 hex digits of the file's SHA-256 (what the prefix caches key).
    sha256: str
    model: str  # the model it belongs to
    # Since the server started: requests that used it, tokens they generated, forward passes
    # run with it.
    requests: int
    generated_tokens: int
    passes: int


@dataclass(frozen=True, slots=True)
class Stats:
    """A live scheduler snapshot plus cumulative counters since the server started."""

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
    slots: tuple[SlotStats, ...]
    batch_strategy: str
    prefix_cache_hit_rate: float
    ram_cache_entries: int = 0
    ram_cache_bytes: int = 0
    ram_cache_hits: int = 0
    ram_cache_misses: int = 0
    ram_cache_evictions: int = 0
    # "starting", "running", "failed" (generation answers UNAVAILABLE) or "stopped".
    engine_state: str = ""
    engine_error: str = ""  # why the engine failed
    # Wall time inside llama_decode since start, and the engine thread's CPU time in it.
    decode_seconds: float = 0.0
    decode_cpu_seconds: float = 0.0
    # The disk tier (--kv-cache-dir): files, restores (hits), lookups without one (misses),
    # files written, deleted for the budget, rejected by verification; read time in all.
    disk_cache_entries: int = 0
    disk_cache_bytes: int = 0
    disk_cache_hits: int = 0
    disk_cache_misses: int = 0
    disk_cache_writes: int = 0
    disk_cache_evictions: int = 0
    disk_cache_verify_failures: int = 0
    disk_cache_read_seconds: float = 0.0
    # Response cache (--response-cache-mb): stored results, their bytes (an estimate), requests
    # answered from it, requests sent to the engine while it was on, entries evicted.
    response_cache_entries: int = 0
    response_cache_bytes: int = 0
    response_cache_hits: int = 0
    response_cache_misses: int = 0
    response_cache_evictions: int = 0
    # Speculative decoding since start: draft tokens verified, accepted, their ratio, and
    # forward passes that carried drafts.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_ticks: int = 0
    # ... of them the draft model's (--draft-model): draft tokens verified, those accepted
    spec_model_draft_tokens: int = 0
    spec_model_accepted_tokens: int = 0
    model_name: str = ""  # the model these figures are of
    # Requests whose deadline passed (not counted as failed or cancelled).
    requests_deadline_exceeded: int = 0
    disk_cache_write_failures: int = 0  # disk-tier writes that failed (full, read-only volume)
    # Disk-tier reads that brought nothing back (the request computed its prompt instead).
    disk_cache_read_failures: int = 0
    # Back-pressure: requests paused for their slow caller now; requests ended for a caller
    # that read nothing for --stalled-reader-s; times a request was paused.
    paused_streams: int = 0
    stalled_readers: int = 0
    stream_pauses: int = 0
    # 1 once the engine's watchdog found a tick past its bound (--watchdog-s): the server exits.
    watchdog_trips: int = 0
    # The model's LoRA adapters with their counters, and forward passes whose adapter set
    # differed from the pass before (each costs a graph rebuild).
    adapters: tuple[Adapter, ...] = ()
    adapter_switches: int = 0


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The server's aggregate load at one moment (WatchLoad): no request ids, no tenants."""

    queue_depth: int  # requests waiting for a slot
    active_slots: int  # slots running a request
    n_parallel: int  # slots in all
    kv_cells_used: int
    kv_cells_total: int
    kv_cache_usage: float  # kv_cells_used / kv_cells_total, from 0 to 1
    prefix_cache_hit_rate: float  # share of prompt tokens served from the prefix cache
    requests_running: int  # requests holding a slot (= active_slots)
    engine_state: str  # "starting", "running", "failed" or "stopped"
    # The server takes new requests: the engine runs and the server is not draining (a draining
    # server's last report has False).
    serving: bool
    timestamp_unix_ms: int  # when the report was made, in ms since the Unix epoch


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """What ClearCache freed: idle slots' prefix caches, the server's RAM tier, its disk tier's
    files and its response cache."""

    cleared_slots: int
    freed_kv_cells: int
    freed_ram_entries: int
    freed_ram_bytes: int
    freed_disk_entries: int = 0
    freed_disk_bytes: int = 0
    freed_response_entries: int = 0
    freed_response_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the loaded model and its context."""

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
    # The template chat messages are rendered with ("gemma", "chatml", "gguf"), "" for none.
    chat_template: str = ""
    n_embd: int = 0  # the length of its embeddings
    pooling: str = ""  # the GGUF's pooling_type ("mean", "cls", "last", "none", "rank"; "": none)


@dataclass(frozen=True, slots=True)
class Embedding:
    """The embedding of one input: one vector, or one per token with pooling "none"."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int
    truncated_tokens: int = 0  # dropped by truncate=True

    @property
    def vector(self) -> tuple[float, ...]:
        """The (first) vector."""
        return self.vectors[0]


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """Embed's answer: one Embedding per input, in input order."""

    embeddings: tuple[Embedding, ...]
    dimensions: int
    pooling: str  # "mean", "cls", "last" or "none": the one used
    prompt_tokens: int  # every input's tokens
    truncated_prompt_tokens: int
    request_id: str


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model a server may serve (ListModels, LoadModel, UnloadModel)."""

    name: str  # what requests put in `model`
    path: str
    size_bytes: int  # the file's size: what counts against --max-loaded-bytes
    state: str  # "loaded", "loading", "unloaded" or "unloading"
    is_default: bool  # requests naming no model are served by it
    last_used_unix_ms: int  # 0 = never used
    slots_busy: int  # its engine's slots running a request
    in_flight: int  # requests holding it (queued or running): it is not unloaded for room
    waiting: int  # requests waiting for it to be loaded
    loads: int  # times loaded since the server started
    load_seconds: float  # how long its last load took
    last_error: str  # why its last load or its engine failed ("" when neither did)


@dataclass(frozen=True, slots=True)
class ModelList:
    """ListModels: every model, the default first, and the server's bounds (0 = no limit)."""

    models: tuple[ModelStatus, ...]
    max_loaded_models: int
    max_loaded_bytes: int


@dataclass(frozen=True, slots=True)
class ModelUnloaded:
    """UnloadModel: the model after, and how many requests in flight were ended (force)."""

    model: ModelStatus
    cancelled_requests: int


def finish_reason_name(value: int) -> str:
    """`FINISH_REASON_STOP_SEQUENCE` -> "stop_sequence"."""
    return pb.FinishReason.Name(value).removeprefix(_FINISH_PREFIX).lower()  # type: ignore[arg-type]


def usage_from_proto(message: pb.Usage) -> Usage:
    """Convert a Usage message."""
    return Usage(
        message.prompt_tokens,
        message.completion_tokens,
        message.cached_prompt_tokens,
        message.truncated_prompt_tokens,
        message.cached_response,
        message.draft_tokens,
        message.accepted_draft_tokens,
    )


def timings_from_proto(message: pb.Timings) -> Timings:
    """Convert a Timings message."""
    return Timings(
        message.queue_ms, message.ttft_ms, message.prefill_ms, message.decode_ms, message.total_ms
    )


def _finish_fields(
    reason: int, finish: pb.FinishInfo, has_finish: bool
) -> tuple[str, str | None, int | None]:
    # FinishInfo.reason is authoritative when the server sent it; the flat field is the fallback.
    if has_finish and finish.reason != pb.FINISH_REASON_UNSPECIFIED:
        reason = finish.reason
    token_id = finish.matched_token_id if finish.HasField("matched_token_id") else None
    return finish_reason_name(reason), finish.matched_stop or None, token_id


def result_from_proto(message: pb.GenerateResponse, request_id: str) -> GenerateResult:
    """Convert a GenerateResponse; `request_id` is used when the message carries none."""
    reason, stop, token_id = _finish_fields(
        message.finish_reason, message.finish, message.HasField("finish")
    )
    return GenerateResult(
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=reason,
        matched_stop=stop,
        matched_token_id=token_id,
        usage=usage_from_proto(message.usage),
        timings=timings_from_proto(message.timings),
        request_id=message.request_id or request_id,
        seed=message.seed,
        logprobs=logprobs_from_proto(message.logprobs),
        truncated=message.truncated,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls),
        reasoning=message.reasoning,
    )


def done_from_proto(message: pb.GenerationDone, request_id: str) -> Done:
    """Convert a GenerationDone; `request_id` is used when the message carries none."""
    reason, stop, token_id = _finish_fields(
        message.finish_reason, message.finish, message.HasField("finish")
    )
    return Done(
        finish_reason=reason,
        matched_stop=stop,
        matched_token_id=token_id,
        usage=usage_from_proto(message.usage),
        timings=timings_from_proto(message.timings),
        request_id=message.request_id or request_id,
        seed=message.seed,
        truncated=message.truncated,
    )


def delta_from_proto(message: pb.GenerationDelta) -> Delta:
    """Convert a GenerationDelta's text, tokens and logprobs (chat_events_from_proto: with its
    tool-call pieces)."""
    return Delta(message.text, tuple(message.token_ids), logprobs_from_proto(message.logprobs))


def chat_events_from_proto(
    message: pb.GenerationDelta,
) -> list[ReasoningDelta | Delta | ToolCallDelta]:
    """A GenerationDelta as a chat stream's events: its ReasoningDelta (new thinking), its
    Delta, then one ToolCallDelta per tool-call piece. A delta that carries only thinking or
    tool-call pieces (no text, tokens or logprobs) gives no Delta."""
    events: list[ReasoningDelta | Delta | ToolCallDelta] = []
    if message.reasoning:
        events.append(ReasoningDelta(message.reasoning))
    bare = not (message.tool_calls or message.reasoning)
    if bare or message.text or message.token_ids or message.logprobs:
        events.append(delta_from_proto(message))
    events.extend(ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in message.tool_calls)
    return events


def logprobs_from_proto(messages: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """Convert repeated TokenLogprob messages."""
    return tuple(
        TokenLogprob(
            m.token_id,
            m.token,
            m.logprob,
            tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in m.top),
        )
        for m in messages
    )


_V = TypeVar("_V")


def _same_named_fields(message: Message, cls: type[_V]) -> dict[str, Any]:
    # Any at the protobuf edge: each value is checked by the dataclass field of the same name,
    # and a unit test checks that every proto field lands in the value.
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        descriptor = message.DESCRIPTOR.fields_by_name[field.name]
        value = getattr(message, field.name)
        if descriptor.has_presence and descriptor.message_type is None:
            value = value if message.HasField(field.name) else None
        elif descriptor.is_repeated:
            value = tuple(value)
        values[field.name] = value
    return values


def stats_from_proto(message: pb.GetStatsResponse) -> Stats:
    """Convert a GetStatsResponse."""
    values = _same_named_fields(message, Stats)
    values["slots"] = tuple(SlotStats(**_same_named_fields(s, SlotStats)) for s in message.slots)
    values["adapters"] = tuple(adapter_from_proto(a) for a in message.adapters)
    return Stats(**values)


def adapter_from_proto(message: pb.Adapter) -> Adapter:
    """Convert an Adapter message."""
    return Adapter(**_same_named_fields(message, Adapter))


def adapters_from_proto(message: pb.ListAdaptersResponse) -> list[Adapter]:
    """Convert a ListAdaptersResponse: its adapters, in the server's order."""
    return [adapter_from_proto(a) for a in message.adapters]


def model_info_from_proto(message: pb.GetModelInfoResponse) -> ModelInfo:
    """Convert a GetModelInfoResponse; unset optional token ids become None."""
    return ModelInfo(**_same_named_fields(message, ModelInfo))


def embed_result_from_proto(message: pb.EmbedResponse) -> EmbedResult:
    """Convert an EmbedResponse; the pooling enum as its lower-case name ("mean")."""
    return EmbedResult(
        embeddings=tuple(
            Embedding(
                tuple(tuple(v.values) for v in e.vectors), e.prompt_tokens, e.truncated_tokens
            )
            for e in message.embeddings
        ),
        dimensions=message.dimensions,
        pooling=pb.Pooling.Name(message.pooling).removeprefix("POOLING_").lower(),
        prompt_tokens=message.usage.prompt_tokens,
        truncated_prompt_tokens=message.usage.truncated_prompt_tokens,
        request_id=message.request_id,
    )


def load_report_from_proto(message: pb.LoadReport) -> LoadReport:
    """Convert a LoadReport message."""
    return LoadReport(**_same_named_fields(message, LoadReport))


def cache_cleared_from_proto(message: pb.ClearCacheResponse) -> CacheCleared:
    return CacheCleared(**_same_named_fields(message, CacheCleared))


def model_status_from_proto(message: pb.ModelStatus) -> ModelStatus:
    """Convert a ModelStatus; the state enum as its lower-case name ("loaded")."""
    values = _same_named_fields(message, ModelStatus)
    values["state"] = pb.ModelState.Name(message.state).removeprefix(_MODEL_STATE_PREFIX).lower()
    return ModelStatus(**values)


def model_list_from_proto(message: pb.ListModelsResponse) -> ModelList:
    return ModelList(
        tuple(model_status_from_proto(m) for m in message.models),
        message.max_loaded_models,
        message.max_loaded_bytes,
    )


def model_unloaded_from_proto(message: pb.UnloadModelResponse) -> ModelUnloaded:
    return ModelUnloaded(model_status_from_proto(message.model), message.cancelled_requests)
