"""Hypothesis strategies for any protobuf message, built from its Descriptor (hypothesis-pb does
not work with protobuf >= 4). Every field type: integers at their extremes, NaN/inf floats, odd
unicode, bytes, unknown enum numbers, nested messages to a bounded depth, maps, oneofs, and
repeated fields that are sometimes huge. A field added to the proto is covered without a change
here. Invalid UTF-8 cannot be put in a python message: see wire_string() for raw bytes."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
HUGE_SIZES = (1_000, 50_000)  # a huge repeated field or map repeats one drawn value this often
ODD_TEXT = (
    "",
    " ",
    "\x00",
    "\ufeff",
    "\u202e",
    "🦙" * 3,
    "e\u0301",
    "\U0010ffff",
    "\r\n",
    "<bos>",
    "<start_of_turn>",
    "x" * 300,  # longer than the 256-character limits on ids and stop strings
)
FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
ODD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -FLOAT32_MAX, FLOAT32_MAX)


def _integers(bits: int, *, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return st.sampled_from(sorted({low, -1 if signed else 0, 0, 1, high})) | st.integers(low, high)


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.CPPTYPE_INT32: _integers(32, signed=True),
    F.CPPTYPE_INT64: _integers(64, signed=True),
    F.CPPTYPE_UINT32: _integers(32, signed=False),
    F.CPPTYPE_UINT64: _integers(64, signed=False),
    F.CPPTYPE_FLOAT: st.sampled_from(ODD_FLOATS) | st.floats(width=32),
    F.CPPTYPE_DOUBLE: st.sampled_from(ODD_FLOATS) | st.floats(),
    F.CPPTYPE_BOOL: st.booleans(),
}


def _single(field: FieldDescriptor, depth: int, huge: bool) -> st.SearchStrategy[Any]:
    """One value of the field's type (one element when the field is repeated)."""
    if field.cpp_type == F.CPPTYPE_MESSAGE:
        return messages(field.message_type, depth - 1, huge)
    if field.cpp_type == F.CPPTYPE_ENUM:  # open enums: any int32 goes on the wire
        known = sorted(value.number for value in field.enum_type.values)
        return st.sampled_from(known) | _integers(32, signed=True)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.cpp_type == F.CPPTYPE_STRING:
        return st.sampled_from(ODD_TEXT) | st.text(max_size=64)
    return _SCALARS[field.cpp_type]


def _is_repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 6; `label` before
    return bool(field.label == F.LABEL_REPEATED if flag is None else flag)


def _repeat(value: Any, count: int) -> list[Any]:
    return [value] * count


def _huge_map(key: FieldDescriptor, value: Any, count: int) -> dict[Any, Any]:
    if key.cpp_type == F.CPPTYPE_STRING:
        return {str(i): value for i in range(count)}
    if key.cpp_type == F.CPPTYPE_BOOL:
        return {False: value, True: value}
    return dict.fromkeys(range(count), value)


def field_values(field: FieldDescriptor, depth: int, huge: bool) -> st.SearchStrategy[Any]:
    """What the field may be set to: a scalar or message, a list, or a dict for a map. A huge
    list or map repeats an element with no huge field inside it: huge within huge multiplies
    (50,000 requests each resuming 50,000 tokens took 23 GB in one protobuf call)."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        small = st.dictionaries(_single(key, depth, huge), _single(value, depth, huge), max_size=6)
        if not huge:
            return small
        many = st.builds(
            functools.partial(_huge_map, key),
            _single(value, depth, huge=False),
            st.sampled_from(HUGE_SIZES),
        )
        return small | small | small | many
    element = _single(field, depth, huge)
    if not _is_repeated(field):
        return element
    short = st.lists(element, max_size=6)
    if not huge:
        return short
    lone = _single(field, depth, huge=False)
    return short | short | short | st.builds(_repeat, lone, st.sampled_from(HUGE_SIZES))


def _is_real_oneof(oneof: OneofDescriptor) -> bool:
    """proto3 `optional` fields sit alone in a synthetic oneof named after them."""
    return len(oneof.fields) > 1 or oneof.name != f"_{oneof.fields[0].name}"


def _build(cls: type[Message], *parts: dict[str, Any]) -> Message:
    return cls(**{name: value for part in parts for name, value in part.items()})


@functools.cache
def messages(
    descriptor: Descriptor, depth: int = 3, huge: bool = True
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`: each field set or not, at most one member of each oneof; below
    `depth` nested messages are left empty; huge repeated fields and maps only when `huge`."""
    cls = GetMessageClass(descriptor)
    if depth <= 0:
        return st.builds(cls)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    oneofs: list[st.SearchStrategy[dict[str, Any]]] = []
    for oneof in filter(_is_real_oneof, descriptor.oneofs):
        members = [
            field_values(f, depth, huge).map(functools.partial(dict.fromkeys, [f.name]))
            for f in oneof.fields
        ]
        oneofs.append(st.one_of(st.just({}), *members))
    for field in descriptor.fields:
        if field.containing_oneof is None or not _is_real_oneof(field.containing_oneof):
            optional[field.name] = field_values(field, depth, huge)
    return st.builds(_build, st.just(cls), st.fixed_dictionaries({}, optional=optional), *oneofs)


def wire_string(number: int, data: bytes) -> bytes:
    """A length-delimited field on the wire (for strings protobuf will not hold: bad UTF-8)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
