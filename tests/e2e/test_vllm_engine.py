"""The vLLM engine protocol (vllm.grpc.engine.VllmEngine) against the real server and model:
text and token ids, streaming, stops, constraints, n samples, the prefix cache, Abort, and bad
input answered with a status while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, Delta
from llama_grpc_server.core.constrained.regex_grammar import choice_to_gbnf, regex_to_gbnf
from llama_grpc_server.core.kv.events import BLOCK_SIZE, chain
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from tests.support.regex_grammar import REGEX_CASES
from tests.support.servicer_fake import details
from tests.support.vllm_engine_fake import announces, is_cleared, kv_until, stored_blocks

from ..conftest import PERSON_SCHEMA, check_person

PROMPT = "The three primary colors are"
# a structural tag format no GBNF grammar is written for (xgrammar's Qwen3-coder parameters)
QWEN_XML = '{"format": {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}}}'


@pytest_asyncio.fixture(loop_scope="session")
async def vllm(server: RunningServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield vpb_grpc.VllmEngineStub(channel)


def generate(*, text: str = "", ids: list[int] | None = None, stream: bool = False,
             request_id: str = "", **params: Any) -> vpb.GenerateRequest:  # fmt: skip
    request = vpb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        sampling_params=vpb.SamplingParams(**params),
        stream=stream,
    )
    if ids is not None:
        request.tokenized.input_ids.extend(ids)
    else:
        request.text = text
    return request


async def run(vllm: Any, request: vpb.GenerateRequest) -> tuple[list[Any], list[Any]]:
    """(chunks, completes) of one call."""
    messages = [m async for m in vllm.Generate(request)]
    chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
    completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
    return chunks, completes


async def v1_greedy_ids(client: AsyncClient, ids: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    events = client.generate_tokens(ids, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for event in events:
        if isinstance(event, Delta):
            out += event.token_ids
    return out


async def test_same_greedy_ids_as_v1_for_ids_and_text(vllm: Any, client: AsyncClient) -> None:
    """Token ids in, the same greedy ids out as v1 GenerateTokens; the text input tokenizes to
    the same prompt (BOS added) and gives the same ids; the stream adds up to the unary call."""
    ids = await client.tokenize(PROMPT)
    expected = await v1_greedy_ids(client, ids, 16)
    params = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    _, [by_ids] = await run(vllm, generate(ids=ids, **params))
    _, [by_text] = await run(vllm, generate(text=PROMPT, **params))
    chunks, [streamed] = await run(vllm, generate(ids=ids, stream=True, **params))
    assert list(by_ids.output_ids) == list(by_text.output_ids) == expected
    assert (by_ids.finish_reason, by_ids.prompt_tokens, by_ids.completion_tokens) == (
        "length", len(ids), 16
    )  # fmt: skip
    assert len(chunks) > 1 and [t for c in chunks for t in c.token_ids] == expected
    assert sum(c.completion_tokens for c in chunks) == 16
    assert list(streamed.output_ids) == expected


async def test_stop_string_is_reported(vllm: Any, client: AsyncClient) -> None:
    """A stop string taken from the greedy text ends the request with "stop" and names it."""
    ids = await client.tokenize(PROMPT)
    text = await client.detokenize(await v1_greedy_ids(client, ids, 24))
    words = [w for w in text.split() if len(w) > 3]
    stop = words[1]
    _, [done] = await run(vllm, generate(ids=ids, temperature=0.0, max_tokens=24, stop=[stop]))
    assert (done.finish_reason, done.matched_stop_str) == ("stop", stop)
    assert done.completion_tokens < 24
    generated = await client.detokenize(list(done.output_ids))
    assert stop in generated and generated.index(stop) == text.index(stop)


async def test_json_schema_output_parses(vllm: Any, client: AsyncClient) -> None:
    request = generate(
        text="Describe a person as JSON:",
        temperature=0.0,
        max_tokens=120,
        json_schema=json.dumps(PERSON_SCHEMA),
    )
    _, [done] = await run(vllm, request)
    assert done.finish_reason == "stop"
    text = await _text(client, done)
    check_person(json.loads(text))


async def test_regex_and_choice_constrain_the_output(
    vllm: Any, client: AsyncClient, server: RunningServer
) -> None:
    """A regex's output fully matches it; a choice's is one of the choices. Every pattern of
    the compiler's table compiles in llama.cpp."""
    engine = server.pool.default_engine()
    assert engine is not None
    for pattern, _ in REGEX_CASES:
        engine.check_grammar(regex_to_gbnf(pattern), "root")
    engine.check_grammar(choice_to_gbnf(["a", 'b"c', "é"]), "root")
    pattern = r"\(?[0-9]{3}\) [0-9]{3}-[0-9]{4}"
    _, [done] = await run(
        vllm, generate(text="Call me at", temperature=0.0, max_tokens=30, regex=pattern)
    )
    assert re.fullmatch(pattern, await _text(client, done)), done
    choices = ["red", "green", "blue"]
    _, [done] = await run(
        vllm,
        generate(
            text=PROMPT, temperature=0.0, max_tokens=8, choice=vpb.ChoiceConstraint(choices=choices)
        ),
    )
    assert await _text(client, done) in choices


async def test_structural_tag_is_free_until_its_trigger(vllm: Any, client: AsyncClient) -> None:
    """A triggered tag (a lazy grammar): greedy writes " red, ..." as it would unconstrained,
    then the trigger "blue" enters the tag, whose content obeys its schema; stop_after_first
    ends the output after it (EOS: finish "stop")."""
    shade = {
        "type": "object",
        "properties": {"shade": {"enum": ["navy", "sky"]}},
        "required": ["shade"],
    }
    tag = {"begin": "blue", "content": {"type": "json_schema", "json_schema": shade}, "end": "."}
    structural_tag = {"type": "structural_tag", "format": {"type": "triggered_tags",
        "triggers": ["blue"], "tags": [tag], "stop_after_first": True}}  # fmt: skip
    request = generate(
        text=PROMPT, temperature=0.0, max_tokens=24, structural_tag=json.dumps(structural_tag)
    )
    _, [done] = await run(vllm, request)
    assert done.finish_reason == "stop"
    # the free text is greedy's (" red, " alone; " red, red, and " after other modules' calls
    # left the prompt cached: KV computed in another batch shape can flip a near tie)
    text = await _text(client, done)
    found = re.fullmatch(r"(.*?)blue(\{.*\})\.", text, re.S)
    assert found is not None, text
    assert "blue" not in found.group(1) and found.group(1).startswith(" red"), text
    assert json.loads(found.group(2)) in ({"shade": "navy"}, {"shade": "sky"}), text


async def test_n_samples_share_the_prompt_kv(vllm: Any, client: AsyncClient) -> None:
    """n = 2: two completes with their index, distinct seeds; the prompt is computed once (one
    sample reports it cached from the other)."""
    salt = f"{uuid.uuid4().hex} "
    prompt = salt + PROMPT * 20
    ids = await client.tokenize(prompt)
    # an earlier prompt from any module on this server can share the BOS and the salt's first
    # hex tokens by chance (CI saw 2 cached), never the whole salt
    fresh = len(await client.tokenize(salt))
    request = generate(ids=ids, temperature=1.0, seed=5, n=2, max_tokens=8, stream=True)
    chunks, completes = await run(vllm, request)
    assert sorted(c.index for c in completes) == [0, 1]
    assert {c.index for c in chunks} == {0, 1}
    low, high = sorted(c.cached_tokens for c in completes)
    assert low < fresh and high == len(ids) - 1  # one computed it, one copied
    assert all(c.completion_tokens == len(c.output_ids) > 0 for c in completes)


async def test_repeated_prefix_reports_cached_tokens(vllm: Any, client: AsyncClient) -> None:
    salt = f"{uuid.uuid4().hex} "
    prompt = salt + PROMPT * 30
    fresh = len(await client.tokenize(salt))  # BOS and salt: at most a chance prefix is cached
    params = {"temperature": 0.0, "max_tokens": 4, "stream": True}
    _, [first] = await run(vllm, generate(text=prompt, **params))
    chunks, [second] = await run(vllm, generate(text=prompt + " and", **params))
    assert first.cached_tokens < fresh
    assert second.cached_tokens >= first.prompt_tokens - 1 > 100
    assert all(c.cached_tokens == second.cached_tokens for c in chunks)


async def test_logprobs(vllm: Any) -> None:
    _, [done] = await run(vllm, generate(text=PROMPT, temperature=0.0, max_tokens=6, logprobs=2))
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids)
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert [len(t.values) for t in lp.top_logprobs] == [2] * 6
    assert [t.token_ids[0] for t in lp.top_logprobs] == list(done.output_ids)  # greedy: top-1


async def test_min_tokens_holds_back_stop_tokens(vllm: Any) -> None:
    """The greedy first token as a stop token ends the request at once; with min_tokens it
    cannot be sampled before min_tokens tokens (the sampler suppresses it), then may stop it."""
    _, [free] = await run(vllm, generate(text=PROMPT, temperature=0.0, max_tokens=3))
    first = free.output_ids[0]
    params = {"temperature": 0.0, "max_tokens": 12, "stop_token_ids": [first]}
    _, [stopped] = await run(vllm, generate(text=PROMPT, **params))
    assert (stopped.finish_reason, stopped.matched_token_id, stopped.completion_tokens) == (
        "stop", first, 0
    )  # fmt: skip
    _, [held] = await run(vllm, generate(text=PROMPT, min_tokens=4, **params))
    assert held.completion_tokens >= 4
    assert first not in held.output_ids[:4]
    # the sampling chain too: a bias that makes the stop token near certain cannot beat it
    sampled = {"temperature": 1.0, "seed": 9, "logit_bias": {first: 50.0}, "max_tokens": 12}
    _, [biased] = await run(vllm, generate(text=PROMPT, stop_token_ids=[first], **sampled))
    assert (biased.finish_reason, biased.completion_tokens) == ("stop", 0)
    _, [held] = await run(
        vllm, generate(text=PROMPT, stop_token_ids=[first], min_tokens=4, **sampled)
    )
    assert held.completion_tokens >= 4 and first not in held.output_ids[:4]


async def test_abort_mid_stream_frees_the_slot(vllm: Any, client: AsyncClient) -> None:
    request = generate(text=PROMPT, temperature=0.0, max_tokens=400, ignore_eos=True, stream=True)
    call = vllm.Generate(request)
    first = await call.read()
    assert first.WhichOneof("response") == "chunk"
    await vllm.Abort(vpb.AbortRequest(request_ids=[request.request_id]))
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        rest.append(message)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 400
    for _ in range(50):
        if (await client.stats()).active_slots == 0:
            break
        await asyncio.sleep(0.05)
    assert (await client.stats()).active_slots == 0
    await vllm.Abort(vpb.AbortRequest(request_ids=[request.request_id]))  # idempotent


async def test_bad_input_gets_a_status_and_the_server_keeps_serving(
    vllm: Any, client: AsyncClient
) -> None:
    cases = [
        (generate(text=PROMPT, structural_tag=QWEN_XML), "sampling_params.structural_tag"),
        (generate(text=PROMPT, regex="(a)\\1"), "sampling_params.regex"),
        (generate(ids=[2, 10**7]), "tokenized.input_ids[1]"),
        (generate(text=PROMPT, json_schema="{not json"), "sampling_params.json_schema"),
        (generate(text=PROMPT, prompt_logprobs=1), "sampling_params.prompt_logprobs"),
        (generate(text="x " * 5000), "text"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run(vllm, request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert details(caught.value)["BadRequest"].field_violations[0].field == field
    slow = generate(text=PROMPT, max_tokens=200, ignore_eos=True, stream=True)
    call = vllm.Generate(slow)
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run(vllm, generate(text=PROMPT, request_id=slow.request_id))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    _, [done] = await run(vllm, generate(text=PROMPT, temperature=0.0, max_tokens=4))
    assert done.finish_reason == "length"
    health = await vllm.HealthCheck(vpb.HealthCheckRequest())
    assert health.healthy


async def test_model_info_is_the_real_model(vllm: Any, server: RunningServer) -> None:
    engine = server.pool.default_engine()
    assert engine is not None
    info = await vllm.GetModelInfo(vpb.GetModelInfoRequest())
    model = engine.model_info
    assert (info.vocab_size, info.max_context_length) == (model.n_vocab, model.n_ctx)
    assert list(info.eos_token_ids) == list(model.eog_token_ids)
    assert info.bos_token_id == model.bos_token_id


async def _text(client: AsyncClient, done: Any) -> str:
    """The generated text of a complete (v1 Detokenize of its ids)."""
    return await client.detokenize(list(done.output_ids))


async def test_kv_events_announce_a_prompts_blocks_and_a_clear(
    vllm: Any, client: AsyncClient
) -> None:
    """SubscribeKvEvents with the real model: after a generation, every whole 16-token block
    of its prompt is announced on the device tier with exactly the prompt's ids, chained
    block to block; FlushCache is announced as a clear."""
    stream = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    await kv_until(stream, lambda b: True)  # the snapshot
    text = f"Request {uuid.uuid4().hex}: list the planets of the solar system in order, " * 2
    ids = await client.tokenize(text)
    whole = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert whole >= 3 * BLOCK_SIZE
    await run(vllm, generate(ids=ids, temperature=0.0, max_tokens=4, ignore_eos=True))
    batches = await kv_until(stream, announces(ids[whole - BLOCK_SIZE : whole]))
    sent = {block.block_hash: (stored, block) for stored, block in stored_blocks(batches)}
    parent = None
    for block in chain("", ids[:whole]):
        stored, got = sent[block.hash]
        assert list(got.token_ids) == list(block.tokens)
        assert stored.tier == cpb.KV_CACHE_TIER_DEVICE
        if stored.blocks[0].block_hash == block.hash:  # the first block of its event
            assert stored.parent_block_hash == parent if parent is not None else (
                not stored.HasField("parent_block_hash")
            )  # fmt: skip
        parent = block.hash
    await vllm.FlushCache(cpb.FlushCacheRequest())
    await kv_until(stream, is_cleared)
    stream.cancel()
