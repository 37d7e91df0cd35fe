"""KvCacheManager: every KV edit of the slot pool. It decides what a placed request reuses (LCP
of the slot's cache, a copy from another slot, a RAM- or disk-tier restore, or a wait for a
shared prefix a busy slot is computing), queues the seq_rm / seq_cp / save / restore ops the
runner applies before the next decode, mirrors them in the cell map, and applies what the runner
reports back. Pure Python; used by the Scheduler on the engine thread only.

The tiers: an idle slot's cache that is about to be destroyed is saved to the RAM tier (when on),
else to the disk tier; what the RAM tier evicts goes to the disk tier; an idle session's cache is
also written to disk after session_idle_ns, and every idle cache at shutdown (persist_idle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from llama_grpc_server.core.api import CacheCleared, DiskTierStats
from llama_grpc_server.core.kv import prefix_cache
from llama_grpc_server.core.kv.cells import CellMap
from llama_grpc_server.core.kv.disk import ReadDone
from llama_grpc_server.core.kv.events import KvEventPublisher, Tier
from llama_grpc_server.core.kv.ram import RamTier
from llama_grpc_server.core.requests.request import Request
from llama_grpc_server.core.scheduling.plan import Chunk, SeqOp, SeqOpKind, StepResult
from llama_grpc_server.core.scheduling.slot import Slot

MIN_SHARED_WAIT_TOKENS = 32
"""A request waits for a busy slot's prefill only to share at least this many more tokens."""

MIN_RAM_TIER_TOKENS = 32
"""The RAM tier saves a cache of no session only when dropping at least this many tokens of it
(a session's history is saved whenever any of it would be lost)."""

MIN_RESTORE_GAIN = 8
"""A saved state is restored only when it holds at least this many more tokens than the slots
offer. Measured on the embedded model (2 cores): restoring a 1,100-token state (11 MB) took
~6 ms, saving it ~12 ms, while a decode of one row costs ~10 ms and of 8 rows ~25 ms; so
restoring pays from the first few tokens, and 8 leaves room for larger states."""

CountCached = Callable[[Request, int], None]  # record a request's cached prompt tokens
DiskListener = Callable[[str, str, Sequence[int] | None], None]


class DiskTier(Protocol):
    """Saved states on disk (kv_disk.KvDiskStore), verified before they are handed out. The
    engine thread never waits for the disk: lookup reads an index in memory, read hands the
    file to an I/O thread."""

    def lookup(self, scope: str, tokens: Sequence[int]) -> tuple[str, int]:
        """(key, usable prefix) of the saved state sharing the longest prefix; ("", 0)."""
        ...

    def read(self, key: str, scope: str, done: ReadDone) -> bool:
        """Read and verify the saved state on another thread, then call done((tokens, state)),
        or done(None) when it is not intact. False when the read cannot be queued (then done
        is never called)."""
        ...

    def put(self, scope: str, tokens: Sequence[int], blob: bytes) -> None: ...

    def record_miss(self) -> None: ...

    def clear(self) -> tuple[int, int]: ...

    def stats(self) -> DiskTierStats: ...

    def watch(self, listener: DiskListener) -> None:
        """Report every file indexed now, then every file indexed or forgotten, from any
        thread: listener(file, scope, tokens), tokens None when forgotten."""
        ...


class KvCacheManager:
    def __init__(
        self,
        slots: Sequence[Slot],
        *,
        count_cached: CountCached,
        supports_partial_removal: bool = True,
        ram_cache_bytes: int = 0,
        ram_min_tokens: int = 64,
        disk: DiskTier | None = None,
        session_idle_ns: int = 0,
        events: KvEventPublisher | None = None,
    ) -> None:
        self.slots = slots
        self.cells = CellMap()  # cells shared through seq_cp count once
        # the blocks each tier holds, for SubscribeKvEvents: told at every edit below
        self.events = events if events is not None else KvEventPublisher()
        self.ram = RamTier(ram_cache_bytes, self.events) if ram_cache_bytes else None
        self.disk = disk
        if disk is not None:
            disk.watch(self.events.disk_changed)
        self._session_idle_ns = session_idle_ns
        self._count_cached = count_cached
        self._supports_partial_removal = supports_partial_removal
        self._ram_min_tokens = ram_min_tokens
        self._ops: list[SeqOp] = []
        # slots whose request waits for a shared prefix (resolve_waits looks at these only)
        self._waiting: set[int] = set()
        # seq_id -> (scope, tokens, to disk only): the SAVE ops in flight
        self._saving: dict[int, tuple[str, list[int], bool]] = {}

    # -- the op queue -----------------------------------------------------------------------------

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def take_ops(self) -> tuple[SeqOp, ...]:
        """The edits for the next plan, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def _queue(self, op: SeqOp, restored_tokens: int = 0) -> None:
        self._ops.append(op)
        if op.kind is SeqOpKind.REMOVE:
            self.cells.removed(op.seq_id, op.p0, op.p1)
            self.events.truncate(Tier.DEVICE, op.seq_id, op.p0)
        elif op.kind is SeqOpKind.COPY:
            self.cells.copied(op.src_seq_id, op.seq_id, op.p1)
            self.events.truncate(Tier.DEVICE, op.seq_id)  # sync_events() adds what it holds
        elif op.kind is SeqOpKind.RESTORE:
            self.cells.restored(op.seq_id, restored_tokens)
            self.events.truncate(Tier.DEVICE, op.seq_id)

    def clear(self, slot: Slot) -> None:
        """Drop the whole sequence (no RAM-tier save)."""
        self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, 0, -1))

    def discard_tail(self, slot_id: int, p0: int) -> None:
        """Drop the KV from p0 on that the last tick computed but nothing keeps (draft tokens
        the sampler rejected, or that came after the request finished): before the next decode,
        before any save or copy, so no cache tier ever holds it."""
        self._ops.append(SeqOp(SeqOpKind.REMOVE, slot_id, p0, -1))
        self.cells.trimmed(slot_id, p0)
        self.events.truncate(Tier.DEVICE, slot_id, p0)

    def clear_idle(self) -> CacheCleared:
        """Forget every idle slot's prefix cache (no RAM-tier save) and the whole RAM tier;
        running requests keep their KV. The cells are free once the next plan's ops ran."""
        used = self.cells.num_used()
        cleared = 0
        for slot in self.slots:
            if slot.is_idle and slot.idle_cache:
                self.clear(slot)
                slot.idle_cache = []
                cleared += 1
        self._saving.clear()  # a save still in flight is not kept either
        entries, num_bytes = self.ram.clear() if self.ram is not None else (0, 0)
        files, file_bytes = self.disk.clear() if self.disk is not None else (0, 0)
        for slot in self.slots:
            slot.persisted_tokens = 0
        self.events.cleared()
        return CacheCleared(
            cleared, used - self.cells.num_used(), entries, num_bytes, files, file_bytes
        )

    # -- placing a request ------------------------------------------------------------------------

    def prepare(self, slot: Slot, request: Request, placement: prefix_cache.Placement) -> int:
        """Make the (idle) slot hold what `request` reuses. Returns the tokens it holds at once;
        a RAM-tier restore in flight sets request.restoring_tokens instead (its count comes
        when the runner reports it)."""
        restoring = self._try_restore(slot, request, placement.num_cached)
        if restoring:
            request.restoring_tokens = restoring
            return 0
        return self._reuse(slot, placement if request.spec.cache_prompt else None)

    def start_disk_read(self, request: Request, num_cached: int, done: ReadDone) -> bool:
        """Ask the disk tier for a saved state when it beats what the slots and the RAM tier
        offer (by MIN_RESTORE_GAIN); True if a read is in flight (its answer comes through
        `done`, on the I/O thread). A request reads at most once."""
        spec = request.spec
        if self.disk is None or request.disk_tried or not spec.cache_prompt:
            return False
        if request.num_preemptions:
            return False
        ram_n = self.ram.best(spec.cache_scope, request.tokens)[1] if self.ram else 0
        key, n = self.disk.lookup(spec.cache_scope, request.tokens)
        if n <= ram_n or n < num_cached + MIN_RESTORE_GAIN:
            return False
        request.disk_tried = True
        return self.disk.read(key, spec.cache_scope, done)

    def _try_restore(self, slot: Slot, request: Request, num_cached: int) -> int:
        """Restore a saved state when it beats what the slots offer: the one a disk read
        brought for this request, else the RAM tier's (the longer verified prefix wins; RAM on
        a tie); returns the prefix length it will provide (0 = no restore)."""
        spec = request.spec
        loaded, request.disk_loaded = request.disk_loaded, None
        if not spec.cache_prompt or request.num_preemptions:
            return 0
        if self.ram is None and self.disk is None:
            return 0
        ram_key, ram_n = self.ram.best(spec.cache_scope, request.tokens) if self.ram else (-1, 0)
        if self.disk is not None:
            if loaded is not None:
                disk_n = prefix_cache.common_prefix_length(loaded[0], request.tokens)
                if disk_n > ram_n and disk_n >= num_cached + MIN_RESTORE_GAIN:
                    if self.ram is not None:
                        self.ram.misses += 1
                    return self._restore(slot, request, *loaded)
            self.disk.record_miss()
        if self.ram is None:
            return 0
        if ram_key < 0 or ram_n < num_cached + MIN_RESTORE_GAIN:
            self.ram.misses += 1
            return 0
        entry = self.ram.take(ram_key)
        return self._restore(slot, request, list(entry.tokens), entry.data)

    def _restore(self, slot: Slot, request: Request, tokens: list[int], data: bytes) -> int:
        """Load a saved state into the slot and keep only the prefix it shares with the
        request (verified here, token by token: never trust what a lookup said)."""
        n = min(prefix_cache.common_prefix_length(tokens, request.tokens), len(request.tokens) - 1)
        if n <= 0:
            return 0
        self.drop_cache(slot)
        self._queue(SeqOp(SeqOpKind.RESTORE, slot.slot_id, data=data), len(tokens))
        if len(tokens) > n:
            self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, n, -1))
        return n

    def _reuse(self, slot: Slot, placement: prefix_cache.Placement | None) -> int:
        """Queue the seq_rm / seq_cp that make `slot` hold exactly the reused prefix."""
        if placement is None or placement.num_cached == 0:
            self.drop_cache(slot)
            return 0
        if placement.donor_slot_id >= 0:
            self.drop_cache(slot)
            n = placement.donor_tokens
            self._queue(SeqOp(SeqOpKind.COPY, slot.slot_id, 0, n, placement.donor_slot_id))
            return n
        keep = placement.keep
        if slot.num_kv_tokens > keep and not self._supports_partial_removal:
            self.drop_cache(slot)
            return 0
        self.drop_cache(slot, keep)
        return keep

    def drop_cache(self, slot: Slot, keep: int = 0) -> None:
        """Remove a slot's KV from `keep` on, saving an idle cache to the RAM tier first if it
        is worth keeping."""
        held = slot.idle_cache if slot.is_idle else slot.kv_tokens()
        if not held or len(held) <= keep:
            return
        on_disk = self.ram is None and slot.persisted_tokens >= len(held)
        worth_saving = MIN_RAM_TIER_TOKENS if not slot.session_id else 1
        if (
            (self.ram is not None or self.disk is not None)
            and slot.is_idle
            and not on_disk
            and len(held) >= self._ram_min_tokens
            and len(held) - keep >= worth_saving
        ):
            self._saving[slot.slot_id] = (slot.cache_scope, list(held), self.ram is None)
            self._queue(SeqOp(SeqOpKind.SAVE, slot.slot_id))
        self._queue(SeqOp(SeqOpKind.REMOVE, slot.slot_id, keep, -1))
        if slot.is_idle:
            slot.idle_cache = held[:keep]

    # -- the disk tier's writes -------------------------------------------------------------------

    def persist_idle(self, now_ns: int, *, everything: bool = False) -> bool:
        """Queue a save to the disk tier of every idle cache not yet written whose session has
        been idle session_idle_ns (of every one, at shutdown: `everything`). True if any."""
        if self.disk is None or (self._session_idle_ns <= 0 and not everything):
            return False
        queued = False
        for slot in self.slots:
            if not self._wants_persist(slot):
                continue
            if everything or now_ns - slot.last_used_ns >= self._session_idle_ns:
                self._saving[slot.slot_id] = (slot.cache_scope, list(slot.idle_cache), True)
                self._queue(SeqOp(SeqOpKind.SAVE, slot.slot_id))
                slot.persisted_tokens = len(slot.idle_cache)
                queued = True
        return queued

    def next_persist_ns(self) -> int | None:
        """When the next idle session is due for the disk tier (scheduler clock), or None."""
        if self.disk is None or self._session_idle_ns <= 0:
            return None
        due = [s.last_used_ns + self._session_idle_ns for s in self.slots if self._wants_persist(s)]
        return min(due) if due else None

    def _wants_persist(self, slot: Slot) -> bool:
        return (
            slot.is_idle
            and len(slot.idle_cache) >= self._ram_min_tokens
            and slot.persisted_tokens < len(slot.idle_cache)
        )

    # -- sharing a prefix a busy slot is computing ------------------------------------------------

    def wait_for_shared_prefix(self, request: Request, slot: Slot) -> bool:
        """If a busy slot is still prefilling a longer shared prefix (a system prompt sent by
        requests arriving together), wait for it and copy its KV instead of computing it twice."""
        best_slot, best_n = None, request.num_computed + MIN_SHARED_WAIT_TOKENS
        for other in self.slots:
            donor = other.request
            if donor is None or other is slot or other.cache_scope != slot.cache_scope:
                continue
            n = prefix_cache.common_prefix_length(donor.tokens[: donor.num_prompt], request.tokens)
            n = min(n, len(request.tokens) - 1)
            if n > best_n and donor.num_computed < n:
                best_slot, best_n = other, n
        if best_slot is None or best_slot.request is None:
            return False
        if request.num_computed:
            self.clear(slot)
            request.num_computed = 0
        request.wait_slot_id = best_slot.slot_id
        request.wait_key = best_slot.request.key
        request.wait_tokens = best_n
        self._waiting.add(slot.slot_id)
        return True

    def resolve_waits(self) -> None:
        """Copy a shared prefix once its donor has computed it; if the donor went away, copy the
        best prefix any slot still holds (or compute from scratch). Only slots that started a
        wait are looked at: with none, the tick skips the scan."""
        for slot_id in sorted(self._waiting):
            slot, request = self.slots[slot_id], self.slots[slot_id].request
            if request is None or not request.is_waiting:
                self._waiting.discard(slot_id)  # ended or resolved
                continue
            donor = self.slots[request.wait_slot_id]
            if donor.request is not None and donor.request.key == request.wait_key:
                if donor.request.num_computed < request.wait_tokens:
                    continue
                src, n = donor.slot_id, request.wait_tokens
            else:
                src, n = -1, 0
                for other in self.slots:
                    if other is slot:
                        continue
                    m = prefix_cache.usable_prefix(other, request.tokens, slot.cache_scope)
                    if m > n:
                        src, n = other.slot_id, m
            if n:
                self._queue(SeqOp(SeqOpKind.COPY, slot.slot_id, 0, n, src_seq_id=src))
            request.num_computed = n
            request.wait_slot_id = -1
            self._waiting.discard(slot_id)
            self._count_cached(request, n)

    # -- what the runner did ----------------------------------------------------------------------

    def apply(self, result: StepResult) -> None:
        """Sequences the runner emptied, states it saved, restores it completed (before the
        tick's chunks are accounted)."""
        for seq_id in result.reset:
            self._reset(seq_id)
        for seq_id, data in result.saved.items():
            scope, tokens, disk_only = self._saving.pop(seq_id, ("", [], False))
            if not tokens:
                continue
            if self.ram is not None and not disk_only:
                for evicted in self.ram.put(scope, tokens, data):
                    if self.disk is not None:
                        self.disk.put(evicted.scope, evicted.tokens, evicted.data)
            elif self.disk is not None:
                self.disk.put(scope, tokens, data)
        for seq_id, ok in result.restored.items():
            request = self.slots[seq_id].request
            if request is None or not request.restoring_tokens:
                continue
            n = request.restoring_tokens if ok else 0
            if not ok:
                self.clear(self.slots[seq_id])
            request.num_computed, request.restoring_tokens = n, 0
            self._count_cached(request, n)

    def _reset(self, seq_id: int) -> None:
        """A partial seq_rm failed and the runner emptied the sequence instead: its request
        re-prefills from position 0 (never reuses a stale cache); an idle slot holds nothing."""
        self.cells.cleared(seq_id)
        self.events.truncate(Tier.DEVICE, seq_id)
        slot = self.slots[seq_id]
        request = slot.request
        if request is None:
            slot.idle_cache = []
            return
        request.num_computed = 0
        request.restoring_tokens = 0
        self._count_cached(request, 0)

    def computed(self, chunk: Chunk) -> None:
        self.cells.computed(chunk.slot_id, chunk.start_pos, len(chunk.tokens))

    def num_used_cells(self) -> int:
        return self.cells.num_used()

    def sync_events(self) -> None:
        """Tell the DEVICE tier the whole blocks each slot has computed by now (the hooks above
        truncated it at every edit, so only new blocks are hashed: O(slots) per tick)."""
        for slot in self.slots:
            request = slot.request
            tokens = request.tokens if request is not None else slot.idle_cache
            # an embedding request's KV is cleared when it ends: never a prefix to route to
            n = 0 if request is not None and request.spec.is_embedding else slot.num_kv_tokens
            self.events.hold(Tier.DEVICE, slot.slot_id, slot.cache_scope, tokens, n)
