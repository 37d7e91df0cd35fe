"""When speculative decoding pays, from measured costs: the tick cost model (how long a decode-only
forward pass of N rows takes), a request's acceptance estimate, and the AUTO policy that picks
each decoding slot's draft length for one tick. Pure functions and values: no clock, no I/O.

A tick of B decode rows and k draft rows costs T(B + k) = D(B) + H(k), where D(B) = T(B) and
H(k) = T(B + k) - T(B). It yields B tokens plus the accepted draft tokens. AUTO drafts only when
(B + expected accepted) / T(B + k) beats B / T(B) by MIN_GAIN, and picks k by that rate too."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

MIN_GAIN = 1.10  # AUTO drafts only for at least 10 % more expected tokens per millisecond
COST_ALPHA = 0.1  # EWMA weight of one measured tick
MAX_SURPRISE = 3.0  # a measured tick moves its point as if it were at most this far off
# T(N) / T(1) for a decode-only tick of N rows, measured on the 2-core development box (Gemma 3
# 270M Q4_K_M, CPU): 13.2 ms at N = 1, 25-28 ms at N = 2 (the engine's calibration), then 38.8 /
# 55.2 / 90.4 ms at N = 5 / 9 / 17: one token takes llama.cpp's matrix-vector path, the second
# row costs ~12 ms and each further one ~4.4 ms. Only used to extend measured points to N not
# measured yet (its slope beyond 17 continues).
PRIOR_SHAPE: tuple[tuple[int, float], ...] = (
    (1, 1.0),
    (2, 1.9),
    (5, 2.94),
    (9, 4.18),
    (17, 6.85),
)
ACCEPT_ALPHA = 0.2  # EWMA weight of one verified draft token (real or shadow)
ACCEPT_PRIOR = 0.5  # p before any evidence


def _interpolate(points: Sequence[tuple[int, float]], n: int) -> float:
    """Piecewise linear through (x, y) points sorted by x; beyond the ends, along the nearest
    segment (a single point: flat)."""
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and n > points[i][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def prior_shape(n: int) -> float:
    """T(n) / T(1) by PRIOR_SHAPE (linear between its points and beyond them)."""
    return _interpolate(PRIOR_SHAPE, n)


class TickCostModel:
    """T(N), milliseconds of a decode-only tick of N rows. Each N measured (by the warm-up
    calibration or a tick since) has an EWMA of its measured times; T of an N not measured is
    interpolated linearly between the nearest measured ones, or outside them extended along
    PRIOR_SHAPE from the nearest measured one. Non-decreasing in N. Unknown (None) until some N
    has been measured."""

    def __init__(self) -> None:
        self._ms: dict[int, float] = {}
        self._points: list[tuple[int, float]] = []  # sorted, rebuilt on change

    def calibrate(self, points: Iterable[tuple[int, float]]) -> None:
        """Start from timed decodes (rows, ms), replacing what was known. A point dearer than
        one with more rows was disturbed (another process had the CPU: measured here, 253 ms
        for one row once, against 25 ms for two) and is taken down to it."""
        measured = sorted((rows, ms) for rows, ms in points if rows > 0 and ms > 0)
        self._ms = {}
        cheapest_above = math.inf
        for rows, ms in reversed(measured):
            cheapest_above = min(cheapest_above, ms)
            self._ms[rows] = cheapest_above
        self._rebuild()

    def observe(self, rows: int, eval_ms: float) -> None:
        """A measured decode-only tick moves T(rows) by COST_ALPHA of the difference; an N
        measured for the first time starts from its estimate, so one disturbed tick on a busy
        machine cannot make a draft length look twice as dear (or cheap) for good."""
        if rows <= 0 or eval_ms <= 0:
            return
        old = self._ms.get(rows)
        if old is None:
            old = self.tick_ms(rows)
        if old is not None:  # a tick disturbed by other work counts as at most 3x off
            eval_ms = min(max(eval_ms, old / MAX_SURPRISE), old * MAX_SURPRISE)
        self._ms[rows] = eval_ms if old is None else old + COST_ALPHA * (eval_ms - old)
        self._rebuild()

    def _rebuild(self) -> None:
        points = sorted(self._ms.items())
        running = 0.0
        self._points = []
        for rows, ms in points:  # noise must not make more rows look cheaper
            running = max(running, ms)
            self._points.append((rows, running))

    @property
    def is_known(self) -> bool:
        return bool(self._points)

    def tick_ms(self, rows: int) -> float | None:
        points = self._points
        if not points:
            return None
        first, last = points[0], points[-1]
        if rows < first[0]:
            return first[1] * prior_shape(rows) / prior_shape(first[0])
        if rows > last[0]:
            return last[1] * prior_shape(rows) / prior_shape(last[0])
        return _interpolate(points, rows)

    def snapshot(self) -> tuple[tuple[int, float], ...]:
        """The measured points (rows, ms), for logs and tests."""
        return tuple(self._points)


@dataclass(slots=True)
class Acceptance:
    """A request's chance p that a draft token is accepted once the ones before it were: an
    EWMA over verified tokens, each a 1 (accepted) or a 0 (the first rejected one; those after
    it are not verified). Real verifications and shadow ones (a draft not sent, compared with
    the tokens generated next) count alike. One full 8-token acceptance lifts p from 0.5 to
    0.92; each rejection takes a fifth off it."""

    p: float = ACCEPT_PRIOR

    def record(self, accepted: int, drafted: int) -> None:
        self.p = 1.0 - (1.0 - self.p) * (1.0 - ACCEPT_ALPHA) ** accepted
        if accepted < drafted:
            self.p *= 1.0 - ACCEPT_ALPHA


def expected_accepted(p: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft when each is accepted with chance p once the
    ones before it were: p + p^2 + ... + p^k."""
    return sum(p**j for j in range(1, k + 1))


@dataclass(frozen=True, slots=True)
class DraftOption:
    """A decoding slot that could draft this tick."""

    slot_id: int
    max_len: int  # draft tokens available (found, and allowed by draft_max / max_tokens / n_ctx)
    p: float  # Acceptance.p
    is_forced: bool = False  # mode ON: the whole draft, whatever it costs


def choose_drafts(
    num_rows: int,
    options: Sequence[DraftOption],
    tick_ms: Callable[[int], float | None],
    max_extra: int,
) -> dict[int, int]:
    """slot_id -> draft length for this tick (slots drafting nothing are left out). num_rows:
    the tick's decode rows; max_extra: draft rows the batch and the KV cache have room for.
    Forced options take their whole draft first; the others share what is left, by the
    marginal expected gain of each further draft token (p^j for the j-th), in the number that
    maximises expected tokens per millisecond, if that beats not drafting them by MIN_GAIN."""
    out: dict[int, int] = {}
    room = max_extra
    for option in options:
        if option.is_forced and option.max_len > 0 and room > 0:
            out[option.slot_id] = min(option.max_len, room)
            room -= out[option.slot_id]
    base_rows = num_rows + (max_extra - room)
    base_tokens = num_rows + sum(
        expected_accepted(o.p, out[o.slot_id]) for o in options if o.slot_id in out
    )
    gains = sorted(
        (
            (o.p**j, o.slot_id)
            for o in options
            if not o.is_forced and o.p > 0
            for j in range(1, o.max_len + 1)
        ),
        reverse=True,
    )[: max(0, room)]
    base_ms = tick_ms(base_rows)
    if not gains or base_ms is None or base_ms <= 0:
        return out
    best_k, best_rate, tokens = 0, base_tokens / base_ms, base_tokens
    threshold = best_rate * MIN_GAIN
    for k, (gain, _) in enumerate(gains, 1):
        tokens += gain
        ms = tick_ms(base_rows + k)
        if ms is not None and ms > 0 and tokens / ms > best_rate:
            best_k, best_rate = k, tokens / ms
    if best_k == 0 or best_rate < threshold:
        return out
    for _, slot_id in gains[:best_k]:
        out[slot_id] = out.get(slot_id, 0) + 1
    return out
