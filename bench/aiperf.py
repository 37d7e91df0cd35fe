"""aiperf benchmark (issue 40): NVIDIA's `aiperf` (PyPI, its own venv bench/.venv-aiperf)
against llama-grpc behind the SMG gateway and against llama.cpp's llama-server, on the same
model (the embedded Gemma 3 270M), threads, 4 slots and 8,192 context; plus the same prompts
sent straight to the llama-grpc replica over v1 gRPC (StreamGenerate, the same concurrency), to
split what SMG costs from what the engine costs.

For each llama.cpp thread count, prompt/answer length pair and concurrency the three targets
run in every repetition, the order alternating (llama-server, SMG, direct on even repetitions;
SMG, direct, llama-server on odd ones: the direct run takes the prompts aiperf wrote for the
SMG run, `inputs.json`). aiperf's prompts are synthetic text of exactly the asked token count
(by the model's exported tokenizer), answers `ignore_eos` of exactly the asked length, a seed per
repetition. No target reuses a prompt's KV: the replica runs --no-cache-prompt and llama-server
gets `cache_prompt: false` (the direct and SMG runs send the same prompts to the same replica).

Per run: aiperf's output tok/s, TTFT and ITL p50/p99 and errors; each server's CPU seconds
(/proc, its threads and children) per output token and per prompt token; and what its forward
passes held: llama-server's /metrics (n_decode_total, prompt_tokens_total,
tokens_predicted_total), the replica's GetStats (ticks, avg_batch_size, prompt and generated
tokens, the time inside llama_decode). Medians over repetitions; the load average beside them.

aiperf loads the tokenizer from the directory `llama-grpc models export-tokenizer` writes; it
reads a local directory only when HF_HUB_OFFLINE is unset (this script unsets it for aiperf).
llama-server comes from bench/build_llama_server.sh (the pinned sdist's llama.cpp, our wheel's
CPU flags); `make bench-aiperf` builds it and installs aiperf first.

    make bench-aiperf                                     # the whole matrix (hours)
    make bench-aiperf ARGS="--threads 1 --lengths 512/64 --concurrency 4 --reps 2"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    RESULTS,
    ROOT,
    finish_facts,
    free_port,
    greedy_params,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    stream_tokens,
    write_json,
)
from deploy.gateway import Gateway
from gateway import cpu_seconds
from peers import N_CTX, llama_server, llama_server_binary, peer_facts

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.models.files import default_model_path

AIPERF = ROOT / "bench" / ".venv-aiperf" / "bin" / "aiperf"
TARGETS = ("llama-server", "smg", "direct")
SLOTS = 4
RUN_TIMEOUT_S = 1800.0


# -- arguments ---------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return values


def parse_lengths(text: str) -> list[tuple[int, int]]:
    """'128/256,512/64' -> [(128, 256), (512, 64)]: prompt/answer tokens."""
    out = []
    for item in text.split(","):
        prompt, sep, answer = item.strip().partition("/")
        if not sep or not prompt.isdigit() or not answer.isdigit() or "0" in (prompt, answer):
            raise argparse.ArgumentTypeError(f"expected PROMPT/ANSWER token counts: {item!r}")
        out.append((int(prompt), int(answer)))
    return out


def parse_targets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"targets are {', '.join(TARGETS)}: got {text!r}")
    if "direct" in names and "smg" not in names:
        raise argparse.ArgumentTypeError(
            "direct takes the prompts aiperf sent through smg: add smg"
        )
    return [t for t in TARGETS if t in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=parse_ints, default=[1, 2], help="llama.cpp threads")
    parser.add_argument(
        "--lengths",
        type=parse_lengths,
        default=parse_lengths("128/256,512/64,2048/64"),
        help="PROMPT/ANSWER token pairs, comma-separated",
    )
    parser.add_argument("--concurrency", type=parse_ints, default=[1, 4, 8, 16])
    parser.add_argument("--targets", type=parse_targets, default=list(TARGETS))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--n-ctx",
        type=int,
        default=N_CTX,
        help="both servers' context, shared by the 4 slots (2048/64 needs > 8,448)",
    )
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=3,
        help="aiperf's request count = concurrency x this",
    )
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--name", default="aiperf", help="results file name (JSON and PNG)")
    parser.add_argument(
        "--tick-log",
        action="store_true",
        help="the replica logs every tick (debug): each run gets its passes' prompt/decode mix",
    )
    parser.add_argument(
        "--py-spy",
        action="store_true",
        help="py-spy the replica in each setting's first SMG run (bench/results/aiperf_pyspy_*)",
    )
    parser.add_argument(
        "--client-nice",
        type=int,
        default=0,
        help="run aiperf under `nice -n N` (0: as is). Its timing_manager takes ~95 %% of a core "
        "for a whole run (client_cpu_s): on 2 cores it competes with the servers",
    )
    parser.add_argument(
        "--replica-args",
        default="",
        help="more llama-grpc serve options for the replica (space-separated)",
    )
    return parser


def order_of(rep: int, targets: Sequence[str]) -> list[str]:
    """The run order of one repetition: direct always right after SMG (it takes SMG's prompts),
    llama-server first on even repetitions and last on odd ones."""
    ours = [t for t in ("smg", "direct") if t in targets]
    peer = [t for t in ("llama-server",) if t in targets]
    return peer + ours if rep % 2 == 0 else ours + peer


def aiperf_command(
    url: str,
    model: str,
    tokenizer: Path,
    setting: Setting,
    *,
    seed: int,
    out: Path,
    extra_inputs: Sequence[str] = (),
) -> list[str]:
    """aiperf profile: streaming /v1/completions, exact prompt and answer lengths (ignore_eos),
    `setting.concurrency` requests in flight, the summary export in `out`."""
    return [
        str(AIPERF),
        "profile",
        "-m",
        model,
        "--tokenizer",
        str(tokenizer),
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--concurrency",
        str(setting.concurrency),
        "--request-count",
        str(setting.requests),
        "--synthetic-input-tokens-mean",
        str(setting.prompt_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(setting.answer_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        *(f for e in extra_inputs for f in ("--extra-inputs", e)),
        "--random-seed",
        str(seed),
        "--artifact-dir",
        str(out),
        "--ui",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]


@dataclass(frozen=True, slots=True)
class Setting:
    threads: int
    prompt_tokens: int
    answer_tokens: int
    concurrency: int
    requests: int

    @property
    def key(self) -> str:
        return f"t{self.threads} {self.prompt_tokens}/{self.answer_tokens} c{self.concurrency}"


# -- summarising -------------------------------------------------------------------------------


def summarise_aiperf(export: dict[str, Any], expected_requests: int) -> dict[str, Any]:
    """aiperf's profile_export_aiperf.json -> the figures a row keeps. Errors: aiperf's error
    summary counts, plus requests that never completed."""

    def stat(name: str, key: str) -> float:
        value = (export.get(name) or {}).get(key)
        return float("nan") if value is None else float(value)

    errors = sum(int(e.get("count", 1)) for e in export.get("error_summary") or [])
    completed = int(stat("request_count", "avg")) if export.get("request_count") else 0
    return {
        "output_tok_s": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "itl_p99_ms": stat("inter_token_latency", "p99"),
        "requests": completed,
        "errors": errors + max(0, expected_requests - completed - errors),
        "output_tokens": stat("output_sequence_length", "sum"),
        "duration_s": stat("benchmark_duration", "avg"),
    }


def _pct(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as aiperf reports them)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Timed:
    """One direct request: send time, first and last token arrival, tokens, error (or '')."""

    t_send: float
    t_first: float
    t_last: float
    tokens: int
    error: str = ""


def summarise_direct(records: Sequence[Timed], expected_requests: int) -> dict[str, Any]:
    """The direct run's figures, computed as aiperf computes its own: TTFT per request; ITL per
    request = (last - first token) / (tokens - 1); output tok/s = all output tokens over the
    time from the first send to the last token."""
    good = [r for r in records if not r.error and r.tokens > 0]
    ttft = [(r.t_first - r.t_send) * 1e3 for r in good]
    itl = [(r.t_last - r.t_first) * 1e3 / (r.tokens - 1) for r in good if r.tokens > 1]
    span = (max(r.t_last for r in good) - min(r.t_send for r in records)) if good else 0.0
    tokens = sum(r.tokens for r in good)
    return {
        "output_tok_s": tokens / span if span > 0 else float("nan"),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "itl_p50_ms": _pct(itl, 0.5),
        "itl_p99_ms": _pct(itl, 0.99),
        "requests": len(good),
        "errors": expected_requests - len(good),
        "output_tokens": float(tokens),
        "duration_s": span,
    }


def pass_mix(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the forward passes of one run held, from two readings of a server's counters
    (`passes`, `prompt_tokens` computed, `decode_tokens` generated, `cpu_s`, `decode_s`):
    tokens per pass, prompt and decode tokens per pass, CPU ms per pass and per token."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    passes = d.get("passes", 0.0)
    prompt, decode = d.get("prompt_tokens", 0.0), d.get("decode_tokens", 0.0)
    tokens = prompt + decode
    out = {
        "passes": passes,
        "prompt_tokens": prompt,
        "decode_tokens": decode,
        "tokens_per_pass": tokens / passes if passes else float("nan"),
        "prompt_per_pass": prompt / passes if passes else float("nan"),
        "decode_per_pass": decode / passes if passes else float("nan"),
        "cpu_s": d.get("cpu_s", 0.0),
        "cpu_ms_per_output_token": 1e3 * d.get("cpu_s", 0.0) / decode if decode else float("nan"),
        "cpu_ms_per_token": 1e3 * d.get("cpu_s", 0.0) / tokens if tokens else float("nan"),
    }
    if "decode_s" in d:
        out["decode_ms_per_pass"] = 1e3 * d["decode_s"] / passes if passes else float("nan")
    if "decode_cpu_s" in d:  # the engine thread's CPU inside llama_decode; the rest is Python's
        out["decode_cpu_s"] = d["decode_cpu_s"]
        out["cpu_outside_decode_ms_per_pass"] = (
            1e3 * (d.get("cpu_s", 0.0) - d["decode_cpu_s"]) / passes if passes else float("nan")
        )
    return out


def tick_mix(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The replica's tick events of one run (its debug log, `--tick-log`) -> what its passes
    held: passes with prompt tokens and decode-only ones, prompt and decode tokens per pass of
    each kind, llama_decode ms per pass of each kind and per token, sampling ms per pass."""
    ticks = [e for e in events if e.get("is_ok", True) and e.get("batch_size", 0) > 0]
    mixed = [e for e in ticks if e.get("prefill_tokens", 0) > 0]
    decode_only = [e for e in ticks if e.get("prefill_tokens", 0) == 0]

    def mean(values: Sequence[float]) -> float:
        return statistics.fmean(values) if values else float("nan")

    tokens = sum(e["batch_size"] for e in ticks)
    return {
        "passes": float(len(ticks)),
        "prefill_passes": float(len(mixed)),
        "decode_only_passes": float(len(decode_only)),
        "prefill_tokens_per_prefill_pass": mean([e["prefill_tokens"] for e in mixed]),
        "decode_tokens_per_prefill_pass": mean([e["decode_tokens"] for e in mixed]),
        "decode_tokens_per_decode_pass": mean([e["decode_tokens"] for e in decode_only]),
        "rows_per_decode_pass": mean([e["batch_size"] for e in decode_only]),
        "eval_ms_per_prefill_pass": mean([e["eval_ms"] for e in mixed]),
        "eval_ms_per_decode_pass": mean([e["eval_ms"] for e in decode_only]),
        "sample_ms_per_pass": mean([e.get("sample_ms", 0.0) for e in ticks]),
        "eval_ms_per_token": sum(e["eval_ms"] for e in ticks) / tokens if tokens else float("nan"),
    }


def tick_events(log: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The `tick` events a replica logged (--log-format json, --log-level debug) after byte
    `offset`; and the offset after them."""
    with log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    events = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") == "tick":
                events.append(entry)
    return events, offset + len(data)


METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def rows_of(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs -> one row per setting: per target the median of each metric over repetitions (and
    its min/max), errors summed, the pass mix's medians; ratios SMG / llama-server and
    direct / llama-server of output tok/s."""
    by_setting: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_setting.setdefault(run["setting"]["key"], []).append(run)
    rows = []
    for key, group in by_setting.items():
        row: dict[str, Any] = {"key": key, **dict(group[0]["setting"].items())}
        for target in TARGETS:
            mine = [r for r in group if r["target"] == target]
            if not mine:
                continue
            cell: dict[str, Any] = {"reps": len(mine)}
            for m in METRICS:
                values = [r["result"][m] for r in mine]
                cell[m] = statistics.median(values)
                cell[f"{m}_range"] = [min(values), max(values)]
            cell["errors"] = sum(r["result"]["errors"] for r in mine)
            mixes = [r["passes"] for r in mine if r.get("passes")]
            if mixes:
                cell["passes"] = {k: statistics.median(m[k] for m in mixes) for k in mixes[0]}
            ticks = [r["ticks"] for r in mine if r.get("ticks")]
            if ticks:
                cell["ticks"] = {k: statistics.median(t[k] for t in ticks) for k in ticks[0]}
            cell["load_1m"] = [r["load_1m"] for r in mine]
            row[target] = cell
        peer = row.get("llama-server", {}).get("output_tok_s")
        for target in ("smg", "direct"):
            if peer and target in row:
                row[f"{target}_ratio"] = row[target]["output_tok_s"] / peer
        rows.append(row)
    return rows


# -- the servers' counters ---------------------------------------------------------------------


def llama_server_counters(port: int, pid: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            values[name[len("llamacpp:") :]] = float(value)
    return {
        "passes": values.get("n_decode_total", 0.0),
        "prompt_tokens": values.get("prompt_tokens_total", 0.0),
        "decode_tokens": values.get("tokens_predicted_total", 0.0),
        "cpu_s": cpu_seconds(pid),
    }


async def replica_counters(stub: Any, pid: int) -> dict[str, float]:
    s = await stub.GetStats(pb.GetStatsRequest())
    return {
        "passes": float(s.ticks),
        "batch_tokens": s.ticks * s.avg_batch_size,
        "prompt_tokens": float(s.prompt_tokens - s.cached_prompt_tokens),
        "decode_tokens": float(s.generated_tokens),
        "decode_s": s.decode_seconds,
        "decode_cpu_s": s.decode_cpu_seconds,
        "cpu_s": cpu_seconds(pid),
    }


# -- the runs ----------------------------------------------------------------------------------


def run_aiperf(cmd: list[str], out: Path, nice: int = 0) -> tuple[dict[str, Any], float]:
    """Run aiperf (HF_HUB_OFFLINE unset: it then loads a local tokenizer directory), under
    `nice -n nice` if not 0; its export JSON and the CPU seconds it took."""
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    before = os.times()
    with (out.parent / f"{out.name}.log").open("wb") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S, check=False
        )
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    export = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        tail = (out.parent / f"{out.name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"aiperf exited with {proc.returncode}: {tail}")
    return json.loads(export.read_text()), cpu


def aiperf_prompts(out: Path) -> list[dict[str, Any]]:
    """The payloads aiperf sent (inputs.json): prompt and max_tokens of each request."""
    data = json.loads((out / "inputs.json").read_text())
    return [p for session in data["data"] for p in session["payloads"]]


async def run_direct(
    stub: Any, payloads: Sequence[dict[str, Any]], concurrency: int
) -> list[Timed]:
    """The same prompts over v1 StreamGenerate, `concurrency` in flight at a time, greedy and
    ignore_eos like aiperf's requests."""
    todo = list(payloads)
    records: list[Timed] = []

    async def worker() -> None:
        while todo:
            payload = todo.pop(0)
            t0 = time.perf_counter()
            try:
                params = greedy_params(int(payload["max_tokens"]))
                rec = await stream_tokens(stub, text=payload["prompt"], params=params)
                first = rec.times[0] if rec.times else t0
                last = rec.times[-1] if rec.times else t0
                records.append(Timed(t0, first, last, rec.n_tokens))
            except grpc.RpcError as exc:
                records.append(Timed(t0, t0, t0, 0, f"{exc.code()}: {exc.details()}"))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


@contextlib.contextmanager
def servers(
    threads: int, targets: Sequence[str], replica_args: Sequence[str], n_ctx: int = N_CTX
) -> Iterator[dict[str, Any]]:
    model = str(default_model_path())
    up: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if "llama-server" in targets:
            binary = llama_server_binary()
            if binary is None:
                raise SystemExit("no llama-server: run bench/build_llama_server.sh first")
            progress(f"starting llama-server ({threads} threads, {SLOTS} slots)")
            extra_args = ("--metrics", "-c", str(n_ctx))  # the last -c counts
            ctx = llama_server(binary, model, SLOTS, threads, extra=extra_args)
            up["llama-server-port"] = stack.enter_context(ctx)
        if "smg" in targets or "direct" in targets:
            progress(f"starting one llama-grpc replica ({threads} threads, {SLOTS} slots) and SMG")
            extra = [
                "--n-parallel",
                str(SLOTS),
                "--n-ctx",
                str(n_ctx),
                "--no-cache-prompt",
                *replica_args,
            ]
            gw = Gateway(replicas=1, port=free_port(), server_args=extra, threads=threads)
            up["gateway"] = stack.enter_context(gw)
        yield up


def llama_server_pid(port: int) -> int:
    """The llama-server process listening on `port` (peer_process keeps no handle we can reach)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                if (
                    cmdline
                    and cmdline[0].endswith(b"llama-server")
                    and str(port).encode() in cmdline
                ):
                    return int(entry.name)
    raise RuntimeError(f"no llama-server process on port {port}")


@dataclass
class Up:
    """The running targets of one thread count."""

    tokenizer: Path
    seed: int
    ls_port: int = 0
    ls_pid: int = 0
    gateway: Gateway | None = None
    stub: Any = None
    tick_log: bool = False  # the replica logs its ticks (debug): summarise them per run
    py_spy: bool = False  # profile the replica during each setting's first SMG run
    client_nice: int = 0  # aiperf runs under nice -n this
    log_offset: int = 0

    @property
    def replica_pid(self) -> int:
        assert self.gateway is not None
        proc = self.gateway.cluster.members[0].proc
        assert proc is not None
        return proc.pid

    async def run(
        self, target: str, setting: Setting, rep: int, out: Path, smg_out: Path
    ) -> dict[str, Any]:
        """One run of one target; its figures, pass mix and CPU."""
        run: dict[str, Any] = {"setting": vars_of(setting), "target": target, "rep": rep}
        seed = self.seed + 1000 * rep
        if target == "llama-server":
            before = llama_server_counters(self.ls_port, self.ls_pid)
            url = f"http://127.0.0.1:{self.ls_port}"
            extra = ("cache_prompt:false",)
            cmd = aiperf_command(
                url, "gemma-3-270m", self.tokenizer, setting, seed=seed, out=out, extra_inputs=extra
            )
            export, run["client_cpu_s"] = run_aiperf(cmd, out, self.client_nice)
            after = llama_server_counters(self.ls_port, self.ls_pid)
            run["result"] = summarise_aiperf(export, setting.requests)
            run["aiperf_errors"] = (export.get("error_summary") or [])[:5]
        elif target == "smg":
            gw = self.gateway
            assert gw is not None
            assert gw.smg is not None
            before = await replica_counters(self.stub, self.replica_pid)
            smg_cpu0 = cpu_seconds(gw.smg.pid)
            url = gw.base_url.removesuffix("/v1")
            cmd = aiperf_command(url, gw.model, self.tokenizer, setting, seed=seed, out=out)
            profile = None
            if self.py_spy and rep == 0:
                profile = RESULTS / f"aiperf_pyspy_{out.name}.txt"
            with py_spy(self.replica_pid, profile):
                export, run["client_cpu_s"] = run_aiperf(cmd, out, self.client_nice)
            after = await replica_counters(self.stub, self.replica_pid)
            run["smg_cpu_s"] = cpu_seconds(gw.smg.pid) - smg_cpu0
            run["result"] = summarise_aiperf(export, setting.requests)
            run["aiperf_errors"] = (export.get("error_summary") or [])[:5]
        else:
            payloads = aiperf_prompts(smg_out)
            before = await replica_counters(self.stub, self.replica_pid)
            t0 = os.times()
            records = await run_direct(self.stub, payloads, setting.concurrency)
            t1 = os.times()
            run["client_cpu_s"] = (t1.user - t0.user) + (t1.system - t0.system)
            after = await replica_counters(self.stub, self.replica_pid)
            run["result"] = summarise_direct(records, setting.requests)
            run["errors_seen"] = sorted({r.error for r in records if r.error})[:5]
        run["passes"] = pass_mix(before, after)
        if self.tick_log and target != "llama-server":
            assert self.gateway is not None
            log = self.gateway.cluster.members[0].log_path
            events, self.log_offset = tick_events(log, self.log_offset)
            run["ticks"] = tick_mix(events)
        run["load_1m"] = os.getloadavg()[0]
        return run


def report(run: dict[str, Any], reps: int) -> None:
    res, mix = run["result"], run["passes"]
    progress(
        f"{run['setting']['key']} rep {run['rep'] + 1}/{reps} {run['target']:>12}: "
        f"{res['output_tok_s']:6.1f} tok/s, TTFT p50 {res['ttft_p50_ms']:8.0f} ms, "
        f"ITL p50 {res['itl_p50_ms']:6.1f} ms, errors {res['errors']}; "
        f"{mix['prompt_per_pass']:.1f}+{mix['decode_per_pass']:.1f} tokens/pass, "
        f"{mix['cpu_ms_per_token']:.2f} CPU ms/token; load {run['load_1m']:.2f}"
    )


async def measure(args: argparse.Namespace, tokenizer: Path, work: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for threads in args.threads:
        replica_args = args.replica_args.split() + (
            ["--log-level", "debug"] if args.tick_log else []
        )
        with servers(threads, args.targets, replica_args, args.n_ctx) as started:
            up = Up(tokenizer, args.seed, gateway=started.get("gateway"))
            up.tick_log, up.py_spy = args.tick_log, args.py_spy
            up.client_nice = args.client_nice
            if up.tick_log and up.gateway is not None:  # the start's own ticks are not a run's
                up.log_offset = up.gateway.cluster.members[0].log_path.stat().st_size
            if "llama-server-port" in started:
                up.ls_port = started["llama-server-port"]
                up.ls_pid = llama_server_pid(up.ls_port)
            async with contextlib.AsyncExitStack() as stack:
                if up.gateway is not None:
                    target = up.gateway.cluster.members[0].target
                    channel = grpc.aio.insecure_channel(target)
                    up.stub = pb_grpc.LlmServiceStub(await stack.enter_async_context(channel))
                for prompt_tokens, answer_tokens in args.lengths:
                    for c in args.concurrency:
                        requests = c * args.requests_per_stream
                        setting = Setting(threads, prompt_tokens, answer_tokens, c, requests)
                        name = setting.key.replace(" ", "_").replace("/", "-")
                        for rep in range(args.reps):
                            smg_out = work / f"{name}_r{rep}_smg"
                            for target in order_of(rep, args.targets):
                                out = work / f"{name}_r{rep}_{target}"
                                run = await up.run(target, setting, rep, out, smg_out)
                                runs.append(run)
                                report(run, args.reps)
    return runs


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """py-spy (bench/.venv-aiperf) recording `pid`'s threads meanwhile, as collapsed stacks in
    `out` (None: no profile)."""
    if out is None:
        yield
        return
    binary = AIPERF.parent / "py-spy"
    cmd = [str(binary), "record", "-p", str(pid), "-r", "50", "-f", "raw", "--threads",
           "--nonblocking", "-o", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        progress(f"wrote {out.relative_to(ROOT)}")


def vars_of(setting: Setting) -> dict[str, Any]:
    return {"key": setting.key, **dataclasses.asdict(setting)}


def export_tokenizer(work: Path) -> Path:
    from llama_grpc_server.core.requests.chat import BUILTIN_TEMPLATES, template_in_use
    from llama_grpc_server.models import tokenizer_export
    from llama_grpc_server.models.gguf_header import read_header

    path = str(default_model_path())
    header = read_header(path)
    name = template_in_use("", header.has_chat_template, header.architecture)
    files = tokenizer_export.export_files(
        path, BUILTIN_TEMPLATES.get(name), cache_dir=tokenizer_export.default_cache_dir()
    )
    out = work / "tokenizer"
    tokenizer_export.write_files(files, out)
    return out


def main() -> int:
    args = build_parser().parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"no {AIPERF}: `make bench-aiperf` installs aiperf first")
    facts = machine_facts(args.threads[0])  # the load average before the run
    work = Path(tempfile.mkdtemp(prefix="aiperf-"))
    try:
        tokenizer = export_tokenizer(work)
        runs = asyncio.run(measure(args, tokenizer, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = rows_of(runs)
    data = {
        "benchmark": "aiperf",
        "command": "python bench/aiperf.py " + " ".join(sys.argv[1:]),
        "settings": {
            **vars(args),
            "lengths": [f"{p}/{a}" for p, a in args.lengths],
            "slots": SLOTS,
            "n_ctx": args.n_ctx,
        },
        "machine": facts | peer_facts(),
        "rows": rows,
        "runs": runs,
    }
    write_json(args.name, finish_facts(data))
    plot(rows, args.name)
    for line in table(rows):
        print(line)
    return 0


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        parts = [f"{r['key']:<16}"]
        for target in TARGETS:
            if target in r:
                c = r[target]
                parts.append(
                    f"{target} {c['output_tok_s']:6.1f} tok/s TTFT {c['ttft_p50_ms']:7.0f} "
                    f"ITL {c['itl_p50_ms']:6.1f} err {c['errors']}"
                )
        for target in ("smg", "direct"):
            if f"{target}_ratio" in r:
                parts.append(f"{target}/llama-server {r[f'{target}_ratio']:.2f}")
        lines.append(" | ".join(parts))
    return lines


def plot(rows: Sequence[dict[str, Any]], name: str) -> None:
    plt = pyplot()
    panels = sorted({(r["threads"], r["prompt_tokens"], r["answer_tokens"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for (threads, p, a), (ax_rate, ax_itl) in zip(panels, axes, strict=True):
        mine = sorted(
            (
                r
                for r in rows
                if (r["threads"], r["prompt_tokens"], r["answer_tokens"]) == (threads, p, a)
            ),
            key=lambda r: r["concurrency"],
        )
        xs = [r["concurrency"] for r in mine]
        for i, target in enumerate(TARGETS):
            if all(target in r for r in mine):
                ax_rate.plot(
                    xs, [r[target]["output_tok_s"] for r in mine], "o-", color=f"C{i}", label=target
                )
                ax_itl.plot(
                    xs, [r[target]["itl_p50_ms"] for r in mine], "o-", color=f"C{i}", label=target
                )
        ax_rate.set_title(f"{threads} thread(s), {p}/{a} tokens: output tok/s")
        ax_itl.set_title("ITL p50 ms")
        for ax in (ax_rate, ax_itl):
            ax.set_xlabel("concurrency")
            ax.set_xticks(xs)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, name)


if __name__ == "__main__":
    sys.exit(main())
