"""Chaos through the SMG gateway (deploy/gateway.py): three real replicas behind SMG's
cache_aware policy, the official `openai` SDK as the client, all on 127.0.0.1. A replica killed
with SIGKILL costs no non-streaming request (SMG retries it on another worker) and only its own
streams, which end with an error the SDK raises; SMG stops routing to it within its health
interval. A rolling restart (SIGTERM: the replica drains) loses nothing, and a restarted
replica's disk tier is announced to the gateway again. Its own gateway, so test_gateway.py's
last test (SMG's event-stream counters) is not disturbed.

Every SDK call has a timeout and max_retries=0: a success is the gateway's doing, not the
SDK's, and nothing can hang."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio
from deploy.cluster import START_TIMEOUT_S, Replica, free_port
from deploy.gateway import HEALTH_ARGS, HEALTH_INTERVAL_S, NO_WARM_UP, QUICK_EXIT, Gateway, _http
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient, Delta
from llama_grpc_server.core.kv.events import chain
from llama_grpc_testkit.models import tiny_model_file
from llama_grpc_testkit.threads import TEST_THREADS
from tests.support.vllm_engine_fake import kv_until, stored_blocks

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 120.0
# The replicas run the tiny counting model (llama_grpc_testkit.models): routing, retries and
# draining do not read the words, and its passes cost microseconds, so calls must be long to be
# in flight when a replica dies: 2,000 tokens are a second or more on a quiet box. The kill
# test's streams would take far longer than the test (it closes them): 2,000 were once all done
# by the kill.
OPEN_STREAM_TOKENS = 30_000
PLAIN_TOKENS = 2000
ROLL_TOKENS = 400  # the rolling restart's calls: ~0.1-0.5 s each, not a busy loop of calls
DISK_BLOCK = 64  # the disk tier saves whole 64-token blocks (core.kv.events' docstring)


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def gateway(kv_dir: Path) -> Iterator[Gateway]:
    # room for four open streams beside the other calls on one replica (the counting model's
    # KV cache is 512 bytes a token)
    server_args = ["--model", str(tiny_model_file()), "--n-ctx", "131072", "--n-parallel", "8",
                   "--grace-s", "30", "--kv-cache-dir", str(kv_dir)]  # fmt: skip
    smg_args = [*NO_WARM_UP, *HEALTH_ARGS, *QUICK_EXIT]  # probes every second (deploy/gateway.py)
    with Gateway(
        replicas=3,
        port=free_port(),
        server_args=server_args,
        smg_args=smg_args,
        threads=TEST_THREADS,
    ) as gw:
        yield gw


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(gateway: Gateway) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    ) as client:
        yield client


def workers(gateway: Gateway) -> dict[str, bool]:
    """SMG's /workers: {url: is_healthy}."""
    listed = _http(f"http://127.0.0.1:{gateway.port}/workers")["workers"]
    return {w["url"]: bool(w.get("is_healthy")) for w in listed}


def url(replica: Replica) -> str:
    return f"grpc://{replica.target}"


async def poll(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> float:
    """Await `predicate()` (sync, run in a thread) becoming true; the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await asyncio.to_thread(predicate):
        if loop.time() - start > timeout_s:
            raise TimeoutError(f"{what} after {timeout_s:g} s")
        await asyncio.sleep(interval_s)
    return loop.time() - start


def retries(gateway: Gateway) -> float:
    """SMG's retries of /v1/completions attempts so far."""
    return gateway.metrics().get(
        'smg_worker_retries_total{worker_type="regular",endpoint="completions"}', 0.0
    )


def kv_metric(gateway: Gateway, replica: Replica, name: str, labels: str = "") -> float:
    return gateway.metrics().get(f'{name}{{worker="{url(replica)}"{labels}}}', 0.0)


async def started(gateway: Gateway, replicas: list[Replica] | None = None) -> list[int]:
    """requests_started of each replica (all of the gateway's unless given), asked directly
    (v1 GetStats)."""
    counts = []
    for replica in gateway.cluster.members if replicas is None else replicas:
        async with AsyncClient(replica.target, timeout=10) as client:
            counts.append((await client.stats()).requests_started)
    return counts


async def until_started(gateway: Gateway, before: list[int], total: int) -> list[int]:
    """Per replica, the requests started since `before`, once `total` have (bounded)."""
    for _ in range(600):
        now = [a - b for a, b in zip(await started(gateway), before, strict=True)]
        if sum(now) >= total:
            return now
        await asyncio.sleep(0.1)
    raise TimeoutError(f"only {sum(now)} of {total} requests started: {now}")


async def plain(sdk: Any, model: str, prompt: str, max_tokens: int = PLAIN_TOKENS) -> int:
    """A non-streamed completion: its completion tokens."""
    answer = await sdk.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return int(answer.usage.completion_tokens)


async def streamed(sdk: Any, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """A streamed completion: ("OK", completion tokens from the usage chunk) or (the SDK's
    exception type, -1)."""
    try:
        stream = await sdk.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = -1
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        return type(exc).__name__, -1
    return "OK", tokens


async def open_stream(sdk: Any, model: str, prompt: str, close: asyncio.Event) -> tuple[str, int]:
    """A stream of OPEN_STREAM_TOKENS read until `close` is set: ("OPEN", chunks read) when it
    was still streaming then (and is closed), ("ENDED", chunks) when it ended first, or (the
    SDK's exception type, chunks)."""
    chunks = 0
    try:
        stream = await sdk.completions.create(
            model=model, prompt=prompt, max_tokens=OPEN_STREAM_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            chunks += 1
            if close.is_set():
                await stream.close()
                return "OPEN", chunks
    except openai.APIError as exc:
        return type(exc).__name__, chunks
    return "ENDED", chunks


async def back_in_the_gateway(gateway: Gateway, replica: Replica, subscriptions: float) -> None:
    """`replica` serves again, SMG lists it healthy and has subscribed to its KV events anew."""
    await asyncio.to_thread(replica.wait_serving)
    await poll(lambda: workers(gateway)[url(replica)], 30, "SMG does not list it healthy")
    await poll(
        lambda: kv_metric(gateway, replica, "smg_kv_event_subscriptions_total") > subscriptions,
        30, "SMG did not subscribe again",
    )  # fmt: skip


async def test_a_killed_replica_costs_no_unary_request_and_only_its_own_streams(
    sdk: Any, gateway: Gateway
) -> None:
    """9 streams, then 9 non-streamed completions, spread over the 3 replicas (distinct prompts:
    cache misses go to the least loaded). SIGKILL the replica with the most of them: each
    non-streamed one completes in full (those the victim had not answered ran again on another
    worker, each after at least one SMG retry), the streams on the victim end with
    openai.APIError and every other stream is still streaming once those calls are done (then
    closed); SMG lists the victim unhealthy within its health interval and sends it nothing more
    (9 more completions, not one retry)."""
    model, tag = gateway.model, uuid.uuid4().hex[:8]
    before, retried = await started(gateway), retries(gateway)
    close = asyncio.Event()
    streams = [
        asyncio.create_task(open_stream(sdk, model, f"{tag} stream {i}: count slowly.", close))
        for i in range(9)
    ]
    per_stream = await until_started(gateway, before, 9)
    unary = [
        asyncio.create_task(plain(sdk, model, f"{tag} unary {i}: list the months."))
        for i in range(9)
    ]
    both = await until_started(gateway, before, 18)
    # Each call started exactly once so far: a replica's count in `both` is final until the kill.
    assert sum(both) == 18, both
    per_unary = [b - s for b, s in zip(both, per_stream, strict=True)]
    candidates = [i for i in range(3) if per_stream[i] and per_unary[i]]
    assert candidates, (per_stream, per_unary)  # cache_aware spread both kinds
    index = max(candidates, key=lambda i: both[i])
    victim = gateway.cluster.members[index]
    others = [i for i in range(3) if i != index]
    subscriptions = kv_metric(gateway, victim, "smg_kv_event_subscriptions_total")
    assert victim.stop(signal.SIGKILL) == -signal.SIGKILL
    try:
        left = await poll(
            lambda: not workers(gateway)[url(victim)], 3 * HEALTH_INTERVAL_S + 5,
            "SMG still lists the killed replica healthy",
        )  # fmt: skip
        assert await asyncio.gather(*unary) == [PLAIN_TOKENS] * 9
        # What the victim never answered, counted after the fact (a GetStats read before the
        # kill races with calls that end meanwhile: 3 unary calls held, 0 retried, once): each
        # unary call it held at the kill ran again on a survivor, where nothing else started,
        # so the survivors' starts beyond their share of the 18 are exactly those calls.
        now = await started(gateway, [gateway.cluster.members[i] for i in others])
        rerun = sum(n - before[i] - both[i] for n, i in zip(now, others, strict=True))
        print(f"\nvictim {index} ({per_stream[index]} streams, {per_unary[index]} unary, "
              f"{rerun} unary unanswered at the kill); unlisted after {left:.1f} s")  # fmt: skip
        assert 0 <= rerun <= per_unary[index], (rerun, per_unary)
        assert retries(gateway) - retried >= rerun  # each one after an SMG retry
        close.set()
        results = await asyncio.gather(*streams)
        failed = [code for code, _ in results if code != "OPEN"]
        assert 1 <= len(failed) <= per_stream[index], results
        assert set(failed) == {"APIError"}, results
        assert all(chunks > 0 for _, chunks in results), results
        assert sorted(workers(gateway).values()) == [False, True, True]
        settled = retries(gateway)
        after = await asyncio.gather(*(plain(sdk, model, f"{tag} after {i}.", 8) for i in range(9)))
        assert after == [8] * 9
        assert retries(gateway) == settled  # no attempt went to the dead replica
    finally:  # back for the next test, whatever this one found
        close.set()
        victim.start()
        await back_in_the_gateway(gateway, victim, subscriptions)


async def test_rolling_restart_with_drain_loses_nothing(sdk: Any, gateway: Gateway) -> None:
    """8 callers (half streaming, half not) keep asking while each replica in turn gets SIGTERM
    (it drains: HealthCheck unhealthy, SMG stops routing to it, in-flight calls finish, then
    it exits 0), starts again, serves and is listed healthy by SMG with a new KV-event
    subscription before the next one goes: not one call fails, every one is complete."""
    model, tag = gateway.model, uuid.uuid4().hex[:8]
    done = asyncio.Event()
    outcomes: list[tuple[str, int]] = []

    async def caller(i: int) -> None:
        turn = 0
        while not done.is_set():
            prompt = f"{tag} caller {i} turn {turn}: name a fruit."
            if i % 2:
                outcomes.append(await streamed(sdk, model, prompt, ROLL_TOKENS))
            else:
                try:
                    outcomes.append(("OK", await plain(sdk, model, prompt, ROLL_TOKENS)))
                except openai.APIError as exc:
                    outcomes.append((type(exc).__name__, -1))
            turn += 1

    async def more_outcomes(n: int) -> None:
        target = len(outcomes) + n
        await poll(lambda: len(outcomes) >= target, 120, "no calls completing")

    callers = [asyncio.create_task(caller(i)) for i in range(8)]
    codes = []
    try:
        for replica in gateway.cluster.members:
            await more_outcomes(4)
            subscriptions = kv_metric(gateway, replica, "smg_kv_event_subscriptions_total")
            codes.append(await asyncio.to_thread(replica.stop, signal.SIGTERM))
            replica.start()
            await back_in_the_gateway(gateway, replica, subscriptions)
        await more_outcomes(4)
    finally:
        done.set()
        await asyncio.gather(*callers)
    assert [o for o in outcomes if o != ("OK", ROLL_TOKENS)] == []
    assert len(outcomes) >= 8 * 3
    assert codes == [0, 0, 0]


async def test_a_restarted_replica_announces_its_disk_tier_again(gateway: Gateway) -> None:
    """A long prompt run on one replica, which then gets SIGTERM (it saves its idle slots to
    the disk tier) and starts again: its first SubscribeKvEvents snapshot holds the prompt's
    whole 64-token blocks on the DISK tier, and SMG subscribed again and took a snapshot
    (which SMG applies without routing on DISK blocks)."""
    replica = gateway.cluster.members[0]
    text = f"{uuid.uuid4().hex} The harbour town keeps its old customs, one by one. " * 24
    async with AsyncClient(replica.target, timeout=CALL_TIMEOUT_S) as client:
        ids = await client.tokenize(text)
        events = [e async for e in client.generate_tokens(ids, max_tokens=2, temperature=0)]
        assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 2
    kept = len(ids) // DISK_BLOCK * DISK_BLOCK
    assert kept >= 4 * DISK_BLOCK
    subscriptions = kv_metric(gateway, replica, "smg_kv_event_subscriptions_total")
    snapshots = kv_metric(gateway, replica, "smg_kv_event_resyncs_total", ',reason="snapshot"')
    assert await asyncio.to_thread(replica.stop, signal.SIGTERM) == 0
    replica.start()
    await asyncio.to_thread(replica.wait_serving, START_TIMEOUT_S)
    async with grpc.aio.insecure_channel(replica.target) as channel:
        stream = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
        [snapshot] = await kv_until(stream, lambda b: True)
        stream.cancel()
    assert snapshot.HasField("snapshot")
    on_disk = {
        block.block_hash
        for stored, block in stored_blocks([snapshot])
        if stored.tier == cpb.KV_CACHE_TIER_DISK
    }
    expected = {block.hash for block in chain("", ids[:kept])}
    assert expected <= on_disk, (len(expected & on_disk), len(expected))
    await back_in_the_gateway(gateway, replica, subscriptions)
    await poll(
        lambda: kv_metric(gateway, replica, "smg_kv_event_resyncs_total", ',reason="snapshot"')
        > snapshots,
        30, "SMG took no new snapshot",
    )  # fmt: skip
