"""rpc.plumbing.decoding: bytes protobuf refuses become InvalidRequest naming the field at fault."""

from __future__ import annotations

import pytest

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.rpc.plumbing import decoding


def field(number: int, data: bytes) -> bytes:
    """A length-delimited field (these tests keep every length below 128: one-byte varints)."""
    assert len(data) < 128
    return bytes([number << 3 | 2, len(data)]) + data


def stop(data: bytes) -> bytes:  # GenerateRequest.params(3).stopping(2).stop(2)
    return field(3, field(2, field(2, data)))


@pytest.mark.parametrize(
    ("data", "path"),
    [
        (field(2, b"\xff"), "prompt"),
        (field(2, b"ok") + field(2, b"caf\xc3"), "prompt"),
        (stop(b"fine") + stop(b"\xed\xa0\x80"), "params.stopping.stop[1]"),
        (field(7, field(2, b"\xc0\xaf")), "messages[0].content"),
        (field(3, field(5, field(1, b"root ::= \xff"))), "params.grammar.gbnf"),
    ],
)
def test_invalid_utf8_names_the_string_field(data: bytes, path: str) -> None:
    with pytest.raises(Exception, match="UTF-8"):
        pb.GenerateRequest.FromString(data)
    assert decoding.bad_field(pb.GenerateRequest.DESCRIPTOR, data) == (path, decoding.NOT_UTF8)


def test_a_field_cut_short_is_named() -> None:
    data = b"\x1a\x05\x12\x09"  # params: 5 bytes promised, 2 given
    assert decoding.bad_field(pb.GenerateRequest.DESCRIPTOR, data) == (
        "params",
        decoding.CUT_SHORT,
    )


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x00", b"\xfa\x3e\x05ab", b"\x0f"])
def test_nothing_to_blame_gives_no_field(data: bytes) -> None:
    assert decoding.bad_field(pb.GenerateRequest.DESCRIPTOR, data) is None


def test_tolerant_deserializer_returns_undecodable_with_the_field() -> None:
    deserialize = decoding.tolerant(pb.TokenizeRequest.FromString)
    assert deserialize is not None
    assert deserialize(field(2, b"hi")) == pb.TokenizeRequest(text="hi")
    refused = deserialize(field(2, b"\xfe"))
    assert isinstance(refused, decoding.Undecodable)
    assert refused.error.code == "INVALID_ARGUMENT" and refused.error.field == "text"
    garbage = deserialize(b"\xff\xff")
    assert isinstance(garbage, decoding.Undecodable) and garbage.error.field is None
    assert "llama_grpc.v1.TokenizeRequest" in garbage.error.message
