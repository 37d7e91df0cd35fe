"""A started server's life until its exit code: RunningServer (reload on SIGHUP, the graceful
stop), the signal handlers, and the wait for a stop signal or an engine's death. If the default
model's engine thread dies, serve() exits with EXIT_ENGINE_FAILED after the grace period (so an
orchestrator restarts the process), unless keep_alive_on_engine_error; an engine, any model's,
whose watchdog tripped makes it exit with EXIT_ENGINE_HUNG whatever keep_alive_on_engine_error
says: its thread cannot be stopped or freed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from llama_grpc_server import errors
from llama_grpc_server.auth import AuthFileError, load_auth_file
from llama_grpc_server.config import Settings
from llama_grpc_server.core.api import EngineApi
from llama_grpc_server.models.pool import ModelPool
from llama_grpc_server.observability.metrics import MetricsServer
from llama_grpc_server.observability.tracing import Tracing
from llama_grpc_server.rpc.plumbing import tls
from llama_grpc_server.rpc.plumbing.access import AccessControl
from llama_grpc_server.rpc.plumbing.health import EngineWatch
from llama_grpc_server.rpc.v1.servicer import LlmServicer
from llama_grpc_server.rpc.vllm.engine import VllmEngineServicer
from llama_grpc_server.watchdog import EXIT_ENGINE_HUNG

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine thread died
# Before the drain's grace period ends, requests still running are ended with ShuttingDown so that
# each caller gets UNAVAILABLE with its reason and request id (grpc's own cut at the end of the
# grace period sends a bare UNAVAILABLE "Cancelling all calls" and the access log says CANCELLED).
# The margin is a quarter of the grace period (at most 2 s): room for a slow tick to finish.
MAX_END_MARGIN_S = 2.0

log = structlog.get_logger("llama_grpc.server")


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


@contextlib.contextmanager
def handle_signals(stop: asyncio.Event, running: RunningServer) -> Iterator[None]:
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


async def loaded_unless_stopped(running: RunningServer, stop: asyncio.Event) -> bool | None:
    """True: the engine serves; False: it failed to load; None: a stop came first."""
    loaded = asyncio.ensure_future(running.wait_loaded())
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (loaded, stopped):
        task.cancel()
    return loaded.result() if loaded in done else None


async def until_stopped(running: RunningServer, stop: asyncio.Event, settings: Settings) -> int:
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


async def announce_drain(running: RunningServer, delay_s: float) -> None:
    """Before refusing anything: health NOT_SERVING, then `delay_s` more of normal serving, so a
    proxy's health check (Envoy's, every second in deploy/envoy) stops routing new calls here
    and the calls it already routed are answered rather than refused."""
    if delay_s <= 0:
        return
    await running.health.enter_graceful_shutdown()
    log.info("draining", delay_s=delay_s)
    await asyncio.sleep(delay_s)
