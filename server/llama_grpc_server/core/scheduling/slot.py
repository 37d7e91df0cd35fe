"""Slots: one llama.cpp sequence id, the request it serves and the tokens whose KV it holds
(Slot); the pool of them (SlotTable), the only place a slot is given a request or freed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from llama_grpc_server.core.requests.request import Request, RequestState


@dataclass(slots=True)
class Slot:
    """A sequence of the unified KV cache. Idle slots keep their KV as prefix cache."""

    slot_id: int
    request: Request | None = None
    idle_cache: list[int] = field(default_factory=list)  # token ids whose KV it keeps when idle
    cache_scope: str = ""
    session_id: str = ""
    last_used_ns: int = 0
    persisted_tokens: int = 0  # of idle_cache already saved to the disk tier

    @property
    def is_idle(self) -> bool:
        return self.request is None

    @property
    def state(self) -> str:
        if self.request is None:
            return "idle"
        return "generating" if self.request.state is RequestState.GENERATING else "prefilling"

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV is computed in this sequence right now."""
        if self.request is not None:
            return self.request.num_computed
        return len(self.idle_cache)

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV this sequence holds, in position order."""
        if self.request is not None:
            return self.request.tokens[: self.request.num_computed]
        return self.idle_cache


class SlotTable(Sequence[Slot]):
    """The slot pool, indexed by slot id. Whom a slot serves changes here only: assign() gives
    an idle slot a request, free() and evict() take it back. What a slot's KV holds is the
    KvCacheManager's to change (it edits idle_cache and persisted_tokens); the others read."""

    def __init__(self, n_slots: int, clock_ns: Callable[[], int]) -> None:
        self._slots = [Slot(i) for i in range(n_slots)]
        self._clock_ns = clock_ns  # stamps a freed slot's last use (LRU of idle caches)

    @overload
    def __getitem__(self, index: int) -> Slot: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Slot]: ...
    def __getitem__(self, index: int | slice) -> Slot | Sequence[Slot]:
        return self._slots[index]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def requests(self) -> list[Request]:
        """The requests in slots, in slot order."""
        return [s.request for s in self._slots if s.request is not None]

    @property
    def has_idle(self) -> bool:
        return any(s.request is None for s in self._slots)

    def find(self, key: str) -> Request | None:
        """The request of that key in a slot, or None."""
        return next((r for r in self.requests() if r.key == key), None)

    def assign(self, slot: Slot, request: Request) -> None:
        """Give an idle slot the request (its cache is the request's now: the KvCacheManager
        prepared what it keeps), under the request's cache scope and session."""
        slot.request, slot.idle_cache, slot.persisted_tokens = request, [], 0
        slot.cache_scope, slot.session_id = request.spec.cache_scope, request.spec.session_id
        request.slot_id = slot.slot_id

    def free(self, request: Request, *, keep_cache: bool) -> Slot | None:
        """An ended request leaves its slot, which keeps the request's computed tokens as its
        prefix cache when `keep_cache`, else caches nothing (the caller drops its KV). Returns
        the slot, or None when the request held none."""
        if request.slot_id < 0:
            return None
        slot = self._slots[request.slot_id]
        if slot.request is not request:
            return None
        slot.request = None
        slot.last_used_ns = self._clock_ns()
        slot.idle_cache = request.tokens[: request.num_computed] if keep_cache else []
        return slot

    def evict(self, request: Request) -> Slot:
        """A preempted request leaves its slot, which caches nothing (the caller drops its KV)
        and keeps its last use: the request goes back to the queue, not to an end."""
        slot = self._slots[request.slot_id]
        slot.request, slot.idle_cache = None, []
        request.slot_id = -1
        return slot
