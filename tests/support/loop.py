"""An EngineLoop over the fake runner (make_loop) and reading its last event (last_event). Shared by
several test modules (until now in tests/unit/engine/test_loop.py)."""

from __future__ import annotations

from typing import Any

from llama_grpc_server.core.requests.request import Event
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.testing import FakeRunner, fake_model_info
from llama_grpc_server.watchdog import PassBounds
from tests.support.scheduler import PIECES


def make_loop(
    strategy: Any = None,
    n_parallel: int = 2,
    runner: FakeRunner | None = None,
    admission_window_s: float = 0.0,
    on_idle: Any = None,
    *,
    overlap_decode: bool = False,
    watchdog_s: float | PassBounds = 0.0,
) -> EngineLoop:
    scheduler = Scheduler(
        SchedulerLimits(n_parallel, 512, 64, 16, 8),
        pieces=PIECES,
        eog_ids=frozenset(),
        strategy=strategy,
    )
    return EngineLoop(
        scheduler,
        runner or FakeRunner(),
        fake_model_info(),
        tokenizer=None,
        kv_cells_total=512,
        admission_window_s=admission_window_s,
        on_idle=on_idle,
        overlap_decode=overlap_decode,
        watchdog_s=lambda: watchdog_s,
    )


async def last_event(stream: Any) -> Event:
    events = [event async for event in stream]
    return events[-1]
