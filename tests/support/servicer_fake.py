"""Calling the servicer over a FakeEngine: the Settings the tests serve with, collecting a stream
(collect, read_all) and reading a status's details (details). Shared by several test modules (until
now in tests/unit/rpc/test_servicer_fake.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import error_details_pb2  # type: ignore[import-untyped]  # no stubs
from grpc_status import rpc_status

from llama_grpc_server.config import SchedulerSettings, ServerSettings, Settings

SETTINGS = Settings(
    scheduler=SchedulerSettings(default_max_tokens=64),
    server=ServerSettings(host="127.0.0.1", port=0, grace_s=0.5),
)


def details(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    """The google.rpc details of a failed call, by type name."""
    found: dict[str, Any] = {}
    status = rpc_status.from_call(error)  # type: ignore[arg-type]  # AioRpcError quacks like a Call
    assert status is not None
    for detail in status.details:
        for cls in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
            error_details_pb2.RequestInfo,
        ):
            value = cls()
            if detail.Unpack(value):
                found[cls.__name__] = value
    return found


async def collect(call: Any) -> list[Any]:
    return [message async for message in call]


async def read_all(call: Any) -> AsyncIterator[Any]:
    """The remaining messages of a call already read with read()."""
    while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lacks aio.EOF
        yield message
