"""bench/soak.py's pure logic on synthetic runs: how the injected stalls' calls are classified,
the verdict's checks (a collapse of tokens/s, fds that drift, a hang replica that was not
caught), the disk tier's per-minute figures, the summary's soak section for results of before
and after the stalls, and bench/soak_faults.py's slow disk (the soak itself needs a server and
minutes: `make bench-soak`)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import soak
import summary
from soak import Plan, disk_figures, reader_status, verdict

from llama_grpc.errors import ResourceExhaustedError


def plan(mode: str, max_tokens: int = 128) -> Plan:
    return Plan("p", [1], False, max_tokens, 0.0, True, mode, 300.0)


def test_reader_statuses() -> None:
    stalled = ResourceExhaustedError("read nothing for 8 s", reason="STALLED_READER")
    assert reader_status(plan("slow_reader"), "OK", 128, 1, None) == "OK_SLOW_READER"
    assert reader_status(plan("slow_reader"), "OK", 127, 1, None) == ""  # a token short
    assert reader_status(plan("slow_reader"), "OK", 128, 2, None) == ""
    assert reader_status(plan("stalled_reader", 256), "RESOURCE_EXHAUSTED", 70, 0, stalled) == (
        "STALLED_READER"
    )
    # read again before the server's clock ran out: served in full, rightly
    assert reader_status(plan("stalled_reader", 256), "OK", 256, 1, None) == "OK_SLOW_READER"
    # only a stalled reader may be ended so; a normal OK is not a reader's
    assert reader_status(plan("slow_reader"), "RESOURCE_EXHAUSTED", 70, 0, stalled) == ""
    assert reader_status(plan("normal"), "RESOURCE_EXHAUSTED", 70, 0, stalled) == ""
    assert reader_status(plan("normal"), "OK", 128, 1, None) == ""
    assert set(soak.SLOW_MODES) <= set(soak.MODES)
    assert {"OK_SLOW_READER", "STALLED_READER"} <= set(soak.EXPECTED)


def stats(**disk: float) -> SimpleNamespace:
    fields = {f"disk_cache_{k}": 0 for k in (*soak.DISK_COUNTERS, "entries", "bytes")}
    fields["disk_cache_read_seconds"] = 0.0
    fields.update({f"disk_cache_{k}": v for k, v in disk.items()})
    return SimpleNamespace(**fields)


def test_disk_figures_are_deltas_but_entries_and_bytes_are_held() -> None:
    before = stats(hits=3, writes=10, read_seconds=2.5, entries=7, bytes=100)
    after = stats(hits=5, writes=16, read_seconds=6.5, entries=9, bytes=150, read_failures=1)
    got = disk_figures(before, after)
    assert (got["hits"], got["writes"], got["read_failures"]) == (2, 6, 1)
    assert got["read_seconds"] == pytest.approx(4.0)
    assert (got["entries"], got["bytes"]) == (9, 150)


def minute(i: int, tok_s: float = 40.0, fds: int = 16, rss: int = 600 * 2**20) -> dict[str, Any]:
    return {
        "minute": i,
        "window_s": 60.0,
        "statuses": {"OK": 50, "OK_SLOW_READER": 3, "STALLED_READER": 1, "CANCELLED": 5},
        "tok_s": tok_s,
        "pause": {"still_in_flight": 0},
        "idle": {
            "rss_bytes": rss,
            "fds": fds,
            "kv": {"ok": True, "kv_cells_used": 900, "baseline_cached_prefix": 950},
        },
        "server": {"stream_pauses": 4, "stalled_readers": 1, "generated_tok_s": tok_s},
        "disk": {
            **dict.fromkeys(soak.DISK_COUNTERS, 0),
            "hits": 6,
            "writes": 30,
            "read_seconds": 4.2,
            "entries": 40,
            "bytes": 10**8,
        },
        "busy": {"rss_bytes": rss, "fds": fds},
        "load_average": [2.0, 2.0, 2.0],
    }


def hang(ok: bool = True) -> dict[str, Any]:
    streams = [
        {"code": "UNAVAILABLE", "reason": "ENGINE_HUNG", "seconds": 6.1, "ok": ok} for _ in range(3)
    ]
    return {
        "stream_bound_s": 15.0,
        "streams": streams,
        "watch": {"health_before": "SERVING", "not_serving_after_s": 6.0, "watchdog_trips": 1},
        "exit_code": 71 if ok else 0,
        "checks": {"every_stream_engine_hung_in_bound": ok, "exit_code_71": ok},
        "ok": ok,
    }


def result(**changes: Any) -> dict[str, Any]:
    rows = [minute(i) for i in range(1, 4)]
    for i, row_changes in changes.pop("rows", {}).items():
        rows[i].update(row_changes)
    data = {
        "minutes": rows,
        "end": {"hung": 0, "calls_started": 10, "calls_ended": 10, "workers_not_ended": 0},
        "probe": {"ok": True, "prompt_tokens": 8128, "seconds": 20.0},
        "slow_disk_read_s": 2.0,
        "hang_replica": hang(),
    }
    data.update(changes)
    return data


def test_verdict_passes_a_clean_run_with_its_stalls() -> None:
    v = verdict(result())
    assert v["passed"], v["checks"]
    assert v["checks"]["hang_replica_caught_exit_71"]
    assert v["disk_total"]["hits"] == 18
    assert v["disk_total"]["read_seconds"] == pytest.approx(12.6)
    assert v["stalled_readers_server"] == 3 and v["stream_pauses_server"] == 12


def test_verdict_fails_each_broken_promise() -> None:
    def failed(data: dict[str, Any]) -> set[str]:
        return {k for k, good in verdict(data)["checks"].items() if not good}

    assert failed(result(rows={2: {"tok_s": 15.0}})) == {"tok_s_never_below_half_median"}
    assert failed(result(rows={2: {"tok_s": 21.0}})) == set()  # above half the median
    fds_check = f"fds_end_within_{soak.FD_SLACK}_of_minute_2"
    assert failed(result(rows={2: {"idle": {**minute(3)["idle"], "fds": 30}}})) == {fds_check}
    assert failed(result(hang_replica=hang(ok=False))) == {"hang_replica_caught_exit_71"}
    no_disk = result()
    for row in no_disk["minutes"]:
        row["disk"]["hits"] = 0
    assert failed(no_disk) == {"slow_disk_read_from"}
    slow_unread = result()
    for row in slow_unread["minutes"]:
        row["disk"]["read_seconds"] = 0.01  # restores, but the stall never happened
    assert failed(slow_unread) == {"slow_disk_read_from"}
    no_stall = result()
    for row in no_stall["minutes"]:
        row["server"]["stalled_readers"] = 0
    assert failed(no_stall) == {"stalled_readers_ended"}
    unexpected = result()
    unexpected["minutes"][0]["statuses"]["UNEXPECTED_INTERNAL"] = 1
    assert failed(unexpected) == {"no_unexpected_status"}
    assert "hang_replica_caught_exit_71" not in verdict(result(hang_replica=None))["checks"]


def summary_data(data: dict[str, Any]) -> dict[str, Any]:
    args = {
        "minutes": 3,
        "minute_s": 60.0,
        "drain_s": 15.0,
        "probe_margin": 64,
        "stream_buffer_tokens": 32,
        "stalled_reader_s": 8.0,
        "hang_minute": 2,
        "slow_disk_read_s": 2.0,
        "slow_disk_period_s": 8.0,
        "hang_streams": 3,
        "streams": 64,
    }
    return {
        "benchmark": "soak",
        "command": "python bench/soak.py",
        "server_command": "SLOW_DISK_READ_S=2 python bench/soak_faults.py",
        "workload": soak.workload(SimpleNamespace(**args)),
        "settings": args,
        "pool": {"prompt_tokens_min": 10, "prompt_tokens_max": 1100, "prompt_tokens_median": 40},
        "machine": {},
        **data,
        "verdict": verdict(data),
    }


def test_summary_shows_the_stalls_and_reads_older_results(monkeypatch: Any) -> None:
    monkeypatch.setattr(summary, "header", lambda data, title, png: [f"## {title}"])
    text = "\n".join(summary.soak(summary_data(result())))
    assert "Injected stalls" in text and "| 3 / 1 |" in text and "| 6 / 30 / 4.2 |" in text
    assert "Hang replica caught: **met**" in text and "UNAVAILABLE ENGINE_HUNG in 6.1 s" in text
    assert "The slow disk was read from: **met** (18 restores" in text

    old = summary_data(result())  # a result of before the stalls: no disk, no reader checks
    for row in old["minutes"]:
        del row["disk"]
    for key in ("slow_disk", "hang_replica"):
        del old["workload"][key]
    old["verdict"] = copy.deepcopy(old["verdict"])
    for key in [k for k in old["verdict"]["checks"] if k not in ("no_hung_call",)]:
        if key.startswith(("slow", "stalled", "hang", "fds", "tok_s")):
            del old["verdict"]["checks"][key]
    text = "\n".join(summary.soak(old))
    assert "Injected stalls" not in text and "Hang replica" not in text and "| \u2013 |" in text


def test_the_slow_disk_stalls_once_a_period(monkeypatch: Any) -> None:
    path = list(sys.path)
    import soak_faults  # it takes bench/ off sys.path (a server must not import from it)

    sys.path[:] = path
    from llama_grpc_server.core.kv.disk import KvDiskStore

    reads: list[Path] = []
    monkeypatch.setattr(KvDiskStore, "_read_file", lambda self, p: reads.append(p) or b"x")
    sleeps: list[float] = []
    monkeypatch.setattr(soak_faults.time, "sleep", sleeps.append)
    clock = iter([0.0, 1.0, 9.0, 9.5, 20.0])
    monkeypatch.setattr(soak_faults.time, "monotonic", lambda: next(clock))
    soak_faults.slow_disk(2.0, 8.0)
    store = object.__new__(KvDiskStore)
    for _ in range(5):
        assert store._read_file(Path("f")) == b"x"
    assert sleeps == [2.0, 2.0, 2.0] and len(reads) == 5  # at 0, 9 and 20 s
