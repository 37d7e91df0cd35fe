"""The exact-match acceptance rule of a speculative decode, in one place: the runner (and the fake
runner of testing.py, so it cannot drift from the real one) samples a chunk's outputs in order and
stops after the first that disagrees with the draft; the scheduler counts the draft tokens the
sampled ones accepted (plan.Chunk.num_accepted)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plan.py imports this module
    from llama_grpc_server.core.scheduling.plan import Chunk


def accepts(chunk: Chunk, i: int, token: int) -> bool:
    """Whether `token`, sampled at the chunk's output i, accepts the draft token at that position
    (tokens[i + 1]), so that output i + 1 is sampled too. The last output has no draft token
    after it, and a pad's rows are never accepted."""
    return not chunk.is_pad and i < chunk.num_draft and token == chunk.tokens[i + 1]


def num_accepted(chunk: Chunk, sampled: Sequence[int]) -> int:
    """Draft tokens the sampled ones (sampled[i] at the position after tokens[i]) accept, up to
    the first disagreement."""
    n = 0
    while n < len(sampled) and accepts(chunk, n, sampled[n]):
        n += 1
    return n
