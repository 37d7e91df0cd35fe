"""The context-fit rule, in one place: prompt + max_tokens must fit n_ctx. Validation uses it to
clamp the default max_tokens and to truncate a prompt from the left; the scheduler checks it
again at submit; generation ends with CONTEXT_LENGTH when the context is full. Pure functions;
the messages name both numbers."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import FinishReason, StoppingParams

MAX_TOKENS_FIELD = "params.stopping.max_tokens"
N_KEEP_FIELD = "params.context_overflow.n_keep"


class TooLongMessage(enum.StrEnum):
    """The PromptTooLong message of each way a request misses the context (numbers to fill in)."""

    MAX_TOKENS_ABSURD = "max_tokens ({max_tokens}) exceeds the context ({n_ctx} tokens)"
    PROMPT_FILLS_CONTEXT = (
        "prompt ({prompt_tokens} tokens) leaves no room to generate in the context ({n_ctx} tokens)"
    )
    PROMPT_PLUS_MAX_TOKENS = (
        "prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
        "({n_ctx} tokens)"
    )
    N_KEEP_TOO_LARGE = (
        "n_keep ({n_keep}) leaves no room for the newest prompt tokens: the context "
        "({n_ctx} tokens) minus max_tokens ({max_tokens}) allows {budget} prompt tokens"
    )
    INPUT_OVER_CONTEXT = "input ({prompt_tokens} tokens) exceeds the context ({n_ctx} tokens)"
    NO_ROOM_FOR_PROMPT = (
        "max_tokens ({max_tokens}) leaves no room for a prompt in the context ({n_ctx} tokens)"
    )


def _too_long(message: TooLongMessage, field: str, **numbers: int) -> errors.PromptTooLong:
    return errors.PromptTooLong(
        message.format(**numbers), field=field, metadata={k: str(v) for k, v in numbers.items()}
    )


def check_max_tokens(max_tokens: int, n_ctx: int) -> None:
    """A max_tokens that could never fit, whatever the prompt."""
    if max_tokens > n_ctx:
        raise errors.InvalidRequest(
            TooLongMessage.MAX_TOKENS_ABSURD.format(max_tokens=max_tokens, n_ctx=n_ctx),
            field=MAX_TOKENS_FIELD,
        )


def fit_max_tokens(
    num_prompt: int,
    max_tokens: int | None,
    *,
    default_max_tokens: int,
    n_ctx: int,
    prompt_field: str = "prompt",
) -> int:
    """The explicit max_tokens if prompt + it fits; without one, the default clamped to the room
    left. Raises PromptTooLong naming the field at fault."""
    if num_prompt >= n_ctx:
        raise _too_long(
            TooLongMessage.PROMPT_FILLS_CONTEXT, prompt_field, prompt_tokens=num_prompt, n_ctx=n_ctx
        )
    if max_tokens is None:
        return min(default_max_tokens, n_ctx - num_prompt)
    if num_prompt + max_tokens > n_ctx:
        raise _too_long(
            TooLongMessage.PROMPT_PLUS_MAX_TOKENS,
            MAX_TOKENS_FIELD,
            prompt_tokens=num_prompt,
            max_tokens=max_tokens,
            n_ctx=n_ctx,
        )
    return max_tokens


def check_fits(num_prompt: int, max_tokens: int, n_ctx: int) -> None:
    """The rule as the scheduler checks it at submit (max_tokens already resolved)."""
    fit_max_tokens(num_prompt, max_tokens, default_max_tokens=max_tokens, n_ctx=n_ctx)


def check_embedding_fits(num_tokens: int, n_ctx: int, field: str = "inputs") -> None:
    """An embedding input generates nothing: it fits when its tokens fit the context."""
    if num_tokens > n_ctx:
        raise _too_long(
            TooLongMessage.INPUT_OVER_CONTEXT, field, prompt_tokens=num_tokens, n_ctx=n_ctx
        )


def truncate_left(
    tokens: Sequence[int],
    *,
    n_keep: int,
    max_tokens: int,
    n_ctx: int,
    bos_token_id: int | None,
) -> tuple[tuple[int, ...], int]:
    """Drop the oldest tokens after the kept head (a leading BOS plus n_keep) so that prompt +
    max_tokens fits; returns (tokens, number dropped)."""
    tokens = tuple(tokens)
    budget = n_ctx - max_tokens
    if len(tokens) <= budget:
        return tokens, 0
    if budget < 1:
        raise _too_long(
            TooLongMessage.NO_ROOM_FOR_PROMPT, MAX_TOKENS_FIELD, max_tokens=max_tokens, n_ctx=n_ctx
        )
    head = n_keep + (1 if tokens[0] == bos_token_id else 0)
    if head >= budget:
        raise errors.InvalidRequest(
            TooLongMessage.N_KEEP_TOO_LARGE.format(
                n_keep=n_keep, budget=budget, max_tokens=max_tokens, n_ctx=n_ctx
            ),
            field=N_KEEP_FIELD,
        )
    return tokens[:head] + tokens[len(tokens) - (budget - head) :], len(tokens) - budget


def length_reason(
    num_output: int, num_tokens: int, n_ctx: int, stopping: StoppingParams
) -> FinishReason | None:
    """Why generation must stop for length after this token, if it must: max_tokens reached, or
    the context full (CONTEXT_LENGTH, also when only the default max_tokens was reached there)."""
    at_context = num_tokens >= n_ctx
    if num_output >= stopping.max_tokens:
        if at_context and stopping.max_tokens_is_default:
            return FinishReason.CONTEXT_LENGTH
        return FinishReason.MAX_TOKENS
    return FinishReason.CONTEXT_LENGTH if at_context else None
