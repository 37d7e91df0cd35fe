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


def machine_facts() -> dict[str, Any]:
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
    port = free_port()
    cmd = [sys.executable, "-m", "llama_grpc_server", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc, timeout_s)
        yield target
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
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
