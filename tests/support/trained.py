"""The trained models of the catalog (server/.../models/trained.py) for the tests whose words
matter: `trained_model_path("qwen2.5-coder-0.5b-instruct")`.

Each is fetched once per machine into the directory a server uses,
$XDG_CACHE_HOME/llama-grpc/models (~/.cache/...): a developer's `llama-grpc models fetch` serves
the tests and the other way round. The first call on a machine downloads and assembles it (the
0.5B: 491 MB, 17 s on the dev box); later calls look at the file's size only. Safe when several
pytest-xdist workers ask at once: models/assemble.py holds a file lock while assembling, the
others wait for it and take the finished file."""

from __future__ import annotations

import functools
from pathlib import Path

from llama_grpc_server.models import assemble, trained

QWEN_05B = trained.QWEN_CODER_05B.name
QWEN_15B = trained.QWEN_CODER_15B.name


@functools.cache
def trained_model_path(name: str) -> Path:
    """The trained model's GGUF file, fetched the first time on this machine (progress on
    stderr). KeyError for a name the catalog does not have; FetchError when it cannot be
    fetched (no network on a machine that has not fetched it yet)."""
    model = trained.find(name)
    if model is None:
        raise KeyError(f"not a trained model: {name!r} (trained: {', '.join(trained.names())})")
    return assemble.fetch(model)
