"""Expiry: the requests whose deadline, time limit or reader stall bound has passed, and how long
until the next one passes for the requests that wait on something other than the engine (a disk
read, a slow reader: the idle engine sleeps until then). Pure functions over the scheduler's
admission (queued and restoring requests), slots and readers; the Scheduler ends what they
return."""

from __future__ import annotations

from collections.abc import Sequence

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import FinishReason, Request
from llama_grpc_server.core.scheduling.admission import Admission
from llama_grpc_server.core.scheduling.backpressure import BackPressure
from llama_grpc_server.core.scheduling.slot import Slot

Ending = errors.ServiceError | FinishReason  # ended with an error, or finished for a reason


def expired(
    admission: Admission,
    slots: Sequence[Slot],
    back_pressure: BackPressure,
    now: float,
    now_ns: int,
) -> list[tuple[Request, Ending]]:
    """What has expired, in queue, slot, restoring order; queued and restoring ones are taken
    out of the admission's queue and `restoring` (a restoring one's read answer, when it
    comes, is dropped)."""
    out: list[tuple[Request, Ending]] = []
    for queued in [r for r in admission.queue if r.deadline_passed(now)]:
        admission.take(queued.key)
        out.append((queued, errors.DeadlineExceeded("deadline passed in queue")))
    for request in [s.request for s in slots if s.request is not None]:
        if request.deadline_passed(now):
            out.append((request, errors.DeadlineExceeded("deadline exceeded")))
        elif request.time_limit_passed(now_ns):
            out.append((request, FinishReason.TIME_LIMIT))
        elif back_pressure.stalled(request, now_ns):
            out.append((request, back_pressure.stall_error(request)))
    for waiting in [r for r in admission.restoring.values() if r.deadline_passed(now)]:
        admission.take(waiting.key)
        error = errors.DeadlineExceeded(
            "deadline exceeded while reading the request's KV cache from the disk tier"
        )
        out.append((waiting, error))
    return out


def timer_s(waiting: Sequence[Request], now: float, now_ns: int, stall_ns: int) -> float | None:
    """Seconds until the earliest deadline, time limit or reader stall of `waiting`, or None."""
    waits = [r.spec.deadline - now for r in waiting if r.spec.deadline is not None]
    for request in waiting:
        limit_ms = request.spec.stopping.time_limit_ms
        if limit_ms is not None:
            waits.append((request.arrival_ns + limit_ms * 1_000_000 - now_ns) / 1e9)
        if request.paused_since_ns and stall_ns:
            waits.append((request.paused_since_ns + stall_ns - now_ns) / 1e9)
    return max(0.0, min(waits)) if waits else None
