"""Requests protobuf refuses to parse (invalid UTF-8 in a string field, corrupt wire format)
become INVALID_ARGUMENT naming the field, instead of grpc's UNKNOWN "Unexpected DecodeError".

grpc calls a handler's request deserializer before the handler runs and answers UNKNOWN when it
raises. tolerant() wraps the deserializer so that it returns an Undecodable instead; the request
interceptor aborts with its error. Generic over messages: the field is found by walking the wire
bytes with the message's descriptor."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from llama_grpc_server import errors

Deserializer = Callable[[bytes], Any]

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_FIXED_SIZES = {_FIXED64: 8, _FIXED32: 4}
_MAX_VARINT_SHIFT = 63  # a varint has at most 10 bytes (64 bits)
NOT_UTF8 = "is not valid UTF-8"
CUT_SHORT = "is cut short or corrupt"


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a tolerant deserializer returns for bytes protobuf cannot parse."""

    error: errors.InvalidRequest


def tolerant(deserializer: Deserializer | None) -> Deserializer | None:
    """The deserializer, returning Undecodable instead of raising DecodeError."""
    if deserializer is None:
        return None
    message_type = getattr(deserializer, "__self__", None)  # Message.FromString is bound
    descriptor: Descriptor | None = getattr(message_type, "DESCRIPTOR", None)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(undecodable_error(descriptor, data, str(exc)))

    return deserialize


def undecodable_error(
    descriptor: Descriptor | None, data: bytes, reason: str
) -> errors.InvalidRequest:
    """The error for bytes protobuf refused with `reason`, naming the field when one is found."""
    found = bad_field(descriptor, data) if descriptor is not None else None
    if found is None:
        name = descriptor.full_name if descriptor is not None else "message"
        return errors.InvalidRequest(f"the request is not a valid {name}: {reason}")
    path, problem = found
    return errors.InvalidRequest(f"{path} {problem}", field=path)


def bad_field(descriptor: Descriptor, data: bytes) -> tuple[str, str] | None:
    """(path, problem) of the first field whose bytes protobuf refuses, the path written like
    "params.stopping.stop[2]": a string that is not UTF-8, or a field cut short. None when no
    field is to blame (an unknown field, a wire type protobuf rejects)."""
    try:
        return _walk(descriptor, bytes(data), "", Counter())
    except Exception:  # arbitrary bytes: a walker bug must not become a status of its own
        return None


class _CutShort(Exception):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > _MAX_VARINT_SHIFT:
            raise _CutShort
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _skip(data: bytes, pos: int, size: int) -> int:
    if pos + size > len(data):
        raise _CutShort
    return pos + size


def _is_repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)  # newer protobuf; `label` before
    if flag is None:
        return getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED
    return bool(flag)


def _walk(
    descriptor: Descriptor, data: bytes, prefix: str, seen: Counter[tuple[str, int]]
) -> tuple[str, str] | None:
    """`seen` counts the elements of each repeated field so far, across the whole request (a
    message field sent twice is merged, so its lists continue)."""
    pos = 0
    while pos < len(data):
        path = prefix or None
        try:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            field = descriptor.fields_by_number.get(number)
            if field is not None:
                index = seen[prefix, number]
                seen[prefix, number] += 1
                name = f"{field.name}[{index}]" if _is_repeated(field) else field.name
                path = f"{prefix}.{name}" if prefix else name
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
                continue
            if wire_type in _FIXED_SIZES:
                pos = _skip(data, pos, _FIXED_SIZES[wire_type])
                continue
            if wire_type != _LENGTH:
                return None  # groups and invalid wire types: nothing to name
            length, pos = _varint(data, pos)
            start, pos = pos, _skip(data, pos, length)
        except _CutShort:
            return (path, CUT_SHORT) if path is not None else None
        if field is None or path is None:
            continue
        chunk = data[start:pos]
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return path, NOT_UTF8
        elif field.message_type is not None:
            found = _walk(field.message_type, chunk, path, seen)
            if found is not None:
                return found
    return None
