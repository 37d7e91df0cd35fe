"""The client's embed(): the EmbedRequest it builds from its arguments and the EmbedResult it
makes of the answer (no server)."""

from __future__ import annotations

import pytest

from llama_grpc import Embedding, EmbedResult
from llama_grpc.client import embed_request
from llama_grpc.types import embed_result_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb


def test_a_text_is_one_input_and_unset_params_stay_unset() -> None:
    """A lone text is one input; what the caller leaves out stays unset (server defaults)."""
    request = embed_request("hello", {})
    assert [i.text for i in request.inputs] == ["hello"]
    assert request.pooling == pb.POOLING_UNSPECIFIED
    assert not request.HasField("normalize")
    assert not request.HasField("add_special")
    assert request.context_overflow.policy == pb.OVERFLOW_POLICY_UNSPECIFIED


def test_texts_token_ids_and_every_param() -> None:
    """Texts and token id lists in order; every parameter lands in its field."""
    request = embed_request(
        ["a", [1, 2, 3]],
        {
            "pooling": "none",
            "normalize": False,
            "dimensions": 64,
            "truncate": True,
            "n_keep": 2,
            "add_special": False,
            "model": "m",
        },
    )
    assert request.inputs[0].text == "a"
    assert list(request.inputs[1].tokens.ids) == [1, 2, 3]
    assert (request.pooling, request.normalize, request.dimensions) == (pb.POOLING_NONE, False, 64)
    assert request.context_overflow.policy == pb.OVERFLOW_POLICY_TRUNCATE_LEFT
    assert request.context_overflow.n_keep == 2
    assert (request.add_special, request.model) == (False, "m")


def test_unknown_pooling_is_a_value_error() -> None:
    """A pooling name the protocol does not have is refused before any call."""
    with pytest.raises(ValueError, match="pooling must be one of mean, cls, last, none"):
        embed_request("a", {"pooling": "max"})


def test_result_from_proto() -> None:
    """EmbedResponse -> EmbedResult: vectors as tuples, the pooling by its lower-case name."""
    message = pb.EmbedResponse(dimensions=2, pooling=pb.POOLING_CLS, request_id="r")
    message.embeddings.add(prompt_tokens=3, truncated_tokens=1).vectors.add(values=[0.5, 1.5])
    message.usage.prompt_tokens = 3
    message.usage.truncated_prompt_tokens = 1
    assert embed_result_from_proto(message) == EmbedResult(
        embeddings=(Embedding(((0.5, 1.5),), 3, 1),),
        dimensions=2,
        pooling="cls",
        prompt_tokens=3,
        truncated_prompt_tokens=1,
        request_id="r",
    )
    assert embed_result_from_proto(message).embeddings[0].vector == (0.5, 1.5)
