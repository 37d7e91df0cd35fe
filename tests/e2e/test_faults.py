"""Fault injection against real servers on 127.0.0.1: random client cancellations, deadlines
expiring in every phase, SIGTERM with streams in flight, KV exhaustion, and a client that stops
reading. Each test gets its own server with the settings it needs.

Greedy outputs are compared with solo runs of the same request token for token over the prefix where
the solo run's top-2 margin is wide (fault_support.Reference): the prompts count by one, whose every
step has a margin of several nats on the embedded Gemma 3 270M, so that prefix is in practice the
whole output. The tests whose timing does not hang on the model's speed (random cancellations,
SIGTERM with streams in flight, KV exhaustion, a stopped reader) run the tiny counting model
(llama_grpc_testkit.models: every step wide by construction, passes of microseconds; the SIGTERM
test sizes its streams by the ticks it measures); deadlines in each phase are measured against the
embedded model's passes."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from llama_grpc import AsyncClient, DeadlineExceededError, Delta, Stats, UnavailableError
from llama_grpc_server import errors
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_testkit.models import tiny_model_file
from llama_grpc_testkit.server_process import server_process
from tests.support.fault_support import (
    ProbedServer,
    Reference,
    busy_request_ids,
    collect,
    gather_bounded,
    is_idle,
    poll,
    probed_server,
    reference,
    request_id,
    start,
    until,
)

from .conftest import settings

pytestmark = pytest.mark.slow

TINY = str(tiny_model_file())


def counting(start: int) -> str:
    """A prompt whose greedy continuation (the next numbers) has wide margins at every step."""
    return "Counting by 1: " + ", ".join(str(start + i) for i in range(6)) + ","


def rid(value: str) -> list[tuple[str, str]]:
    return [("x-request-id", value)]


async def references(client: AsyncClient, prompts: list[str], max_tokens: int) -> list[Reference]:
    refs = [await reference(client, p, max_tokens) for p in prompts]  # one at a time: solo
    for ref in refs:
        assert ref.sound >= max_tokens // 2, "the counting prompts keep wide margins"
    return refs


async def tick_seconds(client: AsyncClient, ticks: int = 5) -> float:
    """Roughly how long one forward pass takes right now (the machine may be shared)."""
    loop = asyncio.get_running_loop()
    first = await client.stats()
    started = loop.time()
    last = await poll(client, lambda s: s.ticks >= first.ticks + ticks)
    assert last.ticks > first.ticks, "the engine is ticking"
    return (loop.time() - started) / (last.ticks - first.ticks)


# -- (a) random cancellations ---------------------------------------------------------------------


async def read_then_cancel(client: AsyncClient, prompt: str, n: int, request: str) -> int:
    """Read at least `n` tokens of a long stream, then cancel it (the call stays open until
    then); the tokens read (a delta carries every token decoded since the last one was sent, so
    a fast model's can overshoot n)."""
    # 3,000 tokens: seconds of decoding on the counting model, so every cancel comes first
    stream = client.stream(prompt, max_tokens=3000, ignore_eos=True, metadata=rid(request))
    got = 0
    async for event in stream:
        assert isinstance(event, Delta), event
        got += len(event.token_ids)
        if got >= n:
            break
    await stream.aclose()
    return got


async def test_random_cancellations_free_every_slot_within_one_tick() -> None:
    """32 streams on 8 slots, each cancelled after a random number of tokens (seeded): every
    cancellation frees its slot at the latest one forward pass after it reaches the engine,
    then no slot is busy, nothing is queued and the engine stops ticking."""
    rng = random.Random(20261123)
    stop_after = [rng.randint(1, 12) for _ in range(32)]
    async with probed_server(settings(TINY, n_parallel=8, n_ctx=32768, max_queue=64)) as s:
        before = await s.client.stats()
        ids = [request_id("cancel") for _ in stop_after]
        got = await gather_bounded(
            *(
                read_then_cancel(s.client, counting(10 * i), n, ids[i])
                for i, n in enumerate(stop_after)
            )
        )
        assert all(n <= g < 3000 for g, n in zip(got, stop_after, strict=True)), got
        stats = await poll(
            s.client,
            lambda st: is_idle(st) and st.requests_cancelled >= before.requests_cancelled + 32,
        )
        assert is_idle(stats), stats
        assert stats.requests_cancelled - before.requests_cancelled == 32
        assert stats.requests_finished == before.requests_finished
        assert stats.requests_failed == before.requests_failed
        assert await until(lambda: all(i in s.probe.ended for i in ids))
        for i in ids:
            ended = s.probe.ended[i]
            assert isinstance(ended.error, errors.Cancelled), ended
            assert ended.tick - s.probe.cancel_ticks[i] <= 1, (ended, s.probe.cancel_ticks[i])
        await asyncio.sleep(0.3)
        later = await s.client.stats()
        assert (later.ticks, later.generated_tokens) == (stats.ticks, stats.generated_tokens)


# -- (b) deadlines in every phase -----------------------------------------------------------------

OTHERS = [counting(start) for start in (100, 250, 1000, 12)]
OTHER_TOKENS = 32
LONG_PROMPT_TOKENS = 2000


async def long_prompt(client: AsyncClient, n_tokens: int) -> str:
    """Natural text of at least `n_tokens` tokens (and not many more)."""
    sentence = "The old lighthouse keeper wrote every storm into his logbook. "
    text, count = "", 0
    for _ in range(10):
        missing = n_tokens - count
        if missing <= 0:
            break
        text += sentence * max(1, missing // 16)
        count = len(await client.tokenize(text))
    assert n_tokens <= count < n_tokens + 100, count
    return text


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def deadline_server() -> AsyncIterator[tuple[ProbedServer, list[Reference], str]]:
    """4 slots, prompt chunks of at most 16 tokens: a 2k-token prefill spans 125+ ticks."""
    async with probed_server(settings(n_parallel=4, n_ctx=4096, chunk_size=16)) as s:
        refs = await references(s.client, OTHERS, OTHER_TOKENS)
        yield s, refs, await long_prompt(s.client, LONG_PROMPT_TOKENS)


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
async def test_deadline_expiring_fails_that_request_only(
    deadline_server: tuple[ProbedServer, list[Reference], str], phase: str
) -> None:
    """A request whose deadline passes while queued (all slots busy), in the middle of a
    2k-token prefill, or while decoding ends with DEADLINE_EXCEEDED and frees its slot; the
    streams decoding beside it finish with their solo output."""
    s, refs, long_prompt = deadline_server
    n_others = 4 if phase == "queued" else 3
    others = [
        await start(s.client.stream(p, max_tokens=OTHER_TOKENS, ignore_eos=True))
        for p in OTHERS[:n_others]
    ]
    tick_s = await tick_seconds(s.client)
    victim = request_id(f"deadline-{phase}")
    # The others have 20+ ticks to go: each deadline passes while they still decode.
    if phase == "queued":  # no slot frees before the others finish
        prompt, max_tokens, deadline = counting(40), 32, max(0.5, 8 * tick_s)
    elif phase == "prefill":  # admitted at the next tick, then 125+ ticks of prefill
        prompt, max_tokens, deadline = long_prompt, 16, max(0.5, 12 * tick_s)
    else:  # a tick or two of prefill, then decoding until the deadline
        prompt, max_tokens, deadline = counting(70), 2000, max(0.5, 12 * tick_s)
    stream = s.client.stream(
        prompt, max_tokens=max_tokens, ignore_eos=True, timeout=deadline, metadata=rid(victim)
    )
    failed = await asyncio.wait_for(collect(stream), 120)
    assert isinstance(failed.error, DeadlineExceededError), failed
    assert await until(lambda: victim in s.probe.ended), "the engine released it"
    ended = s.probe.ended[victim]
    assert isinstance(ended.error, errors.DeadlineExceeded), ended  # never a cancellation
    if phase == "queued":
        assert not ended.was_admitted, ended
    elif phase == "prefill":
        assert ended.num_prompt >= LONG_PROMPT_TOKENS, ended
        assert ended.was_admitted and 0 < ended.num_computed < ended.num_prompt, ended
        assert ended.num_output == 0 and not failed.token_ids, ended
    else:
        assert 0 < ended.num_output < max_tokens and failed.token_ids, ended
    stats = await s.client.stats()
    assert victim not in busy_request_ids(stats), stats
    done = await gather_bounded(*(other.task for other in others))
    for out, ref in zip(done, refs, strict=False):
        assert out.error is None and out.done is not None, out
        ref.check(out.token_ids)
    assert is_idle(await poll(s.client, is_idle))


# -- (c) SIGTERM with streams in flight -----------------------------------------------------------

# The counting model (statuses and token counts, not words): 16 streams tick every few ms, so
# the short ones are long enough to be seen in flight (polled every POLL_S) and the long ones
# outlast the grace period several times over even at a quiet machine's pace.
SHORT, LONG, GRACE_S = 400, 6000, 3
SIGTERM_CTX = 16 * (LONG + 64)


async def test_sigterm_with_16_streams_completes_or_unavailable_and_exits_zero() -> None:
    """SIGTERM with 16 streams decoding in step: the short ones (a few ticks from their end)
    finish within the grace period, the long ones (thousands of tokens to go) are ended with
    UNAVAILABLE when it runs out; no stream hangs; the process exits 0."""
    async with server_process(
        "--model", TINY, "--n-ctx", str(SIGTERM_CTX), "--n-parallel", "16",
        "--grace-s", str(GRACE_S), "--temperature", "0",
    ) as server:  # fmt: skip
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            lengths = [SHORT, LONG] * 8
            streams = await gather_bounded(  # at once: all 16 are admitted together
                *(
                    start(client.stream(counting(20 * i), max_tokens=n, ignore_eos=True))
                    for i, n in enumerate(lengths)
                )
            )
            shorts = [r.outcome for r, n in zip(streams, lengths, strict=True) if n == SHORT]

            def progress() -> int:
                return min(len(o.token_ids) for o in shorts)

            # the machine may be shared: SIGTERM once the short ones have about a quarter of
            # the grace period of decoding left (at most half their length), measured on their
            # own progress
            loop = asyncio.get_running_loop()
            assert await until(lambda: progress() >= 4, 2400)
            started, first = loop.time(), progress()
            assert await until(lambda: progress() >= first + 20, 2400)
            tick_s = (loop.time() - started) / (progress() - first)
            left = max(1, min(SHORT // 2, int(GRACE_S / 4 / tick_s)))
            assert await until(lambda: progress() >= SHORT - left, 2400)
            in_flight = sum(r.outcome.done is None and r.outcome.error is None for r in streams)
            server.proc.send_signal(signal.SIGTERM)
            outs = await gather_bounded(*(r.task for r in streams))
        assert await server.wait(60) == 0, server.lines[-20:]
    assert in_flight == 16
    for n, out in zip(lengths, outs, strict=True):
        if out.done is not None:
            assert out.error is None and len(out.token_ids) == n, out
        else:
            assert isinstance(out.error, UnavailableError), out.error
            assert out.error.reason == "SHUTTING_DOWN", out.error  # ended by us, not cut
            assert 0 < len(out.token_ids) < n
    assert all(out.done is not None for out in shorts), "they finished within the grace period"
    assert any(isinstance(out.error, UnavailableError) for out in outs), "grace ran out"


# -- (e) KV exhaustion ----------------------------------------------------------------------------

KV_PROMPTS = [counting(start) for start in (1, 20, 50, 250)]
KV_TOKENS = 40


async def test_kv_exhaustion_preempts_and_resumes_without_losing_a_token() -> None:
    """16 requests of 65 cells each on 8 slots sharing 256 KV cells: the scheduler preempts and
    resumes; every request completes with exactly its solo output (greedy token ids)."""
    async with probed_server(settings(TINY, n_parallel=8, n_ctx=256, max_queue=64)) as s:
        refs = await references(s.client, KV_PROMPTS, KV_TOKENS)
        before = await s.client.stats()
        ids = [request_id("kv") for _ in range(16)]
        outs = await gather_bounded(
            *(
                collect(
                    s.client.stream(
                        KV_PROMPTS[i % 4], max_tokens=KV_TOKENS, ignore_eos=True, metadata=rid(r)
                    )
                )
                for i, r in enumerate(ids)
            )
        )
        after = await s.client.stats()
        for i, out in enumerate(outs):
            assert out.error is None and out.done is not None, out
            assert out.done.finish_reason == "max_tokens"
            refs[i % 4].check(out.token_ids)
        assert after.preemptions > before.preemptions, "the KV cache ran out"
        assert after.requests_failed == before.requests_failed
        # some request was preempted mid-decode at a point its comparison covers
        checked = [
            p
            for i, r in enumerate(ids)
            for p in s.probe.preempted_at.get(r, [])
            if 0 < p < refs[i % 4].sound
        ]
        assert checked, (s.probe.preempted_at, [ref.sound for ref in refs])


# -- (f) a client that stops reading --------------------------------------------------------------


def kv_tokens(stats: Stats, request: str) -> int:
    return sum(slot.cached_tokens for slot in stats.slots if slot.request_id == request)


# A tiny receive window and no BDP probing: the stalled stream's window fills after a few
# messages, so HTTP/2 flow control stops the server's writes to it.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


async def test_client_that_stops_reading_does_not_stall_others() -> None:
    """One stream is read for 3 tokens and then left open unread until HTTP/2 flow control
    stops the server's writes to it; three streams started after that finish with their solo
    output while it stays stalled; it stops decoding with --stream-buffer-tokens unread (the
    default, 256); cancelling it frees its slot."""
    async with probed_server(settings(TINY, n_parallel=4, n_ctx=4096)) as s:
        prompts = OTHERS[:3]
        refs = await references(s.client, prompts, OTHER_TOKENS)
        stalled_id = request_id("stalled")
        async with AsyncClient(s.target, timeout=300, options=SMALL_WINDOW) as slow:
            stalled = slow.stream(
                counting(5), max_tokens=2000, ignore_eos=True, metadata=rid(stalled_id)
            )
            for _ in range(3):
                assert isinstance(await anext(stalled), Delta)
            # 200 unread tokens are ~8 KB of messages: the 1 KiB window is long full by then (and
            # the server decodes on until 256 are unread in its own buffer)
            backlog = await poll(s.client, lambda st: kv_tokens(st, stalled_id) >= 230, 2400)
            assert kv_tokens(backlog, stalled_id) >= 230, "it is decoded though nobody reads"
            outs = await gather_bounded(
                *(
                    collect(s.client.stream(p, max_tokens=OTHER_TOKENS, ignore_eos=True))
                    for p in prompts
                )
            )
            for out, ref in zip(outs, refs, strict=True):
                assert out.error is None and out.done is not None, out
                ref.check(out.token_ids)
            stats = await poll(s.client, lambda st: st.paused_streams == 1, 2400)
            assert stalled_id in busy_request_ids(stats), "still holding its slot, unread"
            (slot,) = [slot for slot in stats.slots if slot.request_id == stalled_id]
            assert slot.buffered_tokens == SchedulerSettings().stream_buffer_tokens == 256
            assert stats.paused_streams == 1
            before = stats.requests_cancelled
            await stalled.aclose()
            stats = await poll(s.client, lambda st: stalled_id not in busy_request_ids(st))
            assert stalled_id not in busy_request_ids(stats)
            assert stats.requests_cancelled == before + 1
            assert await until(lambda: stalled_id in s.probe.ended)
            assert isinstance(s.probe.ended[stalled_id].error, errors.Cancelled)
            assert is_idle(await poll(s.client, is_idle))
