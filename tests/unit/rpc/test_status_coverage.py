"""Every status the server can send has its own typed client exception.

The server side is enumerated, not listed: every ServiceError subclass defined anywhere in
llama_grpc_server (each module is imported first) and every code of rpc/plumbing/status.py's
STATUS_CODES. A new server status without a client type fails here instead of reaching callers
as the generic LlamaGrpcError.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

import llama_grpc_server
from llama_grpc import LlamaGrpcError
from llama_grpc.errors import from_rpc_error
from llama_grpc_server import errors
from llama_grpc_server.rpc.plumbing import status


def _all_subclasses(cls: type[errors.ServiceError]) -> Iterator[type[errors.ServiceError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _server_errors() -> list[type[errors.ServiceError]]:
    """ServiceError itself (unexpected exceptions are sent as it) and every subclass."""
    for module in pkgutil.walk_packages(llama_grpc_server.__path__, "llama_grpc_server."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found = {errors.ServiceError, *_all_subclasses(errors.ServiceError)}
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


SERVER_ERRORS = _server_errors()
SERVER_CODES = sorted({cls.code for cls in SERVER_ERRORS} | set(status.STATUS_CODES))


class _FailedCall(grpc.RpcError):
    """What a finished grpc call exposes of its status (code, details, trailers)."""

    def __init__(self, sent: Any) -> None:
        self._sent = sent

    def code(self) -> grpc.StatusCode:
        code: grpc.StatusCode = self._sent.code
        return code

    def details(self) -> str:
        return str(self._sent.details)

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(self._sent.trailing_metadata)


class _Bare:
    """A status with no google.rpc details, as a proxy or grpc itself would send it."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.details = "plain"
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()


def test_the_enumeration_finds_the_server_statuses() -> None:
    """Guard against an empty walk: the known classes and codes are all found."""
    names = {cls.__name__ for cls in SERVER_ERRORS}
    assert {"ServiceError", "DuplicateRequest", "Overloaded", "NotReady"} <= names
    assert {"ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "INTERNAL"} <= set(SERVER_CODES)


@pytest.mark.parametrize("server_error", SERVER_ERRORS, ids=lambda cls: cls.__name__)
def test_every_service_error_code_is_sent_as_itself(
    server_error: type[errors.ServiceError],
) -> None:
    """A code missing from STATUS_CODES would silently go out as INTERNAL."""
    assert server_error.code in status.STATUS_CODES
    assert status.STATUS_CODES[server_error.code].name == server_error.code


@pytest.mark.parametrize("server_error", SERVER_ERRORS, ids=lambda cls: cls.__name__)
def test_every_service_error_maps_to_a_typed_client_error(
    server_error: type[errors.ServiceError],
) -> None:
    """The status the server builds for each ServiceError (ErrorInfo, RequestInfo, ...)
    becomes a specific client class whose code is the one sent."""
    sent = rpc_status.to_status(status.build_status(server_error("boom"), "rid-1"))
    error = from_rpc_error(_FailedCall(sent))
    assert type(error) is not LlamaGrpcError
    assert isinstance(error, LlamaGrpcError)
    assert (error.code, error.reason, error.request_id) == (
        server_error.code,
        server_error.reason,
        "rid-1",
    )
    assert type(error).default_code == server_error.code


@pytest.mark.parametrize("code_name", SERVER_CODES)
def test_every_server_code_alone_maps_to_a_typed_client_error(code_name: str) -> None:
    """Without details (a proxy, or grpc itself) the code alone still picks a specific class."""
    error = from_rpc_error(_FailedCall(_Bare(grpc.StatusCode[code_name])))
    assert type(error) is not LlamaGrpcError
    assert type(error).default_code == code_name == error.code
