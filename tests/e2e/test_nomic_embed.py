"""A trained embedding model through every door: nomic-embed-text-v1.5 (the catalog's, F16,
nomic-bert, a `bert` WordPiece vocabulary) on one replica behind SMG (deploy/gateway.py). Queries
and documents written for this test in English, French, German, Spanish, Korean, Japanese and
Chinese: the right document ranks first for every query through v1 Embed and through the
gateway's /v1/embeddings (the official openai SDK), and both doors give the same float32 vectors
and token counts, because both tokenize with BERT's tokenizer (models/tokenizer_wordpiece.py);
llama.cpp's own tokenizer would have given a Korean query another vector. The CLI and the
Matryoshka `dimensions`, SMG's join of an array input, and the refusal of generation, named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from deploy.cluster import free_port
from deploy.gateway import NO_WARM_UP, QUICK_EXIT, Gateway

from llama_grpc import AsyncClient, FailedPreconditionError
from llama_grpc_server.models import trained
from llama_grpc_testkit.threads import TEST_THREADS
from tests.model.test_tokenizer_vocabs import LlamaVocab
from tests.support.trained import trained_model_path

from .conftest import NO_DRAIN

pytestmark = pytest.mark.slow

NOMIC = trained.NOMIC_EMBED_TEXT_V15.name
DOCUMENTS = [
    "The Eiffel Tower in Paris was completed in 1889 for the World's Fair.",
    "Bananas are rich in potassium and are a popular breakfast fruit.",
    "La tour Eiffel a été construite à Paris pour l'Exposition universelle de 1889.",
    "Der Rhein fließt von den Alpen bis in die Nordsee.",
    "El café colombiano se cultiva en las montañas de los Andes.",
    "서울은 대한민국의 수도이며 한강이 도시를 가로질러 흐릅니다.",
    "김치는 배추와 고춧가루로 만드는 한국의 전통 발효 음식입니다.",
    "富士山は日本で一番高い山で、標高は3776メートルです。",
    "长城是中国古代修建的防御工事，全长两万多公里。",  # noqa: RUF001
]
QUERIES = [  # (query, the document it asks for)
    ("When was the Eiffel Tower built?", 0),
    ("Which fruit has a lot of potassium?", 1),
    ("Quand la tour Eiffel a-t-elle été construite ?", 2),
    ("Wohin fließt der Rhein?", 3),
    ("¿Dónde se cultiva el café de Colombia?", 4),
    ("대한민국의 수도는 어디입니까?", 5),
    ("김치는 무엇으로 만듭니까?", 6),
    ("日本で一番高い山はどこですか？", 7),  # noqa: RUF001
    ("长城有多长？", 8),  # noqa: RUF001
]
# nomic-embed's task prefixes (its model card): queries and documents embed differently
TEXTS = [f"search_document: {d}" for d in DOCUMENTS] + [f"search_query: {q}" for q, _ in QUERIES]


@pytest.fixture(scope="module")
def nomic_path() -> Path:
    return trained_model_path(NOMIC)


@pytest.fixture(scope="module")
def gateway(nomic_path: Path) -> Iterator[Gateway]:
    with Gateway(
        replicas=1,
        port=free_port(),
        server_args=(*NO_DRAIN, "--model", f"{NOMIC}={nomic_path}"),
        smg_args=(*NO_WARM_UP, *QUICK_EXIT),
        threads=TEST_THREADS,
    ) as gw:
        yield gw


def _ranks(vectors: np.ndarray) -> list[int]:
    """The best document of each query (vectors: TEXTS' rows, L2-unit)."""
    scores = vectors[len(DOCUMENTS) :] @ vectors[: len(DOCUMENTS)].T
    return [int(i) for i in scores.argmax(axis=1)]


async def _gateway_vectors(sdk: Any, model: str, texts: list[str]) -> np.ndarray:
    """One /v1/embeddings call per text (SMG joins a list into one text), in order."""
    rows = []
    for text in texts:
        answer = await sdk.embeddings.create(model=model, input=text)
        assert len(answer.data) == 1
        rows.append(answer.data[0].embedding)
    return np.array(rows, dtype=np.float32)


async def test_the_gateway_serves_embeddings_only(gateway: Gateway) -> None:
    assert gateway.model == NOMIC
    assert gateway.checked is not None and gateway.checked.embeddings_only


async def test_retrieval_ranks_the_right_document_first_through_both_doors(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """Every query's best document is its own (Korean, Japanese and Chinese included), through
    v1 (one Embed call of all 18 texts) and through the gateway (a call per text)."""
    want = [doc for _, doc in QUERIES]
    result = await direct.embed(TEXTS)
    v1 = np.array([e.vector for e in result.embeddings], dtype=np.float32)
    assert v1.shape == (18, 768)
    assert _ranks(v1) == want
    assert _ranks(await _gateway_vectors(sdk, gateway.model, TEXTS)) == want


async def test_both_doors_give_identical_vectors(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """Text by text, v1 Embed and /v1/embeddings give the same float32 vector (bit for bit)
    and the same token count: [CLS], BERT's WordPiece ids, [SEP] in both."""
    for text in TEXTS[5:7] + TEXTS[14:16] + TEXTS[:1]:
        answer = await sdk.embeddings.create(model=gateway.model, input=text)
        want = (await direct.embed(text)).embeddings[0]
        got = np.array(answer.data[0].embedding, dtype=np.float32)
        assert np.array_equal(got, np.array(want.vector, dtype=np.float32)), text
        ids = await direct.tokenize(text, add_special=True)
        assert (ids[0], ids[-1]) == (101, 102)
        assert answer.usage.prompt_tokens == want.prompt_tokens == len(ids)


async def test_korean_gets_berts_tokens_not_llama_cpps(
    direct: AsyncClient, nomic_path: Path
) -> None:
    """v1 Tokenize gives BERT's ids for Korean (every jamo); llama.cpp's tokenizer keeps the
    leading consonant of each syllable, and its ids give the query another vector."""
    query = TEXTS[len(DOCUMENTS) + 5]
    ids = await direct.tokenize(query, add_special=True)
    llama = LlamaVocab(nomic_path)
    try:
        llama_ids = llama.tokenize(query, add_special=True, parse_special=False)
    finally:
        llama.close()
    assert ids[:6] == llama_ids[:6]  # [CLS] search _ query : (ASCII agrees)
    assert (len(ids), len(llama_ids)) == (28, 16)
    ours, theirs = (await direct.embed([ids, llama_ids])).embeddings
    cosine = float(np.dot(ours.vector, theirs.vector))
    assert cosine < 0.9


async def test_an_array_input_is_one_joined_text_through_the_gateway(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """SMG 1.13 joins a list input with spaces into one text: one vector, that of the joined
    text (v1 Embed takes the list as separate inputs)."""
    pair = TEXTS[5:7]
    answer = await sdk.embeddings.create(model=gateway.model, input=pair)
    assert len(answer.data) == 1
    joined = (await direct.embed(" ".join(pair))).embeddings[0]
    got = np.array(answer.data[0].embedding, dtype=np.float32)
    assert np.array_equal(got, np.array(joined.vector, dtype=np.float32))


async def test_matryoshka_dimensions(sdk: Any, direct: AsyncClient, gateway: Gateway) -> None:
    """v1 `dimensions` keeps the first N components of the raw vector, then normalizes (how
    nomic-embed-text-v1.5's Matryoshka dimensions are used); the engine protocol has no such
    field, so /v1/embeddings answers the full 768 whatever `dimensions` says."""
    text = TEXTS[0]
    full = np.array((await direct.embed(text, normalize=False)).embeddings[0].vector)
    short = np.array((await direct.embed(text, dimensions=256)).embeddings[0].vector)
    assert short.shape == (256,)
    assert np.allclose(short, full[:256] / np.linalg.norm(full[:256]), atol=1e-6)
    answer = await sdk.embeddings.create(model=gateway.model, input=text, dimensions=256)
    assert len(answer.data[0].embedding) == 768


def test_the_cli_embeds(gateway: Gateway) -> None:
    """`llama-grpc embed --dimensions 64` on the replica: one 64-dimensional unit vector."""
    cli = Path(sys.executable).with_name("llama-grpc")
    done = subprocess.run(
        [str(cli), "embed", "--target", gateway.cluster.members[0].target, "--dimensions",
         "64", TEXTS[5]],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout)
    (vector,) = result["embeddings"][0]["vectors"]
    assert len(vector) == 64
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5


async def test_generation_is_refused_naming_the_kind(
    sdk: Any, direct: AsyncClient, gateway: Gateway
) -> None:
    """A chat through the gateway fails in SMG's template step with the exported template's
    message, a completion with the worker's FAILED_PRECONDITION; v1 Generate says the same."""
    kind = "is an encoder-only embedding model (nomic-bert)"
    with pytest.raises(openai.BadRequestError) as chat:
        await sdk.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert f"{NOMIC} {kind}: it cannot chat or generate text; use /v1/embeddings" in str(chat.value)
    with pytest.raises(openai.BadRequestError) as completion:
        await sdk.completions.create(model=gateway.model, prompt="Hi", max_tokens=4)
    assert f"model '{NOMIC}' {kind}: it cannot generate text; call Embed" in str(completion.value)
    with pytest.raises(FailedPreconditionError) as generate:
        await direct.generate("Hi", max_tokens=4)
    assert f"model '{NOMIC}' {kind}" in str(generate.value)
