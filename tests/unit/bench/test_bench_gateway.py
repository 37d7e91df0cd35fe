"""bench/gateway.py's analysis on synthetic runs: which way the ratio goes, added TTFT, CPU per
token and cores (the benchmark itself needs SMG and a quiet machine: `make bench-gateway`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from gateway import analyse


def run(path: str, rep: int, wall_s: float, ttft_s: list[float], **cpu: float) -> dict[str, Any]:
    return {
        "path": path,
        "rep": rep,
        "wall_s": wall_s,
        "tokens": len(ttft_s) * 10,
        "ttft_s": ttft_s,
        "smg_cpu_s": cpu.get("smg", 0.0),
        "replica_cpu_s": cpu.get("replica", 0.0),
        "client_cpu_s": cpu.get("client", 0.0),
        "load_1m": 1.0,
        "same_text": 2,
    }


def test_ratio_ttft_and_cpu_per_token() -> None:
    runs = [
        run("direct", 0, 1.0, [0.010, 0.020], smg=0.001, replica=0.8),
        run("gateway", 0, 1.25, [0.013, 0.024], smg=0.010, replica=0.9),
        run("gateway", 1, 1.0, [0.011, 0.021], smg=0.010, replica=0.9),
        run("direct", 1, 1.0, [0.010, 0.020], smg=0.001, replica=0.8),
        run("direct", 2, 2.0, [0.010, 0.020], smg=0.002, replica=1.6),
        run("gateway", 2, 2.0, [0.012, 0.022], smg=0.020, replica=1.8),
    ]
    row = analyse(2, 10, runs)
    assert row["ratio"] == pytest.approx(1.0 / 1.25)  # gateway / direct tok/s: the medians
    assert row["ratio_per_rep"] == pytest.approx([0.8, 1.0, 1.0])
    assert row["gateway_tok_s"] == pytest.approx(20 / 1.25)
    assert row["direct_tok_s"] == pytest.approx(20.0)
    # every stream of every repetition pooled: p50 13 - 10 ms, p95 24 - 20 ms
    assert row["added_ttft_p50_ms"] == pytest.approx(3.0)
    assert row["added_ttft_p95_ms"] == pytest.approx(4.0)
    assert row["added_ttft_p50_ms_per_rep"] == pytest.approx([3.5, 1.0, 2.0])
    # 40 ms of SMG CPU over 60 gateway tokens; 4.25 wall seconds of gateway runs
    assert row["smg_cpu_ms_per_token"] == pytest.approx(40 / 60)
    assert row["smg_cores"] == pytest.approx(0.040 / 4.25)
    assert row["smg_idle_cores"] == pytest.approx(0.004 / 4.0)
    assert row["smg_cores_at_direct_tok_s"] == pytest.approx(40 / 60 * 20 / 1000)
    assert row["replica_cpu_ms_per_token"] == pytest.approx({"direct": 3200 / 60, "gateway": 60.0})
    assert (row["same_text"], row["streams"]) == (6, 6)


def test_every_repetition_needs_both_paths() -> None:
    with pytest.raises(ValueError, match="each path"):
        analyse(1, 10, [run("direct", 0, 1.0, [0.01]), run("gateway", 1, 1.0, [0.01])])
