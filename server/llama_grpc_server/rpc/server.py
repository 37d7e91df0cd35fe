"""The grpc.aio server: LlmService, the vLLM engine protocol (rpc.vllm_engine), grpc.health.v1
and reflection behind the request interceptor,
in plaintext or TLS (rpc.tls), callers identified by rpc.access. SIGHUP reloads the TLS files and
the tokens file without cutting a stream.

The port opens at once; the default model's engine loads in a thread meanwhile (health
NOT_SERVING, RPCs answer NOT_READY). Other models (--model NAME=PATH, --models-dir) load on
demand through the model pool (models.py). SIGTERM/SIGINT drain gracefully. If the default
model's engine thread dies, health turns NOT_SERVING at once and serve() exits with
EXIT_ENGINE_FAILED after the grace period (so an orchestrator restarts the process), unless
keep_alive_on_engine_error; another model's failed engine is unloaded by the pool. An engine,
any model's, whose watchdog tripped (a tick stuck past --watchdog-s) makes serve() exit with
EXIT_ENGINE_HUNG after the grace period whatever keep_alive_on_engine_error says: its thread
cannot be stopped or freed. Never imports llama_cpp: engines come from factories."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import errors, model_files
from llama_grpc_server.auth import (
    AuthFileError,
    AuthTable,
    is_loopback,
    load_auth_file,
    plaintext_tokens_problem,
)
from llama_grpc_server.config import ServerSettings, Settings
from llama_grpc_server.core.api import EngineApi
from llama_grpc_server.core.cached_engine import ResponseCachingEngine
from llama_grpc_server.core.response_cache import ResponseCache
from llama_grpc_server.metrics import Metrics, MetricsServer, serve_metrics
from llama_grpc_server.models import (
    ModelFactory,
    ModelPool,
    ModelSpec,
    PoolLimits,
    directory_models,
    model_specs,
)
from llama_grpc_server.rpc import tls
from llama_grpc_server.rpc.access import AccessControl
from llama_grpc_server.rpc.interceptors import RequestInterceptor, RpcRecorder
from llama_grpc_server.rpc.servicer import SERVICE_NAME, LlmServicer
from llama_grpc_server.rpc.vllm_engine import VLLM_SERVICE_NAME, TokenizerZip, VllmEngineServicer
from llama_grpc_server.tracing import Tracing
from llama_grpc_server.watchdog import EXIT_ENGINE_HUNG

EngineFactory = Callable[[], EngineApi]
P = ParamSpec("P")

HEALTH_NAMES = ("", SERVICE_NAME, VLLM_SERVICE_NAME)  # "" = the server as a whole
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine thread died
# Before the drain's grace period ends, requests still running are ended with ShuttingDown so that
# each caller gets UNAVAILABLE with its reason and request id (grpc's own cut at the end of the
# grace period sends a bare UNAVAILABLE "Cancelling all calls" and the access log says CANCELLED).
# The margin is a quarter of the grace period (at most 2 s): room for a slow tick to finish.
MAX_END_MARGIN_S = 2.0
MIB = 1024 * 1024

log = structlog.get_logger("llama_grpc.server")


class ServerStartError(Exception):
    """The server could not bind its address (gRPC or /metrics)."""


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    max_bytes = settings.server.max_message_bytes
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        # Without this a second server can silently bind the same port (grpc#16920).
        ("grpc.so_reuseport", 0),
        # Clients may ping during a long unary Generate without being sent GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _try_command(server: ServerSettings, port: int) -> str:
    host = server.host
    target = _address("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port)
    flags = ["-plaintext"]
    if server.tls_cert:
        flags = ["-cacert CA.pem"]
        if server.tls_client_ca:
            flags += ["-cert CLIENT.pem", "-key CLIENT.key"]
    if server.auth_tokens_file:
        flags.append("-H 'authorization: Bearer TOKEN'")
    request = """-d '{"prompt":"Hello"}'"""
    return f"grpcurl {' '.join(flags)} {request} {target} {SERVICE_NAME}/StreamGenerate"


@dataclass(eq=False)
class EngineWatch:
    """Set on the event loop when the engine reports its death; `cause` says why, `is_hung`
    whether its watchdog tripped (then any model's engine counts: see attach)."""

    failed: asyncio.Event = field(default_factory=asyncio.Event)
    cause: str = ""
    is_hung: bool = False
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def attach(self, engine: EngineApi, health_servicer: Any, *, only_hang: bool = False) -> None:
        """Watch `engine`; with only_hang (another model's engine) only a hang counts: a dead
        one is the pool's to unload, a stuck thread nobody can stop but a new process."""
        loop = asyncio.get_running_loop()

        def on_loop(cause: str) -> None:
            is_hung = engine.stats().watchdog_trips > 0
            if self.failed.is_set() or (only_hang and not is_hung):
                return
            self.cause = cause
            self.is_hung = is_hung
            self.failed.set()
            log.error("engine_failed_not_serving", error=cause)
            task = loop.create_task(_set_health(health_servicer, NOT_SERVING))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def on_engine_thread(cause: str) -> None:
            # RuntimeError (the loop is closed) is caught by the engine and logged.
            loop.call_soon_threadsafe(on_loop, cause)

        engine.on_failure(on_engine_thread)


async def _set_health(health_servicer: Any, status: Any) -> None:
    for name in HEALTH_NAMES:
        await health_servicer.set(name, status)


@dataclass(eq=False)
class RunningServer:
    """A started server. `port` is the bound one (useful with port 0); stop() is idempotent."""

    port: int
    server: grpc.aio.Server
    servicer: LlmServicer
    vllm_servicer: VllmEngineServicer
    health: Any  # grpc_health.v1.health.aio.HealthServicer (grpc-stubs has no aio stubs)
    grace_s: float
    _loading: asyncio.Task[EngineApi | None]
    engine_watch: EngineWatch
    pool: ModelPool
    metrics_server: MetricsServer | None = None
    access: AccessControl = field(default_factory=AccessControl)
    credentials: tls.ReloadingCredentials | None = None
    tokens_file: str = ""
    tracing: Tracing | None = None
    _stopping: asyncio.Task[None] | None = field(default=None, init=False)

    def reload(self, why: str) -> bool:
        """Read the TLS files (new connections use them) and the tokens file (the next call
        does) again; the file's tenant limits go to every engine (through its inbox: the
        engine thread applies them before the next request). Broken files are logged and the
        old ones kept; returns False then."""
        is_ok = True
        if self.credentials is not None:
            is_ok = self.credentials.reload(why)
        if self.tokens_file:
            try:
                table = load_auth_file(Path(self.tokens_file))
                self.access.table = table
                self.pool.set_tenant_limits(table.limits)
                log.info("auth_reloaded", why=why, file=self.tokens_file,
                         tenant_limits=sorted(table.limits))  # fmt: skip
            except AuthFileError as exc:
                log.error("auth_reload_failed", why=why, error=str(exc))
                is_ok = False
        return is_ok

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port, or None when Prometheus is off."""
        return self.metrics_server.port if self.metrics_server is not None else None

    async def wait_loaded(self) -> bool:
        """True once the default model's engine serves; False if its factory failed."""
        return await asyncio.shield(self._loading) is not None

    async def stop(self, grace_s: float | None = None) -> None:
        """Draining (WatchLoad streams end) -> health NOT_SERVING -> refuse new RPCs, let
        in-flight ones finish for the grace period -> close the engines in threads. Waits for
        engines still loading, then closes them."""
        if self._stopping is None:
            grace = self.grace_s if grace_s is None else grace_s
            self._stopping = asyncio.create_task(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        self.servicer.draining.set()  # WatchLoad streams end now, not at the grace period's end
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.server.stop(grace_s))
        loaded = self._loading.result() if self._loading.done() else None
        if loaded is not None and grace_s > 0:
            margin = min(MAX_END_MARGIN_S, grace_s / 4)
            done, _ = await asyncio.wait({stopping}, timeout=grace_s - margin)
            if not done:  # what is still running gets UNAVAILABLE with a reason, not a cut
                reason = f"the server is shutting down and its grace period ({grace_s:g} s) is over"
                self.pool.end_all(errors.ShuttingDown(reason))
        await stopping
        await self._loading
        await self.pool.close()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
        if self.tracing is not None:  # export what is still batched
            await asyncio.to_thread(self.tracing.close)
        log.info("stopped", port=self.port)


def _model_identity(path: str) -> str:
    """The model file's sha256; a path that is no file (a test's fake engine) stands for itself."""
    try:
        return model_files.file_sha256(path)
    except OSError:
        return f"path:{path}"


def with_response_cache(factory: Callable[P, EngineApi], megabytes: int) -> Callable[P, EngineApi]:
    """The factory's engines behind the exact response cache (--response-cache-mb), when it is
    on: a cache of its own per engine (each model's). The model's identity is hashed in the
    loading thread too (0.2 s for the embedded one)."""
    if megabytes <= 0:
        return factory

    def build(*args: P.args, **kwargs: P.kwargs) -> EngineApi:
        engine = factory(*args, **kwargs)
        try:
            model_id = _model_identity(engine.model_info.model_path)
        except BaseException:
            engine.close()
            raise
        log.info("response_cache", capacity_mb=megabytes, model_sha256=model_id[:16])
        return ResponseCachingEngine(engine, ResponseCache(megabytes * MIB), model_id)

    return build


def _pool_factory(
    default: ModelSpec, engine_factory: EngineFactory, model_factory: ModelFactory | None
) -> ModelFactory:
    """The default model from `engine_factory` (as with a single model), the others from
    `model_factory`."""

    def build(spec: ModelSpec) -> EngineApi:
        if spec == default:
            return engine_factory()
        if model_factory is None:
            raise RuntimeError(f"no engine factory for model {spec.name!r}")
        return model_factory(spec)

    return build


def _model_pool(
    settings: Settings,
    engine_factory: EngineFactory,
    model_factory: ModelFactory | None,
    on_loaded: Callable[[ModelSpec, EngineApi], None],
) -> ModelPool:
    specs = model_specs(settings)
    factory = _pool_factory(specs[0], engine_factory, model_factory)
    limits = PoolLimits(settings.pool.max_loaded_models, settings.pool.max_loaded_bytes)
    if len(specs) > 1:
        log.info("models", names=[s.name for s in specs], default=specs[0].name,
                 max_loaded_models=limits.max_loaded_models,
                 max_loaded_bytes=limits.max_loaded_bytes)  # fmt: skip
    cached = with_response_cache(factory, settings.scheduler.response_cache_mb)
    models_dir = settings.pool.models_dir
    discover = directory_models(models_dir) if models_dir else None
    return ModelPool(specs, cached, limits, on_loaded=on_loaded, discover=discover)


async def _load_default(
    pool: ModelPool,
    servicers: tuple[LlmServicer, VllmEngineServicer],
    health_servicer: Any,
    metrics: Metrics | None,
) -> EngineApi | None:
    """Load the default model (seconds-long, in a thread), then switch to SERVING."""
    try:
        await pool.load("")
    except errors.ServiceError as exc:
        log.error("engine_load_failed", error=exc.message)
        return None
    engine = pool.default_engine()
    assert engine is not None
    for servicer in servicers:
        servicer.attach(pool)
    if metrics is not None:
        metrics.watch(pool.snapshots, pool.statuses)
    await _set_health(health_servicer, SERVING)
    info = engine.model_info
    log.info("ready", model=info.model_name, n_ctx=info.n_ctx, n_parallel=info.n_parallel)
    return engine


def _start_metrics(settings: Settings, metrics: Metrics | None) -> MetricsServer | None:
    """/metrics on the gRPC host at --metrics-port, when both a Metrics and a port are given."""
    host, port = settings.server.host, settings.server.metrics_port
    if metrics is None or not port:
        return None
    try:
        served = serve_metrics(metrics, host, port)
    except OSError as exc:
        raise ServerStartError(f"cannot serve /metrics on {_address(host, port)}: {exc}") from exc
    log.info("metrics", url=f"http://{_address(host, served.port)}/metrics")
    return served


def _auth_table(server: ServerSettings) -> AuthTable | None:
    if not server.auth_tokens_file:
        return None
    try:
        return load_auth_file(Path(server.auth_tokens_file))
    except AuthFileError as exc:
        raise ServerStartError(f"--auth-tokens-file: {exc}") from None


def _credentials(server: ServerSettings) -> tls.ReloadingCredentials | None:
    if not server.tls_cert:
        return None
    files = tls.TlsFiles(
        Path(server.tls_cert),
        Path(server.tls_key),
        Path(server.tls_client_ca) if server.tls_client_ca else None,
    )
    try:
        return tls.ReloadingCredentials(files)
    except tls.TlsFileError as exc:
        raise ServerStartError(str(exc)) from None


def _listen(
    server: grpc.aio.Server, settings: ServerSettings, credentials: tls.ReloadingCredentials | None
) -> int:
    address = _address(settings.host, settings.port)
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials.server_credentials())
        return server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ServerStartError(f"cannot listen on {address}") from exc


async def _started(
    settings: Settings,
    engine_factory: EngineFactory,
    model_factory: ModelFactory | None,
    recorder: RpcRecorder | None,
    metrics: Metrics | None,
    *,
    tokenizer_zip: TokenizerZip | None = None,
) -> RunningServer:
    problem = plaintext_tokens_problem(
        settings.server.host,
        has_tls=bool(settings.server.tls_cert),
        has_tokens=bool(settings.server.auth_tokens_file),
        allow_insecure=settings.server.allow_insecure_tokens,
    )
    if problem:
        raise ValueError(problem)
    access = AccessControl(_auth_table(settings.server))
    credentials = _credentials(settings.server)
    endpoint = settings.server.otlp_endpoint
    spans = Tracing.start(endpoint) if endpoint else None
    interceptor = RequestInterceptor(
        recorder if recorder is not None else metrics,
        log_payloads=settings.server.log_payloads,
        access=access,
        tracing=spans,
    )
    server = grpc.aio.server(interceptors=[interceptor], options=server_options(settings))
    servicer = LlmServicer(settings)
    pb_grpc.add_LlmServiceServicer_to_server(servicer, server)
    # the vLLM engine protocol (the SMG gateway's workers) on the same port, same engine
    vllm_servicer = VllmEngineServicer(
        settings, draining=servicer.draining, tokenizer_zip=tokenizer_zip
    )
    vpb_grpc.add_VllmEngineServicer_to_server(vllm_servicer, server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # no aio stubs
    for name in HEALTH_NAMES:
        await health_servicer.set(name, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.server.reflection:
        names = (SERVICE_NAME, VLLM_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    host = settings.server.host
    port = _listen(server, settings.server, credentials)
    metrics_server = _start_metrics(settings, metrics)
    await server.start()
    security = "plaintext" if credentials is None else "tls"
    if credentials is not None and credentials.requires_client_certificate:
        security = "mtls"
    log.info("listening", address=_address(host, port), port=port, transport=security,
             auth="tokens" if access.table is not None else "none",
             tracing=endpoint or "off")  # fmt: skip
    if credentials is None and not is_loopback(host):
        log.warning(
            "plaintext_on_network",
            address=_address(host, port),
            hint="anyone who reaches this port can call it unencrypted; use --tls-cert/--tls-key "
            "(and --auth-tokens-file)",
        )
    log.info("try", command=_try_command(settings.server, port))
    watch = EngineWatch()

    def on_loaded(spec: ModelSpec, engine: EngineApi) -> None:
        # after SERVING: a dead default engine, or any hung one, turns it back off
        watch.attach(engine, health_servicer, only_hang=spec.name != pool.default_name)

    pool = _model_pool(settings, engine_factory, model_factory, on_loaded)
    loading = asyncio.create_task(
        _load_default(pool, (servicer, vllm_servicer), health_servicer, metrics)
    )
    grace_s = settings.server.grace_s
    return RunningServer(
        port,
        server,
        servicer,
        vllm_servicer,
        health_servicer,
        grace_s,
        loading,
        watch,
        pool,
        metrics_server,
        access,
        credentials,
        settings.server.auth_tokens_file,
        spans,
    )


@contextlib.asynccontextmanager
async def start_server(
    settings: Settings,
    engine_factory: EngineFactory,
    *,
    model_factory: ModelFactory | None = None,
    recorder: RpcRecorder | None = None,
    metrics: Metrics | None = None,
    tokenizer_zip: TokenizerZip | None = None,
) -> AsyncIterator[RunningServer]:
    """Start listening now, load the default model's engine (`engine_factory`) in the
    background; stop gracefully on exit. The other models of settings.pool are built by
    `model_factory` when a request needs them. With `metrics`, RPCs are recorded there (unless
    `recorder` is given), it watches the engines' stats once the default is loaded, and
    /metrics is served when --metrics-port is set."""
    running = await _started(
        settings, engine_factory, model_factory, recorder, metrics, tokenizer_zip=tokenizer_zip
    )
    try:
        yield running
    finally:
        await running.stop()


@contextlib.contextmanager
def _handle_signals(stop: asyncio.Event, running: RunningServer) -> Iterator[None]:
    """SIGTERM/SIGINT set `stop` and SIGHUP reloads while inside; signal handlers can only live
    in the main thread. Once outside, a second signal gets the default behaviour (an exit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("signal", signal=sig.name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(RELOAD_SIGNAL, running.reload, RELOAD_SIGNAL.name)
    try:
        yield
    finally:
        for sig in (*STOP_SIGNALS, RELOAD_SIGNAL):
            loop.remove_signal_handler(sig)


async def _loaded_unless_stopped(running: RunningServer, stop: asyncio.Event) -> bool | None:
    """True: the engine serves; False: it failed to load; None: a stop came first."""
    loaded = asyncio.ensure_future(running.wait_loaded())
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (loaded, stopped):
        task.cancel()
    return loaded.result() if loaded in done else None


async def _until_stopped(running: RunningServer, stop: asyncio.Event, settings: Settings) -> int:
    """Serve until a stop signal (exit 0) or the engine's death (EXIT_ENGINE_FAILED): then, for
    the grace period, health says NOT_SERVING so proxies route elsewhere before the port closes;
    with keep_alive_on_engine_error, keep answering (GetStats says why) until a signal."""
    failed = asyncio.ensure_future(running.engine_watch.failed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
        stopped.cancel()
    watch = running.engine_watch
    if not watch.failed.is_set():
        return 0
    if settings.server.keep_alive_on_engine_error and not watch.is_hung:
        log.error("engine_failed_keep_alive", error=running.engine_watch.cause)
        await stop.wait()
    else:
        grace = settings.server.grace_s
        log.error("engine_failed_exiting", error=watch.cause, grace_s=grace, hung=watch.is_hung)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), grace)
    return EXIT_ENGINE_HUNG if watch.is_hung else EXIT_ENGINE_FAILED


async def _announce_drain(running: RunningServer, delay_s: float) -> None:
    """Before refusing anything: health NOT_SERVING, then `delay_s` more of normal serving, so a
    proxy's health check (Envoy's, every second in deploy/envoy) stops routing new calls here
    and the calls it already routed are answered rather than refused."""
    if delay_s <= 0:
        return
    await running.health.enter_graceful_shutdown()
    log.info("draining", delay_s=delay_s)
    await asyncio.sleep(delay_s)


async def serve(
    settings: Settings,
    engine_factory: EngineFactory,
    *,
    model_factory: ModelFactory | None = None,
    ready: asyncio.Event | None = None,
    recorder: RpcRecorder | None = None,
    metrics: Metrics | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (then drain) and return the exit code: 0, 1 when the server
    cannot listen or the engine fails to load, EXIT_ENGINE_FAILED when the engine thread died.
    `ready` is set once the engine serves."""
    try:
        async with start_server(
            settings, engine_factory, model_factory=model_factory, recorder=recorder,
            metrics=metrics,
        ) as running:  # fmt: skip
            stop = asyncio.Event()
            with _handle_signals(stop, running):
                is_loaded = await _loaded_unless_stopped(running, stop)
                if is_loaded is False:
                    return 1
                if is_loaded and ready is not None:
                    ready.set()
                code = 0 if is_loaded is None else await _until_stopped(running, stop, settings)
                if code == 0 and is_loaded:
                    await _announce_drain(running, settings.server.drain_delay_s)
            log.info("stopping", grace_s=settings.server.grace_s, exit_code=code)
    except ServerStartError as exc:
        log.error("listen_failed", error=str(exc))
        return 1
    return code
