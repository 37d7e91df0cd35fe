"""A server as a child process, the way a user runs it: `python -m llama_grpc_server` (or a
wrapper module taking the serve options, such as hanging_runner) on port 0 with JSON logs. It
binds a free port and logs it ("listening"), which server_process() reads from its output, so
no port is picked for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llama_grpc_testkit.threads import TEST_THREADS


@dataclass
class ServerProcess:
    """`python -m llama_grpc_server` with its stdout drained into `lines` (a full pipe would
    block its logging)."""

    proc: asyncio.subprocess.Process
    port: int
    lines: list[str]
    _drain: asyncio.Task[None] | None = None

    async def wait(self, timeout_s: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        if self._drain is not None:
            await self._drain
        return code

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment with `extra` added: the settings a fault module reads in the
    server process (HANG_AT_PASS, SLOW_PASS_S, CRASH_AT_CALL, ...)."""
    return {**os.environ, **extra}


@contextlib.asynccontextmanager
async def server_process(
    *args: str, env: dict[str, str] | None = None, module: str = "llama_grpc_server"
) -> AsyncIterator[ServerProcess]:
    """Start the server (`python -m module`, which takes the serve options) on port 0 (it
    binds a free one and logs it), with TEST_THREADS llama.cpp threads unless args say; yield
    once it logs "ready"; kill it if still running."""
    threads = () if "--threads" in args else ("--threads", str(TEST_THREADS))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--port", "0", "--log-format", "json", *threads, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    reader = proc.stdout
    running = ServerProcess(proc, 0, [])
    try:
        while True:  # "listening" (with the port) comes first, "ready" once the model is warm
            line = await asyncio.wait_for(reader.readline(), 120)
            assert line, f"server exited early: {running.lines}"
            running.lines.append(line.decode())
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            running.port = entry.get("port", running.port)
            if entry.get("event") == "ready":
                break
        assert running.port > 0

        async def drain() -> None:
            while line := await reader.readline():
                running.lines.append(line.decode())

        running._drain = asyncio.create_task(drain())
        yield running
    finally:
        running.kill()
        await proc.wait()


def json_lines(proc: ServerProcess) -> list[dict[str, object]]:
    """The server's JSON log lines so far (anything else it printed is skipped)."""
    out = []
    for line in proc.lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
