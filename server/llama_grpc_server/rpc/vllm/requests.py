"""vLLM engine protocol requests (`vllm.grpc.engine.GenerateRequest`) -> the same core
GenerationRequests that llama_grpc.v1 builds, or a ServiceError naming the field.

Pure, with the checks both protocols share (rpc.shared.checks): parse_generate checks every field
before the prompt is tokenized, generation_requests applies the context rules and makes the n
samples; embed_request checks an Embed.
Each SamplingParams field is honoured or refused (INVALID_ARGUMENT naming it):

- temperature unset takes the server's default; top_p, top_k, min_p and the penalties keep
  vLLM's meaning of 0 (top_p 0 and repetition_penalty 0 are unset: 1; top_k 0 and min_p 0 are
  off), and the penalties count every generated token (llama.cpp's penalty sampler sees the
  output; vLLM's repetition_penalty also counts the prompt).
- max_tokens unset takes the server's default (clamped to the context); min_tokens holds back
  end-of-generation, stop tokens and stop strings until that many tokens are generated.
- include_stop_str_in_output, skip_special_tokens and spaces_between_special_tokens shape text;
  this protocol carries token ids, which they do not change (the gateway detokenizes).
- grammar_from_first_token: constraints always start at the first generated token here.
- constraints: json_schema, grammar (GBNF), json_object, regex and choice
(core.constrained.regex_grammar)
  become one GBNF grammar; structural_tag (core.constrained.structural_tag) one too, lazy for
  triggered tags: free text until a trigger, the tag's grammar from there on.
- prompt_logprobs, multimodal inputs, KV transfer and data-parallel ranks are refused.

The protocol has no LoRA field (nor a model name): a replica started with --engine-lora applies
that adapter to every request (generation_requests' `adapters`) and is its own model to the
gateway (rpc.vllm.engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from llama_grpc_server import errors
from llama_grpc_server.auth import scoped_cache_scope
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core.adapters import AdapterSet
from llama_grpc_server.core.api import GrammarCompiler, ModelInfo
from llama_grpc_server.core.constrained.regex_grammar import choice_to_gbnf, regex_to_gbnf
from llama_grpc_server.core.requests import context_fit, embedding
from llama_grpc_server.core.requests.embedding import EmbeddingParams
from llama_grpc_server.core.requests.request import (
    Constraint,
    GenerationRequest,
    OutputParams,
    SamplingParams,
    StoppingParams,
)
from llama_grpc_server.rpc.shared import checks
from llama_grpc_server.rpc.shared.checks import SAMPLING_RANGES, CheckedRequest, SamplingField

PARAMS = "sampling_params"
MAX_SAMPLES = 16  # n at most
MAX_REQUEST_ID_CHARS = 128
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# v1 field names that shared checks put in their errors -> this protocol's
_RENAMED = {context_fit.MAX_TOKENS_FIELD: f"{PARAMS}.max_tokens"}
# Fields of GenerateRequest an engine without them refuses, and why.
_UNSUPPORTED_REQUEST_FIELDS = {
    "mm_inputs": "multimodal inputs are not supported: this worker serves a text model",
    "media_refs": "multimodal inputs are not supported: this worker serves a text model",
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported",
    "data_parallel_rank": "this worker has no data-parallel ranks",
}


@dataclass(frozen=True, slots=True)
class CheckedGenerate:
    """A checked GenerateRequest waiting for its prompt tokens: the text to tokenize (text
    input) or the tokens (tokenized input), the checked request, n and the prompt cut of
    truncate_prompt_tokens."""

    checked: CheckedRequest
    text: str | None  # None: tokenized input, in checked.prompt_tokens
    n: int
    keep_last: int | None  # truncate_prompt_tokens > 0: keep the prompt's last this many


def _invalid(field: str, message: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, field=field)


def renamed(exc: errors.ServiceError) -> errors.ServiceError:
    """The error with a v1 field name (from a shared check) put as this protocol names it."""
    field = _RENAMED.get(exc.field or "")
    if field is None:
        return exc
    return type(exc)(
        exc.message, field=field, metadata=exc.metadata, retry_after_s=exc.retry_after_s
    )


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise _invalid(
            "request_id",
            f"request_id must be printable and at most {MAX_REQUEST_ID_CHARS} characters",
        )


def parse_generate(
    message: vpb.GenerateRequest,
    info: ModelInfo,
    limits: SchedulerSettings,
    *,
    grammars: GrammarCompiler | None = None,
) -> CheckedGenerate:
    """Check every field of a Generate request (a bad constraint is compiled, and refused,
    here)."""
    check_request_id(message.request_id)
    checks.check_generates(info)
    for name, why in _UNSUPPORTED_REQUEST_FIELDS.items():
        if message.HasField(name):
            raise _invalid(name, why)
    if message.extra_mm_inputs:
        raise _invalid("extra_mm_inputs", _UNSUPPORTED_REQUEST_FIELDS["mm_inputs"])
    params = message.sampling_params
    text, prompt_tokens, prompt_field = _input(message, info)
    max_tokens = _max_tokens(params, info.n_ctx)
    n_keep, keep_last = _truncation(params)
    checked = CheckedRequest(
        sampling=_sampling(params, limits.default_sampling, info),
        stopping=_stopping(params, info, limits, max_tokens),
        output=_output(params),
        constraint=_constraint(params, grammars),
        n_keep=n_keep,
        max_tokens=max_tokens,
        session_id="",
        cache_scope="",
        cache_prompt=limits.cache_prompt,
        n_ctx=info.n_ctx,
        default_max_tokens=limits.default_max_tokens,
        prompt_field=prompt_field,
        bos_token_id=info.bos_token_id,
        prompt_tokens=prompt_tokens,
    )
    return CheckedGenerate(checked, text, _n(params), keep_last)


def generation_requests(
    parsed: CheckedGenerate,
    prompt_tokens: Sequence[int],
    *,
    request_id: str,
    deadline: float | None,
    tenant: str = "",
    adapters: AdapterSet = (),
) -> list[GenerationRequest]:
    """The n scheduler requests of one Generate call: the same prompt (its KV computed once
    and shared by the prefix cache), ids `request_id` (n = 1) or `request_id[i]`, and distinct
    seeds (seed + i when the request sets one; the engine draws each otherwise). `adapters`:
    the replica's --engine-lora (this protocol has no LoRA field), in the cache scope too."""
    tokens = tuple(prompt_tokens)
    num_cut = 0
    if parsed.keep_last is not None and len(tokens) > parsed.keep_last:
        num_cut = len(tokens) - parsed.keep_last
        tokens = tokens[num_cut:]
    try:
        spec = checks.complete_request(
            parsed.checked,
            tokens,
            request_id=request_id,
            deadline=deadline,
            tenant=tenant,
            adapters=adapters,
        )
    except errors.ServiceError as exc:
        raise renamed(exc) from None
    if num_cut:
        spec = dataclasses.replace(spec, num_truncated=spec.num_truncated + num_cut)
    if parsed.n == 1:
        return [spec]
    seed = spec.sampling.seed
    return [
        dataclasses.replace(
            spec,
            request_id=f"{request_id}[{index}]",
            sampling=dataclasses.replace(
                spec.sampling, seed=None if seed is None else (seed + index) & 0xFFFFFFFF
            ),
        )
        for index in range(parsed.n)
    ]


# -- fields ----------------------------------------------------------------------------------------


def _input(
    message: vpb.GenerateRequest, info: ModelInfo
) -> tuple[str | None, tuple[int, ...], str]:
    """(text to tokenize or None, the prompt tokens of tokenized input, the prompt's field)."""
    kind = message.WhichOneof("input")
    if kind == "tokenized":
        field = "tokenized.input_ids"
        ids = message.tokenized.input_ids
        if not ids:
            raise _invalid(field, "tokenized.input_ids must not be empty")
        checks.check_token_ids(ids, info.n_vocab, field=field)
        return None, with_bos(ids, info), field
    if kind == "text":
        if not message.text:
            raise _invalid("text", "text must not be empty")
        return message.text, (), "text"
    raise _invalid("input", "set the prompt: tokenized.input_ids or text")


def with_bos(ids: Sequence[int], info: ModelInfo) -> tuple[int, ...]:
    """Token-id input with the model's BOS in front when the model file asks for one
    (add_bos_token) and the ids do not start with it. SMG 1.13.0 tokenizes /v1/completions
    prompts without special tokens (measured: v1 [2, 818, ...], through SMG [818, ...]) while its
    chat templates write the BOS themselves; Gemma without its BOS writes other text. vLLM runs
    the ids as given; a llama.cpp model file says whether its BOS is part of every prompt."""
    if info.add_bos and info.bos_token_id is not None and ids[0] != info.bos_token_id:
        return (info.bos_token_id, *ids)
    return tuple(ids)


def _field(name: str) -> str:
    return f"{PARAMS}.{name}"


def _sampling(
    params: vpb.SamplingParams, defaults: SamplingParams, info: ModelInfo
) -> SamplingParams:
    overrides: dict[str, Any] = {
        "top_p": _number(params, "top_p", "top_p", unset=1.0),
        "top_k": _number(params, "top_k", "top_k", unset=0),
        "min_p": _number(params, "min_p", "min_p", unset=0.0),
        "frequency_penalty": _number(params, "frequency_penalty", "frequency_penalty"),
        "presence_penalty": _number(params, "presence_penalty", "presence_penalty"),
        "repeat_penalty": _number(params, "repetition_penalty", "repeat_penalty", unset=1.0),
        "penalty_last_n": info.n_ctx,  # every generated token, as vLLM counts them
        "seed": params.seed if params.HasField("seed") else None,
    }
    if params.HasField("temperature"):
        overrides["temperature"] = _number(params, "temperature", "temperature")
    if params.logit_bias:
        overrides["logit_bias"] = checks.logit_bias(
            params.logit_bias, info.n_vocab, field=_field("logit_bias")
        )
    return dataclasses.replace(defaults, **overrides)


def _number(
    params: vpb.SamplingParams, name: str, v1_name: SamplingField, unset: float = 0.0
) -> Any:
    """A sampling number checked against the shared range for it (SAMPLING_RANGES, by v1's
    name); 0 (proto3's unset) is `unset`."""
    value = getattr(params, name)
    if value == 0 and name != "temperature":
        return unset
    return checks.checked_number(v1_name, value, SAMPLING_RANGES[v1_name], field=_field(name))


def _max_tokens(params: vpb.SamplingParams, n_ctx: int) -> int | None:
    if not params.HasField("max_tokens"):
        return None
    field = _field("max_tokens")
    if params.max_tokens == 0:
        raise _invalid(field, f"{field} must be at least 1 (leave it unset for the default)")
    try:
        context_fit.check_max_tokens(params.max_tokens, n_ctx)
    except errors.ServiceError as exc:
        raise renamed(exc) from None
    return int(params.max_tokens)


def _stopping(
    params: vpb.SamplingParams,
    info: ModelInfo,
    limits: SchedulerSettings,
    max_tokens: int | None,
) -> StoppingParams:
    checks.check_stops(list(params.stop), limits, field=_field("stop"))
    checks.check_token_ids(params.stop_token_ids, info.n_vocab, field=_field("stop_token_ids"))
    if params.min_tokens > (info.n_ctx if max_tokens is None else max_tokens):
        bound = "max_tokens" if max_tokens is not None else "the context"
        raise _invalid(
            _field("min_tokens"),
            f"min_tokens ({params.min_tokens}) must be at most {bound} "
            f"({info.n_ctx if max_tokens is None else max_tokens})",
        )
    return StoppingParams(
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
    )


def _output(params: vpb.SamplingParams) -> OutputParams:
    if params.HasField("prompt_logprobs"):
        raise _invalid(_field("prompt_logprobs"), "prompt_logprobs are not supported")
    if not params.HasField("logprobs"):
        return OutputParams()
    k = params.logprobs
    if not 0 <= k <= checks.MAX_TOP_LOGPROBS:
        raise _invalid(
            _field("logprobs"),
            f"logprobs must be between 0 and {checks.MAX_TOP_LOGPROBS} (the top "
            f"alternatives per token; -1, the whole vocabulary, is not supported), got {k}",
        )
    return OutputParams(logprobs=True, top_logprobs=k)


def _truncation(params: vpb.SamplingParams) -> tuple[int | None, int | None]:
    """(n_keep for truncate_left, keep_last): -1 drops the oldest tokens that do not fit (a
    leading BOS stays), k >= 1 keeps the last k tokens."""
    if not params.HasField("truncate_prompt_tokens"):
        return None, None
    k = params.truncate_prompt_tokens
    if k == -1:
        return 0, None
    if k < 1:
        raise _invalid(
            _field("truncate_prompt_tokens"),
            f"truncate_prompt_tokens must be -1 (fit the context) or at least 1, got {k}",
        )
    return None, k


def _n(params: vpb.SamplingParams) -> int:
    n = params.n or 1
    if n > MAX_SAMPLES:
        raise _invalid(_field("n"), f"n must be at most {MAX_SAMPLES}, got {n}")
    return int(n)


def _constraint(params: vpb.SamplingParams, grammars: GrammarCompiler | None) -> Constraint | None:
    kind = params.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    field = _field(kind)
    if kind == "structural_tag":
        return checks.structural_tag_constraint(field, params.structural_tag, grammars)
    convert_schema = None if grammars is None else grammars.json_schema_to_grammar
    if kind == "json_object":
        return checks.compiled_constraint(
            field, JSON_OBJECT_SCHEMA, grammars, convert=convert_schema
        )
    if kind == "choice":
        choices = list(params.choice.choices)
        text = repr(choices)  # for the length check; an empty list is refused by the compiler
        return checks.compiled_constraint(
            field, text, grammars, convert=lambda _: choice_to_gbnf(choices)
        )
    # grammar: GBNF as it is
    convert = {"json_schema": convert_schema, "regex": regex_to_gbnf}.get(kind)
    return checks.compiled_constraint(field, getattr(params, kind), grammars, convert=convert)


def embed_request(
    token_ids: Sequence[int],
    info: ModelInfo,
    *,
    request_id: str,
    deadline: float | None,
    tenant: str = "",
) -> GenerationRequest:
    """The vLLM engine protocol's Embed (the gateway's /v1/embeddings): one tokenized input,
    the model's default pooling, L2-normalized, refused over the context: what a v1 Embed with
    its defaults computes."""
    field = "tokenized.input_ids"
    checks.check_embeds(info)
    if not token_ids:
        raise _invalid(field, f"{field} must not be empty")
    checks.check_token_ids(token_ids, info.n_vocab, field)
    context_fit.check_embedding_fits(len(token_ids), info.n_ctx, field)
    return GenerationRequest(
        request_id=request_id,
        prompt_tokens=tuple(token_ids),
        deadline=deadline,
        tenant=tenant,
        cache_scope=scoped_cache_scope(tenant, ""),
        embedding=EmbeddingParams(embedding.default_pooling(info.pooling)),
    )
