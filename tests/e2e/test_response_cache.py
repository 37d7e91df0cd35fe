"""The exact response cache end to end (issue 15), against a real server with the embedded model,
--response-cache-mb and a tokens file: a repeated greedy Generate comes back with the same text
in a small fraction of the first call's time without reaching the scheduler; a stream replays
the original deltas; sampled requests without a seed are never cached, seeded ones are; tenants
and cache scopes never share; cache_response=false opts out; ClearCache empties it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest_asyncio

from llama_grpc import AsyncClient, Delta, Done
from llama_grpc_server.auth import token_digest
from llama_grpc_server.config import ServerSettings
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.rpc.plumbing.lifecycle import RunningServer
from llama_grpc_server.rpc.plumbing.server import start_server
from tests.e2e.conftest import settings

USER_A = "token-of-tenant-a-0123456789"
USER_B = "token-of-tenant-b-0123456789"
ADMIN = "token-of-the-admin-0123456789"
MAX_HIT_SHARE = 0.05  # the bar: a hit takes < 5 % of the first call's time


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def server(tmp_path_factory: Any) -> AsyncIterator[RunningServer]:
    tokens = Path(tmp_path_factory.mktemp("auth")) / "tokens.toml"
    tokens.write_text(
        f"""
[[tokens]]
tenant = "team-a"
sha256 = "{token_digest(USER_A)}"

[[tokens]]
tenant = "team-b"
sha256 = "{token_digest(USER_B)}"

[[tokens]]
tenant = "ops"
role = "admin"
sha256 = "{token_digest(ADMIN)}"
"""
    )
    conf = settings(n_parallel=2, max_queue=16, response_cache_mb=16)
    conf = replace(conf, server=ServerSettings(port=0, grace_s=1.0, auth_tokens_file=str(tokens)))
    async with start_server(conf, lambda: build_engine(conf)) as running:
        assert await running.wait_loaded()
        yield running


def connect(server: RunningServer, token: str) -> AsyncClient:
    return AsyncClient(f"127.0.0.1:{server.port}", timeout=120, token=token)


@pytest_asyncio.fixture(loop_scope="session")
async def team_a(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with connect(server, USER_A) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def team_b(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with connect(server, USER_B) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def admin(server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with connect(server, ADMIN) as client:
        yield client


async def test_a_repeated_greedy_generate_is_answered_from_the_cache(
    team_a: AsyncClient, admin: AsyncClient
) -> None:
    """Identical text, cached_response, no new request in the scheduler, and a small share of
    the first call's wall time (the figure is printed: pytest -s)."""
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    started = time.perf_counter()
    first = await team_a.generate(prompt, temperature=0.0, max_tokens=48, ignore_eos=True)
    first_s = time.perf_counter() - started
    before = await admin.stats()
    started = time.perf_counter()
    second = await team_a.generate(prompt, temperature=0.0, max_tokens=48, ignore_eos=True)
    second_s = time.perf_counter() - started
    after = await admin.stats()
    print(f"\nfirst {first_s * 1000:.1f} ms, hit {second_s * 1000:.2f} ms: "
          f"{second_s / first_s:.2%} (server total_ms {second.timings.total_ms:.3f})")  # fmt: skip
    assert (second.text, second.token_ids) == (first.text, first.token_ids)
    assert len(first.token_ids) == 48
    assert not first.usage.cached_response and second.usage.cached_response
    assert after.requests_started == before.requests_started
    assert after.generated_tokens == before.generated_tokens
    assert after.response_cache_hits == before.response_cache_hits + 1
    assert second_s < MAX_HIT_SHARE * first_s


async def test_a_stream_replays_the_original_deltas(team_a: AsyncClient) -> None:
    prompt = "List the planets of the solar system in order:"
    runs = []
    for _ in range(2):
        stream = team_a.stream(prompt, temperature=0.0, max_tokens=16)
        events = [event async for event in stream]
        runs.append(events)
    original, replay = runs
    deltas = [e for e in original if isinstance(e, Delta)]
    assert len(deltas) > 1
    assert [e for e in replay if isinstance(e, Delta)] == deltas
    done = [e for e in (original[-1], replay[-1]) if isinstance(e, Done)]
    assert [d.usage.cached_response for d in done] == [False, True]
    assert done[0].finish_reason == done[1].finish_reason


async def test_sampled_requests_without_a_seed_are_never_cached(
    team_a: AsyncClient, admin: AsyncClient
) -> None:
    prompt = "Invent a name for a new colour:"
    before = await admin.stats()
    answers = [await team_a.generate(prompt, temperature=0.9, max_tokens=8) for _ in range(2)]
    after = await admin.stats()
    assert [a.usage.cached_response for a in answers] == [False, False]
    assert after.requests_started == before.requests_started + 2
    assert after.response_cache_misses == before.response_cache_misses + 2
    assert after.response_cache_hits == before.response_cache_hits
    assert after.response_cache_entries == before.response_cache_entries


async def test_sampled_requests_with_a_seed_are_cached(team_a: AsyncClient) -> None:
    prompt = "Invent a name for a new planet:"
    first, second = [
        await team_a.generate(prompt, temperature=0.9, seed=1234, max_tokens=8) for _ in range(2)
    ]
    assert [first.usage.cached_response, second.usage.cached_response] == [False, True]
    assert (second.text, second.seed) == (first.text, first.seed) == (first.text, 1234)


async def test_tenants_and_cache_scopes_never_share(
    team_a: AsyncClient, team_b: AsyncClient, admin: AsyncClient
) -> None:
    prompt = "The three primary colours are"
    before = await admin.stats()
    a = await team_a.generate(prompt, temperature=0.0, max_tokens=8)
    b = await team_b.generate(prompt, temperature=0.0, max_tokens=8)
    other_scope = await team_a.generate(prompt, temperature=0.0, max_tokens=8, cache_scope="x")
    a_again = await team_a.generate(prompt, temperature=0.0, max_tokens=8)
    b_again = await team_b.generate(prompt, temperature=0.0, max_tokens=8)
    after = await admin.stats()
    cached = [r.usage.cached_response for r in (a, b, other_scope, a_again, b_again)]
    assert cached == [False, False, False, True, True]
    assert after.requests_started == before.requests_started + 3
    assert a.text == b.text == other_scope.text == a_again.text == b_again.text


async def test_cache_response_false_opts_out(team_a: AsyncClient, admin: AsyncClient) -> None:
    prompt = "A haiku about rain:"
    before = await admin.stats()
    answers = [
        await team_a.generate(prompt, temperature=0.0, max_tokens=8, cache_response=False)
        for _ in range(2)
    ]
    after = await admin.stats()
    assert [a.usage.cached_response for a in answers] == [False, False]
    assert after.response_cache_entries == before.response_cache_entries
    assert after.requests_started == before.requests_started + 2


async def test_clear_cache_empties_it_and_says_what_it_freed(
    team_a: AsyncClient, admin: AsyncClient
) -> None:
    prompt = "The opposite of hot is"
    await team_a.generate(prompt, temperature=0.0, max_tokens=4)
    held = await admin.stats()
    assert held.response_cache_entries >= 1
    cleared = await admin.clear_cache()
    assert (cleared.freed_response_entries, cleared.freed_response_bytes) == (
        held.response_cache_entries,
        held.response_cache_bytes,
    )
    after = await admin.stats()
    assert (after.response_cache_entries, after.response_cache_bytes) == (0, 0)
    again = await team_a.generate(prompt, temperature=0.0, max_tokens=4)
    assert not again.usage.cached_response
