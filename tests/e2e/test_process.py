"""The server as a process: `python -m llama_grpc_server` logs where it listens, serves, and on
SIGTERM lets an in-flight stream finish, then exits 0; SIGHUP reloads the tokens file."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from llama_grpc import AsyncClient, Delta, Done, UnauthenticatedError
from llama_grpc_testkit.threads import TEST_THREADS


async def test_sigterm_drains_in_flight_stream_and_exits_zero() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llama_grpc_server", "--port", "0", "--n-ctx", "2048",
        "--n-parallel", "2", "--grace-s", "30", "--log-format", "json",
        "--threads", str(TEST_THREADS),
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


async def test_sighup_reloads_the_tokens_file(tmp_path: Path) -> None:
    """A token removed from the file stops working after SIGHUP; the process keeps serving."""
    old, new = "old-token-0123456789abcdef", "new-token-0123456789abcdef"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tokens]]\ntenant = "a"\ntoken = "{old}"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llama_grpc_server", "--port", "0", "--n-ctx", "1024",
        "--n-parallel", "1", "--log-format", "json", "--auth-tokens-file", str(tokens),
        "--threads", str(TEST_THREADS),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None

    async def until(event: str) -> dict[str, object]:
        assert proc.stdout is not None
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, "server exited early"
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == event:
                return dict(entry)

    try:
        port = int(str((await until("listening"))["port"]))
        await until("ready")
        async with AsyncClient(f"127.0.0.1:{port}", timeout=60, token=old) as client:
            assert await client.tokenize("hi")
            tokens.write_text(f'[[tokens]]\ntenant = "a"\ntoken = "{new}"\n')
            proc.send_signal(signal.SIGHUP)
            await until("auth_reloaded")
            with pytest.raises(UnauthenticatedError):
                await client.tokenize("hi")
        async with AsyncClient(f"127.0.0.1:{port}", timeout=60, token=new) as client:
            assert await client.tokenize("hi")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
