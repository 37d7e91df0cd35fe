"""The RAM tier: saved sequence states (llama.cpp's blobs) of caches no slot keeps any more, an
LRU store bounded by bytes, looked up by the longest verified prefix. The KvCacheManager decides
when to save (before an idle slot's cache is destroyed) and when to restore; what it evicts goes
to the disk tier (core.kv.disk). Pure Python; engine thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llama_grpc_server.core.kv.events import KvEventPublisher, Tier
from llama_grpc_server.core.kv.prefix_cache import common_prefix_length


@dataclass(slots=True)
class RamEntry:
    """A sequence's saved KV state and the tokens it holds (verified on lookup, never hashed)."""

    scope: str
    tokens: tuple[int, ...]
    data: bytes


RAM_KEY_TOKENS = 4
"""The RAM tier files entries by their first tokens, so a lookup compares only the entries that
begin like the prompt (a match shorter than this never pays for a restore): with the tier on
by default a long-running server holds thousands of entries, and scanning them all took ~30 ms
per admission on the engine thread for 9,500 entries here."""


class RamTier:
    """LRU store of saved sequence states bounded by bytes; the scheduler decides when to save
    (before an idle slot's cache is destroyed) and when to restore (best verified LCP)."""

    def __init__(self, max_bytes: int, events: KvEventPublisher | None = None) -> None:
        self.max_bytes = max_bytes
        self._events = events  # told of every entry stored and dropped (HOST tier blocks)
        self._entries: dict[int, RamEntry] = {}  # insertion order = LRU order
        # (scope, first RAM_KEY_TOKENS tokens) -> keys of the entries beginning so; an entry
        # shorter than that is filed under all its tokens and looked at by every lookup
        self._by_start: dict[tuple[str, tuple[int, ...]], set[int]] = {}
        self._short: set[int] = set()
        self._next_key = 0
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def put(self, scope: str, tokens: Sequence[int], data: bytes) -> list[RamEntry]:
        """Store a state; returns the entries evicted to make room (for the disk tier). Entries
        it supersedes (prefixes of it) are dropped, not returned: the new one covers them."""
        if not data or len(data) > self.max_bytes:
            return []
        tokens = tuple(tokens)
        for key in self._candidates(scope, tokens):
            # an entry whose tokens are a prefix of the new one is superseded by it
            entry = self._entries[key]
            if entry.scope == scope and tokens[: len(entry.tokens)] == entry.tokens:
                self._drop(key)
        evicted: list[RamEntry] = []
        while self.num_bytes + len(data) > self.max_bytes and self._entries:
            evicted.append(self._drop(next(iter(self._entries))))
            self.evictions += 1
        key = self._next_key
        self._next_key += 1
        self._entries[key] = RamEntry(scope, tokens, data)
        if self._events is not None:
            self._events.hold(Tier.HOST, key, scope, tokens)
        if len(tokens) < RAM_KEY_TOKENS:
            self._short.add(key)
        else:
            self._by_start.setdefault((scope, tokens[:RAM_KEY_TOKENS]), set()).add(key)
        self.num_bytes += len(data)
        return evicted

    def _candidates(self, scope: str, tokens: Sequence[int]) -> list[int]:
        """Keys of the entries that may share more than RAM_KEY_TOKENS - 1 tokens with
        `tokens`, and of every short one."""
        start = self._by_start.get((scope, tuple(tokens[:RAM_KEY_TOKENS])), ())
        return [*start, *self._short]

    def clear(self) -> tuple[int, int]:
        """Drop every entry; (entries, bytes) dropped."""
        dropped = (len(self._entries), self.num_bytes)
        if self._events is not None:
            for key in self._entries:
                self._events.truncate(Tier.HOST, key)
        self._entries.clear()
        self._by_start.clear()
        self._short.clear()
        self.num_bytes = 0
        return dropped

    def _drop(self, key: int) -> RamEntry:
        entry = self._entries.pop(key)
        self.num_bytes -= len(entry.data)
        if self._events is not None:
            self._events.truncate(Tier.HOST, key)
        if key in self._short:
            self._short.discard(key)
        else:
            start = (entry.scope, entry.tokens[:RAM_KEY_TOKENS])
            keys = self._by_start[start]
            keys.discard(key)
            if not keys:
                del self._by_start[start]
        return entry

    def best(self, scope: str, tokens: Sequence[int]) -> tuple[int, int]:
        """(key, usable prefix length) of the entry sharing the longest verified prefix, among
        those that begin like `tokens` (RAM_KEY_TOKENS); the newest of equals."""
        best_key, best_len = -1, 0
        probe = tuple(tokens)  # entries hold tuples: a list slice never equals a tuple's
        for key in self._candidates(scope, probe):
            entry = self._entries[key]
            if entry.scope != scope:
                continue
            n = min(common_prefix_length(entry.tokens, probe), len(probe) - 1)
            if n > best_len or (n == best_len and n > 0 and key > best_key):
                best_key, best_len = key, n
        return best_key, best_len

    def held(self) -> list[tuple[str, tuple[int, ...]]]:
        """(scope, tokens) of every entry."""
        return [(e.scope, e.tokens) for e in self._entries.values()]

    def take(self, key: int) -> RamEntry:
        """Use an entry: it becomes the most recently used."""
        entry = self._entries.pop(key)
        self._entries[key] = entry
        self.hits += 1
        return entry
