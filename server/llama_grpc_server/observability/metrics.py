"""Prometheus export for one server, in its own CollectorRegistry: vLLM-style engine series fed by
telemetry events (histograms) and by the engines' StatsSnapshots at scrape time (the same
cumulative counters GetStats returns), plus per-RPC grpc_server_* series (an RpcRecorder).
Every engine series has a `model` label (the model's name: one value per resident model, and
per model that has served since start for the event-fed ones); the RPC series do not.
Imports prometheus_client; never llama_cpp or grpc."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llama_grpc_server.core.api import DiskTierStats, StatsSnapshot
from llama_grpc_server.models.pool import ModelState, ModelStatus
from llama_grpc_server.observability.telemetry import RequestEvent, TickEvent

PREFIX = "llama_grpc:"
MODEL = "model"
StatsSource = Callable[[], Mapping[str, StatsSnapshot]]  # model name -> its engine's snapshot
ModelsSource = Callable[[], Sequence[ModelStatus]]

# Buckets follow vLLM's where it has them (seconds / tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                   15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                   1920.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                 65536, 131072)  # fmt: skip
SEQUENCE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               120.0, 300.0, 600.0)  # fmt: skip


def split_method(method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


class Metrics:
    """Every series of one server. An EventSink for telemetry.Telemetry and an RpcRecorder for
    the request interceptor; `watch(pool.snapshots, pool.statuses)` once the default model is
    loaded."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stats: StatsSource | None = None
        self._models: ModelsSource | None = None
        self._rpc_children: dict[tuple[str, str], Any] = {}
        reg = self.registry
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, [MODEL], buckets=buckets, registry=reg)

        self.ttft = histogram(
            "time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS
        )
        self.inter_token = histogram(
            "inter_token_latency_seconds", "Between two tokens of one request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From arrival to the end.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "From arrival to a slot.", REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "From a slot to the first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the end.", REQUEST_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of a finished request.", TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Batch size: tokens per forward pass.", TOKEN_BUCKETS
        )
        self.iteration_sequences = histogram(
            "iteration_sequences", "Sequences (slots) per forward pass.", SEQUENCE_BUCKETS
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [MODEL, "finished_reason"],
            registry=reg,
        )
        self.eval_seconds = Counter(
            PREFIX + "eval_seconds", "Time in llama_decode.", [MODEL], registry=reg
        )
        self.sample_seconds = Counter(
            PREFIX + "sample_seconds", "Time sampling after llama_decode.", [MODEL], registry=reg
        )
        self.rpc_started_total = Counter(
            "grpc_server_started",
            "RPCs started.",
            ["grpc_service", "grpc_method", "tenant"],
            registry=reg,
        )
        self.rpc_handled_total = Counter(
            "grpc_server_handled",
            "RPCs completed, by status code.",
            ["grpc_service", "grpc_method", "grpc_code", "tenant"],
            registry=reg,
        )
        self.rpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "RPC handling time, to the last message.",
            ["grpc_service", "grpc_method", "tenant"],
            buckets=RPC_BUCKETS,
            registry=reg,
        )
        reg.register(_SnapshotCollector(self))

    def watch(self, stats: StatsSource, models: ModelsSource | None = None) -> None:
        """Read live state and cumulative counters from `stats` (each resident engine's, by
        model name) and the models' states from `models` at each scrape."""
        self._stats = stats
        self._models = models

    def snapshots(self) -> Mapping[str, StatsSnapshot]:
        return self._stats() if self._stats is not None else {}

    def models(self) -> Sequence[ModelStatus]:
        return self._models() if self._models is not None else ()

    def render(self) -> bytes:
        """The text exposition, as /metrics serves it."""
        return generate_latest(self.registry)

    # -- EventSink (engine thread) ----------------------------------------------------------------

    def on_tick(self, event: TickEvent) -> None:
        model = event.model
        self.eval_seconds.labels(model).inc(event.eval_ms / 1000)
        self.sample_seconds.labels(model).inc(event.sample_ms / 1000)
        if not event.is_ok:
            return
        self.iteration_tokens.labels(model).observe(event.batch_size)
        self.iteration_sequences.labels(model).observe(event.num_sequences)
        inter_token = self.inter_token.labels(model)
        for gap_ms in event.inter_token_ms:
            inter_token.observe(gap_ms / 1000)

    def on_request(self, event: RequestEvent) -> None:
        """Latency histograms describe requests that finished; failures are counted by the
        snapshot (requests_failed / cancelled / deadline_exceeded / rejected)."""
        if event.is_failed:
            return
        model = event.model
        self.success.labels(model, event.finish_reason).inc()
        if event.ttft_ms is not None:
            self.ttft.labels(model).observe(event.ttft_ms / 1000)
            prefill_s = max(0.0, event.ttft_ms - event.queue_ms) / 1000
            self.prefill_time.labels(model).observe(prefill_s)
            decode_s = max(0.0, event.duration_ms - event.ttft_ms) / 1000
            self.decode_time.labels(model).observe(decode_s)
        self.e2e.labels(model).observe(event.duration_ms / 1000)
        self.queue_time.labels(model).observe(event.queue_ms / 1000)
        self.prompt_tokens.labels(model).observe(event.prompt_tokens)
        self.generation_tokens.labels(model).observe(event.generated_tokens)

    # -- RpcRecorder (event loop) -----------------------------------------------------------------

    def rpc_started(self, method: str, tenant: str) -> None:
        self.rpc_started_total.labels(*split_method(method), tenant).inc()

    def rpc_handled(self, method: str, code: str, seconds: float, tenant: str) -> None:
        service, name = split_method(method)
        self.rpc_handled_total.labels(service, name, code, tenant).inc()
        self.rpc_seconds.labels(service, name, tenant).observe(seconds)


class _SnapshotCollector:
    """Gauges and counters read from each resident engine's StatsSnapshot per scrape (so
    /metrics and GetStats agree by construction), and the models' residency."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # the series exist only once an engine is watched

    def collect(self) -> Iterator[Metric]:
        snapshots = self._metrics.snapshots()
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model, snapshot in snapshots.items():
            for kind, name, doc, labels, value in _snapshot_series(snapshot):
                family = families.get(name)
                if family is None:
                    names = [MODEL, *labels]
                    family = (GaugeMetricFamily if kind == GAUGE else CounterMetricFamily)(
                        PREFIX + name, doc, labels=names
                    )
                    families[name] = family
                family.add_metric([model, *labels.values()], value)
        yield from families.values()
        yield from _model_series(self._metrics.models())


GAUGE, COUNTER = "gauge", "counter"
Series = tuple[str, str, str, dict[str, str], float]  # kind, name, help, labels, value


def _snapshot_series(s: StatsSnapshot) -> Iterator[Series]:
    """One engine's series, labelled by model in collect()."""
    disk = s.disk_cache or DiskTierStats()
    gauges = {
        "num_requests_running": ("Requests holding a slot.", s.active_slots),
        "num_requests_waiting": ("Requests in the queue.", s.queue_depth),
        "kv_cache_usage_perc": (
            "KV cache usage (0-1): distinct cells in use (shared prefixes once) over n_ctx.",
            s.kv_cells_used / s.kv_cells_total if s.kv_cells_total else 0.0,
        ),
        "ram_cache_entries": ("Slot caches saved in the RAM tier.", s.ram_cache_entries),
        "ram_cache_bytes": ("Bytes held by the RAM tier.", s.ram_cache_bytes),
        "disk_cache_entries": ("Files in the disk tier.", disk.entries),
        "disk_cache_bytes": ("Bytes of the disk tier's files.", disk.bytes),
        "response_cache_entries": (
            "Results stored in the response cache.",
            s.response_cache_entries,
        ),
        "response_cache_bytes": (
            "Bytes held by the response cache (an estimate of their memory).",
            s.response_cache_bytes,
        ),
        "spec_decode_acceptance_rate": (
            "Speculative decoding: accepted / verified draft tokens since start (0 before any).",
            s.spec_acceptance_rate,
        ),
        "paused_streams": (
            "Requests not decoding because their caller has the whole stream buffer unread.",
            s.paused_streams,
        ),
        "engine_up": (
            "1 while the engine thread serves; 0 once it has failed (see GetStats).",
            0 if s.engine_state == "failed" else 1,
        ),
    }
    for name, (doc, value) in gauges.items():
        yield GAUGE, name, doc, {}, value
    for state, count in (
        ("idle", s.idle_slots),
        ("prefilling", s.prefilling_slots),
        ("generating", s.generating_slots),
    ):
        yield GAUGE, "num_slots", "Slots by state.", {"state": state}, count
    counters = {
        "prompt_tokens": ("Prompt tokens of admitted requests.", s.prompt_tokens),
        "generation_tokens": ("Generated tokens.", s.generated_tokens),
        "prefix_cache_queries": ("Prompt tokens looked up in the cache.", s.prompt_tokens),
        "prefix_cache_hits": ("Prompt tokens found in the cache.", s.cached_prompt_tokens),
        "num_preemptions": ("Requests preempted under KV pressure.", s.preemptions),
        "requests_started": ("Requests admitted to a slot.", s.requests_started),
        "requests_finished": ("Requests that finished normally.", s.requests_finished),
        "requests_failed": ("Requests that failed.", s.requests_failed),
        "requests_cancelled": ("Requests cancelled by the client.", s.requests_cancelled),
        "requests_deadline_exceeded": (
            "Requests whose deadline passed (queued, running, or the RPC ended by it).",
            s.requests_deadline_exceeded,
        ),
        "requests_rejected": ("Requests refused by the scheduler.", s.requests_rejected),
        "engine_ticks": ("Forward passes that succeeded.", s.ticks),
        "engine_watchdog_trips": (
            "Ticks the watchdog found running past --watchdog-s (the engine hung; it exits).",
            s.watchdog_trips,
        ),
        "ram_cache_hits": ("RAM-tier restores.", s.ram_cache_hits),
        "ram_cache_misses": ("RAM-tier lookups without a restore.", s.ram_cache_misses),
        "ram_cache_evictions": ("RAM-tier entries evicted.", s.ram_cache_evictions),
        "disk_cache_hits": ("Disk-tier restores.", disk.hits),
        "disk_cache_misses": ("Disk-tier lookups without a restore.", disk.misses),
        "disk_cache_writes": ("Disk-tier files written.", disk.writes),
        "disk_cache_evictions": ("Disk-tier files deleted for the budget.", disk.evictions),
        "disk_cache_verify_failures": (
            "Disk-tier files rejected (corrupt, truncated, another model).",
            disk.verify_failures,
        ),
        "disk_cache_read_seconds": (
            "Time reading and verifying disk-tier files for restores.",
            disk.read_seconds,
        ),
        "disk_cache_read_bytes": ("Bytes read for disk-tier restores.", disk.read_bytes),
        "disk_cache_write_failures": (
            "Disk-tier writes that failed (a full, read-only or failing volume).",
            disk.write_failures,
        ),
        "stalled_readers": (
            "Requests ended because their caller read nothing for --stalled-reader-s.",
            s.stalled_readers,
        ),
        "stream_pauses": ("Times a request was paused for its slow reader.", s.stream_pauses),
        "disk_cache_read_failures": (
            "Disk-tier reads that brought nothing back (the request computed its prompt).",
            disk.read_failures,
        ),
        "response_cache_hits": (
            "Generation requests answered from the response cache.",
            s.response_cache_hits,
        ),
        "response_cache_misses": (
            "Generation requests sent to the engine while the response cache was on.",
            s.response_cache_misses,
        ),
        "response_cache_evictions": (
            "Response-cache entries evicted.",
            s.response_cache_evictions,
        ),
        "spec_decode_num_draft_tokens": (
            "Speculative decoding: draft tokens verified.",
            s.spec_draft_tokens,
        ),
        "spec_decode_num_accepted_tokens": (
            "Speculative decoding: draft tokens the sampler agreed with.",
            s.spec_accepted_tokens,
        ),
        "spec_decode_num_ticks": (
            "Speculative decoding: forward passes that carried drafts.",
            s.spec_ticks,
        ),
    }
    for name, (doc, value) in counters.items():
        yield COUNTER, name, doc, {}, value
    yield (
        COUNTER,
        "adapter_switches",
        "Forward passes whose LoRA adapter set differed from the pass before's.",
        {},
        s.adapter_switches,
    )
    for usage in s.adapters:
        labels = {"adapter": usage.name}
        yield (
            COUNTER,
            "adapter_requests",
            "Requests that applied the LoRA adapter.",
            labels,
            (usage.requests),
        )
        yield (
            COUNTER,
            "adapter_generation_tokens",
            "Tokens generated with the adapter.",
            labels,
            (usage.generated_tokens),
        )
        yield (
            COUNTER,
            "adapter_passes",
            "Forward passes run with the adapter.",
            labels,
            (usage.passes),
        )


def _model_series(models: Sequence[ModelStatus]) -> Iterator[Metric]:
    """Every configured model's residency (models.ModelPool), also of those not loaded."""
    if not models:
        return
    loaded = GaugeMetricFamily(
        PREFIX + "model_loaded", "1 while the model is loaded, else 0.", labels=[MODEL]
    )
    waiting = GaugeMetricFamily(
        PREFIX + "model_requests_waiting",
        "Requests waiting for the model to be loaded.",
        labels=[MODEL],
    )
    loads = CounterMetricFamily(
        PREFIX + "model_loads", "Times the model was loaded since start.", labels=[MODEL]
    )
    load_seconds = GaugeMetricFamily(
        PREFIX + "model_load_seconds", "How long the model's last load took.", labels=[MODEL]
    )
    for m in models:
        loaded.add_metric([m.name], 1 if m.state == ModelState.LOADED.value else 0)
        waiting.add_metric([m.name], m.waiting)
        loads.add_metric([m.name], m.loads)
        load_seconds.add_metric([m.name], m.load_seconds)
    yield from (loaded, waiting, loads, load_seconds)


@dataclass(eq=False)
class MetricsServer:
    """/metrics over HTTP on a background thread; close() stops it."""

    port: int
    _httpd: ThreadingHTTPServer
    _thread: Thread

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


# Always the text format, whatever the scraper's Accept header prefers: prometheus_client's
# OpenMetrics output (what Prometheus asks for first) names samples with the colons escaped to
# underscores while their # TYPE lines keep them (client_python#1177), so a real Prometheus
# stored llama_grpc_* series and every llama_grpc:* query of the dashboard came back empty.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class _MetricsHandler(BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the subclass serve_metrics makes

    def do_GET(self) -> None:  # http.server's name
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the base's name
        """Scrapes are not logged (one a second per scraper)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def serve_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    """Listen on host:port (0 = any free port); raises OSError if the port is taken."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsHttpServer", (_Server,), {"address_family": family})
    handler = type("Handler", (_MetricsHandler,), {"registry": metrics.registry})
    httpd = server_class((host, port), handler)
    thread = Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(int(httpd.server_port), httpd, thread)
