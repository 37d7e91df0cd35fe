"""rpc/v1/embeddings.py: an EmbedRequest checked field by field (errors name the field), each
input's tokens made an embedding request under the overflow policy, the response in order."""

from __future__ import annotations

import dataclasses
from array import array

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core.requests.embedding import EmbeddingParams, Pooling, Vectors
from llama_grpc_server.core.requests.request import Finished, FinishReason, Timings, Usage
from llama_grpc_server.rpc.v1 import embeddings
from llama_grpc_server.testing import fake_model_info

INFO = fake_model_info(n_ctx=16)


def embed(*texts: str, **fields: object) -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts], **fields)  # type: ignore[arg-type]


def test_defaults() -> None:
    """Unset fields: the model's pooling (mean for a model without one), L2, every dimension,
    inputs over the context refused, BOS added."""
    plan = embeddings.parse(embed("a"), INFO)
    assert plan.params == EmbeddingParams(Pooling.MEAN, normalize=True, dimensions=0)
    assert plan.n_keep is None
    assert plan.add_special
    cls_model = dataclasses.replace(INFO, pooling="cls")
    assert embeddings.parse(embed("a"), cls_model).params.pooling is Pooling.CLS


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.EmbedRequest(), "inputs"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput()]), "inputs[0]"),
        (embed("a", pooling=9), "pooling"),  # type: ignore[arg-type]
        (embed("a", dimensions=5), "dimensions"),
        (embed("a", priority=7), "priority"),  # type: ignore[arg-type]
        (embed("a", context_overflow=pb.ContextOverflow(policy=5)), "context_overflow.policy"),  # type: ignore[arg-type]
        (embed("a", context_overflow=pb.ContextOverflow(n_keep=2)), "context_overflow.n_keep"),
    ],
)
def test_bad_fields_are_named(message: pb.EmbedRequest, field: str) -> None:
    """INVALID_ARGUMENT naming the field."""
    with pytest.raises(errors.InvalidRequest) as bad:
        embeddings.parse(message, INFO)
    assert bad.value.field == field


def test_too_many_inputs() -> None:
    """More inputs than MAX_INPUTS: INVALID_ARGUMENT with both numbers."""
    with pytest.raises(errors.InvalidRequest, match="at most 2048"):
        embeddings.parse(embed(*["a"] * (embeddings.MAX_INPUTS + 1)), INFO)


def test_a_reranker_cannot_embed() -> None:
    """A model whose pooling is rank: FAILED_PRECONDITION naming the model."""
    with pytest.raises(errors.FailedPrecondition, match="reranker") as refused:
        embeddings.parse(embed("a"), dataclasses.replace(INFO, pooling="rank"))
    assert refused.value.field == "model"


def test_overflow_policies() -> None:
    """Over n_ctx: refused naming the input, or truncated from the left keeping BOS."""
    plan = embeddings.parse(embed("a"), INFO)
    with pytest.raises(errors.PromptTooLong) as refused:
        embeddings.request(plan, 3, list(range(17)), request_id="r", deadline=None)
    assert refused.value.field == "inputs[3]"
    assert embeddings.request(plan, 0, list(range(16)), request_id="r", deadline=None)
    truncating = embeddings.parse(
        embed("a", context_overflow=pb.ContextOverflow(policy=pb.OVERFLOW_POLICY_TRUNCATE_LEFT)),
        INFO,
    )
    bos = INFO.bos_token_id
    spec = embeddings.request(truncating, 0, [bos, *range(10, 30)], request_id="r", deadline=None)
    assert spec.prompt_tokens == (bos, *range(15, 30))
    assert spec.num_truncated == 5
    assert spec.embedding == truncating.params


def test_response_in_order_with_usage() -> None:
    """One InputEmbedding per finished input, in order; usage sums their tokens."""
    plan = embeddings.parse(embed("a", "b"), INFO)
    timings = Timings(0, 0, 0, 0, 0)
    finished = [
        Finished(
            FinishReason.EMBEDDED,
            Usage(n, 0, 0, truncated),
            timings,
            0,
            embedding=Vectors(2, _floats(n, -n)),
        )
        for n, truncated in ((3, 0), (5, 2))
    ]
    out = embeddings.response("rid", plan, finished, n_embd=2)
    assert [list(e.vectors[0].values) for e in out.embeddings] == [[3.0, -3.0], [5.0, -5.0]]
    assert [e.prompt_tokens for e in out.embeddings] == [3, 5]
    assert out.usage.prompt_tokens == 8
    assert out.usage.truncated_prompt_tokens == 2
    assert out.dimensions == 2
    assert out.pooling == pb.POOLING_MEAN
    assert out.request_id == "rid"


def _floats(*values: float) -> bytes:
    return array("f", values).tobytes()
