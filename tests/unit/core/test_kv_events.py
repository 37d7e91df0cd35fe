"""The KV event model (core.kv.events): chained, scope-salted block hashes, holders counted per
tier, the bounded log, resumption and snapshots. `Subscriber` is what a router rebuilds from the
stream, checking every event (test_kv_events_scheduler.py drives it with the scheduler)."""

from __future__ import annotations

from llama_grpc_server.core.kv.events import (
    BlocksRemoved,
    KvEventLog,
    KvEventPublisher,
    LoadRecord,
    Tier,
    block_hash,
    chain,
    scope_root,
)
from tests.support.kv_events import Subscriber

# -- the block model ----------------------------------------------------------------------------


def test_a_block_hash_names_its_scope_and_whole_prefix() -> None:
    """Chained hashes: the same 16 tokens after another prefix, or in another scope (another
    tenant's), are another block; hashes are stable (blake2b, not Python's salted hash)."""
    tokens = list(range(1, 49))
    a = chain("", tokens)
    assert [b.depth for b in a] == [0, 1, 2]
    assert [b.tokens for b in a] == [
        tuple(range(1, 17)),
        tuple(range(17, 33)),
        tuple(range(33, 49)),
    ]
    assert a[0].parent is None and a[1].parent == a[0].hash and a[2].parent == a[1].hash
    assert a[0].hash == block_hash(scope_root(""), range(1, 17))
    assert chain("5:alice:", tokens)[0].hash != a[0].hash
    assert chain("", [0, *tokens[1:]])[2].hash != a[2].hash
    assert len(chain("", tokens[:47])) == 2  # a partial block is not announced
    assert scope_root("") == 4232266863401571945  # the same in every process


def test_holders_share_blocks_and_the_last_one_removes_them() -> None:
    pub = KvEventPublisher()
    log, load = pub.log, LoadRecord()
    sub = Subscriber(log)
    prefix = list(range(1, 33))
    pub.hold(Tier.DEVICE, 0, "", [*prefix, 90, 91])
    pub.hold(Tier.DEVICE, 1, "", [*prefix, *range(40, 56)])
    pub.flush(load, 1.0)
    sub.catch_up()
    assert len(sub.blocks[Tier.DEVICE]) == 3
    pub.truncate(Tier.DEVICE, 1, 20)  # slot 1 keeps one block, shared with slot 0
    pub.flush(load, 2.0)
    read = sub.catch_up()
    removed = [e for b in read.batches for e in b.events if isinstance(e, BlocksRemoved)]
    assert [e.hashes for e in removed] == [(chain("", [*prefix, *range(40, 56)])[2].hash,)]
    pub.truncate(Tier.DEVICE, 0)
    pub.truncate(Tier.DEVICE, 1)
    pub.flush(load, 3.0)
    sub.catch_up()
    assert sub.blocks[Tier.DEVICE] == {}
    assert pub.flush(load, 4.0) is None  # nothing changed: no batch


def test_a_sequence_that_starts_with_bos_is_also_announced_without_it() -> None:
    """A router that sends BOS-less ids (SMG's /v1/completions; the worker puts the BOS in front)
    folds tokens[1:] into blocks: with `bos` set, every holder starting with it is also held
    without it, truncated and removed with it, in every tier; other sequences are held once."""
    bos = 2
    pub = KvEventPublisher(bos=bos)
    sub = Subscriber(pub.log)
    text = list(range(100, 140))  # 40 tokens of text: with the BOS, 41
    pub.hold(Tier.DEVICE, 0, "s", [bos, *text])
    pub.hold(Tier.DISK, "file", "s", [bos, *text])
    pub.hold(Tier.HOST, 7, "s", list(range(300, 340)))  # no BOS: once
    pub.flush(LoadRecord(), 1.0)
    sub.catch_up()
    with_bos = {b.hash: b.tokens for b in chain("s", [bos, *text])}
    without = {b.hash: b.tokens for b in chain("s", text)}
    assert list(without.values()) == [tuple(range(100, 116)), tuple(range(116, 132))]
    assert sub.blocks[Tier.DEVICE] == sub.blocks[Tier.DISK] == with_bos | without
    assert sub.blocks[Tier.HOST] == {b.hash: b.tokens for b in chain("s", range(300, 340))}
    pub.truncate(Tier.DEVICE, 0, 20)  # [bos, 100 .. 118]: one block each way
    pub.flush(LoadRecord(), 2.0)
    sub.catch_up()
    assert sub.blocks[Tier.DEVICE] == {
        b.hash: b.tokens for b in chain("s", [bos, *text[:19]]) + chain("s", text[:19])
    }
    pub.truncate(Tier.DEVICE, 0, 16)  # [bos, 100 .. 114]: 15 tokens without it, no block
    pub.flush(LoadRecord(), 3.0)
    sub.catch_up()
    assert sub.blocks[Tier.DEVICE] == {b.hash: b.tokens for b in chain("s", [bos, *text[:15]])}
    pub.truncate(Tier.DEVICE, 0)
    pub.hold(Tier.DEVICE, 0, "s", [*text, bos])  # the slot now holds a BOS-less sequence
    pub.disk_changed("file", "s", None)
    pub.flush(LoadRecord(), 4.0)
    sub.catch_up()
    assert sub.blocks[Tier.DEVICE] == {b.hash: b.tokens for b in chain("s", [*text, bos])}
    assert sub.blocks[Tier.DISK] == {}


def test_the_log_is_bounded_and_a_reader_behind_it_gets_a_snapshot() -> None:
    log = KvEventLog(max_batches=4, max_blocks=1000)
    pub = KvEventPublisher(log)
    sub = Subscriber(log)
    for i in range(20):
        pub.hold(Tier.HOST, i, "", list(range(i, i + 32)))
        if i % 3 == 0:
            pub.truncate(Tier.HOST, i - 3)
        pub.flush(LoadRecord(), float(i))
        assert log.num_batches <= 4
    read = sub.catch_up()
    assert read.is_reset and sub.resets == 1 and read.seq == log.seq
    assert sub.blocks[Tier.HOST] == {h: b.tokens for h, b in pub.tiers[Tier.HOST].held().items()}
    pub.hold(Tier.HOST, 99, "", list(range(99, 131)))
    pub.flush(LoadRecord(), 30.0)
    assert not sub.catch_up().is_reset  # resumes from its cursor now
    stale = Subscriber(log)
    stale.cursor = log.seq + 5  # a cursor from an earlier process
    assert stale.catch_up().is_reset


def test_the_log_bounds_its_blocks_too() -> None:
    log = KvEventLog(max_batches=1000, max_blocks=64)
    pub = KvEventPublisher(log)
    for i in range(50):
        pub.hold(Tier.DEVICE, i % 4, str(i), list(range(64)))
        pub.flush(LoadRecord(), 0.0)
        assert log.num_logged_blocks <= 64 + 8  # the newest batch is always kept


def test_a_load_change_without_blocks_is_a_record_not_a_batch() -> None:
    pub = KvEventPublisher()
    pub.flush(LoadRecord(), 0.0)  # the first batch: AllBlocksCleared
    seq = pub.log.seq
    version = pub.log.read(seq).load_version
    pub.flush(LoadRecord(running=1, total_cells=100), 1.0)
    read = pub.log.read(seq)
    assert (read.seq, read.batches, read.load.running) == (seq, (), 1)
    assert read.load_version == version + 1
    pub.flush(LoadRecord(running=1, used_cells=0, total_cells=100), 2.0)
    assert pub.log.read(seq).load_version == version + 1  # nothing a router would see changed
