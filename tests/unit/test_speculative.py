"""Speculative decoding, the pure parts: the n-gram drafter (core.ngram), the tick cost model,
the acceptance estimate and the AUTO policy (core.spec_policy)."""

from __future__ import annotations

import random
import time

import pytest

from llama_grpc_server.core.kv_cells import CellMap
from llama_grpc_server.core.ngram import NgramIndex
from llama_grpc_server.core.spec_policy import (
    MIN_GAIN,
    Acceptance,
    DraftOption,
    TickCostModel,
    choose_drafts,
    expected_accepted,
    prior_shape,
)

# Measured on the development box (spec_policy.PRIOR_SHAPE's source).
BOX = ((1, 13.2), (5, 38.8), (9, 55.2), (17, 90.4))


def reference_draft(tokens: list[int], n_min: int, n_max: int, k: int) -> tuple[int, ...]:
    """The drafter's contract by brute force: longest suffix first, most recent occurrence."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tuple(tokens[end : end + k])
    return ()


def box_costs() -> TickCostModel:
    costs = TickCostModel()
    costs.calibrate(BOX)
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
        assert index.draft(tokens, k) == reference_draft(tokens, n_min, n_max, k)


def test_bad_ngram_range_is_refused() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex(3, 2)


def test_lookup_takes_microseconds_on_a_long_prompt() -> None:
    """After the prompt is indexed once, a step (one new token + a lookup) is cheap."""
    rng = random.Random(0)
    tokens = [rng.randint(0, 5000) for _ in range(4000)]
    index = NgramIndex(2, 4)
    index.draft(tokens, 8)
    start = time.perf_counter()
    for _ in range(1000):
        tokens.append(rng.randint(0, 5000))
        index.draft(tokens, 8)
    per_step_us = (time.perf_counter() - start) * 1e3
    assert per_step_us < 200, per_step_us  # ~10 us measured; generous for a loaded box


# -- cost model ------------------------------------------------------------------------------------


def test_cost_model_is_unknown_until_measured() -> None:
    assert TickCostModel().tick_ms(4) is None


def test_calibrated_points_and_linear_between() -> None:
    costs = box_costs()
    assert costs.tick_ms(1) == pytest.approx(13.2)
    assert costs.tick_ms(9) == pytest.approx(55.2)
    assert costs.tick_ms(3) == pytest.approx((13.2 + 38.8) / 2)


def test_beyond_the_measured_points_along_the_prior_shape() -> None:
    """Only T(1) measured: T(N) is T(1) times the box's shape; past the last point likewise."""
    costs = TickCostModel()
    costs.observe(1, 20.0)
    assert costs.tick_ms(9) == pytest.approx(20.0 * prior_shape(9))
    box = box_costs()
    assert box.tick_ms(33) == pytest.approx(90.4 * prior_shape(33) / prior_shape(17))


def test_a_disturbed_calibration_point_is_taken_down() -> None:
    """One row measured at 253 ms (another process had the CPU) but two at 25 ms: T(1) is
    taken as 25 ms, not 253 (which would make every draft look free)."""
    costs = TickCostModel()
    costs.calibrate([(1, 253.4), (2, 25.5), (4, 34.1), (8, 59.8), (16, 86.1)])
    assert costs.tick_ms(1) == pytest.approx(25.5)
    assert costs.tick_ms(16) == pytest.approx(86.1)


def test_a_disturbed_tick_moves_its_point_as_if_three_times_off() -> None:
    costs = box_costs()
    costs.observe(1, 13.2 * 20)
    assert costs.tick_ms(1) == pytest.approx(13.2 + 0.1 * (3 * 13.2 - 13.2))


def test_observations_move_a_point_by_ewma_and_keep_it_monotone() -> None:
    """A measured tick moves its point a tenth of the way; a noisy cheap reading never makes
    more rows look cheaper than fewer."""
    costs = box_costs()
    costs.observe(5, 48.8)
    assert costs.tick_ms(5) == pytest.approx(39.8)
    costs.observe(3, 60.0)  # first seen: from its estimate (26.5), a tenth of the way
    assert costs.tick_ms(3) == pytest.approx(26.5 + 3.35)
    for _ in range(50):
        costs.observe(9, 5.0)
    assert costs.tick_ms(9) >= costs.tick_ms(5)  # type: ignore[operator]


# -- acceptance ------------------------------------------------------------------------------------


def test_acceptance_is_an_ewma_over_verified_tokens() -> None:
    """4 of 4 accepted: four 1s; 1 of 4: a 1 and a 0 (the tokens after the rejected one were
    never verified); nothing verified changes nothing."""
    a = Acceptance(0.0)
    a.record(4, 4)
    assert a.p == pytest.approx(1 - 0.8**4)
    b = Acceptance(0.5)
    b.record(1, 4)
    assert b.p == pytest.approx((1 - 0.5 * 0.8) * 0.8)
    b.record(0, 0)
    assert b.p == pytest.approx(0.48)


def test_acceptance_backs_off_after_a_few_rejections() -> None:
    """After a long run of full acceptances, three drafts rejected at once halve p."""
    a = Acceptance()
    for _ in range(20):
        a.record(8, 8)
    assert a.p > 0.99
    for _ in range(3):
        a.record(0, 8)
    assert a.p < 0.52


def test_expected_accepted_is_the_geometric_sum() -> None:
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.9, 0) == 0


# -- policy ----------------------------------------------------------------------------------------


def test_no_draft_at_low_acceptance_on_this_box() -> None:
    """At B = 1 a draft row costs ~6 ms against a 13 ms tick: p = 0.6 never pays."""
    chosen = choose_drafts(1, [DraftOption(0, 8, 0.6)], box_costs().tick_ms, 64)
    assert chosen == {}


def test_high_acceptance_drafts_the_best_length() -> None:
    """p = 0.95 at B = 1: about 10 tokens maximise tokens per ms on the box's costs (~1.78x
    the rate of plain decoding); a longer draft adds less than it costs."""
    chosen = choose_drafts(1, [DraftOption(0, 16, 0.95)], box_costs().tick_ms, 64)
    assert chosen == {0: 10}
    rate = (1 + expected_accepted(0.95, 10)) / 64.0
    assert rate / (1 / 13.2) > MIN_GAIN


def test_forced_drafts_whatever_it_costs_within_room() -> None:
    """Mode ON takes its whole draft even at p = 0, but never more than the room."""
    options = [DraftOption(0, 6, 0.0, is_forced=True), DraftOption(1, 6, 0.0, is_forced=True)]
    assert choose_drafts(2, options, box_costs().tick_ms, 8) == {0: 6, 1: 2}


def test_unknown_costs_draft_only_forced() -> None:
    options = [DraftOption(0, 4, 0.99), DraftOption(1, 3, 0.1, is_forced=True)]
    assert choose_drafts(2, options, TickCostModel().tick_ms, 64) == {1: 3}


def test_the_better_request_gets_the_draft_tokens() -> None:
    """Two decoding slots, one repeating its input (p 0.97) and one not (p 0.3): only the
    first drafts."""
    options = [DraftOption(0, 8, 0.3), DraftOption(1, 8, 0.97)]
    chosen = choose_drafts(2, options, box_costs().tick_ms, 64)
    assert set(chosen) == {1} and chosen[1] >= 4


def test_no_draft_when_the_batch_is_full() -> None:
    """With a flat per-row cost (each extra row costs as much as a decode row) a draft at
    p = 0.9 never yields 10 % more tokens per ms."""
    costs = TickCostModel()
    costs.calibrate([(1, 6.0), (64, 384.0)])  # 6 ms per row, exactly linear
    options = [DraftOption(i, 8, 0.9) for i in range(16)]
    assert choose_drafts(16, options, costs.tick_ms, 64) == {}


def test_room_bounds_the_auto_drafts() -> None:
    costs = TickCostModel()
    costs.calibrate([(1, 10.0), (64, 11.0)])  # rows nearly free
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
