"""TickWatchdog: a thread of its own that watches one engine thread's ticks and calls back, once,
when a tick has run past its bound (a llama_decode or any engine step that never returns). The
engine thread only writes one attribute per tick; the watchdog sleeps on an Event with a timeout
and never busy-waits. No grpc, no llama_cpp."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("llama_grpc.engine")

# --watchdog-s auto: AUTO_FACTOR times the slowest legitimate tick the warm-up's measured
# prefill cost predicts (a whole n_batch of prompt tokens), never under AUTO_MIN_S. Ticks on a
# machine shared with other work were seen stretched tenfold (engine/build.calibrate), a load
# in another engine held a pass up to 2 s, and a deep context costs more per token than the
# warm-up's short one: the floor and the factor leave room for all of that.
AUTO_MIN_S = 30.0
AUTO_FACTOR = 10.0
# While no tick runs the watchdog looks every bound / IDLE_CHECKS; once it has seen a tick
# start it sleeps exactly until that tick's bound.
IDLE_CHECKS = 4
EXIT_ENGINE_HUNG = 71  # the process's exit code once an engine's watchdog tripped (rpc.lifecycle)

TripHandler = Callable[[float, float], None]  # (the tick's seconds so far, the bound)


def auto_bound_s(n_batch: int, prefill_token_ms: float) -> float:
    """The default bound: AUTO_FACTOR x (n_batch prompt tokens at the measured cost of one),
    at least AUTO_MIN_S."""
    worst_tick_s = n_batch * max(prefill_token_ms, 0.0) / 1000
    return max(AUTO_MIN_S, AUTO_FACTOR * worst_tick_s)


def bound_s(configured: float | str, n_batch: int, prefill_token_ms: float) -> float:
    """--watchdog-s: as configured (0 = off), or for "auto" auto_bound_s."""
    if configured == "auto":
        return auto_bound_s(n_batch, prefill_token_ms)
    return float(configured)


class TickWatchdog:
    """Calls `on_trip(seconds, bound_s)` on its own thread when a tick started with
    tick_started() has not ended (tick_ended()) after `bound_s`; then it stops watching."""

    def __init__(self, bound_s: float, on_trip: TripHandler, name: str = "llama-watchdog"):
        if bound_s <= 0:
            raise ValueError(f"the watchdog's bound must be positive, not {bound_s}")
        self.bound_s = bound_s
        self._on_trip = on_trip
        # The running tick's start (time.monotonic()), None between ticks. Written by the
        # engine thread only, read here: one reference, no lock.
        self._started: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def tick_started(self) -> None:
        self._started = time.monotonic()

    def tick_ended(self) -> None:
        self._started = None

    def stop(self) -> None:
        """Stop watching (the engine closes); returns at once."""
        self._stopped.set()

    def _run(self) -> None:
        while True:
            started = self._started
            timeout = self.bound_s / IDLE_CHECKS
            if started is not None:
                elapsed = time.monotonic() - started
                if elapsed >= self.bound_s:
                    break
                timeout = self.bound_s - elapsed
            if self._stopped.wait(timeout):
                return
        try:
            self._on_trip(elapsed, self.bound_s)
        except Exception:
            log.exception("watchdog_trip_failed")
