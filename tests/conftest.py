"""Shared test setup: tier markers by directory, and helpers more than one tier uses (imported
as `from ..conftest import ...`)."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from llama_grpc_testkit.models import second_model_file, tiny_model_file


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


# -- the test models (llama_grpc_testkit.models builds them) --------------------------------------


@pytest.fixture(scope="session")
def second_model_path() -> Path:
    return second_model_file()


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
