"""The seeded draw keyed by position (engine/sampler.py): u_i is SplitMix64's output number i
for the seed, the draw cuts [0, 1) by probability, and a chain's draw at a position is the same
whatever was drawn before (what lets a resumed answer go on as the undisturbed one:
tests/e2e/test_resume.py). llama.cpp's samplers on candidate arrays, no model."""

from __future__ import annotations

import math

import llama_cpp
import numpy as np
import pytest

from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.engine.sampler import (
    SMALL_DRAW,
    Candidates,
    _chain,
    draw,
    position_uniform,
)

# SplitMix64 seeded with 0: its first outputs (the reference implementation's)
SPLITMIX64_SEED_0 = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)


def test_position_uniform_is_splitmix64_output_i() -> None:
    for i, value in enumerate(SPLITMIX64_SEED_0):
        assert position_uniform(0, i) == (value >> 11) * 2.0**-53
    draws = [position_uniform(7, i) for i in range(10_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert position_uniform(7, 3) != position_uniform(8, 3)


@pytest.mark.parametrize("size", [2, SMALL_DRAW + 2])
def test_draw_cuts_the_unit_interval_by_probability(size: int) -> None:
    """Equal logits split [0, 1) evenly, in order; a -inf logit is never drawn (in plain Python
    for a few candidates, numpy for many)."""
    logits = [0.0] * size
    logits[1] = -math.inf  # (a weight of 0: with size 2, every u draws index 0)
    weights = [0.0 if i == 1 else 1.0 for i in range(size)]
    total = sum(weights)
    for u in (0.0, 0.49 / total, 0.99 / total, 1.01 / total % 1, 0.5, 0.999999):
        expected = next(i for i in range(size) if sum(weights[: i + 1]) > u * total)
        assert draw(logits, u) == expected
        assert draw(np.array(logits, dtype=np.float32), u) == expected
    assert draw([math.log(3.0), 0.0], 0.74) == 0 and draw([math.log(3.0), 0.0], 0.76) == 1


def test_the_chain_draws_by_position_whatever_came_before() -> None:
    """A sampling chain (top-k, top-p, min-p, temperature, then the position draw) on the same
    candidates: the token at position 5 does not depend on the positions drawn before, and is
    the draw of u_5 from the candidates' tempered softmax."""
    rng = np.random.default_rng(0)
    row = rng.normal(size=1000).astype(np.float32) * 2
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=7)

    def at(position: int, history: int) -> int:
        chain, position_draw = _chain(params, 7, len(row))
        assert position_draw is not None
        cand = Candidates(len(row))
        try:
            for p in range(history):
                position_draw.position = p
                cand.load(row)
                llama_cpp.llama_sampler_apply(chain, cand.ref)
            position_draw.position = position
            cand.load(row)
            llama_cpp.llama_sampler_apply(chain, cand.ref)
            return cand.selected
        finally:
            llama_cpp.llama_sampler_free(chain)

    assert at(5, 0) == at(5, 5) == at(5, 17)
    expected = draw(row / np.float32(0.8), position_uniform(7, 5))
    assert at(5, 0) == expected
    assert len({at(p, 0) for p in range(40)}) > 5  # the positions draw differently
