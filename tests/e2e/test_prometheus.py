"""A real Prometheus (Debian's `prometheus` package, 2.42: `make prometheus` installs it) scrapes
a real server's --metrics-port every second. After a few seconds of traffic, every query of
every panel of deploy/grafana/llama-grpc.json (and its variables) evaluates through Prometheus's
HTTP API to a non-empty result, and the fault counters move by exactly what was injected: client
cancels, deadlines (one decoding, one queued), a request refused by a full queue, disk-tier
writes that fail (the directory replaced by a file), and last an engine failure (a strategy that
raises once told to)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.cluster import free_port

from llama_grpc import (
    AsyncClient,
    DeadlineExceededError,
    Delta,
    InternalError,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.observability.telemetry import Bus, Telemetry
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from llama_grpc_testkit.crashing_strategy import CRASH_NOW
from llama_grpc_testkit.models import tiny_model_file
from tests.support.dashboard import load_dashboard, panels

from .conftest import settings

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not on PATH: `make prometheus` installs Debian's package "
    "(apt-get, as root); CI does so before `make check`",
)

JOB = "llama-grpc"
RATE_INTERVAL = "4s"  # what Grafana's $__rate_interval is at a 1 s scrape interval (4 scrapes)
WAIT_S = 90.0  # bound on every wait for Prometheus to see a change (polled, never slept)
LONG = 30_000  # max_tokens of a stream closed before its end: ~10 s of counting tokens alone
PROMPT = (
    "A monitoring system scrapes the metrics of a language model server every second and keeps "
    "each series in its time-series database, so that a dashboard can show tokens per second, "
    "latencies and the queue. Operators read those panels when a deploy goes out, when users "
    "report slow answers, and when an alert fires because requests fail or time out. Each panel "
    "is a query over the stored series, evaluated at the time the dashboard is opened. "
    "Summarise what it stores:"
)  # over 64 tokens (ram_min_tokens): every idle slot's cache is one the disk tier saves
FAULTS = {
    "cancelled": "llama_grpc:requests_cancelled_total",
    "deadline": "llama_grpc:requests_deadline_exceeded_total",
    "rejected": "llama_grpc:requests_rejected_total",
    "engine failures": "llama_grpc:requests_failed_total",
    "disk write failures": "llama_grpc:disk_cache_write_failures_total",
}


class Prometheus:
    """A prometheus process on 127.0.0.1 scraping one target every second."""

    def __init__(self, directory: Path, target: str) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": JOB, "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        assert PROMETHEUS is not None
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(  # our own arguments
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str | list[str]) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def scalar(self, expr: str) -> float | None:
        """The value of a query with one series, None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    async def ready(self) -> None:
        async def is_ready() -> bool:
            assert self.process.poll() is None, self.log.read_text()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        await until(is_ready, "prometheus ready")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def until(check: Callable[[], Awaitable[Any]], what: str) -> None:
    """Poll `check` until it returns True; anything else it returns is what it saw, named in
    the failure."""
    deadline = time.monotonic() + WAIT_S
    while (seen := await check()) is not True:
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}; last saw {seen}"
        await asyncio.sleep(0.2)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in panels(load_dashboard())
        for target in panel.get("targets", [])
    ]


def resolve(expr: str, instance: str) -> str:
    """What Grafana sends for this dashboard's variables: the job, the instance, the range."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$job", JOB)
        .replace("$instance", instance)
    )


@contextlib.asynccontextmanager
async def scraped_server(tmp_path: Path) -> AsyncIterator[tuple[RunningServer, Prometheus]]:
    """A server on the tiny counting model (the test reads statuses and counters, not words: a
    stream of LONG tokens outlasts every wait below), with 1 slot and 1 place in the queue, a
    disk tier saving idle caches after 0.3 s, a strategy that kills the engine on demand, and a
    Prometheus scraping it."""
    metrics = Metrics()
    hooks = Telemetry(bus=Bus(), sink=metrics)
    base = settings(
        str(tiny_model_file()),
        n_parallel=1,
        max_queue=1,
        n_ctx=LONG + 1024,
        kv_cache_dir=str(tmp_path / "kv"),
        session_idle_s=0.3,
        batch_strategy="llama_grpc_testkit.crashing_strategy:on_demand",
    )
    conf = replace(base, server=replace(base.server, metrics_port=free_port()))
    CRASH_NOW.clear()

    def factory() -> Any:
        return build_engine(conf, on_tick=hooks.on_tick, on_done=hooks.on_done)

    async with start_server(conf, factory, metrics=metrics) as running:
        assert await running.wait_loaded()
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{running.metrics_port}")
        try:
            await prometheus.ready()
            yield running, prometheus
        finally:
            prometheus.close()
            CRASH_NOW.clear()


async def test_prometheus_evaluates_every_panel_and_sees_each_fault(tmp_path: Path) -> None:
    async with (
        scraped_server(tmp_path) as (running, prom),
        AsyncClient(f"127.0.0.1:{running.port}", timeout=120) as client,
    ):
        instance = prom.target

        async def faults() -> dict[str, float | None]:
            return {
                name: await asyncio.to_thread(prom.scalar, f'{series}{{job="{JOB}"}}')
                for name, series in FAULTS.items()
            }

        async def faults_are(expected: dict[str, float]) -> Any:
            seen = await faults()
            return seen == expected or seen

        zero = dict.fromkeys(FAULTS, 0.0)
        await until(lambda: faults_are(zero), "the fault counters at 0 in Prometheus")

        # The disk tier's directory becomes a file: every save of an idle cache fails.
        kv = tmp_path / "kv"
        shutil.rmtree(kv)
        kv.write_bytes(b"not a directory")

        # A few seconds of traffic: streams, a repeated prompt (prefix-cache hit).
        async def stream(prompt: str) -> int:
            events = client.stream(prompt, max_tokens=24, ignore_eos=True)
            return sum([len(e.token_ids) async for e in events if isinstance(e, Delta)])

        assert await asyncio.gather(stream(PROMPT), stream(PROMPT + " Briefly.")) == [24, 24]
        assert (await client.generate(PROMPT, max_tokens=8)).usage.cached_prompt_tokens > 0

        async def started(events: Any) -> Any:
            """The stream, once its first delta arrived (its request holds the slot)."""
            async for _ in events:
                return events
            raise AssertionError("the stream ended without a delta")

        # A client cancel.
        await (await started(client.stream(PROMPT, max_tokens=LONG, ignore_eos=True))).aclose()
        # A deadline that passes while the request decodes.
        late = await started(client.stream(PROMPT, max_tokens=LONG, ignore_eos=True, timeout=1))
        with pytest.raises(DeadlineExceededError):
            async for _ in late:
                pass
        # The queue full (1 slot, max_queue 1): of two more requests beside a running one, the
        # second to reach the engine is rejected, the first waits; then both others are closed.
        running_one = await started(client.stream(PROMPT, max_tokens=LONG, ignore_eos=True))
        outcomes = await asyncio.gather(
            *(client.generate(PROMPT, max_tokens=8, timeout=1.5) for _ in range(2)),
            return_exceptions=True,
        )
        assert sorted(type(o).__name__ for o in outcomes) == [
            "DeadlineExceededError",
            "QueueFullError",
        ]
        await running_one.aclose()

        async def disk_failures_agree() -> Any:
            failures = (await client.stats()).disk_cache_write_failures
            seen = await faults()
            expected = zero | {
                "cancelled": 2.0,
                "deadline": 2.0,
                "rejected": 1.0,
                "disk write failures": float(failures),
            }
            return (failures > 0 and seen == expected) or (failures, seen)

        await until(disk_failures_agree, "the faults in Prometheus (equal to GetStats)")
        codes = {
            code: await asyncio.to_thread(
                prom.scalar,
                f'sum(grpc_server_handled_total{{job="{JOB}", grpc_code="{code}"}})',
            )
            for code in ("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
        }
        assert codes == {"CANCELLED": 2.0, "DEADLINE_EXCEEDED": 2.0, "RESOURCE_EXHAUSTED": 1.0}

        # Every panel's every query, and the dashboard's variables, as Grafana would send them.
        empty = [
            (title, expr)
            for title, expr in panel_queries()
            if not await asyncio.to_thread(prom.query, resolve(expr, instance))
        ]
        assert empty == []
        for label, match in (("job", "llama_grpc:engine_up"), ("instance", "llama_grpc:engine_up")):
            values = await asyncio.to_thread(prom.get, f"/api/v1/label/{label}/values", **{
                "match[]": [match]
            })  # fmt: skip
            assert values == [JOB if label == "job" else instance]

        # Last, the engine fails: the request it was running counts as failed, engine_up is 0.
        CRASH_NOW.set()
        with pytest.raises(InternalError):
            await client.generate(PROMPT, max_tokens=8)

        async def engine_failure_seen() -> Any:
            seen = await faults()
            up = await asyncio.to_thread(prom.scalar, f'llama_grpc:engine_up{{job="{JOB}"}}')
            return (up == 0.0 and seen["engine failures"] == 1.0) or (up, seen)

        await until(engine_failure_seen, "the engine failure in Prometheus")
