"""grpc.health.v1 for the server: the names it answers for, and EngineWatch, which turns
them NOT_SERVING the moment an engine dies (the default model's) or hangs (any model's), so a
proxy routes elsewhere while serve() decides whether to exit (rpc/plumbing/lifecycle.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpc_health.v1 import health_pb2

from llama_grpc_server.core.api import EngineApi
from llama_grpc_server.rpc.v1.servicer import SERVICE_NAME
from llama_grpc_server.rpc.vllm.engine import VLLM_SERVICE_NAME

HEALTH_NAMES = ("", SERVICE_NAME, VLLM_SERVICE_NAME)  # "" = the server as a whole
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = structlog.get_logger("llama_grpc.server")


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
            task = loop.create_task(set_health(health_servicer, NOT_SERVING))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def on_engine_thread(cause: str) -> None:
            # RuntimeError (the loop is closed) is caught by the engine and logged.
            loop.call_soon_threadsafe(on_loop, cause)

        engine.on_failure(on_engine_thread)


async def set_health(health_servicer: Any, status: Any) -> None:
    for name in HEALTH_NAMES:
        await health_servicer.set(name, status)
