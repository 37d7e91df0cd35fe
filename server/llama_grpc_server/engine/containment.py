"""Containing the engine thread's death and hangs (EngineLoop._end_engine ends the engine).

If the thread dies (anything raised by a strategy, the runner, llama.cpp or a plan check), every
request in flight or queued ends with INTERNAL naming the cause, later submissions get
UNAVAILABLE, stats() reports engine_state "failed" with the cause, and the failure listeners
(the server: health NOT_SERVING, exit) are told once.

If a tick runs past the watchdog's bound (watchdog.py: a llama_decode or any step that never
returns; with --watchdog-s auto the bound follows the tick's forward pass, its tokens at the cost
of one measured in the passes before), the watchdog's thread does the same with UNAVAILABLE
(reason ENGINE_HUNG) after logging the engine thread's stack (TickGuard); the stuck thread is
left alone (close() does not wait for it) and the server exits so that it is replaced."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence

import structlog

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import Event, Failed, Request
from llama_grpc_server.core.scheduling.plan import StepPlan
from llama_grpc_server.engine.streams import Deliveries, EngineStream
from llama_grpc_server.watchdog import Basis, PassBounds, PassShape, TickWatchdog, pass_shape

log = structlog.get_logger("llama_grpc.engine")

FailureListener = Callable[[str], None]


class TickGuard:
    """The tick watchdog, seen from the engine thread: started once the warm-up has measured the
    costs its bounds derive from, it times each tick (run) and follows the tick's forward passes
    (expect, expect_inner_pass); on a hang it logs where the engine thread is stuck and calls
    `on_hung(cause)` on the watchdog's thread."""

    def __init__(
        self,
        watchdog_s: Callable[[], float | PassBounds | None] | None,
        on_hung: Callable[[str], None],
    ) -> None:
        # The bounds (a number: the same for every tick; <= 0 or None: no watchdog), asked for
        # on the engine thread once the warm-up has measured the costs they derive from; the
        # watchdog, once started, and its bounds.
        self._watchdog_s = watchdog_s
        self._on_hung = on_hung
        self.watchdog: TickWatchdog | None = None
        self._bounds: PassBounds | None = None
        self._floor_basis: Basis | None = None  # a tick's basis until its pass is known
        self._shape: PassShape | None = None  # the running tick's forward pass (engine thread)
        # When the running tick's first draft pass began (expect_inner_pass), and the seconds
        # its draft passes took (until its plan was known): not its forward pass's time
        self._inner_passes: float | None = None
        self._inner_s = 0.0
        self._thread_ident = -1  # the engine thread's (its stack is logged on a hang)

    def start(self) -> None:
        """On the engine thread, after the warm-up: start the watchdog, if there is one."""
        self._thread_ident = threading.get_ident()
        bounds = self._watchdog_s() if self._watchdog_s is not None else None
        if not isinstance(bounds, PassBounds):
            bounds = PassBounds.constant(bounds) if bounds is not None and bounds > 0 else None
        if bounds is None:
            return
        self._bounds = bounds
        self._floor_basis = bounds.for_pass(None, 0.0)[1]
        self.watchdog = TickWatchdog(bounds.floor_s, self._hung)
        if bounds.fixed:
            log.info("watchdog", watchdog_s=round(bounds.start_s, 1))
        else:
            log.info(
                "watchdog",
                watchdog_s="auto",
                start_s=round(bounds.start_s, 1),
                floor_s=bounds.floor_s,
                margin=bounds.margin,
            )

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def run(self, tick: Callable[[], None]) -> None:
        """One tick, timed by the watchdog; with bounds that follow the pass (expect), its
        time teaches them the cost of a token."""
        watchdog, bounds = self.watchdog, self._bounds
        if watchdog is None or bounds is None:
            tick()
            return
        self._shape = None
        self._inner_passes, self._inner_s = None, 0.0
        started = time.monotonic()
        watchdog.tick_started(self._floor_basis)
        try:
            tick()
        finally:
            watchdog.tick_ended()
        if not bounds.fixed:
            now = time.monotonic()
            bounds.observe(self._shape, now - started - self._inner_s, now)

    def expect(self, plan: StepPlan) -> None:
        """The tick's plan is known: its bound follows its forward pass from now on."""
        bounds, watchdog = self._bounds, self.watchdog
        if bounds is None or bounds.fixed or watchdog is None:
            return
        self._shape = shape = pass_shape(plan)
        if shape is not None and self._inner_passes is not None:  # after a draft pass: from now
            now = time.monotonic()
            self._inner_s = now - self._inner_passes
            watchdog.expect_more(*bounds.for_pass(shape, now))
        elif shape is not None:
            watchdog.expect(*bounds.for_pass(shape, time.monotonic()))

    def expect_inner_pass(self, is_prefill: bool, tokens: int) -> None:
        """A forward pass inside the tick that is not its plan's (engine/draft.py's draft pass,
        during schedule()): the tick's bound grows by what such a pass of the target is given
        (the draft model is smaller: generous), so a slow draft pass is not taken for a hang;
        the plan's own pass, once known, is bounded from then on (expect)."""
        bounds, watchdog = self._bounds, self.watchdog
        if bounds is None or bounds.fixed or watchdog is None:
            return
        now = time.monotonic()
        if self._inner_passes is None:
            self._inner_passes = now
        watchdog.expect_more(*bounds.for_pass(PassShape(is_prefill, tokens), now))

    def _hung(self, seconds: float, bound_s: float, basis: Basis | None) -> None:
        """On the watchdog's thread: the running tick has passed its bound. Log where the
        engine thread is stuck, then end the engine (on_hung)."""
        cause = f"a tick has run for {seconds:.1f} s, past the watchdog's {bound_s:g} s"
        why = self._bounds.describe(basis) if self._bounds is not None else ""
        if why:
            cause += f" ({why})"
        frame = sys._current_frames().get(self._thread_ident)
        # Only the code locations, never frame locals: they hold requests (prompt text).
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"
        log.error("engine_hung", error=cause, watchdog_s=bound_s, stack=stack)
        self._on_hung(cause)


def log_failure(exc: BaseException) -> str:
    """The engine thread died of `exc`: log why; the cause, in one line."""
    cause = errors.describe(exc)
    # The traceback without frame locals: they hold requests (prompt text).
    log.error("engine_failed", error=cause, traceback="".join(traceback.format_exception(exc)))
    return cause


def tell_listeners(listeners: Sequence[FailureListener], cause: str) -> None:
    """Each failure listener once; one that raises is logged and the others still told."""
    for listener in listeners:
        try:
            listener(cause)
        except Exception:
            log.exception("engine_failure_listener_failed")


def refusal(cause: str, error: errors.ServiceError) -> errors.ServiceError:
    """What a caller waiting on the dead engine (or asking it anything later) hears:
    UNAVAILABLE, `error` itself if it says so already."""
    if error.code == "UNAVAILABLE":
        return error
    return errors.EngineUnavailable(f"the engine has failed: {cause}")


def fail_streams(
    streams: Sequence[EngineStream],
    error: errors.ServiceError,
    on_done: Callable[[Request, Event], None],
) -> Deliveries:
    """End each stream's request with `error`: the events to post, by event loop."""
    failed = Failed(error)
    by_loop: Deliveries = defaultdict(list)
    for stream in streams:
        by_loop[stream.loop].append((stream, failed))
        on_done(stream.request, failed)
    return by_loop
