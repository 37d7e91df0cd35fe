"""Several models behind a real grpc.aio server (FakeEngines, no model): requests pick a model by
name, the admin RPCs through the client library and the `llama-grpc` CLI, GetStats of a model
that is not loaded, and UnloadModel of a busy model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
from deploy.cluster import free_port

from llama_grpc import (
    AsyncClient,
    Delta,
    ModelBusyError,
    ModelNotFoundError,
    ModelNotLoadedError,
    UnavailableError,
)
from llama_grpc import cli as client_cli
from llama_grpc_server.config import PoolSettings, ServerSettings, Settings
from llama_grpc_server.models.pool import ModelSpec
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import serve, start_server
from llama_grpc_server.testing import EOS_ID, N_VOCAB, FakeEngine, HangingRunner, fake_model_info
from llama_grpc_server.watchdog import EXIT_ENGINE_HUNG

SETTINGS = Settings(
    model=dataclasses.replace(Settings().model, model_path="/models/a.gguf", model_name="a"),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
    pool=PoolSettings(models=(("b", "/models/b.gguf"),), max_loaded_models=2),
)


def fake(spec: ModelSpec) -> FakeEngine:
    info = dataclasses.replace(fake_model_info(), model_name=spec.name, model_path=spec.path)
    return FakeEngine(info, token_delay_s=0.02)


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    default = ModelSpec("a", "/models/a.gguf")
    async with start_server(SETTINGS, lambda: fake(default), model_factory=fake) as running:
        assert await running.wait_loaded()
        yield running


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=30) as c:
        yield c


async def test_requests_pick_their_model(client: AsyncClient) -> None:
    """The fake engine answers the prompt reversed; stats and info are per model."""
    assert (await client.generate("ab", model="b")).text == "ba"
    assert (await client.generate("ab")).text == "ba"
    assert (await client.stats(model="b")).requests_finished == 1
    assert (await client.stats()).model_name == "a"
    assert (await client.model_info(model="b.gguf")).model_name == "b"
    with pytest.raises(ModelNotFoundError, match="available: a, b"):
        await client.tokenize("x", model="c")


async def test_admin_rpcs(client: AsyncClient) -> None:
    listed = await client.list_models()
    assert [(m.name, m.state, m.is_default) for m in listed.models] == [
        ("a", "loaded", True),
        ("b", "unloaded", False),
    ]
    with pytest.raises(ModelNotLoadedError):
        await client.stats(model="b")
    with pytest.raises(ModelNotLoadedError):
        await client.clear_cache(model="b")
    assert (await client.load_model("b")).state == "loaded"
    assert (await client.clear_cache(model="b")).cleared_slots == 0
    unloaded = await client.unload_model("b")
    assert (unloaded.model.state, unloaded.cancelled_requests) == ("unloaded", 0)


async def test_unload_of_a_busy_model(client: AsyncClient) -> None:
    """Refused while a stream runs; with force the stream ends UNAVAILABLE MODEL_UNLOADED."""
    stream = client.stream("a long prompt to reverse slowly", model="b")
    first = await anext(stream)
    assert isinstance(first, Delta)
    with pytest.raises(ModelBusyError, match="in flight"):
        await client.unload_model("b")
    unloaded = await client.unload_model("b", force=True)
    assert unloaded.cancelled_requests == 1
    with pytest.raises(UnavailableError) as ended:
        async for _ in stream:
            pass
    assert ended.value.reason == "MODEL_UNLOADED"


async def test_cli_model_commands(server: RunningServer) -> None:
    target = ["--target", f"127.0.0.1:{server.port}"]

    def run(*argv: str) -> int:
        return client_cli.main([*argv, *target])

    assert await asyncio.to_thread(run, "load-model", "b") == 0
    assert await asyncio.to_thread(run, "list-models") == 0
    assert await asyncio.to_thread(run, "stats", "--model", "b") == 0
    assert await asyncio.to_thread(run, "unload-model", "b") == 0
    assert await asyncio.to_thread(run, "stats", "--model", "b") == 1


async def test_cli_list_models_prints_json(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["list-models", "--target", f"127.0.0.1:{server.port}"]
    assert await asyncio.to_thread(client_cli.main, argv) == 0
    out = capsys.readouterr().out  # the server's log lines are captured too
    printed = json.loads(out[out.index("{\n") : out.index("\n}\n") + 2])
    assert [m["name"] for m in printed["models"]] == ["a", "b"]
    assert printed["max_loaded_models"] == 2


async def test_another_models_hang_exits_the_server_even_with_keep_alive() -> None:
    """Model b's first forward pass never returns: its caller gets UNAVAILABLE ENGINE_HUNG,
    health turns NOT_SERVING and serve() returns 71 after the grace period, although
    --keep-alive-on-engine-error would keep a merely dead engine's server up."""
    runner = HangingRunner(hang_at=1, n_vocab=N_VOCAB, eos_id=EOS_ID)

    def factory(spec: ModelSpec) -> FakeEngine:
        engine = fake(spec)
        if spec.name == "b":
            engine.runner, engine.watchdog_s = runner, 0.3
        return engine

    port = free_port()  # serve() does not tell its port: pick a free one
    server = dataclasses.replace(SETTINGS.server, port=port, keep_alive_on_engine_error=True)
    settings = dataclasses.replace(SETTINGS, server=server)
    default = ModelSpec("a", "/models/a.gguf")
    ready = asyncio.Event()

    async def serving() -> int:
        return await serve(settings, lambda: fake(default), model_factory=factory, ready=ready)

    try:
        exit_code = asyncio.ensure_future(serving())
        await asyncio.wait_for(ready.wait(), 10)
        async with AsyncClient(f"127.0.0.1:{port}", timeout=30) as client:
            assert (await client.generate("ab")).text == "ba"
            with pytest.raises(UnavailableError) as caught:
                await client.generate("ab", model="b")
            assert caught.value.reason == "ENGINE_HUNG"
            assert "past the watchdog's 0.3 s" in str(caught.value)
            assert await client.health() == "NOT_SERVING"
        assert await asyncio.wait_for(exit_code, 10) == EXIT_ENGINE_HUNG
    finally:
        runner.release.set()
