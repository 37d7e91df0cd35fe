"""Draft-model speculation, its pure parts: whether a draft model's vocabulary is the target's,
how a slot's draft KV is kept in step with the slot's tokens, the batched draft pass's feeds,
and the measured cost of a drafted token. The draft pass itself runs in engine/draft.py (the
only place it can: it decodes with llama.cpp); the Speculator calls it through DraftSource.

Keeping in step, lazily. The draft model has its own llama context (same n_ctx, same sequences:
slot i is sequence i in both) and its own KV. For each slot the drafter remembers the tokens
whose KV its context holds. Before drafting for a slot, the common prefix of those tokens and
the slot's current tokens is kept, the rest removed (llama_memory_seq_rm on the draft context),
and the missing tokens fed, batched with every other drafting slot's in the draft pass's first
llama_decode. Nothing else ever touches the draft KV: there is no event to follow. So whatever
happened to the slot in between is correct by construction: a cancelled or finished request, a
preempted one, a new request in the slot whose prefix the target restored from the slot, RAM or
disk tier (which restore the target's KV only), a resumed answer, a rejected draft's tail, tokens
generated while the request did not draft: each shows up as tokens that differ or are missing,
and only the first draft after it pays for the difference (a prefill of it on the draft model).
A draft context whose cells run out drops the slots that are not drafting (they catch up when
they draft again); one that fails anyway forgets the drafting slots and drafts nothing that tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llama_grpc_server.core.scheduling.plan import Chunk
from llama_grpc_server.core.speculation.policy import MAX_SURPRISE

DRAFT_COST_ALPHA = 0.2  # EWMA weight of one draft pass's measured cost per drafted token


# -- the vocabulary check ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VocabView:
    """What must agree between a target and its draft model: the token count, every token's
    text (llama_vocab_get_text) and the special ids (name -> id, -1 when the model has none)."""

    n_vocab: int
    texts: Sequence[bytes]
    special: Mapping[str, int] = field(default_factory=dict)


def vocab_mismatch(target: VocabView, draft: VocabView) -> str | None:
    """The first difference that makes `draft` unable to draft for `target` (its tokens are
    fed the target's ids and its ids are verified by the target), or None when they agree."""
    if target.n_vocab != draft.n_vocab:
        return f"n_vocab differs: target {target.n_vocab}, draft {draft.n_vocab}"
    for name in sorted(set(target.special) | set(draft.special)):
        t, d = target.special.get(name, -1), draft.special.get(name, -1)
        if t != d:
            return f"special token {name} differs: target {t}, draft {d}"
    for token, (t_text, d_text) in enumerate(zip(target.texts, draft.texts, strict=True)):
        if t_text != d_text:
            return f"token {token} differs: target {t_text!r}, draft {d_text!r}"
    return None


# -- keeping in step ---------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (slice comparisons: C speed on long lists)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def catch_up(held: Sequence[int], current: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(keep, feed) for a slot whose draft KV holds `held` and whose tokens are `current`
    (non-empty): the draft KV keeps its first `keep` tokens (the rest is removed) and takes
    `feed`, current[keep:], which is never empty: its last token's logits give the first draft
    token."""
    keep = min(common_prefix(held, current), len(current) - 1)
    return keep, tuple(current[keep:])


def feed_passes(chunks: Sequence[Chunk], n_batch: int) -> list[list[Chunk]]:
    """The draft pass's first step as llama_decode batches of at most n_batch tokens: the chunks
    in order, a chunk too long for what is left of a batch split across batches, only its last
    part asking for logits (a slot catching up on a long prompt)."""
    passes: list[list[Chunk]] = [[]]
    room = n_batch
    for chunk in chunks:
        start, tokens = chunk.start_pos, chunk.tokens
        while tokens:
            if room == 0:
                passes.append([])
                room = n_batch
            part = tokens[:room]
            tokens = tokens[len(part) :]
            last = not tokens
            passes[-1].append(
                Chunk(chunk.slot_id, chunk.request_id, start, part, chunk.wants_logits and last)
            )
            start += len(part)
            room -= len(part)
    return [p for p in passes if p]


# -- the draft pass, as the Speculator sees it ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class DraftWant:
    """A slot to draft for: its tokens (the last one not yet fed to the target) and how many
    draft tokens."""

    slot_id: int
    tokens: Sequence[int]
    k: int


@dataclass(frozen=True, slots=True)
class DraftPass:
    """What one draft pass made: slot_id -> draft tokens, its wall and CPU milliseconds and the
    tokens it fed the draft model (catch-up and draft steps)."""

    drafts: Mapping[int, tuple[int, ...]]
    ms: float = 0.0
    cpu_ms: float = 0.0
    num_fed: int = 0

    @property
    def num_drafted(self) -> int:
        return sum(len(d) for d in self.drafts.values())


class DraftSource(Protocol):
    """The draft model (engine/draft.py's DraftModel): one batched draft pass for every wanted
    slot, k greedy steps, each step one llama_decode over all of them."""

    def draft(self, wants: Sequence[DraftWant]) -> DraftPass: ...


class DraftCosts:
    """The measured milliseconds of a drafted token (a draft pass's time over the tokens it
    drafted, catch-up included): an EWMA started from the warm-up's timed draft steps, each pass
    moving it as if it were at most MAX_SURPRISE off (a pass catching up on a long prompt is one
    dear pass, not the price of every later token). None until measured."""

    def __init__(self) -> None:
        self.token_ms: float | None = None

    def calibrate(self, token_ms: float) -> None:
        if token_ms > 0:
            self.token_ms = token_ms

    def observe(self, drafted: int, ms: float) -> None:
        if drafted <= 0 or ms <= 0:
            return
        got = ms / drafted
        old = self.token_ms
        if old is None:
            self.token_ms = got
            return
        got = min(max(got, old / MAX_SURPRISE), old * MAX_SURPRISE)
        self.token_ms = old + DRAFT_COST_ALPHA * (got - old)
