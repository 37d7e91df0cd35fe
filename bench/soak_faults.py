"""Faults injected into a real server process for bench/soak.py: `python bench/soak_faults.py
[serve options]` runs `llama-grpc serve [serve options]` with, as the environment asks:

- SLOW_DISK_READ_S=S: a disk-tier file read (KvDiskStore._read_file, on the tier's reader
  thread) sleeps S seconds before reading: a slow volume. SLOW_DISK_PERIOD_S=P (default 0: every
  read) makes it stall on the first read after every P seconds, so that a busy tier (the soak
  restores a few files a second, and the tier has one reader thread) is slow now and then
  rather than saturated for good. Only the requests restoring from it (RESTORING) may wait for
  it; the engine thread never does.
- HANG_AT_PASS=N: forward pass N (the warm-up's is the first) blocks for ever, a llama_decode
  that never returns: the watchdog must trip (the mechanism of llama_grpc_testkit.hanging_runner).

It runs as a script from bench/, which is on no package's path: the server package cannot import
it, and a server started without it has no fault at all."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

# bench/ (this script's directory, first on sys.path) holds modules named like common ones
# (models, common, gpu...): nothing the server imports may find them.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from llama_grpc_server.cli import main  # noqa: E402
from llama_grpc_server.core.kv.disk import KvDiskStore  # noqa: E402
from llama_grpc_server.core.scheduling.plan import StepPlan, StepResult  # noqa: E402
from llama_grpc_server.engine.runner import Runner  # noqa: E402


def slow_disk(delay_s: float, period_s: float = 0.0) -> None:
    """A disk-tier file read (the reader thread's, see kv_disk.load) first sleeps delay_s: every
    read, or with period_s the first one after every period_s seconds."""
    read_file = KvDiskStore._read_file
    lock = threading.Lock()
    last = -float("inf")

    def slow_read_file(self: KvDiskStore, path: Path) -> bytes:
        nonlocal last
        with lock:
            now = time.monotonic()
            stall = now - last >= period_s
            if stall:
                last = now
        if stall:
            time.sleep(delay_s)
        return read_file(self, path)

    KvDiskStore._read_file = slow_read_file  # type: ignore[method-assign]


def hang_at(hang_pass: int) -> None:
    """Forward pass hang_pass blocks for ever, asleep (no CPU): only the watchdog can notice."""
    execute = Runner.execute
    never = threading.Event()
    passes = 0

    def hanging_execute(self: Runner, plan: StepPlan) -> StepResult:
        nonlocal passes
        passes += 1
        if passes == hang_pass:
            never.wait()
        return execute(self, plan)

    Runner.execute = hanging_execute  # type: ignore[method-assign]


def install(env: dict[str, str]) -> None:
    if float(env.get("SLOW_DISK_READ_S", "0")) > 0:
        slow_disk(float(env["SLOW_DISK_READ_S"]), float(env.get("SLOW_DISK_PERIOD_S", "0")))
    if int(env.get("HANG_AT_PASS", "0")) > 0:
        hang_at(int(env["HANG_AT_PASS"]))


if __name__ == "__main__":
    install(dict(os.environ))
    sys.exit(main(sys.argv[1:]))
