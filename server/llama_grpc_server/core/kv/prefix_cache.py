"""Prefix-cache policy: which idle slot a request takes and which slot's KV it may copy.
Pure functions over slots; the runner applies the resulting seq_rm / seq_cp. (Saved states of
caches no slot keeps: core.kv.ram, core.kv.disk.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llama_grpc_server.core.scheduling.slot import Slot

AFFINITY_MIN_RATIO = 0.10
"""An idle slot's cache wins over LRU only when the shared prefix covers more than this share of
the prompt and of the slot's cache: a BOS-only match of a short prompt (1 token is 20% of 5)
must not evict a long conversation it cannot use (measured: `llama-grpc stream "Once upon a
time"` took the slot of an unrelated cached prompt, whose next turn then recomputed all)."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Pass two lists or two tuples: the block comparison below needs slices of one type."""
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


def holds_live_session(slot: Slot, now_ns: int, live_ns: int) -> bool:
    """An idle slot whose cache is a session's history that the session may still continue:
    used within the last `live_ns` (0 = a session stays live for ever)."""
    return bool(slot.session_id and slot.idle_cache) and (
        live_ns <= 0 or now_ns - slot.last_used_ns < live_ns
    )


def eviction_order(slots: Sequence[Slot], now_ns: int, live_ns: int) -> list[Slot]:
    """Idle slots in the order their caches should go: caches of no live session first, then
    live sessions' histories; least recently used first within each."""
    return sorted(
        (s for s in slots if s.is_idle),
        key=lambda s: (holds_live_session(s, now_ns, live_ns), s.last_used_ns, s.slot_id),
    )


def choose_slot(
    slots: Sequence[Slot],
    tokens: Sequence[int],
    scope: str,
    session_id: str,
    *,
    now_ns: int = 0,
    live_ns: int = 0,
) -> Slot:
    """The session's own idle slot; else an idle slot holding no live session's history (the
    one with the longest usable prefix if it covers more than 10% of the prompt and of that
    slot's cache, else the least recently used); another live session's slot only when no
    other is idle, least recently used first. A shared prefix held elsewhere is copied
    (place()), so taking a free slot costs nothing and keeps every history. `slots` must hold
    an idle one."""
    idle = [s for s in slots if s.is_idle]
    if session_id:
        for slot in idle:
            if slot.session_id == session_id and slot.cache_scope == scope:
                return slot
    free = [s for s in idle if not holds_live_session(s, now_ns, live_ns)]
    if not free:
        return eviction_order(idle, now_ns, live_ns)[0]
    best, best_len = None, 0
    for slot in free:
        n = usable_prefix(slot, tokens, scope)
        if n > best_len:
            best, best_len = slot, n
    if (
        best is not None
        and best_len > AFFINITY_MIN_RATIO * len(tokens)
        and best_len > AFFINITY_MIN_RATIO * best.num_kv_tokens
    ):
        return best
    return min(free, key=lambda s: (s.last_used_ns, s.slot_id))


def place(
    slots: Sequence[Slot],
    tokens: Sequence[int],
    scope: str,
    session_id: str,
    *,
    now_ns: int = 0,
    live_ns: int = 0,
) -> Placement:
    """Choose a slot (choose_slot) and decide what KV it reuses: its own LCP, or a longer
    prefix copied from any other slot of the same scope (idle or busy, counting only computed
    tokens)."""
    slot = choose_slot(slots, tokens, scope, session_id, now_ns=now_ns, live_ns=live_ns)
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
