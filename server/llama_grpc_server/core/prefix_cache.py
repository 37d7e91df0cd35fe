"""Prefix-cache policy: which idle slot a request takes and which slot's KV it may copy.
Pure functions over slots; the runner applies the resulting seq_rm / seq_cp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llama_grpc_server.core.slot import Slot

AFFINITY_MIN_RATIO = 0.10
"""An idle slot's cache wins over LRU only when it covers more than this share of the prompt."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: long shared prefixes are the common case.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_prefix(slot: Slot, tokens: Sequence[int], scope: str) -> int:
    """Tokens of `tokens` whose KV `slot` already holds and may share (same scope only).
    At least the last token is always left to compute, for its logits."""
    if slot.cache_scope != scope:
        return 0
    return min(common_prefix_length(slot.kv_tokens(), tokens), len(tokens) - 1)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: its slot, how much of that slot's cache it keeps, and an optional
    donor slot whose longer prefix is copied instead."""

    slot_id: int
    keep: int
    donor_slot_id: int = -1
    donor_tokens: int = 0

    @property
    def num_cached(self) -> int:
        return max(self.keep, self.donor_tokens)


def choose_slot(slots: Sequence[Slot], tokens: Sequence[int], scope: str, session_id: str) -> Slot:
    """Session affinity, then the idle slot with the longest usable prefix if it covers more than
    10% of the prompt, else the least recently used idle slot. `slots` must hold an idle one."""
    idle = [s for s in slots if s.is_idle]
    if session_id:
        for slot in idle:
            if slot.session_id == session_id and slot.cache_scope == scope:
                return slot
    best, best_len = None, 0
    for slot in idle:
        n = usable_prefix(slot, tokens, scope)
        if n > best_len:
            best, best_len = slot, n
    if best is not None and best_len > AFFINITY_MIN_RATIO * len(tokens):
        return best
    return min(idle, key=lambda s: (s.last_used_ns, s.slot_id))


def place(slots: Sequence[Slot], tokens: Sequence[int], scope: str, session_id: str) -> Placement:
    """Choose a slot and decide what KV it reuses: its own LCP, or a longer prefix copied from
    any other slot of the same scope (idle or busy, counting only computed tokens)."""
    slot = choose_slot(slots, tokens, scope, session_id)
    keep = usable_prefix(slot, tokens, scope)
    donor, donor_len = -1, keep
    for other in slots:
        if other is slot:
            continue
        n = usable_prefix(other, tokens, scope)
        if n > donor_len:
            donor, donor_len = other.slot_id, n
    if donor < 0:
        return Placement(slot.slot_id, keep)
    return Placement(slot.slot_id, keep, donor, donor_len)
