"""`python -m llama_grpc_server [options]`: the same as `llama-grpc serve [options]`."""

from __future__ import annotations

import sys

from llama_grpc_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
