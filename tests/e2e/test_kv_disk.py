"""The KV disk tier with real server processes: a conversation survives a restart (SIGTERM, start
again: its history is restored from disk and the greedy answer is exactly the one the server
would have given without the restart); a damaged file or another configuration's file is never
used; a session moving to another replica sharing the directory is restored there. Exact cache
accounting and equal greedy ids, not words: on the tiny synthetic model (nine server starts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from llama_grpc import AsyncClient
from llama_grpc_testkit.models import tiny_model_file
from llama_grpc_testkit.server_process import ServerProcess, server_process
from tests.support.fault_support import Outcome, collect

ARGS = ("--n-ctx", "2048", "--n-parallel", "1", "--grace-s", "10")
HISTORY = (
    "The lighthouse keeper kept a log of every ship that passed the point. In the spring of "
    "that year he counted forty-one schooners, nine steamers and a single paddle boat whose "
    "captain waved a red flag at the tower each morning. The keeper's daughter painted the "
    "ships in watercolour, one page for each, and sold the pages at the harbour market. "
) * 3
FOLLOW_UP = " Question: how many steamers passed? Answer:"


async def turn(client: AsyncClient, token_ids: list[int], n: int = 16) -> Outcome:
    out = await collect(
        client.generate_tokens(token_ids, max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    assert out.error is None and out.done is not None, out.error
    return out


@contextlib.asynccontextmanager
async def replica(*args: str) -> AsyncIterator[tuple[ServerProcess, AsyncClient]]:
    async with (
        server_process("--model", str(tiny_model_file()), *args) as proc,
        AsyncClient(f"127.0.0.1:{proc.port}", timeout=120) as client,
    ):
        yield proc, client


def kv_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.lgkv"))


async def stop(proc: ServerProcess) -> None:
    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait(60) == 0


async def conversation(client: AsyncClient) -> tuple[list[int], list[int]]:
    """(turn 1's prompt, turn 2's prompt = turn 1's history + a follow-up) as token ids."""
    first = await client.tokenize(HISTORY)
    tail = await client.tokenize(FOLLOW_UP, add_special=False)
    answer = await turn(client, first)
    return first, [*first, *answer.token_ids, *tail]


async def test_a_conversation_survives_a_restart_with_the_same_greedy_answer(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "kv"
    async with replica(*ARGS, "--kv-cache-dir", str(cache)) as (proc, client):
        first, second = await conversation(client)
        await stop(proc)  # graceful: every idle slot's cache is written
    assert kv_files(cache), "the idle conversation was saved at shutdown"

    async with replica(*ARGS, "--kv-cache-dir", str(cache)) as (_, client):
        restored = await turn(client, second)
        stats = await client.stats()
    assert restored.done is not None
    # turn 1's prompt and 15 of its 16 answer tokens have KV (the last one was never fed)
    assert restored.done.usage.cached_prompt_tokens == len(first) + 15
    assert stats.disk_cache_hits == 1
    assert stats.disk_cache_verify_failures == 0

    async with replica(*ARGS) as (_, client):  # the same two turns, never restarted
        await turn(client, first)
        warm = await turn(client, second)
    assert warm.done is not None
    assert warm.done.usage.cached_prompt_tokens == restored.done.usage.cached_prompt_tokens
    assert restored.token_ids == warm.token_ids


async def test_damaged_or_foreign_files_are_never_used(tmp_path: Path) -> None:
    """A flipped byte in the saved state: the restarted server warns, deletes the file and
    recomputes, answering exactly as a cold server does. A server with another n_ctx (another
    configuration) sharing the directory neither uses nor deletes the files."""
    cache = tmp_path / "kv"
    async with replica(*ARGS, "--kv-cache-dir", str(cache)) as (proc, client):
        _, second = await conversation(client)
        await stop(proc)
    (saved,) = kv_files(cache)

    other = ("--n-ctx", "4096", "--n-parallel", "1")
    async with replica(*other, "--kv-cache-dir", str(cache)) as (_, client):
        foreign = await turn(client, second)
        stats = await client.stats()
    assert foreign.done is not None and foreign.done.usage.cached_prompt_tokens == 0
    assert stats.disk_cache_verify_failures == 0
    assert saved.exists()

    data = bytearray(saved.read_bytes())
    data[len(data) // 2 + 1000] ^= 0x10  # inside the KV state
    saved.write_bytes(bytes(data))
    async with replica(*ARGS, "--kv-cache-dir", str(cache)) as (proc, client):
        recomputed = await turn(client, second)
        stats = await client.stats()
        warnings = [json.loads(line) for line in proc.lines if "kv_disk_file_rejected" in line]
    assert recomputed.done is not None and recomputed.done.usage.cached_prompt_tokens == 0
    assert stats.disk_cache_verify_failures == 1
    assert len(warnings) == 1 and "checksum" in warnings[0]["reason"]
    assert not saved.exists()

    async with replica(*ARGS) as (_, client):
        cold = await turn(client, second)
    assert recomputed.token_ids == cold.token_ids


async def test_a_session_moving_to_another_replica_is_restored_from_the_shared_directory(
    tmp_path: Path,
) -> None:
    """Two replicas share one directory. Replica 1 serves turn 1 and writes the idle session
    (--session-idle-s 0.5); turn 2 goes to replica 2, which finds the file written after it
    started (its I/O thread indexes new files within a second) and restores it instead of
    recomputing."""
    cache = tmp_path / "kv"
    shared = (*ARGS, "--kv-cache-dir", str(cache), "--session-idle-s", "0.5")
    async with replica(*shared) as (_, c1), replica(*shared) as (_, c2):
        first, second = await conversation(c1)
        for _ in range(100):
            if (await c2.stats()).disk_cache_entries:
                break
            await asyncio.sleep(0.1)
        assert (await c2.stats()).disk_cache_entries == 1
        assert (await c1.stats()).disk_cache_writes == 1
        moved = await turn(c2, second)
        stats = await c2.stats()
    assert moved.done is not None
    assert moved.done.usage.cached_prompt_tokens == len(first) + 15
    assert stats.disk_cache_hits == 1
