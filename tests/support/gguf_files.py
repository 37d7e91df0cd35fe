"""Tiny GGUF files written by hand with struct, for the header reader, catalog and CLI tests.
A value is (type, value); an array is (ARRAY, (element type, [values])); tensors are
(name, dims) with no data after the header (the reader never looks at it)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
_FORMATS = {
    UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
    FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d",
}  # fmt: skip

Value = tuple[int, object]


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def value(kind: int, v: object) -> bytes:
    if kind == STRING:
        assert isinstance(v, str | bytes)
        return string(v)
    if kind == ARRAY:
        element, items = v  # type: ignore[misc]
        body = b"".join(value(element, item) for item in items)
        return struct.pack("<IQ", element, len(items)) + body
    return struct.pack(_FORMATS[kind], v)


def gguf_bytes(
    metadata: dict[str, Value],
    tensors: Sequence[tuple[str, Sequence[int]]] = (),
    *,
    version: int = 3,
    magic: bytes = b"GGUF",
) -> bytes:
    out = [magic, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, (kind, v) in metadata.items():
        out += [string(key), struct.pack("<I", kind), value(kind, v)]
    for offset, (name, dims) in enumerate(tensors):
        out += [string(name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims)]
        out.append(struct.pack("<IQ", 0, offset * 64))  # ggml type F32, data offset
    return b"".join(out)


def model_metadata(
    arch: str = "llama", *, file_type: int = 15, ctx: int = 4096, template: str | None = None
) -> dict[str, Value]:
    """The keys `models list` shows, for a small fake model."""
    meta: dict[str, Value] = {
        "general.architecture": (STRING, arch),
        "general.name": (STRING, f"Tiny {arch}"),
        "general.file_type": (UINT32, file_type),
        f"{arch}.context_length": (UINT32, ctx),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, [f"t{i}" for i in range(100)])),
    }
    if template is not None:
        meta["tokenizer.chat_template"] = (STRING, template)
    return meta


def write_model(path: Path, arch: str = "llama", **meta: object) -> Path:
    """A fake GGUF at `path` with two tensors (4x8 + 8 = 40 parameters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        gguf_bytes(model_metadata(arch, **meta), [("a.weight", (4, 8)), ("b.bias", (8,))])  # type: ignore[arg-type]
    )
    return path
