"""Resumable streams through gRPC with real models (docs/api.md#resumable-streams): a stream cut
after N tokens and sent again with params.resume goes on from position N, and the answer put
together is the undisturbed one, every position once: greedy and seeded sampling (the draw of
position i is a function of the seed and i), StreamGenerate and GenerateTokens, a JSON-schema
constraint cut mid-JSON, a named tool call cut inside its arguments; a bad resume is
INVALID_ARGUMENT naming the field. The tiny counting model for the token flow, the embedded
Gemma 3 where the words and the sampling matter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import pytest_asyncio

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_testkit.models import TINY_N_VOCAB, counting
from tests.support.servicer_fake import details
from tests.support.trained import QWEN_05B, trained_model_path

from ..conftest import PERSON_SCHEMA, check_person
from .conftest import loaded_server, settings

PROMPT = "The three primary colors are"
N = 40  # tokens per answer
CUTS = (0, 1, 13, 39, 40)


@pytest_asyncio.fixture(loop_scope="session")
async def stub(server: RunningServer) -> AsyncIterator[pb_grpc.LlmServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.LlmServiceStub(channel)


@pytest_asyncio.fixture(loop_scope="session")
async def tiny_stub(tiny_server: RunningServer) -> AsyncIterator[pb_grpc.LlmServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tiny_server.port}") as channel:
        yield pb_grpc.LlmServiceStub(channel)


@dataclass
class Answer:
    """A stream's deltas as (index, token ids, text) and its done message."""

    deltas: list[tuple[int, list[int], str]]
    done: Any

    @property
    def tokens(self) -> list[int]:
        return [t for _, ids, _ in self.deltas for t in ids]

    @property
    def text(self) -> str:
        return "".join(text for _, _, text in self.deltas)

    @property
    def positions(self) -> list[int]:
        return [index + i for index, ids, _ in self.deltas for i in range(len(ids))]

    def boundary(self, near: int) -> int:
        """The first position at or after `near` where a delta starts (a slow reader's deltas
        come merged: a cut stream ends after a whole delta), or the answer's end."""
        return next((i for i, ids, _ in self.deltas if ids and i >= near), len(self.tokens))

    def upto(self, cut: int) -> Answer:
        """What a caller whose stream was cut after `cut` tokens has: the deltas with tokens
        before it (the cuts below are where deltas end)."""
        kept = [d for d in self.deltas if d[1] and d[0] < cut]
        assert sum(len(ids) for _, ids, _ in kept) == cut, "not a delta's end"
        return Answer(kept, None)


async def stream(stub: Any, request: Any, method: str = "StreamGenerate") -> Answer:
    deltas, done = [], None
    async for message in getattr(stub, method)(request):
        if message.WhichOneof("event") == "delta":
            d = message.delta
            deltas.append((d.index, list(d.token_ids), d.text))
        else:
            done = message.done
    assert done is not None
    return Answer(deltas, done)


def params(
    *, max_tokens: int = N, resume: Sequence[int] | None = None, **sampling: Any
) -> pb.GenerationParams:
    out = pb.GenerationParams(
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        sampling=pb.SamplingParams(**sampling),
    )
    if resume is not None:
        out.resume.CopyFrom(pb.Resume(token_ids=resume))
    return out


def request(method: str, prompt: Any, p: pb.GenerationParams) -> Any:
    if method == "GenerateTokens":
        return pb.GenerateTokensRequest(token_ids=prompt, params=p)
    return pb.StreamGenerateRequest(prompt=prompt, params=p)


def check_resumed(whole: Answer, cut: int, resumed: Answer) -> None:
    """The caller's part and the resumed stream make the undisturbed answer: tokens, text,
    every position once, the same finish and the whole answer's usage."""
    had = whole.upto(cut)
    assert resumed.deltas[0][0] == cut if resumed.deltas else cut == len(whole.tokens)
    assert had.positions + resumed.positions == list(range(len(whole.tokens)))
    assert had.tokens + resumed.tokens == whole.tokens
    assert had.text + resumed.text == whole.text
    assert resumed.done.finish_reason == whole.done.finish_reason
    assert resumed.done.usage.completion_tokens == whole.done.usage.completion_tokens
    assert resumed.done.usage.prompt_tokens == whole.done.usage.prompt_tokens


# -- the token flow: the tiny counting model ------------------------------------------------------


@pytest.mark.parametrize("method", ["StreamGenerate", "GenerateTokens"])
async def test_greedy_resumed_at_any_cut_is_the_undisturbed_answer(
    tiny_stub: Any, method: str
) -> None:
    """The counting model's 40 greedy tokens cut at 0, 1, 13, 39 and 40, each resumed: the
    deltas start at the cut's index and the answer put together is the undisturbed one; a cut
    at 40 finishes at once (MAX_TOKENS, nothing computed)."""
    prompt: Any = [2, 100] if method == "GenerateTokens" else "count"
    whole = await stream(tiny_stub, request(method, prompt, params()), method)
    if method == "GenerateTokens":
        assert whole.tokens == counting(100, N)
    assert whole.positions == list(range(N))
    for near in CUTS:
        cut = whole.boundary(near)
        p = params(resume=whole.tokens[:cut])
        resumed = await stream(tiny_stub, request(method, prompt, p), method)
        check_resumed(whole, cut, resumed)
    assert whole.done.finish_reason == pb.FINISH_REASON_MAX_TOKENS


async def test_a_resume_elsewhere_recomputes_the_prefix(tiny_stub: Any) -> None:
    """On the replica that served the cut answer its KV serves the resume (usage's cached
    tokens count the prompt's only); without it (cache_prompt false: as on a replica that never
    saw it) the prompt and the resumed tokens are prefilled, and the answer goes on the same."""
    method = "GenerateTokens"
    whole = await stream(tiny_stub, request(method, [2, 300], params()), method)
    cut = whole.boundary(17)
    cached = await stream(
        tiny_stub, request(method, [2, 300], params(resume=whole.tokens[:cut])), method
    )
    check_resumed(whole, cut, cached)
    assert cached.done.usage.cached_prompt_tokens == 2  # the prompt's, not the resumed tokens'
    p = params(resume=whole.tokens[:cut])
    p.cache_prompt = False
    resumed = await stream(tiny_stub, request(method, [2, 300], p), method)
    check_resumed(whole, cut, resumed)
    assert resumed.done.usage.cached_prompt_tokens == 0


@pytest.mark.parametrize(
    ("p", "field"),
    [
        (params(resume=[5, TINY_N_VOCAB]), "params.resume.token_ids[1]"),
        (params(max_tokens=3, resume=[5, 6, 7, 8]), "params.resume.token_ids"),
    ],
)
async def test_a_bad_resume_is_invalid_argument_naming_the_field(
    tiny_stub: Any, p: pb.GenerationParams, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await tiny_stub.Generate(pb.GenerateRequest(prompt="count", params=p))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)["BadRequest"].field_violations[0].field == field


# -- the words and the sampling: the embedded Gemma 3 ----------------------------------------------


SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 7},
}


@pytest.mark.parametrize("method", ["StreamGenerate", "GenerateTokens"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
async def test_gemma_resumed_is_the_undisturbed_answer(
    stub: Any, method: str, sampling: str
) -> None:
    """Greedy and seeded (temperature 0.8, seed 7): 40 tokens, cut at 7, 20 and 33, resumed."""
    prompt: Any = PROMPT
    if method == "GenerateTokens":
        prompt = (await stub.Tokenize(pb.TokenizeRequest(text=PROMPT))).token_ids
    whole = await stream(stub, request(method, prompt, params(**SAMPLINGS[sampling])), method)
    assert len(whole.tokens) == N
    for near in (7, 20, 33):
        cut = whole.boundary(near)
        p = params(resume=whole.tokens[:cut], **SAMPLINGS[sampling])
        check_resumed(whole, cut, await stream(stub, request(method, prompt, p), method))


async def test_the_same_seed_gives_the_same_answer_whatever_ran_before(stub: Any) -> None:
    """Seeded answers are a function of the seed and the positions: the same twice, and the
    same after another seeded request ran. Compared once the prompts are cached, so each run
    computes the same rows alone in its passes: a prompt prefilled whole, or a pass with other
    rows, changes llama.cpp's float summation order, which moves this model's near ties (greedy
    ones too: tests/model/test_batching.py). The concurrent case is the next test's, on the
    tiny model."""
    other = "The capital of France is"

    async def one(prompt: str, seed: int) -> list[int]:
        p = params(max_tokens=24, temperature=0.8, seed=seed)
        return (await stream(stub, request("StreamGenerate", prompt, p))).tokens

    for prompt, seed in ((PROMPT, 7), (other, 11)):  # the prompts cached
        await one(prompt, seed)
    a1, b1 = await one(PROMPT, 7), await one(other, 11)
    assert (await one(other, 11), await one(PROMPT, 7)) == (b1, a1)
    assert await one(PROMPT, 8) != a1  # the seed matters


async def test_seeded_answers_are_the_same_alone_and_interleaved(tiny_stub: Any) -> None:
    """Two seeded requests decoding in the same passes give what each gives alone: the draws
    depend on the seed and the position, not on what the engine sampled before or beside. The
    counting model at temperature 4 samples far from greedy (its margins of several nats make
    float summation order irrelevant)."""
    method = "GenerateTokens"

    async def one(prompt: list[int], seed: int) -> list[int]:
        p = params(max_tokens=24, temperature=4.0, seed=seed, top_k=0, top_p=1.0, min_p=0.0)
        return (await stream(tiny_stub, request(method, prompt, p), method)).tokens

    alone = [await one([2, 100], 7), await one([2, 600], 11)]
    assert alone[0] != counting(100, 24)  # sampled, not greedy
    assert list(await asyncio.gather(one([2, 100], 7), one([2, 600], 11))) == alone
    assert list(await asyncio.gather(one([2, 600], 11), one([2, 100], 7))) == alone[::-1]


@pytest.mark.parametrize("sampling", SAMPLINGS)
async def test_a_json_schema_answer_resumed_mid_json_is_the_same_json(
    stub: Any, sampling: str
) -> None:
    """A constrained answer cut inside its JSON and resumed: the grammar goes on from the
    resumed tokens, and the JSON is valid and the undisturbed one."""
    p = params(max_tokens=120, **SAMPLINGS[sampling])
    p.stopping.ignore_eos = False
    p.json_schema = json.dumps(PERSON_SCHEMA)
    whole = await stream(stub, request("StreamGenerate", "Describe a person as JSON:", p))
    check_person(json.loads(whole.text))
    cut = whole.boundary(len(whole.tokens) // 2)
    p.resume.CopyFrom(pb.Resume(token_ids=whole.tokens[:cut]))
    resumed = await stream(stub, request("StreamGenerate", "Describe a person as JSON:", p))
    check_resumed(whole, cut, resumed)
    check_person(json.loads(whole.upto(cut).text + resumed.text))


async def test_a_resumed_token_the_grammar_refuses_names_the_field(stub: Any) -> None:
    """A resume the constraint could never have produced is INVALID_ARGUMENT naming the token."""
    p = params(max_tokens=8, temperature=0.0)
    p.grammar.gbnf = 'root ::= "yes" | "no"'
    tokenized = await stub.Tokenize(pb.TokenizeRequest(text="yes The", add_special=False))
    p.resume.CopyFrom(pb.Resume(token_ids=tokenized.token_ids))  # "yes" then " The"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(pb.GenerateRequest(prompt="Is water wet?", params=p))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)["BadRequest"].field_violations[0].field == (
        f"params.resume.token_ids[{len(tokenized.token_ids) - 1}]"
    )


WEATHER = pb.Tool(
    name="get_weather",
    description="Get the current weather in a given city",
    parameters=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)


async def test_a_named_tool_call_resumed_inside_its_arguments_gives_the_same_call(
    stub: Any,
) -> None:
    """A call constrained by tool_choice, cut inside its arguments and resumed with the same
    x-request-id: the same call (id, name, arguments), TOOL_CALLS; streamed, the call's pieces
    before and after the seam make the call."""
    base = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[WEATHER],
        tool_choice=pb.ToolChoice(function="get_weather"),
        params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=64)),
    )
    metadata = (("x-request-id", "resume-tool-call"),)
    whole = await stub.Generate(base, metadata=metadata)
    assert whole.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    (call,) = whole.tool_calls
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    for cut in (len(whole.token_ids) // 2, len(whole.token_ids) - 2):
        resumed_request = pb.GenerateRequest()
        resumed_request.CopyFrom(base)
        resumed_request.params.resume.token_ids[:] = whole.token_ids[:cut]
        resumed = await stub.Generate(resumed_request, metadata=metadata)
        assert list(resumed.token_ids) == list(whole.token_ids[cut:])
        assert resumed.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        assert [(c.id, c.name, c.arguments) for c in resumed.tool_calls] == [
            (call.id, call.name, call.arguments)
        ]


# -- a model's own tool call, unconstrained: the trained Qwen 2.5 Coder 0.5B -----------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def qwen_port() -> AsyncIterator[int]:
    async with loaded_server(settings(str(trained_model_path(QWEN_05B)), n_parallel=2)) as running:
        yield running.port


async def test_a_free_tool_call_cut_inside_its_arguments_goes_on(qwen_port: int) -> None:
    """tests/e2e/test_tools.py's question: the model writes its call (bare JSON, parsed as it
    streams). Cut inside the call and resumed with the same x-request-id: the streamed pieces
    before and after the seam make the call, with the same id, and the turn ends TOOL_CALLS."""
    tokyo = [pb.ChatMessage(role="user", content="What's the weather like in Tokyo right now?")]
    base = pb.StreamGenerateRequest(
        messages=tokyo,
        tools=[WEATHER],
        params=pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=64)),
    )
    metadata = (("x-request-id", "resume-free-call"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{qwen_port}") as channel:
        stub = pb_grpc.LlmServiceStub(channel)

        async def call(resume: Sequence[int] | None) -> list[Any]:
            request = pb.StreamGenerateRequest()
            request.CopyFrom(base)
            if resume is not None:
                request.params.resume.token_ids[:] = resume
            return [m async for m in stub.StreamGenerate(request, metadata=metadata)]

        whole = await call(None)
        assert whole[-1].done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        deltas = [m.delta for m in whole[:-1]]
        tokens = [t for d in deltas for t in d.token_ids]
        expected = pieces_of(deltas)
        assert expected[1:] == ["get_weather", json.dumps({"city": "Tokyo"})]
        starts = [d.index for d in deltas if d.token_ids]
        for cut in (starts[len(starts) // 2], starts[-2]):
            had = [d for d in deltas if d.token_ids and d.index < cut]
            got = await call(tokens[:cut])
            assert got[-1].done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
            assert got[0].delta.index == cut
            assert pieces_of([*had, *(m.delta for m in got[:-1])]) == expected


def pieces_of(deltas: Sequence[Any]) -> list[str]:
    """The stream's call: its id, name and arguments, each joined from its pieces."""
    pieces = [p for d in deltas for p in d.tool_calls]
    assert {p.index for p in pieces} == {0}
    return [
        "".join(p.id for p in pieces),
        "".join(p.name for p in pieces),
        "".join(p.arguments for p in pieces),
    ]
