"""Client and AsyncClient against scripted servers: requests, results, streams and cancellation.

The sync client runs over grpc_testing's channel; the async client over a tiny grpc.aio server
on 127.0.0.1:0 whose servicer only replays a script (it tests the client, not the server).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import grpc_testing
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from llama_grpc import (
    AsyncClient,
    Client,
    Delta,
    Done,
    GenerateResult,
    InternalError,
    QueueFullError,
    ResourceExhaustedError,
    Stream,
    TokenizeResult,
    Usage,
)
from llama_grpc.types import ModelInfo, Stats, model_info_from_proto, stats_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from tests.support.client import OK, UnaryScript, channel, client, executor, rpc_method, unary

__all__ = ["channel", "client", "executor", "unary"]  # fixtures


def _done(**fields: Any) -> pb.GenerationDone:
    return pb.GenerationDone(
        finish_reason=pb.FINISH_REASON_MAX_TOKENS,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1),
        timings=pb.Timings(queue_ms=1.0, ttft_ms=2.0, prefill_ms=3.0, decode_ms=4.0, total_ms=5.0),
        seed=7,
        **fields,
    )


def _delta(text: str, *token_ids: int) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(delta=pb.GenerationDelta(text=text, token_ids=token_ids))


def _assert_cancelled(rpc: Any, executor: ThreadPoolExecutor) -> None:
    waiter: Future[None] = executor.submit(rpc.cancelled)
    try:
        waiter.result(timeout=2)
    finally:
        rpc.terminate((), OK, "")  # releases the waiter when the client did not cancel


# --- request building ----------------------------------------------------------------------


def test_generate_without_params_leaves_every_optional_field_unset(
    client: Client, unary: UnaryScript
) -> None:
    """A bare generate() sends no params message, so the server applies its own defaults."""
    _, request, _ = unary(lambda: client.generate("hi"), "Generate", pb.GenerateResponse())
    assert request.prompt == "hi"
    assert not request.HasField("params")
    assert not request.HasField("add_special")
    assert (request.model, request.session_id, request.cache_scope) == ("", "", "")


def test_generate_sets_only_given_fields_including_zero_values(
    client: Client, unary: UnaryScript
) -> None:
    """temperature=0 and seed=0 are sent as set; fields left out stay unset."""
    _, request, _ = unary(
        lambda: client.generate("hi", temperature=0.0, seed=0, max_tokens=5),
        "Generate",
        pb.GenerateResponse(),
    )
    sampling, stopping = request.params.sampling, request.params.stopping
    assert sampling.HasField("temperature")
    assert sampling.temperature == 0.0
    assert sampling.HasField("seed")
    assert sampling.seed == 0
    assert not sampling.HasField("top_k")
    assert not sampling.HasField("top_p")
    assert stopping.HasField("max_tokens")
    assert stopping.max_tokens == 5
    assert not stopping.HasField("time_limit_ms")
    assert not request.params.HasField("cache_prompt")


def test_generate_places_every_keyword_in_its_field(client: Client, unary: UnaryScript) -> None:
    """Each keyword parameter lands in the request field of the same name."""
    params: dict[str, Any] = {
        "temperature": 0.5,
        "top_k": 40,
        "top_p": 0.75,
        "min_p": 0.25,
        "seed": 11,
        "repeat_penalty": 1.5,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.25,
        "penalty_last_n": 64,
        "max_tokens": 9,
        "stop": ["\n", "END"],
        "stop_token_ids": [1, 2],
        "ignore_eos": True,
        "time_limit_ms": 500,
        "cache_prompt": False,
        "session_id": "s1",
        "cache_scope": "tenant",
        "model": "gemma",
        "add_special": False,
    }
    _, request, _ = unary(lambda: client.generate("p", **params), "Generate", pb.GenerateResponse())
    sampling, stopping = request.params.sampling, request.params.stopping
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (
        0.5,
        40,
        0.75,
        0.25,
    )
    assert (sampling.seed, sampling.repeat_penalty, sampling.penalty_last_n) == (11, 1.5, 64)
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, 0.25)
    assert list(stopping.stop) == ["\n", "END"]
    assert list(stopping.stop_token_ids) == [1, 2]
    assert (stopping.max_tokens, stopping.ignore_eos, stopping.time_limit_ms) == (9, True, 500)
    assert request.params.HasField("cache_prompt")
    assert request.params.cache_prompt is False
    assert (request.session_id, request.cache_scope, request.model) == ("s1", "tenant", "gemma")
    assert request.HasField("add_special")
    assert request.add_special is False


def test_a_single_stop_string_is_sent_as_one_stop(client: Client, unary: UnaryScript) -> None:
    """stop="\\n" means one stop string, not one per character."""
    _, request, _ = unary(
        lambda: client.generate("p", stop="ab"), "Generate", pb.GenerateResponse()
    )
    assert list(request.params.stopping.stop) == ["ab"]


def test_none_means_not_given(client: Client, unary: UnaryScript) -> None:
    """A keyword passed as None stays unset, like one left out."""
    _, request, _ = unary(
        lambda: client.generate("p", temperature=None, max_tokens=None),
        "Generate",
        pb.GenerateResponse(),
    )
    assert not request.HasField("params")


def test_unknown_keyword_raises_type_error(client: Client) -> None:
    """A misspelled parameter fails loudly before any RPC is made."""
    with pytest.raises(TypeError, match="max_token"):
        client.generate("p", max_token=5)  # type: ignore[call-arg]


def test_generate_tokens_rejects_add_special(client: Client) -> None:
    """GenerateTokens takes the ids as given, so add_special is not a parameter of it."""
    with pytest.raises(TypeError, match="add_special"):
        client.generate_tokens([1, 2], add_special=True)  # type: ignore[call-arg]


def test_client_and_call_metadata_are_both_sent(
    channel: grpc_testing.Channel, unary: UnaryScript
) -> None:
    """Per-call metadata is added to the client's default metadata."""
    with Client(channel=channel, metadata={"x-tenant": "a"}) as tenant_client:
        metadata, _, _ = unary(
            lambda: tenant_client.tokenize("t", metadata=[("x-request-id", "r1")]),
            "Tokenize",
            pb.TokenizeResponse(),
        )
    assert ("x-tenant", "a") in metadata
    assert ("x-request-id", "r1") in metadata


# --- unary results -------------------------------------------------------------------------


def test_generate_returns_a_frozen_result(client: Client, unary: UnaryScript) -> None:
    """Every field of GenerateResponse is carried into GenerateResult."""
    response = pb.GenerateResponse(
        text="Hello",
        token_ids=[5, 6],
        finish_reason=pb.FINISH_REASON_STOP_SEQUENCE,
        finish=pb.FinishInfo(reason=pb.FINISH_REASON_STOP_SEQUENCE, matched_stop="\n"),
        usage=pb.Usage(prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=3),
        timings=pb.Timings(queue_ms=1.5, ttft_ms=2.5, prefill_ms=3.5, decode_ms=4.5, total_ms=9),
        request_id="req-1",
        seed=42,
    )
    _, _, result = unary(lambda: client.generate("p"), "Generate", response)
    assert isinstance(result, GenerateResult)
    assert (result.text, result.token_ids, result.seed) == ("Hello", (5, 6), 42)
    assert (result.finish_reason, result.matched_stop, result.matched_token_id) == (
        "stop_sequence",
        "\n",
        None,
    )
    assert result.usage == Usage(4, 2, 3)
    assert (result.timings.ttft_ms, result.timings.total_ms) == (2.5, 9.0)
    assert result.request_id == "req-1"
    with pytest.raises(AttributeError):
        result.text = "changed"  # type: ignore[misc]


def test_finish_info_reports_the_matched_token(client: Client, unary: UnaryScript) -> None:
    """A stop-token finish reports the token id; no stop string is reported."""
    response = pb.GenerateResponse(
        finish_reason=pb.FINISH_REASON_STOP_TOKEN,
        finish=pb.FinishInfo(reason=pb.FINISH_REASON_STOP_TOKEN, matched_token_id=0),
    )
    _, _, result = unary(lambda: client.generate("p"), "Generate", response)
    assert (result.finish_reason, result.matched_token_id, result.matched_stop) == (
        "stop_token",
        0,
        None,
    )


def test_request_id_falls_back_to_initial_metadata(client: Client, unary: UnaryScript) -> None:
    """Without a request_id in the message, the x-request-id header is used."""
    _, _, result = unary(
        lambda: client.generate("p"),
        "Generate",
        pb.GenerateResponse(finish_reason=pb.FINISH_REASON_EOS),
        initial_metadata=(("x-request-id", "hdr-9"),),
    )
    assert result.request_id == "hdr-9"
    assert result.finish_reason == "eos"


def test_tokenize_sends_flags_and_returns_ids(client: Client, unary: UnaryScript) -> None:
    """tokenize() sends its flags and returns a plain list of ids."""
    _, request, ids = unary(
        lambda: client.tokenize("hi", add_special=False, parse_special=True),
        "Tokenize",
        pb.TokenizeResponse(token_ids=[2, 9]),
    )
    assert ids == [2, 9]
    assert request.HasField("add_special")
    assert request.add_special is False
    assert request.parse_special
    assert not request.return_pieces


def test_tokenize_with_pieces_returns_a_result(client: Client, unary: UnaryScript) -> None:
    """return_pieces=True returns ids together with their text pieces."""
    _, request, result = unary(
        lambda: client.tokenize("hi", return_pieces=True),
        "Tokenize",
        pb.TokenizeResponse(token_ids=[2, 9], pieces=["<bos>", "hi"]),
    )
    assert request.return_pieces
    assert request.add_special
    assert result == TokenizeResult((2, 9), ("<bos>", "hi"))


def test_detokenize_returns_text(client: Client, unary: UnaryScript) -> None:
    """detokenize() sends the ids and the render flag and returns the text."""
    _, request, text = unary(
        lambda: client.detokenize([2, 9], render_special=True),
        "Detokenize",
        pb.DetokenizeResponse(text="<bos>hi"),
    )
    assert text == "<bos>hi"
    assert list(request.token_ids) == [2, 9]
    assert request.render_special


def test_stats_copies_every_proto_field(client: Client, unary: UnaryScript) -> None:
    """Stats has exactly the fields of GetStatsResponse, slots included."""
    response = pb.GetStatsResponse(
        n_parallel=4,
        queue_depth=2,
        requests_finished=10,
        avg_batch_size=1.5,
        batch_strategy="decode_maximal",
        slots=[pb.SlotStats(slot_id=1, state="generating", request_id="r", cached_tokens=8)],
    )
    _, _, stats = unary(client.stats, "GetStats", response)
    assert isinstance(stats, Stats)
    assert set(Stats.__dataclass_fields__) == set(pb.GetStatsResponse.DESCRIPTOR.fields_by_name)
    assert (stats.n_parallel, stats.queue_depth, stats.requests_finished) == (4, 2, 10)
    assert stats.batch_strategy == "decode_maximal"
    assert stats.avg_batch_size == 1.5
    assert stats.slots[0].state == "generating"
    assert stats.slots[0].cached_tokens == 8


def test_model_info_maps_unset_optional_ids_to_none(client: Client, unary: UnaryScript) -> None:
    """An unset bos_token_id is None while a zero eos_token_id stays 0."""
    response = pb.GetModelInfoResponse(model_name="gemma", n_ctx=2048, eos_token_id=0)
    _, _, info = unary(client.model_info, "GetModelInfo", response)
    assert isinstance(info, ModelInfo)
    assert set(ModelInfo.__dataclass_fields__) == set(
        pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name
    )
    assert (info.model_name, info.n_ctx) == ("gemma", 2048)
    assert info.bos_token_id is None
    assert info.eos_token_id == 0


def test_conversions_are_pure_functions() -> None:
    """Stats and ModelInfo convert without a channel (used by the CLI's JSON output)."""
    stats = stats_from_proto(pb.GetStatsResponse())
    info = model_info_from_proto(pb.GetModelInfoResponse(eog_token_ids=[1, 106]))
    assert stats.slots == ()
    assert info.eog_token_ids == (1, 106)


# --- sync streams --------------------------------------------------------------------------


def test_stream_yields_deltas_then_done(client: Client, channel: grpc_testing.Channel) -> None:
    """A stream yields each delta as a Delta and ends with one Done."""
    stream = client.stream("p", max_tokens=2)
    _, request, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    rpc.send_response(_delta("He", 5))
    rpc.send_response(_delta("llo", 6))
    rpc.send_response(pb.StreamGenerateResponse(done=_done(request_id="r-7")))
    rpc.terminate((), OK, "")
    events = list(stream)
    assert request.params.stopping.max_tokens == 2
    assert events[:2] == [Delta("He", (5,)), Delta("llo", (6,))]
    done = events[2]
    assert isinstance(done, Done)
    assert stream.done is done
    assert (done.finish_reason, done.request_id, done.seed) == ("max_tokens", "r-7", 7)
    assert done.usage == Usage(3, 2, 1)


def test_stream_done_takes_request_id_from_headers(
    client: Client, channel: grpc_testing.Channel
) -> None:
    """A Done without request_id gets the stream's x-request-id header."""
    stream = client.stream("p")
    _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    rpc.send_initial_metadata((("x-request-id", "hdr-1"),))
    rpc.send_response(pb.StreamGenerateResponse(done=_done()))
    rpc.terminate((), OK, "")
    events = list(stream)
    assert isinstance(events[-1], Done)
    assert events[-1].request_id == "hdr-1"
    assert stream.request_id == "hdr-1"


def test_close_cancels_the_rpc(
    client: Client, channel: grpc_testing.Channel, executor: ThreadPoolExecutor
) -> None:
    """close() mid-stream cancels the RPC and ends iteration."""
    stream = client.stream("p")
    _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    rpc.send_response(_delta("a", 1))
    assert next(stream) == Delta("a", (1,))
    stream.close()
    _assert_cancelled(rpc, executor)
    assert list(stream) == []


def test_leaving_a_with_block_cancels_the_rpc(
    client: Client, channel: grpc_testing.Channel, executor: ThreadPoolExecutor
) -> None:
    """Breaking out of a `with` block around the stream cancels the RPC."""
    with client.stream("p") as stream:
        _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
        rpc.send_response(_delta("a", 1))
        for _ in stream:
            break
    _assert_cancelled(rpc, executor)


def test_breaking_out_of_a_for_loop_cancels_the_rpc(
    client: Client, channel: grpc_testing.Channel, executor: ThreadPoolExecutor
) -> None:
    """`for event in client.stream(...): break` cancels as soon as the stream is dropped."""
    rpcs: list[Any] = []

    def start() -> Stream:
        stream = client.stream("p")
        _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
        rpc.send_response(_delta("a", 1))
        rpcs.append(rpc)
        return stream

    for event in start():
        assert event == Delta("a", (1,))
        break
    _assert_cancelled(rpcs[0], executor)


def test_dropping_a_stream_cancels_the_rpc(
    client: Client, channel: grpc_testing.Channel, executor: ThreadPoolExecutor
) -> None:
    """A stream that is garbage-collected before its end cancels its RPC."""
    stream = client.stream("p")
    _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    del stream
    gc.collect()
    _assert_cancelled(rpc, executor)


def test_stream_error_after_deltas_raises_typed_error(
    client: Client, channel: grpc_testing.Channel
) -> None:
    """An error status mid-stream surfaces as a typed error after the deltas already sent."""
    stream = client.stream("p")
    _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    rpc.send_response(_delta("a", 1))
    assert next(stream) == Delta("a", (1,))
    # grpc_testing drops unread messages once a non-OK status is set, so read first.
    rpc.terminate((), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    with pytest.raises(ResourceExhaustedError) as caught:
        next(stream)
    assert not isinstance(caught.value, QueueFullError)  # no ErrorInfo: the code decides
    assert caught.value.message == "queue full"
    assert list(stream) == []


def test_stream_without_done_is_an_internal_error(
    client: Client, channel: grpc_testing.Channel
) -> None:
    """A stream that ends OK without its final done message is reported, not silently cut."""
    stream = client.stream("p")
    _, _, rpc = channel.take_unary_stream(rpc_method("StreamGenerate"))
    rpc.send_response(_delta("a", 1))
    rpc.terminate((), OK, "")
    assert next(stream) == Delta("a", (1,))
    with pytest.raises(InternalError):
        next(stream)


def test_generate_tokens_sends_ids_and_streams(
    client: Client, channel: grpc_testing.Channel
) -> None:
    """generate_tokens() sends the prompt ids and yields token deltas then Done."""
    stream = client.generate_tokens([2, 10, 11], seed=3, session_id="s")
    _, request, rpc = channel.take_unary_stream(rpc_method("GenerateTokens"))
    rpc.send_response(
        pb.GenerateTokensResponse(delta=pb.GenerationDelta(text="x", token_ids=[12, 13]))
    )
    rpc.send_response(pb.GenerateTokensResponse(done=_done(request_id="t")))
    rpc.terminate((), OK, "")
    events = list(stream)
    assert list(request.token_ids) == [2, 10, 11]
    assert request.params.sampling.seed == 3
    assert request.session_id == "s"
    assert events[0] == Delta("x", (12, 13))
    assert isinstance(events[1], Done)
    assert events[1].request_id == "t"


# --- AsyncClient over a real grpc.aio server -----------------------------------------------


class ScriptedServicer(pb_grpc.LlmServiceServicer):
    """Replays fixed answers and records what the client sent."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.time_remaining: float | None = None
        self.metadata: dict[str, str] = {}
        self.stream_cancelled = asyncio.Event()

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        """Answer with fixed text; the request id travels only in the header."""
        self.requests.append(request)
        self.time_remaining = context.time_remaining()
        self.metadata = dict(context.invocation_metadata())
        await context.send_initial_metadata((("x-request-id", "aio-1"),))
        return pb.GenerateResponse(text="ok", token_ids=[1], finish_reason=pb.FINISH_REASON_EOS)

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """Two deltas then done; the prompt "hang" waits for a cancel after one delta."""
        self.requests.append(request)
        yield _delta("A", 1)
        if request.prompt == "hang":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.stream_cancelled.set()
                raise
        yield _delta("B", 2)
        yield pb.StreamGenerateResponse(done=_done(request_id="aio-s"))

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        """Fail with RESOURCE_EXHAUSTED (no details) for "full"; else one id per character."""
        if request.text == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])


@pytest.fixture
async def aio_server() -> AsyncIterator[tuple[str, ScriptedServicer, Any]]:
    """A grpc.aio server on 127.0.0.1:0 with the scripted servicer and a health service."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = ScriptedServicer()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer, health
    await server.stop(None)


async def test_async_generate_sends_deadline_and_reads_header_request_id(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """The client's default timeout reaches the server as a deadline; the header id is kept."""
    target, servicer, _ = aio_server
    async with AsyncClient(target, timeout=30, metadata={"x-tenant": "b"}) as client:
        result = await client.generate("p", top_k=0)
    assert servicer.time_remaining == pytest.approx(30, abs=0.5)  # grpc rounds deadlines up
    assert servicer.metadata["x-tenant"] == "b"
    assert servicer.requests[0].params.sampling.HasField("top_k")
    assert (result.text, result.finish_reason, result.request_id) == ("ok", "eos", "aio-1")


async def test_async_per_call_timeout_overrides_the_default(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """timeout= on a call replaces the client's default deadline."""
    target, servicer, _ = aio_server
    async with AsyncClient(target, timeout=300) as client:
        await client.generate("p", timeout=5)
    assert servicer.time_remaining == pytest.approx(5, abs=0.5)


async def test_async_stream_yields_deltas_then_done(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """An async stream yields Delta values then one Done."""
    target, _, _ = aio_server
    async with AsyncClient(target) as client:
        stream = client.stream("p")
        events = [event async for event in stream]
    assert events[:2] == [Delta("A", (1,)), Delta("B", (2,))]
    assert isinstance(events[2], Done)
    assert events[2].request_id == "aio-s"
    assert stream.done is events[2]


async def test_async_aclose_cancels_the_server_side(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """aclose() mid-stream cancels the RPC: the servicer sees the cancellation."""
    target, servicer, _ = aio_server
    async with AsyncClient(target) as client:
        stream = client.stream("hang")
        assert await anext(stream) == Delta("A", (1,))
        await stream.aclose()
        await asyncio.wait_for(servicer.stream_cancelled.wait(), timeout=5)
        assert [event async for event in stream] == []


async def test_async_with_block_cancels_the_server_side(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """Leaving `async with stream` early cancels the RPC."""
    target, servicer, _ = aio_server
    async with AsyncClient(target) as client:
        async with client.stream("hang") as stream:
            async for _ in stream:
                break
        await asyncio.wait_for(servicer.stream_cancelled.wait(), timeout=5)


async def test_async_error_is_typed(aio_server: tuple[str, ScriptedServicer, Any]) -> None:
    """An aio RpcError becomes the typed error of its status code."""
    target, _, _ = aio_server
    async with AsyncClient(target) as client:
        with pytest.raises(ResourceExhaustedError) as caught:
            await client.tokenize("full")
        assert await client.tokenize("ab") == [97, 98]
    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert caught.value.message == "busy"


async def test_async_health_reports_the_serving_status(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """health() returns the grpc.health.v1 status name, NOT_SERVING then SERVING."""
    target, _, health = aio_server
    async with AsyncClient(target) as client:
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await client.health() == "NOT_SERVING"
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await client.health() == "SERVING"


async def test_sync_client_health_over_a_real_channel(
    aio_server: tuple[str, ScriptedServicer, Any],
) -> None:
    """The sync client's health() works over its own insecure channel."""
    target, _, health = aio_server
    await health.set("", health_pb2.HealthCheckResponse.SERVING)

    def check() -> str:
        with Client(target, timeout=5) as client:
            return client.health()

    assert await asyncio.to_thread(check) == "SERVING"
