"""A real server over a model pool (the default model and PoolSettings.models, each engine built
by build_engine when a request needs it), for the e2e tests of several models."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from llama_grpc_server.config import Settings
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.models.pool import ModelSpec, model_specs, settings_for
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server


@contextlib.asynccontextmanager
async def pool_server(conf: Settings) -> AsyncIterator[RunningServer]:
    """The server, once its default model has loaded."""

    def build(spec: ModelSpec) -> EngineLoop:
        return build_engine(settings_for(conf, spec))

    default = model_specs(conf)[0]
    async with start_server(conf, lambda: build(default), model_factory=build) as running:
        assert await running.wait_loaded()
        yield running
