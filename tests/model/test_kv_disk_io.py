"""The disk tier's reads on its I/O thread with the real model: while a restore's read blocks
(a hung volume), another request is served to the end with its exact greedy output; once the
bytes arrive the restored request generates exactly what it computed before the restart."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from llama_grpc_server.core.kv.disk import KvDiskStore
from llama_grpc_server.engine.loop import EngineLoop

from .conftest import make_engine, request, run

STORY = "The lighthouse keeper counted the ships that passed in the night, one by one. "


def gate_reads(engine: EngineLoop) -> tuple[threading.Event, threading.Event]:
    """Make the engine's disk-tier reads block until the returned gate is set; the second event
    is set once a read has started."""
    disk = engine._scheduler.kv.disk
    assert isinstance(disk, KvDiskStore)
    gate, reading = threading.Event(), threading.Event()
    read_file = disk._read_file

    def blocked(path: Path) -> bytes:
        reading.set()
        assert gate.wait(60), "the test never opened the gate"
        return read_file(path)

    disk._read_file = blocked  # type: ignore[method-assign]
    return gate, reading


async def test_a_blocked_restore_delays_only_itself_and_restores_exactly(tmp_path: Path) -> None:
    options = {"kv_cache_dir": str(tmp_path), "prompt_cache_ram_mb": 0, "session_idle_s": 0.0}
    history = "Disk tier test. " + STORY * 5 + "How many ships?"
    other = "Something else entirely: " + "apples and pears " * 8
    first = make_engine(n_parallel=2, **options)
    try:
        computed = await run(first, request(first, history, max_tokens=16))
        alone = await run(first, request(first, other, max_tokens=16, cache_prompt=False))
    finally:
        first.close()  # writes the idle history to disk
    assert list(tmp_path.glob("*.lgkv"))

    eng = make_engine(n_parallel=2, **options)
    try:
        gate, reading = gate_reads(eng)
        restored_task = asyncio.create_task(run(eng, request(eng, history, max_tokens=16)))
        assert await asyncio.to_thread(reading.wait, 60)
        unrelated = await run(eng, request(eng, other, max_tokens=16, cache_prompt=False))
        assert unrelated.token_ids == alone.token_ids
        stats = eng.stats()
        assert (stats.requests_started, stats.requests_finished) == (1, 1)
        assert stats.queue_depth == 1, "the restoring request waits, holding no slot"
        assert not restored_task.done()

        gate.set()
        restored = await asyncio.wait_for(restored_task, 120)
        n = restored.finished.usage.prompt_tokens
        assert restored.finished.usage.cached_prompt_tokens == n - 1
        assert restored.token_ids == computed.token_ids
        stats = eng.stats()
        assert (stats.disk_cache.hits, stats.disk_cache.read_failures) == (1, 0)  # type: ignore[union-attr]
    finally:
        eng.close()
