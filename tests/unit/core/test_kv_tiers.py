"""The scheduler with the disk tier: a real KvDiskStore on a temporary directory and the fake
runner (whose saved "state" is its token list): what goes to disk when, restores after a
restart with output identical to a cold run, damaged files recomputed; reads on the store's
I/O thread, a blocking one delaying only the requests that wait for it (no model)."""

from __future__ import annotations

import threading
from pathlib import Path

from llama_grpc_server.core.kv.disk import SUFFIX, KvDiskStore
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    RequestState,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.plan import SeqOpKind
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, PIECES, Clock, finals, outputs, req
from tests.support.scheduler import drive as drive_ticks

FP = {"model_sha256": "fake", "n_ctx": 4096}


class GatedStore(KvDiskStore):
    """A disk tier whose file reads block until the test opens the gate (a hung volume), or
    fail with `error`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, FP, 1 << 26)
        self.gate = threading.Event()
        self.reading = threading.Event()  # a read has started (and is blocked)
        self.error: OSError | None = None

    def _read_file(self, path: Path) -> bytes:
        self.reading.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        return super()._read_file(path)


def make(
    path: Path,
    *,
    ram_bytes: int = 0,
    idle_s: float = 0.0,
    clock: Clock | None = None,
    n_parallel: int = 1,
    disk: KvDiskStore | None = None,
) -> tuple[Scheduler, KvDiskStore, FakeRunner]:
    clock = clock or Clock()
    disk = disk or KvDiskStore(path, FP, 1 << 26)
    s = Scheduler(
        SchedulerLimits(
            n_parallel, 4096, 256, 64, 8, ram_cache_bytes=ram_bytes, session_idle_s=idle_s
        ),
        pieces=PIECES,
        eog_ids=frozenset(),
        disk=disk,
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )
    return s, disk, FakeRunner()


def drive(s: Scheduler, runner: FakeRunner, timeout_s: float = 10.0) -> list[tuple[Request, Event]]:
    """Tick until nothing is left, waiting (on the scheduler's wakeup, never a sleep) for the
    disk reads of requests that are RESTORING."""
    woken = threading.Event()
    s.admission.wakeup = woken.set
    out = drive_ticks(s, runner)
    while s.restoring or s.has_work:
        assert woken.wait(timeout_s), "a disk read never came back"
        woken.clear()
        out += drive_ticks(s, runner)
    return out


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
    s.kv.persist_idle(s.clock_ns(), everything=True)
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
    assert s.kv.ram is not None and s.kv.ram.evictions == 1
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
    assert not s.kv.persist_idle(s.clock_ns()), "not idle long enough yet"
    clock.ns += 5_000_000_000
    assert s.idle_wait_s() == 0.0
    assert s.kv.persist_idle(s.clock_ns())
    drive(s, runner)
    disk.flush()
    assert disk.stats().writes == 1
    assert s.idle_wait_s() is None, "nothing left to write"
    clock.ns += 60_000_000_000
    assert not s.kv.persist_idle(s.clock_ns())
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
    assert s.kv.persist_idle(s.clock_ns(), everything=True)
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
    s.kv.persist_idle(s.clock_ns(), everything=True)
    drive(s, runner)
    disk.flush()
    size = files(tmp_path)[0].stat().st_size
    cleared = s.kv.clear_idle()
    assert (cleared.freed_disk_entries, cleared.freed_disk_bytes) == (1, size)
    assert not files(tmp_path)
    drive(s, runner)
    cleared_too = not s.kv.persist_idle(s.clock_ns(), everything=True)
    assert cleared_too, "the slot's cache was cleared too"


def blocked_follow_up(
    tmp_path: Path, clock: Clock | None = None, deadline: float | None = None
) -> tuple[Scheduler, GatedStore, FakeRunner, Request, Request]:
    """A restarted server (2 slots) whose disk reads block: the follow-up of a saved history
    waits for its read (RESTORING) while an unrelated request is served."""
    first = shut_down_after_one_request(tmp_path)
    disk = GatedStore(tmp_path)
    s, _, runner = make(tmp_path, n_parallel=2, disk=disk, clock=clock)
    prompt = (*first.tokens[: first.num_computed], 5, 6, 7)
    again = Request(
        GenerationRequest("again", prompt, GREEDY, StoppingParams(max_tokens=6), deadline=deadline)
    )
    s.add(again)
    s.add(req("unrelated", 90, 5))
    return s, disk, runner, again, first


def test_a_blocked_disk_read_delays_only_the_request_waiting_for_it(tmp_path: Path) -> None:
    """The follow-up's read blocks on the I/O thread; the engine thread never waits for it: the
    unrelated request is served to the end meanwhile (exact output), the follow-up holds no slot
    and gets nothing. Once the read comes back it restores the state and generates exactly what a
    cold run does, computing only its new tokens."""
    s, disk, runner, again, first = blocked_follow_up(tmp_path)
    events = drive_ticks(s, runner)  # returns once nothing is left but the read
    assert disk.reading.wait(10)
    assert outputs(events) == {"unrelated": alone_output(req("unrelated", 90, 5))}
    assert finals(events).keys() == {"unrelated"}
    assert s.restoring == {"again": again} and again.state is RequestState.RESTORING
    assert again.slot_id == -1 and not s.has_work, "the engine may sleep: nothing to tick"
    assert s.snapshot(4096).queue_depth == 1
    assert s.counters.started == 1, "the follow-up is not admitted until its bytes arrive"

    disk.gate.set()
    events = drive(s, runner)
    assert outputs(events)["again"] == cold(again.spec.prompt_tokens)
    assert isinstance(finals(events)["again"], Finished)
    assert again.num_cached_prompt == first.num_computed
    assert runner.fed["again"] == 3 + 6 - 1
    # the miss is the unrelated request's lookup
    assert (disk.stats().hits, disk.stats().misses, disk.stats().read_failures) == (1, 1, 0)
    assert not s.restoring


def test_a_request_cancelled_while_restoring_ends_cancelled_and_its_bytes_are_dropped(
    tmp_path: Path,
) -> None:
    s, disk, runner, _, _ = blocked_follow_up(tmp_path)
    drive_ticks(s, runner)
    assert disk.reading.wait(10)
    (event,) = [e for r, e in s.cancel("again") if r.request_id == "again"]
    assert isinstance(event, Failed) and event.error.code == "CANCELLED"
    assert not s.restoring and s.counters.cancelled == 1

    woken = threading.Event()
    s.admission.wakeup = woken.set
    disk.gate.set()
    assert woken.wait(10), "the late read still comes back"
    plans = len(runner.plans)
    assert drive_ticks(s, runner) == [], "its answer is dropped: no event, no placement"
    assert all(op.kind is not SeqOpKind.RESTORE for p in runner.plans[plans:] for op in p.seq_ops)
    assert all(slot.is_idle for slot in s.slots)
    assert s.counters.started == 1


def test_a_request_whose_deadline_passes_while_restoring_ends_deadline_exceeded(
    tmp_path: Path,
) -> None:
    clock = Clock()
    s, disk, runner, _, _ = blocked_follow_up(tmp_path, clock, deadline=5.0)
    drive_ticks(s, runner)
    assert disk.reading.wait(10)
    assert s.idle_wait_s() == 5.0, "the sleeping engine wakes for the deadline"
    assert not s.has_work
    clock.s = 5.0
    assert s.has_work
    events = drive_ticks(s, runner)
    (event,) = [e for r, e in events if r.request_id == "again"]
    assert isinstance(event, Failed) and event.error.code == "DEADLINE_EXCEEDED"
    assert "disk tier" in event.error.message
    assert not s.restoring
    assert (s.counters.deadline_exceeded, s.counters.failed) == (1, 0)
    disk.gate.set()
    disk.close()
    assert drive(s, runner) == []


def test_a_read_that_fails_falls_back_to_computing_the_prompt(tmp_path: Path) -> None:
    s, disk, runner, again, _ = blocked_follow_up(tmp_path)
    assert isinstance(disk, GatedStore)
    disk.error = OSError(5, "Input/output error")
    disk.gate.set()
    events = drive(s, runner)
    assert outputs(events)["again"] == cold(again.spec.prompt_tokens)
    assert again.num_cached_prompt == 0
    assert runner.fed["again"] == len(again.spec.prompt_tokens) + 6 - 1
    stats = disk.stats()
    # misses: the follow-up's and the unrelated request's
    assert (stats.hits, stats.misses, stats.read_failures, stats.verify_failures) == (0, 2, 1, 1)


def alone_output(request: Request) -> list[int]:
    s = Scheduler(SchedulerLimits(1, 4096, 256, 64, 8), pieces=PIECES, eog_ids=frozenset())
    s.add(request)
    return outputs(drive_ticks(s, FakeRunner()))[request.request_id]
