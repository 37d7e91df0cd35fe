"""Speculative decoding end to end (issue 17): a real server started with --speculative auto and
Prometheus on, the real client. params.speculative reaches the scheduler (ON drafts, OFF does
not, the output is the same), usage carries the draft counts, GetStats and /metrics the totals,
the tick event the per-pass counts, a bad field is INVALID_ARGUMENT naming it, and grpcurl sees
the new fields through reflection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio
from deploy.cluster import free_port

from llama_grpc import AsyncClient, Delta, Done
from llama_grpc.errors import InvalidArgumentError
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.models.files import DEFAULT_MODEL_NAME
from llama_grpc_server.observability.metrics import Metrics
from llama_grpc_server.observability.telemetry import Bus, Telemetry, TelemetryEvent, TickEvent
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.support.grpcurl import grpcurl_run

from ..conftest import scrape, value
from .conftest import settings

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room and the archive."
)
COPY = f"Copy the text exactly.\nText: {PARAGRAPH}\nCopy: {PARAGRAPH}\nCopy:"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def server() -> AsyncIterator[tuple[RunningServer, list[TickEvent]]]:
    ticks: list[TickEvent] = []

    def record(name: str, event: TelemetryEvent) -> None:
        if isinstance(event, TickEvent):
            ticks.append(event)

    bus, metrics = Bus(), Metrics()
    bus.attach("tick", record)
    hooks = Telemetry(bus=bus, sink=metrics, model=DEFAULT_MODEL_NAME)
    base = settings(n_parallel=2, speculative="auto", draft_max=8)
    conf = replace(base, server=replace(base.server, metrics_port=free_port()))

    def factory() -> Any:
        return build_engine(conf, on_tick=hooks.on_tick, on_done=hooks.on_done)

    async with start_server(conf, factory, metrics=metrics) as running:
        assert await running.wait_loaded()
        yield running, ticks


@pytest_asyncio.fixture(loop_scope="session")
async def client(
    server: tuple[RunningServer, list[TickEvent]],
) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{server[0].port}", timeout=120) as c:
        yield c


async def test_on_drafts_off_does_not_and_the_text_is_the_same(client: AsyncClient) -> None:
    """The same greedy request with speculation on and off: same text; on has drafts in its
    usage (most accepted), off has none."""
    on = await client.generate(COPY, max_tokens=40, speculative="on", cache_prompt=False)
    off = await client.generate(COPY, max_tokens=40, speculative="off", cache_prompt=False)
    assert on.text == off.text and on.token_ids == off.token_ids
    assert on.usage.draft_tokens > 0
    assert on.usage.accepted_draft_tokens > on.usage.draft_tokens // 2
    assert (off.usage.draft_tokens, off.usage.accepted_draft_tokens) == (0, 0)


async def test_stream_usage_and_stats_totals(
    client: AsyncClient, server: tuple[RunningServer, list[TickEvent]]
) -> None:
    """A speculating stream's final usage counts its drafts; GetStats, /metrics and the tick
    events move by as much."""
    running, ticks = server
    before = await client.stats()
    seen_ticks = len(ticks)
    done: Done | None = None
    text = ""
    async for event in client.stream(COPY, max_tokens=40, speculative="on", cache_prompt=False):
        if isinstance(event, Delta):
            text += event.text
        else:
            done = event
    assert done is not None and text
    after = await client.stats()
    assert after.spec_draft_tokens - before.spec_draft_tokens == done.usage.draft_tokens > 0
    assert (
        after.spec_accepted_tokens - before.spec_accepted_tokens == done.usage.accepted_draft_tokens
    )
    assert after.spec_ticks > before.spec_ticks
    assert 0 < after.spec_acceptance_rate <= 1
    new_ticks = ticks[seen_ticks:]
    assert sum(t.draft_tokens for t in new_ticks) == done.usage.draft_tokens
    assert any(t.accepted_draft_tokens for t in new_ticks)
    assert running.metrics_port is not None
    got = await asyncio.to_thread(scrape, running.metrics_port)
    model = {"model": DEFAULT_MODEL_NAME}
    assert value(got, "llama_grpc:spec_decode_num_draft_tokens_total", **model) == (
        after.spec_draft_tokens
    )
    assert value(got, "llama_grpc:spec_decode_num_accepted_tokens_total", **model) == (
        after.spec_accepted_tokens
    )
    assert value(got, "llama_grpc:spec_decode_acceptance_rate", **model) == pytest.approx(
        after.spec_acceptance_rate
    )


async def test_a_bad_speculative_field_is_invalid_argument(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await client.generate("hello", max_tokens=2, draft_max=33)
    assert caught.value.field == "params.speculative.draft_max"


async def test_grpcurl_sets_the_speculative_params(
    server: tuple[RunningServer, list[TickEvent]], grpcurl: str
) -> None:
    """Through reflection: params.speculative with the enum by name, usage with the counts."""
    body = {
        "prompt": COPY,
        "params": {
            "stopping": {"max_tokens": 16},
            "speculative": {"mode": "SPECULATIVE_MODE_ON", "draft_max": 4},
            "cache_prompt": False,
        },
    }
    target = f"127.0.0.1:{server[0].port}"
    out = await grpcurl_run(
        grpcurl, "-plaintext", "-d", json.dumps(body), target, "llama_grpc.v1.LlmService/Generate"
    )
    usage = json.loads(out)["usage"]  # grpcurl prints the proto field names
    assert int(usage["draft_tokens"]) > 0 and "accepted_draft_tokens" in usage
