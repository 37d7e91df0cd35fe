"""When speculative decoding pays, from measured costs: the tick cost model (how long a decode-only
forward pass of N rows takes), a request's acceptance estimate, and the AUTO policy that picks
each decoding slot's draft length for one tick. Pure functions and values: no clock, no I/O.

A tick of B decode rows and k draft rows costs T(B + k) = D(B) + H(k), where D(B) = T(B) and
H(k) = T(B + k) - T(B). It yields B tokens plus the accepted draft tokens. AUTO drafts only when
(B + expected accepted) / T(B + k) beats B / T(B) by MIN_GAIN, and picks k by that rate too.
A draft model's tokens cost their drafting too: T(B + k) + k c, c its measured milliseconds per
drafted token (DraftOption.token_ms)."""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llama_grpc_server.core.scheduling.plan import MAX_PAD_ROWS

MIN_GAIN = 1.10  # AUTO drafts only for at least 10 % more expected tokens per millisecond
COST_ALPHA = 0.1  # EWMA weight of one measured tick
MAX_SURPRISE = 3.0  # a measured tick moves its point as if it were at most this far off
# EWMA weights, once the evidence outweighs the prior (Acceptance): of one verified draft's
# first token (real or shadow),
ACCEPT_ALPHA = 0.2
# and of one verified further token: a draft verifies one first token but up to draft_max
# further ones, so with the same weight one copy's end (a rejection after 20 accepted tokens,
# as likely as not at p_next 0.965) took a fifth off p_next and the next copy started with
# short drafts. Replayed on four sets of recorded outputs at the AVX-512 and x86-64-v3 costs,
# 0.05 against 0.2 made every grounded set faster (x1.001-1.043); chosen over 0.1 on the two
# sets that are not the benchmark's.
ACCEPT_ALPHA_NEXT = 0.05
ACCEPT_PRIOR = 0.5  # p before any evidence
PRIOR_WEIGHT = 2.0  # the prior counts as this many verified tokens
CALIBRATION_SLACK = 2.0  # a calibration point dearer than this times its shape's fit was disturbed
# T(N) / T(1) for a decode-only tick of N rows with logits for every row, measured on the 2-core
# development box (Gemma 3 270M Q4_K_M, CPU; `python bench/decode_cost.py --rows 32 --name
# decode_cost_shape`, the fastest of its 3 reps of each N): 12.7 ms at N = 1 (llama.cpp's
# matrix-vector path). The cost is not monotone: with the x86-64-v3 (AVX2) build the output
# layer (a 262,144 x 640 Q8_0 matrix, llama.cpp's tiled tinyBLAS matmul: tiles of 4 x 2 with 16
# vector registers) costs ~10 ms more for an odd number of logits rows >= 3 than for one row
# more: 4 rows take 32.7 ms, 3 take 42.5; 16 take 85.4, 15 take 96.1 (and 4 tokens with 3 logits
# rows 49.5 ms, with 4 rows 35.6: it is the rows of logits, not the tokens). The model keeps
# that shape; beyond its last point each parity goes on at its slope over the last 8 rows.
# fmt: off
PRIOR_SHAPE: tuple[float, ...] = (
    1.00, 1.96, 3.36, 2.58, 4.00, 3.29, 4.87, 4.30,
    5.45, 4.97, 6.38, 5.44, 7.20, 6.25, 7.59, 6.75,
    8.54, 7.99, 9.37, 8.71, 9.92, 9.18, 10.60, 10.26,
    11.65, 10.51, 11.80, 11.44, 12.08, 10.99, 12.44, 12.05,
)
# The same with the AVX-512 build `make install` makes where the CPU has it (32 vector
# registers: tiles of 4 x 4, dpbusd): `python bench/decode_cost.py --rows 32 --name
# decode_cost_shape_avx512` on the AMD EPYC (Zen 4) box, 13.2 ms at N = 1. Multiples of 4 rows
# are the cheap ones here: 8 rows 47.5 ms against 51.5 / 54.4 / 56.2 for 5 / 6 / 7.
PRIOR_SHAPE_AVX512: tuple[float, ...] = (
    1.00, 1.89, 2.03, 2.36, 3.78, 4.03, 4.24, 3.51,
    4.90, 5.02, 5.69, 4.42, 5.87, 5.82, 6.25, 5.47,
    7.54, 7.26, 7.19, 6.33, 7.53, 7.86, 8.12, 6.98,
    8.29, 8.82, 8.81, 7.93, 9.10, 9.34, 9.74, 8.60,
)
# fmt: on


@dataclass(frozen=True, slots=True)
class PriorShape:
    """One build's T(N) / T(1) curve (ratios[N - 1]) and the period of its steps in N (2: odd
    counts dear; 4: counts short of a multiple of 4 dear)."""

    ratios: tuple[float, ...]
    period: int

    def at(self, n: int) -> float:
        """T(n) / T(1); past the curve's end along the slope of its last 8 rows of n's residue
        modulo the period (one reading's noise would tilt a slope over 2)."""
        if n <= len(self.ratios):
            return self.ratios[max(n, 1) - 1]
        last = len(self.ratios) - (len(self.ratios) - n) % self.period  # n's residue's last
        slope = (self.ratios[last - 1] - self.ratios[last - 9]) / 8
        return self.ratios[last - 1] + slope * (n - last)


PRIOR_X86_64_V3 = PriorShape(PRIOR_SHAPE, period=2)
PRIOR_AVX512 = PriorShape(PRIOR_SHAPE_AVX512, period=4)


def prior_shape(n: int) -> float:
    """T(n) / T(1) by the x86-64-v3 build's curve (the default prior)."""
    return PRIOR_X86_64_V3.at(n)


class TickCostModel:
    """T(N), milliseconds of the forward pass of a decode-only tick of N rows (its sampling, ~0.3
    ms a row for a sampled request against ~5 ms a row of forward pass here, is left out). Each
    N measured (by the warm-up calibration or a tick since) has an EWMA of its measured times;
    T of an N not measured is the nearest measured point (of the same parity when as near)
    scaled along the prior shape of the llama.cpp build (one of the same parity unless the
    other parity's is more than a row nearer). Not monotone in N: on the development box 4
    rows cost less than 3. Unknown (None) until some N has been measured."""

    def __init__(self, prior: PriorShape = PRIOR_X86_64_V3) -> None:
        self._ms: dict[int, float] = {}
        self._prior = prior
        # rows not measured -> (the measured N it scales, the prior's T(rows) / T(N)): depends
        # on which N are measured only, so it is cleared when that changes (AUTO asks for
        # dozens of row counts a tick; finding the nearest each time was ~0.4 ms of a B = 16
        # tick's engine-thread time)
        self._near: dict[int, tuple[int, float]] = {}

    @property
    def prior(self) -> PriorShape:
        return self._prior

    @prior.setter
    def prior(self, prior: PriorShape) -> None:
        """The engine sets its llama.cpp build's (engine/build.py)."""
        self._prior = prior
        self._near = {}

    def calibrate(self, points: Iterable[tuple[int, float]]) -> None:
        """Start from timed decodes (rows, ms), replacing what was known; the fastest reading of
        each N counts. A point dearer than CALIBRATION_SLACK times what the others and the prior
        shape predict for it was disturbed (another process had the CPU: measured here, 253 ms
        for one row once, against 25 ms for two) and is taken down to that prediction."""
        best: dict[int, float] = {}
        for rows, ms in points:
            if rows > 0 and ms > 0:
                best[rows] = min(ms, best.get(rows, math.inf))
        self._near = {}
        if not best:
            self._ms = {}
            return
        scale = statistics.median(ms / self.prior.at(rows) for rows, ms in best.items())
        self._ms = {
            rows: min(ms, CALIBRATION_SLACK * scale * self.prior.at(rows))
            for rows, ms in best.items()
        }

    def observe(self, rows: int, tick_ms: float) -> None:
        """A measured decode-only tick moves T(rows) by COST_ALPHA of the difference; an N
        measured for the first time starts from its estimate, so one disturbed tick on a busy
        machine cannot make a draft length look twice as dear (or cheap) for good."""
        if rows <= 0 or tick_ms <= 0:
            return
        old = self._ms.get(rows)
        if old is None:
            old = self.tick_ms(rows)
            self._near = {}  # a row count measured for the first time
        if old is None:
            self._ms[rows] = tick_ms
            return
        tick_ms = min(max(tick_ms, old / MAX_SURPRISE), old * MAX_SURPRISE)
        self._ms[rows] = old + COST_ALPHA * (tick_ms - old)

    def tick_ms(self, rows: int) -> float | None:
        known = self._ms.get(rows)
        if known is not None or not self._ms:
            return known
        scaled = self._near.get(rows)
        if scaled is None:
            # the nearest measured N, counting one of the other parity 1.5 rows further away
            near = min(self._ms, key=lambda n: (abs(n - rows) + 1.5 * ((n - rows) % 2), n))
            scaled = self._near[rows] = (near, self._prior.at(rows) / self._prior.at(near))
        return self._ms[scaled[0]] * scaled[1]

    def snapshot(self) -> tuple[tuple[int, float], ...]:
        """The measured points (rows, ms), for logs and tests."""
        return tuple(sorted(self._ms.items()))


@dataclass(slots=True)
class Acceptance:
    """A request's chances that a draft token is accepted: p for a draft's first token, and
    p_next for each further one once the ones before it were. Two, because prompt-lookup drafts
    are bimodal: a lookup either lands in a passage the output is copying (then it goes on
    being accepted) or not (then it fails at once). Each is an EWMA over verified tokens, a 1
    (accepted) or a 0 (the first rejected one; those after it are not verified). Real
    verifications and shadow ones (a draft not sent, compared with the tokens generated next)
    count alike. The n-th verified token weighs max(floor, 1 / (n + PRIOR_WEIGHT)): the prior
    counts as PRIOR_WEIGHT observations, so the first evidence moves an estimate at once and
    later tokens weigh the floor (ACCEPT_ALPHA for p, ACCEPT_ALPHA_NEXT for p_next)."""

    p: float = ACCEPT_PRIOR
    p_next: float = ACCEPT_PRIOR
    n: int = 0  # first tokens verified
    n_next: int = 0  # further tokens verified

    def record(self, accepted: int, drafted: int) -> None:
        """A verified draft: `accepted` of its `drafted` tokens agreed."""
        if drafted <= 0:
            return
        accepted = min(max(accepted, 0), drafted)
        self.record_first(accepted > 0)
        if accepted:  # tokens 2 .. accepted were accepted; the one after, if any, was not
            self.record_further(accepted - 1, is_rejected=accepted < drafted)

    def record_first(self, is_accepted: bool) -> None:
        self.n += 1
        weight = max(ACCEPT_ALPHA, 1.0 / (self.n + PRIOR_WEIGHT))
        self.p += weight * ((1.0 if is_accepted else 0.0) - self.p)

    def record_further(self, accepted: int, *, is_rejected: bool) -> None:
        """`accepted` further tokens agreed, then one did not if is_rejected. Once the weight is
        down to its floor, a run of agreeing tokens is applied in closed form (a draft verifies
        up to draft_max of them a tick)."""
        accepted = max(accepted, 0)
        while accepted and 1.0 / (self.n_next + 1 + PRIOR_WEIGHT) > ACCEPT_ALPHA_NEXT:
            self.n_next += 1
            self.p_next += (1.0 - self.p_next) / (self.n_next + PRIOR_WEIGHT)
            accepted -= 1
        if accepted:
            self.n_next += accepted
            self.p_next = 1.0 - (1.0 - self.p_next) * (1.0 - ACCEPT_ALPHA_NEXT) ** accepted
        if is_rejected:
            self.n_next += 1
            self.p_next -= max(ACCEPT_ALPHA_NEXT, 1.0 / (self.n_next + PRIOR_WEIGHT)) * self.p_next

    def expected(self, k: int) -> float:
        """Expected accepted tokens of a k-token draft."""
        return expected_accepted(self.p, k, self.p_next)


def expected_accepted(p: float, k: int, p_next: float | None = None) -> float:
    """Expected accepted tokens of a k-token draft whose first token is accepted with chance p
    and each further one with chance p_next (default p) once the ones before it were:
    p (1 + p_next + ... + p_next^(k-1))."""
    q = p if p_next is None else p_next
    return sum(p * q ** (j - 1) for j in range(1, k + 1))


@dataclass(frozen=True, slots=True)
class DraftOption:
    """A decoding slot that could draft this tick."""

    slot_id: int
    max_len: int  # draft tokens available (found, and allowed by draft_max / max_tokens / n_ctx)
    p: float  # Acceptance.p: chance of the first draft token
    is_forced: bool = False  # mode ON: the whole draft, whatever it costs
    p_next: float | None = None  # Acceptance.p_next (None: p)
    # What each draft token costs before the tick: 0 for a lookup, a draft model's measured
    # milliseconds per drafted token (core.speculation.draft_model.DraftCosts)
    token_ms: float = 0.0

    def gain(self, j: int) -> float:
        """Chance that the j-th draft token (from 1) is accepted."""
        return self.p * (self.p if self.p_next is None else self.p_next) ** (j - 1)


def _forced(options: Sequence[DraftOption], room: int) -> dict[int, int]:
    """Mode ON's drafts, whole, as far as the room goes."""
    out: dict[int, int] = {}
    for option in options:
        if option.is_forced and option.max_len > 0 and room > 0:
            out[option.slot_id] = min(option.max_len, room)
            room -= out[option.slot_id]
    return out


def choose_drafts(
    num_rows: int,
    options: Sequence[DraftOption],
    tick_ms: Callable[[int], float | None],
    max_extra: int,
) -> dict[int, int]:
    """slot_id -> draft length for this tick (slots drafting nothing are left out). num_rows:
    the tick's decode rows (one per decoding request; those without an option draft nothing);
    max_extra: draft rows the batch and the KV cache have room for.

    Forced options take their whole draft first. The others' draft tokens are chosen so that
    the slowest of the tick's requests goes fastest: every request waits for the whole tick,
    so a draft row that speeds one stream slows all the others, and AUTO must only ever help.
    A request's expected progress is (1 + its expected accepted tokens) / T(rows); each further
    draft token goes to the request expected to progress least (at a tie, to the likelier
    token), and of all the totals so reached, the one maximising the slowest request's progress
    is taken if it beats not drafting by MIN_GAIN. So drafts go to one stream alone only when
    the others lose nothing (a cheaper row count), and to all streams when all have good
    drafts."""
    out = _forced(options, max_extra)
    room = max_extra - sum(out.values())
    base_rows = num_rows + sum(out.values())
    base_ms = tick_ms(base_rows)
    if base_ms is not None:  # forced draft-model tokens are paid for before the tick
        base_ms += sum(o.token_ms * out.get(o.slot_id, 0) for o in options if o.is_forced)
    free = [o for o in options if not o.is_forced and o.max_len > 0]
    if not free or room <= 0 or base_ms is None or base_ms <= 0:
        return out
    # Expected tokens this tick: a request without an option makes 1. `stuck` is the least of
    # the values that can no longer rise (requests with no draft token left to take).
    stuck = min(
        [1.0 if num_rows > len(options) else math.inf]
        + [
            1.0 + sum(o.gain(j) for j in range(1, out.get(o.slot_id, 0) + 1))
            for o in options
            if o.is_forced or o.max_len <= 0  # those not in free
        ]
    )
    value = [1.0] * len(free)
    taken = [0] * len(free)
    heap = [(1.0, -o.gain(1), i) for i, o in enumerate(free)]  # the slowest request first
    heapq.heapify(heap)
    picks: list[int] = []  # indexes into free, in the order their draft tokens were taken
    best_k, best_rate = 0, min(stuck, heap[0][0]) / base_ms
    threshold = best_rate * MIN_GAIN
    padding = 0
    drafting_ms = 0.0  # what the picked draft-model tokens cost to draft
    while heap and len(picks) < room:
        v, _, i = heapq.heappop(heap)
        if v > stuck:  # the slowest cannot be helped: a few rows more may still be cheaper
            padding += 1
            if padding > MAX_PAD_ROWS:
                break
        taken[i] += 1
        value[i] += free[i].gain(taken[i])
        picks.append(i)
        drafting_ms += free[i].token_ms
        if taken[i] < free[i].max_len:
            heapq.heappush(heap, (value[i], -free[i].gain(taken[i] + 1), i))
        else:
            stuck = min(stuck, value[i])
        ms = tick_ms(base_rows + len(picks))
        if ms is not None:
            ms += drafting_ms
        slowest = min(stuck, heap[0][0]) if heap else stuck
        if ms is not None and ms > 0 and slowest / ms > best_rate:
            best_k, best_rate = len(picks), slowest / ms
    if best_k == 0 or best_rate < threshold:
        return out
    for i in picks[:best_k]:
        out[free[i].slot_id] = out.get(free[i].slot_id, 0) + 1
    return out
