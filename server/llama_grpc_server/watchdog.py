"""TickWatchdog: a thread of its own that watches one engine thread's ticks and calls back, once,
when a tick has run past its bound (a llama_decode or any engine step that never returns). The
engine thread only writes one attribute per tick (and one more once it knows the tick's forward
pass); the watchdog sleeps on an Event with a timeout and never busy-waits. PassBounds: each
tick's bound, fixed (--watchdog-s S) or following the forward pass it runs (auto). No grpc, no
llama_cpp."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import structlog

from llama_grpc_server.core.scheduling.plan import SeqOpKind, StepPlan

log = structlog.get_logger("llama_grpc.engine")

# --watchdog-s auto: a tick's bound follows the forward pass it runs: MARGIN times its tokens
# times the measured cost of one (PassBounds), never under FLOOR_S. Ticks on a machine
# shared with other work were seen stretched tenfold (engine/build.calibrate), and a deep
# context costs more per token than the shallow passes that set the estimate: the margin.
MARGIN = 10.0
# The least a tick is given. The longest legitimate short passes measured on the shared 2-core
# box were 2.2-2.8 s (docs/performance.md, "Several models on shared cores": a ~20 ms pass held
# by OpenMP barrier spinning while another engine loaded; since bounded to ~2 s); a full
# collection of Python's oldest generation or the scheduler's own work in a tick come on top.
# Twice the worst seen, rounded: a hang in a short decode pass is declared within seconds.
FLOOR_S = 5.0
# Until a pass of its kind (prefill or decode) has been timed, and for the first pass after
# COLD_AFTER_S without one (the kernel may have dropped the mmapped weights from its page cache
# meanwhile, and the pass pages them in again: seconds to tens of seconds for a large model on a
# slow disk), and for a pass that saves or restores a sequence's KV state (its cost follows
# the bytes), a tick keeps the start bound: START_FACTOR times the slowest pass the warm-up's
# measured prefill cost predicts (a whole n_batch of prompt tokens), never under START_MIN_S.
START_FACTOR = 10.0
START_MIN_S = 30.0
COLD_AFTER_S = 60.0
# How much of the gap to a faster pass's cost per token the estimate closes at each pass; a
# slower pass sets it at once (the bound errs on the generous side).
DECAY = 0.1
# While no tick runs, and while one runs, the watchdog looks at least every shortest bound /
# IDLE_CHECKS: a tick that ends and the next one, with a shorter bound, are noticed that late.
IDLE_CHECKS = 4
# the process's exit code once an engine's watchdog tripped (rpc.plumbing.lifecycle)
EXIT_ENGINE_HUNG = 71

# (the tick's seconds so far, its bound, why that bound: a Basis or None for a fixed bound)
TripHandler = Callable[[float, float, "Basis | None"], None]


class PassShape(NamedTuple):
    """What a tick's forward pass feeds: its tokens (every row: prompt tokens, decode tokens,
    drafts, pads) and whether any is a prompt (prefill) token; keeps_state: the plan saves or
    restores a sequence's KV state, whose cost follows the bytes, not the tokens."""

    is_prefill: bool
    tokens: int
    keeps_state: bool = False


class Basis(NamedTuple):
    """How a tick's bound was derived, for the hang's message (PassBounds.describe)."""

    shape: PassShape | None  # None: no forward pass (yet)
    reason: str  # "floor", "measured", "unmeasured", "cold", "state"
    ms_per_token: float = 0.0


def pass_shape(plan: StepPlan) -> PassShape | None:
    """The forward pass of `plan`, None if it runs none and keeps no state."""
    keeps_state = any(op.kind in (SeqOpKind.SAVE, SeqOpKind.RESTORE) for op in plan.seq_ops)
    if not plan.chunks and not keeps_state:
        return None
    tokens = sum(len(chunk.tokens) for chunk in plan.chunks)
    is_prefill = plan.is_embedding or any(not chunk.is_decode for chunk in plan.chunks)
    return PassShape(is_prefill, tokens, keeps_state)


def start_bound_s(n_batch: int, prefill_token_ms: float) -> float:
    """The bound before anything is measured: START_FACTOR x (n_batch prompt tokens at the
    warm-up's measured cost of one), at least START_MIN_S."""
    worst_tick_s = n_batch * max(prefill_token_ms, 0.0) / 1000
    return max(START_MIN_S, START_FACTOR * worst_tick_s)


class PassBounds:
    """Each tick's bound. Fixed (--watchdog-s S): S for every tick. Following the pass (auto):
    before its plan is known and for a tick without a forward pass, floor_s; for a pass,
    margin x its tokens x the running estimate of a token's cost in passes of its kind (prefill
    or decode), at least floor_s; start_s for a pass of a kind not timed yet, for the first after
    cold_after_s without a pass, and for one that saves or restores a sequence's state. Used on
    the engine thread only."""

    def __init__(
        self,
        start_s: float,
        *,
        floor_s: float = FLOOR_S,
        margin: float = MARGIN,
        cold_after_s: float = COLD_AFTER_S,
        fixed: bool = False,
    ) -> None:
        if start_s <= 0 or floor_s <= 0:
            raise ValueError(f"the watchdog's bounds must be positive, not {start_s}, {floor_s}")
        self.start_s = start_s
        self.floor_s = start_s if fixed else min(floor_s, start_s)
        self.margin = margin
        self.cold_after_s = cold_after_s
        self.fixed = fixed
        # milliseconds per token of the passes timed so far, by PassShape.is_prefill
        self.ms_per_token: dict[bool, float] = {}
        self._last_pass_at: float | None = None  # time.monotonic() when the last pass ended

    @classmethod
    def constant(cls, bound_s: float) -> PassBounds:
        """--watchdog-s S: every tick's bound."""
        return cls(bound_s, fixed=True)

    def for_pass(self, shape: PassShape | None, now: float) -> tuple[float, Basis | None]:
        """The bound of a tick running `shape` (None: no forward pass), and how it was derived
        (None when fixed)."""
        if self.fixed:
            return self.start_s, None
        if shape is None:
            return self.floor_s, Basis(None, "floor")
        if shape.keeps_state:
            return self.start_s, Basis(shape, "state")
        ms = self.ms_per_token.get(shape.is_prefill)
        if ms is None:
            return self.start_s, Basis(shape, "unmeasured")
        if self._last_pass_at is not None and now - self._last_pass_at > self.cold_after_s:
            return self.start_s, Basis(shape, "cold")
        predicted_s = shape.tokens * ms / 1000
        return max(self.floor_s, self.margin * predicted_s), Basis(shape, "measured", ms)

    def observe(self, shape: PassShape | None, seconds: float, now: float) -> None:
        """A tick that ran `shape` took `seconds`: update the estimate of its kind."""
        if self.fixed or shape is None:
            return
        self._last_pass_at = now
        if shape.keeps_state or shape.tokens <= 0:
            return
        ms = seconds * 1000 / shape.tokens
        old = self.ms_per_token.get(shape.is_prefill)
        self.ms_per_token[shape.is_prefill] = (
            ms if old is None or ms > old else old + DECAY * (ms - old)
        )

    def describe(self, basis: Basis | None) -> str:
        """Why a tick had its bound, for the hang's message ("" when fixed)."""
        if basis is None:
            return ""
        shape = basis.shape
        if shape is None:
            return "no forward pass: the floor"
        kind = "prefill" if shape.is_prefill else "decode"
        what = f"a {kind} pass of {shape.tokens} token{'' if shape.tokens == 1 else 's'}"
        if basis.reason == "measured":
            return (
                f"{what}: {shape.tokens} x {basis.ms_per_token:.3g} ms x {self.margin:g}, "
                f"at least {self.floor_s:g} s"
            )
        why = {
            "unmeasured": "none of its kind timed yet",
            "cold": f"none for over {self.cold_after_s:g} s",
            "state": "a sequence's state saved or restored",
        }[basis.reason]
        return f"{what}, {why}: the start bound"


def tick_bounds(
    configured: float | str, n_batch: int, prefill_token_ms: float
) -> PassBounds | None:
    """--watchdog-s: None when 0 (off), a constant bound as configured, or for "auto" bounds that
    follow the pass, starting from start_bound_s."""
    if configured == "auto":
        return PassBounds(start_bound_s(n_batch, prefill_token_ms))
    if float(configured) <= 0:
        return None
    return PassBounds.constant(float(configured))


class TickWatchdog:
    """Calls `on_trip(seconds, bound_s, basis)` on its own thread when a tick started with
    tick_started() has not ended (tick_ended()) after its bound (`bound_s`, or what expect() set
    once the tick's pass was known); then it stops watching. `bound_s` is the shortest bound a
    tick can have: the watchdog looks at least every bound_s / IDLE_CHECKS."""

    def __init__(self, bound_s: float, on_trip: TripHandler, name: str = "llama-watchdog"):
        if bound_s <= 0:
            raise ValueError(f"the watchdog's bound must be positive, not {bound_s}")
        self.bound_s = bound_s
        self._on_trip = on_trip
        # The running tick: (its start as time.monotonic(), its bound, why), None between ticks.
        # Written by the engine thread only, read here: one reference, no lock.
        self._tick: tuple[float, float, Basis | None] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def tick_started(self, basis: Basis | None = None) -> None:
        self._tick = (time.monotonic(), self.bound_s, basis)

    def expect(self, bound_s: float, basis: Basis | None) -> None:
        """The running tick's bound is `bound_s` (from its start): its pass is known now."""
        tick = self._tick
        if tick is not None:
            self._tick = (tick[0], bound_s, basis)

    def expect_more(self, bound_s: float, basis: Basis | None) -> None:
        """The running tick goes on with a pass bounded by `bound_s` from now (a draft model's
        pass inside the tick, before its own forward pass): its bound is the time it has run so
        far plus that."""
        tick = self._tick
        if tick is not None:
            self._tick = (tick[0], time.monotonic() - tick[0] + bound_s, basis)

    def tick_ended(self) -> None:
        self._tick = None

    def stop(self) -> None:
        """Stop watching (the engine closes); returns at once."""
        self._stopped.set()

    def _run(self) -> None:
        check_s = self.bound_s / IDLE_CHECKS
        while True:
            tick = self._tick
            timeout = check_s
            if tick is not None:
                started, bound_s, basis = tick
                elapsed = time.monotonic() - started
                if elapsed >= bound_s:
                    break
                timeout = min(check_s, bound_s - elapsed)
            if self._stopped.wait(timeout):
                return
        try:
            self._on_trip(elapsed, bound_s, basis)
        except Exception:
            log.exception("watchdog_trip_failed")
