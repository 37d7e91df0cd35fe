"""The server as a process: `python -m llama_grpc_server` logs where it listens, serves, and on
SIGTERM lets an in-flight stream finish, then exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from llama_grpc import AsyncClient, Delta, Done


async def test_sigterm_drains_in_flight_stream_and_exits_zero() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llama_grpc_server", "--port", "0", "--n-ctx", "2048",
        "--n-parallel", "2", "--grace-s", "30", "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    port, lines = 0, []
    try:
        while True:  # "listening" comes first, "ready" once the model is warmed up
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, f"server exited early: {lines}"
            lines.append(line.decode())
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            port = entry.get("port", port)
            if entry.get("event") == "ready":
                break
        assert port > 0
        async with AsyncClient(f"127.0.0.1:{port}", timeout=60) as client:
            assert await client.health() == "SERVING"
            stream = client.stream("Count to ten:", max_tokens=64, ignore_eos=True)
            events = [await stream.__anext__()]
            proc.send_signal(signal.SIGTERM)
            events += [event async for event in stream]
        deltas = [e for e in events if isinstance(e, Delta)]
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "max_tokens"
        assert sum(len(d.token_ids) for d in deltas) == 64, "the in-flight stream finished"
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
