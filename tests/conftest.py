"""Shared test setup: tier markers by directory, and helpers more than one tier uses (imported
as `from ..conftest import ...`)."""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from llama_grpc_testkit import synth_gguf


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        if "model" in parts:
            item.add_marker(pytest.mark.model)
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo configure_logging(): structlog defaults and the root logger's handlers and level."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


# -- a second real model ---------------------------------------------------------------------------

SECOND_MODEL_TYPE = "Q8_0"


def built_models_dir() -> Path:
    """Where built test models are kept between sessions (one build per machine)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / "test-models"


def second_model_file() -> Path:
    """The embedded model re-quantized to Q8_0 by llama.cpp: a second real model, with its own
    file, size, sha256 and quantization (same architecture and vocabulary). Built once per
    machine (1.6 s on the 2-core dev box), cached under ~/.cache/llama-grpc/test-models/ by
    the source's sha256; the write is atomic. The tests' fixture and the benchmarks use it."""
    from llama_grpc_server.engine.quantize import quantize
    from llama_grpc_server.models.files import default_model_path, file_sha256

    source = default_model_path()
    path = built_models_dir() / f"embedded-{file_sha256(source)[:16]}-{SECOND_MODEL_TYPE}.gguf"
    if not path.is_file():
        quantize(source, path, SECOND_MODEL_TYPE)
    return path


@pytest.fixture(scope="session")
def second_model_path() -> Path:
    return second_model_file()


# -- a tiny synthetic model -----------------------------------------------------------------------


def tiny_model_file() -> Path:
    """llama_grpc_testkit.synth_gguf's counting model (a Gemma 3 128 wide, 2 layers, a 1,024-token
    synthetic vocabulary): a forward pass costs microseconds where the embedded model's costs
    tens of milliseconds, and its greedy next token is always `synth_gguf.successor` of the last
    one by several nats, whatever the batch (never EOS: a stream runs to max_tokens). For the
    tests of statuses, token flow, cancellation, limits, streams and metrics, which do not read
    the words. Written once per machine under ~/.cache/llama-grpc/test-models/."""
    return synth_gguf.counting_model()


TINY_N_VOCAB = 1024  # synth_gguf.SHAPES["counting"].n_vocab (a test checks they agree)
TINY_BOS = 2  # synth_gguf.BOS


def counting(after: int, n: int) -> list[int]:
    """The tiny model's greedy output: the n tokens that follow token `after`."""
    out = [synth_gguf.successor(after, TINY_N_VOCAB)]
    while len(out) < n:
        out.append(synth_gguf.successor(out[-1], TINY_N_VOCAB))
    return out[:n]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return tiny_model_file()


# -- Prometheus ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str | bytes) -> Samples:
    """Every sample of an exposition as {(name, sorted labels): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> Samples:
    """GET http://127.0.0.1:<port>/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return samples(response.read())


def value(got: Samples, name: str, **labels: str) -> float:
    return got[(name, tuple(sorted(labels.items())))]


# -- structured output -----------------------------------------------------------------------------

YES_NO = 'root ::= "yes" | "no"'
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}


def check_person(value: object) -> None:
    """PERSON_SCHEMA by hand (no jsonschema dependency): exact keys, types, maxLength."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "member"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["member"], bool)
