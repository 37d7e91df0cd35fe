"""Shared benchmark plumbing: machine facts, a llama-grpc server subprocess, JSON + PNG output,
progress lines. Benchmarks never assert timings; they write what they measured."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_facts(threads: int | None = None) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    facts: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": threads,
        "load_average_at_start": list(os.getloadavg()),
    }
    with contextlib.suppress(Exception):
        import llama_cpp

        facts["llama_cpp_python"] = llama_cpp.__version__
        facts["llama_system_info"] = llama_cpp.llama_print_system_info().decode()
    return facts


def summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "n": len(ordered),
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    progress(f"wrote {path.relative_to(ROOT)}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_grpc_server(*args: str, timeout_s: float = 120.0) -> Iterator[str]:
    """Start `python -m llama_grpc_server` on a free loopback port; yield its target."""
    with llama_grpc_process(*args, timeout_s=timeout_s) as (target, _):
        yield target


@contextlib.contextmanager
def llama_grpc_process(
    *args: str,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """llama_grpc_server, yielding the process too (its pid, for CPU accounting); `env` is
    added to this process's environment for the server alone; `credentials` reach a TLS one."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_grpc_server", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc, timeout_s, credentials)
        yield target, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(
    target: str,
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"server exited with {proc.returncode}: {err[-2000:]}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"server at {target} not SERVING after {timeout_s}s")


# -- shared workload helpers (single, concurrency, strategies, prefix_cache, tokenize, peers) ----

DEFAULT_THREADS = 2
_WORD_LIST = (
    "the city river bridge market music people century change growth trade stone harbour "
    "lighthouse boat street church tide season winter summer festival bread wine garden tower "
    "wall gate road village farmer merchant sailor scholar library letter story song dance "
    "morning evening night rain wind snow sun moon star field forest hill valley mountain lake "
    "king queen council law court school teacher student book map ship cargo silver gold iron "
    "copper salt wool cloth grain fish oil lamp fire smoke bell clock square fountain statue "
    "painter poet builder engineer doctor family child friend neighbour stranger guest feast"
)
WORDS = tuple(_WORD_LIST.split(" "))


def seeded_text(n_words: int, seed: int) -> str:
    """Deterministic English-like text: sentences of 6-14 words from a fixed word list."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n_words:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentence[0] = sentence[0].capitalize()
        out += sentence
        out[-1] += "."
    return " ".join(out[:n_words])


def finish_facts(data: dict[str, Any]) -> dict[str, Any]:
    """Stamp the end-of-run load average next to the start one (noise from other work)."""
    data.setdefault("machine", machine_facts())
    data["machine"]["load_average_at_end"] = list(os.getloadavg())
    return data


def server_args(threads: int, *extra: str) -> list[str]:
    return ["--threads", str(threads), "--threads-batch", str(threads), *extra]


def greedy_params(
    max_tokens: int, *, ignore_eos: bool = True, cache_prompt: bool | None = None
) -> Any:
    from llama_grpc.v1 import llm_service_pb2 as pb

    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0, seed=1234),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
    if cache_prompt is not None:
        params.cache_prompt = cache_prompt
    return params


class StreamRecord:
    """Client-side timing of one streaming request: send time, one arrival time per token."""

    __slots__ = (
        "cached_prompt_tokens",
        "n_tokens",
        "server_ttft_ms",
        "t_done",
        "t_send",
        "times",
        "token_ids",
    )

    def __init__(self, t_send: float) -> None:
        self.t_send = t_send
        self.times: list[float] = []  # one entry per generated token, at its delta's arrival
        self.token_ids: list[int] = []
        self.t_done = t_send
        self.n_tokens = 0
        self.cached_prompt_tokens = 0
        self.server_ttft_ms = float("nan")

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.t_send if self.times else float("nan")

    @property
    def decode_tok_s(self) -> float:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return float("nan")
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def gaps_s(self) -> list[float]:
        """Inter-token gaps between consecutive arrivals (tokens of one delta arrive together)."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "n_tokens": self.n_tokens,
            "decode_tok_s": self.decode_tok_s,
            "total_s": self.t_done - self.t_send,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "server_ttft_ms": self.server_ttft_ms,
        }


async def stream_tokens(
    stub: Any,
    token_ids: Sequence[int] | None = None,
    *,
    text: str | None = None,
    params: Any,
    session_id: str = "",
    timeout: float = 600.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> StreamRecord:
    """One GenerateTokens (ids) or StreamGenerate (text) call, timed per delta on arrival."""
    from llama_grpc.v1 import llm_service_pb2 as pb

    record = StreamRecord(time.perf_counter())
    if text is None:
        call = stub.GenerateTokens(
            pb.GenerateTokensRequest(token_ids=token_ids, params=params, session_id=session_id),
            timeout=timeout,
            metadata=metadata or None,
        )
    else:
        call = stub.StreamGenerate(
            pb.StreamGenerateRequest(prompt=text, params=params, session_id=session_id),
            timeout=timeout,
            metadata=metadata or None,
        )
    async for msg in call:
        now = time.perf_counter()
        if msg.HasField("delta"):
            k = len(msg.delta.token_ids)
            record.times += [now] * k
            record.token_ids += msg.delta.token_ids
            record.n_tokens += k
        elif msg.HasField("done"):
            record.cached_prompt_tokens = msg.done.usage.cached_prompt_tokens
            record.server_ttft_ms = msg.done.timings.ttft_ms
    record.t_done = time.perf_counter()
    return record


async def tokenize(stub: Any, text: str) -> list[int]:
    from llama_grpc.v1 import llm_service_pb2 as pb

    reply = await stub.Tokenize(pb.TokenizeRequest(text=text))
    return list(reply.token_ids)


async def prompt_of(stub: Any, n_tokens: int, seed: int) -> list[int]:
    """Exactly n_tokens ids (BOS first) of seeded text, cut from a longer tokenization."""
    ids = await tokenize(stub, seeded_text(n_tokens, seed))
    while len(ids) < n_tokens:  # words are >= 1 token each, so this rarely loops
        ids = await tokenize(stub, seeded_text(2 * n_tokens, seed))
    return ids[:n_tokens]


def spread(values: Sequence[float]) -> dict[str, float]:
    """summary() plus p50/p95 and the relative spread (max-min)/median."""
    out = summary(values)
    out["p50"] = out["median"]
    out["mean"] = statistics.fmean(values)
    out["rel_spread"] = (out["max"] - out["min"]) / out["median"] if out["median"] else 0.0
    return out


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rates(
    ax: Any, rows: Sequence[dict[str, Any]], series: Sequence[tuple[str, str, str]], ratio: str
) -> None:
    """Aggregate tok/s against B: a line per (row key, line style, label); the last line's points
    carry each row's `ratio` below them."""
    xs = [r["batch"] for r in rows]
    for key, style, label in series:
        ax.plot(xs, [r[key] for r in rows], style, label=label)
    for r in rows:
        ax.annotate(
            f"{r[ratio]:.2f}",
            (r["batch"], r[series[-1][0]]),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("concurrent sequences B")
    ax.set_ylabel("aggregate tokens/s")


def save_figure(fig: Any, name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"wrote {path.relative_to(ROOT)}")
    return path


class GrpcBackend:
    """llama-grpc as a benchmark backend: greedy GenerateTokens streams over one channel.
    peers.py implements the same two methods for the HTTP peers."""

    name = "llama-grpc"

    def __init__(self, stub: Any) -> None:
        self.stub = stub

    async def generate(
        self,
        ids: Sequence[int],
        max_tokens: int,
        *,
        cache_prompt: bool | None = None,
        session: str = "",
    ) -> StreamRecord:
        params = greedy_params(max_tokens, cache_prompt=cache_prompt)
        return await stream_tokens(self.stub, ids, params=params, session_id=session)

    async def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        from llama_grpc.v1 import llm_service_pb2 as pb

        reply = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special=add_special))
        return list(reply.token_ids)
