"""Fixtures shared by the unit tests. A test module provides its own `server` fixture (a real
grpc.aio server on 127.0.0.1 around the FakeEngine `engine`); `channel` and `stub` connect to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.testing import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.LlmServiceStub(channel)
