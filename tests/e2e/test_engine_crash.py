"""Engine death in a real server process: a --batch-strategy plugin raises mid-run. Every
stream in flight or queued ends with INTERNAL naming the cause, health turns NOT_SERVING,
GetStats says why, new generations get UNAVAILABLE, the log has the traceback once and no
prompt text, and the process exits 70 after --grace-s (or stays up with
--keep-alive-on-engine-error)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from llama_grpc import AsyncClient, Done, InternalError, UnavailableError
from llama_grpc_testkit.server_process import ServerProcess, json_lines, server_env, server_process

SECRET = "zebra-violet-secret-marker"
EXIT_ENGINE_FAILED = 70


@pytest.fixture
async def crashing_server(request: pytest.FixtureRequest) -> AsyncIterator[ServerProcess]:
    env = server_env(CRASH_AT_CALL="30")
    async with server_process(
        "--n-ctx", "2048", "--n-parallel", "2", "--temperature", "0",
        "--batch-strategy", "llama_grpc_testkit.crashing_strategy:from_env", *request.param,
        env=env,
    ) as proc:  # fmt: skip
        yield proc


async def run_stream(client: AsyncClient, i: int) -> BaseException | Done:
    prompt = f"Request {i} {SECRET}: tell a long story about the sea."
    try:
        async for event in client.stream(prompt, max_tokens=400, ignore_eos=True):
            if isinstance(event, Done):
                return event
    except Exception as exc:
        return exc
    raise AssertionError("the stream ended without Done or an error")


async def crash_with_four_streams(client: AsyncClient) -> None:
    """Two streams decode and two wait in the queue when the strategy raises (tick 30)."""
    results = await asyncio.wait_for(asyncio.gather(*(run_stream(client, i) for i in range(4))), 60)
    for result in results:
        assert isinstance(result, InternalError), result
        assert result.reason == "ENGINE_FAILED"
        assert "ZeroDivisionError: strategy bug at call 30" in str(result)
        assert "Traceback" not in str(result)
    for _ in range(20):  # health follows within one second (bounded poll)
        if await client.health() == "NOT_SERVING":
            break
        await asyncio.sleep(0.05)
    assert await client.health() == "NOT_SERVING"
    stats = await client.stats()
    assert stats.engine_state == "failed"
    assert stats.engine_error == "ZeroDivisionError: strategy bug at call 30"
    with pytest.raises(UnavailableError, match="the engine has failed"):
        await client.generate("Hello", max_tokens=2)


def check_logs(proc: ServerProcess) -> None:
    failures = [e for e in json_lines(proc) if e.get("event") == "engine_failed"]
    assert len(failures) == 1 and failures[0]["level"] == "error"
    assert "ZeroDivisionError" in str(failures[0]["traceback"])
    assert SECRET not in "".join(proc.lines), "prompt text reached the logs"


@pytest.mark.parametrize("crashing_server", [("--grace-s", "1")], indirect=True)
async def test_engine_crash_fails_every_caller_then_exits_70(
    crashing_server: ServerProcess,
) -> None:
    proc = crashing_server
    async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=60) as client:
        await crash_with_four_streams(client)
    assert await proc.wait(30) == EXIT_ENGINE_FAILED
    check_logs(proc)


@pytest.mark.parametrize(
    "crashing_server", [("--grace-s", "0.5", "--keep-alive-on-engine-error")], indirect=True
)
async def test_keep_alive_on_engine_error_stays_up_until_sigterm(
    crashing_server: ServerProcess,
) -> None:
    proc = crashing_server
    async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=60) as client:
        await crash_with_four_streams(client)
        await asyncio.sleep(1.5)  # past --grace-s: still up, still explaining itself
        assert proc.proc.returncode is None
        assert (await client.stats()).engine_state == "failed"
    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait(30) == EXIT_ENGINE_FAILED
    check_logs(proc)
