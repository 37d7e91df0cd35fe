"""KV cache events: what the prefix cache holds, as fixed-size token blocks a router can index
(the vLLM engine protocol's SubscribeKvEvents). Pure Python, no clock of its own.

Blocks. A cache of tokens t0 .. tn-1 is the whole blocks [t0 .. t15], [t16 .. t31], ...; a
partial last block is not announced (nothing can be matched against it). BLOCK_SIZE is 16
because that is what the gateway indexes by: SMG's event-driven cache-aware index defaults to
`--block-size 16`, learns the size from the events' `block_size` anyway, and folds a request's
prompt into blocks of that size before looking them up, so a match is credited in whole blocks.
A smaller block would multiply the gateway's index entries and the stream's volume for a finer
match than a routing decision needs; a larger one (the disk tier's 64) would leave up to 63
tokens of every cached prefix invisible to routing. llama.cpp's cells are per token, so any
size is exact on the engine side.

Hashes. A block's hash is chained: blake2b-64 over its parent's hash and its token ids, the
first block's parent being a root derived from the cache scope (tenant-prefixed, see auth.py).
So a block names its whole prefix, and the same tokens in two scopes are two different blocks:
one tenant's block can never be taken for another's. The hash is stable across processes and
Python versions, so a restart that announces the disk tier again names the same blocks.

Tiers and holders. Each tier (DEVICE: a slot's sequence, HOST: the RAM tier, DISK: the disk
tier) counts its holders per block (slots sharing a prefix through seq_cp, RAM entries sharing
their beginning): a block is announced when its first holder in that tier appears and removed
when its last one goes, so a subscriber sees a set per tier. A holder always holds a whole
chain from the first block, so a parent outlives its children in every tier.

The engine thread tells the holdings what changed at the points where cells change (KV manager
hooks: a removal truncates, a copy or restore starts over, a tick's computed tokens extend) and
calls `KvEventPublisher.flush` once per tick: only the blocks touched since the last flush are
compared, so a tick costs O(slots) plus the hashing of the blocks it completed. The disk
tier's writer thread reports its changes through a deque the next flush drains.

The log. Each flush with changes appends one numbered `EventBatch` (with the engine's load) to
a ring buffer bounded in batches and in blocks; the engine thread only appends (a lock held for
O(events)) and never waits for a reader. Readers (the rpc side) ask for the batches after their
cursor; a reader whose cursor is older than the ring, newer than the log (another process's), or
0 gets a snapshot instead: one batch at the current sequence number, a AllBlocksCleared then every
block held, so it resumes from there without a gap or a duplicate."""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import overload

BLOCK_SIZE = 16
MAX_BATCHES = 1024
"""Batches the log keeps for readers that resume (a tick with changes makes one)."""
MAX_LOGGED_BLOCKS = 1 << 16
"""Blocks (each with its 16 token ids) the kept batches may carry in all: 65,536 blocks, about
1 M tokens; the ring drops its oldest batches beyond either bound."""
LOAD_USAGE_STEP = 0.01
"""A change of KV usage smaller than this is not a new load record (decode grows it per tick)."""


class Tier(IntEnum):
    """Where a block lives; the numbers are smg.grpc.common.KvCacheTier's."""

    DEVICE = 1
    HOST = 2
    DISK = 3


def _digest(data: bytes) -> int:
    raw = hashlib.blake2b(data, digest_size=8, person=b"llgrpc-kv-block").digest()
    return int.from_bytes(raw, "little", signed=True)


@functools.lru_cache(maxsize=4096)
def scope_root(scope: str) -> int:
    """The hash a scope's first block is chained from."""
    return _digest(b"scope\0" + scope.encode())


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block whose predecessor's hash (or scope root) is `parent`."""
    return _digest(parent.to_bytes(8, "little", signed=True) + array("i", tokens).tobytes())


@dataclass(frozen=True, slots=True)
class Block:
    hash: int
    parent: int | None  # None: the first block of its scope
    depth: int  # its index in the chain: it covers tokens depth*16 .. depth*16+15
    tokens: tuple[int, ...]
    scope: str


def chain(scope: str, tokens: Sequence[int]) -> list[Block]:
    """Every whole block of `tokens` in `scope` (the reference the tests compare with)."""
    blocks: list[Block] = []
    _extend(blocks, scope, tokens, len(tokens))
    return blocks


def _extend(blocks: list[Block], scope: str, tokens: Sequence[int], n: int) -> list[Block]:
    """Append the whole blocks of tokens[:n] beyond those `blocks` has; returns the new ones."""
    new: list[Block] = []
    parent = blocks[-1].hash if blocks else None
    for depth in range(len(blocks), n // BLOCK_SIZE):
        start = depth * BLOCK_SIZE
        toks = tuple(tokens[start : start + BLOCK_SIZE])
        h = block_hash(scope_root(scope) if parent is None else parent, toks)
        new.append(Block(h, parent, depth, toks, scope))
        parent = h
    blocks += new
    return new


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A chain of blocks now held in `tier`: blocks[0]'s parent is `parent`, each later one's
    the block before it."""

    tier: Tier
    blocks: tuple[Block, ...]

    @property
    def parent(self) -> int | None:
        return self.blocks[0].parent

    @property
    def scope(self) -> str:
        return self.blocks[0].scope


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks of one scope no longer held in `tier` (children before parents)."""

    tier: Tier
    scope: str
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every tier is gone (ClearCache, or a new engine: the first batch)."""


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """The engine's load when a batch was made (EngineLoad's routing core)."""

    running: int = 0
    waiting: int = 0
    used_cells: int = 0  # every cell in use, idle slots' kept prefixes included
    total_cells: int = 0
    max_running: int = 0
    active_cells: int = 0  # held by running requests (core.stats.active_cells)

    @property
    def token_usage(self) -> float:
        """The KV share running requests hold, as vLLM reports it: SMG leaves a worker out of
        routing at 0.8 (--worker-overload-token-usage), and counting idle slots' prefixes here
        made every replica that had cached a few long prompts look overloaded (seen in
        bench/cluster.py: SMG round robin sent every request to one replica)."""
        return self.active_cells / self.total_cells if self.total_cells else 0.0

    def differs(self, other: LoadRecord) -> bool:
        """Whether a router would want to hear of the change (usage in LOAD_USAGE_STEP steps)."""
        return (
            (self.running, self.waiting, self.max_running, self.total_cells)
            != (other.running, other.waiting, other.max_running, other.total_cells)
        ) or abs(self.token_usage - other.token_usage) >= LOAD_USAGE_STEP


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    timestamp: float  # unix seconds
    events: tuple[KvEvent, ...]
    load: LoadRecord
    is_snapshot: bool = False  # a reset: AllBlocksCleared, then everything held at `seq`

    @property
    def num_blocks(self) -> int:
        return sum(
            len(e.blocks) if isinstance(e, BlocksStored) else len(e.hashes)
            for e in self.events
            if not isinstance(e, AllBlocksCleared)
        )


def stored_chains(tier: Tier, blocks: Iterable[Block]) -> list[BlocksStored]:
    """Blocks as chains, parents before children: one event per run of blocks each the parent
    of the next (a branch starts a new run)."""
    runs: list[list[Block]] = []
    open_runs: dict[int, int] = {}  # the hash a run ends with -> its index
    for block in sorted(blocks, key=lambda b: b.depth):
        i = open_runs.pop(block.parent, -1) if block.parent is not None else -1
        if i < 0:
            runs.append([block])
            i = len(runs) - 1
        else:
            runs[i].append(block)
        open_runs[block.hash] = i
    return [BlocksStored(tier, tuple(run)) for run in runs]


def removed_by_scope(tier: Tier, blocks: Iterable[Block]) -> list[BlocksRemoved]:
    by_scope: dict[str, list[Block]] = {}
    for block in blocks:
        by_scope.setdefault(block.scope, []).append(block)
    return [
        BlocksRemoved(tier, scope, tuple(b.hash for b in sorted(bs, key=lambda b: -b.depth)))
        for scope, bs in by_scope.items()
    ]


# -- what each tier holds (engine thread) -----------------------------------------------------


@dataclass(slots=True)
class _Holder:
    scope: str
    blocks: list[Block] = field(default_factory=list)


class TierHoldings:
    """The blocks one tier holds, counted per holder (a slot, a RAM entry, a file)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._holders: dict[Hashable, _Holder] = {}
        self._refs: dict[int, int] = {}
        self._blocks: dict[int, Block] = {}  # held, or released since the last diff
        self._dirty: set[int] = set()

    def hold(self, key: Hashable, scope: str, tokens: Sequence[int], n: int = -1) -> None:
        """The holder now holds tokens[:n] (all of `tokens` when n < 0) in `scope`; the blocks
        it held before are unchanged (a hook truncated it at any edit)."""
        n = len(tokens) if n < 0 else n
        holder = self._holders.get(key)
        if holder is not None and (holder.scope != scope or len(holder.blocks) * BLOCK_SIZE > n):
            self.truncate(key, 0 if holder.scope != scope else n)  # never stale, whatever
            holder = self._holders.get(key)
        if n < BLOCK_SIZE * (len(holder.blocks) + 1 if holder is not None else 1):
            return
        if holder is None:
            holder = self._holders[key] = _Holder(scope)
        for block in _extend(holder.blocks, scope, tokens, n):
            refs = self._refs.get(block.hash, 0)
            if refs == 0:
                self._blocks.setdefault(block.hash, block)
                self._dirty.add(block.hash)
            self._refs[block.hash] = refs + 1

    def truncate(self, key: Hashable, n_tokens: int) -> None:
        """The holder keeps only tokens[:n_tokens] (0: nothing)."""
        holder = self._holders.get(key)
        if holder is None:
            return
        keep = n_tokens // BLOCK_SIZE
        for block in holder.blocks[keep:]:
            refs = self._refs[block.hash] - 1
            if refs:
                self._refs[block.hash] = refs
            else:
                del self._refs[block.hash]
                self._dirty.add(block.hash)
        del holder.blocks[keep:]
        if not holder.blocks:
            del self._holders[key]

    def keys(self) -> list[Hashable]:
        return list(self._holders)

    def held(self) -> dict[int, Block]:
        return {h: self._blocks[h] for h in self._refs}

    def diff(
        self, published: Mapping[int, Block], everything: bool = False
    ) -> tuple[list[Block], list[Block]]:
        """(blocks to announce, blocks to remove) against what subscribers know; only the
        blocks touched since the last diff are looked at (all of them when `everything`)."""
        dirty = set(self._blocks) if everything else self._dirty
        self._dirty = set()
        stored: list[Block] = []
        removed: list[Block] = []
        for h in dirty:
            if h in self._refs:
                if h not in published:
                    stored.append(self._blocks[h])
            else:
                self._blocks.pop(h, None)
                if h in published:
                    removed.append(published[h])
        return stored, removed


# -- the log (any thread reads, the engine thread appends) ------------------------------------


@dataclass(frozen=True, slots=True)
class Read:
    """What a reader gets: the batches after its cursor (or one snapshot batch), the sequence
    number it is now at, and the latest load record with its version (records change without
    batches: a load-only heartbeat repeats `seq`)."""

    batches: tuple[EventBatch, ...]
    seq: int
    load: LoadRecord
    load_version: int

    @property
    def is_reset(self) -> bool:
        return bool(self.batches) and self.batches[0].is_snapshot


class KvEventLog:
    """A bounded ring of numbered batches and the set of blocks they add up to."""

    def __init__(self, max_batches: int = MAX_BATCHES, max_blocks: int = MAX_LOGGED_BLOCKS) -> None:
        self.max_batches = max_batches
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._batches: deque[EventBatch] = deque()
        self._num_blocks = 0
        self._seq = 0
        self._timestamp = 0.0
        # what the batches add up to, per tier: written under the lock by append() only
        self.published: dict[Tier, dict[int, Block]] = {t: {} for t in Tier}
        self._load = LoadRecord()
        self._load_version = 0
        self._listeners: list[Callable[[], None]] = []
        self.resets = 0  # snapshots handed out

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def num_batches(self) -> int:
        return len(self._batches)

    @property
    def num_logged_blocks(self) -> int:
        return self._num_blocks

    def append(self, events: Sequence[KvEvent], load: LoadRecord, timestamp: float) -> EventBatch:
        """Number, keep and apply a batch (engine thread); tells the listeners."""
        with self._lock:
            self._seq += 1
            batch = EventBatch(self._seq, timestamp, tuple(events), load)
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    for blocks in self.published.values():
                        blocks.clear()
                elif isinstance(event, BlocksStored):
                    tier = self.published[event.tier]
                    for block in event.blocks:
                        tier[block.hash] = block
                else:
                    tier = self.published[event.tier]
                    for h in event.hashes:
                        tier.pop(h, None)
            self._batches.append(batch)
            self._num_blocks += batch.num_blocks
            while len(self._batches) > 1 and (
                len(self._batches) > self.max_batches or self._num_blocks > self.max_blocks
            ):
                self._num_blocks -= self._batches.popleft().num_blocks
            self._timestamp = timestamp
            self._load, self._load_version = load, self._load_version + 1
        self._notify()
        return batch

    def set_load(self, load: LoadRecord) -> None:
        """A new load record without KV events (engine thread)."""
        with self._lock:
            self._load, self._load_version = load, self._load_version + 1
        self._notify()

    @property
    def load(self) -> LoadRecord:
        return self._load

    def read(self, cursor: int) -> Read:
        """The batches after `cursor`, or a snapshot when they are not all kept (any thread;
        the lock is held for a slice, or a copy of the block tables: C speed)."""
        with self._lock:
            seq, load, version = self._seq, self._load, self._load_version
            oldest = self._batches[0].seq if self._batches else seq + 1
            if 0 < cursor <= seq and cursor >= oldest - 1:
                start = cursor - (oldest - 1)
                kept = tuple(itertools.islice(self._batches, start, None))
                return Read(kept, seq, load, version)
            if seq == 0:
                return Read((), 0, load, version)
            tables = {tier: list(blocks.values()) for tier, blocks in self.published.items()}
            timestamp = self._timestamp
            self.resets += 1
        events: list[KvEvent] = [AllBlocksCleared()]
        for tier, blocks in tables.items():
            events += stored_chains(tier, blocks)
        snapshot = EventBatch(seq, timestamp, tuple(events), load, is_snapshot=True)
        return Read((snapshot,), seq, load, version)

    def add_listener(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` (on the engine thread: it must only schedule work, never block)
        after every batch or load record; returns the function that removes it."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

        def remove() -> None:
            with self._lock:
                self._listeners = [f for f in self._listeners if f is not listener]

        return remove

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()


# -- the publisher (engine thread) ------------------------------------------------------------


DiskChange = tuple[Hashable, str, Sequence[int] | None]  # (file, scope, tokens); None: removed


@dataclass(frozen=True, slots=True)
class _Unprefixed:
    """The holder key of a sequence's view without its leading BOS (KvEventPublisher)."""

    key: Hashable


class _Tail(Sequence[int]):
    """tokens[1:] without the copy (sync_events holds every slot's tokens every tick)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens) - 1

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self._tokens[start + 1 : stop + 1 : step]
        return self._tokens[range(1, len(self._tokens))[index]]


class KvEventPublisher:
    """The tiers' holdings, and the flush that turns their changes into the log's batches.

    `bos`: the model's BOS when it adds one. A router sends the ids it tokenized, and SMG
    tokenizes /v1/completions prompts without special tokens while the worker runs them with
    the BOS in front (rpc/vllm/requests.with_bos): the gateway folds [t1 .. t16] into its first
    block where the cache holds [BOS, t1 .. t15]. So every holder whose tokens start with `bos`
    is also held without it (a second chain, tokens[1:], under its own key): each chain says
    truthfully which ids, sent as they are, find this prefix cached. Chat prompts (the template
    writes the BOS) match the first chain, completions the second. It doubles the blocks of such
    sequences in the stream and in a router's index."""

    def __init__(self, log: KvEventLog | None = None, *, bos: int | None = None) -> None:
        self.log = log if log is not None else KvEventLog()
        self.tiers = {tier: TierHoldings(tier) for tier in Tier}
        self.bos = bos
        self._disk_changes: deque[DiskChange] = deque()  # appended by any thread
        self._cleared = True  # the first batch tells a subscriber the engine is new

    def hold(
        self, tier: Tier, key: Hashable, scope: str, tokens: Sequence[int], n: int = -1
    ) -> None:
        holdings = self.tiers[tier]
        holdings.hold(key, scope, tokens, n)
        if self.bos is None:
            return
        n = len(tokens) if n < 0 else n
        if n and tokens[0] == self.bos:
            holdings.hold(_Unprefixed(key), scope, _Tail(tokens), n - 1)
        else:
            holdings.truncate(_Unprefixed(key), 0)

    def truncate(self, tier: Tier, key: Hashable, n_tokens: int = 0) -> None:
        holdings = self.tiers[tier]
        holdings.truncate(key, n_tokens)
        if self.bos is not None:
            holdings.truncate(_Unprefixed(key), max(n_tokens - 1, 0))

    def disk_changed(self, key: Hashable, scope: str, tokens: Sequence[int] | None) -> None:
        """The disk tier indexed (tokens) or forgot (None) a file: from any thread."""
        self._disk_changes.append((key, scope, tokens))

    def cleared(self) -> None:
        """ClearCache ran: the next batch starts with AllBlocksCleared, then what is still held
        (running requests' blocks) is announced again."""
        self._cleared = True

    def flush(self, load: LoadRecord, timestamp: float) -> EventBatch | None:
        """Append one batch with every change since the last flush; a load record alone when
        nothing changed but the load did."""
        while self._disk_changes:
            key, scope, tokens = self._disk_changes.popleft()
            self.truncate(Tier.DISK, key, 0)
            if tokens is not None:
                self.hold(Tier.DISK, key, scope, tokens)
        events: list[KvEvent] = []
        everything = self._cleared
        if everything:
            events.append(AllBlocksCleared())
            self._cleared = False
        stores: list[KvEvent] = []
        for tier, holdings in self.tiers.items():
            published = {} if everything else self.log.published[tier]
            stored, removed = holdings.diff(published, everything)
            events += removed_by_scope(tier, removed)
            stores += stored_chains(tier, stored)
        events += stores
        if events:
            return self.log.append(events, load, timestamp)
        if load.differs(self.log.load):
            self.log.set_load(load)
        return None
