"""The server's entry points: start_server (an application's, and the tests') and serve
(`llama-grpc serve`'s). The port opens at once; the default model's engine loads in a thread
meanwhile (health NOT_SERVING, RPCs answer NOT_READY); other models (--model NAME=PATH,
--models-dir) load on demand through the model pool. SIGTERM/SIGINT drain gracefully; SIGHUP
reloads the TLS files and the tokens file without cutting a stream. How the server is put
together is rpc/plumbing/wiring.py, health rpc/plumbing/health.py, its life until the exit code
rpc/plumbing/lifecycle.py.
Never imports llama_cpp: engines come from factories."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from llama_grpc_server.config import Settings
from llama_grpc_server.models.pool import ModelFactory
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.rpc.plumbing.interceptors import RpcRecorder
from llama_grpc_server.rpc.plumbing.lifecycle import (
    RunningServer,
    announce_drain,
    handle_signals,
    loaded_unless_stopped,
    until_stopped,
)
from llama_grpc_server.rpc.plumbing.wiring import EngineFactory, ServerStartError, start_listening
from llama_grpc_server.rpc.vllm.engine import TokenizerZip

log = structlog.get_logger("llama_grpc.server")


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
    running = await start_listening(
        settings, engine_factory, model_factory, recorder, metrics, tokenizer_zip=tokenizer_zip
    )
    try:
        yield running
    finally:
        await running.stop()


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
            with handle_signals(stop, running):
                is_loaded = await loaded_unless_stopped(running, stop)
                if is_loaded is False:
                    return 1
                if is_loaded and ready is not None:
                    ready.set()
                code = 0 if is_loaded is None else await until_stopped(running, stop, settings)
                if code == 0 and is_loaded:
                    await announce_drain(running, settings.server.drain_delay_s)
            log.info("stopping", grace_s=settings.server.grace_s, exit_code=code)
    except ServerStartError as exc:
        log.error("listen_failed", error=str(exc))
        return 1
    return code
