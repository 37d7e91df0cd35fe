"""bench/aiperf.py's pure parts: its arguments, the aiperf command, the summaries of aiperf's
export, of the direct runs, of the servers' counters and tick events, and the rows (the benchmark
itself needs aiperf, llama-server and SMG: `make bench-aiperf`)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from aiperf import (
    Setting,
    Timed,
    aiperf_command,
    build_parser,
    order_of,
    parse_lengths,
    parse_targets,
    pass_mix,
    rows_of,
    run_aiperf,
    summarise_aiperf,
    summarise_direct,
    tick_mix,
    vars_of,
)


def test_defaults_are_the_issues_matrix() -> None:
    args = build_parser().parse_args([])
    assert args.threads == [1, 2]
    assert args.concurrency == [1, 4, 8, 16]
    assert args.lengths == [(128, 256), (512, 64), (2048, 64)]
    assert args.targets == ["llama-server", "smg", "direct"]


def test_a_short_run_is_selectable() -> None:
    argv = [
        "--threads",
        "1",
        "--lengths",
        "512/64",
        "--concurrency",
        "4",
        "--targets",
        "smg,direct",
    ]
    args = build_parser().parse_args(argv)
    assert (args.threads, args.lengths, args.concurrency) == ([1], [(512, 64)], [4])
    assert args.targets == ["smg", "direct"]


@pytest.mark.parametrize("text", ["512", "512/", "a/64", "0/64", "512/0", "512-64"])
def test_bad_lengths_are_refused_by_name(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="PROMPT/ANSWER"):
        parse_lengths(text)


def test_targets_keep_their_order_and_direct_needs_smg() -> None:
    assert parse_targets("direct,smg,llama-server") == ["llama-server", "smg", "direct"]
    with pytest.raises(argparse.ArgumentTypeError, match="add smg"):
        parse_targets("llama-server,direct")
    with pytest.raises(argparse.ArgumentTypeError, match="targets are"):
        parse_targets("vllm")


def test_the_order_alternates_and_direct_follows_smg() -> None:
    targets = ["llama-server", "smg", "direct"]
    assert order_of(0, targets) == ["llama-server", "smg", "direct"]
    assert order_of(1, targets) == ["smg", "direct", "llama-server"]
    assert order_of(2, ["llama-server", "smg"]) == ["llama-server", "smg"]


def test_the_aiperf_command() -> None:
    setting = Setting(1, 512, 64, 4, 12)
    cmd = aiperf_command("http://h:1", "m", Path("/tok"), setting, seed=41, out=Path("/o"),
                         extra_inputs=("cache_prompt:false",))  # fmt: skip
    pairs = dict(itertools.pairwise(cmd))
    assert cmd[1] == "profile"
    assert pairs["--concurrency"] == "4"
    assert pairs["--request-count"] == "12"
    assert pairs["--synthetic-input-tokens-mean"] == "512"
    assert pairs["--output-tokens-mean"] == "64"
    assert pairs["--random-seed"] == "41"
    assert pairs["--endpoint-type"] == "completions"
    assert "--streaming" in cmd
    inputs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--extra-inputs"]
    assert inputs == ["ignore_eos:true", "cache_prompt:false"]


def _stat(**values: float) -> dict[str, float]:
    return {"unit": "ms", **values}


def test_summarise_aiperf_export() -> None:
    export = {
        "output_token_throughput": {"avg": 18.5},
        "time_to_first_token": _stat(p50=3600.0, p99=5100.0),
        "inter_token_latency": _stat(p50=147.0, p99=180.0),
        "request_count": {"avg": 10.0},
        "output_sequence_length": _stat(sum=640.0),
        "benchmark_duration": {"avg": 34.6},
        "error_summary": [{"code": 500, "count": 1}],
    }
    got = summarise_aiperf(export, expected_requests=12)
    assert got == {
        "output_tok_s": 18.5,
        "ttft_p50_ms": 3600.0,
        "ttft_p99_ms": 5100.0,
        "itl_p50_ms": 147.0,
        "itl_p99_ms": 180.0,
        "requests": 10,
        "errors": 2,  # the one aiperf counted, and one that never completed
        "output_tokens": 640.0,
        "duration_s": 34.6,
    }


def test_summarise_direct_as_aiperf_does() -> None:
    records = [
        Timed(0.0, 1.0, 4.0, 4),  # TTFT 1 s, ITL 1 s
        Timed(0.0, 2.0, 3.0, 3),  # TTFT 2 s, ITL 0.5 s
        Timed(1.0, 1.0, 1.0, 0, "UNAVAILABLE: gone"),
    ]
    got = summarise_direct(records, expected_requests=3)
    assert got["output_tok_s"] == pytest.approx(7 / 4.0)
    assert got["ttft_p50_ms"] == pytest.approx(1500.0)
    assert got["ttft_p99_ms"] == pytest.approx(1990.0)
    assert got["itl_p50_ms"] == pytest.approx(750.0)
    assert got["requests"] == 2
    assert got["errors"] == 1


def test_pass_mix_from_two_readings() -> None:
    before = {"passes": 100.0, "prompt_tokens": 1000.0, "decode_tokens": 50.0, "cpu_s": 10.0,
              "decode_s": 5.0, "decode_cpu_s": 4.0}  # fmt: skip
    after = {"passes": 110.0, "prompt_tokens": 1512.0, "decode_tokens": 90.0, "cpu_s": 13.0,
             "decode_s": 7.0, "decode_cpu_s": 6.5}  # fmt: skip
    got = pass_mix(before, after)
    assert got["passes"] == 10.0
    assert got["prompt_per_pass"] == pytest.approx(51.2)
    assert got["decode_per_pass"] == pytest.approx(4.0)
    assert got["tokens_per_pass"] == pytest.approx(55.2)
    assert got["cpu_ms_per_output_token"] == pytest.approx(75.0)
    assert got["cpu_ms_per_token"] == pytest.approx(3000 / 552)
    assert got["decode_ms_per_pass"] == pytest.approx(200.0)
    assert got["cpu_outside_decode_ms_per_pass"] == pytest.approx(50.0)


def test_pass_mix_without_passes_is_nan_not_an_error() -> None:
    got = pass_mix({"passes": 5.0}, {"passes": 5.0})
    assert math.isnan(got["tokens_per_pass"])


def tick(prefill: int, decode: int, eval_ms: float, pad: int = 0) -> dict[str, Any]:
    counts = {"batch_size": prefill + decode + pad, "prefill_tokens": prefill}
    return {"event": "tick", **counts, "decode_tokens": decode, "eval_ms": eval_ms,
            "sample_ms": 1.0, "is_ok": True}  # fmt: skip


def test_tick_mix_splits_prefill_and_decode_only_passes() -> None:
    events = [tick(32, 3, 200.0), tick(16, 3, 100.0), tick(0, 3, 60.0, pad=1), tick(0, 4, 70.0)]
    events.append({**tick(8, 1, 5.0), "is_ok": False})  # a KV-full retry is no pass
    got = tick_mix(events)
    assert got["passes"] == 4
    assert got["prefill_passes"] == 2
    assert got["decode_only_passes"] == 2
    assert got["prefill_tokens_per_prefill_pass"] == 24.0
    assert got["decode_tokens_per_prefill_pass"] == 3.0
    assert got["decode_tokens_per_decode_pass"] == 3.5
    assert got["rows_per_decode_pass"] == 4.0
    assert got["eval_ms_per_prefill_pass"] == 150.0
    assert got["eval_ms_per_decode_pass"] == 65.0
    assert got["eval_ms_per_token"] == pytest.approx(430.0 / 62)


def _run(target: str, rep: int, tok_s: float, itl: float, errors: int = 0) -> dict[str, Any]:
    result = {"output_tok_s": tok_s, "ttft_p50_ms": 1000.0, "ttft_p99_ms": 2000.0,
              "itl_p50_ms": itl, "itl_p99_ms": 2 * itl, "errors": errors}  # fmt: skip
    return {"setting": vars_of(Setting(1, 512, 64, 4, 12)), "target": target, "rep": rep,
            "result": result, "passes": {"tokens_per_pass": 20.0}, "load_1m": 3.0}  # fmt: skip


def test_rows_take_medians_and_ratios_to_llama_server() -> None:
    runs = [
        _run("llama-server", 0, 20.0, 110.0),
        _run("smg", 0, 18.0, 150.0),
        _run("direct", 0, 19.0, 140.0),
        _run("smg", 1, 16.0, 160.0, errors=1),
        _run("direct", 1, 21.0, 130.0),
        _run("llama-server", 1, 24.0, 120.0),
        _run("llama-server", 2, 22.0, 100.0),
        _run("smg", 2, 17.0, 155.0),
        _run("direct", 2, 20.0, 135.0),
    ]
    (row,) = rows_of(runs)
    assert row["key"] == "t1 512/64 c4"
    assert row["llama-server"]["output_tok_s"] == 22.0
    assert row["llama-server"]["output_tok_s_range"] == [20.0, 24.0]
    assert row["smg"]["itl_p50_ms"] == 155.0
    assert row["smg"]["errors"] == 1
    assert row["smg_ratio"] == pytest.approx(17.0 / 22.0)
    assert row["direct_ratio"] == pytest.approx(20.0 / 22.0)
    assert row["direct"]["passes"] == {"tokens_per_pass": 20.0}


def test_the_client_runs_under_nice_when_asked(tmp_path: Path) -> None:
    """--client-nice N puts `nice -n N` before aiperf; without it the command runs as given (a
    stand-in command writes the export aiperf would)."""
    out = tmp_path / "run"
    out.mkdir()
    export = out / "profile_export_aiperf.json"
    write = f"import os, json; json.dump({{'nice': os.nice(0)}}, open({str(export)!r}, 'w'))"
    assert build_parser().parse_args(["--client-nice", "19"]).client_nice == 19
    assert run_aiperf([sys.executable, "-c", write], out, nice=19)[0] == {"nice": 19}
    assert run_aiperf([sys.executable, "-c", write], out)[0] == {"nice": os.nice(0)}
