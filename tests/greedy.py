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
    """assert_greedy_equal for a client that reports text only: the first differing character
    is mapped to the reference token that holds it, which must be a near-tie."""
    if got == reference:
        return
    at = next(
        (i for i, (x, y) in enumerate(zip(reference, got, strict=False)) if x != y),
        min(len(reference), len(got)),
    )
    pos = 0
    for i, step in enumerate(steps):
        pos += len(step.token)
        if pos > at:
            top = step.top
            assert len(top) >= 2, f"{what}: the reference needs top_logprobs >= 2"
            gap = top[0].logprob - top[1].logprob
            assert gap < TIE, (
                f"{what}: differs at character {at}, in token {i} ({step.token!r}), where the "
                f"reference's top two were {gap:.3f} apart (a near-tie is < {TIE}): {got!r}"
            )
            return
    raise AssertionError(f"{what}: {got!r} runs past the reference {reference!r}")


class _StepText(_Step, Protocol):
    @property
    def token(self) -> str: ...
