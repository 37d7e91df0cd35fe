"""bench/lora.py's pure parts: which adapter a stream applies, the requests both servers get,
the run order, and the summary arithmetic (medians, paired ratios, GetStats deltas, set finish
times); no model and no server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load() -> ModuleType:
    # by path, under its own name (bench/ is not a package)
    spec = importlib.util.spec_from_file_location("bench_lora", BENCH / "lora.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_lora"] = module
    spec.loader.exec_module(module)
    return module


bl = _load()


def test_streams_alternate_between_adapters() -> None:
    assert [bl.adapter_of(i, 0) for i in range(4)] == [None] * 4
    assert [bl.adapter_of(i, 1) for i in range(4)] == [0, 0, 0, 0]
    assert [bl.adapter_of(i, 2) for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [bl.adapter_of(i, 4) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_grpc_params_name_the_adapter_or_none() -> None:
    base = bl.grpc_params(None, 64)
    assert len(base.lora) == 0
    assert base.sampling.temperature == 0.0
    assert base.stopping.max_tokens == 64 and base.stopping.ignore_eos
    assert base.HasField("cache_prompt") and not base.cache_prompt
    tuned = bl.grpc_params(3, 16)
    assert [(a.name, a.scale) for a in tuned.lora] == [("a3", 1.0)]


def test_server_body_sets_every_loaded_adapter_explicitly() -> None:
    # an absent or empty `lora` would make llama-server apply its global scales
    body = bl.server_body([1, 2, 3], 1, 4, 64)
    assert body["lora"] == [
        {"id": 0, "scale": 0.0},
        {"id": 1, "scale": 1.0},
        {"id": 2, "scale": 0.0},
        {"id": 3, "scale": 0.0},
    ]
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64
    assert body["ignore_eos"] and body["stream"] and body["return_tokens"]
    assert body["cache_prompt"] is False and body["temperature"] == 0.0
    base = bl.server_body([1], None, 4, 8)
    assert [a["scale"] for a in base["lora"]] == [0.0] * 4


def test_run_order_interleaves_and_alternates_the_first_system() -> None:
    systems = ["llama-grpc", "llama-server"]
    order = bl.run_order(2, [4, 8], ["base", "lora2"], systems)
    assert len(order) == 2 * 2 * 2 * 2
    # rep by rep, every (S, configuration) in turn, both systems back to back
    cells = [(r.rep, r.streams, r.config) for r in order[::2]]
    assert cells == [(rep, s, c) for rep in range(2) for s in (4, 8) for c in ("base", "lora2")]
    for a, b in zip(order[::2], order[1::2], strict=True):
        assert (a.rep, a.streams, a.config) == (b.rep, b.streams, b.config)
        assert {a.system, b.system} == set(systems)
    firsts = [r.system for r in order[::2]]
    assert firsts[:4] == ["llama-grpc", "llama-server", "llama-grpc", "llama-server"]
    # the next rep starts with the other system for the same cell
    assert firsts[4:] == ["llama-server", "llama-grpc", "llama-server", "llama-grpc"]


def test_spread_and_paired_ratio() -> None:
    s = bl.spread([10.0, 30.0, 20.0])
    assert s["median"] == 20.0 and s["min"] == 10.0 and s["max"] == 30.0
    assert s["rel_spread"] == pytest.approx(1.0) and s["n"] == 3
    # the ratio is taken rep by rep, then its median (not the ratio of medians)
    num = {0: 10.0, 1: 30.0, 2: 12.0}
    den = {0: 20.0, 1: 30.0, 2: 6.0}
    r = bl.paired_ratio(num, den)
    assert r is not None
    assert r["median"] == pytest.approx(1.0) and r["min"] == 0.5 and r["max"] == 2.0
    assert bl.paired_ratio({0: 1.0}, {1: 1.0}) is None
    assert bl.paired_ratio({0: 1.0}, {0: 0.0}) is None


def test_stats_delta_tokens_per_pass() -> None:
    before = {"ticks": 100.0, "avg_batch_size": 2.5, "adapter_switches": 7.0,
              "generated_tokens": 150.0, "passes_a0": 10.0}  # fmt: skip
    # 40 more passes carrying 250 more tokens (a 4 x 64 prompt chunk and 1-token rows)
    after = {"ticks": 140.0, "avg_batch_size": (250 + 250) / 140, "adapter_switches": 47.0,
             "generated_tokens": 278.0, "passes_a0": 30.0}  # fmt: skip
    d = bl.stats_delta(before, after)
    assert d["ticks"] == 40 and d["adapter_switches"] == 40 and d["passes_a0"] == 20
    assert d["batch_tokens"] == 250
    assert d["tokens_per_pass"] == pytest.approx(250 / 40)
    assert d["generated_per_pass"] == pytest.approx(128 / 40)
    assert "avg_batch_size" not in d
    idle = bl.stats_delta(before, before)
    assert idle["tokens_per_pass"] == 0.0 and idle["generated_per_pass"] == 0.0


def test_metrics_value() -> None:
    text = (
        "# HELP llamacpp:n_decode_total Total number of llama_decode() calls\n"
        "# TYPE llamacpp:n_decode_total counter\n"
        "llamacpp:n_decode_total 1234\n"
        "llamacpp:n_decode_total_extra 9\n"
        "llamacpp:tokens_predicted_total 5.5e+03\n"
    )
    assert bl.metrics_value(text, "n_decode_total") == 1234.0
    assert bl.metrics_value(text, "tokens_predicted_total") == 5500.0
    with pytest.raises(KeyError):
        bl.metrics_value(text, "prompt_tokens_total")


def test_set_finish_together_and_one_after_another() -> None:
    adapters = [0, 1, 0, 1]
    together = bl.set_finish([9.8, 10.0, 9.9, 10.0], [1.0, 1.1, 1.0, 1.1], adapters)
    assert together["finish_ratio"] == pytest.approx(10.0 / 9.9)
    assert together["sets"]["a1"] == {"first_token_s": 1.1, "finish_s": 10.0}
    serial = bl.set_finish([5.0, 10.0, 5.1, 10.2], [0.5, 5.4, 0.5, 5.5], adapters)
    assert serial["finish_ratio"] == pytest.approx(10.2 / 5.1)
    assert serial["sets"]["a1"]["first_token_s"] == 5.4
    base = bl.set_finish([3.0, 4.0], [1.0, 1.0], [None, None])
    assert list(base["sets"]) == ["base"] and base["finish_ratio"] == 1.0


def _run(rep: int, s: int, config: str, system: str, tok_s: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "rep": rep, "streams": s, "config": config, "system": system, "tok_s": tok_s,
        "cpu_s_per_token": 0.1, "passes": 64.0, "generated_per_pass": 4.0,
        "fairness": {"finish_ratio": 1.0}, "max_ttft_s": 0.5,
    }  # fmt: skip
    if system == "llama-grpc":
        record["grpc_stats"] = {"adapter_switches": 64.0, "tokens_per_pass": 4.0}
    return record


def test_summarize_ratios_to_base_and_between_systems() -> None:
    runs = []
    for rep, (g_base, g_l2, s_base, s_l2) in enumerate([(100, 60, 80, 40), (90, 45, 90, 60)]):
        runs += [
            _run(rep, 4, "base", "llama-grpc", g_base),
            _run(rep, 4, "lora2", "llama-grpc", g_l2),
            _run(rep, 4, "base", "llama-server", s_base),
            _run(rep, 4, "lora2", "llama-server", s_l2),
        ]
    rows = bl.summarize(runs, ["base", "lora2"])
    assert [(r["streams"], r["config"], r["adapters"]) for r in rows] == [
        (4, "base", 0),
        (4, "lora2", 2),
    ]
    base, lora2 = rows
    assert base["llama-grpc"]["ratio_to_base"]["median"] == 1.0
    assert lora2["llama-grpc"]["tok_s"]["median"] == pytest.approx(52.5)
    # per rep 0.6 and 0.5: median 0.55
    assert lora2["llama-grpc"]["ratio_to_base"]["median"] == pytest.approx(0.55)
    assert lora2["llama-server"]["ratio_to_base"]["median"] == pytest.approx((0.5 + 2 / 3) / 2)
    # llama-grpc / llama-server, per rep 1.5 and 0.75
    assert lora2["grpc_over_server"]["median"] == pytest.approx(1.125)
    assert base["grpc_over_server"]["median"] == pytest.approx((1.25 + 1.0) / 2)
    assert lora2["llama-grpc"]["adapter_switches"]["median"] == 64.0
    assert "adapter_switches" not in lora2["llama-server"]
    assert lora2["llama-grpc"]["cpu_ms_per_token"]["median"] == pytest.approx(100.0)


def test_summarize_one_system_has_no_cross_ratio() -> None:
    runs = [_run(0, 8, "base", "llama-grpc", 50.0), _run(0, 8, "lora4", "llama-grpc", 20.0)]
    rows = bl.summarize(runs, ["base", "lora4"])
    assert "grpc_over_server" not in rows[1] and "llama-server" not in rows[1]
    assert rows[1]["llama-grpc"]["ratio_to_base"]["median"] == pytest.approx(0.4)


def test_token_checks() -> None:
    tokens = {
        ("llama-grpc", 2, "base"): [[1, 2, 3], [4, 5, 6]],
        ("llama-server", 2, "base"): [[1, 2, 3], [4, 9, 6]],
        ("llama-grpc", 2, "lora1"): [[1, 7, 7], [8, 8, 8]],
        ("llama-server", 2, "lora1"): [[1, 7, 7], [8, 8, 8]],
    }
    checks = bl.token_checks(tokens)
    assert checks["shared_with_other_system"] == {"S2/base": [3, 1], "S2/lora1": [3, 3]}
    assert checks["shared_with_base"] == {
        "llama-grpc S2/lora1": [1, 0],
        "llama-server S2/lora1": [1, 0],
    }


def test_server_and_grpc_commands_load_every_adapter() -> None:
    paths = [Path("/x/a.gguf"), Path("/x/b.gguf")]
    cmd = bl.llama_server_cmd("llama-server", Path("/m.gguf"), 8080, slots=8, threads=1,
                              adapters=paths)  # fmt: skip
    assert cmd[-1] == "--lora-init-without-apply"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--lora"] == ["/x/a.gguf", "/x/b.gguf"]
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-t") + 1] == "1"
    assert "--metrics" in cmd and cmd[cmd.index("--cache-ram") + 1] == "0"
    args = bl.grpc_server_args(Path("/m.gguf"), 8, 1, paths)
    assert [args[i + 1] for i, a in enumerate(args) if a == "--lora"] == [
        "a0=/x/a.gguf",
        "a1=/x/b.gguf",
    ]
    assert args[args.index("--n-parallel") + 1] == "8"
    assert args[args.index("--threads") + 1] == "1"
    assert "--no-cache-prompt" in args
