"""Speculative decoding inside the scheduler, driven by the FakeRunner (no model): output identical
to plain decoding, stop strings / EOS / max_tokens inside an accepted draft, the rejected tail
removed from the KV cache (the scheduler's view of every sequence matches the runner's after every
tick), cancellation and KV pressure while speculating, AUTO's choices, usage and counters."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Sequence

import pytest

from llama_grpc_server import errors
from llama_grpc_server.core.requests.request import (
    Event,
    Failed,
    Finished,
    FinishReason,
    OutputParams,
    Request,
    SpeculativeConfig,
    SpeculativeMode,
    SpeculativeParams,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.plan import (
    Chunk,
    SampledLogprob,
    SeqOpKind,
    StepPlan,
    StepResult,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler
from llama_grpc_server.core.speculation.policy import PRIOR_AVX512
from llama_grpc_server.testing import FakeRunner
from tests.support.scheduler import drive as base_drive
from tests.support.scheduler import finals, outputs
from tests.support.speculative import BOX
from tests.support.speculative_scheduler import EOS, ON, echo_model, make, prompt_of, req

OFF = SpeculativeParams(SpeculativeMode.OFF)
AUTO = SpeculativeParams(SpeculativeMode.AUTO)


def box_cost_ms(rows: int) -> float:
    """Decode-only tick costs like the development box's (ms for n rows; odd counts >= 3 dear),
    each parity ~4.9 ms per row beyond the measured 18."""
    if rows in BOX:
        return BOX[rows]
    last = 18 if rows % 2 == 0 else 17
    return BOX[last] + 4.9 * (rows - last)


def pending_kv(s: Scheduler, runner: FakeRunner) -> dict[int, list[int]]:
    """The runner's sequences once the KV edits the scheduler has queued are applied."""
    kv = {slot.slot_id: list(runner.kv[slot.slot_id]) for slot in s.slots}
    for op in s.kv._ops:
        if op.kind is SeqOpKind.REMOVE:
            del kv[op.seq_id][op.p0 : None if op.p1 < 0 else op.p1]
        elif op.kind is SeqOpKind.COPY:
            kv[op.seq_id] = kv[op.src_seq_id][: op.p1]
        else:
            raise AssertionError(f"unexpected {op.kind} in these tests")
    return kv


def check_mirror(s: Scheduler, runner: FakeRunner) -> None:
    """Every sequence holds exactly the tokens the scheduler believes (no rejected draft token
    anywhere), and the cell map counts them."""
    kv = pending_kv(s, runner)
    for slot in s.slots:
        if slot.request is not None and slot.request.is_blocked:
            continue
        assert kv[slot.slot_id] == slot.kv_tokens(), f"slot {slot.slot_id}"
        assert s.kv.cells.num_cells(slot.slot_id) == len(kv[slot.slot_id])


def drive(
    s: Scheduler,
    runner: FakeRunner,
    between: Callable[[int], None] | None = None,
    max_ticks: int = 3000,
) -> list[tuple[Request, Event]]:
    """test_scheduler's drive with the KV mirror checked after every tick."""
    return base_drive(s, runner, max_ticks, between, after=lambda: check_mirror(s, runner))


def run(
    requests: Sequence[Request],
    model: Callable[[list[int]], int] | None = None,
    *,
    n_parallel: int = 3,
    scripts: dict[str, list[int]] | None = None,
    **kw: object,
) -> tuple[list[tuple[Request, Event]], FakeRunner, Scheduler]:
    cost = bool(kw.pop("cost", False))
    s = make(n_parallel=n_parallel, **kw)  # type: ignore[arg-type]
    runner = FakeRunner(eos_id=EOS)
    if cost:
        runner.cost_ms = box_cost_ms
    if model is not None:
        runner.next_token = model  # type: ignore[method-assign]
    runner.scripts.update(scripts or {})
    for request in requests:
        s.add(request)
    return drive(s, runner), runner, s


def with_mode(requests: Sequence[Request], mode: SpeculativeParams) -> list[Request]:
    return [Request(dataclasses.replace(r.spec, speculative=mode)) for r in requests]


def drafts_of(runner: FakeRunner, key: str) -> list[Chunk]:
    return [c for p in runner.plans for c in p.chunks if c.request_id == key and c.num_draft]


# -- identity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_parallel", [1, 3])
def test_output_identical_with_and_without_drafts(n_parallel: int) -> None:
    """Greedy output, token for token, does not change with speculation, alone or batched;
    drafts were both accepted and rejected on the way."""
    requests = [req(f"r{i}", prompt_of(i), max_tokens=60) for i in range(3)]
    on_events, runner, _ = run(requests, echo_model(), n_parallel=n_parallel)
    off_events, _, _ = run(with_mode(requests, OFF), echo_model(), n_parallel=n_parallel)
    assert outputs(on_events) == outputs(off_events)
    assert {k: v.reason for k, v in finals(on_events).items()} == {  # type: ignore[union-attr]
        k: v.reason  # type: ignore[union-attr]
        for k, v in finals(off_events).items()
    }
    usage = {r.request_id: e.usage for r, e in on_events if isinstance(e, Finished)}
    assert all(u.draft_tokens > u.accepted_draft_tokens > 0 for u in usage.values()), usage
    assert any(p.num_draft for p in runner.plans)


def test_usage_and_counters_count_what_was_drafted_and_accepted() -> None:
    """usage.draft_tokens is the sum of the request's draft lengths; the stats snapshot
    totals agree with the requests' usage."""
    requests = [req(f"r{i}", prompt_of(i), max_tokens=50) for i in range(2)]
    events, runner, s = run(requests, echo_model())
    usage = {r.request_id: e.usage for r, e in events if isinstance(e, Finished)}
    for rid, u in usage.items():
        assert u.draft_tokens == sum(c.num_draft for c in drafts_of(runner, rid))
    snapshot = s.snapshot(1024)
    assert snapshot.spec_draft_tokens == sum(u.draft_tokens for u in usage.values())
    assert snapshot.spec_accepted_tokens == sum(u.accepted_draft_tokens for u in usage.values())
    assert snapshot.spec_acceptance_rate == pytest.approx(
        snapshot.spec_accepted_tokens / snapshot.spec_draft_tokens
    )
    assert snapshot.spec_ticks == sum(1 for p in runner.plans if p.num_draft)


def test_off_by_default_drafts_nothing() -> None:
    """A request that does not choose takes the server's default: off."""
    _events, runner, s = run([req("r", prompt_of(1), speculative=SpeculativeParams())])
    assert not any(p.num_draft for p in runner.plans)
    assert s.snapshot(1024).spec_draft_tokens == 0


def test_server_default_on_applies_to_requests_that_do_not_choose() -> None:
    default = SpeculativeConfig(SpeculativeMode.ON, draft_max=4)
    requests = [req("r", prompt_of(1), speculative=SpeculativeParams())]
    _, runner, _ = run(requests, echo_model(), default=default)
    chunks = drafts_of(runner, "r")
    assert chunks and max(c.num_draft for c in chunks) == 4


# -- endings inside a draft ------------------------------------------------------------------------

# A prompt that repeats: after the first generated token the drafter proposes the rest of it.
LOOP = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19)
COPY = [12, 13, 14, 15, 16, 17, 18, 19, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def scripted(rid: str, script: list[int], **kw: object) -> tuple[list, FakeRunner, Scheduler]:
    prompt = (*LOOP, 10, 11)
    on = run([req(rid, prompt, **kw)], scripts={rid: script})  # type: ignore[arg-type]
    off = run([req(rid, prompt, speculative=OFF, **kw)], scripts={rid: script})  # type: ignore[arg-type]
    assert outputs(on[0]) == outputs(off[0])
    assert [type(e) for _, e in on[0] if not isinstance(e, TokenDelta)] == [
        type(e) for _, e in off[0] if not isinstance(e, TokenDelta)
    ]
    return on


def test_stop_string_inside_an_accepted_draft() -> None:
    """A stop string completed in the middle of a draft ends the request there; the drafted
    tokens after it are not output and their KV is removed."""
    events, runner, s = scripted("r", COPY, max_tokens=30, stop=("<15>",))
    done = finals(events)["r"]
    assert isinstance(done, Finished) and done.reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.text for _, e in events if isinstance(e, TokenDelta)) == "<12><13><14>"
    first = drafts_of(runner, "r")[0]
    assert first.num_draft >= 4  # the stop came inside this draft
    assert s.slots[0].idle_cache[-3:] == [12, 13, 14] and len(s.slots[0].idle_cache) == 15
    assert runner.kv[0] == s.slots[0].idle_cache


def test_eos_inside_an_accepted_draft() -> None:
    """The draft runs through an end-of-generation token the sampler agrees with: the request
    ends with EOS at that token."""
    prompt = (10, 11, 12, 13, EOS, 40, 41, 10, 11)
    events, runner, _ = run([req("r", prompt)], scripts={"r": [12, 13, EOS, 50]})
    done = finals(events)["r"]
    assert isinstance(done, Finished) and done.reason is FinishReason.EOS
    assert outputs(events)["r"] == [12, 13]
    chunk = drafts_of(runner, "r")[0]
    assert chunk.tokens[1:3] == (13, EOS)
    assert done.usage.accepted_draft_tokens == 2  # 13 and EOS


def test_max_tokens_inside_a_draft_is_never_exceeded() -> None:
    """Drafts are capped at what max_tokens leaves: exactly max_tokens tokens come out."""
    events, runner, _ = scripted("r", COPY, max_tokens=6)
    done = finals(events)["r"]
    assert isinstance(done, Finished) and done.reason is FinishReason.MAX_TOKENS
    assert len(outputs(events)["r"]) == 6 == done.usage.completion_tokens
    for chunk in drafts_of(runner, "r"):
        assert chunk.num_draft <= 6 - (chunk.start_pos + 1 - (len(LOOP) + 2)) - 1


def test_stop_token_inside_a_draft() -> None:
    events, _, _ = scripted("r", COPY, stop_token_ids=frozenset({16}))
    done = finals(events)["r"]
    assert isinstance(done, Finished) and done.reason is FinishReason.STOP_TOKEN
    assert outputs(events)["r"] == [12, 13, 14, 15]


def test_every_emitted_token_carries_its_logprob() -> None:
    """A request asking for logprobs gets one per token, also for tokens accepted from a
    draft (the runner computes them at each verified position)."""

    class LogprobRunner(FakeRunner):
        def execute(self, plan: StepPlan) -> StepResult:
            result = super().execute(plan)
            lps = {s: SampledLogprob(-0.5) for s in result.sampled}
            more = {
                s: tuple(SampledLogprob(-1.0 - i) for i in range(len(t)))
                for s, t in result.draft_sampled.items()
            }
            return dataclasses.replace(result, logprobs=lps, draft_logprobs=more)

    s = make(n_parallel=1)
    runner = LogprobRunner(eos_id=EOS)
    spec = dataclasses.replace(req("r", (*LOOP, 10, 11)).spec, output=OutputParams(logprobs=True))
    runner.scripts["r"] = COPY[:12]
    s.add(Request(spec))
    events = drive(s, runner)
    deltas = [e for _, e in events if isinstance(e, TokenDelta)]
    assert all(len(d.logprobs) == len(d.token_ids) == 1 for d in deltas)
    assert {lp.logprob for d in deltas for lp in d.logprobs} >= {-0.5, -1.0, -2.0}


# -- the KV cache ----------------------------------------------------------------------------------


def test_rejected_tail_is_removed_before_the_next_decode() -> None:
    """After a partly rejected draft the next plan starts with seq_rm of the rejected
    positions (the mirror check in drive() verifies every tick)."""
    _, runner, _ = run([req("r", prompt_of(3), max_tokens=60)], echo_model(), n_parallel=1)
    removals = [
        op for p in runner.plans for op in p.seq_ops if op.kind is SeqOpKind.REMOVE and op.p0 > 0
    ]
    assert removals
    for plan in runner.plans:
        starts = {c.slot_id: c.start_pos for c in plan.chunks}
        for op in plan.seq_ops:
            if op.kind is SeqOpKind.REMOVE and op.p0 > 0 and op.seq_id in starts:
                assert starts[op.seq_id] == op.p0  # decoding resumes where the kept KV ends


def test_cancel_while_speculating_frees_the_slot_and_keeps_only_accepted_kv() -> None:
    """Cancelled right after a tick with a draft: Failed(cancelled), the slot is idle, its
    cache holds exactly the accepted tokens (what the runner holds once the queued removal
    runs), and the sampler is closed."""
    s = make(n_parallel=1)
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = echo_model(noise_every=4)  # type: ignore[method-assign]
    s.add(req("r", prompt_of(5), max_tokens=200))
    events: list[tuple[Request, Event]] = []
    for _ in range(200):
        plan, evs = s.schedule()
        events += evs
        assert plan is not None
        events += s.update(plan, runner.execute(plan))
        if plan.num_draft and s.kv._ops:  # a rejected tail waits for removal
            break
    events += s.cancel("r")
    check_mirror(s, runner)
    events += drive(s, runner)
    assert isinstance(finals(events)["r"], Failed)
    assert s.slots[0].is_idle and runner.kv[0] == s.slots[0].idle_cache
    assert not runner.samplers


def test_drafts_that_do_not_fit_the_kv_cache_never_preempt() -> None:
    """A runner whose cache has room for the requests but not for their drafts: the tick with
    drafts fails, is retried without them, and nobody is preempted or dropped."""
    requests = [req(f"r{i}", prompt_of(i, 20), max_tokens=30) for i in range(2)]
    s = make(n_parallel=2, n_ctx=1024)
    runner = FakeRunner(kv_cells=2 * (20 + 30) + 1, eos_id=EOS)
    runner.next_token = echo_model()  # type: ignore[method-assign]
    for r in requests:
        s.add(r)
    events = drive(s, runner)
    assert all(isinstance(e, Finished) for e in finals(events).values())
    assert s.counters.preemptions == 0
    off, _, _ = run(with_mode(requests, OFF), echo_model(), n_parallel=2)
    assert outputs(events) == outputs(off)


def test_preempted_while_speculating_resumes_with_the_same_output() -> None:
    """Too little KV for three requests: one is preempted (drafts or not) and resumes by
    re-prefilling; every output equals the one without speculation."""
    requests = [req(f"r{i}", prompt_of(i, 30), max_tokens=40) for i in range(3)]

    def go(reqs: list[Request]) -> tuple[list[tuple[Request, Event]], Scheduler]:
        s = make(n_parallel=3, n_ctx=1024)
        runner = FakeRunner(kv_cells=160, eos_id=EOS)
        runner.next_token = echo_model()  # type: ignore[method-assign]
        for r in reqs:
            s.add(r)
        return drive(s, runner), s

    on, s_on = go(list(requests))
    off, s_off = go(with_mode(requests, OFF))
    assert s_on.counters.preemptions > 0 and s_off.counters.preemptions > 0
    assert outputs(on) == outputs(off)
    assert all(isinstance(e, Finished) for e in finals(on).values())


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_kv_mirror_and_the_output(seed: int) -> None:
    """Arrivals, cancels, mixed modes, stops and limits: every tick the scheduler's view of
    every sequence equals the runner's (drive() checks), every request ends once, and every
    request that finished produced what it produces without speculation."""
    rng = random.Random(seed)
    modes = [ON, AUTO, OFF, SpeculativeParams(SpeculativeMode.ON, draft_max=2, ngram_min=1)]
    requests = [
        req(
            f"r{i}",
            prompt_of(seed * 100 + i, rng.randint(8, 40)),
            max_tokens=rng.randint(1, 50),
            speculative=rng.choice(modes),
            stop=(f"<{rng.randint(3, 60)}>",) if rng.random() < 0.3 else (),
        )
        for i in range(12)
    ]
    s = make(n_parallel=3, n_ctx=600, n_batch=64, chunk=16)
    runner = FakeRunner(kv_cells=250, eos_id=EOS)
    runner.next_token = echo_model(period=rng.randint(3, 9), noise_every=rng.randint(3, 8))  # type: ignore[method-assign]
    runner.cost_ms = box_cost_ms
    pending = list(requests)
    events: list[tuple[Request, Event]] = []

    def between(tick: int) -> None:
        if pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        active = [sl.request for sl in s.slots if sl.request is not None]
        if active and rng.random() < 0.03:
            events.extend(s.cancel(rng.choice(active).request_id))

    events += drive(s, runner, between)
    while pending:
        s.add(pending.pop(0))
        events += drive(s, runner)
    ended = [r.request_id for r, e in events if isinstance(e, Finished | Failed)]
    assert sorted(ended) == sorted(r.request_id for r in requests)
    assert not runner.samplers
    finished = [r for r in requests if isinstance(finals(events)[r.request_id], Finished)]
    alone, _, _ = run(with_mode(finished, OFF), runner.next_token, n_parallel=3)
    got = outputs(events)
    assert {r.request_id: got.get(r.request_id, []) for r in finished} == {
        r.request_id: outputs(alone).get(r.request_id, []) for r in finished
    }


# -- AUTO ------------------------------------------------------------------------------------------

MARK = 95  # a prompt starting with it is answered by copying; any other by noise


def mixed_model(context: list[int]) -> int:
    if context[0] == MARK:
        return context[-9] if len(context) >= 9 else 3
    return (hash(tuple(context)) >> 7) % 90 + 3  # ints hash the same in every process


def test_auto_speculates_for_the_copying_request_only() -> None:
    """At the box's costs AUTO drafts for a request that repeats its input, never for one that
    does not, and not while that one decodes beside it (drafts would make it wait for dearer
    ticks): the copier's drafts start when the other finished."""
    copy = req("copy", (MARK, *prompt_of(1, 8)), max_tokens=80, speculative=AUTO)
    noise = req("noise", prompt_of(2, 24), max_tokens=30, speculative=AUTO)
    s = make(n_parallel=2)
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = mixed_model  # type: ignore[method-assign]
    runner.cost_ms = box_cost_ms
    s.add(copy)
    s.add(noise)
    events = drive(s, runner)
    usage = {r.request_id: e.usage for r, e in events if isinstance(e, Finished)}
    assert usage["copy"].draft_tokens >= 30
    assert usage["copy"].accepted_draft_tokens >= 0.9 * usage["copy"].draft_tokens
    # at most at the start, both at the prior acceptance of 0.5, before shadow drafts settle
    assert usage["noise"].draft_tokens <= 2
    assert sum(p.num_draft for p in runner.plans if p.num_decode == 2) <= 4


def test_a_long_match_drafts_at_once_a_short_one_waits_for_evidence() -> None:
    """Alone, at the box's costs: a request whose output repeats a passage of its prompt finds
    drafts matched on 3+ tokens and drafts from its first decode on (a long match's prior
    acceptance pays); one whose lookup matches on 2 tokens only (its prompt ends with a pair
    it held before) starts from the short prior, which does not pay."""
    copy = req("copy", (MARK, *prompt_of(1, 8)), max_tokens=30, speculative=AUTO)
    _, runner, _ = run([copy], mixed_model, n_parallel=1, cost=True)
    decodes = [p for p in runner.plans if p.num_decode and not p.num_prefill]
    assert sum(1 for p in decodes[1:4] if p.num_draft) >= 2  # the first tick measures costs
    pairs = req("pairs", (MARK, 10, 11, 20, 21, 22, 5, 10), max_tokens=8, speculative=AUTO)
    s = make(n_parallel=1)
    s.spec.costs.calibrate(BOX.items())
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = lambda ctx: 11 if len(ctx) == 8 else 60 + len(ctx)  # type: ignore
    s.add(pairs)
    drive(s, runner)
    assert not any(p.num_draft for p in runner.plans)


def counting(context: list[int]) -> int:
    """Never repeats: the lookup finds nothing, a filler guess is never accepted."""
    return context[0] + len(context)


def three_counting(mode: SpeculativeParams) -> tuple[list[Request], Scheduler, FakeRunner]:
    """Three requests of `mode` decoding `counting` at the box's costs, added, not yet run."""
    requests = [req(f"n{i}", range(3 + i, 27 + i), 40, mode) for i in range(3)]
    s = make(n_parallel=3)
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = counting  # type: ignore[method-assign]
    runner.cost_ms = box_cost_ms
    for request in requests:
        s.add(request)
    return requests, s, runner


def test_fillers_pad_odd_ticks_and_change_nothing() -> None:
    """Three AUTO requests with nothing to look up: at the box's costs (3 rows 42 ms, 4 rows
    33) each decode-only tick of three takes a one-token filler, and no tick of 1, 2 or 4
    rows does; the output is the unspeculated one, and no request's acceptance learns from
    its rejected fillers."""
    requests, s, runner = three_counting(AUTO)
    seen: set[float | None] = set()
    events = base_drive(
        s, runner, 3000, after=lambda: seen.update(s.spec.acceptance(r.key) for r in requests)
    )
    threes = [p for p in runner.plans if p.num_decode == 3 and not p.num_prefill]
    # no costs are known before the first tick; the last leaves no room under max_tokens
    assert len(threes) > 20 and all(p.num_draft == 1 for p in threes[1:-1])
    assert not any(p.num_draft for p in runner.plans if p.num_decode != 3)
    off_events, _, _ = run(with_mode(requests, OFF), counting)
    assert outputs(events) == outputs(off_events)
    assert seen == {None, 0.5}


@pytest.mark.parametrize("mode", [OFF, SpeculativeParams()])
def test_odd_decode_ticks_take_a_pad_that_changes_nothing(mode: SpeculativeParams) -> None:
    """Three plain decodes at the box's costs (3 rows 42 ms, 4 rows 33): each decode-only tick
    of three takes a pad, also for requests that do not speculate (a pad is no draft; AUTO
    ones take a filler instead, test above). The output is the same as without measured costs
    (no pads), nothing counts as drafted, and the KV mirror holds after every tick (drive
    checks it)."""
    requests, s, runner = three_counting(mode)
    events = drive(s, runner)
    threes = [p for p in runner.plans if p.num_decode == 3 and not p.num_prefill]
    pads = [c for p in threes for c in p.chunks if c.is_pad]
    assert len(threes) > 20 and len(pads) >= len(threes) - 2
    assert not any(c.is_pad for p in runner.plans if p.num_decode != 3 for c in p.chunks)
    plain, _, _ = run(with_mode(requests, OFF), counting)
    assert outputs(events) == outputs(plain)
    usage = [e.usage for _, e in events if isinstance(e, Finished)]
    assert all(u.draft_tokens == 0 for u in usage) and s.counters.spec_draft_tokens == 0
    assert s.counters.pad_rows == len(pads)


# The AVX-512 build's costs on the development box (bench/results/decode_cost_shape_avx512.json,
# medians): multiples of 4 rows are the cheap counts.
AVX512_BOX = {
    1: 13.3, 2: 27.6, 3: 28.1, 4: 33.4, 5: 51.5, 6: 54.4, 7: 56.2, 8: 47.5, 9: 73.8,
    10: 66.6, 11: 77.2, 12: 69.4,
}  # fmt: skip


def test_six_decodes_take_two_pad_rows_where_eight_rows_cost_less() -> None:
    """Six plain decodes at the AVX-512 build's costs (6 rows 54.4 ms, 8 rows 47.5) with that
    build's prior shape: each decode-only tick of six takes a pad of two rows, and once two
    have finished the ticks of four (the cheap count) none; the output is the unpadded one, pad
    rows are counted, nothing as drafted, and the KV mirror holds after every tick (drive
    checks it)."""
    requests = [req(f"n{i}", range(3 + i, 27 + i), 40 if i < 4 else 24, OFF) for i in range(6)]
    s = make(n_parallel=6)
    s.spec.costs.prior = PRIOR_AVX512
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = counting  # type: ignore[method-assign]
    runner.cost_ms = lambda rows: AVX512_BOX.get(rows, 5.0 * rows + 20.0)
    for request in requests:
        s.add(request)
    events = drive(s, runner)
    sixes = [p for p in runner.plans if p.num_decode == 6 and not p.num_prefill]
    pads = [c for p in sixes for c in p.chunks if c.is_pad]
    fours = [p for p in runner.plans if p.num_decode == 4 and not p.num_prefill]
    assert len(sixes) > 15 and len(pads) >= len(sixes) - 2 and len(fours) > 10
    assert all(c.num_draft == 2 and len(c.tokens) == 3 for c in pads)
    assert not any(p.num_pad for p in fours)
    plain, _, _ = run(with_mode(requests, OFF), counting, n_parallel=6)
    assert outputs(events) == outputs(plain)
    assert s.counters.spec_draft_tokens == 0 and s.counters.pad_rows == 2 * len(pads)


def test_a_pad_that_does_not_fit_the_kv_cache_is_dropped_not_a_preemption() -> None:
    """A runner whose cache holds the three requests' tokens but not one cell more: the padded
    tick that finds no KV slot is retried without its pad; nobody is preempted, the output is
    the unpadded one."""
    requests, s, runner = three_counting(OFF)
    runner.kv_cells = 3 * (24 + 39)  # every token fed, and no pad, at the last tick
    events = drive(s, runner)

    def starts(plan: StepPlan) -> list[int]:
        return [c.start_pos for c in plan.chunks]

    retries = [  # the same positions fed again: the padded tick failed
        b for a, b in itertools.pairwise(runner.plans) if a.num_pad and starts(a) == starts(b)
    ]
    assert retries and not any(b.num_pad for b in retries)
    assert s.counters.preemptions == 0
    plain, _, _ = run(with_mode(requests, OFF), counting)
    assert outputs(events) == outputs(plain)


def test_auto_does_not_draft_without_measured_costs() -> None:
    """No tick was measured (eval_ms 0): AUTO has no cost model and drafts nothing."""
    copy = req("copy", (MARK, *prompt_of(1, 8)), max_tokens=40, speculative=AUTO)
    _, runner, _ = run([copy], mixed_model)
    assert not any(p.num_draft for p in runner.plans)


def test_auto_does_not_draft_in_a_tick_with_prompt_chunks() -> None:
    """Its cost model is of decode-only ticks: while another prompt is being fed, no AUTO
    drafts join the tick."""
    copy = req("copy", (MARK, *prompt_of(1, 8)), max_tokens=300, speculative=AUTO)
    s = make(n_parallel=2, chunk=4)
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = mixed_model  # type: ignore[method-assign]
    runner.cost_ms = box_cost_ms
    s.add(copy)
    late = req("late", prompt_of(7, 200), max_tokens=4, speculative=OFF)

    def add_late(tick: int) -> None:
        if late.arrival_ns == 0 and any(p.num_draft for p in runner.plans):
            s.add(late)  # sets arrival_ns

    drive(s, runner, add_late)
    mixed = [p for p in runner.plans if p.num_prefill and p.num_decode]
    assert mixed and not any(p.num_draft for p in mixed)
    assert any(p.num_draft for p in runner.plans)


# -- plan invariants -------------------------------------------------------------------------------


def check(*chunks: Chunk, computed: dict[int, int]) -> None:
    StepPlan(tick=1, chunks=chunks).check(64, 16, computed)


def test_a_decode_with_a_draft_is_not_a_prompt_chunk() -> None:
    """A 25-token speculative decode passes though chunk_size is 16."""
    chunk = Chunk(0, "a", 10, tuple(range(25)), True, num_draft=24)
    assert chunk.is_decode and chunk.num_outputs == 25
    check(chunk, computed={0: 10})
    plan = StepPlan(tick=1, chunks=(chunk, Chunk(1, "b", 0, (1, 2, 3), True)))
    assert (plan.num_decode, plan.num_draft, plan.num_prefill) == (1, 24, 3)


@pytest.mark.parametrize(
    "chunk",
    [
        Chunk(0, "a", 10, (1, 2, 3), False, num_draft=2),  # no logits
        Chunk(0, "a", 10, (1, 2, 3), True, num_draft=1),  # tokens != 1 + draft
        Chunk(0, "a", 10, tuple(range(34)), True, num_draft=33),  # over MAX_DRAFT_TOKENS
        Chunk(0, "a", 0, (1, 2), True, num_draft=1),  # at position 0: a prompt
        Chunk(0, "a", 10, (1,) * 5, True, num_draft=4, is_pad=True),  # over MAX_PAD_ROWS
    ],
)
def test_bad_drafts_are_refused(chunk: Chunk) -> None:
    with pytest.raises(RuntimeError, match="bad draft"):
        check(chunk, computed={0: chunk.start_pos})


def test_num_accepted_stops_at_the_first_disagreement() -> None:
    chunk = Chunk(0, "a", 5, (9, 1, 2, 3), True, num_draft=3)
    assert chunk.num_accepted((1, 2, 7)) == 2
    assert chunk.num_accepted((1, 2, 3, 4)) == 3
    assert chunk.num_accepted((8,)) == 0


def test_prompt_too_long_still_rejected_with_speculation() -> None:
    s = make(n_ctx=100)
    with pytest.raises(errors.PromptTooLong):
        s.add(req("big", prompt_of(0, 90), max_tokens=20))


def test_auto_counts_every_decode_row_of_the_tick() -> None:
    """A copying AUTO request among fifteen plain ones: at B = 16 the box's per-row cost makes
    drafting not pay, so it never drafts (alone it does: test above)."""
    copy = req("copy", (MARK, *prompt_of(1, 8)), max_tokens=60, speculative=AUTO)
    others = [
        req(f"o{i}", prompt_of(10 + i, 6), max_tokens=200, speculative=OFF) for i in range(15)
    ]
    s = make(n_parallel=16, n_batch=256)
    runner = FakeRunner(eos_id=EOS)
    runner.next_token = mixed_model  # type: ignore[method-assign]
    runner.cost_ms = box_cost_ms
    for r in [*others, copy]:
        s.add(r)
    events = drive(s, runner)
    usage = {r.request_id: e.usage for r, e in events if isinstance(e, Finished)}
    assert usage["copy"].draft_tokens == 0
