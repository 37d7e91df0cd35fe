"""`python -m llama_grpc`: the same command line as `llama-grpc`."""

from __future__ import annotations

from llama_grpc.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
