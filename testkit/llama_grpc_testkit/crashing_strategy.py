"""Custom batch strategies that kill the engine thread. `from_env` (loaded by `--batch-strategy
llama_grpc_testkit.crashing_strategy:from_env` in a server process) raises on its Nth allocate()
call, N = $CRASH_AT_CALL: a buggy plugin that kills the engine thread mid-run. `on_demand`
(`llama_grpc_testkit.crashing_strategy:on_demand`, in-process) raises once a test sets
CRASH_NOW."""

from __future__ import annotations

import os
import threading

from llama_grpc_server.core.scheduling.strategies import Allocation, BatchView, DecodeMaximal


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


CRASH_NOW = threading.Event()
"""Set by a test: the next allocate() of an `on_demand` strategy raises (the engine dies)."""


class CrashOnDemand:
    """DecodeMaximal until CRASH_NOW is set; then its next call raises, killing the engine."""

    name = "crash_on_demand"

    def __init__(self) -> None:
        self.inner = DecodeMaximal()

    def allocate(self, view: BatchView) -> Allocation:
        if CRASH_NOW.is_set():
            raise RuntimeError("injected engine failure")
        return self.inner.allocate(view)


def on_demand() -> CrashOnDemand:
    return CrashOnDemand()
