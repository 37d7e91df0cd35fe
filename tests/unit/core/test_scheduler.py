"""Scheduler driven by a fake runner: admission, queue bound, deadlines, cancellation,
preemption with identical output, plan invariants (no model)."""

from __future__ import annotations

import pytest

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import (
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Request,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.plan import SeqOpKind
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.core.scheduling.strategies import PrefillPriority
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import GREEDY, PIECES, Clock, alone, drive, finals, make, outputs, req


def test_all_requests_finish_with_exact_token_counts() -> None:
    """More requests than slots: all finish with max_tokens tokens, queue FIFO."""
    s, runner = make(n_parallel=2), FakeRunner()
    for i in range(5):
        s.add(req(f"r{i}", 20 + i, 6 + i))
    events = drive(s, runner)
    done = finals(events)
    assert all(isinstance(done[f"r{i}"], Finished) for i in range(5))
    assert {rid: len(toks) for rid, toks in outputs(events).items()} == {
        f"r{i}": 6 + i for i in range(5)
    }
    assert not runner.samplers, "every sampler is closed"


def test_batched_output_equals_alone() -> None:
    """A request's tokens do not depend on what else shares the batch."""
    s, runner = make(n_parallel=3), FakeRunner()
    for i in range(3):
        s.add(req(f"r{i}", 30 + 7 * i, 10))
    got = outputs(drive(s, runner))
    assert got["r1"] == alone(37, 10, "r1")


def test_prompt_too_long_rejected_with_numbers() -> None:
    """prompt + max_tokens beyond n_ctx is rejected at once, both numbers in the message."""
    s = make(n_ctx=100)
    with pytest.raises(errors.PromptTooLong, match=r"prompt \(90 tokens\) \+ max_tokens \(20\)"):
        s.add(req("big", 90, 20))
    assert s.counters.rejected == 1 and not s.queue


def test_queue_bound_answers_overloaded_with_retry() -> None:
    """With all slots busy, max_queue waiting requests fill the queue; the next is Overloaded."""
    s = make(n_parallel=1, max_queue=2)
    s.add(req("a"))
    s.schedule()  # a takes the slot
    s.add(req("b"))
    s.add(req("c"))
    with pytest.raises(errors.Overloaded) as info:
        s.add(req("d"))
    assert info.value.retry_after_s is not None


def test_queued_request_past_deadline_is_dropped_before_work() -> None:
    """A queued request whose deadline passed fails with DeadlineExceeded and is never fed."""
    clock = Clock()
    s, runner = make(n_parallel=1, clock=clock), FakeRunner()
    s.add(req("a", max_tokens=20))
    late = Request(GenerationRequest("late", (1, 2, 3), GREEDY, StoppingParams(4), deadline=5.0))
    s.add(late)

    def advance(tick: int) -> None:
        if tick == 2:
            clock.s = 10.0

    events = drive(s, runner, between=advance)
    assert isinstance(finals(events)["late"], Failed)
    assert isinstance(finals(events)["late"].error, errors.DeadlineExceeded)  # type: ignore[union-attr]
    assert runner.fed["late"] == 0


def test_cancel_frees_slot_at_next_tick() -> None:
    """After cancel, the request is never fed again, its sampler closes and its slot is reused."""
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", max_tokens=100))
    s.add(req("b", max_tokens=3))
    for _ in range(5):
        plan, _ = s.schedule()
        assert plan is not None
        s.update(plan, runner.execute(plan))
    fed_before = runner.fed["a"]
    cancelled = s.cancel("a")
    assert isinstance(cancelled[0][1], Failed)
    events = drive(s, runner)
    assert runner.fed["a"] == fed_before
    assert isinstance(finals(events)["b"], Finished)
    assert "a" not in runner.samplers
    assert s.counters.cancelled == 1


def test_cancel_for_a_passed_deadline_is_deadline_exceeded() -> None:
    """A cancel because the caller's deadline passed (grpc ended the call) ends the request with
    DeadlineExceeded and counts it as such, not as cancelled or failed; queued or running."""
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("running", max_tokens=100))
    s.add(req("queued", max_tokens=100))
    plan, _ = s.schedule()
    assert plan is not None
    s.update(plan, runner.execute(plan))
    ended = s.cancel("queued", deadline_exceeded=True) + s.cancel("running", deadline_exceeded=True)
    assert [(r.request_id, type(e.error)) for r, e in ended if isinstance(e, Failed)] == [
        ("queued", errors.DeadlineExceeded),
        ("running", errors.DeadlineExceeded),
    ]
    c = s.counters
    assert (c.deadline_exceeded, c.cancelled, c.failed) == (2, 0, 0)
    assert s.snapshot(64).requests_deadline_exceeded == 2


def test_prefill_is_chunked() -> None:
    """A 100-token prompt with chunk_size 16 is fed in chunks of at most 16."""
    s, runner = make(n_parallel=1, chunk=16), FakeRunner()
    s.add(req("a", 100, 2))
    drive(s, runner)
    sizes = [len(c.tokens) for p in runner.plans for c in p.chunks]
    assert max(sizes) == 16 and sum(sizes) == 100 + 1  # prompt + one decode token


RIDS = ("a", "bb", "ccc", "dddd")


def _first_token_pass(chunk: int, max_tokens: int = 1) -> tuple[dict[str, int], int]:
    """Four 64-token prompts arriving together in passes of 64 tokens: the pass (1-based) that
    gave each its first token, and the passes in all."""
    s, runner = make(n_parallel=4, n_batch=64, chunk=chunk), FakeRunner()
    for rid in RIDS:  # ids of different lengths: prompts with no common prefix (req)
        s.add(req(rid, 64, max_tokens))
    first: dict[str, int] = {}
    passes = 0
    while s.has_work:
        plan, _ = s.schedule()
        if plan is None or not plan.chunks:
            continue
        passes += 1
        for request, event in s.update(plan, runner.execute(plan)):
            if isinstance(event, TokenDelta):
                first.setdefault(request.request_id, passes)
    return first, passes


def test_prompts_sharing_passes_finish_one_after_another() -> None:
    """Oldest first, each taking what it needs: the first prompt's first token after one pass,
    the next after two... (mean 2.5 passes); capped at 16 tokens a prompt, round robin as
    before, all four wait for the fourth pass. The same number of passes either way."""
    whole, passes = _first_token_pass(chunk=64)
    capped, capped_passes = _first_token_pass(chunk=16)
    assert whole == {"a": 1, "bb": 2, "ccc": 3, "dddd": 4}
    assert capped == dict.fromkeys(RIDS, 4)
    assert passes == capped_passes == 4


def test_a_generating_slot_waits_a_pass_for_a_prompt_to_finish() -> None:
    """With answers of 2 tokens the first prompt generates while the others prefill: its row
    waits (at most MAX_DECODE_WAIT_TICKS passes) so that each pass-sized prompt finishes in
    its pass instead of spilling one token into the next; the fourth finds the first's row
    due (it waited three passes) and spills. Round robin: all four in the fourth pass."""
    whole, passes = _first_token_pass(chunk=64, max_tokens=2)
    capped, capped_passes = _first_token_pass(chunk=16, max_tokens=2)
    assert whole == {"a": 1, "bb": 2, "ccc": 3, "dddd": 5}
    assert capped == dict.fromkeys(RIDS, 4)
    assert (passes, capped_passes) == (6, 5)


def test_stop_token_and_eos_reasons() -> None:
    """An EOG token ends with EOS, a stop token with STOP_TOKEN; neither is emitted."""
    first = alone(20, 5, "a")[0]
    s, runner = make(n_parallel=1, eog=frozenset({first})), FakeRunner()
    s.add(req("a", 20, 5))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.EOS
    assert done.matched_token_id == first and done.usage.completion_tokens == 0
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 20, 5, stop_token_ids=frozenset({first})))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.STOP_TOKEN


def test_ignore_eos_keeps_generating() -> None:
    """ignore_eos: EOG tokens are generated like any other until max_tokens."""
    first = alone(20, 5, "a")[0]
    s, runner = make(n_parallel=1, eog=frozenset({first})), FakeRunner()
    s.add(req("a", 20, 5, ignore_eos=True))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.MAX_TOKENS


def test_stop_string_cuts_text() -> None:
    """A stop string spanning tokens ends generation; text stops before it."""
    toks = alone(20, 6, "a")
    stop = PIECES[toks[2]].decode() + PIECES[toks[3]].decode()[:2]
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 20, 6, stop=(stop,)))
    events = drive(s, runner)
    text = "".join(e.text for _, e in events if isinstance(e, TokenDelta))
    done = finals(events)["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.STOP_SEQUENCE
    assert done.matched_stop == stop
    assert text == PIECES[toks[0]].decode() + PIECES[toks[1]].decode()


def test_time_limit() -> None:
    """time_limit_ms ends generation with TIME_LIMIT (the fake clock moves 1 ms per read)."""
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a", 20, 400, time_limit_ms=30))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Finished) and done.reason is FinishReason.TIME_LIMIT
    assert 0 < done.usage.completion_tokens < 400


def test_kv_pressure_drops_idle_cache_then_preempts_and_resumes_identically() -> None:
    """Under KV pressure, idle caches go first, then the youngest request is preempted and
    resumed; every request still produces exactly its solo output."""
    expected = {f"r{i}": alone(40, 30, f"r{i}") for i in range(3)}
    s, runner = make(n_parallel=3, n_ctx=512, n_batch=64), FakeRunner(kv_cells=150)
    for i in range(3):
        s.add(req(f"r{i}", 40, 30))
    events = drive(s, runner)
    assert s.counters.preemptions >= 1
    assert all(isinstance(e, Finished) for e in finals(events).values())
    assert outputs(events) == expected


def test_request_that_alone_cannot_fit_fails_with_numbers() -> None:
    """If the only running request cannot fit the KV cache, it fails with KvCacheFull."""
    s, runner = make(n_parallel=1), FakeRunner(kv_cells=30)
    s.add(req("a", 40, 5))
    done = finals(drive(s, runner))["a"]
    assert isinstance(done, Failed) and isinstance(done.error, errors.KvCacheFull)


def test_decode_error_fails_only_that_batch() -> None:
    """A negative llama_decode status fails the batch's requests; later requests still run."""
    s, runner = make(n_parallel=1), FakeRunner()
    s.add(req("a"))
    plan, _ = s.schedule()
    assert plan is not None
    runner.execute(plan)
    from llama_grpc_server.core.scheduling.plan import StepResult

    events = s.update(plan, StepResult(status=-3))
    assert isinstance(events[0][1], Failed)
    assert isinstance(events[0][1].error, errors.EngineError)
    s.add(req("b"))
    assert isinstance(finals(drive(s, runner))["b"], Finished)


def test_repeated_prompt_reuses_prefix() -> None:
    """The same prompt again reuses all but the last token from the idle slot's cache; a prompt
    that differs from its first token reuses nothing."""
    s, runner = make(n_parallel=1), FakeRunner()
    first = req("a", 50, 4)
    s.add(first)
    drive(s, runner)
    prompt = first.spec.prompt_tokens
    s.add(Request(GenerationRequest("again", prompt, GREEDY, StoppingParams(4))))
    again = finals(drive(s, runner))["again"]
    assert isinstance(again, Finished) and again.usage.cached_prompt_tokens == 49
    other = req("bb", 50, 4)  # req() derives the tokens from len(rid)
    assert other.spec.prompt_tokens[0] != prompt[0]
    s.add(other)
    done = finals(drive(s, runner))["bb"]
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens == 0


def test_cross_slot_copy_uses_seq_cp() -> None:
    """A request sharing a prefix with a busy slot copies it instead of recomputing."""
    s, runner = make(n_parallel=2, chunk=64), FakeRunner()
    shared = tuple(range(1, 41))
    s.add(Request(GenerationRequest("a", (*shared, 50), GREEDY, StoppingParams(20))))
    for _ in range(3):
        plan, _ = s.schedule()
        assert plan is not None
        s.update(plan, runner.execute(plan))
    s.add(Request(GenerationRequest("b", (*shared, 60, 61), GREEDY, StoppingParams(3))))
    plan, _ = s.schedule()
    assert plan is not None
    assert any(op.kind is SeqOpKind.COPY and op.p1 == 40 for op in plan.seq_ops)
    s.update(plan, runner.execute(plan))
    done = finals(drive(s, runner))["b"]
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens == 40


def test_cache_scopes_never_share() -> None:
    """A request in another cache scope reuses nothing, even with an identical prompt."""
    s, runner = make(n_parallel=1), FakeRunner()
    prompt = tuple(range(1, 31))
    s.add(Request(GenerationRequest("a", prompt, GREEDY, StoppingParams(2), cache_scope="t1")))
    drive(s, runner)
    s.add(Request(GenerationRequest("b", prompt, GREEDY, StoppingParams(2), cache_scope="t2")))
    done = finals(drive(s, runner))["b"]
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens == 0


def test_every_plan_respects_budget_under_prefill_priority() -> None:
    """Plans never exceed n_batch and decoders keep getting tokens under prefill_priority."""
    s, runner = make(n_parallel=4, n_batch=24, chunk=16, strategy=PrefillPriority()), FakeRunner()
    s.add(req("short", 5, 40))
    for i in range(3):
        s.add(req(f"long{i}", 200, 2))
    drive(s, runner)
    assert all(p.num_tokens <= 24 for p in runner.plans)
    gaps, last = [], None
    for p in runner.plans:
        if any(c.request_id == "short" and c.is_decode for c in p.chunks):
            if last is not None:
                gaps.append(p.tick - last)
            last = p.tick
    assert gaps and max(gaps) <= 4


def test_requests_arriving_together_prefill_shared_prefix_once() -> None:
    """Four requests with one long shared system prompt: it is computed once and copied."""
    s, runner = make(n_parallel=4, n_batch=512, chunk=64), FakeRunner()
    system = tuple(range(1, 201))
    for i in range(4):
        s.add(Request(GenerationRequest(f"q{i}", (*system, 300 + i), GREEDY, StoppingParams(3))))
    events = drive(s, runner)
    done = finals(events)
    assert all(isinstance(e, Finished) for e in done.values())
    fed_total = sum(runner.fed.values())
    # 200 shared tokens once + 4 distinct last tokens + 4 * 2 decode tokens
    assert fed_total == 200 + 4 + 4 * 2
    cached = sorted(e.usage.cached_prompt_tokens for e in done.values())  # type: ignore[union-attr]
    assert cached == [0, 200, 200, 200]


def test_waiting_request_recovers_when_donor_is_cancelled() -> None:
    """If the slot it waits for is cancelled, the waiting request computes on its own."""
    s, runner = make(n_parallel=2, n_batch=512, chunk=16), FakeRunner()
    system = tuple(range(1, 101))
    s.add(Request(GenerationRequest("a", (*system, 7), GREEDY, StoppingParams(50))))
    s.add(Request(GenerationRequest("b", (*system, 8), GREEDY, StoppingParams(3))))
    plan, _ = s.schedule()
    assert plan is not None
    s.update(plan, runner.execute(plan))
    s.cancel("a")
    done = finals(drive(s, runner))["b"]
    assert isinstance(done, Finished) and done.usage.completion_tokens == 3


def test_ram_tier_saves_evicted_cache_and_restores_it() -> None:
    """With one slot, an unrelated request evicts a long cache; the RAM tier saves it first and a
    later request with that prefix restores it instead of recomputing, with identical output."""
    s = make(n_parallel=1, ram_cache_bytes=1 << 20)
    s_cold = make(n_parallel=1)
    runner, cold_runner = FakeRunner(), FakeRunner()
    first, other = req("first", 100, 4), req("unrelated", 90, 4)
    s.add(first)
    drive(s, runner)
    s.add(other)
    drive(s, runner)
    assert s.kv.ram is not None and s.kv.ram.num_entries == 1
    prompt = (*first.spec.prompt_tokens, 5, 6, 7)
    again = Request(GenerationRequest("again", prompt, GREEDY, StoppingParams(max_tokens=6)))
    s.add(again)
    got = outputs(drive(s, runner))["again"]
    s_cold.add(Request(GenerationRequest("again", prompt, GREEDY, StoppingParams(max_tokens=6))))
    assert got == outputs(drive(s_cold, cold_runner))["again"]
    assert s.kv.ram.hits == 1
    assert again.num_cached_prompt == 100
    assert runner.fed["again"] == 3 + 6 - 1, "only the new tail and decode tokens were fed"


def test_queued_request_of_idle_session_goes_first() -> None:
    """With the only idle slot holding session "s", a later-queued request of that session is
    admitted before an earlier unrelated one, and reuses the session's cache."""
    s, runner = make(n_parallel=2), FakeRunner()
    first = Request(GenerationRequest("s1", tuple(range(1, 41)), GREEDY, StoppingParams(4), "s"))
    s.add(first)
    drive(s, runner)
    s.add(req("long", 30, 40))
    plan, _ = s.schedule()  # "long" takes the never-used slot
    assert plan is not None
    s.update(plan, runner.execute(plan))
    s.add(req("unrelated", 30, 4))
    follow_up = (*first.tokens, 77, 78)
    s.add(Request(GenerationRequest("s2", follow_up, GREEDY, StoppingParams(4), "s")))
    events = drive(s, runner)
    order = [r.request_id for r, e in events if isinstance(e, TokenDelta)]
    assert order.index("s2") < order.index("unrelated")
    s2 = next(r for r, _ in events if r.request_id == "s2")
    assert s2.num_cached_prompt == len(first.tokens) - 1  # its last token was never fed


def test_clear_cache_forgets_idle_caches_and_the_ram_tier_but_not_running_work() -> None:
    """ClearCache: the idle slot's cells and the RAM tier go; a request running meanwhile keeps
    its KV and finishes exactly as alone; the cleared prompt is then computed from scratch."""
    s, runner = make(n_parallel=2, ram_cache_bytes=1 << 20), FakeRunner()
    s.add(req("first", 100, 4))
    s.add(req("evicts-into-ram", 90, 4))  # one slot each; nothing is saved yet
    drive(s, runner)
    s.add(req("longer-running", 30, 40))
    plan, _ = s.schedule()  # the running request takes an idle slot: its cache goes to RAM
    assert plan is not None
    s.update(plan, runner.execute(plan))
    assert s.kv.ram is not None
    ram_entries, ram_bytes = s.kv.ram.num_entries, s.kv.ram.num_bytes
    assert ram_entries == 1
    used = s.kv.num_used_cells()
    cleared = s.kv.clear_idle()
    assert cleared.cleared_slots == 1
    assert cleared.freed_kv_cells > 0
    assert s.kv.num_used_cells() == used - cleared.freed_kv_cells
    assert (cleared.freed_ram_entries, cleared.freed_ram_bytes) == (ram_entries, ram_bytes)
    assert s.kv.ram.num_entries == 0
    got = outputs(drive(s, runner))
    assert got["longer-running"] == alone(30, 40, "longer-running")
    again = req("first", 100, 4)
    s.add(again)
    drive(s, runner)
    assert again.num_cached_prompt == 0


@pytest.mark.parametrize(("stall", "chunk"), [(2.0, 12), (4.0, 38), (16.0, 192), (0.0, 400)])
def test_prefill_stall_sets_the_prompt_chunk_beside_a_decoding_slot(
    stall: float, chunk: int
) -> None:
    """With a 40 ms decode tick and 2.5 ms per prompt token measured, a 400-token prompt
    arriving while another request generates gets 0.8 * (stall - 1) * 40 / 2.5 tokens a tick
    (SchedulerLimits.prefill_stall, --prefill-stall), the generating slot its one token; at 0
    (the default) the whole prompt goes in that tick."""
    limits = SchedulerLimits(2, 4096, 512, 512, 8, prefill_stall=stall)
    s, runner = Scheduler(limits, pieces=PIECES, eog_ids=frozenset()), FakeRunner()
    s.add(req("gen", 8, 50))
    plan, _ = s.schedule()
    assert plan is not None
    s.update(plan, runner.execute(plan))  # its prompt in one tick: it generates now
    s.add(req("long", 400, 4))
    s.passes.costs.decode_tick_ms, s.passes.costs.prefill_token_ms = 40.0, 2.5
    plan, _ = s.schedule()
    assert plan is not None
    assert {c.slot_id: len(c.tokens) for c in plan.chunks} == {0: 1, 1: chunk}
