"""Client (sync) and AsyncClient (grpc.aio) for LlmService; streams cancel their RPC on close.

Builds requests from keyword parameters, converts replies to frozen values (types.py) and
every grpc.RpcError to a LlamaGrpcError (errors.py). Never imports the server package.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any, Generic, Literal, Self, TypedDict, TypeVar, Unpack, cast, overload

import grpc
import grpc.aio
from google.protobuf.message import Message

from llama_grpc import types as t
from llama_grpc.errors import REQUEST_ID_KEY, InternalError, LlamaGrpcError, from_rpc_error
from llama_grpc.resume import DEFAULT_RESUME_ATTEMPTS, GenerationRequest, Resumption, check_attempts
from llama_grpc.routing import (
    BALANCED_SERVICE_CONFIG,
    SERVICE_CONFIG_OPTION,
    balanced_target,
    routing_metadata,
)
from llama_grpc.tls import TlsConfig, channel_security
from llama_grpc.trace_context import trace_metadata
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
AUTHORIZATION_KEY = "authorization"
_MAX_UINT32 = 2**32 - 1

MetadataLike = Mapping[str, str] | Sequence[tuple[str, str]]
_Metadata = tuple[tuple[str, str], ...]
_EventMessage = pb.StreamGenerateResponse | pb.GenerateTokensResponse
_Request = TypeVar(
    "_Request", pb.GenerateRequest, pb.StreamGenerateRequest, pb.GenerateTokensRequest
)
_ChatRequest = TypeVar("_ChatRequest", pb.GenerateRequest, pb.StreamGenerateRequest)
_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)


class CallOptions(TypedDict, total=False):
    """Per-call options: a deadline in seconds and extra metadata (added to the client's)."""

    timeout: float | None
    metadata: MetadataLike | None


# LoRA adapters a request applies (see TokenGenerationParams.lora): a name, {name: scale}, or a
# list of names and (name, scale) pairs; a scale of None is the adapter's default.
LoraLike = str | Mapping[str, float | None] | Sequence[str | tuple[str, float | None]]


class TokenGenerationParams(CallOptions, total=False):
    """Keyword parameters of generate_tokens(); None (or leaving one out) means server default."""

    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    seed: int | None
    repeat_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    penalty_last_n: int | None
    # token id -> bias added to its logit; float("-inf") bans the token.
    logit_bias: Mapping[int, float] | None
    max_tokens: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool | None
    time_limit_ms: int | None
    cache_prompt: bool | None
    # False: the server's response cache neither answers nor stores this request.
    cache_response: bool | None
    # Prompt-lookup speculative decoding (server default: its --speculative): "auto" (when it
    # pays), "off" or "on"; draft_max, ngram_min and ngram_max tune it. Output tokens are the
    # sampler's own either way (exact-match verification).
    speculative: Literal["auto", "off", "on"] | None
    draft_max: int | None
    ngram_min: int | None
    ngram_max: int | None
    # LoRA adapters the model serves (list_adapters()) to apply, each named once: a name,
    # {name: scale} or a list of names and (name, scale) pairs; a name without a scale (or with
    # None) gets the adapter's default scale. None or empty: the base model.
    lora: LoraLike | None
    # Per-token log-probabilities in the result (top_logprobs > 0 implies logprobs).
    logprobs: bool | None
    top_logprobs: int | None
    # Structured output: a GBNF grammar (with its start rule) or a JSON Schema (dict or JSON text).
    grammar: str | None
    grammar_root: str | None
    json_schema: str | Mapping[str, Any] | None
    # When prompt + max_tokens does not fit: "reject" (the server default) or "truncate_left"
    # (drop the oldest prompt tokens, keeping a leading BOS and the first n_keep).
    context_overflow: Literal["reject", "truncate_left"] | None
    n_keep: int | None
    # Queue order among the caller's requests (server default: "normal"); waiting raises a
    # request's priority over time, so "low" work is delayed, never starved.
    priority: Literal["low", "normal", "high"] | None
    session_id: str | None
    cache_scope: str | None
    model: str | None


class GenerationParams(TokenGenerationParams, total=False):
    """Keyword parameters of generate(), stream(), chat() and stream_chat(): those of
    generate_tokens() + add_special and (for chat) chat_template."""

    add_special: bool | None
    # chat() / stream_chat(): a built-in template ("gemma", "chatml") or "gguf" (the model's own).
    chat_template: str | None


class _Resuming(TypedDict, total=False):
    # How many times in a row a stream cut by UNAVAILABLE is called again (None: the client's
    # resume_attempts; 0: never). See Client.__init__.
    resume_attempts: int | None


class TokenStreamParams(TokenGenerationParams, _Resuming, total=False):
    """Keyword parameters of generate_tokens(): those of TokenGenerationParams + resume_attempts."""


class StreamParams(GenerationParams, _Resuming, total=False):
    """Keyword parameters of stream() and stream_chat(): those of GenerationParams +
    resume_attempts."""


# A chat turn: ChatMessage, a dict in OpenAI's shape ({"role", "content"}, and "tool_calls",
# "tool_call_id", "name" where they apply) or (role, content).
MessageLike = t.ChatMessage | Mapping[str, Any] | tuple[str, str]
# A tool: Tool, {"type": "function", "function": {"name", "description", "parameters"}} or
# {"name", "description", "parameters"} (parameters: a JSON Schema dict or its JSON text).
ToolLike = t.Tool | Mapping[str, Any]
# "auto", "none", "required", a function's name, {"type": "function", "function": {"name": ...}}
# or a Tool (that one).
ToolChoiceLike = str | Mapping[str, Any] | t.Tool


_SAMPLING_KEYS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_STOPPING_KEYS = frozenset(pb.StoppingCriteria.DESCRIPTOR.fields_by_name)
_OUTPUT_KEYS = frozenset(pb.OutputOptions.DESCRIPTOR.fields_by_name)
_CONSTRAINT_KEYS = frozenset({"grammar", "grammar_root", "json_schema"})
_OVERFLOW_KEYS = frozenset({"context_overflow", "n_keep"})
_POLICIES = {
    "reject": pb.OVERFLOW_POLICY_REJECT,
    "truncate_left": pb.OVERFLOW_POLICY_TRUNCATE_LEFT,
}
_PRIORITIES = {
    "low": pb.PRIORITY_LOW,
    "normal": pb.PRIORITY_NORMAL,
    "high": pb.PRIORITY_HIGH,
}
_SPECULATIVE_KEYS = frozenset({"draft_max", "ngram_min", "ngram_max"})
_SPECULATIVE_MODES = {
    "auto": pb.SPECULATIVE_MODE_AUTO,
    "off": pb.SPECULATIVE_MODE_OFF,
    "on": pb.SPECULATIVE_MODE_ON,
}
_CALL_KEYS = frozenset(CallOptions.__annotations__)
_REQUEST_KEYS = frozenset({"session_id", "cache_scope", "model", "add_special", "chat_template"})


def _fill(message: Message, values: Mapping[str, object]) -> None:
    """Set the given fields only, so every optional field left out stays unset on the wire."""
    for name, value in values.items():
        if isinstance(value, Mapping):
            getattr(message, name).update(value)
        elif message.DESCRIPTOR.fields_by_name[name].is_repeated:
            items = [value] if isinstance(value, str) else value
            getattr(message, name).extend(items)
        else:
            setattr(message, name, value)


def _pick(params: Mapping[str, object], keys: frozenset[str]) -> dict[str, object]:
    return {key: value for key, value in params.items() if key in keys and value is not None}


def build_request(request: _Request, params: Mapping[str, object]) -> _Request:
    """Add keyword `params` to a generation request; unknown names raise TypeError."""
    request_keys = _REQUEST_KEYS & set(request.DESCRIPTOR.fields_by_name)
    allowed = (
        _SAMPLING_KEYS
        | _STOPPING_KEYS
        | _OUTPUT_KEYS
        | _CONSTRAINT_KEYS
        | _OVERFLOW_KEYS
        | _CALL_KEYS
        | request_keys
        | _SPECULATIVE_KEYS
        | {"cache_prompt", "cache_response", "priority", "speculative", "lora"}
    )
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    _fill(request, _pick(params, request_keys))
    _fill(request.params.sampling, _pick(params, _SAMPLING_KEYS))
    _fill(request.params.stopping, _pick(params, _STOPPING_KEYS))
    _fill(request.params.output, _pick(params, _OUTPUT_KEYS))
    _fill(request.params, _pick(params, frozenset({"cache_prompt", "cache_response"})))
    _set_constraint(request.params, _pick(params, _CONSTRAINT_KEYS))
    _set_overflow(request.params.context_overflow, _pick(params, _OVERFLOW_KEYS))
    _set_enum(request.params, "priority", "priority", params.get("priority"), _PRIORITIES)
    _set_enum(
        request.params.speculative, "mode", "speculative", params.get("speculative"),
        _SPECULATIVE_MODES,
    )  # fmt: skip
    _fill(request.params.speculative, _pick(params, _SPECULATIVE_KEYS))
    adapters = lora_adapters(cast("LoraLike | None", params.get("lora")))
    if adapters:  # none: params stays unset when nothing else is given
        request.params.lora.extend(adapters)
    return request


def _set_enum(
    message: Any, field: str, option: str, value: object, names: Mapping[str, int]
) -> None:
    """message.field = the enum value named `value` (None: left unset); ValueError naming the
    option and its choices otherwise."""
    if value is None:
        return
    if value not in names:
        *rest, last = (repr(n) for n in names)
        raise ValueError(f"{option} must be {', '.join(rest)} or {last}, not {value!r}")
    setattr(message, field, names[str(value)])


def _set_overflow(message: pb.ContextOverflow, values: Mapping[str, object]) -> None:
    policy, n_keep = values.get("context_overflow"), values.get("n_keep")
    if policy is not None:
        if policy not in _POLICIES:
            raise ValueError(
                f"context_overflow must be 'reject' or 'truncate_left', not {policy!r}"
            )
        message.policy = _POLICIES[str(policy)]
    if isinstance(n_keep, int):
        message.n_keep = n_keep


def _set_constraint(message: pb.GenerationParams, values: Mapping[str, object]) -> None:
    """grammar (+ grammar_root) or json_schema; a schema given as a dict is sent as JSON."""
    schema = values.get("json_schema")
    if schema is not None and "grammar" in values:
        raise ValueError("pass either grammar or json_schema, not both")
    if "grammar_root" in values and "grammar" not in values:
        raise ValueError("grammar_root needs a grammar")
    if schema is not None:
        message.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif "grammar" in values:
        message.grammar.gbnf = str(values["grammar"])
        message.grammar.root = str(values.get("grammar_root", ""))


def lora_adapters(lora: LoraLike | None) -> list[pb.LoraAdapter]:
    """The LoraAdapter messages of a `lora` keyword: a name, {name: scale}, or a sequence of
    names and (name, scale) pairs, in order; a scale left out or None stays unset (the
    adapter's default). None gives none. TypeError for another shape, ValueError for an empty
    name, a name given twice or a scale that is not finite."""
    if lora is None:
        return []
    items: list[object]
    if isinstance(lora, str):
        items = [lora]
    elif isinstance(lora, Mapping):
        items = list(lora.items())
    elif isinstance(lora, Sequence) and not isinstance(lora, bytes):
        items = list(lora)
    else:
        raise TypeError(
            "lora must be an adapter's name, a {name: scale} mapping or a list of names and "
            f"(name, scale) pairs, not {type(lora).__name__}"
        )
    adapters: list[pb.LoraAdapter] = []
    for item in items:
        adapter = _lora_adapter(item)
        if any(a.name == adapter.name for a in adapters):
            raise ValueError(f"lora names adapter {adapter.name!r} twice")
        adapters.append(adapter)
    return adapters


def _lora_adapter(item: object) -> pb.LoraAdapter:
    """One `lora` entry: a name or a (name, scale) pair."""
    if isinstance(item, str):
        name, scale = item, None
    elif isinstance(item, tuple | list) and len(item) == 2:  # noqa: PLR2004  # a pair
        name, scale = item
    else:
        raise TypeError(
            f"a lora entry must be a name or a (name, scale) pair, not {item!r} (a single pair "
            "goes in a list: lora=[(name, scale)])"
        )
    if not isinstance(name, str):
        raise TypeError(f"a lora adapter's name must be a str, not {name!r}")
    if not name:
        raise ValueError("a lora adapter's name must not be empty")
    adapter = pb.LoraAdapter(name=name)
    if scale is not None:
        adapter.scale = _scale(f"the scale of lora adapter {name!r}", scale)
    return adapter


def _scale(what: str, value: object) -> float:
    """An adapter scale: a finite int or float (TypeError, ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def load_adapter_request(
    name: str, path: str, model: str | None, default_scale: float | None
) -> pb.LoadAdapterRequest:
    """Build a LoadAdapterRequest; default_scale None stays unset (the server's 1)."""
    request = pb.LoadAdapterRequest(model=model or "", name=name, path=path)
    if default_scale is not None:
        request.default_scale = _scale("default_scale", default_scale)
    return request


def chat_messages(messages: Iterable[MessageLike]) -> list[pb.ChatMessage]:
    """ChatMessage values, OpenAI-shaped dicts (ChatMessage.from_dict) or (role, content) pairs
    as messages."""
    return [_chat_message(message) for message in messages]


def _chat_message(message: MessageLike) -> pb.ChatMessage:
    if isinstance(message, Mapping):
        message = t.ChatMessage.from_dict(message)
    elif not isinstance(message, t.ChatMessage):
        role, content = message
        message = t.ChatMessage(role, content)
    return pb.ChatMessage(
        role=message.role,
        content=message.content,
        reasoning_content=message.reasoning_content,
        tool_calls=[
            pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls
        ],
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def tool_message(tool: ToolLike) -> pb.Tool:
    """A Tool, an OpenAI-shaped tool dict or a plain {"name", "description", "parameters"} dict
    as a Tool message; the parameters schema as JSON text ("" for none)."""
    name: object
    description: object
    parameters: object
    if isinstance(tool, t.Tool):
        name, description, parameters = tool.name, tool.description, tool.parameters
    elif isinstance(tool, Mapping):
        if tool.get("type", "function") != "function":
            raise ValueError(f"only function tools can be sent, not type {tool['type']!r}")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping):
            raise ValueError(f"a tool's function must be a dict: {dict(tool)!r}")
        name = function.get("name")
        description, parameters = function.get("description") or "", function.get("parameters")
    else:
        raise TypeError(f"a tool must be a Tool or a dict, not {type(tool).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool needs a name: {tool!r}")
    if parameters is None:
        schema = ""
    else:
        schema = parameters if isinstance(parameters, str) else json.dumps(parameters)
    return pb.Tool(name=name, description=str(description), parameters=schema)


_TOOL_CHOICE_MODES = {
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}


def tool_choice_message(choice: ToolChoiceLike) -> pb.ToolChoice:
    """ "auto", "none" or "required" as a mode; any other str, a Tool or {"type": "function",
    "function": {"name": ...}} (or {"name": ...}) as the one function to call."""
    if isinstance(choice, str) and choice in _TOOL_CHOICE_MODES:
        return pb.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    if isinstance(choice, t.Tool):
        name: object = choice.name
    elif isinstance(choice, Mapping):
        function = choice.get("function", choice)
        name = function.get("name") if isinstance(function, Mapping) else None
    else:
        name = choice
    if not isinstance(name, str) or not name:
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required', a function's name or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, not {choice!r}"
        )
    return pb.ToolChoice(function=name)


def set_thinking(
    request: pb.GenerateRequest | pb.StreamGenerateRequest,
    enable_thinking: bool | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    reasoning_budget: int | None,
) -> None:
    """Set a chat request's thinking options; None leaves one unset. chat_template_kwargs is
    sent as JSON text of an object (TypeError for anything but a mapping or None);
    reasoning_budget -1 means no limit, 0 no thinking (ValueError below -1)."""
    if enable_thinking is not None:
        request.enable_thinking = bool(enable_thinking)
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(
                "chat_template_kwargs must be a mapping (sent as a JSON object), not "
                f"{type(chat_template_kwargs).__name__}"
            )
        request.chat_template_kwargs = json.dumps(dict(chat_template_kwargs), ensure_ascii=False)
    if reasoning_budget is not None:
        if isinstance(reasoning_budget, bool) or not isinstance(reasoning_budget, int):
            raise TypeError(f"reasoning_budget must be an int, not {reasoning_budget!r}")
        if reasoning_budget < -1:
            raise ValueError(
                f"reasoning_budget must be -1 (no limit), 0 (no thinking) or more, "
                f"not {reasoning_budget}"
            )
        request.reasoning_budget = reasoning_budget


def build_chat_request(  # noqa: PLR0917  # chat()'s arguments, passed on
    request: _ChatRequest,
    messages: Iterable[MessageLike],
    tools: Sequence[ToolLike] | None,
    tool_choice: ToolChoiceLike | None,
    parallel_tool_calls: bool | None,
    params: Mapping[str, object],
    thinking: _Thinking | None = None,
) -> _ChatRequest:
    """Add a conversation, its tools, its thinking options and keyword `params` (build_request)
    to a chat request; None leaves tool_choice, parallel_tool_calls and each thinking option
    unset (the server's defaults)."""
    if isinstance(tools, Mapping | str):
        raise TypeError("tools must be a list of tools")
    set_thinking(request, *(thinking or (None, None, None)))
    request.messages.extend(chat_messages(messages))
    request.tools.extend(tool_message(tool) for tool in tools or ())
    if tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_message(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return build_request(request, params)


def tokenize_request(
    text: str, add_special: bool, parse_special: bool, return_pieces: bool, model: str | None
) -> pb.TokenizeRequest:
    """Build a TokenizeRequest."""
    return pb.TokenizeRequest(
        model=model or "",
        text=text,
        add_special=add_special,
        parse_special=parse_special,
        return_pieces=return_pieces,
    )


EmbedInputs = str | Sequence[str | Sequence[int]]
_POOLINGS = {
    None: pb.POOLING_UNSPECIFIED,
    "mean": pb.POOLING_MEAN,
    "cls": pb.POOLING_CLS,
    "last": pb.POOLING_LAST,
    "none": pb.POOLING_NONE,
}


class EmbedParams(CallOptions, total=False):
    """Keyword parameters of embed(); None (or leaving one out) means the server default."""

    # "mean", "cls", "last" or "none" (a vector per token); default: the model's own, else mean
    pooling: str | None
    normalize: bool | None  # L2 (server default: True)
    dimensions: int | None  # keep the first N components (then normalize)
    # An input over the context: False (default) refuses it, True drops its oldest tokens
    # (after a leading BOS and n_keep more).
    truncate: bool | None
    n_keep: int | None
    add_special: bool | None  # add BOS to text inputs (server default: True)
    model: str | None


def embed_request(inputs: EmbedInputs, params: EmbedParams) -> pb.EmbedRequest:
    """Build an EmbedRequest: a text is one input, a list holds texts and token id lists."""
    pooling = params.get("pooling")
    if pooling not in _POOLINGS:
        raise ValueError(f"pooling must be one of mean, cls, last, none; got {pooling!r}")
    request = pb.EmbedRequest(
        model=params.get("model") or "",
        pooling=_POOLINGS[pooling],
        dimensions=params.get("dimensions") or 0,
    )
    for item in [inputs] if isinstance(inputs, str) else inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add().tokens.ids.extend(item)
    if params.get("normalize") is not None:
        request.normalize = bool(params["normalize"])
    if params.get("add_special") is not None:
        request.add_special = bool(params["add_special"])
    if params.get("truncate"):
        request.context_overflow.policy = pb.OVERFLOW_POLICY_TRUNCATE_LEFT
        request.context_overflow.n_keep = params.get("n_keep") or 0
    return request


def _to_metadata(metadata: MetadataLike | None) -> _Metadata:
    items: Iterable[tuple[str, str]] = (
        metadata.items() if isinstance(metadata, Mapping) else metadata or ()
    )
    return tuple((key, value) for key, value in items)


def request_id_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The `x-request-id` value in call metadata, or ""."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def _tokenized(response: pb.TokenizeResponse, return_pieces: bool) -> list[int] | t.TokenizeResult:
    if return_pieces:
        return t.TokenizeResult(tuple(response.token_ids), tuple(response.pieces))
    return list(response.token_ids)


def _model_status(response: pb.LoadModelResponse) -> t.ModelStatus:
    return t.model_status_from_proto(response.model)


def _loaded_adapter(response: pb.LoadAdapterResponse) -> t.Adapter:
    return t.adapter_from_proto(response.adapter)


def _health_modules() -> tuple[ModuleType, ModuleType]:
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as error:
        raise ImportError(
            "health() needs grpcio-health-checking: pip install grpcio-health-checking"
        ) from error
    return health_pb2, health_pb2_grpc


def _bearer(token: str | None) -> _Metadata:
    """The `authorization: Bearer <token>` metadata of `token` (none for None)."""
    if token is None:
        return ()
    if not (token and token.isascii() and token.isprintable() and token.strip() == token):
        raise ValueError("token must be printable ASCII without spaces around it, and not empty")
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)


def _channel_settings(
    target: str | Sequence[str],
    has_channel: bool,
    options: Sequence[tuple[str, str | int]] | None,
    tls: bool | TlsConfig,
    balance: bool | None,
) -> tuple[str, grpc.ChannelCredentials | None, list[tuple[str, str | int]]]:
    """(target URI, credentials or None for plaintext, channel options) of a channel the client
    creates; balancing (balance=True, or a list of targets) adds the round-robin service config."""
    if has_channel:
        if tls is not False:
            raise ValueError("tls applies to the channel the client creates, not to `channel`")
        if balance is not None or not isinstance(target, str):
            raise ValueError(
                "a target list and balance apply to the channel the client creates, "
                "not to `channel`"
            )
        return "", None, []
    uri, is_balanced = _target_uri(target, balance, tls)
    credentials, tls_options = channel_security(tls)
    channel_options = [*(options or ()), *tls_options]
    if is_balanced:
        if any(key == SERVICE_CONFIG_OPTION for key, _ in channel_options):
            raise ValueError(
                f"balancing sets the {SERVICE_CONFIG_OPTION} option: pass either a target list "
                "or balance=True, or your own service config"
            )
        channel_options.append((SERVICE_CONFIG_OPTION, BALANCED_SERVICE_CONFIG))
    return uri, credentials, channel_options


def _target_uri(
    target: str | Sequence[str], balance: bool | None, tls: bool | TlsConfig
) -> tuple[str, bool]:
    """(the target URI, whether to balance over its addresses); a list is always balanced."""
    if isinstance(target, str):
        return target, bool(balance)
    if balance is False:
        raise ValueError("a list of targets is always balanced: balance=False takes one target")
    if tls is not False and not (isinstance(tls, TlsConfig) and tls.server_name):
        raise ValueError(
            "TLS over a list of targets checks one name for every replica: set "
            "TlsConfig(server_name=...) (--tls-server-name) to the name their certificates carry"
        )
    return balanced_target(target), True


class _Defaults:
    """Client-wide call defaults: a deadline and metadata (with the token) sent with every call,
    and how many times in a row a generation stream is resumed."""

    def __init__(
        self,
        timeout: float | None,
        metadata: MetadataLike | None,
        token: str | None,
        resume_attempts: int,
    ) -> None:
        self.timeout = timeout
        self.metadata = _bearer(token) + _to_metadata(metadata)
        self.resume_attempts = check_attempts(resume_attempts)

    def resumption(
        self, call: _Streaming[Any, Any], timeout: float | None, metadata: _Metadata | None
    ) -> Resumption | None:
        """The resumption of a generation stream starting now (None: it is not resumed)."""
        attempts = call.resume_attempts
        attempts = self.resume_attempts if attempts is None else check_attempts(attempts)
        if not (call.resumable and attempts):
            return None
        request = cast("GenerationRequest", call.request)
        return Resumption(request, timeout, metadata, attempts)

    def call_options(
        self, options: CallOptions, request: Message, *, use_default_timeout: bool = True
    ) -> tuple[float | None, _Metadata | None]:
        """The (timeout, metadata) of one call: per-call values over the client's, plus the
        routing headers of `request` and the current trace context (traceparent, when
        OpenTelemetry is installed) that the caller's metadata does not set itself. A call with
        no natural end (a watch) passes use_default_timeout=False: only its own timeout counts."""
        timeout = options.get("timeout")
        if timeout is None and use_default_timeout:
            timeout = self.timeout
        metadata = self.metadata + _to_metadata(options.get("metadata"))
        given = {key for key, _ in metadata}
        added = (*routing_metadata(request), *trace_metadata())
        metadata += tuple(item for item in added if item[0] not in given)
        return timeout, (metadata or None)


_Message = TypeVar("_Message", bound=Message)


_Dialed_co = TypeVar("_Dialed_co", covariant=True)


@dataclass(frozen=True, slots=True)
class _Redial(Generic[_Dialed_co]):
    """How a stream calls again: `dial` starts the call of a (request, timeout, metadata) and
    gives (call, its messages); `state` says when and with what."""

    dial: Callable[[Any, float | None, _Metadata | None], _Dialed_co]
    state: Resumption


class _SyncCall(Generic[_Message]):
    """One server-streaming call read message by message: close(), leaving a `with` block or
    GC cancels it unless it has ended; errors arrive as LlamaGrpcError. With `redial`, a
    generation stream cut by UNAVAILABLE calls again (see _EventStream)."""

    def __init__(
        self,
        call: grpc.Call,
        messages: Iterator[_Message],
        redial: _Redial[tuple[grpc.Call, Iterator[_Message]]] | None = None,
    ) -> None:
        self._call = call
        self._messages = messages
        self._redial = redial
        self._is_ended = False
        self._is_closed = False

    def _read(self) -> _Message | None:
        """The next message; None once the call ended OK."""
        try:
            return next(self._messages)
        except StopIteration:
            self._is_ended = True
            return None
        except grpc.RpcError as error:
            self._is_ended = True
            raise from_rpc_error(error) from error

    def close(self) -> None:
        """Cancel the RPC unless it already ended; later iteration stops at once."""
        self._is_closed = True
        if not self._is_ended:
            self._is_ended = True
            self._call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves cancel untyped

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_is_ended"):
            self.close()


class _AsyncCall(Generic[_Message]):
    """The asyncio _SyncCall: aclose(), leaving an `async with` block or GC cancels it."""

    def __init__(
        self,
        call: grpc.aio.Call,
        messages: AsyncIterator[_Message],
        redial: _Redial[tuple[grpc.aio.Call, AsyncIterator[_Message]]] | None = None,
    ) -> None:
        self._call = call
        self._messages = messages
        self._redial = redial
        self._is_ended = False
        self._is_closed = False

    async def _read(self) -> _Message | None:
        """The next message; None once the call ended OK."""
        try:
            return await anext(self._messages)
        except StopAsyncIteration:
            self._is_ended = True
            return None
        except grpc.RpcError as error:
            self._is_ended = True
            raise from_rpc_error(error) from error

    async def aclose(self) -> None:
        """Cancel the RPC unless it already ended; later iteration stops at once."""
        self._cancel()

    def _cancel(self) -> None:
        self._is_closed = True
        if not self._is_ended:
            self._is_ended = True
            self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._cancel()

    def __del__(self) -> None:
        if hasattr(self, "_is_ended"):
            # The event loop may already be closed at interpreter exit; nothing is left to cancel.
            with contextlib.suppress(RuntimeError):
                self._cancel()


_NO_DONE = "the stream ended without a final done message"


_E = TypeVar("_E", bound=t.ReasoningDelta | t.Delta | t.ToolCallDelta)


class _EventStream(_SyncCall[_EventMessage], Generic[_E]):
    """A sync stream of generation events ending with one Done; close() or GC cancels the RPC.
    Each delta message becomes the events `_events` makes of it. With `redial` (the client's
    resume_attempts), a call cut by UNAVAILABLE is made again with the tokens received so far
    (resume.py) and iteration goes on with what the caller has not had."""

    def __init__(
        self,
        call: grpc.Call,
        messages: Iterator[_EventMessage],
        redial: _Redial[tuple[grpc.Call, Iterator[_EventMessage]]] | None = None,
    ) -> None:
        super().__init__(call, messages, redial)
        self._done: t.Done | None = None
        self._pending: deque[_E] = deque()

    def _events(self, delta: pb.GenerationDelta) -> list[_E]:
        raise NotImplementedError

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> _E | t.Done:
        while not self._is_ended:
            if self._pending:
                return self._pending.popleft()
            try:
                message = self._read()
            except LlamaGrpcError as error:
                if self._redial is None:
                    raise
                time.sleep(self._redial.state.after(error))  # or raises the stream's error
                if self._is_closed:
                    break
                self._call, self._messages = self._redial.dial(*self._redial.state.next_call())
                self._is_ended = False
                continue
            if message is None:
                if self._done is None:
                    raise InternalError(_NO_DONE)
                break
            kind = message.WhichOneof("event")
            if kind == "delta":
                delta = self._new_part(message.delta)
                self._pending.extend(self._events(delta) if delta is not None else ())
            elif kind == "done":
                request_id = message.done.request_id or self._fallback_request_id()
                self._done = t.done_from_proto(message.done, request_id)
                return self._done
        raise StopIteration

    def _new_part(self, delta: pb.GenerationDelta) -> pb.GenerationDelta | None:
        """What of `delta` the caller has not had (all of it unless the stream was resumed);
        a resumed call that cannot be lined up with the answer is cancelled (InternalError)."""
        if self._redial is None:
            return delta
        try:
            return self._redial.state.take(delta)
        except InternalError:
            self.close()
            raise

    def _fallback_request_id(self) -> str:
        return request_id_of(self._call.initial_metadata())

    @property
    def done(self) -> t.Done | None:
        """The final Done value, once the stream has yielded it."""
        return self._done

    @property
    def resumptions(self) -> int:
        """How many times the stream called again after its call was cut (0: never)."""
        return 0 if self._redial is None else self._redial.state.resumptions

    @property
    def request_id(self) -> str:
        """The server's `x-request-id` (waits for the response headers, which come with the
        first message; a call refused before one has its id in the error instead)."""
        return self._fallback_request_id()


class Stream(_EventStream[t.Delta]):
    """A sync stream of Delta values ending with one Done; close() or GC cancels the RPC."""

    def _events(self, delta: pb.GenerationDelta) -> list[t.Delta]:
        return [t.delta_from_proto(delta)]


class ChatStream(_EventStream[t.ReasoningDelta | t.Delta | t.ToolCallDelta]):
    """A sync chat stream: ReasoningDelta values (a thinking model's thinking, all before the
    text), Delta values (text) and ToolCallDelta values (pieces of tool calls), ending with one
    Done; close() or GC cancels the RPC. It joins what it has yielded: reasoning, text,
    tool_calls and message() give the answer so far (whole once the Done has come)."""

    def __init__(
        self,
        call: grpc.Call,
        messages: Iterator[_EventMessage],
        redial: _Redial[tuple[grpc.Call, Iterator[_EventMessage]]] | None = None,
    ) -> None:
        super().__init__(call, messages, redial)
        self._answer = t.StreamAccumulator()

    def _events(
        self, delta: pb.GenerationDelta
    ) -> list[t.ReasoningDelta | t.Delta | t.ToolCallDelta]:
        return t.chat_events_from_proto(delta)

    def __next__(self) -> t.ChatStreamEvent:
        event = super().__next__()
        self._answer.add(event)
        return event

    @property
    def reasoning(self) -> str:
        """The thinking yielded so far ("" from a model that did not think)."""
        return self._answer.reasoning

    @property
    def text(self) -> str:
        """The text yielded so far."""
        return self._answer.text

    @property
    def tool_calls(self) -> tuple[t.ToolCall, ...]:
        """The tool calls yielded so far, their pieces joined (whole once the Done has come)."""
        return self._answer.tool_calls

    def message(self) -> t.ChatMessage:
        """The answer as the assistant turn to append to the conversation (with its calls and
        its thinking as reasoning_content)."""
        return self._answer.message()


class _AsyncEventStream(_AsyncCall[_EventMessage], Generic[_E]):
    """The asyncio _EventStream: aclose(), `async with` or GC cancels the RPC; resumed the same
    way."""

    def __init__(
        self,
        call: grpc.aio.Call,
        messages: AsyncIterator[_EventMessage],
        redial: _Redial[tuple[grpc.aio.Call, AsyncIterator[_EventMessage]]] | None = None,
    ) -> None:
        super().__init__(call, messages, redial)
        self._done: t.Done | None = None
        self._pending: deque[_E] = deque()

    def _events(self, delta: pb.GenerationDelta) -> list[_E]:
        raise NotImplementedError

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> _E | t.Done:
        while not self._is_ended:
            if self._pending:
                return self._pending.popleft()
            try:
                message = await self._read()
            except LlamaGrpcError as error:
                if self._redial is None:
                    raise
                await asyncio.sleep(self._redial.state.after(error))  # or raises the error
                if self._is_closed:
                    break
                self._call, self._messages = self._redial.dial(*self._redial.state.next_call())
                self._is_ended = False
                continue
            if message is None:
                if self._done is None:
                    raise InternalError(_NO_DONE)
                break
            kind = message.WhichOneof("event")
            if kind == "delta":
                delta = self._new_part(message.delta)
                self._pending.extend(self._events(delta) if delta is not None else ())
            elif kind == "done":
                request_id = message.done.request_id or await self._fallback_request_id()
                self._done = t.done_from_proto(message.done, request_id)
                return self._done
        raise StopAsyncIteration

    def _new_part(self, delta: pb.GenerationDelta) -> pb.GenerationDelta | None:
        """What of `delta` the caller has not had (see _EventStream._new_part)."""
        if self._redial is None:
            return delta
        try:
            return self._redial.state.take(delta)
        except InternalError:
            self._cancel()
            raise

    async def _fallback_request_id(self) -> str:
        return request_id_of(await self._call.initial_metadata())

    @property
    def done(self) -> t.Done | None:
        """The final Done value, once the stream has yielded it."""
        return self._done

    @property
    def resumptions(self) -> int:
        """How many times the stream called again after its call was cut (0: never)."""
        return 0 if self._redial is None else self._redial.state.resumptions

    async def request_id(self) -> str:
        """The server's `x-request-id` (waits for the response headers, which come with the
        first message; a call refused before one has its id in the error instead)."""
        return await self._fallback_request_id()


class AsyncStream(_AsyncEventStream[t.Delta]):
    """An async stream of Delta values ending with one Done; aclose() or GC cancels the RPC."""

    def _events(self, delta: pb.GenerationDelta) -> list[t.Delta]:
        return [t.delta_from_proto(delta)]


class AsyncChatStream(_AsyncEventStream[t.ReasoningDelta | t.Delta | t.ToolCallDelta]):
    """The asyncio ChatStream: ReasoningDelta, Delta and ToolCallDelta values, then one Done;
    aclose(), `async with` or GC cancels the RPC. reasoning, text, tool_calls and message()
    join what it yielded."""

    def __init__(
        self,
        call: grpc.aio.Call,
        messages: AsyncIterator[_EventMessage],
        redial: _Redial[tuple[grpc.aio.Call, AsyncIterator[_EventMessage]]] | None = None,
    ) -> None:
        super().__init__(call, messages, redial)
        self._answer = t.StreamAccumulator()

    def _events(
        self, delta: pb.GenerationDelta
    ) -> list[t.ReasoningDelta | t.Delta | t.ToolCallDelta]:
        return t.chat_events_from_proto(delta)

    async def __anext__(self) -> t.ChatStreamEvent:
        event = await super().__anext__()
        self._answer.add(event)
        return event

    @property
    def reasoning(self) -> str:
        """The thinking yielded so far ("" from a model that did not think)."""
        return self._answer.reasoning

    @property
    def text(self) -> str:
        """The text yielded so far."""
        return self._answer.text

    @property
    def tool_calls(self) -> tuple[t.ToolCall, ...]:
        """The tool calls yielded so far, their pieces joined (whole once the Done has come)."""
        return self._answer.tool_calls

    def message(self) -> t.ChatMessage:
        """The answer as the assistant turn to append to the conversation (with its calls and
        its thinking as reasoning_content)."""
        return self._answer.message()


class LoadStream(_SyncCall[pb.LoadReport]):
    """LoadReport values from WatchLoad: one at once, then one per interval, until close() (or
    GC) cancels the RPC or the server drains (its last report has serving=False)."""

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> t.LoadReport:
        message = None if self._is_ended else self._read()
        if message is None:
            raise StopIteration
        return t.load_report_from_proto(message)


class AsyncLoadStream(_AsyncCall[pb.LoadReport]):
    """The asyncio LoadStream: aclose(), `async with` or GC cancels the RPC."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> t.LoadReport:
        message = None if self._is_ended else await self._read()
        if message is None:
            raise StopAsyncIteration
        return t.load_report_from_proto(message)


def watch_load_request(interval_s: float) -> pb.WatchLoadRequest:
    """A WatchLoadRequest for `interval_s` seconds between reports (in whole milliseconds; the
    server refuses less than 0.1 s and takes more than 60 s as 60 s)."""
    if not math.isfinite(interval_s) or round(interval_s * 1000) < 1:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    return pb.WatchLoadRequest(interval_ms=min(round(interval_s * 1000), _MAX_UINT32))


_T = TypeVar("_T")
_Wrapped = TypeVar("_Wrapped")


@dataclass(frozen=True, slots=True)
class _Unary(Generic[_Req, _Resp, _T]):
    """One unary call: the stub method it calls (picked from a sync stub; an aio stub has the
    same methods for the same messages), its request and per-call options, and how its
    response and the server's `x-request-id` become the value the client method returns."""

    rpc: Callable[[pb_grpc.LlmServiceStub], grpc.UnaryUnaryMultiCallable[_Req, _Resp]]
    request: _Req
    options: CallOptions
    convert: Callable[[_Resp, str], _T]


@dataclass(frozen=True, slots=True)
class _Streaming(Generic[_Req, _Resp]):
    """One server-streaming call: the stub method, its request and per-call options; a call with
    no natural end (a watch) takes no default timeout."""

    rpc: Callable[[pb_grpc.LlmServiceStub], grpc.UnaryStreamMultiCallable[_Req, _Resp]]
    request: _Req
    options: CallOptions
    use_default_timeout: bool = True
    # A generation stream, resumed when its call is cut; resume_attempts None: the client's.
    resumable: bool = False
    resume_attempts: int | None = None


# chat()'s tools, tool_choice and parallel_tool_calls, passed on together.
_Tools = tuple[Sequence[ToolLike] | None, ToolChoiceLike | None, bool | None]
# chat()'s enable_thinking, chat_template_kwargs and reasoning_budget.
_Thinking = tuple[bool | None, Mapping[str, Any] | None, int | None]


def _resume_attempts(params: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A stream's keyword parameters without resume_attempts, and resume_attempts (None: not
    given)."""
    fields = dict(params)
    return fields, fields.pop("resume_attempts", None)


def _value(convert: Callable[[_Resp], _T]) -> Callable[[_Resp, str], _T]:
    """A response converter that has no use for the server's request id."""
    return lambda response, _: convert(response)


class _Surface:
    """The call surface of Client and AsyncClient, defined once: per public method, the call it
    makes (stub method, request built from its arguments, options) and how the response becomes
    its return value. Each client method is a shell that runs its call here, sync or async
    (tests/unit/client/test_client_parity.py checks that the two classes' methods match)."""

    @staticmethod
    def generate(
        prompt: str, params: GenerationParams
    ) -> _Unary[pb.GenerateRequest, pb.GenerateResponse, t.GenerateResult]:
        request = build_request(pb.GenerateRequest(prompt=prompt), params)
        return _Unary(lambda stub: stub.Generate, request, params, t.result_from_proto)

    @staticmethod
    def stream(
        prompt: str, params: StreamParams
    ) -> _Streaming[pb.StreamGenerateRequest, pb.StreamGenerateResponse]:
        fields, attempts = _resume_attempts(params)
        request = build_request(pb.StreamGenerateRequest(prompt=prompt), fields)
        return _Streaming(
            lambda stub: stub.StreamGenerate,
            request,
            params,
            resumable=True,
            resume_attempts=attempts,
        )

    @staticmethod
    def chat(
        messages: Iterable[MessageLike],
        tools: _Tools,
        thinking: _Thinking,
        params: GenerationParams,
    ) -> _Unary[pb.GenerateRequest, pb.GenerateResponse, t.GenerateResult]:
        request = build_chat_request(pb.GenerateRequest(), messages, *tools, params, thinking)
        return _Unary(lambda stub: stub.Generate, request, params, t.result_from_proto)

    @staticmethod
    def stream_chat(
        messages: Iterable[MessageLike],
        tools: _Tools,
        thinking: _Thinking,
        params: StreamParams,
    ) -> _Streaming[pb.StreamGenerateRequest, pb.StreamGenerateResponse]:
        fields, attempts = _resume_attempts(params)
        request = build_chat_request(pb.StreamGenerateRequest(), messages, *tools, fields, thinking)
        return _Streaming(
            lambda stub: stub.StreamGenerate,
            request,
            params,
            resumable=True,
            resume_attempts=attempts,
        )

    @staticmethod
    def generate_tokens(
        token_ids: Sequence[int], params: TokenStreamParams
    ) -> _Streaming[pb.GenerateTokensRequest, pb.GenerateTokensResponse]:
        fields, attempts = _resume_attempts(params)
        request = build_request(pb.GenerateTokensRequest(token_ids=token_ids), fields)
        return _Streaming(
            lambda stub: stub.GenerateTokens,
            request,
            params,
            resumable=True,
            resume_attempts=attempts,
        )

    @staticmethod
    def tokenize(  # noqa: PLR0917  # tokenize()'s arguments, passed on
        text: str,
        add_special: bool,
        parse_special: bool,
        return_pieces: bool,
        model: str | None,
        options: CallOptions,
    ) -> _Unary[pb.TokenizeRequest, pb.TokenizeResponse, list[int] | t.TokenizeResult]:
        request = tokenize_request(text, add_special, parse_special, return_pieces, model)
        pieces = _value(partial(_tokenized, return_pieces=return_pieces))
        return _Unary(lambda stub: stub.Tokenize, request, options, pieces)

    @staticmethod
    def embed(
        inputs: EmbedInputs, params: EmbedParams
    ) -> _Unary[pb.EmbedRequest, pb.EmbedResponse, t.EmbedResult]:
        request = embed_request(inputs, params)
        return _Unary(lambda stub: stub.Embed, request, params, _value(t.embed_result_from_proto))

    @staticmethod
    def detokenize(
        token_ids: Sequence[int], render_special: bool, model: str | None, options: CallOptions
    ) -> _Unary[pb.DetokenizeRequest, pb.DetokenizeResponse, str]:
        request = pb.DetokenizeRequest(
            model=model or "", token_ids=token_ids, render_special=render_special
        )
        return _Unary(lambda stub: stub.Detokenize, request, options, lambda r, _: r.text)

    @staticmethod
    def stats(
        model: str | None, options: CallOptions
    ) -> _Unary[pb.GetStatsRequest, pb.GetStatsResponse, t.Stats]:
        request = pb.GetStatsRequest(model=model or "")
        return _Unary(lambda stub: stub.GetStats, request, options, _value(t.stats_from_proto))

    @staticmethod
    def watch_load(
        interval_s: float, options: CallOptions
    ) -> _Streaming[pb.WatchLoadRequest, pb.LoadReport]:
        request = watch_load_request(interval_s)
        return _Streaming(lambda stub: stub.WatchLoad, request, options, use_default_timeout=False)

    @staticmethod
    def model_info(
        model: str | None, options: CallOptions
    ) -> _Unary[pb.GetModelInfoRequest, pb.GetModelInfoResponse, t.ModelInfo]:
        request = pb.GetModelInfoRequest(model=model or "")
        info = _value(t.model_info_from_proto)
        return _Unary(lambda stub: stub.GetModelInfo, request, options, info)

    @staticmethod
    def clear_cache(
        model: str | None, options: CallOptions
    ) -> _Unary[pb.ClearCacheRequest, pb.ClearCacheResponse, t.CacheCleared]:
        request = pb.ClearCacheRequest(model=model or "")
        cleared = _value(t.cache_cleared_from_proto)
        return _Unary(lambda stub: stub.ClearCache, request, options, cleared)

    @staticmethod
    def list_models(
        options: CallOptions,
    ) -> _Unary[pb.ListModelsRequest, pb.ListModelsResponse, t.ModelList]:
        models = _value(t.model_list_from_proto)
        return _Unary(lambda stub: stub.ListModels, pb.ListModelsRequest(), options, models)

    @staticmethod
    def load_model(
        model: str, options: CallOptions
    ) -> _Unary[pb.LoadModelRequest, pb.LoadModelResponse, t.ModelStatus]:
        request = pb.LoadModelRequest(model=model)
        status = _value(_model_status)
        return _Unary(lambda stub: stub.LoadModel, request, options, status)

    @staticmethod
    def unload_model(
        model: str, force: bool, options: CallOptions
    ) -> _Unary[pb.UnloadModelRequest, pb.UnloadModelResponse, t.ModelUnloaded]:
        request = pb.UnloadModelRequest(model=model, force=force)
        unloaded = _value(t.model_unloaded_from_proto)
        return _Unary(lambda stub: stub.UnloadModel, request, options, unloaded)

    @staticmethod
    def load_adapter(
        name: str,
        path: str,
        model: str | None,
        default_scale: float | None,
        options: CallOptions,
    ) -> _Unary[pb.LoadAdapterRequest, pb.LoadAdapterResponse, t.Adapter]:
        request = load_adapter_request(name, path, model, default_scale)
        adapter = _value(_loaded_adapter)
        return _Unary(lambda stub: stub.LoadAdapter, request, options, adapter)

    @staticmethod
    def unload_adapter(
        name: str, model: str | None, options: CallOptions
    ) -> _Unary[pb.UnloadAdapterRequest, pb.UnloadAdapterResponse, int]:
        request = pb.UnloadAdapterRequest(model=model or "", name=name)
        return _Unary(lambda stub: stub.UnloadAdapter, request, options, lambda r, _: r.in_flight)

    @staticmethod
    def list_adapters(
        model: str | None, options: CallOptions
    ) -> _Unary[pb.ListAdaptersRequest, pb.ListAdaptersResponse, list[t.Adapter]]:
        request = pb.ListAdaptersRequest(model=model or "")
        adapters = _value(t.adapters_from_proto)
        return _Unary(lambda stub: stub.ListAdapters, request, options, adapters)

    @staticmethod
    def health(
        channel: grpc.Channel | grpc.aio.Channel, service: str, options: CallOptions
    ) -> _Unary[Any, Any, str]:
        """grpc.health.v1 Check on `channel` (grpcio-health-checking has no type hints)."""
        health_pb2, health_pb2_grpc = _health_modules()
        request = health_pb2.HealthCheckRequest(service=service)

        def status(response: Any, _: str) -> str:
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

        return _Unary(lambda _: health_pb2_grpc.HealthStub(channel).Check, request, options, status)


class Client:
    """A sync client of a llama-grpc server (or of replicas); close() it or use `with`."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        channel: grpc.Channel | None = None,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        options: Sequence[tuple[str, str | int]] | None = None,
        tls: bool | TlsConfig = False,
        token: str | None = None,
        balance: bool | None = None,
        resume_attempts: int = DEFAULT_RESUME_ATTEMPTS,
    ) -> None:
        """Connect to `target` (or use `channel`); `timeout` (s) is the default deadline.

        `target`: HOST:PORT or a gRPC target URI, or a list of IP:PORT replicas. A list, or a
        target such as `dns:///name:port` with `balance=True`, makes one channel that sends calls
        round robin to the replicas whose LlmService health is SERVING (gRPC's round_robin with
        client-side health checking); a list is always balanced, and over TLS it needs
        TlsConfig(server_name=...). `tls`: True for TLS trusting the system roots, a TlsConfig for
        a CA, a client certificate (mTLS) or a server name; its files are read here. `token` is
        sent as `authorization: Bearer <token>` with every call, also over plaintext (fine on
        loopback; anywhere else anyone on the path can read it: use TLS).

        `resume_attempts`: a generation stream (stream, stream_chat, generate_tokens) whose call
        ends UNAVAILABLE (a replica drained, stopped or hung, a connection reset) calls again
        through the same target with the tokens received so far, and goes on yielding what it
        had not yet yielded, as if nothing happened (docs/resume-client.md); this many times in
        a row at most (a call that brings new tokens starts the count again), within the call's
        deadline, each after a short random wait. 0 turns it off; a stream's resume_attempts=
        keyword overrides it, and its `resumptions` says how often it called again."""
        self._owns_channel = channel is None
        uri, credentials, channel_options = _channel_settings(
            target, channel is not None, options, tls, balance
        )
        self._defaults = _Defaults(timeout, metadata, token, resume_attempts)
        if channel is not None:
            self._channel = channel
        elif credentials is None:
            self._channel = grpc.insecure_channel(uri, options=channel_options)
        else:
            self._channel = grpc.secure_channel(uri, credentials, options=channel_options)
        self._stub = pb_grpc.LlmServiceStub(self._channel)

    def _unary(self, call: _Unary[_Req, _Resp, _T]) -> _T:
        timeout, metadata = self._defaults.call_options(call.options, call.request)
        method = call.rpc(self._stub)
        try:
            response, rpc = method.with_call(call.request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        return call.convert(response, request_id_of(rpc.initial_metadata()))

    def _streaming(
        self,
        call: _Streaming[_Req, _Resp],
        wrap: Callable[
            [grpc.Call, Iterator[_Resp], _Redial[tuple[grpc.Call, Iterator[_Resp]]] | None],
            _Wrapped,
        ],
    ) -> _Wrapped:
        timeout, metadata = self._defaults.call_options(
            call.options, call.request, use_default_timeout=call.use_default_timeout
        )
        method = call.rpc(self._stub)

        def dial(
            request: _Req, timeout: float | None, metadata: _Metadata | None
        ) -> tuple[grpc.Call, Iterator[_Resp]]:
            rpc = method(request, timeout=timeout, metadata=metadata)
            return rpc, iter(rpc)

        resumption = self._defaults.resumption(call, timeout, metadata)
        redial = None if resumption is None else _Redial(dial, resumption)
        return wrap(*dial(call.request, timeout, metadata), redial)

    def generate(self, prompt: str, **params: Unpack[GenerationParams]) -> t.GenerateResult:
        """Generate a whole completion of `prompt`."""
        return self._unary(_Surface.generate(prompt, params))

    def stream(self, prompt: str, **params: Unpack[StreamParams]) -> Stream:
        """Stream the completion of `prompt` as Delta values, then one Done."""
        return self._streaming(_Surface.stream(prompt, params), Stream)

    def chat(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] | None = None,
        tool_choice: ToolChoiceLike | None = None,
        parallel_tool_calls: bool | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_budget: int | None = None,
        **params: Unpack[GenerationParams],
    ) -> t.GenerateResult:
        """Complete a conversation (rendered with the server's or `chat_template`'s template).

        `messages`: ChatMessage values, OpenAI-shaped dicts or (role, content) pairs; assistant
        turns may carry tool_calls and "tool" turns answer them (tool_call_id). `tools`:
        functions the model may call (Tool values, OpenAI-shaped or plain dicts); its calls come
        back in the result's tool_calls, with finish_reason "tool_calls". `tool_choice`: "auto"
        (the default with tools), "none", "required" or one function (its name, a Tool or
        {"type": "function", "function": {"name": ...}}). `parallel_tool_calls=False`: at most
        one call. A thinking model (Qwen 3, DeepSeek R1, Gemma 4...) returns its thinking in the
        result's reasoning: `enable_thinking` turns it on or off (the template's own default
        when None), `chat_template_kwargs` are extra variables of the template (a mapping, sent
        as JSON; enable_thinking wins over its key of that name), `reasoning_budget` caps the
        thinking tokens (-1 no limit, 0 no thinking). None leaves a setting to the server."""
        tooling = (tools, tool_choice, parallel_tool_calls)
        thinking = (enable_thinking, chat_template_kwargs, reasoning_budget)
        return self._unary(_Surface.chat(messages, tooling, thinking, params))

    def stream_chat(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] | None = None,
        tool_choice: ToolChoiceLike | None = None,
        parallel_tool_calls: bool | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_budget: int | None = None,
        **params: Unpack[StreamParams],
    ) -> ChatStream:
        """Stream the reply to a conversation as ReasoningDelta values (thinking, all before the
        text), Delta values (text) and ToolCallDelta values (pieces of tool calls), then one
        Done; the arguments are chat()'s. The stream joins what it yields: its reasoning, text,
        tool_calls and message() (the assistant turn to append)."""
        tooling = (tools, tool_choice, parallel_tool_calls)
        thinking = (enable_thinking, chat_template_kwargs, reasoning_budget)
        return self._streaming(
            _Surface.stream_chat(messages, tooling, thinking, params), ChatStream
        )

    def generate_tokens(
        self, token_ids: Sequence[int], **params: Unpack[TokenStreamParams]
    ) -> Stream:
        """Stream the completion of a pre-tokenized prompt (used as given: add BOS yourself)."""
        return self._streaming(_Surface.generate_tokens(token_ids, params), Stream)

    @overload
    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = ...,
        parse_special: bool = ...,
        return_pieces: Literal[False] = ...,
        model: str | None = ...,
        **options: Unpack[CallOptions],
    ) -> list[int]: ...
    @overload
    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = ...,
        parse_special: bool = ...,
        return_pieces: Literal[True],
        model: str | None = ...,
        **options: Unpack[CallOptions],
    ) -> t.TokenizeResult: ...
    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        return_pieces: bool = False,
        model: str | None = None,
        **options: Unpack[CallOptions],
    ) -> list[int] | t.TokenizeResult:
        """Token ids of `text`; with return_pieces=True a TokenizeResult with each token's text."""
        return self._unary(
            _Surface.tokenize(text, add_special, parse_special, return_pieces, model, options)
        )

    def embed(self, inputs: EmbedInputs, **params: Unpack[EmbedParams]) -> t.EmbedResult:
        """Embeddings of `inputs` (a text, or a list of texts and token id lists), in order."""
        return self._unary(_Surface.embed(inputs, params))

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        render_special: bool = False,
        model: str | None = None,
        **options: Unpack[CallOptions],
    ) -> str:
        """The text of `token_ids`."""
        return self._unary(_Surface.detokenize(token_ids, render_special, model, options))

    def stats(self, *, model: str | None = None, **options: Unpack[CallOptions]) -> t.Stats:
        """A model's (the default one's) live scheduler snapshot and cumulative counters;
        ModelNotLoadedError when that model is not loaded."""
        return self._unary(_Surface.stats(model, options))

    def watch_load(self, interval_s: float = 1.0, **options: Unpack[CallOptions]) -> LoadStream:
        """The server's load as LoadReport values: one at once, then one every `interval_s`
        (at least 0.1), until close() or the server drains (its last report has
        serving=False). The client's default timeout does not apply: pass timeout= for one."""
        return self._streaming(_Surface.watch_load(interval_s, options), LoadStream)

    def model_info(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> t.ModelInfo:
        """Facts about a model (the default one) and its context; loads it if need be."""
        return self._unary(_Surface.model_info(model, options))

    def clear_cache(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> t.CacheCleared:
        """Admin: forget cached KV no request is using (PermissionDeniedError for a user)."""
        return self._unary(_Surface.clear_cache(model, options))

    def list_models(self, **options: Unpack[CallOptions]) -> t.ModelList:
        """Admin: every model the server may serve, with its state."""
        return self._unary(_Surface.list_models(options))

    def load_model(self, model: str, **options: Unpack[CallOptions]) -> t.ModelStatus:
        """Admin: load a model now (waits for it, within the call's timeout)."""
        return self._unary(_Surface.load_model(model, options))

    def unload_model(
        self, model: str, *, force: bool = False, **options: Unpack[CallOptions]
    ) -> t.ModelUnloaded:
        """Admin: unload a model. ModelBusyError while it has requests in flight, unless
        force (they then end with UnavailableError, reason MODEL_UNLOADED)."""
        return self._unary(_Surface.unload_model(model, force, options))

    def load_adapter(
        self,
        name: str,
        path: str,
        *,
        model: str | None = None,
        default_scale: float | None = None,
        **options: Unpack[CallOptions],
    ) -> t.Adapter:
        """Admin: load the LoRA adapter GGUF at `path` (on the server) for a model (the default
        one), served as `name`; `default_scale` (None: 1) is what requests naming it without a
        scale get. InvalidArgumentError when it does not fit the model."""
        return self._unary(_Surface.load_adapter(name, path, model, default_scale, options))

    def unload_adapter(
        self, name: str, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> int:
        """Admin: unload a model's (the default one's) adapter; requests already using it finish
        with it. Returns how many those are."""
        return self._unary(_Surface.unload_adapter(name, model, options))

    def list_adapters(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> list[t.Adapter]:
        """The LoRA adapters a model (the default one) serves, with their counters (a user sees
        only those its tenant may use)."""
        return self._unary(_Surface.list_adapters(model, options))

    def health(self, service: str = "", **options: Unpack[CallOptions]) -> str:
        """The grpc.health.v1 status of `service` ("" = whole server): "SERVING", "NOT_SERVING"."""
        return self._unary(_Surface.health(self._channel, service, options))

    def close(self) -> None:
        """Close the channel if this client created it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """An asyncio client of a llama-grpc server (or of replicas); aclose() it or `async with`."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        channel: grpc.aio.Channel | None = None,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        options: Sequence[tuple[str, str | int]] | None = None,
        tls: bool | TlsConfig = False,
        token: str | None = None,
        balance: bool | None = None,
        resume_attempts: int = DEFAULT_RESUME_ATTEMPTS,
    ) -> None:
        """Connect to `target` (or use a grpc.aio `channel`): the arguments are Client's (see
        Client.__init__: target lists and balance=True, tls, token, resume_attempts)."""
        self._owns_channel = channel is None
        uri, credentials, channel_options = _channel_settings(
            target, channel is not None, options, tls, balance
        )
        self._defaults = _Defaults(timeout, metadata, token, resume_attempts)
        if channel is not None:
            self._channel = channel
        elif credentials is None:
            self._channel = grpc.aio.insecure_channel(uri, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(uri, credentials, options=channel_options)
        # The sync stub's type: the calls pick their methods by it (the aio ones take the same
        # messages; the methods are grpc.aio multicallables, cast back where they are called).
        self._stub = cast("pb_grpc.LlmServiceStub", pb_grpc.LlmServiceStub(self._channel))

    async def _unary(self, call: _Unary[_Req, _Resp, _T]) -> _T:
        timeout, metadata = self._defaults.call_options(call.options, call.request)
        method = cast("grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]", call.rpc(self._stub))
        rpc = method(call.request, timeout=timeout, metadata=metadata)
        try:
            response = await rpc
            initial_metadata = await rpc.initial_metadata()
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        return call.convert(response, request_id_of(initial_metadata))

    def _streaming(
        self,
        call: _Streaming[_Req, _Resp],
        wrap: Callable[
            [
                grpc.aio.Call,
                AsyncIterator[_Resp],
                _Redial[tuple[grpc.aio.Call, AsyncIterator[_Resp]]] | None,
            ],
            _Wrapped,
        ],
    ) -> _Wrapped:
        timeout, metadata = self._defaults.call_options(
            call.options, call.request, use_default_timeout=call.use_default_timeout
        )
        method = cast("grpc.aio.UnaryStreamMultiCallable[_Req, _Resp]", call.rpc(self._stub))

        def dial(
            request: _Req, timeout: float | None, metadata: _Metadata | None
        ) -> tuple[grpc.aio.Call, AsyncIterator[_Resp]]:
            rpc = method(request, timeout=timeout, metadata=metadata)
            return rpc, aiter(rpc)

        resumption = self._defaults.resumption(call, timeout, metadata)
        redial = None if resumption is None else _Redial(dial, resumption)
        return wrap(*dial(call.request, timeout, metadata), redial)

    async def generate(self, prompt: str, **params: Unpack[GenerationParams]) -> t.GenerateResult:
        """Generate a whole completion of `prompt`."""
        return await self._unary(_Surface.generate(prompt, params))

    def stream(self, prompt: str, **params: Unpack[StreamParams]) -> AsyncStream:
        """Stream the completion of `prompt` as Delta values, then one Done."""
        return self._streaming(_Surface.stream(prompt, params), AsyncStream)

    async def chat(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] | None = None,
        tool_choice: ToolChoiceLike | None = None,
        parallel_tool_calls: bool | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_budget: int | None = None,
        **params: Unpack[GenerationParams],
    ) -> t.GenerateResult:
        """Complete a conversation (rendered with the server's or `chat_template`'s template).

        `messages`: ChatMessage values, OpenAI-shaped dicts or (role, content) pairs; assistant
        turns may carry tool_calls and "tool" turns answer them (tool_call_id). `tools`:
        functions the model may call (Tool values, OpenAI-shaped or plain dicts); its calls come
        back in the result's tool_calls, with finish_reason "tool_calls". `tool_choice`: "auto"
        (the default with tools), "none", "required" or one function (its name, a Tool or
        {"type": "function", "function": {"name": ...}}). `parallel_tool_calls=False`: at most
        one call. A thinking model (Qwen 3, DeepSeek R1, Gemma 4...) returns its thinking in the
        result's reasoning: `enable_thinking` turns it on or off (the template's own default
        when None), `chat_template_kwargs` are extra variables of the template (a mapping, sent
        as JSON; enable_thinking wins over its key of that name), `reasoning_budget` caps the
        thinking tokens (-1 no limit, 0 no thinking). None leaves a setting to the server."""
        tooling = (tools, tool_choice, parallel_tool_calls)
        thinking = (enable_thinking, chat_template_kwargs, reasoning_budget)
        return await self._unary(_Surface.chat(messages, tooling, thinking, params))

    def stream_chat(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] | None = None,
        tool_choice: ToolChoiceLike | None = None,
        parallel_tool_calls: bool | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_budget: int | None = None,
        **params: Unpack[StreamParams],
    ) -> AsyncChatStream:
        """Stream the reply to a conversation as ReasoningDelta values (thinking, all before the
        text), Delta values (text) and ToolCallDelta values (pieces of tool calls), then one
        Done; the arguments are chat()'s. The stream joins what it yields: its reasoning, text,
        tool_calls and message() (the assistant turn to append)."""
        tooling = (tools, tool_choice, parallel_tool_calls)
        thinking = (enable_thinking, chat_template_kwargs, reasoning_budget)
        return self._streaming(
            _Surface.stream_chat(messages, tooling, thinking, params), AsyncChatStream
        )

    def generate_tokens(
        self, token_ids: Sequence[int], **params: Unpack[TokenStreamParams]
    ) -> AsyncStream:
        """Stream the completion of a pre-tokenized prompt (used as given: add BOS yourself)."""
        return self._streaming(_Surface.generate_tokens(token_ids, params), AsyncStream)

    @overload
    async def tokenize(
        self,
        text: str,
        *,
        add_special: bool = ...,
        parse_special: bool = ...,
        return_pieces: Literal[False] = ...,
        model: str | None = ...,
        **options: Unpack[CallOptions],
    ) -> list[int]: ...
    @overload
    async def tokenize(
        self,
        text: str,
        *,
        add_special: bool = ...,
        parse_special: bool = ...,
        return_pieces: Literal[True],
        model: str | None = ...,
        **options: Unpack[CallOptions],
    ) -> t.TokenizeResult: ...
    async def tokenize(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        return_pieces: bool = False,
        model: str | None = None,
        **options: Unpack[CallOptions],
    ) -> list[int] | t.TokenizeResult:
        """Token ids of `text`; with return_pieces=True a TokenizeResult with each token's text."""
        return await self._unary(
            _Surface.tokenize(text, add_special, parse_special, return_pieces, model, options)
        )

    async def embed(self, inputs: EmbedInputs, **params: Unpack[EmbedParams]) -> t.EmbedResult:
        """Embeddings of `inputs` (a text, or a list of texts and token id lists), in order."""
        return await self._unary(_Surface.embed(inputs, params))

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        render_special: bool = False,
        model: str | None = None,
        **options: Unpack[CallOptions],
    ) -> str:
        """The text of `token_ids`."""
        return await self._unary(_Surface.detokenize(token_ids, render_special, model, options))

    async def stats(self, *, model: str | None = None, **options: Unpack[CallOptions]) -> t.Stats:
        """A model's (the default one's) live scheduler snapshot and cumulative counters;
        ModelNotLoadedError when that model is not loaded."""
        return await self._unary(_Surface.stats(model, options))

    def watch_load(
        self, interval_s: float = 1.0, **options: Unpack[CallOptions]
    ) -> AsyncLoadStream:
        """The server's load as LoadReport values: one at once, then one every `interval_s`
        (at least 0.1), until aclose() or the server drains (its last report has
        serving=False). The client's default timeout does not apply: pass timeout= for one."""
        return self._streaming(_Surface.watch_load(interval_s, options), AsyncLoadStream)

    async def model_info(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> t.ModelInfo:
        """Facts about a model (the default one) and its context; loads it if need be."""
        return await self._unary(_Surface.model_info(model, options))

    async def clear_cache(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> t.CacheCleared:
        """Admin: forget cached KV no request is using (PermissionDeniedError for a user)."""
        return await self._unary(_Surface.clear_cache(model, options))

    async def list_models(self, **options: Unpack[CallOptions]) -> t.ModelList:
        """Admin: every model the server may serve, with its state."""
        return await self._unary(_Surface.list_models(options))

    async def load_model(self, model: str, **options: Unpack[CallOptions]) -> t.ModelStatus:
        """Admin: load a model now (waits for it, within the call's timeout)."""
        return await self._unary(_Surface.load_model(model, options))

    async def unload_model(
        self, model: str, *, force: bool = False, **options: Unpack[CallOptions]
    ) -> t.ModelUnloaded:
        """Admin: unload a model. ModelBusyError while it has requests in flight, unless
        force (they then end with UnavailableError, reason MODEL_UNLOADED)."""
        return await self._unary(_Surface.unload_model(model, force, options))

    async def load_adapter(
        self,
        name: str,
        path: str,
        *,
        model: str | None = None,
        default_scale: float | None = None,
        **options: Unpack[CallOptions],
    ) -> t.Adapter:
        """Admin: load the LoRA adapter GGUF at `path` (on the server) for a model (the default
        one), served as `name`; `default_scale` (None: 1) is what requests naming it without a
        scale get. InvalidArgumentError when it does not fit the model."""
        return await self._unary(_Surface.load_adapter(name, path, model, default_scale, options))

    async def unload_adapter(
        self, name: str, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> int:
        """Admin: unload a model's (the default one's) adapter; requests already using it finish
        with it. Returns how many those are."""
        return await self._unary(_Surface.unload_adapter(name, model, options))

    async def list_adapters(
        self, *, model: str | None = None, **options: Unpack[CallOptions]
    ) -> list[t.Adapter]:
        """The LoRA adapters a model (the default one) serves, with their counters (a user sees
        only those its tenant may use)."""
        return await self._unary(_Surface.list_adapters(model, options))

    async def health(self, service: str = "", **options: Unpack[CallOptions]) -> str:
        """The grpc.health.v1 status of `service` ("" = whole server): "SERVING", "NOT_SERVING"."""
        return await self._unary(_Surface.health(self._channel, service, options))

    async def aclose(self) -> None:
        """Close the channel if this client created it."""
        if self._owns_channel:
            await self._channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
