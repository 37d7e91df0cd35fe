"""The engine watchdog in a real server process: the tiny counting model (the tests count
passes and statuses, not words: llama_grpc_testkit.models) and the real runner with a fault injected
(hanging_runner.py). A forward pass that never returns ends every stream in flight or queued
with UNAVAILABLE (ENGINE_HUNG) naming the bound, turns health NOT_SERVING, counts the trip in
GetStats and /metrics, logs the engine thread's stack and exits 71 after --grace-s. Passes
slowed to well within the bound, many bounds in all, trip nothing. With --watchdog-s auto (the
default) the bound follows the pass: a hung decode pass is declared at its own bound (the floor,
seconds) rather than the start bound, and a 2,048-token prompt pass longer than that floor, slow
in proportion to its tokens, is not cut."""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request

import pytest
from deploy.cluster import free_port

from llama_grpc import AsyncClient, Done, UnavailableError
from llama_grpc_server.watchdog import FLOOR_S, MARGIN, START_MIN_S
from llama_grpc_testkit.models import TINY_BOS, tiny_model_file
from llama_grpc_testkit.server_process import ServerProcess, json_lines, server_env, server_process
from tests.support.fault_support import poll

WATCHDOG_S = "2"
HANGING_RUNNER = "llama_grpc_testkit.hanging_runner"  # the server, with faults on demand
# The hang test's passes before the hung one each take this much more (a pass of the counting
# model alone costs about a millisecond): all four requests arrive before the second pass, as
# on the embedded model, so two decode and two wait whatever the machine's pace.
PACED_PASS_S = "0.05"
GRACE_S = "3"
# One llama.cpp thread: on the shared 2-core box a 2-thread pass beside other work was seen to
# take seconds (OpenMP barrier spinning), which would trip a bound this short legitimately.
THREADS = ("--threads", "1")
# In the slow-pass test a pass of the counting model (about a millisecond) is SLOW_PASS_S and
# nothing else, whatever else the machine runs. 0.4 s of 1 s (0.6 s to spare), as 0.75 of 2 and
# 1.5 of 4 on the embedded model before, in less time: 11 passes.
SLOW_WATCHDOG_S = 1.0
SLOW_PASS_S = 0.4  # added to every pass: slow, but well within SLOW_WATCHDOG_S
EXIT_ENGINE_HUNG = 71
SECRET = "walrus-indigo-secret-marker"
# The auto bound's message for a pass whose cost was measured (watchdog.PassBounds.describe).
MEASURED = re.compile(
    r"past the watchdog's ([0-9.]+) s \(a decode pass of (\d+) tokens?: \d+ x ([0-9.e+-]+) ms "
    rf"x {MARGIN:g}, at least {FLOOR_S:g} s\)"
)
# The long-pass test: one pass of LONG_PROMPT tokens (--chunk-size = --n-batch), each token
# SLOW_TOKEN_S slower: over 6 s, past the floor that bounds every short pass.
LONG_PROMPT = 2048
SLOW_TOKEN_S = 0.003


def scrape(port: int, name: str) -> float:
    """One series' value from /metrics (the default model's label)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert len(values) == 1, (name, values)
    return values[0]


async def stream_until_end(client: AsyncClient, i: int) -> tuple[int, BaseException | Done]:
    """The tokens a long stream got, and how it ended."""
    prompt = f"Request {i} {SECRET}: tell a long story about the sea."
    got = 0
    try:
        async for event in client.stream(prompt, max_tokens=400, ignore_eos=True):
            if isinstance(event, Done):
                return got, event
            got += len(event.token_ids)
    except Exception as exc:
        return got, exc
    raise AssertionError("the stream ended without Done or an error")


async def test_hung_forward_pass_fails_every_caller_and_exits_71() -> None:
    """Two streams decode and two wait in the queue when forward pass 8 never returns."""
    metrics_port = free_port()
    async with server_process(
        "--model", str(tiny_model_file()), "--n-ctx", "2048", "--n-parallel", "2",
        "--temperature", "0", "--watchdog-s", WATCHDOG_S, "--grace-s", GRACE_S,
        "--metrics-port", str(metrics_port), *THREADS,
        env=server_env(HANG_AT_PASS="8", SLOW_PASS_S=PACED_PASS_S), module=HANGING_RUNNER,
    ) as proc:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=60) as client:
            results = await asyncio.wait_for(
                asyncio.gather(*(stream_until_end(client, i) for i in range(4))), 60
            )
            assert sorted(got > 0 for got, _ in results) == [False, False, True, True]
            for _, result in results:
                assert isinstance(result, UnavailableError), result
                assert result.reason == "ENGINE_HUNG"
                assert f"past the watchdog's {WATCHDOG_S} s" in str(result)
            await check_hung(client, metrics_port)
        assert await proc.wait(30) == EXIT_ENGINE_HUNG
    check_hang_logs(proc, float(WATCHDOG_S))


async def test_a_hung_decode_pass_is_declared_at_its_own_bound_not_the_start_bound() -> None:
    """--watchdog-s auto: the same four streams and hang, the passes before it timed, so the
    hung decode pass's bound is 10 x its tokens x their measured cost, at least the floor
    (5 s), not the start bound (30 s at least) that a pass of a kind not timed yet gets: each
    stream's status names that bound and how it was derived; health, stats, metrics, logs and
    the exit code as with a configured bound."""
    metrics_port = free_port()
    async with server_process(
        "--model", str(tiny_model_file()), "--n-ctx", "2048", "--n-parallel", "2",
        "--temperature", "0", "--grace-s", GRACE_S, "--metrics-port", str(metrics_port),
        *THREADS,
        env=server_env(HANG_AT_PASS="8", SLOW_PASS_S=PACED_PASS_S), module=HANGING_RUNNER,
    ) as proc:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=60) as client:
            results = await asyncio.wait_for(
                asyncio.gather(*(stream_until_end(client, i) for i in range(4))), 60
            )
            assert sorted(got > 0 for got, _ in results) == [False, False, True, True]
            bounds = set()
            for _, result in results:
                assert isinstance(result, UnavailableError), result
                assert result.reason == "ENGINE_HUNG"
                derived = MEASURED.search(str(result))
                assert derived, str(result)
                bound_s, tokens, ms = (float(derived[1]), int(derived[2]), float(derived[3]))
                # the message rounds the cost to 3 digits
                assert bound_s == pytest.approx(max(FLOOR_S, MARGIN * tokens * ms / 1000), 0.01)
                bounds.add(bound_s)
            assert len(bounds) == 1, bounds
            await check_hung(client, metrics_port)
        assert await proc.wait(30) == EXIT_ENGINE_HUNG
    started = [e for e in json_lines(proc) if e.get("event") == "watchdog"]
    assert len(started) == 1 and started[0]["watchdog_s"] == "auto", started
    assert float(str(started[0]["start_s"])) >= START_MIN_S > bound_s
    check_hang_logs(proc, bound_s)


async def check_hung(client: AsyncClient, metrics_port: int) -> None:
    """Within the grace period: health, stats, metrics and a new call all say so."""
    for _ in range(100):  # health follows at once; a bounded poll
        if await client.health() == "NOT_SERVING":
            break
        await asyncio.sleep(0.05)
    assert await client.health() == "NOT_SERVING"
    stats = await poll(client, lambda s: s.watchdog_trips == 1)
    assert (stats.engine_state, stats.watchdog_trips, stats.requests_failed) == ("failed", 1, 4)
    assert stats.engine_error.startswith("a tick has run for ")
    with pytest.raises(UnavailableError) as caught:
        await client.generate("Hello", max_tokens=2)
    assert caught.value.reason == "ENGINE_HUNG"
    assert (
        await asyncio.to_thread(scrape, metrics_port, "llama_grpc:engine_watchdog_trips_total") == 1
    )
    assert await asyncio.to_thread(scrape, metrics_port, "llama_grpc:engine_up") == 0


def check_hang_logs(proc: ServerProcess, bound_s: float) -> None:
    """One engine_hung line with the engine thread's stack (where it is stuck) and the bound,
    no prompt."""
    hangs = [e for e in json_lines(proc) if e.get("event") == "engine_hung"]
    assert len(hangs) == 1 and hangs[0]["level"] == "error", hangs
    stack = str(hangs[0]["stack"])
    assert "hanging_runner.py" in stack and "never.wait()" in stack and "in _tick" in stack
    assert hangs[0]["watchdog_s"] == pytest.approx(bound_s, 0.01)
    assert SECRET not in "".join(proc.lines), "prompt text reached the logs"


async def test_slow_legitimate_passes_do_not_trip_the_watchdog() -> None:
    """Every pass takes SLOW_PASS_S more than it needs, over three bounds in all: the streams
    finish, nothing trips, health stays SERVING, SIGTERM exits 0."""
    async with server_process(
        "--model", str(tiny_model_file()), "--n-ctx", "2048", "--n-parallel", "2",
        "--temperature", "0", "--watchdog-s", str(SLOW_WATCHDOG_S), *THREADS,
        env=server_env(SLOW_PASS_S=str(SLOW_PASS_S)), module=HANGING_RUNNER,
    ) as proc:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=120) as client:
            results = await asyncio.gather(
                *(client.generate(f"Count to {i}:", max_tokens=10, ignore_eos=True) for i in (3, 5))
            )
            assert [r.finish_reason for r in results] == ["max_tokens", "max_tokens"]
            assert [len(r.token_ids) for r in results] == [10, 10]
            stats = await client.stats()
            assert stats.ticks * SLOW_PASS_S > 3 * SLOW_WATCHDOG_S
            assert (stats.engine_state, stats.watchdog_trips, stats.requests_finished) == (
                "running", 0, 2,
            )  # fmt: skip
            assert await client.health() == "SERVING"
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait(30) == 0
    assert not [e for e in json_lines(proc) if e.get("event") == "engine_hung"]


async def test_a_long_prompt_pass_past_the_floor_is_not_cut() -> None:
    """--watchdog-s auto, every pass SLOW_TOKEN_S a token slower: a short request has the cost
    of a token measured; then a 2,048-token prompt goes in one pass of over 6 s, longer than
    the floor that bounds a short pass, within its own bound (10 x 2,048 x that cost): it
    finishes, nothing trips, health stays SERVING, SIGTERM exits 0."""
    assert LONG_PROMPT * SLOW_TOKEN_S > FLOOR_S
    async with server_process(
        "--model", str(tiny_model_file()), "--n-ctx", "4096", "--n-parallel", "1",
        "--chunk-size", str(LONG_PROMPT), "--temperature", "0", *THREADS,
        env=server_env(SLOW_TOKEN_S=str(SLOW_TOKEN_S)), module=HANGING_RUNNER,
    ) as proc:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{proc.port}", timeout=120) as client:
            short = await client.generate("Count to 3:", max_tokens=4, ignore_eos=True)
            assert short.finish_reason == "max_tokens"
            prompt = [TINY_BOS] + [10 + i % 1000 for i in range(LONG_PROMPT - 1)]
            events = [
                e async for e in client.generate_tokens(prompt, max_tokens=4, ignore_eos=True)
            ]
            done = events[-1]
            assert isinstance(done, Done) and done.finish_reason == "max_tokens", events
            stats = await client.stats()
            assert (stats.engine_state, stats.watchdog_trips, stats.requests_finished) == (
                "running", 0, 2,
            )  # fmt: skip
            assert stats.prompt_tokens >= LONG_PROMPT
            assert await client.health() == "SERVING"
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait(30) == 0
    assert not [e for e in json_lines(proc) if e.get("event") == "engine_hung"]
