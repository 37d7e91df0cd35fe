"""Chat sessions sharing a system prompt, driven through the scheduler with the fake runner: each
session keeps its history while slots allow, a new session or a one-off request copies the
shared prefix into a free slot instead of overwriting another session's history, and with more
sessions than slots the least recently used history moves to the RAM tier and comes back whole
(no model)."""

from __future__ import annotations

from llama_grpc_server.core.requests.request import GenerationRequest, Request, StoppingParams
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, PIECES, Clock, drive, outputs

SYSTEM = tuple((i * 7) % 90 + 1 for i in range(200))  # the shared system prompt
ANSWER_TOKENS = 6


def make(n_parallel: int, *, ram_bytes: int = 0, live_s: float = 0.0) -> Scheduler:
    clock = Clock()
    return Scheduler(
        SchedulerLimits(
            n_parallel, 8192, 256, 64, 32, ram_cache_bytes=ram_bytes, session_live_s=live_s
        ),
        pieces=PIECES,
        eog_ids=frozenset(),
        clock_ns=clock.tick_ns,
        monotonic=clock.monotonic,
    )


def question(session: int, turn: int) -> tuple[int, ...]:
    """A user turn: its first token differs between sessions, so only SYSTEM is shared."""
    return (91 + session % 6, *((session * 11 + turn * 5 + i) % 90 + 1 for i in range(9)))


def ask(
    s: Scheduler, runner: FakeRunner, rid: str, prompt: tuple[int, ...], session: str = ""
) -> tuple[Request, list[int]]:
    stopping = StoppingParams(max_tokens=ANSWER_TOKENS)
    request = Request(GenerationRequest(rid, prompt, GREEDY, stopping, session_id=session))
    s.add(request)
    return request, outputs(drive(s, runner))[rid]


def cold(prompt: tuple[int, ...], rid: str) -> list[int]:
    return ask(make(1), FakeRunner(), rid, prompt)[1]


def chat(s: Scheduler, num_sessions: int, num_turns: int) -> list[list[int]]:
    """Sessions take turns (s0, s1, ..., then s0's second turn, ...), each resending its whole
    history and answer; returns, per session, each turn's cached prompt tokens minus what the
    session had computed before that turn (0 = the whole history was reused), after checking
    every answer against a cold run of the same prompt."""
    runner = FakeRunner()
    history = [SYSTEM for _ in range(num_sessions)]
    missed: list[list[int]] = [[] for _ in range(num_sessions)]
    for turn in range(num_turns):
        for n in range(num_sessions):
            prompt = (*history[n], *question(n, turn))
            rid = f"s{n}-t{turn}"
            request, answer = ask(s, runner, rid, prompt, session=f"s{n}")
            assert answer == cold(prompt, rid), rid
            computed_before = len(history[n]) - 1 if turn else len(SYSTEM)
            missed[n].append(computed_before - request.num_cached_prompt)
            history[n] = (*prompt, *answer)
    return missed


def test_sessions_sharing_a_system_prompt_each_keep_their_history() -> None:
    """3 sessions, 4 slots: the first turn of s1 and s2 copies the system prompt from s0's slot
    into a free one, and every later turn reuses its whole history (all of it but the answer's
    last token, which was sampled, never decoded). Before, s1 took s0's slot for its system
    prompt, and every later turn found only the system prompt."""
    s = make(4)
    assert chat(s, 3, 4) == [[200, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert sorted(slot.session_id for slot in s.slots) == ["", "s0", "s1", "s2"]


def test_a_one_off_request_copies_the_shared_prefix_instead_of_evicting_a_session() -> None:
    """Two sessions in two of three slots: a request without a session that shares the system
    prompt takes the free slot (copying the prefix), and both sessions' next turns reuse their
    whole histories."""
    s, runner = make(3), FakeRunner()
    first = {}
    for n in range(2):
        prompt = (*SYSTEM, *question(n, 0))
        first[n] = (*prompt, *ask(s, runner, f"s{n}", prompt, session=f"s{n}")[1])
    one_off, _ = ask(s, runner, "one-off", (*SYSTEM, *question(5, 0)))
    assert one_off.num_cached_prompt == len(SYSTEM)
    assert one_off.slot_id == 2
    for n in range(2):
        again, _ = ask(s, runner, f"s{n}-again", (*first[n], *question(n, 1)), session=f"s{n}")
        assert again.num_cached_prompt == len(first[n]) - 1


def test_with_more_sessions_than_slots_the_ram_tier_brings_each_history_back_whole() -> None:
    """6 sessions, 2 slots, a RAM tier: a session's slot is taken only when no other is idle,
    least recently used first, after its history is saved; every later turn restores that
    history whole and answers exactly as a cold run."""
    s = make(2, ram_bytes=1 << 20)
    assert chat(s, 6, 3) == [[200, 0, 0], [0, 0, 0], [0, 0, 0]] + [[0, 0, 0]] * 3
    assert s.kv.ram is not None
    assert s.kv.ram.hits == 6 * 2, "every later turn was restored from RAM"
    assert s.kv.ram.evictions == 0


def test_without_a_ram_tier_more_sessions_than_slots_evict_least_recently_used() -> None:
    """6 sessions, 2 slots, no RAM tier: a turn finds only the system prompt (copied from a
    slot), never a wrong history; the output stays exact."""
    s = make(2)
    missed = chat(s, 6, 2)
    for n, (first, second) in enumerate(missed):
        assert first == (200 if n == 0 else 0)
        assert second > 0, "histories cannot survive without a tier"


def test_an_idle_session_past_session_live_s_is_fair_game() -> None:
    """A session idle for longer than session_live_s yields its slot like any cache: a new
    session with the same system prompt then takes that slot and keeps the prefix in place,
    where a live one makes it take the empty slot and copy the prefix."""
    for idle_s, expected_slot in ((0.5, 2), (2.0, 0)):
        clock = Clock()
        s = Scheduler(
            SchedulerLimits(3, 8192, 256, 64, 32, session_live_s=1.0),
            pieces=PIECES,
            eog_ids=frozenset(),
            clock_ns=clock.tick_ns,
            monotonic=clock.monotonic,
        )
        runner = FakeRunner()
        ask(s, runner, "a", (*SYSTEM, *question(0, 0)), session="a")
        ask(s, runner, "b", (*SYSTEM, *question(1, 0)), session="b")
        assert [slot.session_id for slot in s.slots] == ["a", "b", ""]
        clock.ns += int(idle_s * 1e9)
        c, _ = ask(s, runner, "c", (*SYSTEM, *question(2, 0)), session="c")
        assert c.slot_id == expected_slot, idle_s
        assert c.num_cached_prompt == len(SYSTEM)
