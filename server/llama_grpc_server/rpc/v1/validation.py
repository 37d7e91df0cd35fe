"""v1 proto requests -> checked requests (rpc.shared.checks.CheckedRequest), or a ServiceError
naming the offending field.

Pure: no grpc context, no engine calls (the servicer tokenizes text prompts between the two steps:
parse_* checks every field, checks.complete_request applies the prompt length). Error texts live
in RequestErrorText.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core import adapters
from llama_grpc_server.core.api import GrammarCompiler, ModelInfo
from llama_grpc_server.core.requests import context_fit
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
    OutputParams,
    Priority,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.tools.types import ToolCall
from llama_grpc_server.rpc.shared import checks

MAX_ID_LENGTH = 256  # session_id, cache_scope
MAX_ADAPTERS = 8  # LoRA adapters one request may apply
# WatchLoad's interval_ms: 0 means the default; below the minimum is refused; above the maximum
# is taken as the maximum.
DEFAULT_WATCH_INTERVAL_MS = 1000
MIN_WATCH_INTERVAL_MS = 100
MAX_WATCH_INTERVAL_MS = 60_000

TextRequest = pb.GenerateRequest | pb.StreamGenerateRequest


class RequestErrorText(enum.StrEnum):
    """The error texts of v1's own request fields, written once; format() fills the numbers.
    The fields both protocols share have theirs in rpc.shared.checks.ParamErrorText; the
    context-fit texts live with their rule in core.requests.context_fit."""

    EMPTY_PROMPT = "prompt must not be empty"
    EMPTY_TOKEN_IDS = "token_ids must not be empty"
    MODEL_NOT_FOUND = "model {model!r} is not loaded here; this server serves {loaded!r}"
    MAX_TOKENS_ZERO = "max_tokens must be at least 1 (leave it unset for the server default)"
    TIME_LIMIT_ZERO = "time_limit_ms must be at least 1 (leave it unset for no limit)"
    ID_TOO_LONG = "{name} is {length} characters long; at most {limit} are allowed"
    CONTROL_CHARACTER = "{name} must not contain control characters (found U+{code:04X})"
    TOO_MANY_ADAPTERS = "lora names {count} adapters; at most {limit} are allowed"
    TOP_LOGPROBS_TOO_MANY = "top_logprobs must be at most {limit}, got {value}"
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


def _invalid(field: str, message: RequestErrorText, **values: Any) -> errors.InvalidRequest:
    return errors.InvalidRequest(message.format(**values), field=field)


# -- public entry points ---------------------------------------------------------------------------


def check_model(model: str, info: ModelInfo) -> None:
    """An empty name means the loaded model; otherwise accept its name, path or file name."""
    if not model:
        return
    known = {info.model_name, info.model_path, os.path.basename(info.model_path)}
    if model not in known - {""}:
        raise errors.ModelNotFound(
            RequestErrorText.MODEL_NOT_FOUND.format(model=model, loaded=info.model_name),
            field="model",
            metadata={"model": model, "loaded": info.model_name},
        )


def watch_interval_s(interval_ms: int) -> float:
    """WatchLoad's time between reports in seconds: 0 is the default, too short is refused,
    too long is capped."""
    if interval_ms == 0:
        return DEFAULT_WATCH_INTERVAL_MS / 1000
    if interval_ms < MIN_WATCH_INTERVAL_MS:
        raise _invalid(
            "interval_ms",
            RequestErrorText.INTERVAL_TOO_SHORT,
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
) -> checks.CheckedRequest:
    """Check a Generate/StreamGenerate request before its prompt is tokenized. `grammars`
    (the engine) compiles a constraint once, here, so a bad one never reaches a slot."""
    check_model(message.model, info)
    checks.check_generates(info)
    if message.messages:
        if message.prompt:
            raise _invalid("prompt", RequestErrorText.PROMPT_AND_MESSAGES)
        messages = _messages(message.messages)
        checked = _checked(message, info, limits, grammars, prompt_field="messages")
        template = _chat_template(message.chat_template, info)
        return dataclasses.replace(checked, messages=messages, chat_template=template)
    if not message.prompt:
        raise _invalid("prompt", RequestErrorText.EMPTY_PROMPT)
    if message.chat_template:
        raise _invalid("chat_template", RequestErrorText.TEMPLATE_WITHOUT_MESSAGES)
    return _checked(message, info, limits, grammars, prompt_field="prompt")


def parse_tokens_request(
    message: pb.GenerateTokensRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    *,
    grammars: GrammarCompiler | None = None,
) -> checks.CheckedRequest:
    """Check a GenerateTokens request; its prompt tokens travel in the checked."""
    check_model(message.model, info)
    checks.check_generates(info)
    if not message.token_ids:
        raise _invalid("token_ids", RequestErrorText.EMPTY_TOKEN_IDS)
    checks.check_token_ids(message.token_ids, info.n_vocab)
    checked = _checked(message, info, limits, grammars, prompt_field="token_ids")
    return dataclasses.replace(checked, prompt_tokens=tuple(message.token_ids))


def chat_prompt_tokens(tokens: Sequence[int], info: ModelInfo) -> list[int]:
    """A rendered chat prompt's tokens (tokenized without adding specials, since the template
    writes them): add BOS only when the model wants one and the template did not write it."""
    bos = info.bos_token_id
    if info.add_bos and bos is not None and (not tokens or tokens[0] != bos):
        return [bos, *tokens]
    return list(tokens)


# -- fields ----------------------------------------------------------------------------------------


def _checked(
    message: TextRequest | pb.GenerateTokensRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    grammars: GrammarCompiler | None,
    *,
    prompt_field: str,
) -> checks.CheckedRequest:
    params = message.params
    _check_id_length("session_id", message.session_id)
    _check_id_length("cache_scope", message.cache_scope)
    _check_printable("cache_scope", message.cache_scope)
    max_tokens = _max_tokens(params.stopping, info.n_ctx)
    return checks.CheckedRequest(
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
    max_tokens once it is known: checks.complete_request)."""
    if not params.HasField("resume"):
        return ()
    checks.check_token_ids(params.resume.token_ids, n_vocab, field=checks.RESUME_FIELD)
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
                RequestErrorText.UNKNOWN_ROLE,
                roles=", ".join(sorted(ROLES)),
                role=message.role,
            )
        if message.tool_calls and message.role != "assistant":
            raise _invalid(f"{field}.tool_calls", RequestErrorText.CALLS_NOT_ASSISTANT)
        calls: list[ToolCall] = []
        for number, call in enumerate(message.tool_calls):
            call_field = f"{field}.tool_calls[{number}]"
            function_name(f"{call_field}.name", call.name)
            if call.arguments.strip():
                json_object(f"{call_field}.arguments", call.arguments, "arguments")
            calls.append(ToolCall(call.id, call.name, call.arguments))
        if message.role != "tool" and message.tool_call_id:  # (OpenAI's `name` is any role's)
            raise _invalid(
                f"{field}.tool_call_id", RequestErrorText.TOOL_FIELD_ONLY, name="tool_call_id"
            )
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
        raise _invalid(
            "chat_template", RequestErrorText.UNKNOWN_TEMPLATE, name=requested, known=known
        )
    name = requested or info.chat_template
    if not name:
        raise errors.FailedPrecondition(
            RequestErrorText.NO_TEMPLATE.format(builtins=" | ".join(BUILTIN_TEMPLATES)),
            field="messages",
        )
    if name == GGUF_TEMPLATE and not info.has_chat_template:
        raise errors.FailedPrecondition(
            RequestErrorText.NO_GGUF_TEMPLATE.format(builtins=builtins), field="chat_template"
        )
    return name


def _check_printable(name: str, value: str) -> None:
    """No control characters (the server's own cache-scope parts are set off by one)."""
    for char in value:
        if not char.isprintable() and char != " ":
            raise _invalid(name, RequestErrorText.CONTROL_CHARACTER, name=name, code=ord(char))


def _lora(entries: Sequence[pb.LoraAdapter]) -> tuple[tuple[str, float | None], ...]:
    """params.lora's names and scales, each checked on its own (the servicer resolves them
    against the model's adapters)."""
    if len(entries) > MAX_ADAPTERS:
        raise _invalid(
            "params.lora",
            RequestErrorText.TOO_MANY_ADAPTERS,
            count=len(entries),
            limit=MAX_ADAPTERS,
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
        raise _invalid(
            name, RequestErrorText.ID_TOO_LONG, name=name, length=len(value), limit=MAX_ID_LENGTH
        )


def _sampling(
    message: pb.SamplingParams, defaults: SamplingParams, info: ModelInfo
) -> SamplingParams:
    """Server defaults, overridden field by field by what the request sets. penalty_last_n is
    at most the context, and -1 (the whole context) becomes n_ctx: llama.cpp reads -1 as 0 (no
    penalty) and allocates a history of penalty_last_n tokens (2**31 - 1 stalled the engine)."""
    ranges = {**checks.SAMPLING_RANGES, "penalty_last_n": checks.Range(-1.0, info.n_ctx)}
    overrides: dict[str, Any] = {}
    for name, bounds in ranges.items():
        if message.HasField(name):
            overrides[name] = checks.checked_number(name, getattr(message, name), bounds)
    if overrides.get("penalty_last_n") == -1:
        overrides["penalty_last_n"] = info.n_ctx
    if message.HasField("seed"):
        overrides["seed"] = message.seed
    if message.logit_bias:
        overrides["logit_bias"] = checks.logit_bias(message.logit_bias, info.n_vocab)
    return dataclasses.replace(defaults, **overrides)


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
        return checks.compiled_constraint(field, text, grammars, convert=convert, root=root)
    except errors.InvalidRequest as exc:
        is_root = f"'{root}' symbol" in exc.message
        if kind == "grammar" and params.grammar.root and is_root:
            raise errors.InvalidRequest(exc.message, field="params.grammar.root") from None
        raise


def _output(message: pb.OutputOptions) -> OutputParams:
    if message.top_logprobs > checks.MAX_TOP_LOGPROBS:
        raise _invalid(
            "params.output.top_logprobs",
            RequestErrorText.TOP_LOGPROBS_TOO_MANY,
            limit=checks.MAX_TOP_LOGPROBS,
            value=message.top_logprobs,
        )
    return OutputParams(logprobs=message.logprobs, top_logprobs=message.top_logprobs)


def _max_tokens(message: pb.StoppingCriteria, n_ctx: int) -> int | None:
    if not message.HasField("max_tokens"):
        return None
    field = "params.stopping.max_tokens"
    if message.max_tokens == 0:
        raise _invalid(field, RequestErrorText.MAX_TOKENS_ZERO)
    context_fit.check_max_tokens(message.max_tokens, n_ctx)
    return message.max_tokens


def _stopping(
    message: pb.StoppingCriteria, n_vocab: int, limits: SchedulerSettings
) -> StoppingParams:
    checks.check_stops(list(message.stop), limits)
    checks.check_token_ids(message.stop_token_ids, n_vocab, field="params.stopping.stop_token_ids")
    time_limit_ms: int | None = None
    if message.HasField("time_limit_ms"):
        if message.time_limit_ms == 0:
            raise _invalid("params.stopping.time_limit_ms", RequestErrorText.TIME_LIMIT_ZERO)
        time_limit_ms = message.time_limit_ms
    return StoppingParams(
        stop=tuple(message.stop),
        stop_token_ids=frozenset(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        time_limit_ms=time_limit_ms,
    )


def _n_keep(message: pb.ContextOverflow) -> int | None:
    """None for the reject policy; the number of leading tokens to keep for truncate_left."""
    if message.policy == pb.OVERFLOW_POLICY_TRUNCATE_LEFT:
        return message.n_keep
    if message.policy not in (pb.OVERFLOW_POLICY_UNSPECIFIED, pb.OVERFLOW_POLICY_REJECT):
        raise _invalid(
            "params.context_overflow.policy", RequestErrorText.UNKNOWN_POLICY, value=message.policy
        )
    if message.n_keep:
        raise _invalid("params.context_overflow.n_keep", RequestErrorText.N_KEEP_WITHOUT_TRUNCATION)
    return None


def _speculative(message: pb.SpeculativeParams, limits: SchedulerSettings) -> SpeculativeParams:
    """The request's speculation settings; what it leaves unset is the server's (and must
    still make a valid whole with what it sets)."""
    field = "params.speculative"
    if message.mode not in _SPECULATIVE_MODES:
        raise _invalid(
            f"{field}.mode", RequestErrorText.UNKNOWN_SPECULATIVE_MODE, value=message.mode
        )
    draft_max = _speculative_number(message, "draft_max", MAX_DRAFT_TOKENS)
    ngram_min = _speculative_number(message, "ngram_min", MAX_NGRAM)
    ngram_max = _speculative_number(message, "ngram_max", MAX_NGRAM)
    low = limits.ngram_min if ngram_min is None else ngram_min
    high = limits.ngram_max if ngram_max is None else ngram_max
    if low > high:
        name = "ngram_min" if ngram_min is not None else "ngram_max"
        raise _invalid(
            f"{field}.{name}",
            RequestErrorText.NGRAM_ORDER,
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
            RequestErrorText.SPECULATIVE_RANGE,
            name=name,
            limit=limit,
            value=value,
        )
    return value


def _priority(value: pb.Priority.ValueType) -> Priority:
    found = _PRIORITIES.get(value)
    if found is None:
        raise _invalid("params.priority", RequestErrorText.UNKNOWN_PRIORITY, value=value)
    return found
