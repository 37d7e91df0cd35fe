"""BackPressure: a request whose reader has stream_buffer_tokens or more unread is not planned
(its KV stays; KV pressure may preempt it like any request) until the reader takes them, which
wakes the engine (ReaderProgress.is_paused); one whose reader reads nothing for stalled_reader_s
meanwhile is stalled (the Scheduler ends it with StalledReader). Pure Python, engine thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import Request
from llama_grpc_server.core.scheduling.slot import Slot
from llama_grpc_server.core.stats import Counters


class BackPressure:
    def __init__(
        self,
        buffer_tokens: int,
        stalled_reader_s: float,
        counters: Counters,
        clock_ns: Callable[[], int],
    ) -> None:
        self.buffer_tokens = buffer_tokens  # 0: unbounded
        self.stalled_reader_s = stalled_reader_s
        self.stall_ns = int(stalled_reader_s * 1e9)  # 0: never stalled
        self._counters = counters
        self._clock_ns = clock_ns

    def behind(self, request: Request) -> bool:
        """Whether the request's reader has buffer_tokens or more unread (then the request is
        paused: it is not planned until its reader reads)."""
        reader, limit = request.reader, self.buffer_tokens
        if reader is None or limit <= 0:
            return False
        reader.is_paused = True  # first: a read after the comparison below sees it
        if request.num_sent - reader.num_read < limit:
            reader.is_paused = False
            request.paused_since_ns = 0
            return False
        if not request.paused_since_ns:
            request.paused_since_ns = self._clock_ns()
            self._counters.reader_pauses += 1
        return True

    def paused(self, slots: Sequence[Slot]) -> list[Request]:
        return [s.request for s in slots if s.request is not None and self.behind(s.request)]

    def stalled(self, request: Request, now_ns: int) -> bool:
        return bool(
            self.stall_ns
            and self.behind(request)
            and now_ns - request.paused_since_ns >= self.stall_ns
        )

    def stall_error(self, request: Request) -> errors.StalledReader:
        """How a stalled request ends (counted in reader_stalls)."""
        self._counters.reader_stalls += 1
        unread = request.num_sent - (request.reader.num_read if request.reader else 0)
        return errors.StalledReader(
            f"the caller read nothing for {self.stalled_reader_s:g} s with "
            f"{unread} tokens waiting (--stalled-reader-s)",
            metadata={"unread_tokens": str(unread)},
        )
