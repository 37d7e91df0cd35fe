"""Shared test setup: tier markers by directory."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        if "model" in parts:
            item.add_marker(pytest.mark.model)
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)
