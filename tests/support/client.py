"""A Client over grpc_testing (no server): the channel, client and executor fixtures and
UnaryScript, which answers a unary call the way a test scripts it. Shared by several test modules
(until now in tests/unit/client/test_client.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import grpc_testing
import pytest

from llama_grpc import Client
from llama_grpc.v1 import llm_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["LlmService"]


OK = grpc.StatusCode.OK


def rpc_method(name: str) -> Any:
    return SERVICE.methods_by_name[name]


@pytest.fixture
def channel() -> grpc_testing.Channel:
    """A grpc_testing channel serving LlmService by script."""
    return grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())


@pytest.fixture
def client(channel: grpc_testing.Channel) -> Iterator[Client]:
    """A sync Client over the scripted channel."""
    with Client(channel=channel) as sync_client:
        yield sync_client


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    """Threads for blocking unary calls while the test thread plays the server."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


class UnaryScript:
    """Runs a blocking client call in a thread and answers it from the test thread."""

    def __init__(self, channel: grpc_testing.Channel, executor: ThreadPoolExecutor) -> None:
        self.channel = channel
        self.executor = executor

    def __call__(
        self,
        call: Callable[[], Any],
        method: str,
        response: Any,
        initial_metadata: tuple[tuple[str, str], ...] = (),
    ) -> tuple[Any, Any, Any]:
        """Answer one call; returns (invocation metadata, request, client result)."""
        future = self.executor.submit(call)
        metadata, request, rpc = self.channel.take_unary_unary(rpc_method(method))
        rpc.send_initial_metadata(initial_metadata)
        rpc.terminate(response, (), OK, "")
        return metadata, request, future.result(timeout=5)


@pytest.fixture
def unary(channel: grpc_testing.Channel, executor: ThreadPoolExecutor) -> UnaryScript:
    """Scripted answers to blocking unary calls."""
    return UnaryScript(channel, executor)
