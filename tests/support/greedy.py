"""Greedy output equality up to the batch-shape rounding of llama.cpp's CPU kernels.

A token's logits depend on the shape of the forward pass that computed them: one row goes
through llama.cpp's matrix-vector path, four or more rows through its tiled matrix-matrix
kernels (tinyBLAS, the repacked Q4_K gemm), which add in another order. Measured on Gemma 3
270M (5 prompts x 40 steps, each step's row alone and first in a 4- and a 16-row pass), the
logit gap between a step's top two tokens moved by up to 0.38 with the x86-64-v3 build and 0.41
with the AVX-512 one (99th percentile 0.32 / 0.26, median 0). So two greedy
runs whose passes have different shapes (batched with other requests, verifying a draft,
padded) may part where the model's top two tokens are closer than that, and only there.

`assert_greedy_equal` checks exactly that: the runs are equal, or they first differ at a step
where the reference's top two tokens are less than TIE apart and the other run took the
reference's second choice. A wrong token anywhere else (a bad draft accepted, a token lost or
repeated, a KV cell leaked into another sequence) still fails. The reference must carry logprobs
with top_logprobs >= 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

TIE = 1.0  # nats: 2.4x the largest move of a top-two gap measured between batch shapes (0.41)


class _Top(Protocol):
    @property
    def token_id(self) -> int: ...

    @property
    def logprob(self) -> float: ...


class _Step(Protocol):
    @property
    def token_id(self) -> int: ...

    @property
    def top(self) -> Sequence[_Top]: ...


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (one ending early counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_equal(
    reference: Sequence[int], steps: Sequence[_Step], got: Sequence[int], what: str = ""
) -> None:
    """got equals the greedy reference, or parts from it only at a near-tie (see the module)."""
    i = first_difference(reference, got)
    if i is None:
        return
    assert i < len(reference) and i < len(got), (
        f"{what}: lengths differ ({len(reference)}, {len(got)})"
    )
    assert len(steps) == len(reference), f"{what}: the reference has no logprobs for every token"
    top = steps[i].top
    assert len(top) >= 2, f"{what}: the reference needs top_logprobs >= 2"
    gap = top[0].logprob - top[1].logprob
    assert gap < TIE and got[i] == top[1].token_id, (
        f"{what}: differs at token {i} of {len(reference)}: got {got[i]}, the reference's top two "
        f"were {top[0].token_id} / {top[1].token_id}, {gap:.3f} apart (a near-tie is < {TIE})"
    )


def assert_text_greedy_equal(
    reference: str, steps: Sequence[_StepText], got: str, what: str = ""
) -> None:
    """assert_greedy_equal for a client that reports text only. The reference's tokens must
    spell its text. The first differing character lies in reference token i (or starts it, and
    then token i - 1 may be the one that differs: ' the' against ' then'); got must take the
    second choice of such a token whose top two are a near-tie, and run past it: a got that
    stops inside the reference, or that differs anywhere else, fails."""
    if got == reference:
        return
    starts, pos = [], 0
    for step in steps:
        starts.append(pos)
        pos += len(step.token)
    assert pos == len(reference), f"{what}: the reference's tokens do not spell its text"
    at = next(
        (i for i, (x, y) in enumerate(zip(reference, got, strict=False)) if x != y),
        min(len(reference), len(got)),
    )
    assert at < len(reference), f"{what}: {got!r} runs past the reference {reference!r}"
    assert at < len(got), f"{what}: {got!r} stops inside the reference {reference!r}"
    holder = max(i for i, start in enumerate(starts) if start <= at)
    candidates = [holder] + ([holder - 1] if starts[holder] == at and holder > 0 else [])
    for i in candidates:
        top = steps[i].top
        assert len(top) >= 2, f"{what}: the reference needs top_logprobs >= 2"
        tail, alt = got[starts[i] :], top[1].token
        if top[0].logprob - top[1].logprob < TIE and tail.startswith(alt) and len(tail) > len(alt):
            return
    gaps = [(i, steps[i].top[0].logprob - steps[i].top[1].logprob) for i in candidates]
    raise AssertionError(
        f"{what}: differs at character {at}, in reference token(s) {gaps} (index, top-two gap), "
        f"not a near-tie (< {TIE}) whose second choice got took: {got!r} vs {reference!r}"
    )


class _StepText(_Step, Protocol):
    @property
    def token(self) -> str: ...
