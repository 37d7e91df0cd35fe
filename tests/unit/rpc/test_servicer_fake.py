"""LlmServicer behind a real grpc.aio server on 127.0.0.1:0, with the FakeEngine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import errors
from llama_grpc_server.core.scheduling.tenants import TenantLimits
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import serve, start_server
from llama_grpc_server.rpc.v1.servicer import SERVICE_NAME
from llama_grpc_server.testing import BOS_ID, FakeEngine, encode
from tests.support.servicer_fake import SETTINGS, collect, details, read_all


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        yield running


# -- generation ------------------------------------------------------------------------------------


async def test_unary_equals_concatenated_stream(stub: Any) -> None:
    """Generate returns exactly what StreamGenerate's deltas add up to, with the same finish."""
    unary = await stub.Generate(pb.GenerateRequest(prompt="hello"))
    messages = await collect(stub.StreamGenerate(pb.StreamGenerateRequest(prompt="hello")))
    deltas, done = messages[:-1], messages[-1]
    assert all(m.WhichOneof("event") == "delta" for m in deltas)
    assert done.WhichOneof("event") == "done"
    assert unary.text == "".join(m.delta.text for m in deltas) == "olleh"
    assert list(unary.token_ids) == [t for m in deltas for t in m.delta.token_ids]
    assert unary.finish_reason == done.done.finish_reason == pb.FINISH_REASON_EOS
    usage = (unary.usage.prompt_tokens, unary.usage.completion_tokens)
    assert usage == (done.done.usage.prompt_tokens, done.done.usage.completion_tokens) == (6, 5)
    # the same prompt again reuses the first call's KV (the real scheduler's prefix cache)
    assert (unary.usage.cached_prompt_tokens, done.done.usage.cached_prompt_tokens) == (0, 5)
    assert unary.usage.prompt_tokens == 6  # BOS + 5 bytes


async def test_max_tokens_cuts_the_output(stub: Any) -> None:
    """An explicit max_tokens limits the output and reports MAX_TOKENS."""
    params = pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=2))
    response = await stub.Generate(pb.GenerateRequest(prompt="abcdef", params=params))
    assert response.text == "fe"
    assert response.finish_reason == pb.FINISH_REASON_MAX_TOKENS


async def test_stop_string_cuts_the_text(stub: Any) -> None:
    """The fake runs the real scheduler: a stop string ends generation and is not sent."""
    params = pb.GenerationParams(stopping=pb.StoppingCriteria(stop=["ll"]))
    unary = await stub.Generate(pb.GenerateRequest(prompt="hello", params=params))
    assert unary.text == "o"
    assert unary.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert unary.finish.matched_stop == "ll"


async def test_stop_token_is_reported(stub: Any) -> None:
    """A stop token ends generation with STOP_TOKEN and names the token; it is not emitted."""
    [stop_id] = encode("c")
    params = pb.GenerationParams(stopping=pb.StoppingCriteria(stop_token_ids=[stop_id]))
    response = await stub.Generate(pb.GenerateRequest(prompt="abcd", params=params))
    assert response.text == "d"
    assert response.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert response.finish.matched_token_id == stop_id


async def test_generate_tokens_streams_token_ids(stub: Any, engine: FakeEngine) -> None:
    """GenerateTokens takes ids as the prompt (no BOS added) and streams ids and text, one
    delta per token (50 ms apart: the client keeps up, nothing is merged)."""
    engine.token_delay_s = 0.05
    messages = await collect(stub.GenerateTokens(pb.GenerateTokensRequest(token_ids=encode("ab"))))
    assert [list(m.delta.token_ids) for m in messages[:-1]] == [encode("b"), encode("a")]
    assert messages[-1].done.usage.prompt_tokens == 2
    assert engine.submitted[0].prompt_tokens == tuple(encode("ab"))


async def test_add_special_false_skips_bos(stub: Any, engine: FakeEngine) -> None:
    """add_special=False tokenizes the prompt without BOS; the default adds it."""
    await stub.Generate(pb.GenerateRequest(prompt="a", add_special=False))
    await stub.Generate(pb.GenerateRequest(prompt="a"))
    assert engine.submitted[0].prompt_tokens == tuple(encode("a"))
    assert engine.submitted[1].prompt_tokens == (BOS_ID, *encode("a"))


async def test_deadline_reaches_the_engine(stub: Any, engine: FakeEngine) -> None:
    """A call timeout becomes the request's monotonic deadline; no timeout means None."""
    await stub.Generate(pb.GenerateRequest(prompt="a"), timeout=30)
    await stub.Generate(pb.GenerateRequest(prompt="a"))
    loop_now = time.monotonic()
    deadline = engine.submitted[0].deadline
    assert deadline is not None
    assert 25 < deadline - loop_now <= 31  # grpc rounds time_remaining; clocks differ a little
    assert engine.submitted[1].deadline is None


async def test_cancel_mid_stream_cancels_the_engine_request(stub: Any, engine: FakeEngine) -> None:
    """A client cancel after two deltas makes the servicer cancel the request in the engine."""
    engine.token_delay_s = 0.05
    call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 50))
    received = 0
    async for _ in call:
        received += 1
        if received == 2:
            call.cancel()
            break
    cancelled_id = await engine.wait_for_cancel(timeout_s=2)
    assert cancelled_id == engine.submitted[0].request_id
    assert await call.code() == grpc.StatusCode.CANCELLED


async def test_deadline_mid_stream_cancels_the_engine_request(
    stub: Any, engine: FakeEngine
) -> None:
    """An expired deadline ends the stream with DEADLINE_EXCEEDED and cancels the engine request."""
    engine.token_delay_s = 0.05
    call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 50), timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(call)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await engine.wait_for_cancel(timeout_s=2) == engine.submitted[0].request_id


@pytest.mark.parametrize("method", ["Generate", "StreamGenerate"])
async def test_a_deadline_is_counted_as_deadline_exceeded_not_cancelled(
    stub: Any, engine: FakeEngine, method: str
) -> None:
    """The engine request of a call whose deadline expired ends as DeadlineExceeded: GetStats
    counts it in requests_deadline_exceeded, never in requests_cancelled or requests_failed; a
    client's own cancel still counts as cancelled."""
    engine.token_delay_s = 0.05

    async def expire() -> None:
        if method == "Generate":
            await stub.Generate(pb.GenerateRequest(prompt="x" * 50), timeout=0.3)
        else:
            await collect(
                stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 50), timeout=0.3)
            )

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await expire()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="y" * 50))
    await call.read()
    call.cancel()

    def ended(s: Any) -> int:
        return int(s.requests_deadline_exceeded + s.requests_cancelled + s.requests_failed)

    stats = await stub.GetStats(pb.GetStatsRequest())
    for _ in range(200):
        if ended(stats) >= 2:
            break
        await asyncio.sleep(0.02)
        stats = await stub.GetStats(pb.GetStatsRequest())
    counts = (stats.requests_deadline_exceeded, stats.requests_cancelled, stats.requests_failed)
    assert counts == (1, 1, 0)


async def test_unary_deadline_cancels_the_engine_request(stub: Any, engine: FakeEngine) -> None:
    """A unary Generate that times out also cancels its engine request."""
    engine.token_delay_s = 0.05
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(pb.GenerateRequest(prompt="x" * 50), timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await engine.wait_for_cancel(timeout_s=10) == engine.submitted[0].request_id


# -- errors ----------------------------------------------------------------------------------------


async def test_failed_event_mid_stream_becomes_status(stub: Any, engine: FakeEngine) -> None:
    """A Failed event after two deltas ends the stream with its status and details."""
    engine.token_delay_s = 0.05  # one delta per token: none merged before the failure
    engine.fail_with = errors.KvCacheFull("no room", metadata={"n_ctx": "512"}, retry_after_s=2)
    engine.fail_after = 2
    call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="abcdef"))
    received = [await call.read(), await call.read()]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert [m.WhichOneof("event") for m in received] == ["delta", "delta"]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == "no room"
    found = details(caught.value)
    assert found["ErrorInfo"].reason == "KV_CACHE_FULL"
    assert dict(found["ErrorInfo"].metadata) == {"n_ctx": "512"}
    assert found["RetryInfo"].retry_delay.seconds == 2
    assert found["RequestInfo"].request_id == engine.submitted[0].request_id


async def test_invalid_argument_names_the_field(stub: Any, engine: FakeEngine) -> None:
    """A bad parameter is INVALID_ARGUMENT with BadRequest naming it; nothing is submitted."""
    params = pb.GenerationParams(sampling=pb.SamplingParams(top_p=0))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(pb.GenerateRequest(prompt="a", params=params))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = details(caught.value)
    assert found["BadRequest"].field_violations[0].field == "params.sampling.top_p"
    assert found["ErrorInfo"].reason == "INVALID_ARGUMENT"
    assert engine.submitted == []


async def test_overloaded_is_resource_exhausted_with_retry(stub: Any, engine: FakeEngine) -> None:
    """A full queue is RESOURCE_EXHAUSTED, reason QUEUE_FULL, with RetryInfo."""
    engine.max_queue = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.StreamGenerate(pb.StreamGenerateRequest(prompt="a")))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(caught.value)
    assert found["ErrorInfo"].reason == "QUEUE_FULL"
    assert found["RetryInfo"].retry_delay.seconds == 1


async def test_a_refused_call_is_trailers_only(stub: Any, engine: FakeEngine) -> None:
    """Refused before any message (here a full queue), unary or streaming: no response headers
    before the status (trailers-only), so SMG, Envoy (retry_on: resource-exhausted,unavailable)
    and grpc's retry policy may send it to another replica; the id is in the trailers. A call
    that answers gets its headers with its first message."""
    engine.max_queue = 0
    unary = stub.Generate(pb.GenerateRequest(prompt="a"), metadata=(("x-request-id", "u-1"),))
    stream = stub.StreamGenerate(
        pb.StreamGenerateRequest(prompt="a"), metadata=(("x-request-id", "s-1"),)
    )
    for call, request_id in ((unary, "u-1"), (stream, "s-1")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(call) if call is stream else await call
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await call.initial_metadata() == grpc.aio.Metadata()
        assert dict(caught.value.trailing_metadata())["x-request-id"] == request_id
    engine.max_queue = None
    answered = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="ab"))
    assert (await answered.read()).WhichOneof("event") == "delta"
    assert "x-request-id" in dict(await answered.initial_metadata())
    answered.cancel()


async def test_unknown_model_is_not_found(stub: Any) -> None:
    """Naming another model is NOT_FOUND."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(pb.GenerateRequest(model="gpt-5", prompt="a"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert details(caught.value)["ErrorInfo"].reason == "MODEL_NOT_FOUND"


async def test_bug_in_engine_is_internal_without_details(stub: Any, engine: FakeEngine) -> None:
    """An unexpected exception is INTERNAL naming only the request id."""

    def broken(request: Any) -> list[int]:
        raise ZeroDivisionError("secret internals")

    engine.script = broken
    call = stub.Generate(pb.GenerateRequest(prompt="a"), metadata=(("x-request-id", "bug-1"),))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "internal error (request_id=bug-1)"


# -- request ids -----------------------------------------------------------------------------------


async def test_request_id_is_echoed(stub: Any, engine: FakeEngine) -> None:
    """A caller's x-request-id comes back in initial metadata, the result, and the engine."""
    call = stub.StreamGenerate(
        pb.StreamGenerateRequest(prompt="ab"), metadata=(("x-request-id", "mine-42"),)
    )
    metadata = await call.initial_metadata()
    messages = await collect(call)
    assert dict(metadata)["x-request-id"] == "mine-42"
    assert messages[-1].done.request_id == "mine-42"
    assert engine.submitted[0].request_id == "mine-42"


async def test_request_id_is_generated_when_absent(stub: Any, engine: FakeEngine) -> None:
    """Without x-request-id the server makes one (32 lowercase hex digits, new per call) and
    uses it in the metadata, the result and the engine request."""
    ids = []
    for _ in range(3):
        call = stub.Generate(pb.GenerateRequest(prompt="ab"))
        response = await call
        request_id = dict(await call.initial_metadata())["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", request_id), request_id
        assert response.request_id == request_id
        ids.append(request_id)
    assert len(set(ids)) == 3
    assert [r.request_id for r in engine.submitted] == ids


# -- no-scheduler RPCs -----------------------------------------------------------------------------


async def test_tokenize_with_pieces(stub: Any) -> None:
    """Tokenize returns ids and, when asked, each token's text."""
    response = await stub.Tokenize(pb.TokenizeRequest(text="hi", return_pieces=True))
    assert list(response.token_ids) == [BOS_ID, *encode("hi")]
    assert list(response.pieces) == ["<s>", "h", "i"]


async def test_detokenize_and_bad_id(stub: Any) -> None:
    """Detokenize renders ids; an id outside the vocabulary is INVALID_ARGUMENT at its index."""
    response = await stub.Detokenize(pb.DetokenizeRequest(token_ids=encode("ok")))
    assert response.text == "ok"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Detokenize(pb.DetokenizeRequest(token_ids=[*encode("ok"), 9999]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)["BadRequest"].field_violations[0].field == "token_ids[2]"


async def test_stats_and_model_info(stub: Any) -> None:
    """GetStats counts what the callers were answered; GetModelInfo describes the model."""
    answers = [await stub.Generate(pb.GenerateRequest(prompt=p)) for p in ("abc", "hello")]
    stats = await stub.GetStats(pb.GetStatsRequest())
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert stats.requests_started == stats.requests_finished == len(answers)
    assert stats.prompt_tokens == sum(a.usage.prompt_tokens for a in answers) == 4 + 6
    assert stats.generated_tokens == sum(len(a.token_ids) for a in answers) == 3 + 5
    assert (info.model_name, info.n_vocab, info.n_ctx) == ("fake", 259, 512)


async def test_clear_cache_without_authentication(stub: Any) -> None:
    """Anyone may clear when no tokens file is set; it reports the idle slot it emptied; an
    unknown model is NOT_FOUND."""
    await stub.Generate(pb.GenerateRequest(prompt="abcdef"))
    held = (await stub.GetStats(pb.GetStatsRequest())).kv_cells_used
    cleared = await stub.ClearCache(pb.ClearCacheRequest())
    assert held > 0
    assert (cleared.cleared_slots, cleared.freed_kv_cells) == (1, held)
    assert (await stub.GetStats(pb.GetStatsRequest())).kv_cells_used == 0
    again = await stub.ClearCache(pb.ClearCacheRequest())
    assert (again.cleared_slots, again.freed_kv_cells) == (0, 0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ClearCache(pb.ClearCacheRequest(model="other"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# -- loading, health, reflection, shutdown ---------------------------------------------------------


async def test_not_ready_until_engine_loads() -> None:
    """While the factory runs: health NOT_SERVING and RPCs UNAVAILABLE/NOT_READY; then SERVING."""
    release = threading.Event()
    engine = FakeEngine()

    def slow_factory() -> FakeEngine:
        release.wait(10)
        return engine

    async with (
        start_server(SETTINGS, slow_factory) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        stub: Any = pb_grpc.LlmServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            check = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        loading = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="a"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(loading)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert details(caught.value)["ErrorInfo"].reason == "NOT_READY"
        assert await loading.initial_metadata() == grpc.aio.Metadata()  # trailers-only
        release.set()
        assert await running.wait_loaded()
        check = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert (await stub.Generate(pb.GenerateRequest(prompt="ab"))).text == "ba"


async def test_reflection_lists_the_services(channel: grpc.aio.Channel) -> None:
    """Server reflection lists LlmService, health and reflection itself."""
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert "grpc.reflection.v1alpha.ServerReflection" in names


async def test_stop_ends_what_outlasts_the_grace_period_with_a_reason(engine: FakeEngine) -> None:
    """A stream still running when the grace period is about to end gets UNAVAILABLE with
    reason SHUTTING_DOWN and its request id (not grpc's bare cut), before the server stops."""
    engine.token_delay_s = 0.05  # 200 tokens: 10 s, far past the 1 s grace period
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub: Any = pb_grpc.LlmServiceStub(channel)
            call = stub.StreamGenerate(
                pb.StreamGenerateRequest(prompt="x" * 200), metadata=(("x-request-id", "late"),)
            )
            first = await call.read()
            stopping = asyncio.create_task(running.stop(grace_s=1.0))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                _ = [m async for m in read_all(call)]
            await stopping
    assert first.WhichOneof("event") == "delta"
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    found = details(caught.value)
    assert found["ErrorInfo"].reason == "SHUTTING_DOWN"
    assert found["RequestInfo"].request_id == "late"
    assert "grace period (1 s) is over" in caught.value.details()


async def test_stop_lets_in_flight_streams_finish(engine: FakeEngine) -> None:
    """stop(grace) refuses new calls but an in-flight stream still ends with `done`."""
    engine.token_delay_s = 0.02
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub: Any = pb_grpc.LlmServiceStub(channel)
            call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="abcdefgh"))
            first = await call.read()
            stopping = asyncio.create_task(running.stop(grace_s=5))
            rest = [m async for m in read_all(call)]
            await stopping
    assert first.WhichOneof("event") == "delta"
    assert rest[-1].WhichOneof("event") == "done"
    assert await call.code() == grpc.StatusCode.OK
    assert engine.is_closed


async def test_serve_returns_1_when_the_engine_fails_to_load() -> None:
    """A factory that raises makes serve() log it and return 1."""

    def broken() -> FakeEngine:
        raise RuntimeError("no such model file")

    assert await asyncio.wait_for(serve(SETTINGS, broken), 10) == 1


async def test_serve_stops_on_sigterm() -> None:
    """SIGTERM drains the server, closes the engine and serve() returns 0."""
    engine = FakeEngine()
    ready = asyncio.Event()
    task = asyncio.create_task(serve(SETTINGS, lambda: engine, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 0
    assert engine.is_closed


# -- tenant limits reload --------------------------------------------------------------------------

TENANT_TOKEN = "tenant-a-token-0123456789"


def tokens_file(path: Path, limits: str = "") -> None:
    path.write_text(f'{limits}\n[[tokens]]\ntenant = "a"\ntoken = "{TENANT_TOKEN}"\n')


async def test_reload_applies_new_tenant_limits_to_the_running_engine(tmp_path: Path) -> None:
    """The tokens file's tenant limits reload with the tokens (what SIGHUP calls): three streams
    of tenant a are all accepted before; after a reload that sets max_concurrent = 1 and
    max_queued = 1, the third is RESOURCE_EXHAUSTED naming the new limit."""
    path = tmp_path / "tokens.toml"
    tokens_file(path)
    conf = dataclasses.replace(
        SETTINGS, server=dataclasses.replace(SETTINGS.server, auth_tokens_file=str(path))
    )
    engine = FakeEngine(token_delay_s=0.05)
    metadata = (("authorization", f"Bearer {TENANT_TOKEN}"),)
    async with (
        start_server(conf, lambda: engine) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        assert await running.wait_loaded()
        stub: Any = pb_grpc.LlmServiceStub(channel)

        async def three(admitted: int) -> list[Any]:
            """Three streams, once `admitted` of them run or wait in the engine (a refused
            call is trailers-only: it has no headers to wait for)."""
            calls = [
                stub.StreamGenerate(pb.StreamGenerateRequest(prompt="x" * 60), metadata=metadata)
                for _ in range(3)
            ]
            for _ in range(500):
                stats = await stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
                if stats.active_slots + stats.queue_depth == admitted:
                    break
                await asyncio.sleep(0.01)
            return calls

        async def outcome(call: Any) -> grpc.StatusCode:
            try:
                await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            call.cancel()
            return grpc.StatusCode.OK

        before = await three(3)
        assert [await outcome(c) for c in before] == [grpc.StatusCode.OK] * 3
        for _ in range(500):  # the cancelled streams leave their slots
            stats = await stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
            if stats.active_slots == stats.queue_depth == 0:
                break
            await asyncio.sleep(0.01)
        tokens_file(path, "[tenants.a]\nmax_concurrent = 1\nmax_queued = 1\n")
        assert running.reload("test")
        after = await three(2)
        codes = [await outcome(c) for c in after]
        assert sorted(codes, key=str) == sorted(
            [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED], key=str
        )
        rejected = after[codes.index(grpc.StatusCode.RESOURCE_EXHAUSTED)]
        assert await rejected.details() == "tenant 'a' has 1 requests waiting (max_queued=1)"
        assert engine.loop._scheduler.limits.tenants == {
            "a": TenantLimits(max_concurrent=1, max_queued=1)
        }


async def test_start_server_refuses_tokens_on_a_plaintext_network_listener(tmp_path: Path) -> None:
    """The same rule as the command line's, for servers started from code: nothing listens."""
    path = tmp_path / "tokens.toml"
    tokens_file(path)
    server = dataclasses.replace(SETTINGS.server, host="0.0.0.0", auth_tokens_file=str(path))
    refused = r"^--auth-tokens-file on a plaintext listener at --host=0\.0\.0\.0: bearer tokens"
    with pytest.raises(ValueError, match=refused):
        async with start_server(dataclasses.replace(SETTINGS, server=server), FakeEngine):
            pass
    allowed = dataclasses.replace(server, allow_insecure_tokens=True)
    async with start_server(dataclasses.replace(SETTINGS, server=allowed), FakeEngine) as running:
        assert await running.wait_loaded()
