"""Prefix-affinity slot choice and donor selection (no model)."""

from __future__ import annotations

from llama_grpc_server.core.kv.prefix_cache import (
    choose_slot,
    common_prefix_length,
    eviction_order,
    place,
)
from llama_grpc_server.core.kv.ram import RamTier
from llama_grpc_server.core.requests.request import GenerationRequest, Request
from llama_grpc_server.core.scheduling.slot import Slot


def idle(
    slot_id: int, tokens: list[int], used: int = 0, scope: str = "", session: str = ""
) -> Slot:
    return Slot(slot_id, None, tokens, scope, session, used)


def test_common_prefix_length_long_and_short() -> None:
    """Block comparison and the per-token tail agree with a naive scan."""
    a = list(range(1000))
    b = [*list(range(700)), -1, *list(range(701, 1000))]
    assert common_prefix_length(a, b) == 700
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_threshold_is_strict() -> None:
    """A cache covering exactly 10% of the prompt does not win; LRU is used instead."""
    prompt = list(range(100))
    slots = [idle(0, prompt[:10], used=5), idle(1, [], used=1)]
    assert choose_slot(slots, prompt, "", "").slot_id == 1
    slots = [idle(0, prompt[:11], used=5), idle(1, [], used=1)]
    assert choose_slot(slots, prompt, "", "").slot_id == 0


def test_lru_fallback_keeps_long_unrelated_cache() -> None:
    """A tiny unrelated request takes the least recently used slot."""
    slots = [idle(0, [9] * 500, used=1), idle(1, [8] * 10, used=2)]
    assert choose_slot(slots, [1, 2, 3], "", "").slot_id == 0
    slots = [idle(0, [9] * 500, used=3), idle(1, [8] * 10, used=2)]
    assert choose_slot(slots, [1, 2, 3], "", "").slot_id == 1


def test_scope_filters_matches() -> None:
    """Another scope's cache is never chosen for affinity nor used as a donor."""
    prompt = list(range(50))
    slots = [idle(0, prompt, used=9, scope="a"), idle(1, [], used=1, scope="b")]
    p = place(slots, prompt, "b", "")
    assert p.slot_id == 1 and p.num_cached == 0


def test_session_before_similarity() -> None:
    """The session's idle slot wins even if another slot shares a longer prefix."""
    prompt = list(range(50))
    slots = [idle(0, prompt, used=9), idle(1, [7], used=1, session="s1")]
    assert choose_slot(slots, prompt, "", "s1").slot_id == 1


def test_donor_counts_only_computed_tokens_of_busy_slot() -> None:
    """A busy slot donates only the tokens whose KV it has computed."""
    prompt = tuple(range(100))
    busy_req = Request(GenerationRequest("busy", prompt))
    busy_req.num_computed = 30
    busy = Slot(0, busy_req)
    p = place([busy, idle(1, [], used=1)], list(prompt), "", "")
    assert p.slot_id == 1 and p.donor_slot_id == 0 and p.donor_tokens == 30


def test_last_token_always_recomputed() -> None:
    """An identical cached prompt reuses all but its last token."""
    prompt = list(range(20))
    p = place([idle(0, prompt)], prompt, "", "")
    assert p.keep == 19


def test_ram_tier_evicts_least_recently_used_by_bytes() -> None:
    """The store stays within its byte bound; a taken entry becomes most recently used."""
    ram = RamTier(max_bytes=250)
    ram.put("", [1, 2, 3], b"a" * 100)
    ram.put("", [4, 5, 6], b"b" * 100)
    key, _ = ram.best("", [1, 2, 3, 9])
    ram.take(key)  # [1,2,3] is now the most recently used
    ram.put("", [7, 8, 9], b"c" * 100)
    assert ram.num_bytes == 200 and ram.num_entries == 2 and ram.evictions == 1
    assert ram.best("", [4, 5, 6, 0]) == (-1, 0), "the LRU entry was evicted"
    assert ram.best("", [1, 2, 3, 0])[1] == 3
    ram.put("", [0], b"x" * 251)  # larger than the whole store: not kept
    assert ram.num_entries == 2


def test_ram_tier_verifies_tokens_and_scope() -> None:
    """Lookups compare the tokens themselves (longest verified prefix wins), never across
    scopes, and always leave the last prompt token to be evaluated."""
    ram = RamTier(max_bytes=10_000)
    ram.put("a", [1, 2, 3, 4, 5], b"short")
    ram.put("a", [1, 2, 9, 9, 9, 9, 9], b"other")
    ram.put("b", [1, 2, 3, 4, 5, 6, 7], b"tenant-b")
    key, n = ram.best("a", [1, 2, 3, 4, 5, 6])
    assert n == 5 and ram.take(key).data == b"short"
    assert ram.best("a", [1, 2, 3, 4, 5])[1] == 4, "last prompt token is re-evaluated"
    assert ram.best("c", [1, 2, 3, 4, 5, 6]) == (-1, 0)
    ram.put("a", [1, 2, 3, 4, 5, 6, 7, 8], b"longer")  # supersedes its prefix entry
    assert ram.num_entries == 3 and ram.best("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])[1] == 8


def test_ram_tier_looks_only_at_entries_beginning_like_the_prompt() -> None:
    """Entries are filed by their first RAM_KEY_TOKENS tokens: a match shorter than that is
    not looked for (it could never pay for a restore), short entries are always looked at,
    equals go to the newest, and dropping entries empties the index."""
    ram = RamTier(max_bytes=10_000)
    ram.put("", [1, 2, 3, 4, 5, 6], b"a")
    ram.put("", [1, 2, 3, 9, 9, 9], b"b")
    ram.put("", [1, 2], b"short")
    assert ram.best("", [1, 2, 3, 4, 5, 6, 7]) == (0, 6)
    assert ram.best("", [1, 2, 3, 7, 7]) == (2, 2), "only the short entry is looked at"
    ram.put("", [1, 2, 3, 4, 5, 6, 8], b"c")  # supersedes entries 0 and 2
    ram.put("", [1, 2, 3, 4, 5, 6, 9], b"d")
    assert ram.num_entries == 3
    assert ram.best("", [1, 2, 3, 4, 5, 6, 7]) == (4, 6), "the newest of equals"
    assert ram.clear() == (3, 3) and ram.best("", [1, 2, 3, 4, 5, 6, 7]) == (-1, 0)
    ram.put("", [5, 5, 5, 5, 5], b"x" * 9_000)
    ram.put("", [6, 6, 6, 6, 6], b"y" * 9_000)  # evicts the first
    assert ram.best("", [5, 5, 5, 5, 5, 5]) == (-1, 0) and ram.evictions == 1


def test_trivial_match_does_not_evict_a_long_cache() -> None:
    """A 5-token prompt sharing only BOS with a 1,000-token cache (20% of the prompt, 0.1% of
    the cache) goes to the least recently used slot instead of destroying that cache."""
    long_cache = [2, *range(100, 1099)]
    slots = [idle(0, long_cache, used=5), idle(1, [], used=1)]
    assert choose_slot(slots, [2, 50, 51, 52, 53], "", "").slot_id == 1
    # the same cache continued by a new turn is still chosen by affinity
    assert choose_slot(slots, [*long_cache, 9, 9], "", "").slot_id == 0


def test_another_live_session_is_the_last_choice() -> None:
    """A session's idle history is not taken while a free slot is idle, however much of the
    prompt it shares (the shared prefix is copied instead); a one-off request likewise."""
    system = list(range(1, 201))
    slots = [idle(0, [*system, 7, 7], used=9, session="a"), idle(1, [], used=1)]
    for session in ("b", ""):
        p = place(slots, [*system, 8, 8], "", session, now_ns=10, live_ns=100)
        assert (p.slot_id, p.donor_slot_id, p.donor_tokens) == (1, 0, 200)


def test_live_sessions_yield_least_recently_used_first() -> None:
    """With every idle slot holding a live session, the least recently used one is taken, not
    the one sharing the longest prefix."""
    slots = [idle(0, list(range(50)), used=5, session="a"), idle(1, [9] * 5, used=3, session="b")]
    assert choose_slot(slots, list(range(60)), "", "c", now_ns=10, live_ns=100).slot_id == 1


def test_a_session_idle_past_live_ns_counts_as_free() -> None:
    """A session idle for live_ns or longer yields like a one-off cache (here: its longer
    prefix wins over the empty slot); live_ns 0 keeps sessions live for ever."""
    prompt = list(range(60))
    slots = [idle(0, prompt[:50], used=5, session="a"), idle(1, [], used=3)]
    assert choose_slot(slots, prompt, "", "c", now_ns=104, live_ns=100).slot_id == 1
    assert choose_slot(slots, prompt, "", "c", now_ns=105, live_ns=100).slot_id == 0
    assert choose_slot(slots, prompt, "", "c", now_ns=10**12, live_ns=0).slot_id == 1


def test_eviction_order_puts_live_sessions_last() -> None:
    """Caches of no live session first (a stale session's among them), then live sessions'
    histories, least recently used first within each."""
    slots = [
        idle(0, [1] * 10, used=5, session="a"),
        idle(1, [2] * 10, used=4),
        idle(2, [3] * 10, used=2, session="stale"),
        idle(3, [4] * 10, used=6, session="b"),
    ]
    order = eviction_order(slots, now_ns=60, live_ns=57)
    assert [s.slot_id for s in order] == [2, 1, 0, 3]
