"""Checked parameters, whichever protocol asked: the `CheckedRequest` both protocols' requests
become before their prompt is tokenized, the checks of the fields they share (sampling numbers
and their ranges, logit bias, stop strings, token ids, constraints), and complete_request, which
applies the context rules once the prompt's tokens are known. Pure: no grpc context, no engine
calls, no generated messages (field names are the callers' to give; v1's are the defaults)."""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from llama_grpc_server import errors
from llama_grpc_server.auth import scoped_cache_scope
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core.adapters import AdapterSet, scoped
from llama_grpc_server.core.api import GrammarCompiler, ModelInfo
from llama_grpc_server.core.constrained.structural_tag import structural_tag_to_gbnf
from llama_grpc_server.core.requests import context_fit, embedding
from llama_grpc_server.core.requests.chat import ChatMessage
from llama_grpc_server.core.requests.request import (
    Constraint,
    GenerationRequest,
    OutputParams,
    Priority,
    SamplingParams,
    SpeculativeParams,
    StoppingParams,
)

MAX_LOGIT_BIAS = 1024  # entries of params.sampling.logit_bias
MAX_TOP_LOGPROBS = 20
MAX_CONSTRAINT_CHARS = 100_000  # grammar text or JSON schema
RESUME_FIELD = "params.resume.token_ids"


class ParamErrorText(enum.StrEnum):
    """The error texts of the shared checks, written once; format() fills the numbers. Each
    protocol's own fields have theirs (rpc.v1.validation.RequestErrorText); the context-fit
    texts live with their rule in core.requests.context_fit."""

    TOKEN_OUT_OF_RANGE = (
        "token id {token_id} at index {index} is out of range: the vocabulary has {n_vocab} tokens"
    )
    NOT_FINITE = "{name} must be a finite number, got {value:g}"
    OUT_OF_RANGE = "{name} must be {bounds}, got {value:g}"
    TOO_MANY_STOPS = "stop has {count} strings; at most {limit} are allowed"
    EMPTY_STOP = "stop strings must not be empty"
    STOP_TOO_LONG = "stop string is {length} characters long; at most {limit} are allowed"
    BIAS_TOKEN_OUT_OF_RANGE = (
        "token id {token_id} is out of range: the vocabulary has {n_vocab} tokens"
    )
    TOO_MANY_BIASES = "logit_bias has {count} entries; at most {limit} are allowed"
    BIAS_NOT_ALLOWED = "the bias of token {token_id} must be a finite number or -inf, got {value}"
    EMPTY_CONSTRAINT = "{name} must not be empty"
    CONSTRAINT_TOO_LONG = "{name} is {length} characters long; at most {limit} are allowed"
    NO_CONSTRAINTS = "this server cannot check grammars, so {name} is not supported"
    RESUME_TOO_LONG = (
        "resume has {count} tokens but max_tokens allows {max_tokens}: an answer of this "
        "request never has more"
    )
    NOT_AN_EMBEDDING_MODEL = (
        "model {model!r} has pooling {pooling!r} (a reranker's scores), not embeddings"
    )


def _invalid(field: str, message: ParamErrorText, **values: Any) -> errors.InvalidRequest:
    return errors.InvalidRequest(message.format(**values), field=field)


@dataclass(frozen=True, slots=True)
class Range:
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

SAMPLING_RANGES: dict[SamplingField, Range] = {
    "temperature": Range(0.0, 100.0),
    "top_k": Range(0.0),
    "top_p": Range(0.0, 1.0, is_low_open=True),
    "min_p": Range(0.0, 1.0),
    "repeat_penalty": Range(0.0, is_low_open=True),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "penalty_last_n": Range(-1.0),  # at most n_ctx: see rpc.v1.validation._sampling
}


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request whose fields are all checked, whichever protocol it came in, waiting for its
    prompt tokens (they fix the default max_tokens and the context check): complete_request
    makes it a GenerationRequest."""

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


def check_generates(info: ModelInfo) -> None:
    """Generation on an encoder-only model (BERT) is refused: FAILED_PRECONDITION naming it."""
    if info.is_encoder:
        raise embedding.refuse_generation(info.model_name, info.architecture)


def check_embeds(info: ModelInfo) -> None:
    """Embedding on a model whose pooling gives a reranker's scores is refused:
    FAILED_PRECONDITION naming the model."""
    if not embedding.can_embed(info.pooling):
        raise errors.FailedPrecondition(
            ParamErrorText.NOT_AN_EMBEDDING_MODEL.format(
                model=info.model_name, pooling=info.pooling
            ),
            field="model",
        )


def check_token_ids(token_ids: Iterable[int], n_vocab: int, field: str = "token_ids") -> None:
    """Every id must be inside the vocabulary; the error names the first bad index."""
    for index, token_id in enumerate(token_ids):
        if token_id >= n_vocab:
            raise _invalid(
                f"{field}[{index}]",
                ParamErrorText.TOKEN_OUT_OF_RANGE,
                token_id=token_id,
                index=index,
                n_vocab=n_vocab,
            )


def complete_request(
    checked: CheckedRequest,
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
    tokens, num_truncated = _truncate_left(checked, tuple(prompt_tokens))
    max_tokens = _fit_max_tokens(checked, len(tokens))
    if len(checked.resumed) > max_tokens:
        raise _invalid(
            RESUME_FIELD,
            ParamErrorText.RESUME_TOO_LONG,
            count=len(checked.resumed),
            max_tokens=max_tokens,
        )
    stopping = dataclasses.replace(
        checked.stopping, max_tokens=max_tokens, max_tokens_is_default=checked.max_tokens is None
    )
    return GenerationRequest(
        request_id=request_id,
        prompt_tokens=tokens,
        sampling=checked.sampling,
        stopping=stopping,
        output=checked.output,
        constraint=checked.constraint,
        num_truncated=num_truncated,
        session_id=checked.session_id,
        cache_scope=scoped(scoped_cache_scope(tenant, checked.cache_scope), adapters),
        cache_prompt=checked.cache_prompt,
        deadline=deadline,
        adapters=adapters,
        tenant=tenant,
        priority=checked.priority,
        cache_response=checked.cache_response,
        speculative=checked.speculative,
        resumed=checked.resumed,
    )


def logit_bias(
    biases: Mapping[int, float], n_vocab: int, field: str = "params.sampling.logit_bias"
) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs; every id in the vocabulary, every bias finite or -inf."""
    if len(biases) > MAX_LOGIT_BIAS:
        raise _invalid(
            field, ParamErrorText.TOO_MANY_BIASES, count=len(biases), limit=MAX_LOGIT_BIAS
        )
    out: list[tuple[int, float]] = []
    for token_id, bias in sorted(biases.items()):
        if not 0 <= token_id < n_vocab:
            raise _invalid(
                f"{field}[{token_id}]",
                ParamErrorText.BIAS_TOKEN_OUT_OF_RANGE,
                token_id=token_id,
                n_vocab=n_vocab,
            )
        if math.isnan(bias) or bias == math.inf:
            raise _invalid(
                f"{field}[{token_id}]",
                ParamErrorText.BIAS_NOT_ALLOWED,
                token_id=token_id,
                value=bias,
            )
        out.append((token_id, bias if bias == -math.inf else shortest_float32(bias)))
    return tuple(out)


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
        raise errors.FailedPrecondition(
            ParamErrorText.NO_CONSTRAINTS.format(name=field), field=field
        )
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
        raise _invalid(field, ParamErrorText.EMPTY_CONSTRAINT, name=name)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise _invalid(
            field,
            ParamErrorText.CONSTRAINT_TOO_LONG,
            name=name,
            length=len(text),
            limit=MAX_CONSTRAINT_CHARS,
        )


def checked_number(name: str, value: float, bounds: Range, field: str = "") -> float:
    """The value, unless it is not finite or outside its bounds; `field` defaults to v1's."""
    field = field or f"params.sampling.{name}"
    if not math.isfinite(value):
        raise _invalid(field, ParamErrorText.NOT_FINITE, name=name, value=value)
    if not bounds.contains(value):
        raise _invalid(
            field, ParamErrorText.OUT_OF_RANGE, name=name, bounds=bounds.describe(), value=value
        )
    return value if isinstance(value, int) else shortest_float32(value)


def shortest_float32(value: float) -> float:
    """The shortest decimal with the same float32 bits: 0.7, not 0.699999988079071 (proto floats
    are float32; llama.cpp reads float32 too, so nothing changes but logs and comparisons)."""
    bits = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == bits:
            return candidate
    return value


def check_stops(
    stops: list[str], limits: SchedulerSettings, field: str = "params.stopping.stop"
) -> None:
    if len(stops) > limits.max_stop_strings:
        raise _invalid(
            field, ParamErrorText.TOO_MANY_STOPS, count=len(stops), limit=limits.max_stop_strings
        )
    for index, stop in enumerate(stops):
        if not stop:
            raise _invalid(f"{field}[{index}]", ParamErrorText.EMPTY_STOP)
        if len(stop) > limits.max_stop_length:
            raise _invalid(
                f"{field}[{index}]",
                ParamErrorText.STOP_TOO_LONG,
                length=len(stop),
                limit=limits.max_stop_length,
            )


def _truncate_left(checked: CheckedRequest, tokens: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """With truncate_left, cut the prompt to fit with max_tokens (or the default)."""
    if checked.n_keep is None:
        return tokens, 0
    max_tokens = checked.default_max_tokens if checked.max_tokens is None else checked.max_tokens
    return context_fit.truncate_left(
        tokens,
        n_keep=checked.n_keep,
        max_tokens=max_tokens,
        n_ctx=checked.n_ctx,
        bos_token_id=checked.bos_token_id,
    )


def _fit_max_tokens(checked: CheckedRequest, num_prompt: int) -> int:
    return context_fit.fit_max_tokens(
        num_prompt,
        checked.max_tokens,
        default_max_tokens=checked.default_max_tokens,
        n_ctx=checked.n_ctx,
        prompt_field=checked.prompt_field,
    )
