"""Speculative decoding, the pure parts: the n-gram drafter (core.speculation.ngram), the tick cost
model, the acceptance estimate and the AUTO policy (core.speculation.policy)."""

from __future__ import annotations

import random

import pytest

from llama_grpc_server.core.kv.cells import CellMap
from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    Request,
    SamplingParams,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.plan import MAX_PAD_ROWS, Chunk
from llama_grpc_server.core.speculation import acceptance
from llama_grpc_server.core.speculation.ngram import Match, NgramIndex
from llama_grpc_server.core.speculation.policy import (
    ACCEPT_ALPHA,
    ACCEPT_ALPHA_NEXT,
    MIN_GAIN,
    PRIOR_AVX512,
    PRIOR_SHAPE_AVX512,
    Acceptance,
    DraftOption,
    TickCostModel,
    choose_drafts,
    expected_accepted,
    prior_shape,
)
from llama_grpc_server.core.speculation.speculator import (
    AMBIGUOUS,
    AMBIGUOUS_PRIOR,
    LONG,
    SHORT,
    Speculator,
)
from tests.support.speculative import BOX


def reference_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> Match:
    """The drafter's contract by brute force: longest suffix first, most recent occurrence;
    ambiguous when the suffix's earlier occurrences were not all followed by the same token."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
        if ends:
            followers = {tokens[e] for e in ends}
            return Match(tuple(tokens[ends[-1] : ends[-1] + k]), n, len(followers) > 1)
    return Match((), 0)


def reference_draft(tokens: list[int], n_min: int, n_max: int, k: int) -> tuple[int, ...]:
    return reference_lookup(tokens, n_min, n_max, k).draft


def box_costs() -> TickCostModel:
    costs = TickCostModel()
    costs.calibrate(BOX.items())
    return costs


# -- drafter ---------------------------------------------------------------------------------------


def test_draft_is_what_followed_the_suffix() -> None:
    """The suffix [1, 2, 3] occurred before, followed by 4, 5, 6."""
    index = NgramIndex(2, 3)
    assert index.draft([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3) == (4, 5, 6)


def test_most_recent_occurrence_first() -> None:
    """Of two earlier occurrences of the suffix, the later one's continuation is drafted."""
    index = NgramIndex(2, 2)
    assert index.draft([7, 8, 1, 9, 7, 8, 2, 9, 7, 8], 2) == (2, 9)


def test_longest_suffix_first() -> None:
    """A 3-token match wins over a more recent 2-token one."""
    index = NgramIndex(2, 3)
    tokens = [5, 1, 2, 40, 41, 9, 1, 2, 50, 51, 5, 1, 2]
    assert index.draft(tokens, 2) == (40, 41)
    assert NgramIndex(2, 2).draft(tokens, 2) == (50, 51)


def test_no_match_shorter_than_ngram_min() -> None:
    """Only the last token recurs: with ngram_min 2 there is no draft, with 1 there is."""
    tokens = [3, 4, 5, 6, 7, 4]
    assert NgramIndex(2, 4).draft(tokens, 4) == ()
    assert NgramIndex(1, 4).draft(tokens, 4) == (5, 6, 7, 4)


def test_suffix_never_matches_itself() -> None:
    """A list whose suffix occurs nowhere else drafts nothing, however it is grown."""
    index = NgramIndex(1, 3)
    tokens: list[int] = []
    for token in range(20):
        tokens.append(token)
        assert index.draft(tokens, 5) == ()


def test_draft_is_capped_at_max_tokens() -> None:
    """max_tokens bounds the draft; 0 or less drafts nothing."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert NgramIndex(2, 2).draft(tokens, 3) == (3, 4, 5)
    assert NgramIndex(2, 2).draft(tokens, 0) == ()


def test_a_repeating_pattern_drafts_into_its_own_suffix() -> None:
    """In a period-2 list the continuation may run up to the end of the list."""
    assert NgramIndex(2, 2).draft([1, 2, 1, 2, 1, 2], 8) == (1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_index_matches_a_rescan(seed: int) -> None:
    """Growing one index token by token drafts exactly what the brute-force rule drafts."""
    rng = random.Random(seed)
    n_min, n_max = rng.randint(1, 2), rng.randint(2, 5)
    index = NgramIndex(n_min, n_max)
    tokens = [rng.randint(0, 6) for _ in range(5)]
    for _ in range(300):
        tokens.extend(rng.randint(0, 6) for _ in range(rng.randint(1, 4)))
        k = rng.randint(1, 8)
        assert index.lookup(tokens, k) == reference_lookup(tokens, n_min, n_max, k)


def test_lookup_tells_how_long_a_suffix_matched() -> None:
    """The longest suffix first: 4 tokens here, then 2 where only 2 occurred before."""
    index = NgramIndex(2, 4)
    assert index.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3, 4], 2) == Match((5, 9), 4)
    assert NgramIndex(2, 4).lookup([7, 3, 4, 5, 9, 3, 4], 2) == Match((5, 9), 2)
    assert NgramIndex(2, 4).lookup([1, 2, 3], 2) == Match((), 0)


def test_lookup_tells_whether_the_suffix_had_other_followers() -> None:
    """(1, 2) was followed by 7 and then by 8: the draft (from the most recent) is ambiguous;
    (3, 4) was followed by 5 both times: it is not. The index learns it as the list grows."""
    index = NgramIndex(2, 2)
    assert index.lookup([1, 2, 7, 1, 2], 3) == Match((7, 1, 2), 2, False)
    assert index.lookup([1, 2, 7, 1, 2, 8, 1, 2], 3) == Match((8, 1, 2), 2, True)
    assert NgramIndex(2, 2).lookup([3, 4, 5, 0, 3, 4, 5, 6, 3, 4], 2) == Match((5, 6), 2, False)


def test_filler_is_what_last_followed_the_last_token() -> None:
    """Where the lookup finds nothing, the filler guesses the token that followed the last one
    most recently, else the last one again."""
    index = NgramIndex(3, 4)
    tokens = [5, 6, 7, 9, 5, 8, 1, 5]
    assert index.draft(tokens, 4) == ()
    assert index.filler(tokens) == 8
    assert index.filler([*tokens, 42]) == 42


def test_bad_ngram_range_is_refused() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex(3, 2)


def test_an_index_grown_token_by_token_answers_as_one_built_at_once() -> None:
    """After the prompt is indexed once, each step indexes only the new token: every lookup
    equals that of an index built from the whole list in one go (the cost of a step, a few
    microseconds on a 4,000-token prompt, is measured by bench/ngram_lookup.py)."""
    rng = random.Random(0)
    tokens = [rng.randint(0, 11) for _ in range(400)]  # a small vocabulary: many repeats
    index = NgramIndex(2, 4)
    index.lookup(tokens, 8)
    found = 0
    for _ in range(200):
        tokens.append(rng.randint(0, 11))
        grown = index.lookup(tokens, 8)
        assert grown == NgramIndex(2, 4).lookup(tokens, 8), len(tokens)
        found += grown.length > 0
    assert found > 100, found  # most steps match something: the comparison is not vacuous


# -- cost model ------------------------------------------------------------------------------------


def test_cost_model_is_unknown_until_measured() -> None:
    assert TickCostModel().tick_ms(4) is None


def test_calibrated_points_are_kept_as_measured_not_made_monotone() -> None:
    """4 rows cost less than 3 on the box (llama.cpp's output matmul and an odd row count):
    the model keeps that, so a policy can pick the cheaper length."""
    costs = box_costs()
    assert costs.tick_ms(1) == pytest.approx(12.8)
    assert costs.tick_ms(3) == pytest.approx(42.1)
    assert costs.tick_ms(4) == pytest.approx(33.2)
    assert costs.tick_ms(4) < costs.tick_ms(3)  # type: ignore[operator]


def test_a_row_count_not_measured_scales_the_nearest_of_its_parity() -> None:
    """Measured 1, 2, 4: T(3) comes from T(1) along the prior shape (odd like 3), not from a
    line between T(2) and T(4), which would make it look cheaper than T(4)."""
    costs = TickCostModel()
    costs.calibrate([(1, 12.8), (2, 25.3), (4, 33.2)])
    assert costs.tick_ms(3) == pytest.approx(12.8 * prior_shape(3))
    assert costs.tick_ms(3) > costs.tick_ms(4)  # type: ignore[operator]
    assert costs.tick_ms(6) == pytest.approx(33.2 * prior_shape(6) / prior_shape(4))


def test_a_newly_measured_row_count_becomes_the_nearest_for_its_neighbours() -> None:
    """The nearest measured N of a row count is remembered, and forgotten when a row count is
    measured for the first time or the prior changes; a measured point's new value is used at
    once. Measured 1, 2, 4, T(7) scales T(4); once 8 is measured, T(8)."""
    costs = TickCostModel()
    costs.calibrate([(1, 12.8), (2, 25.3), (4, 33.2)])
    assert costs.tick_ms(7) == pytest.approx(33.2 * prior_shape(7) / prior_shape(4))
    costs.observe(4, 43.2)  # moves T(4) by a tenth of 10 ms
    assert costs.tick_ms(7) == pytest.approx(34.2 * prior_shape(7) / prior_shape(4))
    costs.observe(8, 50.0)  # first measured: starts from its estimate, then moves
    t8 = costs.tick_ms(8)
    assert t8 is not None
    assert costs.tick_ms(7) == pytest.approx(t8 * prior_shape(7) / prior_shape(8))
    costs.prior = PRIOR_AVX512
    assert costs.tick_ms(7) == pytest.approx(t8 * PRIOR_AVX512.at(7) / PRIOR_AVX512.at(8))


def test_past_the_avx512_shape_each_residue_of_4_goes_on_along_its_own_slope() -> None:
    """The AVX-512 build's cheap counts are the multiples of 4: beyond the shape's 32 rows, 36
    still costs less than 33, 34 and 35 (a parity-based extrapolation would make 34 the cheap
    one), so a pad past 32 rows aims at a multiple of 4."""

    def shape(n: int) -> float:
        return PRIOR_AVX512.at(n)

    assert shape(36) < min(shape(33), shape(34), shape(35))
    assert shape(40) < min(shape(37), shape(38), shape(39))
    assert shape(36) == pytest.approx(
        PRIOR_SHAPE_AVX512[31] + (PRIOR_SHAPE_AVX512[31] - PRIOR_SHAPE_AVX512[23]) / 2
    )


def test_beyond_the_measured_points_along_the_prior_shape() -> None:
    """Only T(1) measured: T(N) is T(1) times the box's shape; past the last point likewise,
    and past the shape's own end each parity continues its last slope."""
    costs = TickCostModel()
    costs.observe(1, 20.0)
    assert costs.tick_ms(9) == pytest.approx(20.0 * prior_shape(9))
    box = box_costs()
    assert box.tick_ms(33) == pytest.approx(102.2 * prior_shape(33) / prior_shape(17))
    assert prior_shape(32) < prior_shape(34) < prior_shape(33)


def test_a_disturbed_calibration_point_is_taken_down() -> None:
    """One row measured at 253 ms (another process had the CPU) but two at 25 ms: T(1) is
    taken down to twice what the other points and the shape predict (~13 ms), not 253 (which
    would make every draft look free); of two readings of one N the faster counts."""
    costs = TickCostModel()
    costs.calibrate([(1, 253.4), (2, 25.5), (4, 34.1), (8, 59.8), (16, 86.1), (16, 90.0)])
    assert costs.tick_ms(1) < 30
    assert costs.tick_ms(16) == pytest.approx(86.1)


def test_a_disturbed_tick_moves_its_point_as_if_three_times_off() -> None:
    costs = box_costs()
    costs.observe(1, 12.8 * 20)
    assert costs.tick_ms(1) == pytest.approx(12.8 + 0.1 * (3 * 12.8 - 12.8))


def test_observations_move_a_point_by_ewma() -> None:
    """A measured tick moves its point a tenth of the way; a row count seen for the first time
    starts from its estimate; a cheap reading counts as at most three times off."""
    costs = TickCostModel()
    costs.calibrate([(1, 12.8), (4, 33.2)])
    costs.observe(4, 43.2)
    assert costs.tick_ms(4) == pytest.approx(34.2)
    estimate = 12.8 * prior_shape(3)
    costs.observe(3, 60.0)
    assert costs.tick_ms(3) == pytest.approx(estimate + 0.1 * (60.0 - estimate))
    costs.observe(1, 1.0)
    assert costs.tick_ms(1) == pytest.approx(12.8 + 0.1 * (12.8 / 3 - 12.8))


# -- acceptance ------------------------------------------------------------------------------------


def test_acceptance_learns_first_tokens_and_further_ones_apart() -> None:
    """4 of 4 accepted: the first token a 1 for p, three 1s for p_next; 1 of 4: a 1 for p and
    a 0 for p_next (the tokens after the rejected one were never verified); 0 of 4: a 0 for p
    only; nothing verified changes nothing. The n-th verified token of each weighs
    1 / (n + PRIOR_WEIGHT) until that falls to the floor."""
    a = Acceptance(0.0, 0.0)
    a.record(4, 4)
    assert (a.p, a.p_next) == (pytest.approx(1 / 3), pytest.approx(1 - (2 / 3) * (3 / 4) * (4 / 5)))
    b = Acceptance(0.5, 0.5)
    b.record(1, 4)
    assert (b.p, b.p_next) == (pytest.approx(0.5 + 0.5 / 3), pytest.approx(0.5 - 0.5 / 3))
    b.record(0, 4)
    assert (b.p, b.p_next) == (pytest.approx((0.5 + 0.5 / 3) * 3 / 4), pytest.approx(1 / 3))
    b.record(0, 0)
    assert (b.n, b.n_next) == (2, 1)


def test_acceptance_takes_impossible_counts_as_the_nearest_possible() -> None:
    """A count below 0 is none accepted, one above the draft's length is all of it."""
    for accepted, drafted, same_as in ((-1, 4, 0), (5, 4, 4)):
        a, b = Acceptance(), Acceptance()
        a.record(accepted, drafted)
        b.record(same_as, drafted)
        assert (a.p, a.p_next, a.n, a.n_next) == (b.p, b.p_next, b.n, b.n_next)


def test_acceptance_weighs_the_floor_once_evidence_outweighs_the_prior() -> None:
    """After many verified tokens a first token moves p by ACCEPT_ALPHA and a further one moves
    p_next by ACCEPT_ALPHA_NEXT, whatever came before."""
    a = Acceptance()
    for _ in range(40):
        a.record(3, 3)
    p, p_next = a.p, a.p_next
    a.record(1, 3)
    assert a.p == pytest.approx(p + ACCEPT_ALPHA * (1 - p))
    assert a.p_next == pytest.approx(p_next * (1 - ACCEPT_ALPHA_NEXT))


def test_drafts_that_fail_after_one_token_stop_being_long_at_once() -> None:
    """Long lookups in free writing: the first token right, the second wrong (measured in the
    sampled control of bench/speculative.py). One such draft brings a long-lookup estimate
    (prior 0.8 / 0.9) down to where the box's costs take no draft at all; with p_next learning
    at its floor weight from the start, two of them would leave it drafting 5 tokens a step."""
    a = Acceptance(0.8, 0.9)

    def draft_length(acceptance: Acceptance) -> int:
        option = DraftOption(0, 16, acceptance.p, p_next=acceptance.p_next)
        return choose_drafts(1, [option], box_costs().tick_ms, 64).get(0, 0)

    assert draft_length(a) == 5
    a.record(1, 15)
    assert draft_length(a) == 0
    floor_only = Acceptance(0.8, 0.9, n=100, n_next=100)  # the prior already outweighed
    for _ in range(2):
        floor_only.record(1, 15)
    assert draft_length(floor_only) == 5


def test_one_copy_ending_barely_moves_the_further_tokens_estimate() -> None:
    """A draft's further tokens are many more events than its first one: after copies of 16
    tokens, one rejection (a copy's end) takes a twentieth off p_next, so the next copy still
    gets the long drafts (7 on the box's costs) that a fifth off, as for p, would cut (to 5)."""
    a = Acceptance(0.9, 0.9)
    for _ in range(3):
        a.record(16, 16)
    a.record(4, 16)
    assert 0.9 < a.p_next < 0.96

    def draft_length(p_next: float) -> int:
        option = DraftOption(0, 16, a.p, p_next=p_next)
        return choose_drafts(1, [option], box_costs().tick_ms, 64)[0]

    assert draft_length(a.p_next) > draft_length(a.p_next * 0.8 / 0.95)


def test_acceptance_backs_off_after_a_few_rejections() -> None:
    """After a long run of full acceptances, three drafts rejected at once halve p."""
    a = Acceptance()
    for _ in range(20):
        a.record(8, 8)
    assert a.p > 0.99 and a.p_next > 0.99
    for _ in range(3):
        a.record(0, 8)
    assert a.p < 0.52


def test_expected_accepted_is_the_geometric_sum() -> None:
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.5, 3, 0.9) == pytest.approx(0.5 * (1 + 0.9 + 0.81))
    assert Acceptance(0.5, 0.9).expected(3) == pytest.approx(0.5 * (1 + 0.9 + 0.81))
    assert expected_accepted(0.9, 0) == 0
    assert DraftOption(0, 3, 0.5, p_next=0.9).gain(3) == pytest.approx(0.5 * 0.81)


# -- policy ----------------------------------------------------------------------------------------


def test_no_draft_at_low_acceptance_on_this_box() -> None:
    """At B = 1 a second row doubles the tick (matrix-vector to matrix-matrix): p = 0.6 never
    pays."""
    chosen = choose_drafts(1, [DraftOption(0, 8, 0.6)], box_costs().tick_ms, 64)
    assert chosen == {}


@pytest.mark.parametrize(("p", "length"), [(0.8, 3), (0.9, 7), (0.95, 15)])
def test_acceptance_picks_a_draft_length_with_an_even_row_count(p: float, length: int) -> None:
    """The better a request's acceptance, the longer its draft; on the box's costs always one
    that makes the tick's row count even (16 rows cost less than 15 or 17)."""
    costs = box_costs()
    chosen = choose_drafts(1, [DraftOption(0, 16, p)], costs.tick_ms, 64)
    assert chosen == {0: length}
    rate = (1 + expected_accepted(p, length)) / costs.tick_ms(1 + length)  # type: ignore[operator]
    assert rate * 12.8 > MIN_GAIN


def test_a_filler_pads_an_odd_tick_to_a_cheaper_even_one() -> None:
    """A guess nobody expects to be accepted (p = 0) is sent only where one more row makes the
    tick cheaper: 3 decode rows take 42 ms, 4 take 33; never at 1 or 4 decode rows."""
    filler = [DraftOption(0, 1, 0.0)]
    costs = box_costs()
    assert choose_drafts(3, filler, costs.tick_ms, 64) == {0: 1}
    assert choose_drafts(15, filler, costs.tick_ms, 64) == {0: 1}
    assert choose_drafts(1, filler, costs.tick_ms, 64) == {}
    assert choose_drafts(4, filler, costs.tick_ms, 64) == {}
    assert choose_drafts(3, filler, costs.tick_ms, 0) == {}


def test_beside_a_plain_stream_only_padding_is_weighed() -> None:
    """Fourteen streams with long drafts and one without: the slowest stream cannot be helped,
    so the policy weighs the streams' first tokens and up to MAX_PAD_ROWS rows more (a cheaper
    row count may be that far), and stops, rather than every one of the 224 draft tokens (its
    work per tick stays small at large batches)."""
    calls: list[int] = []
    costs = box_costs()

    def tick_ms(rows: int) -> float | None:
        calls.append(rows)
        return costs.tick_ms(rows)

    options = [DraftOption(i, 16, 0.9) for i in range(14)]
    assert choose_drafts(15, options, tick_ms, 512) == {0: 1}  # 16 rows cost less than 15
    assert len(calls) <= 1 + 14 + MAX_PAD_ROWS


def test_forced_drafts_whatever_it_costs_within_room() -> None:
    """Mode ON takes its whole draft even at p = 0, but never more than the room."""
    options = [DraftOption(0, 6, 0.0, is_forced=True), DraftOption(1, 6, 0.0, is_forced=True)]
    assert choose_drafts(2, options, box_costs().tick_ms, 8) == {0: 6, 1: 2}


def test_unknown_costs_draft_only_forced() -> None:
    options = [DraftOption(0, 4, 0.99), DraftOption(1, 3, 0.1, is_forced=True)]
    assert choose_drafts(2, options, TickCostModel().tick_ms, 64) == {1: 3}


def test_a_copying_stream_does_not_slow_a_plain_one() -> None:
    """Two decoding slots, one repeating its input (p 0.97) and one not (p 0.3): a draft for
    the first would make the second wait for a dearer tick (25 ms for 2 rows, 50 for 8), so
    neither drafts, although the pair would make more tokens per ms."""
    options = [DraftOption(0, 8, 0.3), DraftOption(1, 8, 0.97)]
    assert choose_drafts(2, options, box_costs().tick_ms, 64) == {}
    assert choose_drafts(2, options[1:], box_costs().tick_ms, 64) == {}


def test_streams_that_all_copy_all_draft_evenly() -> None:
    """Two copying streams both draft, the less likely one at least as much (it needs more
    tokens for the same expected progress), in an even row count."""
    options = [DraftOption(0, 8, 0.9), DraftOption(1, 8, 0.97)]
    chosen = choose_drafts(2, options, box_costs().tick_ms, 64)
    assert set(chosen) == {0, 1} and chosen[0] >= chosen[1] >= 2
    assert (2 + sum(chosen.values())) % 2 == 0


def test_a_draft_that_pads_an_odd_tick_goes_to_the_likeliest() -> None:
    """Three decode rows, one stream with a good draft: one row more makes the tick cheaper
    for all, and it is that stream's draft token, not a filler."""
    options = [DraftOption(0, 1, 0.0), DraftOption(1, 8, 0.9)]
    assert choose_drafts(3, options, box_costs().tick_ms, 64) == {1: 1}


def test_no_draft_when_the_batch_is_full() -> None:
    """With a flat per-row cost (each extra row costs as much as a decode row) a draft at
    p = 0.9 never yields 10 % more tokens per ms."""
    costs = TickCostModel()
    costs.calibrate([(n, 6.0 * n) for n in range(1, 65)])  # 6 ms per row, exactly linear
    options = [DraftOption(i, 8, 0.9) for i in range(16)]
    assert choose_drafts(16, options, costs.tick_ms, 64) == {}


def test_room_bounds_the_auto_drafts() -> None:
    costs = TickCostModel()
    costs.calibrate([(n, 10.0 + n / 64) for n in range(1, 65)])  # rows nearly free
    chosen = choose_drafts(1, [DraftOption(0, 16, 0.99)], costs.tick_ms, 5)
    assert chosen == {0: 5}


# -- the cell map ----------------------------------------------------------------------------------


def test_trimming_rejected_drafts_keeps_one_run() -> None:
    """Computed, trimmed back, computed again from the cut: still one run of the same origin
    (a run per tick would make every stats snapshot slower as a request speculates)."""
    cells = CellMap()
    cells.computed(0, 0, 10)
    for start in range(10, 50, 5):
        cells.computed(0, start, 8)  # the decode token + 7 drafts
        cells.trimmed(0, start + 5)  # 4 of the drafts accepted
    assert cells.num_cells(0) == 50 and len(cells._runs[0]) == 1


def test_trimming_after_a_copy_keeps_shared_cells_shared() -> None:
    """Sequence 1 copied sequence 0's first 10 cells; 0 then speculates: the 10 cells count
    once, the rest once each."""
    cells = CellMap()
    cells.computed(0, 0, 10)
    cells.copied(0, 1, 10)
    cells.computed(0, 10, 6)
    cells.trimmed(0, 12)
    cells.computed(0, 12, 3)
    assert cells.num_cells(0) == 15 and cells.num_used() == 15


# -- the speculator's kinds of lookup --------------------------------------------------------------


def first_drafts(prompt: list[int]) -> dict[int, tuple[int, ...]]:
    """What a fresh AUTO speculator sends for a request that has just its prompt, alone, at the
    box's costs."""
    return propose(*speculating(prompt))


def speculating(prompt: list[int]) -> tuple[Speculator, Request]:
    """A fresh AUTO speculator at the box's costs and a request that has just its prompt."""
    spec = Speculator()
    spec.costs.calibrate(BOX.items())
    auto = SpeculativeParams(SpeculativeMode.AUTO)
    stop = StoppingParams(max_tokens=40)
    request = Request(
        GenerationRequest("r", tuple(prompt), SamplingParams(), stop, speculative=auto)
    )
    request.slot_id = 0
    return spec, request


def propose(spec: Speculator, request: Request) -> dict[int, tuple[int, ...]]:
    """The speculator's drafts for the request alone in a decode-only tick."""
    return spec.propose([request], num_rows=1, room=64, n_ctx=4096, has_prefill=False)


def test_an_ambiguous_match_waits_for_evidence_an_unambiguous_one_drafts_at_once() -> None:
    """The prompt ends with a 4-token suffix it held twice before: followed by the same token
    both times, the draft is sent from the first decode on (the long prior pays); followed by
    different tokens, the same lookup starts from the ambiguous prior, which does not pay."""
    gram = [10, 11, 12, 13]
    same = [*gram, *range(20, 36), 5, *gram, *range(20, 36), 6, *gram]
    other = [*gram, *range(40, 56), 5, *gram, *range(20, 36), 6, *gram]
    assert first_drafts(same) == {0: tuple(range(20, 20 + len(first_drafts(same)[0])))}
    assert first_drafts(other) == {}


def test_a_shadow_drafts_first_token_is_learned_from_as_soon_as_it_is_generated() -> None:
    """An ambiguous lookup is not sent (its prior does not pay) but kept as a shadow: its first
    token counts for the ambiguous estimate's p the moment that token is generated, its further
    tokens for p_next once one of them differs."""
    gram = [10, 11, 12, 13]
    spec, request = speculating([*gram, *range(40, 56), 5, *gram, *range(20, 36), 6, *gram])
    assert propose(spec, request) == {}
    estimate = spec._states[request.key].of(AMBIGUOUS)
    request.tokens.append(20)  # the shadow's first token
    spec.observe_tokens(request)
    assert (estimate.n, estimate.p) == (
        1,
        pytest.approx(AMBIGUOUS_PRIOR + (1 - AMBIGUOUS_PRIOR) / 3),
    )
    assert estimate.n_next == 0
    request.tokens.append(99)  # its second token differs
    spec.observe_tokens(request)
    assert (estimate.n, estimate.n_next, estimate.p_next) == (1, 1, pytest.approx(0.5 - 0.5 / 3))


def test_failing_short_lookups_hold_back_a_long_lookups_untested_prior() -> None:
    """A long lookup drafts at once on its prior in a request whose short lookups are untested
    (a copy from the start); in one whose short lookups failed (free writing) it waits, until a
    verified long draft of its own replaces the prior."""
    gram = [10, 11, 12, 13]
    prompt = [*gram, *range(20, 36), 5, *gram, *range(20, 36), 6, *gram]
    spec, request = speculating(prompt)
    assert propose(spec, request)  # and makes the request's state
    state = spec._states[request.key]
    for _ in range(3):
        state.of(SHORT).record(0, 2)
    assert propose(spec, request) == {}
    state.of(LONG).record(3, 3)
    assert propose(spec, request)


def test_acceptance_samples_while_the_draft_agrees() -> None:
    """The rule both runners (engine/runner.py and testing.FakeRunner) sample by, and the
    scheduler counts by: output i + 1 only after output i matched draft token i + 1."""
    chunk = Chunk(0, "a", 10, (7, 1, 2, 3), True, num_draft=3)  # decode token 7, draft 1 2 3
    assert acceptance.accepts(chunk, 0, 1)
    assert not acceptance.accepts(chunk, 0, 9), "a disagreement ends the sampling"
    assert acceptance.accepts(chunk, 2, 3)
    assert not acceptance.accepts(chunk, 3, 4), "the last output has no draft token after it"
    assert acceptance.num_accepted(chunk, [1, 2, 3, 4]) == 3
    assert acceptance.num_accepted(chunk, [1, 5, 3]) == 1
    assert acceptance.num_accepted(chunk, [1, 2]) == 2
    assert chunk.num_accepted([9]) == 0
    pad = Chunk(0, "a", 10, (7, 1, 2), True, num_draft=2, is_pad=True)
    assert not acceptance.accepts(pad, 0, 1), "a pad's rows are never accepted"
    assert acceptance.num_accepted(pad, [1, 2, 3]) == 0
    plain = Chunk(0, "a", 10, (7,), True)
    assert not acceptance.accepts(plain, 0, 7)
