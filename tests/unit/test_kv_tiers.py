"""The scheduler with the disk tier: a real KvDiskStore on a temporary directory and the fake
runner (whose saved "state" is its token list): what goes to disk when, restores after a
restart with output identical to a cold run, damaged files recomputed (no model)."""

from __future__ import annotations

from pathlib import Path

from llama_grpc_server.core.plan import SeqOpKind
from llama_grpc_server.core.request import GenerationRequest, Request, StoppingParams
from llama_grpc_server.core.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.kv_disk import SUFFIX, KvDiskStore
from llama_grpc_server.testing import FakeRunner
from tests.unit.test_scheduler import GREEDY, PIECES, Clock, drive, outputs, req

FP = {"model_sha256": "fake", "n_ctx": 4096}


def make(
    path: Path, *, ram_bytes: int = 0, idle_s: float = 0.0, clock: Clock | None = None
) -> tuple[Scheduler, KvDiskStore, FakeRunner]:
    clock = clock or Clock()
    disk = KvDiskStore(path, FP, 1 << 26)
    s = Scheduler(
        SchedulerLimits(1, 4096, 256, 64, 8, ram_cache_bytes=ram_bytes, session_idle_s=idle_s),
        pieces=PIECES,
        eog_ids=frozenset(),
        disk=disk,
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )
    return s, disk, FakeRunner()


def follow_up(first: Request, rid: str = "again", tail: tuple[int, ...] = (5, 6, 7)) -> Request:
    prompt = (*first.tokens[: first.num_computed], *tail)
    return Request(GenerationRequest(rid, prompt, GREEDY, StoppingParams(max_tokens=6)))


def cold(prompt: tuple[int, ...], rid: str = "again") -> list[int]:
    s = Scheduler(SchedulerLimits(1, 4096, 256, 64, 8), pieces=PIECES, eog_ids=frozenset())
    s.add(Request(GenerationRequest(rid, prompt, GREEDY, StoppingParams(max_tokens=6))))
    return outputs(drive(s, FakeRunner()))[rid]


def shut_down_after_one_request(path: Path) -> Request:
    """Serve one 100-token request, then write every idle cache (what shutdown does)."""
    s, disk, runner = make(path)
    first = req("first", 100, 4)
    s.add(first)
    drive(s, runner)
    s.persist_idle(everything=True)
    drive(s, runner)
    disk.close()
    return first


def files(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.suffix == SUFFIX]


def test_an_evicted_cache_goes_to_disk_and_survives_a_restart(tmp_path: Path) -> None:
    """Without a RAM tier, a slot cache an unrelated request evicts is written to disk; a new
    scheduler and store (a restart) restore it for the follow-up, which computes only its new
    tokens and generates exactly what a cold run does."""
    s, disk, runner = make(tmp_path)
    first = req("first", 100, 4)
    s.add(first)
    drive(s, runner)
    s.add(req("unrelated", 90, 4))
    drive(s, runner)
    disk.close()
    assert len(files(tmp_path)) == 1

    s2, disk2, runner2 = make(tmp_path)
    again = follow_up(first)
    s2.add(again)
    got = outputs(drive(s2, runner2))["again"]
    assert got == cold(again.spec.prompt_tokens)
    assert again.num_cached_prompt == first.num_computed
    assert runner2.fed["again"] == 3 + 6 - 1, "only the new tail and decode tokens were fed"
    assert disk2.stats().hits == 1
    assert s2.snapshot(4096).disk_cache == disk2.stats()


def test_what_the_ram_tier_evicts_goes_to_disk(tmp_path: Path) -> None:
    """A RAM tier with room for one saved cache: the second eviction pushes the first saved
    cache out of RAM, onto disk; it comes back from disk."""
    s, disk, runner = make(tmp_path, ram_bytes=600)  # one fake state (~400 bytes) fits
    first = req("first", 100, 4)
    for r in (first, req("second", 110, 4), req("the-third", 120, 4)):
        s.add(r)
        drive(s, runner)
    disk.flush()
    assert s.ram is not None and s.ram.evictions == 1
    assert disk.stats().entries == 1
    again = follow_up(first)
    s.add(again)
    assert outputs(drive(s, runner))["again"] == cold(again.spec.prompt_tokens)
    assert again.num_cached_prompt == first.num_computed
    assert disk.stats().hits == 1


def test_an_idle_session_is_written_once_after_session_idle_s(tmp_path: Path) -> None:
    clock = Clock()
    s, disk, runner = make(tmp_path, idle_s=5.0, clock=clock)
    s.add(req("first", 100, 4))
    drive(s, runner)
    assert s.idle_wait_s() is not None and 4.0 < (s.idle_wait_s() or 0) <= 5.0
    assert not s.persist_idle(), "not idle long enough yet"
    clock.ns += 5_000_000_000
    assert s.idle_wait_s() == 0.0
    assert s.persist_idle()
    drive(s, runner)
    disk.flush()
    assert disk.stats().writes == 1
    assert s.idle_wait_s() is None, "nothing left to write"
    clock.ns += 60_000_000_000
    assert not s.persist_idle()
    plan, _ = s.schedule()
    assert plan is None, "written once, not again"
    assert s.slots[0].idle_cache, "the slot keeps its cache too"


def test_shutdown_writes_every_idle_cache_and_an_evicted_written_one_is_not_saved_again(
    tmp_path: Path,
) -> None:
    s, disk, runner = make(tmp_path)
    first = req("first", 100, 4)
    s.add(first)
    drive(s, runner)
    assert s.persist_idle(everything=True)
    drive(s, runner)
    disk.flush()
    assert disk.stats().writes == 1
    s.add(req("unrelated", 90, 4))
    plan, _ = s.schedule()
    assert plan is not None
    assert [op.kind for op in plan.seq_ops] == [SeqOpKind.REMOVE], "already on disk: no save"


def test_a_damaged_file_is_recomputed_with_correct_output(tmp_path: Path) -> None:
    first = shut_down_after_one_request(tmp_path)
    (f,) = files(tmp_path)
    data = bytearray(f.read_bytes())
    data[-3] ^= 1  # in the state itself: found by the index, caught by the checksum at load
    f.write_bytes(bytes(data))

    s2, disk2, runner2 = make(tmp_path)
    again = follow_up(first)
    s2.add(again)
    assert outputs(drive(s2, runner2))["again"] == cold(again.spec.prompt_tokens)
    assert again.num_cached_prompt == 0
    assert disk2.stats().verify_failures == 1
    assert disk2.stats().misses == 1
    assert not f.exists()


def test_another_scope_does_not_restore_it(tmp_path: Path) -> None:
    first = shut_down_after_one_request(tmp_path)
    s2, disk2, runner2 = make(tmp_path)
    prompt = (*first.tokens[: first.num_computed], 5, 6, 7)
    other = Request(
        GenerationRequest("other", prompt, GREEDY, StoppingParams(max_tokens=6), cache_scope="b")
    )
    s2.add(other)
    drive(s2, runner2)
    assert other.num_cached_prompt == 0
    assert disk2.stats().hits == 0


def test_clear_cache_clears_the_disk_tier(tmp_path: Path) -> None:
    s, disk, runner = make(tmp_path)
    s.add(req("first", 100, 4))
    drive(s, runner)
    s.persist_idle(everything=True)
    drive(s, runner)
    disk.flush()
    size = files(tmp_path)[0].stat().st_size
    cleared = s.clear_cache()
    assert (cleared.freed_disk_entries, cleared.freed_disk_bytes) == (1, size)
    assert not files(tmp_path)
    drive(s, runner)
    assert s.persist_idle(everything=True) is False, "the slot's cache was cleared too"
