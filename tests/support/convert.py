"""Engine snapshots and Finished events as the servicer converts them: make_snapshot, finished, and
the TIMINGS / USAGE they carry. Shared by several test modules (until now in
tests/unit/rpc/test_convert.py)."""

from __future__ import annotations

import dataclasses

from llama_grpc_server.core.api import DiskTierStats, SlotSnapshot, StatsSnapshot
from llama_grpc_server.core.requests.request import Finished, FinishReason, Timings, Usage

USAGE = Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2)


TIMINGS = Timings(queue_ms=1.5, ttft_ms=10.0, prefill_ms=8.5, decode_ms=20.0, total_ms=30.0)


def finished(reason: FinishReason = FinishReason.EOS, **fields: object) -> Finished:
    return Finished(reason=reason, usage=USAGE, timings=TIMINGS, seed=1234, **fields)  # type: ignore[arg-type]  # test helper passes optional fields through


def make_snapshot() -> StatsSnapshot:
    slots = (SlotSnapshot(0, "generating", "req-9", 40), SlotSnapshot(1, "idle", "", 12))
    numbers = {
        f.name: index + 1
        for index, f in enumerate(dataclasses.fields(StatsSnapshot))
        if f.type in ("int", int)
    }
    return StatsSnapshot(
        **numbers,
        avg_batch_size=2.5,
        uptime_s=12.25,
        slots=slots,
        batch_strategy="decode_maximal",
        prefix_cache_hit_rate=0.75,
        engine_state="failed",
        engine_error="RuntimeError: boom",
        disk_cache=DiskTierStats(
            **{f.name: 100 + i for i, f in enumerate(dataclasses.fields(DiskTierStats))}
        ),
    )
