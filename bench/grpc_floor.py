"""The floor under llama-grpc's per-token CPU: what grpc.aio alone costs per streamed message.

A bare grpc.aio server (no engine, no interceptor, no validation) answers GenerateTokens with
`--tokens` one-token deltas per stream, one every `--tick-ms` for all streams at once (like the
engine's ticks), then a done message; B streams run concurrently over one channel, as in
concurrency.py. The server runs in its own process; its CPU time per thread comes from
/proc/PID/task/*/schedstat, as in overhead.py. Reported: server CPU µs per message, split into
the event loop (main thread) and grpc's other threads, and the client's. Caches stay warm here
(no forward pass between ticks evicts them), so this is a lower bound for the same work next to
llama.cpp.

    python bench/grpc_floor.py            # --batches 1,16 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_facts, free_port, machine_facts, progress, write_json
from overhead import thread_cpu

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

TOKEN = 1234
PIECE = " word"


class BareService(pb_grpc.LlmServiceServicer):
    """GenerateTokens only: the message shapes llama-grpc streams, made as cheaply as they get."""

    def __init__(self, ticker: Ticker) -> None:
        self._ticker = ticker

    async def GenerateTokens(self, request: Any, context: Any) -> Any:
        n = request.params.stopping.max_tokens
        for _ in range(n):
            await self._ticker.next_tick()
            yield pb.GenerateTokensResponse(delta=pb.GenerationDelta(text=PIECE, token_ids=[TOKEN]))
        done = pb.GenerationDone(finish_reason=pb.FINISH_REASON_MAX_TOKENS)
        yield pb.GenerateTokensResponse(done=done)


class Ticker:
    """One shared clock: every stream waiting on it wakes at the same tick, like the engine's
    one call_soon_threadsafe per tick."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def next_tick(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        await self._event.wait()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            event, self._event = self._event, asyncio.Event()
            event.set()


async def serve(port: int, tick_ms: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_LlmServiceServicer_to_server(BareService(Ticker(tick_ms / 1000)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def one_run(stub: Any, b: int, tokens: int) -> int:
    params = pb.GenerationParams(stopping=pb.StoppingCriteria(max_tokens=tokens))

    async def stream() -> int:
        n = 0
        async for msg in stub.GenerateTokens(
            pb.GenerateTokensRequest(token_ids=[1], params=params)
        ):
            n += 1 if msg.HasField("delta") else 0
        return n

    return sum(await asyncio.gather(*(stream() for _ in range(b))))


async def measure(target: str, pid: int, batches: list[int], reps: int, tokens: int) -> list[Any]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        await one_run(stub, 2, 4)  # warm-up
        for b in batches:
            per_rep = []
            for rep in range(reps):
                t0, c0 = thread_cpu(pid), time.process_time()
                n = await one_run(stub, b, tokens)
                t1, c1 = thread_cpu(pid), time.process_time()
                main = (t1[pid][1] - t0[pid][1]) / 1e9
                total = sum(ns - t0.get(tid, (name, 0))[1] for tid, (name, ns) in t1.items()) / 1e9
                us = {
                    "event_loop": main / n * 1e6,
                    "grpc_threads": (total - main) / n * 1e6,
                    "server": total / n * 1e6,
                    "client": (c1 - c0) / n * 1e6,
                }
                per_rep.append(us)
                progress(
                    f"B={b:>2} rep {rep + 1}/{reps}: server {us['server']:.0f} µs/message "
                    f"(event loop {us['event_loop']:.0f}, grpc threads "
                    f"{us['grpc_threads']:.0f}), client {us['client']:.0f}"
                )
            medians = {k: statistics.median(u[k] for u in per_rep) for k in per_rep[0]}
            rows.append({"batch": b, "us_per_message": medians, "per_rep": per_rep})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tick-ms", type=float, default=20.0)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.tick_ms))
        return 0
    facts = machine_facts()
    port = free_port()
    argv = [sys.executable, __file__, "--serve", str(port), "--tick-ms", str(args.tick_ms)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the bare server did not start")
        batches = [int(b) for b in args.batches.split(",")]
        rows = asyncio.run(measure(f"127.0.0.1:{port}", proc.pid, batches, args.reps, args.tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    data = {
        "benchmark": "grpc_floor",
        "command": "python bench/grpc_floor.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json("grpc_floor", finish_facts(data))
    for r in rows:
        us = r["us_per_message"]
        print(
            f"B={r['batch']:>2}  server {us['server']:.0f} µs/message (event loop "
            f"{us['event_loop']:.0f}, grpc threads {us['grpc_threads']:.0f})  client "
            f"{us['client']:.0f} µs/message"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
