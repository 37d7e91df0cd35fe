"""Back-pressure: do three readers keep their speed beside a client that stopped reading?

Two llama-grpc servers (4 slots each), one with back-pressure (--stream-buffer-tokens, the
default 256 unless --buffer-tokens says otherwise) and one without (--stream-buffer-tokens 0,
the behaviour before it existed). Three conditions, rotated within every repetition:

- alone: three greedy streams (--gen-tokens each) read at full speed on the back-pressure
  server, nothing else running;
- paused: the same three streams on the same server, beside a fourth stream whose client read
  its first delta and then stopped (a small HTTP/2 receive window, so grpc stops accepting its
  messages within a few dozen tokens); the run starts once GetStats reports it paused;
- unbounded: the same, on the server without back-pressure, where the stopped stream keeps
  decoding (to --stopped-max-tokens) into its unbounded queue while the three read.

Measured per run: the three readers' aggregate tok/s (wall), forward passes per generated
token of theirs (a pass serves every running slot; noise does not move it), the server's CPU
ms per reader token, the server's RSS at the end, and for the stopped stream the tokens the
server generated for it while the readers ran (GetStats generated_tokens, less the readers')
and its unread tokens as the back-pressure server counts them (SlotStats buffered_tokens; the
server without back-pressure does not track them). Reported: medians and spread over the
repetitions, the paired per-rep ratios paused / alone and unbounded / alone, and the load
average at start and end.

    make bench-backpressure      # or: python bench/backpressure.py --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    greedy_params,
    llama_grpc_process,
    machine_facts,
    progress,
    server_args,
    spread,
    write_json,
)
from speculative import Meter, concurrent

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

READERS = (
    "Write a long story about a lighthouse keeper and the ships he counted.",
    "List the rivers of Europe and describe each one in detail.",
    "Explain how a steam engine works, step by step, for a child.",
)
STOPPED = "Describe a busy railway station in the early morning, in great detail."
# The stopped client's receive window: small, so the server's writes wait for it within a few
# dozen tokens (by default HTTP/2 flow control lets ~2,000 small deltas through unread).
SLOW_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
CONDITIONS = ("alone", "paused", "unbounded")
POLL_S = 0.05


class Server:
    """One server: a normal channel (the readers, GetStats) and a slow one (the stopped
    client), and the pid for CPU and RSS."""

    def __init__(self, target: str, pid: int) -> None:
        self.target, self.pid = target, pid

    async def open(self, stack: contextlib.AsyncExitStack) -> None:
        fast = await stack.enter_async_context(grpc.aio.insecure_channel(self.target))
        slow = grpc.aio.insecure_channel(self.target, options=SLOW_OPTIONS)
        await stack.enter_async_context(slow)
        self.stub = pb_grpc.LlmServiceStub(fast)
        self.slow = pb_grpc.LlmServiceStub(slow)
        self.meter = Meter(self.stub, self.pid)

    async def stats(self) -> Any:
        return await self.stub.GetStats(pb.GetStatsRequest())

    async def until(self, what: str, holds: Any, timeout_s: float = 120.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not holds(await self.stats()):
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise RuntimeError(f"waited {timeout_s:g} s for {what}") from None

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


async def with_stopped_reader(
    server: Server, args: argparse.Namespace, *, pauses: bool
) -> dict[str, float]:
    """The readers' run beside a stream whose client read one delta and stopped (`pauses`: the
    server has back-pressure); the stopped call is cancelled afterwards and the run ends once
    every slot is idle again."""
    params = greedy_params(args.stopped_max_tokens)
    generated_before = (await server.stats()).generated_tokens
    call = server.slow.StreamGenerate(pb.StreamGenerateRequest(prompt=STOPPED, params=params))
    await anext(aiter(call))  # its first delta; then the client reads nothing more
    if pauses:
        await server.until("the stopped stream paused", lambda s: s.paused_streams == 1)
    else:  # unbounded: it decodes on; start once it is past its prefill
        await server.until("the stopped stream decoding", lambda s: s.generating_slots == 1)
    result = await concurrent(server.meter, READERS, greedy_params(args.gen_tokens))
    stats = await server.stats()
    readers = len(READERS) * args.gen_tokens
    result["stopped_generated_tokens"] = float(stats.generated_tokens - generated_before - readers)
    result["stopped_unread_tokens"] = float(max(s.buffered_tokens for s in stats.slots))
    result["rss_mib"] = server.rss_mib()
    call.cancel()
    await server.until("every slot idle", lambda s: s.active_slots == 0)
    return result


async def run(servers: dict[str, Server], condition: str, args: argparse.Namespace) -> Any:
    if condition == "alone":
        result = await concurrent(servers["bounded"].meter, READERS, greedy_params(args.gen_tokens))
        result["rss_mib"] = servers["bounded"].rss_mib()
        return result
    pauses = condition == "paused"
    server = servers["bounded" if pauses else "unbounded"]
    return await with_stopped_reader(server, args, pauses=pauses)


def ratios(got: dict[str, list[dict[str, float]]], condition: str) -> list[float]:
    return [c["tok_s"] / a["tok_s"] for c, a in zip(got[condition], got["alone"], strict=True)]


async def measure(targets: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict:
    got: dict[str, list[dict[str, float]]] = {c: [] for c in CONDITIONS}
    async with contextlib.AsyncExitStack() as stack:
        servers = {name: Server(*target) for name, target in targets.items()}
        for server in servers.values():
            await server.open(stack)
            await concurrent(server.meter, READERS, greedy_params(8))  # warm-up
        for rep in range(args.reps):
            order = CONDITIONS[rep % 3 :] + CONDITIONS[: rep % 3]
            for condition in order:
                got[condition].append(await run(servers, condition, args))
            progress(
                f"rep {rep + 1}/{args.reps}: "
                + " ".join(f"{c} {got[c][-1]['tok_s']:.1f} tok/s" for c in CONDITIONS)
            )
    keys = ("tok_s", "passes_per_token", "cpu_ms_per_token", "rss_mib")
    return {
        "conditions": {
            c: {key: spread([r[key] for r in got[c]]) for key in keys}
            | {
                key: spread([r[key] for r in got[c]])
                for key in ("stopped_generated_tokens", "stopped_unread_tokens")
                if c != "alone"
            }
            for c in CONDITIONS
        },
        "paused_over_alone": statistics.median(ratios(got, "paused")),
        "paused_over_alone_per_rep": ratios(got, "paused"),
        "unbounded_over_alone": statistics.median(ratios(got, "unbounded")),
        "unbounded_over_alone_per_rep": ratios(got, "unbounded"),
        "runs": got,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--stopped-max-tokens", type=int, default=900)
    parser.add_argument("--buffer-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    modes = {"bounded": str(args.buffer_tokens), "unbounded": "0"}
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, bound in modes.items():
            progress(f"starting llama-grpc --stream-buffer-tokens {bound}")
            flags = ("--n-parallel", "4", "--stream-buffer-tokens", bound)
            target, proc = stack.enter_context(
                llama_grpc_process(*server_args(args.threads, *flags))
            )
            targets[name] = (target, proc.pid)
        result = asyncio.run(measure(targets, args))
    data = {
        "benchmark": "backpressure",
        "command": "python bench/backpressure.py " + " ".join(sys.argv[1:]),
        "workload": {"readers": READERS, "stopped": STOPPED, "greedy": True},
        "settings": vars(args),
        "machine": facts,
        **result,
    }
    write_json("backpressure", finish_facts(data))
    conditions = result["conditions"]
    print(
        "readers' tok/s: "
        + ", ".join(f"{c} {conditions[c]['tok_s']['median']:.1f}" for c in CONDITIONS)
        + f"; paused/alone {result['paused_over_alone']:.3f}, "
        f"unbounded/alone {result['unbounded_over_alone']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
