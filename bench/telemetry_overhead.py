"""Telemetry overhead: aggregate tok/s of B concurrent streams (default 8) against two servers
doing the same work, one with telemetry fully on (Prometheus /metrics scraped every second, a
handler subscribed to every bus event, info-level JSON access logs written to a file), one
minimal (warning-level logs, no metrics, no handler) and one traced (minimal plus OpenTelemetry
tracing: --otlp-endpoint to a receiver in this process that decodes every export). Repetitions
rotate the order of the three in one run so drift hits all alike. Targets: full within 2 % of
minimal (issue 5); traced >= 0.98 of minimal (issue 19).

    make bench-telemetry              # or: python bench/telemetry_overhead.py --reps 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    free_port,
    machine_facts,
    progress,
    summary,
    wait_serving,
    write_json,
)

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

MODES = ("full", "minimal", "traced")
TEXT = (
    "Stream {i} of round {r}: describe the harbour town, its lighthouse, fishing boats, market "
    "stalls, narrow streets, old churches, the tides and the people who live there all year."
)


def serve_child(mode: str, argv: list[str]) -> int:
    """The server process: `full` subscribes a handler to every event before cli.main()."""
    from llama_grpc_server import cli
    from llama_grpc_server.observability import telemetry

    if mode == "full":
        totals: dict[str, float] = {}

        def handler(name: str, event: telemetry.TelemetryEvent) -> None:
            # What an embedder's aggregation might do: a few dictionary updates per event.
            totals[name] = totals.get(name, 0) + 1
            if isinstance(event, telemetry.TickEvent):
                totals["tokens"] = totals.get("tokens", 0) + event.batch_size
                totals["eval_ms"] = totals.get("eval_ms", 0.0) + event.eval_ms

        for name in telemetry.EVENT_NAMES:
            telemetry.attach(name, handler)
    return cli.main(argv)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[dict[str, Any]]:
    """An OTLP/HTTP traces endpoint that decodes each export and counts its spans."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    got: dict[str, Any] = {"spans": 0, "exports": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            got["exports"] += 1
            got["spans"] += sum(
                len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
            )
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    got["url"] = f"http://127.0.0.1:{http.server_address[1]}/v1/traces"
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield got
    finally:
        http.shutdown()


@contextlib.contextmanager
def server(
    mode: str, args: list[str], log_dir: Path, otlp_url: str = ""
) -> Iterator[dict[str, Any]]:
    """Start one server in `mode`; yields its target, metrics port and log file."""
    port = free_port()
    argv = ["--port", str(port), *args, "--log-format", "json"]
    metrics_port = 0
    if mode == "full":
        metrics_port = free_port()
        argv += ["--log-level", "info", "--metrics-port", str(metrics_port)]
    else:
        argv += ["--log-level", "warning"]
    if mode == "traced":
        argv += ["--otlp-endpoint", otlp_url]
    log_path = log_dir / f"{mode}.log"
    with log_path.open("wb") as log:
        cmd = [sys.executable, __file__, "--serve", mode, "--", *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        target = f"127.0.0.1:{port}"
        try:
            wait_serving(target, proc, 180.0)
            yield {"target": target, "metrics_port": metrics_port, "log": log_path}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


@contextlib.contextmanager
def scraping(port: int, interval_s: float) -> Iterator[list[int]]:
    """Scrape /metrics every interval_s on a thread while inside; yields [number of scrapes]."""
    count, stop = [0], threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            scrape(port)
            count[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join()


async def load(target: str, batch: int, gen_tokens: int, round_: int) -> tuple[float, int]:
    """B concurrent StreamGenerate calls with distinct prompts; (wall seconds, tokens)."""
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=gen_tokens, ignore_eos=True),
        cache_prompt=False,
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)

        async def one(i: int) -> int:
            request = pb.StreamGenerateRequest(prompt=TEXT.format(i=i, r=round_), params=params)
            n = 0
            async for message in stub.StreamGenerate(request):
                if message.HasField("delta"):
                    n += len(message.delta.token_ids)
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(batch)))
        return time.perf_counter() - t0, sum(counts)


def run_once(
    srv: dict[str, Any], mode: str, args: argparse.Namespace, round_: int
) -> tuple[float, int]:
    if mode == "full":
        with scraping(srv["metrics_port"], args.scrape_interval_s):
            seconds, n = asyncio.run(load(srv["target"], args.batch, args.gen_tokens, round_))
    else:
        seconds, n = asyncio.run(load(srv["target"], args.batch, args.gen_tokens, round_))
    if n != args.batch * args.gen_tokens:
        raise RuntimeError(f"{mode}: expected {args.batch * args.gen_tokens} tokens, got {n}")
    return seconds, n


def hook_cost_us(batch: int, iterations: int = 20_000) -> dict[str, float]:
    """In-process, noise-free part: microseconds the engine thread spends in the telemetry hooks
    per tick (B decode tokens: tick event, B inter-token gaps, Prometheus updates, a handler)
    and per finished request, with everything on and with nobody listening."""
    from collections import deque
    from types import SimpleNamespace

    from llama_grpc_server.core.requests.request import (
        Finished,
        FinishReason,
        GenerationRequest,
        Request,
        Timings,
        Usage,
    )
    from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan, StepResult
    from llama_grpc_server.observability.metrics import Metrics
    from llama_grpc_server.observability.telemetry import EVENT_NAMES, Bus, Telemetry
    from llama_grpc_server.testing import FakeEngine

    chunks = tuple(Chunk(i, f"r{i}", 50, (7,), True) for i in range(batch))
    plan = StepPlan(tick=1, chunks=chunks)
    result = StepResult(sampled=dict.fromkeys(range(batch), 7), eval_ms=40.0, sample_ms=4.0)
    scheduler: Any = SimpleNamespace(
        slots=[SimpleNamespace(request=object()) for _ in range(batch)], queue=deque()
    )
    request = Request(GenerationRequest("done", tuple(range(40))), arrival_ns=1)
    finished = Finished(
        FinishReason.MAX_TOKENS, Usage(40, 64, 0), Timings(1.0, 50.0, 49.0, 900.0, 950.0), 1
    )
    bus = Bus()
    seen: dict[str, int] = {}

    def handler(name: str, event: Any) -> None:
        seen[name] = seen.get(name, 0) + 1

    for name in EVENT_NAMES:
        bus.attach(name, handler)
    out: dict[str, float] = {}
    metrics = Metrics()
    engine = FakeEngine()
    metrics.watch(lambda: {"fake": engine.stats()})
    for label, hooks in (
        ("full", Telemetry(bus=bus, sink=metrics, model="fake")),
        ("nobody_listening", Telemetry(bus=Bus())),
    ):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            hooks.on_tick(plan, result, scheduler)
        t1 = time.perf_counter_ns()
        for _ in range(iterations):
            hooks.on_done(request, finished)
        t2 = time.perf_counter_ns()
        out[f"{label}_per_tick_us"] = (t1 - t0) / iterations / 1000
        out[f"{label}_per_request_us"] = (t2 - t1) / iterations / 1000
    t0 = time.perf_counter_ns()
    for _ in range(100):
        metrics.render()
    out["scrape_render_ms"] = (time.perf_counter_ns() - t0) / 100 / 1e6  # GIL held meanwhile
    return out


def metric_value(text: str, name: str) -> float:
    """The series' value summed over its labels (engine series carry a `model` label)."""
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    ]
    return sum(values) if values else float("nan")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    server_args = ["--n-parallel", str(args.batch), "--n-ctx", str(args.n_ctx)]
    server_args += ["--threads", str(args.threads)]
    tok_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory() as tmp,
        otlp_receiver() as receiver,
        server("full", server_args, Path(tmp)) as full,
        server("minimal", server_args, Path(tmp)) as minimal,
        server("traced", server_args, Path(tmp), receiver["url"]) as traced,
    ):
        servers = {"full": full, "minimal": minimal, "traced": traced}
        for mode in MODES:  # warm-up, not recorded
            run_once(servers[mode], mode, args, round_=-1)
        for rep in range(args.reps):
            shift = rep % len(MODES)
            order = MODES[shift:] + MODES[:shift]
            for mode in order:
                seconds, n = run_once(servers[mode], mode, args, round_=rep)
                tok_s[mode].append(n / seconds)
                progress(f"rep {rep + 1}/{args.reps} {mode:>7}: {n / seconds:7.1f} tok/s")
        exposition = scrape(full["metrics_port"])
        log_bytes = full["log"].stat().st_size
        time.sleep(6)  # the traced server's batch processor exports every 5 s
    traced_m = statistics.median(tok_s["traced"])
    traced_paired = [t / m for t, m in zip(tok_s["traced"], tok_s["minimal"], strict=True)]
    full_m, minimal_m = statistics.median(tok_s["full"]), statistics.median(tok_s["minimal"])
    paired = [100 * (m - f) / m for f, m in zip(tok_s["full"], tok_s["minimal"], strict=True)]
    ticks = metric_value(exposition, "llama_grpc:iteration_tokens_total_count")
    tick_compute_ms = (
        1000
        * (
            metric_value(exposition, "llama_grpc:eval_seconds_total")
            + metric_value(exposition, "llama_grpc:sample_seconds_total")
        )
        / ticks
    )
    hooks = hook_cost_us(args.batch)
    return {
        "mean_tick_compute_ms": tick_compute_ms,
        "hook_cost_us": hooks,
        "hook_cost_pct_of_tick": hooks["full_per_tick_us"] / (10 * tick_compute_ms),
        "tok_s": {mode: summary(values) for mode, values in tok_s.items()},
        "tok_s_runs": tok_s,
        "overhead_pct_of_medians": 100 * (minimal_m - full_m) / minimal_m,
        "overhead_pct_paired": summary(paired),
        "traced_ratio_of_medians": traced_m / minimal_m,
        "traced_ratio_paired": summary(traced_paired),
        "spans_received": receiver["spans"],
        "otlp_exports": receiver["exports"],
        "full_server_evidence": {
            "generation_tokens_total": metric_value(
                exposition, "llama_grpc:generation_tokens_total"
            ),
            "iteration_tokens_total_count": metric_value(
                exposition, "llama_grpc:iteration_tokens_total_count"
            ),
            "access_log_bytes": log_bytes,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--scrape-interval-s", type=float, default=1.0)
    args, rest = parser.parse_known_args()
    if args.serve:
        return serve_child(args.serve, [a for a in rest if a != "--"])
    result = measure(args)
    data = {
        "benchmark": "telemetry_overhead",
        "command": "python bench/telemetry_overhead.py " + " ".join(sys.argv[1:]),
        "workload": {
            "concurrent_streams": args.batch,
            "generated_tokens_per_stream": args.gen_tokens,
            "sampling": "greedy, ignore_eos, cache_prompt=false, distinct prompts",
        },
        "modes": {
            "full": "--metrics-port (scraped every scrape_interval_s), a handler on every bus "
            "event, --log-level info JSON access logs to a file",
            "minimal": "--log-level warning, no --metrics-port, no handler",
            "traced": "minimal plus --otlp-endpoint to an OTLP/HTTP receiver in the benchmark",
        },
        "settings": {k: v for k, v in vars(args).items() if k != "serve"},
        "machine": machine_facts(),
        **result,
    }
    write_json("telemetry_overhead", data)
    plot(result["tok_s_runs"])
    for mode in MODES:
        print(f"{mode:>7}: median {result['tok_s'][mode]['median']:7.1f} tok/s")
    print(f"overhead (medians): {result['overhead_pct_of_medians']:+.2f}%")
    print(f"overhead (paired, median): {result['overhead_pct_paired']['median']:+.2f}%")
    print(
        f"traced / minimal: {result['traced_ratio_of_medians']:.3f} (medians), paired median "
        f"{result['traced_ratio_paired']['median']:.3f}; {result['spans_received']} spans "
        f"received in {result['otlp_exports']} exports"
    )
    hooks = result["hook_cost_us"]
    print(
        f"engine-thread hook cost: {hooks['full_per_tick_us']:.1f} us/tick "
        f"({result['hook_cost_pct_of_tick']:.3f}% of a {result['mean_tick_compute_ms']:.1f} ms "
        f"tick), {hooks['full_per_request_us']:.1f} us/request; nobody listening: "
        f"{hooks['nobody_listening_per_tick_us']:.2f} us/tick; one /metrics render "
        f"{hooks['scrape_render_ms']:.2f} ms"
    )
    return 0


def plot(tok_s: dict[str, list[float]]) -> None:
    try:
        import matplotlib
    except ImportError:
        progress("matplotlib missing (dependency group 'bench'): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in zip(MODES, "os^", strict=True):
        ax.plot(range(1, len(tok_s[mode]) + 1), tok_s[mode], marker + "-", label=mode)
    ax.set_xlabel("repetition")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Telemetry fully on vs minimal vs traced, 8 concurrent streams")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "telemetry_overhead.png", dpi=120)
    progress("wrote bench/results/telemetry_overhead.png")


if __name__ == "__main__":
    sys.exit(main())
