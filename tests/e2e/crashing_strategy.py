"""A custom batch strategy (loaded by `--batch-strategy crashing_strategy:from_env` with this
directory on PYTHONPATH) that raises on its Nth allocate() call, N = $CRASH_AT_CALL: a buggy
plugin that kills the engine thread mid-run."""

from __future__ import annotations

import os

from llama_grpc_server.core.strategies import Allocation, BatchView, DecodeMaximal


class CrashAtCall:
    name = "crashing"

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0
        self.inner = DecodeMaximal()

    def allocate(self, view: BatchView) -> Allocation:
        self.calls += 1
        if self.calls == self.n:
            raise ZeroDivisionError(f"strategy bug at call {self.n}")
        return self.inner.allocate(view)


def from_env() -> CrashAtCall:
    return CrashAtCall(int(os.environ.get("CRASH_AT_CALL", "0")))
