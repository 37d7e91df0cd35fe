"""The near-tie comparison the model and end-to-end tests use (tests/support/greedy.py): it passes
only where a real batch-shape rounding can part two greedy runs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.support.greedy import assert_greedy_equal, assert_text_greedy_equal


@dataclass(frozen=True)
class Top:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class Step:
    token_id: int
    token: str
    top: tuple[Top, ...]


def step(token_id: int, token: str, alt_id: int, alt: str, gap: float) -> Step:
    return Step(token_id, token, (Top(token_id, token, -0.1), Top(alt_id, alt, -0.1 - gap)))


# " the" / " cat" are near-ties (0.4 nats), " sat" is not (3 nats)
STEPS = [
    step(1, " the", 11, " then", 0.4),
    step(2, " cat", 12, " dog", 0.4),
    step(3, " sat", 13, " ran", 3.0),
]
REFERENCE = " the cat sat"


@pytest.mark.parametrize(
    ("got", "passes"),
    [
        (" the cat sat", True),
        (" the dog ran", True),  # the second choice at a near-tie, then anything
        (" then dog", True),  # the second choice extends the first: " the" -> " then"
        (" the cat", False),  # stops inside the reference
        (" the cat sXt", False),  # differs where the top two were 3 nats apart
        (" the cow sat", False),  # not the second choice
        (" the cat sat more", False),  # runs past the reference
    ],
)
def test_text_comparison(got: str, passes: bool) -> None:
    if passes:
        assert_text_greedy_equal(REFERENCE, STEPS, got)
    else:
        with pytest.raises(AssertionError):
            assert_text_greedy_equal(REFERENCE, STEPS, got)


@pytest.mark.parametrize(
    ("got", "passes"),
    [
        ([1, 2, 3], True),
        ([1, 12, 9], True),
        ([11, 5, 6], True),
        ([1, 2], False),
        ([1, 2, 13], False),
        ([1, 14, 3], False),
        ([1, 2, 3, 4], False),
    ],
)
def test_token_comparison(got: list[int], passes: bool) -> None:
    if passes:
        assert_greedy_equal([1, 2, 3], STEPS, got)
    else:
        with pytest.raises(AssertionError):
            assert_greedy_equal([1, 2, 3], STEPS, got)
