"""Re-quantize a GGUF file with llama.cpp (llama_model_quantize): how the tests get a second,
different real model from the embedded one without downloading anything."""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

import llama_cpp

from llama_grpc_server.engine import logs
from llama_grpc_server.models.gguf_header import FILE_TYPES

_FTYPES = {name: number for number, name in FILE_TYPES.items()}


class QuantizeError(RuntimeError):
    """llama.cpp refused or failed to quantize the file."""


def ftype_of(name: str) -> int:
    """The llama_ftype number of a quantization name (Q8_0, Q4_0, Q4_K_M, F16...)."""
    try:
        return _FTYPES[name.upper()]
    except KeyError:
        known = ", ".join(sorted(_FTYPES))
        raise QuantizeError(f"unknown quantization {name!r}; known: {known}") from None


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str) -> Path:
    """Write `src` quantized to `ftype` at `dst`, atomically: llama.cpp writes a temporary file
    next to dst, renamed over it only when complete. Already-quantized tensors are requantized
    (allow_requantize): dequantized to F32, then quantized again."""
    dst = Path(dst)
    logs.install(debug=False)  # llama.cpp logs a line per tensor at info level
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_of(ftype)
    params.allow_requantize = True
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        status = llama_cpp.llama_model_quantize(
            os.fsencode(src), os.fsencode(tmp), ctypes.byref(params)
        )
        if status != 0:
            raise QuantizeError(f"llama_model_quantize({src} -> {ftype}) returned {status}")
        os.chmod(tmp, 0o644)  # mkstemp made it owner-only
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dst
