"""What KV event publishing costs the engine thread per tick (issue 33): the scheduler over the
fake runner (no model), 4 slots decoding after 1,000-token prompts with shared prefixes, the RAM
tier on; times Scheduler.publish_kv_events (sync of the slots' blocks + the flush into the log)
against the stats snapshot the same tick already publishes. Run: python bench/kv_events_tick.py"""

from __future__ import annotations

import statistics
import time

from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    Request,
    SamplingParams,
    StoppingParams,
)
from llama_grpc_server.core.scheduling.scheduler import Scheduler, SchedulerLimits
from llama_grpc_server.testing import FakeRunner

PIECES = [f"<{i}>".encode() for i in range(97)]


def main() -> None:
    s = Scheduler(
        SchedulerLimits(4, 8192, 512, 512, 64, ram_cache_bytes=1 << 26),
        pieces=PIECES,
        eog_ids=frozenset(),
    )
    runner = FakeRunner()
    system = [(i * 7) % 90 + 1 for i in range(600)]
    for n in range(16):
        prompt = (*system, *[(i * 13 + n) % 90 + 1 for i in range(400)])
        stopping = StoppingParams(max_tokens=200)
        s.add(
            Request(GenerationRequest(f"r{n}", prompt, SamplingParams(temperature=0.0), stopping))
        )
    publish, snapshot, ticks, blocks = [], [], 0, 0
    while s.has_work:
        plan, _ = s.schedule()
        if plan is not None:
            s.update(plan, runner.execute(plan))
        t0 = time.perf_counter()
        s.snapshot(8192)
        t1 = time.perf_counter()
        seq = s.kv.events.log.seq
        s.publish_kv_events(time.time())
        t2 = time.perf_counter()
        if s.kv.events.log.seq != seq:
            blocks += s.kv.events.log.read(seq).batches[0].num_blocks
        snapshot.append((t1 - t0) * 1e6)
        publish.append((t2 - t1) * 1e6)
        ticks += 1
    q = statistics.quantiles(publish, n=100)
    print(f"{ticks} ticks, {s.kv.events.log.seq} batches, {blocks} blocks announced or removed")
    print(
        f"publish_kv_events: median {statistics.median(publish):.1f} us, p99 {q[98]:.1f} us, "
        f"max {max(publish):.1f} us"
    )
    print(f"stats snapshot (for scale): median {statistics.median(snapshot):.1f} us")


if __name__ == "__main__":
    main()
