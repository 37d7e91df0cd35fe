"""The KV disk tier's store (kv_disk.KvDiskStore) on a real directory: the file format and its
checks, prefix lookup, scopes, the byte budget, atomic writes from two processes (no model)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from llama_grpc_server.core.kv import disk as kv_disk
from llama_grpc_server.core.kv.disk import BLOCK_TOKENS, KvDiskStore
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.testing import FakeRunner, FakeVocabulary, fake_model_info
from tests.support.scheduler import PIECES

FP = {"model_sha256": "ab" * 32, "n_ctx": 4096, "type_k": 1}
MB = 1 << 20


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 262144 for i in range(n)]


def blob(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 256 for i in range(n))


def store(path: Path, fp: dict[str, object] | None = None, max_bytes: int = 64 * MB) -> KvDiskStore:
    return KvDiskStore(path, fp or FP, max_bytes)


def saved(path: Path, scope: str, toks: list[int], data: bytes) -> KvDiskStore:
    s = store(path)
    s.put(scope, toks, data)
    s.flush()
    return s


def only_file(path: Path) -> Path:
    (f,) = [p for p in path.iterdir() if p.suffix == kv_disk.SUFFIX]
    return f


def test_a_saved_state_is_found_by_prefix_after_a_restart(tmp_path: Path) -> None:
    """A new store (a restarted server) indexes the file from the directory; a prompt sharing
    300 of its tokens gets exactly those back, with the blob, verified."""
    history, data = tokens(400), blob(5000)
    saved(tmp_path, "", history, data).close()
    fresh = store(tmp_path)
    assert fresh.stats().entries == 1
    key, n = fresh.lookup("", [*history[:300], 5, 6, 7])
    assert n == 300
    loaded = fresh.load(key, "")
    assert loaded == (history, data)
    assert fresh.stats().hits == 1
    # the whole history asked again: all but its last token (whose logits must be computed)
    assert fresh.lookup("", history)[1] == len(history) - 1


def test_less_than_one_block_in_common_finds_nothing(tmp_path: Path) -> None:
    s = saved(tmp_path, "", tokens(400), blob(100))
    assert s.lookup("", [*tokens(BLOCK_TOKENS - 1), 999_999]) == ("", 0)
    assert s.lookup("", tokens(400, seed=3)) == ("", 0)


def test_the_longest_of_several_files_wins(tmp_path: Path) -> None:
    """Two conversations share a system prompt; each follow-up finds its own conversation."""
    system = tokens(200)
    a, b = [*system, *tokens(150, seed=1)], [*system, *tokens(150, seed=2)]
    s = store(tmp_path)
    s.put("", a, blob(100, 1))
    s.put("", b, blob(100, 2))
    s.flush()
    key, n = s.lookup("", [*b, 42])
    assert n == len(b)
    assert s.load(key, "") == (b, blob(100, 2))
    key, n = s.lookup("", [*system, 1, 2, 3])
    assert n == len(system), "a new session with the known system prompt restores it"


def test_one_scope_never_reaches_another_scopes_file(tmp_path: Path) -> None:
    history = tokens(300)
    s = saved(tmp_path, "tenant-a", history, blob(100))
    assert s.lookup("tenant-b", history) == ("", 0)
    assert s.lookup("", history) == ("", 0)
    key, n = s.lookup("tenant-a", history)
    assert n == len(history) - 1
    assert s.load(key, "tenant-b") is None
    assert s.load(key, "tenant-a") is not None


@pytest.mark.parametrize(
    ("where", "damage"),
    [
        ("truncated", lambda size: None),
        ("header", lambda size: 20),
        ("tokens", lambda size: size - 2000 - 100),
        ("blob", lambda size: size - 10),
        ("magic", lambda size: 0),
    ],
)
def test_a_damaged_file_is_skipped_warned_about_and_deleted(
    tmp_path: Path, where: str, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Truncation or one flipped byte anywhere: never loaded, counted, the file is gone."""
    history = tokens(500)
    saved(tmp_path, "", history, blob(2000)).close()
    f = only_file(tmp_path)
    data = bytearray(f.read_bytes())
    if where == "truncated":
        data = data[: len(data) - 1000]
    else:
        at = damage(len(data))  # type: ignore[operator]
        data[at] ^= 0x40
    f.write_bytes(bytes(data))
    fresh = store(tmp_path)
    key, _ = fresh.lookup("", history)
    if key:  # only the blob's checksum is read at load time, not at indexing
        assert where == "blob"
        assert fresh.load(key, "") is None
    assert fresh.stats().verify_failures == 1
    assert fresh.stats().entries == 0
    assert not f.exists()
    assert fresh.lookup("", history) == ("", 0)


def test_another_configurations_files_are_ignored_and_kept(tmp_path: Path) -> None:
    """A replica of another model (or n_ctx) sharing the directory neither uses nor deletes
    this one's files; a file claiming its fingerprint by name without matching is rejected."""
    history = tokens(300)
    saved(tmp_path, "", history, blob(100)).close()
    f = only_file(tmp_path)
    other_fp = {**FP, "n_ctx": 8192}
    other = store(tmp_path, other_fp)
    assert other.lookup("", history) == ("", 0)
    assert other.stats().verify_failures == 0
    assert f.exists()
    impostor = tmp_path / f"{kv_disk.fingerprint_tag(other_fp)}-{'0' * 32}{kv_disk.SUFFIX}"
    impostor.write_bytes(f.read_bytes())
    other.refresh()
    assert other.lookup("", history) == ("", 0)
    assert other.stats().verify_failures == 1
    assert not impostor.exists()
    assert f.exists()


def test_a_longer_save_supersedes_its_prefix(tmp_path: Path) -> None:
    history = tokens(400)
    s = store(tmp_path)
    s.put("", history[:200], blob(100, 1))
    s.flush()
    s.put("", history, blob(100, 2))
    s.flush()
    assert s.stats().entries == 1
    key, n = s.lookup("", history[:200])
    assert n == 199
    assert s.load(key, "") == (history, blob(100, 2))


def test_the_same_state_saved_twice_is_one_file(tmp_path: Path) -> None:
    s = store(tmp_path)
    for _ in range(3):
        s.put("", tokens(300), blob(100))
    s.flush()
    assert s.stats().entries == 1
    assert s.stats().writes == 1


def test_the_byte_budget_holds_under_churn_and_keeps_the_recent(tmp_path: Path) -> None:
    """60 different histories of ~20 KB each into a 200 KB budget: the directory never holds
    more, the newest files stay, evictions are counted."""
    s = store(tmp_path, max_bytes=200_000)
    for i in range(60):
        s.put("", tokens(300, seed=i), blob(20_000, i))
        if i % 10 == 9:
            s.flush()
            on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
            assert on_disk <= 200_000
    s.flush()
    st = s.stats()
    assert st.bytes <= 200_000
    assert st.evictions == 60 - st.entries
    assert st.entries >= 8
    assert s.lookup("", tokens(300, seed=59))[1] == 299
    assert s.lookup("", tokens(300, seed=0)) == ("", 0)


def test_a_state_larger_than_the_budget_is_not_written(tmp_path: Path) -> None:
    s = store(tmp_path, max_bytes=10_000)
    s.put("", tokens(300), blob(20_000))
    s.flush()
    assert s.stats().entries == 0
    assert not list(tmp_path.iterdir())


def test_clear_deletes_this_configurations_files_and_queued_writes(tmp_path: Path) -> None:
    s = saved(tmp_path, "", tokens(300), blob(1000))
    size = only_file(tmp_path).stat().st_size
    other = saved(tmp_path / "x", "", tokens(300), blob(1000))  # another directory: untouched
    assert s.clear() == (1, size)
    assert s.stats().entries == 0
    assert s.lookup("", tokens(300)) == ("", 0)
    assert not [p for p in tmp_path.iterdir() if p.is_file()]
    assert other.stats().entries == 1


def test_a_crashed_writers_temp_file_is_removed_and_never_indexed(tmp_path: Path) -> None:
    stale = tmp_path / ".x.lgkv.1.2.tmp"
    fresh = tmp_path / ".y.lgkv.3.4.tmp"
    for f in (stale, fresh):
        f.write_bytes(b"partial")
    old = time.time() - 2 * kv_disk.STALE_TEMP_S
    os.utime(stale, (old, old))
    s = store(tmp_path)
    assert not stale.exists()
    assert fresh.exists(), "a live writer's file is left alone"
    assert s.stats().entries == 0
    assert s.stats().verify_failures == 0


def test_a_write_that_fails_is_logged_and_the_store_goes_on(tmp_path: Path) -> None:
    """The directory vanishes under the server (a file in its place): the save is lost, the
    writer thread survives, and saves work again once the directory is back."""
    cache = tmp_path / "cache"
    s = store(cache)
    cache.rmdir()
    cache.write_text("not a directory")
    s.put("", tokens(300), blob(100))
    s.flush()
    assert s.stats().entries == 0
    cache.unlink()
    cache.mkdir()
    s.put("", tokens(300), blob(100))
    s.flush()
    assert s.stats().entries == 1


def _writer(path: str, worker: int, n: int) -> None:
    s = KvDiskStore(path, FP, 64 * MB)
    for i in range(n):
        # every other history is the same in both processes: the same file name, written twice
        seed = i if i % 2 == 0 else 1000 * worker + i
        s.put("", tokens(300, seed=seed), blob(30_000, seed))
    s.close()


def test_two_processes_writing_one_directory_never_corrupt_it(tmp_path: Path) -> None:
    """Two writer processes save 30 states each (half of them identical) while this process
    keeps re-indexing the directory: it never sees a file that fails verification, and in the
    end every state is there exactly once with its own blob."""
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), w, 30)) for w in (1, 2)]
    for p in workers:
        p.start()
    reader = store(tmp_path)
    while any(p.is_alive() for p in workers):
        reader.refresh()
        time.sleep(0.005)
    for p in workers:
        p.join()
        assert p.exitcode == 0
    reader.refresh()
    final = store(tmp_path)
    assert reader.stats().verify_failures == 0
    assert final.stats().verify_failures == 0
    assert final.stats().entries == 15 + 15 + 15
    for seed in (0, 2, 1001, 2001, 2029):
        key, n = final.lookup("", tokens(300, seed=seed))
        assert n == 299
        assert final.load(key, "") == (tokens(300, seed=seed), blob(30_000, seed))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_directory_that_vanishes_is_a_miss_not_an_error(tmp_path: Path) -> None:
    """Lookups run on the engine thread: the directory removed under a running server (or a
    volume gone) makes them find nothing instead of raising."""
    cache = tmp_path / "cache"
    s = saved(cache, "", tokens(300), blob(100))
    for f in cache.iterdir():
        f.unlink()
    cache.rmdir()
    key, _ = s.lookup("", tokens(300))  # still indexed: found, but not loadable
    assert s.load(key, "") is None
    assert s.lookup("", tokens(300)) == ("", 0)
    assert s.stats().verify_failures == 0, "a vanished file is a miss, not a bad file"


def test_a_failed_write_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    """A write that raises (the directory replaced by a file: what a gone or read-only volume
    looks like, even to root) counts one write failure and no write; once the directory is back
    the writer thread still saves."""
    directory = tmp_path / "kv"
    s = store(directory)
    directory.rmdir()
    directory.write_bytes(b"not a directory")
    s.put("", tokens(2 * BLOCK_TOKENS), blob(1000))
    s.flush()
    assert (s.stats().write_failures, s.stats().writes) == (1, 0)
    directory.unlink()
    directory.mkdir()
    s.put("", tokens(2 * BLOCK_TOKENS, seed=1), blob(1000, seed=1))
    s.flush()
    assert (s.stats().write_failures, s.stats().writes) == (1, 1)
    s.close()


async def test_engine_stats_show_a_write_that_failed_after_the_last_tick(tmp_path: Path) -> None:
    """An idle engine does not tick, but its disk tier's writer goes on (an idle session's
    save): EngineLoop.stats() (GetStats, /metrics) reads the tier's own figures, so a write
    that failed after the last tick shows at once."""
    directory = tmp_path / "kv"
    disk = store(directory)
    engine = EngineLoop(
        Scheduler(
            SchedulerLimits(1, 512, 64, 16, 8), pieces=PIECES, eog_ids=frozenset(), disk=disk
        ),
        FakeRunner(),
        fake_model_info(),
        tokenizer=FakeVocabulary(),
        kv_cells_total=512,
    )
    try:
        directory.rmdir()
        directory.write_bytes(b"not a directory")
        disk.put("", tokens(2 * BLOCK_TOKENS), blob(1000))
        disk.flush()
        got = engine.stats().disk_cache
        assert got is not None and (got.write_failures, got.writes) == (1, 0)
    finally:
        await asyncio.to_thread(engine.close)
        disk.close()
