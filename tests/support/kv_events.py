"""A KV event subscriber that replays a KvEventLog into the set of blocks it announces (Subscriber,
Blocks), to compare with what the scheduler really holds. Shared by several test modules (until now
in tests/unit/core/test_kv_events.py)."""

from __future__ import annotations

from llama_grpc_server.core.kv.events import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventLog,
    Read,
    Tier,
)

Blocks = dict[Tier, dict[int, tuple[int, ...]]]


class Subscriber:
    """What a router rebuilds from the stream: every event is checked as it is applied."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        self.cursor = 0
        self.blocks: Blocks = {tier: {} for tier in Tier}
        self.parents: dict[Tier, dict[int, int | None]] = {tier: {} for tier in Tier}
        self.resets = 0

    def catch_up(self) -> Read:
        read = self.log.read(self.cursor)
        for batch in read.batches:
            if batch.is_snapshot:
                self.resets += 1
                assert isinstance(batch.events[0], AllBlocksCleared)
            else:
                assert batch.seq == self.cursor + 1, "a gap in the sequence numbers"
            for event in batch.events:
                self._apply(event)
            self.cursor = batch.seq
        assert self.cursor == read.seq
        return read

    def _apply(self, event: BlocksStored | BlocksRemoved | AllBlocksCleared) -> None:
        if isinstance(event, AllBlocksCleared):
            for blocks in self.blocks.values():
                blocks.clear()
            for parents in self.parents.values():
                parents.clear()
            return
        tier = self.blocks[event.tier]
        if isinstance(event, BlocksRemoved):
            for h in event.hashes:
                assert h in tier, "removal of a block never announced"
                del tier[h]
                del self.parents[event.tier][h]
            return
        parent = event.parent
        for block in event.blocks:
            assert block.parent == parent, "a stored run is a chain"
            assert parent is None or parent in tier, "a child announced before its parent"
            assert block.hash not in tier, "a block announced twice"
            assert len(block.tokens) == BLOCK_SIZE
            tier[block.hash] = block.tokens
            self.parents[event.tier][block.hash] = parent
            parent = block.hash
