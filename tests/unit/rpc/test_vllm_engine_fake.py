"""VllmEngineServicer (the vLLM engine protocol) behind a real grpc.aio server on 127.0.0.1:0,
with the FakeEngine: every SamplingParams field mapped or refused, the response shapes, n > 1,
Abort, duplicate ids and the worker RPCs."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.core.kv.events import chain
from llama_grpc_server.core.requests.request import Constraint, OutputParams, SamplingParams
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.vllm.engine import VLLM_SERVICE_NAME
from llama_grpc_server.testing import BOS_ID, EOS_ID, FakeEngine, encode
from tests.support.servicer_fake import collect, details, read_all
from tests.support.vllm_engine_fake import announces, is_cleared, kv_until, stored_blocks

SETTINGS = Settings(
    scheduler=SchedulerSettings(default_max_tokens=64),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
)
TOKENIZER_ZIP = bytes(range(256)) * 10_000  # 2.56 MB: three chunks


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine, tokenizer_zip=lambda: TOKENIZER_ZIP) as run:
        assert await run.wait_loaded()
        yield run


@pytest.fixture
def vllm(channel: grpc.aio.Channel) -> Any:
    return vpb_grpc.VllmEngineStub(channel)


def generate(request_id: str = "r1", *, text: str = "", ids: list[int] | None = None,
             stream: bool = False, **params: Any) -> vpb.GenerateRequest:  # fmt: skip
    request = vpb.GenerateRequest(
        request_id=request_id, sampling_params=vpb.SamplingParams(**params), stream=stream
    )
    if ids is not None:
        request.tokenized.input_ids.extend(ids)
    else:
        request.text = text or "hello"
    return request


async def completes(vllm: Any, request: vpb.GenerateRequest) -> list[vpb.GenerateComplete]:
    messages = await collect(vllm.Generate(request))
    assert all(m.WhichOneof("response") == "complete" for m in messages)
    return [m.complete for m in messages]


# -- generation ------------------------------------------------------------------------------------


async def test_text_input_unary_completes_with_the_ids(vllm: Any, engine: FakeEngine) -> None:
    """Text is tokenized with BOS; one GenerateComplete carries every output id and counts;
    an end-of-generation stop names no stop token or string."""
    [done] = await completes(vllm, generate(text="hello"))
    assert list(done.output_ids) == encode("olleh")
    assert (done.finish_reason, done.index) == ("stop", 0)
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (6, 5, 0)
    assert done.WhichOneof("matched_stop") is None
    assert engine.submitted[0].prompt_tokens == (BOS_ID, *encode("hello"))
    assert engine.submitted[0].request_id == "r1"


async def test_tokenized_input_streams_chunks_then_the_totals(
    vllm: Any, engine: FakeEngine
) -> None:
    """Tokenized input starting with BOS is the prompt as given; each chunk carries its new ids
    (counted) and the prompt size; GenerateComplete repeats all ids; a repeated prompt reports
    its cache."""
    engine.token_delay_s = 0.05
    ids = [BOS_ID, *encode("ab")]
    messages = await collect(vllm.Generate(generate(ids=ids, stream=True)))
    chunks, done = [m.chunk for m in messages[:-1]], messages[-1].complete
    assert [list(c.token_ids) for c in chunks] == [encode("b"), encode("a")]
    assert [(c.prompt_tokens, c.completion_tokens, c.index) for c in chunks] == [(3, 1, 0)] * 2
    assert list(done.output_ids) == encode("ba") and done.completion_tokens == 2
    assert engine.submitted[0].prompt_tokens == tuple(ids)
    again = await collect(vllm.Generate(generate("r2", ids=ids, stream=True)))
    assert [m.chunk.cached_tokens for m in again[:-1]] == [2, 2]
    assert again[-1].complete.cached_tokens == 2


async def test_tokenized_input_without_bos_gets_the_models_bos(
    vllm: Any, engine: FakeEngine
) -> None:
    """SMG tokenizes completions without special tokens: the model file's BOS is put in front
    (it asks for one: add_bos), counted in prompt_tokens."""
    [done] = await completes(vllm, generate(ids=encode("ab")))
    assert engine.submitted[0].prompt_tokens == (BOS_ID, *encode("ab"))
    assert done.prompt_tokens == 3


async def test_stop_string_stop_token_and_length(vllm: Any) -> None:
    """A stop string and a stop token end with "stop" and say which; max_tokens with
    "length". Output ids are the generated tokens (the stop token is not one)."""
    [done] = await completes(vllm, generate(text="hello", stop=["ll"]))
    assert (done.finish_reason, done.matched_stop_str) == ("stop", "ll")
    assert list(done.output_ids) == encode("oll")  # the ids that made the text, stop included
    [stop_id] = encode("l")
    [done] = await completes(vllm, generate("r2", text="hello", stop_token_ids=[stop_id]))
    assert (done.finish_reason, done.matched_token_id) == ("stop", stop_id)
    assert list(done.output_ids) == encode("o")
    [done] = await completes(vllm, generate("r3", text="hello", max_tokens=2))
    assert (done.finish_reason, list(done.output_ids)) == ("length", encode("ol"))
    assert done.WhichOneof("matched_stop") is None


async def test_every_sampling_field_reaches_the_engine(vllm: Any, engine: FakeEngine) -> None:
    """Each honoured field as the scheduler request carries it."""
    [stop_id] = encode("z")
    await completes(
        vllm,
        generate(
            text="hello", temperature=0.3, top_p=0.9, top_k=7, min_p=0.1,
            frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2,
            max_tokens=9, min_tokens=2, stop=["x"], stop_token_ids=[stop_id], ignore_eos=True,
            seed=42, logit_bias={5: -1.5, 9: float("-inf")}, logprobs=3,
            include_stop_str_in_output=True, skip_special_tokens=True,
            spaces_between_special_tokens=True, grammar_from_first_token=True,
        ),
    )  # fmt: skip
    spec = engine.submitted[0]
    assert spec.sampling == SamplingParams(
        temperature=0.3, top_k=7, top_p=0.9, min_p=0.1, seed=42, repeat_penalty=1.2,
        frequency_penalty=0.5, presence_penalty=-0.5, penalty_last_n=512,
        logit_bias=((5, -1.5), (9, -math.inf)),
    )  # fmt: skip
    stopping = spec.stopping
    assert (stopping.max_tokens, stopping.min_tokens, stopping.stop) == (9, 2, ("x",))
    assert (stopping.stop_token_ids, stopping.ignore_eos) == (frozenset({stop_id}), True)
    assert not stopping.max_tokens_is_default
    assert spec.output == OutputParams(logprobs=True, top_logprobs=3)
    assert spec.constraint is None


async def test_unset_fields_take_the_server_defaults_and_vllm_zeros(
    vllm: Any, engine: FakeEngine
) -> None:
    """temperature and max_tokens unset are the server's; proto3 zeros keep vLLM's meaning:
    top_p and repetition_penalty 1 (off), top_k and min_p off."""
    await completes(vllm, generate(text="hello"))
    spec = engine.submitted[0]
    assert spec.sampling == SamplingParams(
        temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, penalty_last_n=512
    )
    assert (spec.stopping.max_tokens, spec.stopping.max_tokens_is_default) == (64, True)
    assert spec.output == OutputParams()


@pytest.mark.parametrize(
    ("params", "field", "gbnf"),
    [
        ({"json_schema": '{"type": "object"}'}, "json_schema", 'root ::= "{}"'),
        ({"json_object": True}, "json_object", 'root ::= "{}"'),
        ({"grammar": 'root ::= "yes"'}, "grammar", 'root ::= "yes"'),
        ({"regex": "a[0-9]+"}, "regex", 'root ::= "a" [0-9]+\n'),
        ({"choice": vpb.ChoiceConstraint(choices=["yes", "no"])}, "choice",
         'root ::= "yes" | "no"\n'),
    ],
)  # fmt: skip
async def test_constraints_become_one_grammar(
    vllm: Any, engine: FakeEngine, params: dict[str, Any], field: str, gbnf: str
) -> None:
    engine.script = lambda request: encode("{}")
    await completes(vllm, generate(text="hello", **params))
    constraint = engine.submitted[0].constraint
    assert constraint == Constraint(gbnf, "root", f"sampling_params.{field}")


async def test_truncate_prompt_tokens(vllm: Any, engine: FakeEngine) -> None:
    """k keeps the prompt's last k tokens (counted as truncated); -1 keeps what fits."""
    [done] = await completes(vllm, generate(text="hello", truncate_prompt_tokens=3))
    assert engine.submitted[0].prompt_tokens == tuple(encode("llo"))
    assert engine.submitted[0].num_truncated == 3
    assert done.prompt_tokens == 3
    await completes(vllm, generate("r2", text="hello", truncate_prompt_tokens=-1))
    assert engine.submitted[1].prompt_tokens == (BOS_ID, *encode("hello"))


LOGPROBS = (
    "logprobs must be between 0 and 20 (the top alternatives per token; -1, the whole "
    "vocabulary, is not supported), got {}"
)
OUT_OF_VOCAB = "token id {} is out of range: the vocabulary has 259 tokens"
NO_GRAMMAR = "the regex uses {}, which cannot be compiled to a grammar"
# (sampling params, the field under sampling_params., the message; None: not checked)
BAD = [
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs are not supported"),
    ({"structural_tag": "{}"}, "structural_tag",
     "the structural tag needs 'format' (or legacy 'structures')"),
    ({"structural_tag": '{"format": {"type": "qwen_xml_parameter", "json_schema": {}}}'},
     "structural_tag", "format: format type 'qwen_xml_parameter' is not supported"),
    ({"logprobs": -1}, "logprobs", LOGPROBS.format(-1)),
    ({"logprobs": 21}, "logprobs", LOGPROBS.format(21)),
    ({"n": 17}, "n", "n must be at most 16, got 17"),
    ({"temperature": -1.0}, "temperature", "temperature must be in [0, 100], got -1"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"min_p": 2.0}, "min_p", "min_p must be in [0, 1], got 2"),
    ({"frequency_penalty": 3.0}, "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got 3"),
    ({"presence_penalty": -3.0}, "presence_penalty", "presence_penalty must be in [-2, 2], got -3"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "repeat_penalty must be > 0, got -1"),
    ({"max_tokens": 0}, "max_tokens",
     "sampling_params.max_tokens must be at least 1 (leave it unset for the default)"),
    ({"max_tokens": 600}, "max_tokens", None),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens (5) must be at most max_tokens (4)"),
    ({"min_tokens": 600}, "min_tokens", "min_tokens (600) must be at most the context (512)"),
    ({"stop": ["a", ""]}, "stop[1]", "stop strings must not be empty"),
    ({"stop_token_ids": [1, 999]}, "stop_token_ids[1]",
     "token id 999 at index 1 is out of range: the vocabulary has 259 tokens"),
    ({"logit_bias": {999: 1.0}}, "logit_bias[999]", OUT_OF_VOCAB.format(999)),
    ({"logit_bias": {-4: 1.0}}, "logit_bias[-4]", OUT_OF_VOCAB.format(-4)),
    ({"logit_bias": {5: math.inf}}, "logit_bias[5]",
     "the bias of token 5 must be a finite number or -inf, got inf"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 (fit the context) or at least 1, got 0"),
    ({"regex": "a(?=b)"}, "regex", NO_GRAMMAR.format("a lookahead at position 1")),
    ({"choice": vpb.ChoiceConstraint(choices=[])}, "choice", "the choice list is empty"),
    ({"grammar": "nonsense"}, "grammar", "invalid grammar: expecting ::="),
    ({"json_schema": "[1]"}, "json_schema", "the schema must be a JSON object"),
    ({"json_schema": "  "}, "json_schema", "sampling_params.json_schema must not be empty"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "field", "message"), BAD)
async def test_refused_sampling_fields_are_named(
    vllm: Any, engine: FakeEngine, params: dict[str, Any], field: str, message: str | None
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await completes(vllm, generate(text="hello", **params))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = details(caught.value)["BadRequest"].field_violations
    assert violation.field == f"sampling_params.{field}"
    if message is not None:
        assert caught.value.details() == violation.description == message
    assert not engine.submitted


def _request_with(**fields: Any) -> vpb.GenerateRequest:
    request = generate(text="hello")
    for name, value in fields.items():
        if name == "clear":
            request.ClearField(value)
        elif name == "tokenized":
            request.tokenized.CopyFrom(value)
        elif isinstance(value, vpb.MultimodalInputs | vpb.KvTransferParams):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize(
    ("request_fields", "field", "message"),
    [
        ({"mm_inputs": vpb.MultimodalInputs(mm_hashes=["h"])}, "mm_inputs",
         "multimodal inputs are not supported: this worker serves a text model"),
        ({"kv_transfer_params": vpb.KvTransferParams(remote_port=1)}, "kv_transfer_params",
         "KV transfer (prefill/decode disaggregation) is not supported"),
        ({"kv_transfer_params_json": "{}"}, "kv_transfer_params_json",
         "KV transfer (prefill/decode disaggregation) is not supported"),
        ({"data_parallel_rank": 0}, "data_parallel_rank", "this worker has no data-parallel ranks"),
        ({"tokenized": vpb.TokenizedInput()}, "tokenized.input_ids",
         "tokenized.input_ids must not be empty"),
        ({"tokenized": vpb.TokenizedInput(input_ids=[5, 300])}, "tokenized.input_ids[1]",
         "token id 300 at index 1 is out of range: the vocabulary has 259 tokens"),
        ({"text": ""}, "text", "text must not be empty"),
        ({"clear": "input"}, "input", "set the prompt: tokenized.input_ids or text"),
        ({"request_id": "a\nb"}, "request_id",
         "request_id must be printable and at most 128 characters"),
    ],
)  # fmt: skip
async def test_refused_request_fields_are_named(
    vllm: Any, engine: FakeEngine, request_fields: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await completes(vllm, _request_with(**request_fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message
    [violation] = details(caught.value)["BadRequest"].field_violations
    assert violation.field == field
    assert not engine.submitted


async def test_a_prompt_that_fills_the_context_is_refused(vllm: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await completes(vllm, generate(ids=[5] * 512))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)["BadRequest"].field_violations[0].field == "tokenized.input_ids"


async def test_n_samples_run_in_parallel_with_their_index(vllm: Any, engine: FakeEngine) -> None:
    """n = 3: three scheduler requests of the same prompt, seeds seed + i, one complete per
    index; streamed chunks carry their index."""
    messages = await collect(vllm.Generate(generate(text="abc", n=3, seed=7, stream=True)))
    done = {
        m.complete.index: m.complete for m in messages if m.WhichOneof("response") == "complete"
    }
    assert sorted(done) == [0, 1, 2]
    assert all(list(d.output_ids) == encode("cba") for d in done.values())
    chunk_ids: dict[int, list[int]] = {}
    for m in messages:
        if m.WhichOneof("response") == "chunk":
            chunk_ids.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
    assert chunk_ids == {i: encode("cba") for i in range(3)}
    assert sorted((s.request_id, s.sampling.seed) for s in engine.submitted) == [
        ("r1[0]", 7), ("r1[1]", 8), ("r1[2]", 9)
    ]  # fmt: skip
    assert len({s.prompt_tokens for s in engine.submitted}) == 1


async def test_a_duplicate_in_flight_request_id_is_refused(vllm: Any, engine: FakeEngine) -> None:
    """A second call with an id in flight gets ALREADY_EXISTS naming request_id; the first
    goes on; once it is done the id may be used again."""
    engine.token_delay_s = 0.05
    first = vllm.Generate(generate("dup", text="x" * 20, stream=True))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await completes(vllm, generate("dup", text="hello"))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert details(caught.value)["BadRequest"].field_violations[0].field == "request_id"
    rest = [m async for m in read_all(first)]
    assert rest[-1].complete.finish_reason == "stop"
    engine.token_delay_s = 0.0
    [done] = await completes(vllm, generate("dup", text="hello"))
    assert done.finish_reason == "stop"


async def test_a_refused_generate_is_trailers_only(vllm: Any, engine: FakeEngine) -> None:
    """A Generate refused before its first message (a full queue, streamed or not) has no
    response headers before its status, so SMG may retry it on another worker; one that
    streams gets its headers with its first chunk (and is never retried after it)."""
    engine.max_queue = 0
    for stream in (False, True):
        call = vllm.Generate(generate(f"full-{stream}", ids=[BOS_ID, 5, 6], stream=stream))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(call)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await call.initial_metadata() == grpc.aio.Metadata()
    engine.max_queue = None
    call = vllm.Generate(generate("ok", ids=[BOS_ID, 5, 6], stream=True))
    assert (await call.read()).WhichOneof("response") == "chunk"
    assert "x-request-id" in dict(await call.initial_metadata())
    call.cancel()


async def test_abort_ends_the_stream_with_abort(vllm: Any, engine: FakeEngine) -> None:
    """Abort mid-stream: the engine request is cancelled and the call ends with a complete
    whose finish_reason is "abort", carrying what was generated; aborting again, or an
    unknown id, is harmless."""
    engine.token_delay_s = 0.05
    call = vllm.Generate(generate("victim", text="y" * 100, n=2, stream=True))
    first = await call.read()
    assert first.WhichOneof("response") == "chunk"
    await vllm.Abort(vpb.AbortRequest(request_ids=["victim", "unknown"]))
    rest = [m async for m in read_all(call)]
    done = [m.complete for m in [first, *rest] if m.WhichOneof("response") == "complete"]
    assert sorted(d.index for d in done) == [0, 1]
    assert all(d.finish_reason == "abort" for d in done)
    assert all(0 < d.completion_tokens < 100 for d in done)
    await asyncio.wait_for(engine.wait_for_cancel(), 5)
    await vllm.Abort(vpb.AbortRequest(request_ids=["victim"]))
    assert engine.stats().active_slots == 0


async def test_a_client_cancel_cancels_every_sample(vllm: Any, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.05
    call = vllm.Generate(generate("gone", text="z" * 100, n=2, stream=True))
    await call.read()
    call.cancel()
    for _ in range(100):
        if len(engine.cancelled) == 2:
            break
        await asyncio.sleep(0.02)
    assert sorted(engine.cancelled) == ["gone[0]", "gone[1]"]


# -- the worker's state ----------------------------------------------------------------------------


async def test_health_model_server_info_and_loads(vllm: Any, stub: Any, engine: FakeEngine) -> None:
    health = await vllm.HealthCheck(vpb.HealthCheckRequest())
    assert (health.healthy, health.message) == (True, "healthy")
    info = await vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert (info.model_path, info.served_model_name, info.is_generation) == (
        "/models/fake.gguf", "fake", True
    )  # fmt: skip
    assert (info.max_context_length, info.max_req_input_len, info.vocab_size) == (512, 511, 259)
    assert (list(info.eos_token_ids), info.bos_token_id) == ([EOS_ID], BOS_ID)
    assert info.default_sampling_params_json == (
        '{"max_tokens": 64, "min_p": 0.05, "repetition_penalty": 1.0, "temperature": 0.8, '
        '"top_k": 40, "top_p": 0.95}'
    )
    server_info = await vllm.GetServerInfo(vpb.GetServerInfoRequest())
    assert (server_info.server_type, server_info.max_num_seqs) == ("vllm-grpc", 4)
    assert (server_info.active_requests, server_info.is_paused) == (0, False)
    loads = await vllm.GetLoads(vpb.GetLoadsRequest())
    report = await anext(aiter(stub.WatchLoad(pb.WatchLoadRequest())))
    [load] = loads.loads
    assert loads.dp_rank_count == 1 and loads.version.startswith("llama-grpc")
    assert (load.num_running_reqs, load.num_waiting_reqs) == (
        report.requests_running, report.queue_depth
    )  # fmt: skip
    assert (load.num_used_tokens, load.max_total_num_tokens, load.max_running_requests) == (
        report.kv_cells_used, report.kv_cells_total, report.n_parallel
    )  # fmt: skip
    assert load.token_usage == 0.0  # nothing runs (report.kv_cache_usage counts kept prefixes)


async def test_an_unloaded_default_model_names_no_field_of_the_engine_protocol(
    vllm: Any, stub: Any
) -> None:
    """After v1's UnloadModel, the engine protocol's calls that need the resident model answer
    FAILED_PRECONDITION saying so, naming no field: its requests have no `model` (found by the
    fuzz test, which checks that every named field resolves in the request)."""
    await stub.UnloadModel(pb.UnloadModelRequest())
    for call, request in (
        (vllm.GetModelInfo, vpb.GetModelInfoRequest()),
        (vllm.FlushCache, cpb.FlushCacheRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(request)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not loaded" in (caught.value.details() or "")
        assert "BadRequest" not in details(caught.value)


async def test_token_usage_counts_running_requests_not_kept_prefixes(
    vllm: Any, stub: Any, engine: FakeEngine
) -> None:
    """GetLoads and the KV events' load records report as token usage the KV share running
    requests hold, as vLLM does: a prefix kept in an idle slot is reclaimable, and SMG leaves a
    worker out of routing at 0.8 of it. num_used_tokens still counts every cell in use."""
    await completes(vllm, generate("kept", text="y" * 200))
    [idle] = (await vllm.GetLoads(vpb.GetLoadsRequest())).loads
    assert idle.num_used_tokens > 200 and idle.token_usage == 0.0
    events = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    first = await kv_until(events, lambda b: b.HasField("load"))
    assert first[-1].load.token_usage == 0.0 and first[-1].load.num_used_tokens > 200
    engine.token_delay_s = 0.05
    running = vllm.Generate(generate("run", text="z" * 100, stream=True))
    await running.read()
    [busy] = (await vllm.GetLoads(vpb.GetLoadsRequest())).loads
    stats = await stub.GetStats(pb.GetStatsRequest())
    held = sum(s.cached_tokens for s in stats.slots if s.state != "idle")
    assert 100 <= busy.token_usage * busy.max_total_num_tokens <= held + 1
    seen = await kv_until(events, lambda b: b.HasField("load") and b.load.token_usage > 0)
    assert seen[-1].load.active_token_usage == seen[-1].load.token_usage
    running.cancel()
    events.cancel()


async def test_health_and_reflection_list_the_service(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE_NAME))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [response] = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in response.list_services_response.service}
    assert VLLM_SERVICE_NAME == "vllm.grpc.engine.VllmEngine" and VLLM_SERVICE_NAME in names


async def test_flush_cache_clears_the_prefix_cache(vllm: Any, engine: FakeEngine) -> None:
    await completes(vllm, generate(text="hello"))
    flushed = await vllm.FlushCache(cpb.FlushCacheRequest())
    assert flushed.success and "cleared_slots=1" in flushed.message
    [done] = await completes(vllm, generate("r2", text="hello"))
    assert done.cached_tokens == 0


async def test_get_tokenizer_streams_the_zip_with_its_sha256(vllm: Any) -> None:
    chunks = await collect(vllm.GetTokenizer(cpb.GetTokenizerRequest()))
    assert len(chunks) == 3
    assert b"".join(c.data for c in chunks) == TOKENIZER_ZIP
    assert [c.sha256 for c in chunks[:-1]] == ["", ""]
    assert chunks[-1].sha256 == hashlib.sha256(TOKENIZER_ZIP).hexdigest()


async def test_a_model_file_the_exporter_cannot_read_is_a_failed_precondition(
    engine: FakeEngine,
) -> None:
    """The default exporter reads the model file (the fake engine's does not exist): a clear
    FAILED_PRECONDITION with the reason, never INTERNAL."""
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(
                    vpb_grpc.VllmEngineStub(channel).GetTokenizer(cpb.GetTokenizerRequest())
                )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith("no tokenizer to export: ")
    assert "/models/fake.gguf" in caught.value.details()


async def test_unserved_rpcs_say_so(vllm: Any) -> None:
    calls = [
        (vllm.StartProfile(cpb.StartProfileRequest()), "profiling is not supported"),
        (vllm.StopProfile(cpb.StopProfileRequest()), "profiling is not supported"),
    ]
    for call, message in calls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.UNIMPLEMENTED, message
        )  # fmt: skip


async def test_health_follows_the_engine_state(
    vllm: Any, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Healthy while the engine takes requests (warming up included: requests wait for it, and
    the gateway fetches the tokenizer only from a healthy worker); not once it failed."""
    real = engine.stats
    cases = [
        ("starting", "", True, "healthy"),
        ("failed", "boom", False, "the engine is down: boom"),
        ("stopped", "", False, "the engine is down: stopped"),
    ]
    for state, error, healthy, message in cases:
        snapshot = dataclasses.replace(real(), engine_state=state, engine_error=error)
        monkeypatch.setattr(engine, "stats", lambda snapshot=snapshot: snapshot)
        answer = await vllm.HealthCheck(vpb.HealthCheckRequest())
        assert (answer.healthy, answer.message) == (healthy, message), state


async def test_an_exporter_refusal_is_failed_precondition(engine: FakeEngine) -> None:
    def refuse() -> bytes:
        raise ValueError("the vocabulary is not reproducible")

    async with start_server(SETTINGS, lambda: engine, tokenizer_zip=refuse) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = vpb_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub.GetTokenizer(cpb.GetTokenizerRequest()))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == "no tokenizer to export: the vocabulary is not reproducible"


# -- KV cache events -------------------------------------------------------------------------------


async def test_kv_events_announce_a_prompts_blocks_resume_and_clear(vllm: Any) -> None:
    """A new subscriber gets a one-chunk snapshot starting with a clear; a prompt's whole
    16-token blocks are then announced on the device tier with their exact ids, chained from no
    parent; a subscriber resuming at that sequence number gets no snapshot, only a load record;
    FlushCache is announced as a clear."""
    stream = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    [first] = await kv_until(stream, lambda b: True)
    assert (first.snapshot.index, first.snapshot.count) == (0, 1)
    assert first.events[0].WhichOneof("data") == "cleared"
    ids = [BOS_ID, *range(10, 50)]  # 41 tokens: two whole blocks
    await completes(vllm, generate(ids=ids, max_tokens=4, temperature=0.0))
    batches = await kv_until(stream, announces(ids[16:32]))
    got = {block.block_hash: (stored, block) for stored, block in stored_blocks(batches)}
    expected = chain("", ids[:32])
    for block in expected:
        stored, sent = got[block.hash]
        assert list(sent.token_ids) == list(block.tokens)
        assert (sent.block_size, sent.cache_level, stored.tier) == (16, 0, cpb.KV_CACHE_TIER_DEVICE)
        assert not stored.HasField("cache_salt")
    first_run = got[expected[0].hash][0]
    assert not first_run.HasField("parent_block_hash")
    assert batches[-1].load.max_running_requests == 4
    seq = batches[-1].sequence_number

    resumed = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=seq))
    [again] = await kv_until(resumed, lambda b: True)
    assert (again.sequence_number, again.load.load_only, len(again.events)) == (seq, True, 0)
    assert not again.HasField("snapshot")
    resumed.cancel()

    await vllm.FlushCache(cpb.FlushCacheRequest())
    cleared = await kv_until(stream, is_cleared)
    assert cleared[-1].sequence_number > seq
    stream.cancel()
