"""`/v1/embeddings` end to end: the official `openai` SDK through SMG (deploy/gateway.py) to one
real replica's vLLM-protocol Embed, against v1 Embed on the same replica."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from deploy.cluster import free_port
from deploy.gateway import NO_WARM_UP, QUICK_EXIT, Gateway

from llama_grpc import AsyncClient
from llama_grpc_testkit.threads import TEST_THREADS

from .conftest import NO_DRAIN

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday morning."]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    with Gateway(
        replicas=1,
        port=free_port(),
        server_args=NO_DRAIN,
        smg_args=(*NO_WARM_UP, *QUICK_EXIT),
        threads=TEST_THREADS,
    ) as gw:
        yield gw


async def test_openai_embeddings_equal_v1_embed(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """embeddings.create of a text returns v1 Embed's vector of that text (cosine >= 0.9999,
    same dimension) and its token count as usage.

    One text per call: SMG 1.13.0 (measured) joins a list input into one text (the vector and
    the 16 tokens of " ".join of two texts of 8 and 9 tokens, as one data entry) and refuses
    token-id inputs ("Input text cannot be empty"), so callers send a call per text (v1 Embed
    takes batches and token ids)."""
    for text in TEXTS:
        answer = await sdk.embeddings.create(model=gateway.model, input=text)
        want = (await direct.embed(text)).embeddings[0]
        assert len(answer.data) == 1
        got = answer.data[0].embedding
        assert len(got) == len(want.vector)
        dot = math.fsum(a * b for a, b in zip(got, want.vector, strict=True))
        assert dot / math.sqrt(math.fsum(a * a for a in got)) >= 0.9999
        assert answer.usage.prompt_tokens == want.prompt_tokens
