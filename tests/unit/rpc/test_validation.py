"""rpc.v1.validation: proto requests -> GenerationRequest, or an error naming the field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import GenerationRequest
from llama_grpc_server.rpc.shared import checks, running
from llama_grpc_server.rpc.v1 import validation
from llama_grpc_server.testing import N_VOCAB
from tests.support.validation import INFO, LIMITS, N_CTX, text_request


def tokens_request(token_ids: list[int], **fields: Any) -> GenerationRequest:
    message = pb.GenerateTokensRequest(token_ids=token_ids, **fields)
    checked = validation.parse_tokens_request(message, INFO, LIMITS)
    return checks.complete_request(checked, checked.prompt_tokens, request_id="r2", deadline=None)


def sampling(**fields: Any) -> dict[str, Any]:
    return {"params": pb.GenerationParams(sampling=pb.SamplingParams(**fields))}


def stopping(**fields: Any) -> dict[str, Any]:
    return {"params": pb.GenerationParams(stopping=pb.StoppingCriteria(**fields))}


Case = tuple[Callable[[], object], type[errors.ServiceError], str, str]

BAD: dict[str, Case] = {
    "empty prompt": (
        lambda: text_request(prompt=""),
        errors.InvalidRequest,
        "prompt",
        "must not be empty",
    ),
    "unknown model": (
        lambda: text_request(model="llama-70b"),
        errors.ModelNotFound,
        "model",
        "'llama-70b'",
    ),
    "empty token ids": (lambda: tokens_request([]), errors.InvalidRequest, "token_ids", "empty"),
    "token id past vocab": (
        lambda: tokens_request([5, N_VOCAB + 1]),
        errors.InvalidRequest,
        "token_ids[1]",
        f"token id {N_VOCAB + 1} at index 1 is out of range: the vocabulary has {N_VOCAB}",
    ),
    "max_tokens zero": (
        lambda: text_request(**stopping(max_tokens=0)),
        errors.InvalidRequest,
        "params.stopping.max_tokens",
        "at least 1",
    ),
    "max_tokens absurd": (
        lambda: text_request(**stopping(max_tokens=N_CTX + 1)),
        errors.InvalidRequest,
        "params.stopping.max_tokens",
        f"max_tokens ({N_CTX + 1}) exceeds the context ({N_CTX} tokens)",
    ),
    "prompt plus max_tokens": (
        lambda: text_request(60, **stopping(max_tokens=10)),
        errors.PromptTooLong,
        "params.stopping.max_tokens",
        f"prompt (60 tokens) + max_tokens (10) exceeds the context ({N_CTX} tokens)",
    ),
    "prompt fills context": (
        lambda: text_request(N_CTX),
        errors.PromptTooLong,
        "prompt",
        f"prompt ({N_CTX} tokens) leaves no room",
    ),
    "token prompt fills context": (
        lambda: tokens_request([5] * N_CTX),
        errors.PromptTooLong,
        "token_ids",
        f"context ({N_CTX} tokens)",
    ),
    "temperature nan": (
        lambda: text_request(**sampling(temperature=math.nan)),
        errors.InvalidRequest,
        "params.sampling.temperature",
        "finite",
    ),
    "temperature inf": (
        lambda: text_request(**sampling(temperature=math.inf)),
        errors.InvalidRequest,
        "params.sampling.temperature",
        "finite",
    ),
    "temperature negative": (
        lambda: text_request(**sampling(temperature=-0.5)),
        errors.InvalidRequest,
        "params.sampling.temperature",
        "in [0, 100], got -0.5",
    ),
    "temperature huge": (
        lambda: text_request(**sampling(temperature=101)),
        errors.InvalidRequest,
        "params.sampling.temperature",
        "in [0, 100]",
    ),
    "top_p zero": (
        lambda: text_request(**sampling(top_p=0)),
        errors.InvalidRequest,
        "params.sampling.top_p",
        "in (0, 1]",
    ),
    "top_p above one": (
        lambda: text_request(**sampling(top_p=1.5)),
        errors.InvalidRequest,
        "params.sampling.top_p",
        "in (0, 1]",
    ),
    "min_p above one": (
        lambda: text_request(**sampling(min_p=1.5)),
        errors.InvalidRequest,
        "params.sampling.min_p",
        "in [0, 1]",
    ),
    "top_k negative": (
        lambda: text_request(**sampling(top_k=-1)),
        errors.InvalidRequest,
        "params.sampling.top_k",
        ">= 0",
    ),
    "repeat_penalty zero": (
        lambda: text_request(**sampling(repeat_penalty=0)),
        errors.InvalidRequest,
        "params.sampling.repeat_penalty",
        "> 0",
    ),
    "repeat_penalty inf": (
        lambda: text_request(**sampling(repeat_penalty=math.inf)),
        errors.InvalidRequest,
        "params.sampling.repeat_penalty",
        "finite",
    ),
    "frequency_penalty high": (
        lambda: text_request(**sampling(frequency_penalty=2.5)),
        errors.InvalidRequest,
        "params.sampling.frequency_penalty",
        "in [-2, 2]",
    ),
    "presence_penalty nan": (
        lambda: text_request(**sampling(presence_penalty=math.nan)),
        errors.InvalidRequest,
        "params.sampling.presence_penalty",
        "finite",
    ),
    "penalty_last_n below -1": (
        lambda: text_request(**sampling(penalty_last_n=-2)),
        errors.InvalidRequest,
        "params.sampling.penalty_last_n",
        "in [-1, 64]",
    ),
    "penalty_last_n beyond the context (2**31 - 1 stalled the engine)": (
        lambda: text_request(**sampling(penalty_last_n=N_CTX + 1)),
        errors.InvalidRequest,
        "params.sampling.penalty_last_n",
        "in [-1, 64]",
    ),
    "too many stops": (
        lambda: text_request(**stopping(stop=["a", "b", "c"])),
        errors.InvalidRequest,
        "params.stopping.stop",
        "3 strings; at most 2",
    ),
    "empty stop": (
        lambda: text_request(**stopping(stop=["a", ""])),
        errors.InvalidRequest,
        "params.stopping.stop[1]",
        "must not be empty",
    ),
    "long stop": (
        lambda: text_request(**stopping(stop=["x" * 9])),
        errors.InvalidRequest,
        "params.stopping.stop[0]",
        "9 characters long; at most 8",
    ),
    "stop token past vocab": (
        lambda: text_request(**stopping(stop_token_ids=[N_VOCAB])),
        errors.InvalidRequest,
        "params.stopping.stop_token_ids[0]",
        f"the vocabulary has {N_VOCAB} tokens",
    ),
    "time limit zero": (
        lambda: text_request(**stopping(time_limit_ms=0)),
        errors.InvalidRequest,
        "params.stopping.time_limit_ms",
        "at least 1",
    ),
    "long session id": (
        lambda: text_request(session_id="s" * 257),
        errors.InvalidRequest,
        "session_id",
        "257 characters long; at most 256",
    ),
    "long cache scope": (
        lambda: text_request(cache_scope="c" * 257),
        errors.InvalidRequest,
        "cache_scope",
        "at most 256",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_request_names_field_and_problem(case: Case) -> None:
    """Each bad input raises the right error type, naming its field, with a useful message."""
    build, error_type, field, text = case
    with pytest.raises(error_type) as caught:
        build()
    assert type(caught.value) is error_type
    assert caught.value.field == field
    assert text in caught.value.message


def test_prompt_too_long_carries_numbers_in_metadata() -> None:
    """PromptTooLong metadata has prompt_tokens, max_tokens and n_ctx as strings."""
    with pytest.raises(errors.PromptTooLong) as caught:
        text_request(60, **stopping(max_tokens=10))
    assert caught.value.metadata == {"prompt_tokens": "60", "max_tokens": "10", "n_ctx": "64"}
    assert caught.value.reason == "CONTEXT_LENGTH_EXCEEDED"


def test_defaults_apply_when_nothing_is_set() -> None:
    """An unset request takes the server's sampling defaults, seed None and the default limit."""
    request = text_request(3)
    assert request.sampling == LIMITS.default_sampling
    assert request.sampling.seed is None
    assert request.stopping.max_tokens == LIMITS.default_max_tokens
    assert request.stopping.max_tokens_is_default
    assert request.cache_prompt is LIMITS.cache_prompt
    assert request.request_id == "r1"
    assert request.prompt_tokens == (10, 10, 10)


def test_default_max_tokens_is_clamped_to_the_room_left() -> None:
    """Unset max_tokens becomes min(default, n_ctx - prompt) so a long prompt still fits."""
    request = text_request(60)
    assert request.stopping.max_tokens == N_CTX - 60
    assert request.stopping.max_tokens_is_default


def test_explicit_max_tokens_that_exactly_fits_is_kept() -> None:
    """prompt + max_tokens == n_ctx is accepted and not marked as a default."""
    request = text_request(54, **stopping(max_tokens=10))
    assert request.stopping.max_tokens == 10
    assert not request.stopping.max_tokens_is_default


def test_sampling_overrides_field_by_field() -> None:
    """Set fields replace the defaults; unset ones keep them."""
    request = text_request(**sampling(temperature=0.5, seed=7, penalty_last_n=32))
    expected = dataclasses.replace(
        LIMITS.default_sampling, temperature=0.5, seed=7, penalty_last_n=32
    )
    assert request.sampling == expected


def test_penalty_last_n_minus_one_is_the_whole_context() -> None:
    """-1 is sent to llama.cpp as n_ctx (llama.cpp itself reads -1 as "no penalty")."""
    assert text_request(**sampling(penalty_last_n=-1)).sampling.penalty_last_n == N_CTX
    assert text_request(**sampling(penalty_last_n=N_CTX)).sampling.penalty_last_n == N_CTX


def test_zero_values_that_mean_something_are_accepted() -> None:
    """temperature 0 (greedy), top_k 0, min_p 0 and the range edges are valid when set."""
    request = text_request(
        **sampling(temperature=0, top_k=0, min_p=0, top_p=1, frequency_penalty=-2, seed=0)
    )
    assert request.sampling.temperature == 0.0
    assert request.sampling.is_greedy
    assert request.sampling.top_k == 0
    assert request.sampling.seed == 0
    assert request.sampling.frequency_penalty == -2.0


def test_stopping_and_cache_fields_pass_through() -> None:
    """stop, stop_token_ids, ignore_eos, time limit, cache_prompt, session and scope are kept."""
    params = pb.GenerationParams(
        stopping=pb.StoppingCriteria(
            stop=["\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, time_limit_ms=1500
        ),
        cache_prompt=False,
    )
    request = text_request(params=params, session_id="chat-1", cache_scope="tenant-a")
    assert request.stopping.stop == ("\n", "END")
    assert request.stopping.stop_token_ids == frozenset({2, 7})
    assert request.stopping.ignore_eos
    assert request.stopping.time_limit_ms == 1500
    assert request.cache_prompt is False
    assert (request.session_id, request.cache_scope) == ("chat-1", "tenant-a")


def test_unset_time_limit_means_none() -> None:
    """No time_limit_ms means no limit."""
    assert text_request().stopping.time_limit_ms is None


@pytest.mark.parametrize("model", ["", "fake", "/models/fake.gguf", "fake.gguf"])
def test_model_accepts_name_path_and_file_name(model: str) -> None:
    """The loaded model may be named by its name, its path or its file name (or not at all):
    the request then parses exactly like one naming no model."""
    assert text_request(model=model) == text_request()


@pytest.mark.parametrize("model", ["Fake", "fake.gg", "models/fake.gguf", "/other/fake.gguf"])
def test_model_near_misses_are_not_found(model: str) -> None:
    """Names that are not exactly the loaded model's name, path or file name are NOT_FOUND."""
    with pytest.raises(errors.ModelNotFound) as caught:
        text_request(model=model)
    assert caught.value.metadata == {"model": model, "loaded": "fake"}


def test_tokens_request_keeps_prompt_ids() -> None:
    """GenerateTokens uses its ids as the prompt, unchanged."""
    request = tokens_request([5, 6, 7], params=pb.GenerationParams())
    assert request.prompt_tokens == (5, 6, 7)
    assert request.stopping.max_tokens == LIMITS.default_max_tokens


def test_add_special_defaults_to_true() -> None:
    """add_special is True unless the request sets it."""
    assert validation.add_special(pb.GenerateRequest(prompt="x"))
    assert not validation.add_special(pb.GenerateRequest(prompt="x", add_special=False))
    assert not validation.add_special(pb.TokenizeRequest(text="x", add_special=False))


def test_deadline_from_time_remaining() -> None:
    """A remaining time becomes an absolute monotonic deadline; None stays None."""
    assert running.deadline_from(None, 100.0) is None
    assert running.deadline_from(2.5, 100.0) == 102.5
    assert running.deadline_from(-1.0, 100.0) == 100.0


def test_deadline_reaches_the_request() -> None:
    """complete_request carries the deadline it is given."""
    checked = validation.parse_text_request(pb.GenerateRequest(prompt="x"), INFO, LIMITS)
    request = checks.complete_request(checked, [1], request_id="r", deadline=123.0)
    assert request.deadline == 123.0


def test_float32_values_read_as_written() -> None:
    """A float32 0.7 on the wire becomes 0.7 again, not 0.699999988079071."""
    request = text_request(**sampling(temperature=0.7, top_p=0.9, min_p=0.1))
    assert (request.sampling.temperature, request.sampling.top_p) == (0.7, 0.9)
    assert request.sampling.min_p == 0.1


def test_out_of_range_message_shows_the_value_as_written() -> None:
    """The message shows 100.7, not float32 noise."""
    with pytest.raises(errors.InvalidRequest, match=r"got 100\.7$"):
        text_request(**sampling(temperature=100.7))


@pytest.mark.parametrize(
    ("interval_ms", "seconds"),
    [(0, 1.0), (100, 0.1), (250, 0.25), (60_000, 60.0), (60_001, 60.0), (2**32 - 1, 60.0)],
)
def test_watch_interval_default_and_cap(interval_ms: int, seconds: float) -> None:
    """0 is the 1 s default; from 100 ms as asked; above 60 s capped at 60 s."""
    assert validation.watch_interval_s(interval_ms) == seconds


@pytest.mark.parametrize("interval_ms", [1, 99])
def test_watch_interval_below_100_ms_names_the_field(interval_ms: int) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        validation.watch_interval_s(interval_ms)
    assert caught.value.field == "interval_ms"
    assert str(interval_ms) in caught.value.message
