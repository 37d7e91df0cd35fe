"""Proto requests -> core.GenerationRequest, or a ServiceError naming the offending field.

Pure: no grpc context, no engine calls (the servicer tokenizes text prompts between the two steps:
parse_* checks every field, complete_request applies the prompt length). Messages live in Message.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.auth import scoped_cache_scope
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core import adapters
from llama_grpc_server.core.adapters import AdapterSet, scoped
from llama_grpc_server.core.api import GrammarCompiler, ModelInfo
from llama_grpc_server.core.constrained.structural_tag import structural_tag_to_gbnf
from llama_grpc_server.core.requests import context_fit, embedding
from llama_grpc_server.core.requests.chat import (
    BUILTIN_TEMPLATES,
    GGUF_TEMPLATE,
    ROLES,
    ChatMessage,
)
from llama_grpc_server.core.requests.request import (
    MAX_DRAFT_TOKENS,
    MAX_NGRAM,
    Constraint,
    GenerationRequest,
    OutputParams,
    Priority,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.tools.types import ToolCall

MAX_ID_LENGTH = 256  # session_id, cache_scope
MAX_ADAPTERS = 8  # LoRA adapters one request may apply
MAX_LOGIT_BIAS = 1024  # entries of params.sampling.logit_bias
MAX_TOP_LOGPROBS = 20
MAX_CONSTRAINT_CHARS = 100_000  # grammar text or JSON schema
# WatchLoad's interval_ms: 0 means the default; below the minimum is refused; above the maximum
# is taken as the maximum.
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 100
MAX_WATCH_INTERVAL_MS = 60_000

TextRequest = pb.GenerateRequest | pb.StreamGenerateRequest


class Message(enum.StrEnum):
    """Every validation message, written once; format() fills the numbers. The context-fit
    messages live with their rule in core.requests.context_fit."""

    EMPTY_PROMPT = "prompt must not be empty"
    EMPTY_TOKEN_IDS = "token_ids must not be empty"
    TOKEN_OUT_OF_RANGE = (
        "token id {token_id} at index {index} is out of range: the vocabulary has {n_vocab} tokens"
    )
    MODEL_NOT_FOUND = "model {model!r} is not loaded here; this server serves {loaded!r}"
    MAX_TOKENS_ZERO = "max_tokens must be at least 1 (leave it unset for the server default)"
    NOT_FINITE = "{name} must be a finite number, got {value:g}"
    OUT_OF_RANGE = "{name} must be {bounds}, got {value:g}"
    TOO_MANY_STOPS = "stop has {count} strings; at most {limit} are allowed"
    EMPTY_STOP = "stop strings must not be empty"
    STOP_TOO_LONG = "stop string is {length} characters long; at most {limit} are allowed"
    TIME_LIMIT_ZERO = "time_limit_ms must be at least 1 (leave it unset for no limit)"
    ID_TOO_LONG = "{name} is {length} characters long; at most {limit} are allowed"
    CONTROL_CHARACTER = "{name} must not contain control characters (found U+{code:04X})"
    TOO_MANY_ADAPTERS = "lora names {count} adapters; at most {limit} are allowed"
    BIAS_TOKEN_OUT_OF_RANGE = (
        "token id {token_id} is out of range: the vocabulary has {n_vocab} tokens"
    )
    TOO_MANY_BIASES = "logit_bias has {count} entries; at most {limit} are allowed"
    BIAS_NOT_ALLOWED = "the bias of token {token_id} must be a finite number or -inf, got {value}"
    TOP_LOGPROBS_TOO_MANY = "top_logprobs must be at most {limit}, got {value}"
    EMPTY_CONSTRAINT = "{name} must not be empty"
    CONSTRAINT_TOO_LONG = "{name} is {length} characters long; at most {limit} are allowed"
    NO_CONSTRAINTS = "this server cannot check grammars, so {name} is not supported"
    PROMPT_AND_MESSAGES = "set either prompt or messages, not both"
    TEMPLATE_WITHOUT_MESSAGES = "chat_template applies to messages only"
    UNKNOWN_ROLE = "role must be one of {roles}, got {role!r}"
    CALLS_NOT_ASSISTANT = "only assistant messages have tool_calls"
    TOOL_FIELD_ONLY = "{name} belongs to tool messages only"
    UNKNOWN_TEMPLATE = "unknown chat template {name!r}; known: {known}"
    NO_TEMPLATE = (
        "this model has no chat template: start the server with --chat-template "
        "({builtins}) or send chat_template with the request"
    )
    NO_GGUF_TEMPLATE = "the model file has no chat template of its own; use one of {builtins}"
    UNKNOWN_POLICY = "unknown context overflow policy {value}"
    N_KEEP_WITHOUT_TRUNCATION = "n_keep only applies with OVERFLOW_POLICY_TRUNCATE_LEFT"
    UNKNOWN_PRIORITY = "unknown priority {value}"
    UNKNOWN_SPECULATIVE_MODE = "unknown speculative mode {value}"
    SPECULATIVE_RANGE = "{name} must be between 1 and {limit}, got {value}"
    NGRAM_ORDER = (
        "ngram_min ({ngram_min}) must be at most ngram_max ({ngram_max}); unset ones take the "
        "server's ({default_min}, {default_max})"
    )
    RESUME_TOO_LONG = (
        "resume has {count} tokens but max_tokens allows {max_tokens}: an answer of this "
        "request never has more"
    )
    INTERVAL_TOO_SHORT = (
        "interval_ms must be at least {minimum} (or 0 for the default, {default}), got {value}"
    )


_SPECULATIVE_MODES = {
    pb.SPECULATIVE_MODE_UNSPECIFIED: None,
    pb.SPECULATIVE_MODE_AUTO: SpeculativeMode.AUTO,
    pb.SPECULATIVE_MODE_OFF: SpeculativeMode.OFF,
    pb.SPECULATIVE_MODE_ON: SpeculativeMode.ON,
}

_PRIORITIES = {
    pb.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    pb.PRIORITY_LOW: Priority.LOW,
    pb.PRIORITY_NORMAL: Priority.NORMAL,
    pb.PRIORITY_HIGH: Priority.HIGH,
}


def _invalid(field: str, message: Message, **values: Any) -> errors.InvalidRequest:
    return errors.InvalidRequest(message.format(**values), field=field)


@dataclass(frozen=True, slots=True)
class _Range:
    """A closed interval, optionally open at the low end."""

    low: float
    high: float = math.inf
    is_low_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.is_low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.is_low_open else '>='} {self.low:g}"
        return f"in {'(' if self.is_low_open else '['}{self.low:g}, {self.high:g}]"


SamplingField = Literal[
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalty_last_n",
]

SAMPLING_RANGES: dict[SamplingField, _Range] = {
    "temperature": _Range(0.0, 100.0),
    "top_k": _Range(0.0),
    "top_p": _Range(0.0, 1.0, is_low_open=True),
    "min_p": _Range(0.0, 1.0),
    "repeat_penalty": _Range(0.0, is_low_open=True),
    "frequency_penalty": _Range(-2.0, 2.0),
    "presence_penalty": _Range(-2.0, 2.0),
    "penalty_last_n": _Range(-1.0),  # at most n_ctx: see _sampling
}


@dataclass(frozen=True, slots=True)
class Draft:
    """A request whose fields are all checked, waiting for its prompt tokens (they fix the
    default max_tokens and the context check)."""

    sampling: SamplingParams
    stopping: StoppingParams  # max_tokens is filled in by complete_request
    output: OutputParams
    constraint: Constraint | None
    n_keep: int | None  # None = reject what does not fit; else truncate_left keeping n_keep
    max_tokens: int | None  # as asked for; None = the server default, clamped to fit
    session_id: str
    cache_scope: str
    cache_prompt: bool
    n_ctx: int
    default_max_tokens: int
    prompt_field: str  # "prompt" or "token_ids": where a context error points
    bos_token_id: int | None = None  # a leading BOS survives truncation
    prompt_tokens: tuple[int, ...] = ()  # set for token requests only
    messages: tuple[ChatMessage, ...] = ()  # a chat request: render these with chat_template
    chat_template: str = ""
    priority: Priority = Priority.NORMAL
    cache_response: bool = True
    speculative: SpeculativeParams = dataclasses.field(default_factory=SpeculativeParams)
    # params.lora as asked for: (name, scale or None for the adapter's default), resolved
    # against the model's adapters by the servicer (core.adapters.AdapterCatalog.resolve)
    lora: tuple[tuple[str, float | None], ...] = ()
    # params.resume.token_ids: the answer so far of a cut stream (GenerationRequest.resumed)
    resumed: tuple[int, ...] = ()


RESUME_FIELD = "params.resume.token_ids"

# -- public entry points ---------------------------------------------------------------------------


def check_model(model: str, info: ModelInfo) -> None:
    """An empty name means the loaded model; otherwise accept its name, path or file name."""
    if not model:
        return
    known = {info.model_name, info.model_path, os.path.basename(info.model_path)}
    if model not in known - {""}:
        raise errors.ModelNotFound(
            Message.MODEL_NOT_FOUND.format(model=model, loaded=info.model_name),
            field="model",
            metadata={"model": model, "loaded": info.model_name},
        )


def check_generates(info: ModelInfo) -> None:
    """Generation on an encoder-only model (BERT) is refused: FAILED_PRECONDITION naming it."""
    if info.is_encoder:
        raise embedding.refuse_generation(info.model_name, info.architecture)


def check_token_ids(token_ids: Iterable[int], n_vocab: int, field: str = "token_ids") -> None:
    """Every id must be inside the vocabulary; the error names the first bad index."""
    for index, token_id in enumerate(token_ids):
        if token_id >= n_vocab:
            raise _invalid(
                f"{field}[{index}]",
                Message.TOKEN_OUT_OF_RANGE,
                token_id=token_id,
                index=index,
                n_vocab=n_vocab,
            )


def watch_interval_s(interval_ms: int) -> float:
    """WatchLoad's time between reports in seconds: 0 is the default, too short is refused,
    too long is capped."""
    if interval_ms == 0:
        return DEFAULT_WATCH_INTERVAL_MS / 1000
    if interval_ms < MIN_WATCH_INTERVAL_MS:
        raise _invalid(
            "interval_ms",
            Message.INTERVAL_TOO_SHORT,
            minimum=MIN_WATCH_INTERVAL_MS,
            default=DEFAULT_WATCH_INTERVAL_MS,
            value=interval_ms,
        )
    return min(interval_ms, MAX_WATCH_INTERVAL_MS) / 1000


def add_special(message: TextRequest | pb.TokenizeRequest) -> bool:
    """The request's add_special, defaulting to True when unset."""
    return message.add_special if message.HasField("add_special") else True


def parse_text_request(
    message: TextRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    *,
    grammars: GrammarCompiler | None = None,
) -> Draft:
    """Check a Generate/StreamGenerate request before its prompt is tokenized. `grammars`
    (the engine) compiles a constraint once, here, so a bad one never reaches a slot."""
    check_model(message.model, info)
    check_generates(info)
    if message.messages:
        if message.prompt:
            raise _invalid("prompt", Message.PROMPT_AND_MESSAGES)
        messages = _messages(message.messages)
        draft = _draft(message, info, limits, grammars, prompt_field="messages")
        template = _chat_template(message.chat_template, info)
        return dataclasses.replace(draft, messages=messages, chat_template=template)
    if not message.prompt:
        raise _invalid("prompt", Message.EMPTY_PROMPT)
    if message.chat_template:
        raise _invalid("chat_template", Message.TEMPLATE_WITHOUT_MESSAGES)
    return _draft(message, info, limits, grammars, prompt_field="prompt")


def parse_tokens_request(
    message: pb.GenerateTokensRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    *,
    grammars: GrammarCompiler | None = None,
) -> Draft:
    """Check a GenerateTokens request; its prompt tokens travel in the draft."""
    check_model(message.model, info)
    check_generates(info)
    if not message.token_ids:
        raise _invalid("token_ids", Message.EMPTY_TOKEN_IDS)
    check_token_ids(message.token_ids, info.n_vocab)
    draft = _draft(message, info, limits, grammars, prompt_field="token_ids")
    return dataclasses.replace(draft, prompt_tokens=tuple(message.token_ids))


def chat_prompt_tokens(tokens: Sequence[int], info: ModelInfo) -> list[int]:
    """A rendered chat prompt's tokens (tokenized without adding specials, since the template
    writes them): add BOS only when the model wants one and the template did not write it."""
    bos = info.bos_token_id
    if info.add_bos and bos is not None and (not tokens or tokens[0] != bos):
        return [bos, *tokens]
    return list(tokens)


def complete_request(
    draft: Draft,
    prompt_tokens: Iterable[int],
    *,
    request_id: str,
    deadline: float | None,
    tenant: str = "",
    adapters: AdapterSet = (),
) -> GenerationRequest:
    """Apply the context checks and the default max_tokens; the result is ready to submit.
    The tenant's name prefixes its cache scope: tenants never share cached prefixes; nor do
    adapter sets (core.adapters.scoped)."""
    tokens, num_truncated = _truncate_left(draft, tuple(prompt_tokens))
    max_tokens = _fit_max_tokens(draft, len(tokens))
    if len(draft.resumed) > max_tokens:
        raise _invalid(
            RESUME_FIELD, Message.RESUME_TOO_LONG, count=len(draft.resumed), max_tokens=max_tokens
        )
    stopping = dataclasses.replace(
        draft.stopping, max_tokens=max_tokens, max_tokens_is_default=draft.max_tokens is None
    )
    return GenerationRequest(
        request_id=request_id,
        prompt_tokens=tokens,
        sampling=draft.sampling,
        stopping=stopping,
        output=draft.output,
        constraint=draft.constraint,
        num_truncated=num_truncated,
        session_id=draft.session_id,
        cache_scope=scoped(scoped_cache_scope(tenant, draft.cache_scope), adapters),
        cache_prompt=draft.cache_prompt,
        deadline=deadline,
        adapters=adapters,
        tenant=tenant,
        priority=draft.priority,
        cache_response=draft.cache_response,
        speculative=draft.speculative,
        resumed=draft.resumed,
    )


def deadline_from(time_remaining_s: float | None, now: float) -> float | None:
    """A gRPC time_remaining() (seconds or None) as an absolute time.monotonic() deadline."""
    return None if time_remaining_s is None else now + max(0.0, time_remaining_s)


# -- fields ----------------------------------------------------------------------------------------


def _draft(
    message: TextRequest | pb.GenerateTokensRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    grammars: GrammarCompiler | None,
    *,
    prompt_field: str,
) -> Draft:
    params = message.params
    _check_id_length("session_id", message.session_id)
    _check_id_length("cache_scope", message.cache_scope)
    _check_printable("cache_scope", message.cache_scope)
    max_tokens = _max_tokens(params.stopping, info.n_ctx)
    return Draft(
        sampling=_sampling(params.sampling, limits.default_sampling, info),
        stopping=_stopping(params.stopping, info.n_vocab, limits),
        output=_output(params.output),
        constraint=_constraint(params, grammars),
        n_keep=_n_keep(params.context_overflow),
        priority=_priority(params.priority),
        bos_token_id=info.bos_token_id,
        max_tokens=max_tokens,
        session_id=message.session_id,
        cache_scope=message.cache_scope,
        cache_prompt=params.cache_prompt
        if params.HasField("cache_prompt")
        else limits.cache_prompt,
        n_ctx=info.n_ctx,
        default_max_tokens=limits.default_max_tokens,
        prompt_field=prompt_field,
        cache_response=params.cache_response if params.HasField("cache_response") else True,
        speculative=_speculative(params.speculative, limits),
        lora=_lora(params.lora),
        resumed=_resumed(params, info.n_vocab),
    )


def _resumed(params: pb.GenerationParams, n_vocab: int) -> tuple[int, ...]:
    """params.resume's tokens, each in the vocabulary (their count is checked against
    max_tokens once it is known: complete_request)."""
    if not params.HasField("resume"):
        return ()
    check_token_ids(params.resume.token_ids, n_vocab, field=RESUME_FIELD)
    return tuple(params.resume.token_ids)


MAX_NAME_CHARS = 64
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def json_object(field: str, text: str, what: str) -> dict[str, Any]:
    """JSON text that must be an object (tool parameters, call arguments)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise errors.InvalidRequest(
            f"{what} must be JSON text of an object: {exc}"[:300], field=field
        ) from None
    if not isinstance(value, dict):
        raise errors.InvalidRequest(
            f"{what} must be a JSON object, got {type(value).__name__}", field=field
        )
    return value


def function_name(field: str, name: str) -> str:
    if not name:
        raise errors.InvalidRequest("a function name must not be empty", field=field)
    if len(name) > MAX_NAME_CHARS or not _FUNCTION_NAME.fullmatch(name):
        raise errors.InvalidRequest(
            f"function name {name[:80]!r} must be 1 to {MAX_NAME_CHARS} letters, digits, "
            "'_', '-' or '.'",
            field=field,
        )
    return name


def _messages(messages: Sequence[pb.ChatMessage]) -> tuple[ChatMessage, ...]:
    """Chat messages, checked: known roles, calls only on assistant turns, each call's
    arguments a JSON object."""
    out: list[ChatMessage] = []
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if message.role not in ROLES:
            raise _invalid(
                f"{field}.role",
                Message.UNKNOWN_ROLE,
                roles=", ".join(sorted(ROLES)),
                role=message.role,
            )
        if message.tool_calls and message.role != "assistant":
            raise _invalid(f"{field}.tool_calls", Message.CALLS_NOT_ASSISTANT)
        calls: list[ToolCall] = []
        for number, call in enumerate(message.tool_calls):
            call_field = f"{field}.tool_calls[{number}]"
            function_name(f"{call_field}.name", call.name)
            if call.arguments.strip():
                json_object(f"{call_field}.arguments", call.arguments, "arguments")
            calls.append(ToolCall(call.id, call.name, call.arguments))
        if message.role != "tool" and message.tool_call_id:  # (OpenAI's `name` is any role's)
            raise _invalid(f"{field}.tool_call_id", Message.TOOL_FIELD_ONLY, name="tool_call_id")
        out.append(
            ChatMessage(
                message.role,
                message.content,
                tuple(calls),
                tool_call_id=message.tool_call_id,
                name=message.name,
                reasoning_content=message.reasoning_content,
            )
        )
    return tuple(out)


def _chat_template(requested: str, info: ModelInfo) -> str:
    """The template a chat request gets: its own choice, else the server's; FAILED_PRECONDITION
    when there is none."""
    builtins = ", ".join(BUILTIN_TEMPLATES)
    if requested and requested not in (*BUILTIN_TEMPLATES, GGUF_TEMPLATE):
        known = f"{builtins}, {GGUF_TEMPLATE} (the model's own)"
        raise _invalid("chat_template", Message.UNKNOWN_TEMPLATE, name=requested, known=known)
    name = requested or info.chat_template
    if not name:
        raise errors.FailedPrecondition(
            Message.NO_TEMPLATE.format(builtins=" | ".join(BUILTIN_TEMPLATES)), field="messages"
        )
    if name == GGUF_TEMPLATE and not info.has_chat_template:
        raise errors.FailedPrecondition(
            Message.NO_GGUF_TEMPLATE.format(builtins=builtins), field="chat_template"
        )
    return name


def _check_printable(name: str, value: str) -> None:
    """No control characters (the server's own cache-scope parts are set off by one)."""
    for char in value:
        if not char.isprintable() and char != " ":
            raise _invalid(name, Message.CONTROL_CHARACTER, name=name, code=ord(char))


def _lora(entries: Sequence[pb.LoraAdapter]) -> tuple[tuple[str, float | None], ...]:
    """params.lora's names and scales, each checked on its own (the servicer resolves them
    against the model's adapters)."""
    if len(entries) > MAX_ADAPTERS:
        raise _invalid(
            "params.lora", Message.TOO_MANY_ADAPTERS, count=len(entries), limit=MAX_ADAPTERS
        )
    out: list[tuple[str, float | None]] = []
    for i, entry in enumerate(entries):
        where = f"params.lora[{i}]"
        name = adapters.check_name(entry.name, f"{where}.name")
        scale = (
            adapters.check_scale(entry.scale, f"{where}.scale") if entry.HasField("scale") else None
        )
        out.append((name, scale))
    return tuple(out)


def _check_id_length(name: str, value: str) -> None:
    if len(value) > MAX_ID_LENGTH:
        raise _invalid(name, Message.ID_TOO_LONG, name=name, length=len(value), limit=MAX_ID_LENGTH)


def _sampling(
    message: pb.SamplingParams, defaults: SamplingParams, info: ModelInfo
) -> SamplingParams:
    """Server defaults, overridden field by field by what the request sets. penalty_last_n is
    at most the context, and -1 (the whole context) becomes n_ctx: llama.cpp reads -1 as 0 (no
    penalty) and allocates a history of penalty_last_n tokens (2**31 - 1 stalled the engine)."""
    ranges = {**SAMPLING_RANGES, "penalty_last_n": _Range(-1.0, info.n_ctx)}
    overrides: dict[str, Any] = {}
    for name, bounds in ranges.items():
        if message.HasField(name):
            overrides[name] = checked_number(name, getattr(message, name), bounds)
    if overrides.get("penalty_last_n") == -1:
        overrides["penalty_last_n"] = info.n_ctx
    if message.HasField("seed"):
        overrides["seed"] = message.seed
    if message.logit_bias:
        overrides["logit_bias"] = logit_bias(message.logit_bias, info.n_vocab)
    return dataclasses.replace(defaults, **overrides)


def logit_bias(
    biases: Mapping[int, float], n_vocab: int, field: str = "params.sampling.logit_bias"
) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs; every id in the vocabulary, every bias finite or -inf."""
    if len(biases) > MAX_LOGIT_BIAS:
        raise _invalid(field, Message.TOO_MANY_BIASES, count=len(biases), limit=MAX_LOGIT_BIAS)
    out: list[tuple[int, float]] = []
    for token_id, bias in sorted(biases.items()):
        if not 0 <= token_id < n_vocab:
            raise _invalid(
                f"{field}[{token_id}]",
                Message.BIAS_TOKEN_OUT_OF_RANGE,
                token_id=token_id,
                n_vocab=n_vocab,
            )
        if math.isnan(bias) or bias == math.inf:
            raise _invalid(
                f"{field}[{token_id}]", Message.BIAS_NOT_ALLOWED, token_id=token_id, value=bias
            )
        out.append((token_id, bias if bias == -math.inf else _shortest_float32(bias)))
    return tuple(out)


def _constraint(params: pb.GenerationParams, grammars: GrammarCompiler | None) -> Constraint | None:
    """The request's grammar (a JSON schema converted to one), compiled once by the engine."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "grammar":
        text, root, field = (
            params.grammar.gbnf,
            params.grammar.root or "root",
            "params.grammar.gbnf",
        )
    else:
        text, root, field = params.json_schema, "root", "params.json_schema"
    convert = None if kind == "grammar" or grammars is None else grammars.json_schema_to_grammar
    try:
        return compiled_constraint(field, text, grammars, convert=convert, root=root)
    except errors.InvalidRequest as exc:
        is_root = f"'{root}' symbol" in exc.message
        if kind == "grammar" and params.grammar.root and is_root:
            raise errors.InvalidRequest(exc.message, field="params.grammar.root") from None
        raise


def compiled_constraint(
    field: str,
    text: str,
    grammars: GrammarCompiler | None,
    *,
    convert: Callable[[str], str] | None = None,
    root: str = "root",
) -> Constraint:
    """The constraint `text` (at `field`) as a checked GBNF grammar: `convert` turns it into
    GBNF first (a JSON schema, a regex); its ValueError, like the grammar check's, becomes
    INVALID_ARGUMENT naming the field."""
    check_constraint_text(field, text)
    if grammars is None:
        raise errors.FailedPrecondition(Message.NO_CONSTRAINTS.format(name=field), field=field)
    try:
        gbnf = text if convert is None else convert(text)
        grammars.check_grammar(gbnf, root)
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc), field=field) from None
    return Constraint(gbnf, root, field)


def structural_tag_constraint(
    field: str, text: str, grammars: GrammarCompiler | None
) -> Constraint:
    """The structural tag as a checked grammar, lazy when it starts at a trigger; anything it
    cannot be is INVALID_ARGUMENT naming the field, the part (`format.tags[0].content`) in the
    message."""
    compiled = None

    def convert(tag: str) -> str:
        nonlocal compiled
        if grammars is None:  # compiled_constraint refuses first; never reached
            raise ValueError("no grammar compiler")
        compiled = structural_tag_to_gbnf(tag, grammars.json_schema_to_grammar)
        return compiled.gbnf

    constraint = compiled_constraint(field, text, grammars, convert=convert)
    if compiled is None or not compiled.triggers:
        return constraint
    return dataclasses.replace(constraint, triggers=compiled.triggers, starts=compiled.starts)


def check_constraint_text(field: str, text: str) -> None:
    """Not blank, not longer than MAX_CONSTRAINT_CHARS."""
    name = field.removeprefix("params.")
    if not text.strip():
        raise _invalid(field, Message.EMPTY_CONSTRAINT, name=name)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise _invalid(
            field,
            Message.CONSTRAINT_TOO_LONG,
            name=name,
            length=len(text),
            limit=MAX_CONSTRAINT_CHARS,
        )


def _output(message: pb.OutputOptions) -> OutputParams:
    if message.top_logprobs > MAX_TOP_LOGPROBS:
        raise _invalid(
            "params.output.top_logprobs",
            Message.TOP_LOGPROBS_TOO_MANY,
            limit=MAX_TOP_LOGPROBS,
            value=message.top_logprobs,
        )
    return OutputParams(logprobs=message.logprobs, top_logprobs=message.top_logprobs)


def checked_number(name: str, value: float, bounds: _Range, field: str = "") -> float:
    """The value, unless it is not finite or outside its bounds; `field` defaults to v1's."""
    field = field or f"params.sampling.{name}"
    if not math.isfinite(value):
        raise _invalid(field, Message.NOT_FINITE, name=name, value=value)
    if not bounds.contains(value):
        raise _invalid(
            field, Message.OUT_OF_RANGE, name=name, bounds=bounds.describe(), value=value
        )
    return value if isinstance(value, int) else _shortest_float32(value)


def _shortest_float32(value: float) -> float:
    """The shortest decimal with the same float32 bits: 0.7, not 0.699999988079071 (proto floats
    are float32; llama.cpp reads float32 too, so nothing changes but logs and comparisons)."""
    bits = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == bits:
            return candidate
    return value


def _max_tokens(message: pb.StoppingCriteria, n_ctx: int) -> int | None:
    if not message.HasField("max_tokens"):
        return None
    field = "params.stopping.max_tokens"
    if message.max_tokens == 0:
        raise _invalid(field, Message.MAX_TOKENS_ZERO)
    context_fit.check_max_tokens(message.max_tokens, n_ctx)
    return message.max_tokens


def _stopping(
    message: pb.StoppingCriteria, n_vocab: int, limits: SchedulerSettings
) -> StoppingParams:
    check_stops(list(message.stop), limits)
    check_token_ids(message.stop_token_ids, n_vocab, field="params.stopping.stop_token_ids")
    time_limit_ms: int | None = None
    if message.HasField("time_limit_ms"):
        if message.time_limit_ms == 0:
            raise _invalid("params.stopping.time_limit_ms", Message.TIME_LIMIT_ZERO)
        time_limit_ms = message.time_limit_ms
    return StoppingParams(
        stop=tuple(message.stop),
        stop_token_ids=frozenset(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        time_limit_ms=time_limit_ms,
    )


def check_stops(
    stops: list[str], limits: SchedulerSettings, field: str = "params.stopping.stop"
) -> None:
    if len(stops) > limits.max_stop_strings:
        raise _invalid(
            field, Message.TOO_MANY_STOPS, count=len(stops), limit=limits.max_stop_strings
        )
    for index, stop in enumerate(stops):
        if not stop:
            raise _invalid(f"{field}[{index}]", Message.EMPTY_STOP)
        if len(stop) > limits.max_stop_length:
            raise _invalid(
                f"{field}[{index}]",
                Message.STOP_TOO_LONG,
                length=len(stop),
                limit=limits.max_stop_length,
            )


def _n_keep(message: pb.ContextOverflow) -> int | None:
    """None for the reject policy; the number of leading tokens to keep for truncate_left."""
    if message.policy == pb.OVERFLOW_POLICY_TRUNCATE_LEFT:
        return message.n_keep
    if message.policy not in (pb.OVERFLOW_POLICY_UNSPECIFIED, pb.OVERFLOW_POLICY_REJECT):
        raise _invalid(
            "params.context_overflow.policy", Message.UNKNOWN_POLICY, value=message.policy
        )
    if message.n_keep:
        raise _invalid("params.context_overflow.n_keep", Message.N_KEEP_WITHOUT_TRUNCATION)
    return None


def _speculative(message: pb.SpeculativeParams, limits: SchedulerSettings) -> SpeculativeParams:
    """The request's speculation settings; what it leaves unset is the server's (and must
    still make a valid whole with what it sets)."""
    field = "params.speculative"
    if message.mode not in _SPECULATIVE_MODES:
        raise _invalid(f"{field}.mode", Message.UNKNOWN_SPECULATIVE_MODE, value=message.mode)
    draft_max = _speculative_number(message, "draft_max", MAX_DRAFT_TOKENS)
    ngram_min = _speculative_number(message, "ngram_min", MAX_NGRAM)
    ngram_max = _speculative_number(message, "ngram_max", MAX_NGRAM)
    low = limits.ngram_min if ngram_min is None else ngram_min
    high = limits.ngram_max if ngram_max is None else ngram_max
    if low > high:
        name = "ngram_min" if ngram_min is not None else "ngram_max"
        raise _invalid(
            f"{field}.{name}",
            Message.NGRAM_ORDER,
            ngram_min=low,
            ngram_max=high,
            default_min=limits.ngram_min,
            default_max=limits.ngram_max,
        )
    return SpeculativeParams(_SPECULATIVE_MODES[message.mode], draft_max, ngram_min, ngram_max)


def _speculative_number(message: pb.SpeculativeParams, name: str, limit: int) -> int | None:
    if not message.HasField(name):  # type: ignore[arg-type]  # a field name from our own code
        return None
    value: int = getattr(message, name)
    if not 1 <= value <= limit:
        raise _invalid(
            f"params.speculative.{name}",
            Message.SPECULATIVE_RANGE,
            name=name,
            limit=limit,
            value=value,
        )
    return value


def _priority(value: pb.Priority.ValueType) -> Priority:
    found = _PRIORITIES.get(value)
    if found is None:
        raise _invalid("params.priority", Message.UNKNOWN_PRIORITY, value=value)
    return found


def _truncate_left(draft: Draft, tokens: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """With truncate_left, cut the prompt to fit with max_tokens (or the default)."""
    if draft.n_keep is None:
        return tokens, 0
    max_tokens = draft.default_max_tokens if draft.max_tokens is None else draft.max_tokens
    return context_fit.truncate_left(
        tokens,
        n_keep=draft.n_keep,
        max_tokens=max_tokens,
        n_ctx=draft.n_ctx,
        bos_token_id=draft.bos_token_id,
    )


def _fit_max_tokens(draft: Draft, num_prompt: int) -> int:
    return context_fit.fit_max_tokens(
        num_prompt,
        draft.max_tokens,
        default_max_tokens=draft.default_max_tokens,
        n_ctx=draft.n_ctx,
        prompt_field=draft.prompt_field,
    )
