"""The Grafana dashboard (deploy/grafana/llama-grpc.json) and its panels, rows unfolded, for the
e2e tests that check its queries against a real server and Prometheus. Shared by several test
modules (until now in tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llama-grpc.json"


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every non-row panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel
