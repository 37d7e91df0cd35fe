"""SlotTable: the only place a slot is given a request or freed (no model)."""

from __future__ import annotations

from llama_grpc_server.core.requests.request import GenerationRequest, Request
from llama_grpc_server.core.scheduling.slot import SlotTable


def table() -> SlotTable:
    ticks = iter(range(1, 100))
    return SlotTable(3, lambda: next(ticks) * 1_000)


def request(rid: str, scope: str = "", session: str = "") -> Request:
    return Request(GenerationRequest(rid, (1, 2, 3, 4), session_id=session, cache_scope=scope))


def test_assign_gives_the_slot_the_request_and_its_scope_and_session() -> None:
    slots = table()
    slots[1].idle_cache, slots[1].persisted_tokens = [9, 9], 2
    r = request("a", scope="t", session="s")
    slots.assign(slots[1], r)
    assert r.slot_id == 1 and slots[1].request is r and slots.find(r.key) is r
    assert (slots[1].idle_cache, slots[1].persisted_tokens) == ([], 0)
    assert (slots[1].cache_scope, slots[1].session_id) == ("t", "s")
    assert slots.requests() == [r] and slots.has_idle and len(slots) == 3


def test_free_keeps_the_computed_tokens_as_cache_and_stamps_the_last_use() -> None:
    slots = table()
    kept, dropped = request("a"), request("b")
    slots.assign(slots[0], kept)
    slots.assign(slots[2], dropped)
    kept.num_computed = dropped.num_computed = 3
    assert slots.free(kept, keep_cache=True) is slots[0]
    assert slots[0].is_idle and slots[0].idle_cache == [1, 2, 3] and slots[0].last_used_ns == 1_000
    assert slots.free(dropped, keep_cache=False) is slots[2]
    assert slots[2].idle_cache == [] and slots[2].last_used_ns == 2_000
    assert slots.free(kept, keep_cache=True) is None  # it holds no slot any more
    assert slots.requests() == []


def test_evict_frees_the_slot_without_cache_or_a_new_last_use() -> None:
    slots = table()
    r = request("a")
    slots.assign(slots[0], r)
    r.num_computed = 4
    assert slots.evict(r) is slots[0]
    assert slots[0].is_idle and slots[0].idle_cache == [] and slots[0].last_used_ns == 0
    assert r.slot_id == -1
