"""gguf_header: hand-written GGUF bytes -> metadata, parameter count, the fields `models list`
shows; bad files raise GGUFError naming the file (no llama.cpp, no model)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from llama_grpc_server.models.gguf_header import ArraySummary, GGUFError, format_count, read_header
from tests.support.gguf_files import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    gguf_bytes,
    model_metadata,
    write_model,
)


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_every_value_type_is_read(tmp_path: Path) -> None:
    """Each scalar type, strings, small arrays (nested too) come back as Python values."""
    meta = {
        "u8": (UINT8, 255), "i8": (INT8, -128), "u16": (UINT16, 65535), "i16": (INT16, -32768),
        "u32": (UINT32, 2**32 - 1), "i32": (INT32, -(2**31)), "f32": (FLOAT32, 0.5),
        "bool": (BOOL, True), "str": (STRING, "héllo"), "u64": (UINT64, 2**64 - 1),
        "i64": (INT64, -(2**63)), "f64": (FLOAT64, 1e-300),
        "small": (ARRAY, (INT32, [1, -2, 3])),
        "nested": (ARRAY, (ARRAY, [(STRING, ["a", "b"]), (UINT8, [7])])),
        "empty": (ARRAY, (FLOAT32, [])),
    }  # fmt: skip
    header = read_header(write(tmp_path, gguf_bytes(meta)))  # type: ignore[arg-type]
    assert header.metadata == {key: v for key, (_, v) in meta.items() if key not in
                               ("small", "nested", "empty")} | {
        "small": (1, -2, 3),
        "nested": (("a", "b"), (7,)),
        "empty": (),
    }  # fmt: skip


def test_long_arrays_are_summarized_not_read(tmp_path: Path) -> None:
    """A vocabulary-sized array becomes ArraySummary(type, length); later keys still parse."""
    meta = {
        "tokenizer.ggml.tokens": (ARRAY, (STRING, [f"tok{i}" for i in range(1000)])),
        "tokenizer.ggml.scores": (ARRAY, (FLOAT32, [0.0] * 1000)),
        "pairs": (ARRAY, (ARRAY, [(UINT8, [1, 2])] * 20)),
        "after": (STRING, "still here"),
    }
    header = read_header(write(tmp_path, gguf_bytes(meta)))  # type: ignore[arg-type]
    assert header.metadata["tokenizer.ggml.tokens"] == ArraySummary("string", 1000)
    assert header.metadata["tokenizer.ggml.scores"] == ArraySummary("float32", 1000)
    assert header.metadata["pairs"] == ArraySummary("array", 20)
    assert header.metadata["after"] == "still here"
    assert str(header.metadata["tokenizer.ggml.tokens"]) == "[1000 x string]"


def test_model_fields(tmp_path: Path) -> None:
    """Architecture, name, quantization (llama_ftype name), context length, chat template,
    parameters summed over the tensor table, file size, version."""
    path = write_model(tmp_path / "m.gguf", "qwen2", file_type=7, ctx=32768, template="{{x}}")
    header = read_header(path)
    assert (header.architecture, header.name) == ("qwen2", "Tiny qwen2")
    assert (header.quantization, header.file_type) == ("Q8_0", 7)
    assert header.context_length == 32768
    assert header.has_chat_template
    assert (header.n_params, header.tensor_count, header.version) == (40, 2, 3)
    assert header.file_size == path.stat().st_size
    assert header.size_label == "40"


@pytest.mark.parametrize(
    ("file_type", "name"),
    [(0, "F32"), (1, "F16"), (2, "Q4_0"), (15, "Q4_K_M"), (18, "Q6_K"), (32, "BF16"),
     (1024 + 15, "Q4_K_M"), (999, "ftype 999")],
)  # fmt: skip
def test_quantization_names_follow_llama_ftype(tmp_path: Path, file_type: int, name: str) -> None:
    path = write_model(tmp_path / "m.gguf", file_type=file_type)
    assert read_header(path).quantization == name


def test_missing_fields_are_empty_and_size_label_wins(tmp_path: Path) -> None:
    """No file_type, context length or template: "", 0, False; general.size_label is used as
    given; version 2 files read too."""
    meta = {"general.architecture": (STRING, "x"), "general.size_label": (STRING, "7B")}
    header = read_header(write(tmp_path, gguf_bytes(meta, version=2)))  # type: ignore[arg-type]
    assert (header.quantization, header.context_length, header.has_chat_template) == ("", 0, False)
    assert (header.size_label, header.version, header.n_params) == ("7B", 2, 0)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "empty"),
        (b"PK\x03\x04" + b"\0" * 60, "bad magic"),
        (gguf_bytes({}, version=1), "unsupported GGUF version 1"),
        (gguf_bytes({"k": (STRING, "v")})[:-1], "truncated"),
        (gguf_bytes(model_metadata())[:200], "truncated"),
        (gguf_bytes({}, [("t", (4, 4))])[:-4], "truncated"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + b"\x01\0\0\0\0\0\0\0k" + struct.pack("<I", 13),
         "unknown metadata value type 13"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + b"\xff" * 8, "truncated"),
    ],
)  # fmt: skip
def test_bad_files_raise_naming_the_file(tmp_path: Path, data: bytes, expected: str) -> None:
    path = write(tmp_path, data, "broken.gguf")
    with pytest.raises(GGUFError) as caught:
        read_header(path)
    assert str(path) in str(caught.value)
    assert expected in str(caught.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.gguf", tmp_path):
        with pytest.raises(GGUFError, match=re.escape(str(path))):
            read_header(path)


def test_format_count() -> None:
    assert [format_count(n) for n in (999, 1500, 268_098_176, 1_240_000_000, 70_000_000_000)] == [
        "999", "1.5K", "268M", "1.2B", "70B",
    ]  # fmt: skip


def test_arrays_named_full_are_read_whole_and_strictly(tmp_path: Path) -> None:
    """A long array named in `full` comes back element by element (strings, scalars); one not
    named stays a summary; a string that is not UTF-8 in a full array is an error."""
    tokens = [f"t{i}" for i in range(40)] + ["é▁"]
    meta = {
        "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)),
        "tokenizer.ggml.scores": (ARRAY, (FLOAT32, [float(-i) for i in range(41)])),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, [1] * 41)),
    }
    path = write(tmp_path, gguf_bytes(meta))
    header = read_header(path, full=("tokenizer.ggml.tokens", "tokenizer.ggml.scores"))
    assert header.metadata["tokenizer.ggml.tokens"] == tuple(tokens)
    assert header.metadata["tokenizer.ggml.scores"] == tuple(float(-i) for i in range(41))
    assert header.metadata["tokenizer.ggml.token_type"] == ArraySummary("int32", 41)
    bad = {"tokenizer.ggml.tokens": (ARRAY, (STRING, [b"ok"] * 20 + [b"\xff\xfe"]))}
    with pytest.raises(GGUFError, match=r"string 20 at offset \d+ is not UTF-8"):
        read_header(write(tmp_path, gguf_bytes(bad), "bad.gguf"), full=("tokenizer.ggml.tokens",))
