"""deploy/grafana/llama-grpc.json against a real server's /metrics: every series a panel queries
is one the server exports (names compared with the scraped sample names, so a histogram must be
queried as _bucket/_sum/_count and a counter as _total), every panel is well formed, and the
panels cover the required topics. The extractor itself is checked on representative expressions
and on a copy of the dashboard with a bogus metric in it. test_prometheus.py evaluates every
query in a real Prometheus."""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio
import yaml
from deploy.cluster import free_port

from llama_grpc import AsyncClient
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.observability.telemetry import Bus, Telemetry
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.support.dashboard import DASHBOARD, load_dashboard, panels

from ..conftest import scrape
from .conftest import settings

P = "llama_grpc:"

# One series per required topic; the dashboard must query each of them.
REQUIRED = {
    "generated tokens/s": P + "generation_tokens_total",
    "TTFT percentiles": P + "time_to_first_token_seconds_bucket",
    "inter-token latency percentiles": P + "inter_token_latency_seconds_bucket",
    "e2e latency percentiles": P + "e2e_request_latency_seconds_bucket",
    "queue depth": P + "num_requests_waiting",
    "running requests": P + "num_requests_running",
    "slots by state": P + "num_slots",
    "KV cache usage": P + "kv_cache_usage_perc",
    "prefix-cache hits": P + "prefix_cache_hits_total",
    "prefix-cache queries": P + "prefix_cache_queries_total",
    "RAM tier": P + "ram_cache_entries",
    "preemptions": P + "num_preemptions_total",
    "RPC rate": "grpc_server_started_total",
    "RPC outcomes by code": "grpc_server_handled_total",
    "engine up": P + "engine_up",
    "deadlines": P + "requests_deadline_exceeded_total",
    "disk-tier write failures": P + "disk_cache_write_failures_total",
}

# -- the PromQL name extractor ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z_$]+")
_NAME = re.compile(r"(?<![\w:$.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\((.*),\s*\w+\s*\)")  # Grafana's variable query
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                       "and", "or", "unless", "offset", "inf", "nan"})  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: quoted strings, label matchers, ranges and
    grouping clauses are removed, then every identifier that is not a function call (followed by
    '('), a keyword, a Grafana variable or part of a number is a metric name."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


# -- the dashboard ---------------------------------------------------------------------------------


def queried(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """{metric name: titles of the panels that query it}, template variables' queries included."""
    found: dict[str, set[str]] = {}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                found.setdefault(name, set()).add(panel["title"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            selector = _LABEL_VALUES.fullmatch(var["query"]["query"].strip())
            assert selector, var["query"]
            for name in metric_names(selector.group(1)):
                found.setdefault(name, set()).add(f"${var['name']}")
    return found


def unexported(dashboard: dict[str, Any], exported: set[str]) -> dict[str, set[str]]:
    """The queried names that no scraped sample has, with the panels that use them."""
    return {name: where for name, where in queried(dashboard).items() if name not in exported}


# -- the live server -------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def exported() -> AsyncIterator[set[str]]:
    """Sample names a real server exports on --metrics-port after a few requests (streams, a
    repeated prompt for a prefix hit), so its histograms and labelled counters have series."""
    metrics = Metrics()
    hooks = Telemetry(bus=Bus(), sink=metrics)
    base = settings(n_parallel=2)
    conf = replace(base, server=replace(base.server, metrics_port=free_port()))

    def factory() -> Any:
        return build_engine(conf, on_tick=hooks.on_tick, on_done=hooks.on_done)

    async with start_server(conf, factory, metrics=metrics) as running:
        assert await running.wait_loaded()
        assert running.metrics_port is not None
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=120) as client:
            prompt = "A dashboard for a language model server shows"
            async for _ in client.stream(prompt, max_tokens=4, ignore_eos=True):
                pass
            await client.generate(prompt + " latency", max_tokens=4, ignore_eos=True)
            await client.generate(prompt + " latency", max_tokens=4, ignore_eos=True)
            got = await asyncio.to_thread(scrape, running.metrics_port)
    yield {name for name, _ in got}


async def test_every_queried_metric_is_exported(exported: set[str]) -> None:
    dashboard = load_dashboard()
    assert queried(dashboard)
    assert unexported(dashboard, exported) == {}


async def test_required_topics_are_covered(exported: set[str]) -> None:
    names = queried(load_dashboard())
    missing = {topic: name for topic, name in REQUIRED.items() if name not in names}
    assert missing == {}
    assert set(REQUIRED.values()) <= exported  # the topic list itself names real series


async def test_a_bogus_metric_is_caught(exported: set[str]) -> None:
    """A copy of the dashboard with one made-up series, and one histogram queried without its
    _bucket suffix, fails the export check, naming both."""
    original = load_dashboard()
    dashboard = copy.deepcopy(original)
    [first, *_] = panels(dashboard)
    first["targets"].append({"refId": "Z", "expr": 'sum(rate(llama_grpc:bogus_total{a="b"}[5m]))'})
    first["targets"].append(
        {"refId": "Y", "expr": "avg(llama_grpc:time_to_first_token_seconds)"}  # no such series
    )
    added = set(unexported(dashboard, exported)) - set(unexported(original, exported))
    assert added == {
        "llama_grpc:bogus_total",
        "llama_grpc:time_to_first_token_seconds",
    }


# -- static checks (no server) ---------------------------------------------------------------------


def test_panels_are_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    all_panels = list(panels(dashboard))
    assert len(all_panels) >= 15
    for panel in all_panels:
        title = panel.get("title")
        assert title, panel
        targets = panel.get("targets", [])
        assert targets, title
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", title
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), title
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in targets:
            expr = target["expr"]
            assert metric_names(expr), (title, expr)
            assert '$instance"' in expr, (title, expr)  # follows the instance selector
            for opening, closing in ("()", "{}", "[]"):
                assert expr.count(opening) == expr.count(closing), (title, expr)


def test_the_disk_tier_is_on_the_dashboard() -> None:
    """The disk tier's size, restores and rejected files are shown (that every queried series
    exists on a real server is checked above)."""
    names = queried(load_dashboard())
    for series in (
        "disk_cache_entries",
        "disk_cache_hits_total",
        "disk_cache_verify_failures",
        "disk_cache_write_failures",
    ):
        assert any(series in name for name in names), series


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.95, sum by (le) (rate("
            'llama_grpc:time_to_first_token_seconds_bucket{job=~"$job"}[$__rate_interval])))',
            {"llama_grpc:time_to_first_token_seconds_bucket"},
        ),
        (
            "sum by (instance) (rate(llama_grpc:prefix_cache_hits_total[5m])) / "
            "sum by (instance) (rate(llama_grpc:prefix_cache_queries_total[5m]))",
            {"llama_grpc:prefix_cache_hits_total", "llama_grpc:prefix_cache_queries_total"},
        ),
        (
            'sum by (grpc_code) (rate(grpc_server_handled_total{grpc_code!="OK", '
            'tenant=~"a|b"}[1m]))',
            {"grpc_server_handled_total"},
        ),
        ("llama_grpc:num_requests_waiting", {"llama_grpc:num_requests_waiting"}),
        (
            "max without (state) (llama_grpc:num_slots) > bool 0.5 or on (instance) "
            "llama_grpc:engine_up offset 5m",
            {"llama_grpc:num_slots", "llama_grpc:engine_up"},
        ),
        (
            "sum(rate(llama_grpc:iteration_tokens_total_sum[2m])) / "
            "sum(rate(llama_grpc:iteration_tokens_total_count[2m])) * 1e3",
            {"llama_grpc:iteration_tokens_total_sum", "llama_grpc:iteration_tokens_total_count"},
        ),
        ('vector(1) + label_replace(up, "a", "$1", "b", "(.*)")', {"up"}),
    ],
)
def test_metric_names_extractor(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_prometheus_example_matches_the_k8s_manifest() -> None:
    """prometheus.yml parses, and its commented Kubernetes variant, once uncommented, parses
    too and keeps the pods and the container port that deploy/k8s/llama-grpc.yaml declares."""
    text = (DASHBOARD.parent / "prometheus.yml").read_text()
    static = yaml.safe_load(text)
    [job] = static["scrape_configs"]
    assert job["job_name"] == "llama-grpc"
    assert all(t.endswith(":9100") for t in job["static_configs"][0]["targets"])

    block = [line for line in text.splitlines() if line.startswith("  # ")]
    k8s_lines = block[block.index("  # - job_name: llama-grpc") :]
    [k8s] = yaml.safe_load("\n".join("  " + line[4:] for line in k8s_lines))
    keep = {
        r["source_labels"][0]: r["regex"]
        for r in k8s["relabel_configs"]
        if r.get("action") == "keep"
    }
    manifest = DASHBOARD.parents[1] / "k8s" / "llama-grpc.yaml"
    [deployment, *_] = yaml.safe_load_all(manifest.read_text())
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert keep["__meta_kubernetes_pod_label_app"] == pod["metadata"]["labels"]["app"]
    assert ports[keep["__meta_kubernetes_pod_container_port_name"]] == 9100
    assert "--metrics-port=9100" in container["args"]
