"""The response cache in a real grpc.aio server around the FakeEngine (no model): hits replay
the stored result without the engine, across Generate and the streams; what is never cached
(sampled without a seed, opted out, time-limited, failed, cancelled); scopes; ClearCache;
GetStats; a stopped engine serves no hit."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import errors
from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings, loading
from llama_grpc_server.core.cached_engine import ResponseCachingEngine
from llama_grpc_server.core.requests.request import Finished, GenerationRequest, SamplingParams
from llama_grpc_server.core.response_cache import ResponseCache
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_server.rpc.plumbing.wiring import with_response_cache
from llama_grpc_server.testing import BOS_ID, FakeEngine, encode, fake_model_info

SETTINGS = Settings(
    scheduler=SchedulerSettings(
        default_max_tokens=64,
        response_cache_mb=1,
        default_sampling=SamplingParams(temperature=0.0),
    ),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
)
SAMPLED = pb.SamplingParams(temperature=0.9)


@pytest.fixture
async def server(engine: FakeEngine) -> AsyncIterator[RunningServer]:
    async with start_server(SETTINGS, lambda: engine) as running:
        assert await running.wait_loaded()
        yield running


async def stats(stub: Any) -> pb.GetStatsResponse:
    response: pb.GetStatsResponse = await stub.GetStats(pb.GetStatsRequest())
    return response


async def events(stub: Any, request: pb.StreamGenerateRequest) -> list[Any]:
    return [m async for m in stub.StreamGenerate(request)]


def generate(prompt: str = "hello", **params: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, params=pb.GenerationParams(**params))


async def test_a_repeated_greedy_generate_is_replayed_without_the_engine(
    stub: Any, engine: FakeEngine
) -> None:
    first = await stub.Generate(generate())
    second = await stub.Generate(generate())
    assert len(engine.submitted) == 1
    assert not first.usage.cached_response and second.usage.cached_response
    assert (
        (second.text, list(second.token_ids))
        == (first.text, list(first.token_ids))
        == (
            "olleh",
            encode("olleh"),
        )
    )
    assert (second.finish, second.seed) == (first.finish, first.seed)
    assert second.request_id != first.request_id
    usage = second.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, 5)
    assert usage.cached_prompt_tokens == usage.prompt_tokens  # nothing was computed
    timings = second.timings
    assert timings.queue_ms == timings.prefill_ms == 0
    assert 0 < timings.total_ms < first.timings.total_ms
    got = await stats(stub)
    assert (got.requests_started, got.response_cache_hits, got.response_cache_misses) == (1, 1, 1)
    assert got.response_cache_entries == 1 and got.response_cache_bytes > 0


async def test_a_stream_replays_the_original_deltas(stub: Any, engine: FakeEngine) -> None:
    """The same chunking as the original stream; Generate and GenerateTokens of the same
    request hit the same entry (the key is the request, not the RPC)."""
    engine.token_delay_s = 0.02  # one delta per token
    request = pb.StreamGenerateRequest(prompt="abcd")
    original = await events(stub, request)
    replay = await events(stub, request)
    assert len(original) == 5  # four deltas, then done
    assert [m.delta for m in replay[:-1]] == [m.delta for m in original[:-1]]
    assert replay[-1].done.usage.cached_response and not original[-1].done.usage.cached_response
    assert replay[-1].done.finish == original[-1].done.finish
    unary = await stub.Generate(pb.GenerateRequest(prompt="abcd"))
    tokens_call = stub.GenerateTokens(pb.GenerateTokensRequest(token_ids=[BOS_ID, *encode("abcd")]))
    by_tokens = [m async for m in tokens_call]
    assert unary.usage.cached_response and by_tokens[-1].done.usage.cached_response
    assert [m.delta for m in by_tokens[:-1]] == [m.delta for m in original[:-1]]
    assert len(engine.submitted) == 1


async def test_sampled_requests_without_a_seed_are_never_cached(
    stub: Any, engine: FakeEngine
) -> None:
    for _ in range(2):
        response = await stub.Generate(generate(sampling=SAMPLED))
        assert not response.usage.cached_response
    got = await stats(stub)
    assert (got.response_cache_hits, got.response_cache_misses) == (0, 2)
    assert got.response_cache_entries == 0 and len(engine.submitted) == 2


async def test_sampled_requests_with_a_seed_are_cached(stub: Any, engine: FakeEngine) -> None:
    seeded = pb.SamplingParams(temperature=0.9, seed=42)
    first = await stub.Generate(generate(sampling=seeded))
    second = await stub.Generate(generate(sampling=seeded))
    other_seed = await stub.Generate(generate(sampling=pb.SamplingParams(temperature=0.9, seed=43)))
    assert [r.usage.cached_response for r in (first, second, other_seed)] == [False, True, False]
    assert second.seed == first.seed == 42
    assert len(engine.submitted) == 2


async def test_cache_response_false_neither_reads_nor_writes(stub: Any, engine: FakeEngine) -> None:
    opted_out = await stub.Generate(generate(cache_response=False))
    assert not opted_out.usage.cached_response
    assert (await stats(stub)).response_cache_entries == 0
    await stub.Generate(generate())  # stored now
    again = await stub.Generate(generate(cache_response=False))
    assert not again.usage.cached_response
    assert (await stub.Generate(generate(cache_response=True))).usage.cached_response
    assert len(engine.submitted) == 3


async def test_time_limited_requests_are_not_cached(stub: Any, engine: FakeEngine) -> None:
    limited = pb.StoppingCriteria(time_limit_ms=60_000)
    for _ in range(2):
        response = await stub.Generate(generate(stopping=limited))
        assert not response.usage.cached_response
    assert len(engine.submitted) == 2


async def test_cache_scopes_never_share(stub: Any, engine: FakeEngine) -> None:
    for scope in ("a", "b", "a", ""):
        await stub.Generate(pb.GenerateRequest(prompt="hello", cache_scope=scope))
    assert len(engine.submitted) == 3
    assert (await stats(stub)).response_cache_entries == 3


async def test_a_failed_request_is_not_stored(stub: Any, engine: FakeEngine) -> None:
    engine.fail_with = errors.EngineError("llama_decode failed")
    engine.fail_after = 1
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Generate(generate())
    engine.fail_with = None
    assert not (await stub.Generate(generate())).usage.cached_response
    assert (await stub.Generate(generate())).usage.cached_response


async def test_a_cancelled_stream_is_not_stored(stub: Any, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.05
    call = stub.StreamGenerate(pb.StreamGenerateRequest(prompt="abcdefgh"))
    first = await call.read()
    assert first.WhichOneof("event") == "delta"
    call.cancel()
    await engine.wait_for_cancel()
    engine.token_delay_s = 0.0
    replay = await events(stub, pb.StreamGenerateRequest(prompt="abcdefgh"))
    assert not replay[-1].done.usage.cached_response
    assert (await stats(stub)).response_cache_entries == 1


async def test_clear_cache_empties_it_and_says_what_it_freed(stub: Any) -> None:
    for prompt in ("abc", "hello"):
        await stub.Generate(generate(prompt))
    held = await stats(stub)
    cleared = await stub.ClearCache(pb.ClearCacheRequest())
    assert (cleared.freed_response_entries, cleared.freed_response_bytes) == (
        2,
        held.response_cache_bytes,
    )
    after = await stats(stub)
    assert (after.response_cache_entries, after.response_cache_bytes) == (0, 0)
    assert not (await stub.Generate(generate("abc"))).usage.cached_response
    again = await stub.ClearCache(pb.ClearCacheRequest())
    assert again.freed_response_entries == 1


async def test_without_the_option_nothing_is_cached(engine: FakeEngine) -> None:
    settings = Settings(
        scheduler=SchedulerSettings(default_sampling=SamplingParams(temperature=0.0)),
        server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
    )
    async with start_server(settings, lambda: engine) as running:
        assert await running.wait_loaded()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.LlmServiceStub(channel)
            answers = [await stub.Generate(generate()) for _ in range(2)]
            got = await stub.GetStats(pb.GetStatsRequest())
    assert not any(a.usage.cached_response for a in answers)
    assert (got.response_cache_hits, got.response_cache_misses) == (0, 0)
    assert len(engine.submitted) == 2


def test_the_option_sets_the_budget() -> None:
    settings = loading.load_settings(["--response-cache-mb", "64"], {})
    assert settings.scheduler.response_cache_mb == 64
    assert loading.load_settings([], {}).scheduler.response_cache_mb == 0
    with pytest.raises(loading.ConfigError, match="--response-cache-mb"):
        loading.load_settings(["--response-cache-mb", "-1"], {})


def test_the_model_file_sha256_is_in_every_key(tmp_path: Path) -> None:
    """with_response_cache wraps the engine only when on; the model's identity is its file's
    sha256 (a fake's path that is no file stands for itself)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF not really")
    engine = FakeEngine(dataclasses.replace(fake_model_info(), model_path=str(model)))
    assert with_response_cache(lambda: engine, 0)() is engine
    wrapped = with_response_cache(lambda: engine, 2)()
    assert isinstance(wrapped, ResponseCachingEngine)
    assert wrapped.model_id == hashlib.sha256(model.read_bytes()).hexdigest()
    assert wrapped.cache.capacity_bytes == 2 * 1024 * 1024
    fake = with_response_cache(FakeEngine, 1)()
    assert isinstance(fake, ResponseCachingEngine) and fake.model_id == "path:/models/fake.gguf"


async def test_a_stopped_engine_serves_no_hit() -> None:
    """Hits need a running engine: once it stops, a stored request is refused like any other."""
    engine = FakeEngine()
    cached = ResponseCachingEngine(engine, ResponseCache(1 << 20), "model")
    prompt, greedy = (BOS_ID, *encode("hi")), SamplingParams(temperature=0.0)
    for request_id in ("r1", "r2"):
        stream = cached.submit(GenerationRequest(request_id, prompt, greedy))
        [*_, done] = [event async for event in stream]
    assert isinstance(done, Finished) and done.usage.cached_response
    await asyncio.to_thread(cached.close)
    with pytest.raises(errors.ShuttingDown):
        cached.submit(GenerationRequest("r3", prompt, greedy))
    assert cached.stats().response_cache_hits == 1
