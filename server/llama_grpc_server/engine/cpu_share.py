"""Sharing the CPUs between a model load and the engines decoding meanwhile (one process).

A model load (llama_model_load_from_file, the context, the vocabulary tables: LlamaModel's
constructor) keeps one core busy for seconds on its own thread. An engine that decodes meanwhile
with one llama.cpp thread per core then has more threads than there are cores: a forward pass is
a few hundred OpenMP barriers, and at each one the threads that are done spin (libgomp spins
~300,000 times before it sleeps), holding a core while the thread they wait for sits in the run
queue behind the loader. Measured on the 2-core dev box (bench/load_stall.py), with other work on
the box: one 2-thread forward pass (~15 ms alone) lasted the whole 2.4-2.8 s load, its two
threads and the loader each getting a third of the CPU, so a stream got 1 delta in the load.

So while loads are in progress every engine decodes with fewer threads: at most the CPUs left
once each load has its core (never fewer than one, never more than configured). Each engine
applies it on its own thread just before each llama_decode (`forward_pass`, then
llama_set_n_threads, which only sets what the next graph computation uses) and goes back to its
configured threads at the first pass after the last load ended. A pass already running when a
load starts keeps its threads until it ends, so the load waits for it first (`loading`: at most
PASS_WAIT_S; a decode pass takes tens of milliseconds, a 512-token prompt chunk under a second)
instead of starting beside it: measured, such a pass was the whole stall."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

from llama_grpc_server.config import num_cpus

PASS_WAIT_S = 2.0  # the longest a load waits for the forward passes running when it starts


class CpuShare:
    """The process's model loads in progress and the forward passes running, with their
    threads. Loader threads and engine threads meet on one condition; an engine's critical
    section is a few dict operations per forward pass."""

    def __init__(self, cpus: int | None = None) -> None:
        self._cond = threading.Condition()
        self._cpus = cpus
        self.loads = 0
        self._running: Counter[int] = Counter()  # threads of each forward pass running now
        # bench/load_stall.py turns this off to measure what the engines do without it.
        self.enabled = True

    @property
    def cpus(self) -> int:
        return self._cpus if self._cpus is not None else num_cpus()

    def threads_for(self, configured: tuple[int, int]) -> tuple[int, int]:
        """(generation, prompt) threads for a forward pass starting now: `configured` unless
        loads are in progress and it would leave them no core."""
        if not self.loads or not self.enabled:
            return configured
        free = max(1, self.cpus - self.loads)
        return min(configured[0], free), min(configured[1], free)

    @contextlib.contextmanager
    def loading(self, wait_s: float = PASS_WAIT_S) -> Iterator[None]:
        """A model load in progress: from now on forward passes leave it a core; the passes
        running with more threads than that end first (`wait_s` at most)."""
        with self._cond:
            self.loads += 1
            if self.enabled:
                free = max(1, self.cpus - self.loads)
                self._cond.wait_for(lambda: max(self._running, default=0) <= free, wait_s)
        try:
            yield
        finally:
            with self._cond:
                self.loads -= 1

    @contextlib.contextmanager
    def forward_pass(self, configured: tuple[int, int]) -> Iterator[tuple[int, int]]:
        """Around one llama_decode: yields the threads it is to run with (threads_for) and
        counts it as running with them until it ends."""
        with self._cond:
            threads = self.threads_for(configured)
            self._running[max(threads)] += 1
        try:
            yield threads
        finally:
            with self._cond:
                self._running[max(threads)] -= 1
                if not self._running[max(threads)]:
                    del self._running[max(threads)]
                if self.loads:
                    self._cond.notify_all()


SHARE = CpuShare()


def loading() -> contextlib.AbstractContextManager[None]:
    """A model load in progress (this process): see CpuShare.loading."""
    return SHARE.loading()


def forward_pass(configured: tuple[int, int]) -> contextlib.AbstractContextManager[tuple[int, int]]:
    """One forward pass of an engine (this process): see CpuShare.forward_pass."""
    return SHARE.forward_pass(configured)
