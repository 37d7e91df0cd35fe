"""LoRA adapters in the client: the `lora` keyword of every generation call (the LoraAdapter
messages it builds, the shapes it refuses), the adapter admin calls (LoadAdapter, UnloadAdapter,
ListAdapters: their requests and results, sync over grpc_testing and async over a scripted
grpc.aio server) and the Adapter value (from its message, and in Stats)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import grpc_testing
import pytest

from llama_grpc import Adapter, AsyncClient, Client
from llama_grpc.client import build_request, lora_adapters
from llama_grpc.types import adapter_from_proto, stats_from_proto
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from tests.support.client import UnaryScript, channel, client, executor, rpc_method, unary

__all__ = ["channel", "client", "executor", "unary"]  # fixtures

ADAPTER = pb.Adapter(
    name="sql",
    path="/adapters/sql.gguf",
    default_scale=0.75,
    rank=16,
    alpha=32.0,
    num_tensors=196,
    size_bytes=13_000_000,
    sha256="0123456789abcdef",
    model="qwen",
    requests=5,
    generated_tokens=240,
    passes=61,
)
ADAPTER_VALUE = Adapter(
    name="sql",
    path="/adapters/sql.gguf",
    default_scale=0.75,
    rank=16,
    alpha=32.0,
    num_tensors=196,
    size_bytes=13_000_000,
    sha256="0123456789abcdef",
    model="qwen",
    requests=5,
    generated_tokens=240,
    passes=61,
)


def _lora(lora: Any) -> list[pb.LoraAdapter]:
    """params.lora of a GenerateRequest built with `lora`."""
    return list(build_request(pb.GenerateRequest(prompt="p"), {"lora": lora}).params.lora)


# --- the lora keyword ----------------------------------------------------------------------


def test_a_mapping_gives_one_adapter_per_entry_with_its_scale() -> None:
    assert _lora({"a": 0.5}) == [pb.LoraAdapter(name="a", scale=0.5)]
    assert _lora({"a": 0.5, "b": -1}) == [
        pb.LoraAdapter(name="a", scale=0.5),
        pb.LoraAdapter(name="b", scale=-1.0),
    ]


def test_a_bare_name_leaves_the_scale_unset() -> None:
    """A name alone (or with None) sends no scale: the server applies the adapter's default."""
    for lora in ("a", ["a"], [("a", None)], {"a": None}):
        (adapter,) = _lora(lora)
        assert adapter.name == "a"
        assert not adapter.HasField("scale"), lora


def test_a_zero_scale_is_sent_as_set() -> None:
    """scale 0 (the base model's output) is a value, not "unset"."""
    (adapter,) = _lora({"a": 0})
    assert adapter.HasField("scale")
    assert adapter.scale == 0.0


def test_a_sequence_mixes_names_and_pairs_in_order() -> None:
    assert _lora(["a", ("b", 0.25), ["c", 2]]) == [
        pb.LoraAdapter(name="a"),
        pb.LoraAdapter(name="b", scale=0.25),
        pb.LoraAdapter(name="c", scale=2.0),
    ]


@pytest.mark.parametrize("lora", [None, [], {}, ()])
def test_none_or_empty_sends_nothing(lora: Any) -> None:
    """No adapters: no params message at all (the base model, and the server's defaults)."""
    request = build_request(pb.GenerateRequest(prompt="p"), {"lora": lora})
    assert not request.HasField("params")


def test_every_generation_request_takes_lora() -> None:
    """GenerateTokens and StreamGenerate requests are built with the same keyword."""
    tokens = build_request(pb.GenerateTokensRequest(token_ids=[1]), {"lora": {"a": 0.5}})
    streamed = build_request(pb.StreamGenerateRequest(prompt="p"), {"lora": "a"})
    assert list(tokens.params.lora) == [pb.LoraAdapter(name="a", scale=0.5)]
    assert list(streamed.params.lora) == [pb.LoraAdapter(name="a")]


@pytest.mark.parametrize(
    ("lora", "error", "match"),
    [
        (3, TypeError, "lora must be an adapter's name, a {name: scale} mapping"),
        (b"a", TypeError, "not bytes"),
        ({"a"}, TypeError, "not set"),
        (("a", 0.5), TypeError, r"a single pair goes in a list: lora=\[\(name, scale\)\]"),
        ([("a", 0.5, 1)], TypeError, "a name or a \\(name, scale\\) pair"),
        ([3], TypeError, "a name or a \\(name, scale\\) pair, not 3"),
        ({3: 0.5}, TypeError, "name must be a str, not 3"),
        ([("a", "0.5")], TypeError, "the scale of lora adapter 'a' must be a number"),
        ({"a": True}, TypeError, "must be a number, not True"),
        ("", ValueError, "must not be empty"),
        ({"a": math.nan}, ValueError, "must be a finite number"),
        ({"a": math.inf}, ValueError, "must be a finite number"),
        (["a", ("a", 0.5)], ValueError, "lora names adapter 'a' twice"),
    ],
)
def test_bad_shapes_raise_before_any_rpc(lora: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        lora_adapters(lora)
    with pytest.raises(error, match=match):
        build_request(pb.GenerateRequest(prompt="p"), {"lora": lora})


def test_generate_sends_lora(client: Client, unary: UnaryScript) -> None:
    _, request, _ = unary(
        lambda: client.generate("p", lora=["a", ("b", 0.5)]), "Generate", pb.GenerateResponse()
    )
    assert list(request.params.lora) == [
        pb.LoraAdapter(name="a"),
        pb.LoraAdapter(name="b", scale=0.5),
    ]


def test_chat_sends_lora(client: Client, unary: UnaryScript) -> None:
    _, request, _ = unary(
        lambda: client.chat([("user", "hi")], lora={"a": 1.5}), "Generate", pb.GenerateResponse()
    )
    assert list(request.params.lora) == [pb.LoraAdapter(name="a", scale=1.5)]


@pytest.mark.parametrize("method", ["stream", "stream_chat", "generate_tokens"])
def test_streaming_calls_send_lora(
    client: Client, channel: grpc_testing.Channel, method: str
) -> None:
    """stream(), stream_chat() and generate_tokens() carry lora in their requests too."""
    first: Any = {"stream": "p", "stream_chat": [("user", "hi")], "generate_tokens": [1, 2]}
    rpc_name = "GenerateTokens" if method == "generate_tokens" else "StreamGenerate"
    stream = getattr(client, method)(first[method], lora={"a": 0.5})
    _, request, rpc = channel.take_unary_stream(rpc_method(rpc_name))
    stream.close()
    rpc.terminate((), grpc.StatusCode.OK, "")
    assert list(request.params.lora) == [pb.LoraAdapter(name="a", scale=0.5)]


# --- Adapter values ------------------------------------------------------------------------


def test_adapter_has_every_field_of_the_message() -> None:
    assert [f.name for f in dataclasses.fields(Adapter)] == [
        f.name for f in pb.Adapter.DESCRIPTOR.fields
    ]
    assert adapter_from_proto(ADAPTER) == ADAPTER_VALUE


def test_stats_carry_the_adapters_and_switches() -> None:
    stats = stats_from_proto(pb.GetStatsResponse(adapters=[ADAPTER], adapter_switches=9))
    assert stats.adapters == (ADAPTER_VALUE,)
    assert stats.adapter_switches == 9
    bare = stats_from_proto(pb.GetStatsResponse())
    assert (bare.adapters, bare.adapter_switches) == ((), 0)


# --- admin calls, sync (grpc_testing) ------------------------------------------------------


def test_load_adapter_sends_its_fields_and_returns_the_adapter(
    client: Client, unary: UnaryScript
) -> None:
    _, request, adapter = unary(
        lambda: client.load_adapter("sql", "/adapters/sql.gguf", model="qwen", default_scale=0.75),
        "LoadAdapter",
        pb.LoadAdapterResponse(adapter=ADAPTER),
    )
    assert request == pb.LoadAdapterRequest(
        model="qwen", name="sql", path="/adapters/sql.gguf", default_scale=0.75
    )
    assert adapter == ADAPTER_VALUE


def test_load_adapter_without_a_scale_leaves_it_unset(client: Client, unary: UnaryScript) -> None:
    """No default_scale: unset (the server's 1), and no model: the default one ("")."""
    _, request, _ = unary(
        lambda: client.load_adapter("sql", "/a.gguf"), "LoadAdapter", pb.LoadAdapterResponse()
    )
    assert request == pb.LoadAdapterRequest(name="sql", path="/a.gguf")
    assert not request.HasField("default_scale")


def test_load_adapter_refuses_a_bad_default_scale(client: Client) -> None:
    with pytest.raises(ValueError, match="default_scale must be a finite number"):
        client.load_adapter("sql", "/a.gguf", default_scale=math.nan)
    with pytest.raises(TypeError, match="default_scale must be a number"):
        client.load_adapter("sql", "/a.gguf", default_scale="1")  # type: ignore[arg-type]


def test_unload_adapter_returns_the_requests_in_flight(client: Client, unary: UnaryScript) -> None:
    _, request, in_flight = unary(
        lambda: client.unload_adapter("sql", model="qwen"),
        "UnloadAdapter",
        pb.UnloadAdapterResponse(in_flight=3),
    )
    assert request == pb.UnloadAdapterRequest(model="qwen", name="sql")
    assert in_flight == 3


def test_list_adapters_returns_a_list_of_adapters(client: Client, unary: UnaryScript) -> None:
    other = pb.Adapter(name="chat", model="qwen")
    _, request, adapters = unary(
        lambda: client.list_adapters(model="qwen"),
        "ListAdapters",
        pb.ListAdaptersResponse(adapters=[ADAPTER, other]),
    )
    assert request == pb.ListAdaptersRequest(model="qwen")
    assert adapters == [ADAPTER_VALUE, adapter_from_proto(other)]
    _, request, adapters = unary(client.list_adapters, "ListAdapters", pb.ListAdaptersResponse())
    assert (request, adapters) == (pb.ListAdaptersRequest(), [])


# --- admin calls and lora, async (a scripted grpc.aio server) ------------------------------


class AdapterServicer(pb_grpc.LlmServiceServicer):
    """Records each request by RPC name and answers with fixed values."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        self.requests["Generate"] = request
        return pb.GenerateResponse(text="ok")

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: Any
    ) -> pb.LoadAdapterResponse:
        self.requests["LoadAdapter"] = request
        return pb.LoadAdapterResponse(adapter=ADAPTER)

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: Any
    ) -> pb.UnloadAdapterResponse:
        self.requests["UnloadAdapter"] = request
        return pb.UnloadAdapterResponse(in_flight=2)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: Any
    ) -> pb.ListAdaptersResponse:
        self.requests["ListAdapters"] = request
        return pb.ListAdaptersResponse(adapters=[ADAPTER])


@pytest.fixture
async def adapter_server() -> AsyncIterator[tuple[str, AdapterServicer]]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = AdapterServicer()
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


async def test_async_admin_calls_send_their_fields(
    adapter_server: tuple[str, AdapterServicer],
) -> None:
    target, servicer = adapter_server
    async with AsyncClient(target, timeout=10) as client:
        loaded = await client.load_adapter("sql", "/a.gguf", model="qwen", default_scale=0.5)
        in_flight = await client.unload_adapter("sql", model="qwen")
        listed = await client.list_adapters()
        await client.generate("p", lora={"sql": 0.5})
    assert servicer.requests["LoadAdapter"] == pb.LoadAdapterRequest(
        model="qwen", name="sql", path="/a.gguf", default_scale=0.5
    )
    assert servicer.requests["UnloadAdapter"] == pb.UnloadAdapterRequest(model="qwen", name="sql")
    assert servicer.requests["ListAdapters"] == pb.ListAdaptersRequest()
    assert list(servicer.requests["Generate"].params.lora) == [
        pb.LoraAdapter(name="sql", scale=0.5)
    ]
    assert (loaded, in_flight, listed) == (ADAPTER_VALUE, 2, [ADAPTER_VALUE])
