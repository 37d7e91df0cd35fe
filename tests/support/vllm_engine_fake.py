"""Reading the vLLM engine protocol's KV event stream: kv_until (batches until one matches),
stored_blocks, announces (a predicate on a token list), is_cleared. Shared by several test modules
(until now in tests/unit/rpc/test_vllm_engine_fake.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from smg_grpc_proto.generated import common_pb2 as cpb


async def kv_until(
    stream: Any, done: Callable[[cpb.KvEventBatch], bool], timeout_s: float = 20.0
) -> list[cpb.KvEventBatch]:
    """The batches of a SubscribeKvEvents stream up to the first one `done` accepts (bounded)."""
    seen: list[cpb.KvEventBatch] = []
    async with asyncio.timeout(timeout_s):
        while not seen or not done(seen[-1]):
            seen.append(await stream.read())
    return seen


def stored_blocks(batches: list[cpb.KvEventBatch]) -> list[tuple[cpb.KvBlocksStored, cpb.KvBlock]]:
    return [
        (e.stored, block)
        for b in batches
        for e in b.events
        if e.WhichOneof("data") == "stored"
        for block in e.stored.blocks
    ]


def announces(tokens: list[int]) -> Callable[[cpb.KvEventBatch], bool]:
    return lambda b: any(list(block.token_ids) == tokens for _, block in stored_blocks([b]))


def is_cleared(batch: cpb.KvEventBatch) -> bool:
    return any(e.WhichOneof("data") == "cleared" for e in batch.events)
