"""Read a GGUF file's header (metadata and tensor table) without loading weights or llama.cpp,
so `llama-grpc models list` can describe a directory of models in milliseconds.

The file is memory-mapped and parsed in place: a 262k-token vocabulary array is skipped by
walking its string lengths, never materialized (about 40 ms for the embedded model), unless the
caller names its key in `full` (tokenizer_export.py reads the vocabulary so, in ~0.3 s). Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3; version 1 used
32-bit counts and is long gone).

The format's tables (magic, value types and their numpy types, llama_ftype names) are the gguf
package's. Its GGUFReader is not used to parse: it builds numpy views of every field, each
string of a vocabulary too (about a minute over the embedded model's 262k tokens, measured on a
busy 2-core machine, where this reader takes ~0.1 s)."""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType, LlamaFileType

MAGIC = struct.pack("<I", gguf.GGUF_MAGIC)  # b"GGUF"
VERSIONS = (2, 3)
SMALL_ARRAY = 16  # arrays up to this many elements are read; longer ones are summarized

# Metadata value types: fixed-size scalars (as little-endian numpy types), strings, arrays.
_SCALARS: dict[int, np.dtype[Any]] = {
    kind.value: np.dtype(scalar).newbyteorder("<")
    for kind, scalar in gguf.GGUFReader.gguf_scalar_to_np.items()
}
STRING, ARRAY = GGUFValueType.STRING.value, GGUFValueType.ARRAY.value
_U64 = struct.Struct("<Q")
TYPE_NAMES = {kind.value: kind.name.lower() for kind in GGUFValueType}  # 6: "float32"...

# general.file_type is a llama_ftype (llama.h): gguf's LlamaFileType (MOSTLY_Q4_K_M = 15...),
# and the ones llama.h (llama-cpp-python 0.3.36's) names that gguf 0.19 does not.
_FTYPES_NOT_IN_GGUF = {
    4: "Q4_1_SOME_F16", 33: "Q4_0_4_4", 34: "Q4_0_4_8", 35: "Q4_0_8_8", 41: "Q2_0",
}  # fmt: skip
FILE_TYPES: dict[int, str] = dict(sorted({
    **{t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in LlamaFileType
       if t is not LlamaFileType.GUESSED},
    **_FTYPES_NOT_IN_GGUF,
}.items()))  # fmt: skip


class GGUFError(ValueError):
    """The file is not a readable GGUF file; the message names the file."""


@dataclass(frozen=True, slots=True)
class ArraySummary:
    """A metadata array too long to be worth reading (a vocabulary, merges, scores)."""

    element_type: str
    length: int

    def __str__(self) -> str:
        return f"[{self.length} x {self.element_type}]"


MetaValue = int | float | bool | str | ArraySummary | tuple["MetaValue", ...]


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file says about itself, without its weights."""

    path: Path
    file_size: int
    version: int
    tensor_count: int
    metadata: Mapping[str, MetaValue]
    n_params: int  # sum of the tensors' element counts

    def _str(self, key: str) -> str:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else ""

    @property
    def architecture(self) -> str:
        return self._str("general.architecture")

    @property
    def name(self) -> str:
        return self._str("general.name")

    @property
    def size_label(self) -> str:
        """general.size_label ("270M") when the file has one, else from the tensor table."""
        return self._str("general.size_label") or (
            format_count(self.n_params) if self.n_params else ""
        )

    @property
    def file_type(self) -> int | None:
        value = self.metadata.get("general.file_type")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def quantization(self) -> str:
        """The llama_ftype name (Q4_K_M, Q8_0, F16...); "" when the file does not say."""
        ftype = self.file_type
        if ftype is None:
            return ""
        return FILE_TYPES.get(ftype & ~LlamaFileType.GUESSED, f"ftype {ftype}")

    @property
    def context_length(self) -> int:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    @property
    def has_chat_template(self) -> bool:
        return bool(self._str("tokenizer.chat_template"))


def format_count(n: int) -> str:
    """268098176 -> "268M", 1_200_000_000 -> "1.2B" (parameter counts)."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"  # noqa: PLR2004
    return str(n)


class _Reader:
    """A cursor over the mapped file; every read checks bounds (a short file is truncated)."""

    def __init__(self, data: mmap.mmap | bytes, full: Collection[str] = ()) -> None:
        self.data = data
        self.pos = 0
        self.full = full  # keys whose arrays are read whole, however long

    def scalar(self, dtype: np.dtype[Any]) -> int | float | bool:
        self.need(dtype.itemsize)
        value: int | float | bool = np.frombuffer(self.data, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return value

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def need(self, size: int) -> None:
        if self.pos + size > len(self.data):
            raise EOFError(f"needs {size} bytes at offset {self.pos}")

    def skip_string(self) -> None:
        n = self.u64()
        self.need(n)
        self.pos += n

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> MetaValue:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {kind} at offset {self.pos - 4}")

    def array(self) -> MetaValue:
        kind, length = self.u32(), self.u64()
        if length <= SMALL_ARRAY:
            return tuple(self.value(kind) for _ in range(length))
        self.skip(kind, length)
        return ArraySummary(TYPE_NAMES.get(kind, str(kind)), length)

    def whole_array(self) -> MetaValue:
        """An array of scalars or strings, every element (a 262k-token vocabulary: ~0.1 s)."""
        kind, length = self.u32(), self.u64()
        if kind in _SCALARS:
            dtype = _SCALARS[kind]
            size = dtype.itemsize * length
            self.need(size)
            values = np.frombuffer(self.data, dtype, length, self.pos).tolist()
            self.pos += size
            return tuple(values)
        if kind == STRING:
            return self._strings(length)
        raise ValueError(f"array of {TYPE_NAMES.get(kind, kind)} at offset {self.pos}")

    def _strings(self, length: int) -> tuple[str, ...]:
        """Strictly UTF-8 (a vocabulary must not change in decoding): ValueError otherwise."""
        data, pos, end, unpack = self.data, self.pos, len(self.data), _U64.unpack_from
        out = []
        for _ in range(length):
            if pos + 8 > end:
                raise EOFError(f"needs 8 bytes at offset {pos}")
            n = unpack(data, pos)[0]
            pos += 8
            if pos + n > end:
                raise EOFError(f"string runs past the end of the file at offset {pos}")
            try:
                out.append(str(data[pos : pos + n], "utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"string {len(out)} at offset {pos} is not UTF-8") from None
            pos += n
        self.pos = pos
        return tuple(out)

    def _skip_strings(self, length: int) -> None:
        """The hot loop of a vocabulary (262k strings): locals only, one bounds check each."""
        data, pos, end, unpack = self.data, self.pos, len(self.data), _U64.unpack_from
        for _ in range(length):
            if pos + 8 > end:
                raise EOFError(f"needs 8 bytes at offset {pos}")
            pos += 8 + unpack(data, pos)[0]
        if pos > end:
            raise EOFError(f"string runs past the end of the file at offset {pos}")
        self.pos = pos

    def skip(self, kind: int, length: int) -> None:
        """Step over `length` values of `kind` without building them."""
        if kind in _SCALARS:
            size = _SCALARS[kind].itemsize * length
            self.need(size)
            self.pos += size
        elif kind == STRING:
            self._skip_strings(length)
        elif kind == ARRAY:
            for _ in range(length):
                self.skip(self.u32(), self.u64())
        else:
            raise ValueError(f"unknown array element type {kind} at offset {self.pos}")


def _parse(reader: _Reader) -> tuple[int, int, dict[str, MetaValue], int]:
    """(version, tensor count, metadata, parameter count)."""
    if bytes(reader.data[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    reader.pos = 4
    version = reader.u32()
    if version not in VERSIONS:
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count, kv_count = reader.u64(), reader.u64()
    metadata: dict[str, MetaValue] = {}
    for _ in range(kv_count):
        key = reader.string()
        kind = reader.u32()
        metadata[key] = (
            reader.whole_array() if kind == ARRAY and key in reader.full else (reader.value(kind))
        )
    n_params = 0
    for _ in range(tensor_count):
        reader.skip_string()  # tensor name
        n_dims = reader.u32()
        dims = [reader.u64() for _ in range(n_dims)]
        reader.need(12)
        reader.pos += 12  # ggml_type (u32) + data offset (u64)
        n_params += math.prod(dims)
    return version, tensor_count, metadata, n_params


def read_header(path: str | os.PathLike[str], *, full: Collection[str] = ()) -> GGUFHeader:
    """Parse the header of the GGUF file at `path`; the arrays of the keys in `full` are read
    whole (scalars or strings), the other long ones summarized. GGUFError (naming the file) when
    it is missing, unreadable, not GGUF, of an unsupported version, or truncated."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(f"{path}: not a GGUF file (empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                version, tensor_count, metadata, n_params = _parse(_Reader(data, full))
    except OSError as exc:
        raise GGUFError(f"{path}: {exc.strerror or exc}") from None
    except EOFError as exc:
        raise GGUFError(f"{path}: truncated GGUF header ({exc})") from None
    except RecursionError:
        raise GGUFError(f"{path}: metadata arrays nested too deep") from None
    except ValueError as exc:  # GGUFError is one: keep its message
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{path}: {exc}") from None
    return GGUFHeader(path, size, version, tensor_count, metadata, n_params)
