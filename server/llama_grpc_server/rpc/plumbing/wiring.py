"""Putting a server together: the grpc.aio server with LlmService, the vLLM engine protocol
(rpc.vllm.engine), grpc.health.v1 and reflection behind the request interceptor, in plaintext
or TLS (rpc.plumbing.tls), callers identified by rpc.plumbing.access; /metrics; the model pool
(models/pool.py) with the response cache in front of each engine; and the default model's load
in a thread (health NOT_SERVING until it serves). Never imports llama_cpp: engines come from
factories."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server import errors
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
from llama_grpc_server.models import files as model_files
from llama_grpc_server.models.pool import (
    ModelFactory,
    ModelPool,
    ModelSpec,
    PoolLimits,
    directory_models,
    model_specs,
)
from llama_grpc_server.observability.metrics import Metrics, MetricsServer, serve_metrics
from llama_grpc_server.observability.tracing import Tracing
from llama_grpc_server.rpc.plumbing import tls
from llama_grpc_server.rpc.plumbing.access import AccessControl
from llama_grpc_server.rpc.plumbing.health import (
    HEALTH_NAMES,
    NOT_SERVING,
    SERVING,
    EngineWatch,
    set_health,
)
from llama_grpc_server.rpc.plumbing.interceptors import RequestInterceptor, RpcRecorder
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.v1.servicer import SERVICE_NAME, LlmServicer
from llama_grpc_server.rpc.vllm.engine import VLLM_SERVICE_NAME, TokenizerZip, VllmEngineServicer

EngineFactory = Callable[[], EngineApi]
P = ParamSpec("P")
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
    await set_health(health_servicer, SERVING)
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


async def start_listening(
    settings: Settings,
    engine_factory: EngineFactory,
    model_factory: ModelFactory | None,
    recorder: RpcRecorder | None,
    metrics: Metrics | None,
    *,
    tokenizer_zip: TokenizerZip | None = None,
) -> RunningServer:
    """Put the server together (services, interceptor, health, reflection, TLS, /metrics),
    open its port and begin loading the default model in the background: the RunningServer
    that start_server hands out. ServerStartError when a port, the TLS files or the tokens
    file fail; ValueError when the settings would send bearer tokens in plaintext over the
    network."""
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
