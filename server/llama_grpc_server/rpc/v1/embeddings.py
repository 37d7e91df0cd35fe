"""The Embed RPC's values: an EmbedRequest -> checked `EmbedPlan` (or an error naming the
field), each input's tokens -> an embedding GenerationRequest (the context-overflow policy
applied), and the finished inputs -> the EmbedResponse. Pure: no grpc context, no engine calls
(the servicer tokenizes text inputs and runs the requests)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.auth import scoped_cache_scope
from llama_grpc_server.core.api import ModelInfo
from llama_grpc_server.core.requests import context_fit, embedding
from llama_grpc_server.core.requests.embedding import EmbeddingParams, Pooling
from llama_grpc_server.core.requests.request import Finished, GenerationRequest, Priority
from llama_grpc_server.rpc.shared import checks
from llama_grpc_server.rpc.v1 import validation

MAX_INPUTS = 2048  # inputs of one Embed call (OpenAI's /v1/embeddings bound)

POOLINGS = {
    pb.POOLING_MEAN: Pooling.MEAN,
    pb.POOLING_CLS: Pooling.CLS,
    pb.POOLING_LAST: Pooling.LAST,
    pb.POOLING_NONE: Pooling.NONE,
}
POOLING_VALUES = {v: k for k, v in POOLINGS.items()}
_PRIORITIES = {
    pb.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    pb.PRIORITY_LOW: Priority.LOW,
    pb.PRIORITY_NORMAL: Priority.NORMAL,
    pb.PRIORITY_HIGH: Priority.HIGH,
}


class EmbedErrorText(enum.StrEnum):
    """The error texts of the Embed request's own fields; format() fills the numbers."""

    NO_INPUTS = "inputs must not be empty"
    TOO_MANY_INPUTS = "inputs has {count} entries; at most {limit} are allowed"
    EMPTY_INPUT = "input {index} is empty"
    UNKNOWN_POOLING = "unknown pooling {value}"
    DIMENSIONS_TOO_LARGE = "dimensions ({dimensions}) exceeds the model's ({n_embd})"
    UNKNOWN_POLICY = "unknown context overflow policy {value}"
    N_KEEP_WITHOUT_TRUNCATION = "n_keep only applies with OVERFLOW_POLICY_TRUNCATE_LEFT"
    UNKNOWN_PRIORITY = "unknown priority {value}"


def _invalid(field: str, message: EmbedErrorText, **values: Any) -> errors.InvalidRequest:
    return errors.InvalidRequest(message.format(**values), field=field)


@dataclass(frozen=True, slots=True)
class EmbedPlan:
    """A checked EmbedRequest: what each input becomes once tokenized."""

    params: EmbeddingParams
    n_keep: int | None  # None: reject an input over the context; else truncate_left keeping it
    priority: Priority
    add_special: bool
    n_ctx: int
    bos_token_id: int | None


def parse(message: pb.EmbedRequest, info: ModelInfo) -> EmbedPlan:
    """Check every field but the inputs' lengths (known once tokenized: `request`)."""
    validation.check_model(message.model, info)
    checks.check_embeds(info)
    _check_inputs(message.inputs, info.n_vocab)
    if message.pooling == pb.POOLING_UNSPECIFIED:
        pooling = embedding.default_pooling(info.pooling)
    elif message.pooling in POOLINGS:
        pooling = POOLINGS[message.pooling]
    else:
        raise _invalid("pooling", EmbedErrorText.UNKNOWN_POOLING, value=message.pooling)
    if message.dimensions > info.n_embd:
        raise _invalid(
            "dimensions",
            EmbedErrorText.DIMENSIONS_TOO_LARGE,
            dimensions=message.dimensions,
            n_embd=info.n_embd,
        )
    if message.priority not in _PRIORITIES:
        raise _invalid("priority", EmbedErrorText.UNKNOWN_PRIORITY, value=message.priority)
    normalize = message.normalize if message.HasField("normalize") else True
    return EmbedPlan(
        params=EmbeddingParams(pooling, normalize, message.dimensions),
        n_keep=_n_keep(message.context_overflow),
        priority=_PRIORITIES[message.priority],
        add_special=message.add_special if message.HasField("add_special") else True,
        n_ctx=info.n_ctx,
        bos_token_id=info.bos_token_id,
    )


def _check_inputs(inputs: Sequence[pb.EmbedInput], n_vocab: int) -> None:
    if not inputs:
        raise _invalid("inputs", EmbedErrorText.NO_INPUTS)
    if len(inputs) > MAX_INPUTS:
        raise _invalid(
            "inputs", EmbedErrorText.TOO_MANY_INPUTS, count=len(inputs), limit=MAX_INPUTS
        )
    for index, item in enumerate(inputs):
        kind = item.WhichOneof("input")
        if kind == "tokens":
            if not item.tokens.ids:
                raise _invalid(
                    f"inputs[{index}].tokens.ids", EmbedErrorText.EMPTY_INPUT, index=index
                )
            checks.check_token_ids(item.tokens.ids, n_vocab, f"inputs[{index}].tokens.ids")
        elif kind != "text" or not item.text:
            raise _invalid(f"inputs[{index}]", EmbedErrorText.EMPTY_INPUT, index=index)


def _n_keep(message: pb.ContextOverflow) -> int | None:
    if message.policy == pb.OVERFLOW_POLICY_TRUNCATE_LEFT:
        return message.n_keep
    if message.policy not in (pb.OVERFLOW_POLICY_UNSPECIFIED, pb.OVERFLOW_POLICY_REJECT):
        raise _invalid(
            "context_overflow.policy", EmbedErrorText.UNKNOWN_POLICY, value=message.policy
        )
    if message.n_keep:
        raise _invalid("context_overflow.n_keep", EmbedErrorText.N_KEEP_WITHOUT_TRUNCATION)
    return None


def request(
    plan: EmbedPlan,
    index: int,
    tokens: Sequence[int],
    *,
    request_id: str,
    deadline: float | None,
    tenant: str = "",
) -> GenerationRequest:
    """Input `index`'s embedding request: over the context it is refused (naming the input)
    or truncated from the left, as the plan's policy says."""
    field = f"inputs[{index}]"
    num_truncated = 0
    if plan.n_keep is None:
        context_fit.check_embedding_fits(len(tokens), plan.n_ctx, field)
    else:
        try:
            tokens, num_truncated = context_fit.truncate_left(
                tokens,
                n_keep=plan.n_keep,
                max_tokens=0,
                n_ctx=plan.n_ctx,
                bos_token_id=plan.bos_token_id,
            )
        except errors.InvalidRequest as exc:
            raise errors.InvalidRequest(exc.message, field="context_overflow.n_keep") from None
    if not tokens:
        raise _invalid(field, EmbedErrorText.EMPTY_INPUT, index=index)
    return GenerationRequest(
        request_id=request_id,
        prompt_tokens=tuple(tokens),
        num_truncated=num_truncated,
        deadline=deadline,
        tenant=tenant,
        cache_scope=scoped_cache_scope(tenant, ""),
        priority=plan.priority,
        embedding=plan.params,
    )


def response(
    request_id: str, plan: EmbedPlan, finished: Sequence[Finished], n_embd: int
) -> pb.EmbedResponse:
    """The inputs' vectors in input order, their token counts and the totals."""
    out = pb.EmbedResponse(
        request_id=request_id,
        dimensions=plan.params.dimensions or n_embd,
        pooling=POOLING_VALUES[plan.params.pooling],
    )
    for done in finished:
        item = out.embeddings.add(
            prompt_tokens=done.usage.prompt_tokens,
            truncated_tokens=done.usage.truncated_prompt_tokens,
        )
        if done.embedding is not None:
            for row in done.embedding.rows():
                item.vectors.add().values.extend(row)
    out.usage.prompt_tokens = sum(d.usage.prompt_tokens for d in finished)
    out.usage.truncated_prompt_tokens = sum(d.usage.truncated_prompt_tokens for d in finished)
    return out
