"""Client and AsyncClient expose one call surface: the same public methods with the same
parameters (names, kinds, defaults, annotations), return types, tokenize overloads and docstrings,
apart from what asyncio changes (aclose/async with, AsyncStream, grpc.aio.Channel, coroutines).
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest

from llama_grpc import AsyncClient, Client
from llama_grpc.client import _Surface

# the asyncio name of a sync name: methods, and words in annotations and docstrings
ASYNC_NAMES = {
    "close": "aclose",
    "__enter__": "__aenter__",
    "__exit__": "__aexit__",
    "Stream": "AsyncStream",
    "ChatStream": "AsyncChatStream",
    "LoadStream": "AsyncLoadStream",
    "grpc.Channel": "grpc.aio.Channel",
}
STREAMS = frozenset({"AsyncStream", "AsyncChatStream", "AsyncLoadStream"})


def _sync_text(text: str) -> str:
    """`text` with each asyncio name written as its sync name."""
    for sync, async_ in ASYNC_NAMES.items():
        text = re.sub(rf"(?<![\w.]){re.escape(async_)}(?!\w)", sync, text)
    return text


def _surface(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods of `cls`, plus its context-manager methods, by their sync names."""
    methods = {
        name: member
        for name, member in vars(cls).items()
        if callable(member) and (not name.startswith("_") or name.endswith("__"))
    }
    return {_sync_text(name): method for name, method in methods.items()}


def _shape(signature: inspect.Signature) -> list[tuple[str, Any, Any, str]]:
    """(name, kind, default, annotation) per parameter, then the return annotation."""
    rows = [
        (p.name, p.kind, p.default, _sync_text(str(p.annotation)))
        for p in signature.parameters.values()
    ]
    return [*rows, ("return", None, None, _sync_text(str(signature.return_annotation)))]


SYNC = _surface(Client)
ASYNC = _surface(AsyncClient)


def test_both_clients_have_the_same_methods() -> None:
    assert sorted(SYNC) == sorted(ASYNC)
    assert {"__init__", "close", "__enter__", "__exit__", "generate", "tokenize"} <= set(SYNC)


@pytest.mark.parametrize("name", sorted(SYNC))
def test_same_parameters_defaults_and_annotations(name: str) -> None:
    sync, async_ = SYNC[name], ASYNC.get(name)
    assert async_ is not None, f"AsyncClient has no {name}"
    assert _shape(inspect.signature(sync)) == _shape(inspect.signature(async_))


@pytest.mark.parametrize("name", sorted(SYNC))
def test_same_overloads(name: str) -> None:
    sync, async_ = SYNC[name], ASYNC[name]
    sync_overloads = [_shape(inspect.signature(f)) for f in typing.get_overloads(sync)]
    async_overloads = [_shape(inspect.signature(f)) for f in typing.get_overloads(async_)]
    assert sync_overloads == async_overloads
    assert name != "tokenize" or len(sync_overloads) == 2


@pytest.mark.parametrize("name", sorted(SYNC))
def test_async_methods_are_coroutines_unless_they_return_a_stream(name: str) -> None:
    sync, async_ = SYNC[name], ASYNC[name]
    assert not inspect.iscoroutinefunction(sync)
    returns_stream = inspect.signature(async_).return_annotation in STREAMS
    is_sync_protocol = name == "__init__"
    assert inspect.iscoroutinefunction(async_) is not (returns_stream or is_sync_protocol)


@pytest.mark.parametrize("name", sorted(set(SYNC) - {"__init__"}))
def test_same_docstrings(name: str) -> None:
    """AsyncClient.__init__ refers to Client's; every other docstring says the same."""
    assert _sync_text(ASYNC[name].__doc__ or "") == (SYNC[name].__doc__ or "")


def test_every_call_is_defined_once_in_the_surface() -> None:
    """Each RPC method of the clients builds its call in _Surface (the shells only run it)."""
    calls = set(SYNC) - {"__init__", "close", "__enter__", "__exit__"}
    defined = {name for name in vars(_Surface) if not name.startswith("_")}
    assert calls == defined
