"""When an idle engine waits for the rest of a burst (the admission window, EngineLoop's
_gather_burst) and when it starts at once.

The window makes a burst of requests start as one batch, but a caller that sends one request at
a time (a sequential client, batch-1 embeddings, aiperf at concurrency 1) pays all of it on
every request for nothing: a lone request's queue time was 2.4 ms with the default 2 ms window,
0.3-0.5 ms without, of a ~140 ms batch-1 embedding, where llama-grpc trailed llama-server by
0.7 % (bench/embeddings.py, issue 41). So the engine learns which kind of traffic it has: after
LONE_STARTS_TO_SKIP windows in a row that gathered nothing but the first request, it starts at
once; a request that then arrives within the window's horizon after such a start (one the
window would have caught) turns the window back on for the next start. Pure: the caller passes
the clock."""

from __future__ import annotations

from dataclasses import dataclass

LONE_STARTS_TO_SKIP = 3


@dataclass(slots=True)
class BurstDetector:
    """Whether the next idle start waits for a burst (engine thread only)."""

    horizon_s: float  # what a start that waited would have gathered: the window's longest wait
    lone_starts: int = 0  # windows in a row that gathered no second request
    skipped_at: float | None = None  # the last start that did not wait, while it may be caught

    def should_wait(self, now: float) -> bool:
        """At an idle start: wait out the window (True), or start at once (and remember when)."""
        if self.lone_starts < LONE_STARTS_TO_SKIP:
            self.skipped_at = None
            return True
        self.skipped_at = now
        return False

    def gathered(self, num_requests: int) -> None:
        """A window ended with this many requests in (1: the one that woke the engine)."""
        self.lone_starts = self.lone_starts + 1 if num_requests <= 1 else 0

    def arrived(self, arrival: float) -> None:
        """A request arrived while the engine was busy: if it came within the horizon of a start
        that did not wait, the window would have caught it; wait again from the next start."""
        if self.skipped_at is not None and arrival - self.skipped_at <= self.horizon_s:
            self.lone_starts = 0
            self.skipped_at = None
