"""Built-in batch strategies on table-driven views (no model)."""

from __future__ import annotations

import pytest

from llama_grpc_server.core.scheduling.strategies import (
    DEFAULT_PREFILL_STALL,
    INTERACTIVE_PREFILL_STALL,
    MAX_DECODE_WAIT_TICKS,
    MAX_PREFILL_WAIT_TICKS,
    Balanced,
    BatchStrategy,
    BatchView,
    DecodeMaximal,
    PrefillPriority,
    SlotView,
    TickCosts,
    load_strategy,
)


def dec(slot_id: int, last: int = 9) -> SlotView:
    return SlotView(slot_id, 1, True, last)


def pre(slot_id: int, pending: int, last: int = 9) -> SlotView:
    return SlotView(slot_id, pending, False, last)


def view(*slots: SlotView, budget: int = 64, chunk: int = 16, tick: int = 10) -> BatchView:
    return BatchView(tick=tick, budget=budget, chunk_size=chunk, queue_depth=0, slots=slots)


ALL: list[BatchStrategy] = [DecodeMaximal(), PrefillPriority(), Balanced()]


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.name)
def test_budget_and_chunk_size_respected(strategy: BatchStrategy) -> None:
    """No strategy exceeds the budget, a slot's pending tokens or chunk_size."""
    v = view(dec(0), dec(1), pre(2, 100), pre(3, 5), budget=24, chunk=16)
    alloc = strategy.allocate(v)
    assert sum(alloc.values()) <= 24
    pending = {s.slot_id: s.num_pending for s in v.slots}
    for slot_id, n in alloc.items():
        assert 0 < n <= min(pending[slot_id], 16)


def test_decode_maximal_serves_every_decoder_first() -> None:
    """decode_maximal: decoders get their token, prefill takes only the rest."""
    alloc = DecodeMaximal().allocate(view(dec(0), dec(1), dec(2), pre(3, 100), budget=10))
    assert [alloc[0], alloc[1], alloc[2]] == [1, 1, 1]
    assert alloc[3] == 7


def test_prefill_priority_fills_prefill_first() -> None:
    """prefill_priority: prompt chunks first; decoders only get what is left."""
    alloc = PrefillPriority().allocate(view(dec(0), dec(1), pre(2, 100), budget=10, chunk=16))
    assert alloc[2] == 10
    assert 0 not in alloc and 1 not in alloc


def test_balanced_splits_budget() -> None:
    """balanced: with more decoders than half the budget, half goes to decode, half to prefill."""
    decoders = [dec(i) for i in range(8)]
    alloc = Balanced().allocate(view(*decoders, pre(8, 100), budget=8, chunk=16))
    assert sum(1 for i in range(8) if i in alloc) == 4
    assert alloc[8] == 4


def test_balanced_lends_unused_decode_budget_to_prefill() -> None:
    """balanced: one decoder uses 1 token; prefill gets everything else."""
    alloc = Balanced().allocate(view(dec(0), pre(1, 100), budget=20, chunk=32))
    assert alloc == {0: 1, 1: 19}


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.name)
def test_starving_decoder_is_served(strategy: BatchStrategy) -> None:
    """A decoder that waited MAX_DECODE_WAIT_TICKS gets a token even when prefill would eat all."""
    starving = dec(0, last=10 - MAX_DECODE_WAIT_TICKS)
    alloc = strategy.allocate(view(starving, pre(1, 100, last=9), budget=8, chunk=16))
    assert alloc.get(0) == 1


def arrived(slot_id: int, pending: int, arrival_ns: int, last: int = 9) -> SlotView:
    return SlotView(slot_id, pending, False, last, arrival_ns)


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.name)
def test_equal_prompts_go_oldest_first_each_taking_what_it_needs(strategy: BatchStrategy) -> None:
    """Four 2,048-token prompts in passes of 2,048: the oldest takes the whole first pass (it
    used to be 512 each, round robin, all four finishing in the fourth pass)."""
    slots = [arrived(i, 2048, arrival_ns=[30, 10, 40, 20][i]) for i in range(4)]
    assert strategy.allocate(view(*slots, budget=2048, chunk=2048)) == {1: 2048}
    # the oldest's last 100 tokens, then the next oldest fills the rest of the pass
    slots[1] = arrived(1, 100, arrival_ns=10)
    assert strategy.allocate(view(*slots, budget=2048, chunk=2048)) == {1: 100, 3: 1948}


def test_the_shortest_remaining_prompt_goes_first() -> None:
    """A short prompt behind a long one finishes in this pass; the long one takes the rest."""
    v = view(arrived(0, 5000, arrival_ns=1), arrived(1, 40, arrival_ns=2), budget=512, chunk=512)
    assert DecodeMaximal().allocate(v) == {1: 40, 0: 472}


def test_a_prompt_kept_waiting_goes_first() -> None:
    """Short prompts filling every pass cannot starve a long one: after MAX_PREFILL_WAIT_TICKS
    ticks without a token it goes before them."""
    tick = 20
    waiting = arrived(0, 5000, arrival_ns=1, last=tick - MAX_PREFILL_WAIT_TICKS)
    short = [arrived(i, 16, arrival_ns=2, last=tick - 1) for i in (1, 2)]
    assert DecodeMaximal().allocate(view(waiting, *short, budget=32, chunk=32, tick=tick)) == {
        0: 32
    }
    recent = arrived(0, 5000, arrival_ns=1, last=tick - MAX_PREFILL_WAIT_TICKS + 1)
    assert DecodeMaximal().allocate(view(recent, *short, budget=32, chunk=32, tick=tick)) == {
        1: 16,
        2: 16,
    }


def test_chunk_size_still_caps_one_prompt() -> None:
    v = view(arrived(0, 1000, arrival_ns=1), arrived(1, 1000, arrival_ns=2), budget=24, chunk=16)
    assert DecodeMaximal().allocate(v) == {0: 16, 1: 8}


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: s.name)
def test_no_prefill_starves_across_ticks(strategy: BatchStrategy) -> None:
    """Simulated over many ticks with a tiny budget, every prefilling slot makes progress."""
    pending = {0: 50, 1: 50, 2: 50}
    last = {0: 0, 1: 0, 2: 0}
    for tick in range(1, 40):
        slots = tuple(pre(i, pending[i], last[i]) for i in pending if pending[i] > 0)
        if not slots:
            break
        alloc = strategy.allocate(view(*slots, budget=8, chunk=8, tick=tick))
        for slot_id, n in alloc.items():
            pending[slot_id] -= n
            last[slot_id] = tick
    assert all(p == 0 for p in pending.values())


def test_load_strategy_by_name_and_path() -> None:
    """Built-ins load by name, custom ones by module:attr; unknown names fail clearly."""
    assert load_strategy("balanced").name == "balanced"
    custom = load_strategy("llama_grpc_server.core.scheduling.strategies:PrefillPriority")
    assert custom.name == "prefill_priority"
    with pytest.raises(ValueError, match="unknown batch strategy"):
        load_strategy("fastest")
    with pytest.raises(ValueError, match="cannot import"):
        load_strategy("no_such_module:thing")


def test_decode_maximal_limits_prefill_to_the_allowance_while_decoding() -> None:
    """With slots generating, prompt chunks get only the measured allowance; without, all."""
    decoding = SlotView(0, 1, True, 5)
    prefilling = SlotView(1, 2000, False, 5)
    view = BatchView(tick=6, budget=2048, chunk_size=512, queue_depth=0,
                     slots=(decoding, prefilling), prefill_allowance=20)  # fmt: skip
    assert DecodeMaximal().allocate(view) == {0: 1, 1: 20}
    alone = BatchView(6, 2048, 512, 0, (prefilling,), prefill_allowance=20)
    assert DecodeMaximal().allocate(alone) == {1: 512}
    unmeasured = BatchView(6, 2048, 512, 0, (decoding, prefilling))
    assert DecodeMaximal().allocate(unmeasured) == {0: 1, 1: 512}


def test_tick_costs_turn_measured_times_into_an_allowance() -> None:
    """A 40 ms decode tick and 2.5 ms per prompt token allow 0.8 * 40 / 2.5 = 12 tokens;
    bounded below (prompts progress) and above (chunk size); 0 until both are measured."""
    costs = TickCosts()
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 0
    costs.observe(num_decode=4, num_prefill=0, eval_ms=40.0)
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 0
    costs.observe(num_decode=0, num_prefill=512, eval_ms=1280.0)
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 12
    assert costs.prefill_allowance(10, INTERACTIVE_PREFILL_STALL) == 10
    costs.observe(num_decode=0, num_prefill=512, eval_ms=512_000.0)  # very slow prompt tokens
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 8


def test_prefill_stall_scales_the_allowance() -> None:
    """--prefill-stall X lets a pass with prompt tokens last about X decode ticks: with a 40 ms
    decode tick and 2.5 ms per prompt token, 0.8 * (X - 1) * 40 / 2.5 tokens: 12 at the default
    2, 38 at 4 (12.8 * 3), 192 at 16, the chunk size at most."""
    costs = TickCosts()
    costs.observe(num_decode=4, num_prefill=0, eval_ms=40.0)
    costs.observe(num_decode=0, num_prefill=512, eval_ms=1280.0)
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 12
    assert costs.prefill_allowance(512, 4.0) == 38
    assert costs.prefill_allowance(512, 16.0) == 192
    assert costs.prefill_allowance(128, 16.0) == 128
    assert costs.prefill_allowance(512, 1.25) == 8  # 3.2 tokens: the floor


def test_the_default_stall_sets_no_allowance() -> None:
    """The default (0): measured costs or not, prompts are not held back beside generating
    slots (DEFAULT_PREFILL_STALL: throughput on prompt-heavy traffic, issue 40)."""
    costs = TickCosts()
    costs.observe(num_decode=4, num_prefill=0, eval_ms=40.0)
    costs.observe(num_decode=0, num_prefill=512, eval_ms=1280.0)
    assert DEFAULT_PREFILL_STALL == 0.0
    assert costs.prefill_allowance(512) == 0
    assert costs.prefill_allowance(512, 0.0) == 0
    assert costs.prefill_allowance(512, INTERACTIVE_PREFILL_STALL) == 12


def test_decode_maximal_lets_a_prompt_finish_in_its_pass() -> None:
    """A prompt that fits the pass but for the decode rows takes the rows it lacks from the
    decoders served most recently (they wait a tick); one that cannot fit takes none."""
    fits = view(dec(0, last=9), dec(1, last=8), pre(2, 63), budget=64, chunk=64)
    assert DecodeMaximal().allocate(fits) == {1: 1, 2: 63}
    whole = view(dec(0, last=9), dec(1, last=8), pre(2, 64), budget=64, chunk=64)
    assert DecodeMaximal().allocate(whole) == {2: 64}
    too_long = view(dec(0, last=9), dec(1, last=8), pre(2, 65), budget=64, chunk=64)
    assert DecodeMaximal().allocate(too_long) == {0: 1, 1: 1, 2: 62}
    capped = view(dec(0, last=9), dec(1, last=8), pre(2, 63), budget=64, chunk=32)
    assert DecodeMaximal().allocate(capped) == {0: 1, 1: 1, 2: 32}
    starving = dec(0, last=10 - MAX_DECODE_WAIT_TICKS)
    assert DecodeMaximal().allocate(view(starving, pre(1, 64), budget=64, chunk=64)) == {
        0: 1,
        1: 63,
    }


def test_decode_maximal_keeps_decode_rows_under_a_prefill_allowance() -> None:
    v = BatchView(
        tick=10,
        budget=64,
        chunk_size=64,
        queue_depth=0,
        slots=(dec(0), pre(1, 63)),
        prefill_allowance=32,
    )
    assert DecodeMaximal().allocate(v) == {0: 1, 1: 32}
