"""Scale-out benchmark: a multi-session chat workload (S sessions at once, T turns each, every
turn resending the whole history) through Envoy with ring hash on x-session-id, through Envoy
with round robin, both in front of the same 3 replicas (deploy/cluster.py, 1 llama.cpp thread
each on this 2-core box), and against one replica with both threads. Reported per setup:
prefix-cache hit rate (cached / prompt tokens of turns 2..T), time to first token p50/p95 of
those turns, and the wall time of the whole workload. Setups alternate in every repetition and
each repetition uses new session names, so no setup inherits another's caches.

Throughput does not scale here: three replicas share the same 2 cores. What the cluster changes
and this measures is affinity (hit rate) and its effect on latency.

    make bench-cluster           # or: python bench/cluster.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    finish_facts,
    llama_grpc_process,
    machine_facts,
    percentile,
    progress,
    pyplot,
    save_figure,
    write_json,
)
from deploy.cluster import Cluster

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

SETUPS = ("ring_hash", "round_robin", "single")
SERVER_ARGS = ("--n-ctx", "8192", "--n-parallel", "8")
# One replica gets both threads and a slot per session, so it keeps every session's cache too.
SINGLE_ARGS = ("--n-ctx", "8192", "--n-parallel", "16", "--threads", "2", "--threads-batch", "2")
QUESTIONS = (
    "Describe the harbour town in one sentence.",
    "What do its fishermen catch in winter?",
    "Which festival do they hold in spring?",
    "What is sold at the market on that day?",
    "How do visitors reach the town?",
    "Where do they stay for the night?",
)
SYSTEM = "You are a guide for a small harbour town. Answer briefly and concretely. " * 4


async def turn(
    stub: Any, prompt: str, session: str, max_tokens: int
) -> tuple[float, int, int, str]:
    """One streamed turn: (TTFT s, prompt tokens, cached prompt tokens, reply text)."""
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    ttft: float | None = None
    text = []
    call = stub.StreamGenerate(
        pb.StreamGenerateRequest(prompt=prompt, params=params, session_id=session),
        metadata=(("x-session-id", session),),
    )
    prompt_tokens = cached = 0
    async for message in call:
        if message.HasField("delta"):
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(message.delta.text)
        elif message.HasField("done"):
            prompt_tokens = message.done.usage.prompt_tokens
            cached = message.done.usage.cached_prompt_tokens
    return (ttft if ttft is not None else float("nan")), prompt_tokens, cached, "".join(text)


async def conversation(
    stub: Any, session: str, turns: int, max_tokens: int
) -> list[tuple[float, int, int]]:
    history = SYSTEM + f"\n(conversation {session})\n"
    out = []
    for question in QUESTIONS[:turns]:
        history += f"User: {question}\nAssistant:"
        ttft, prompt_tokens, cached, reply = await turn(stub, history, session, max_tokens)
        out.append((ttft, prompt_tokens, cached))
        history += reply + "\n"
    return out


async def workload(
    target: str, tag: str, sessions: int, turns: int, max_tokens: int
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(conversation(stub, f"{tag}-{i}", turns, max_tokens) for i in range(sessions))
        )
        wall = time.perf_counter() - t0
    later = [t for conv in results for t in conv[1:]]
    return {
        "wall_s": wall,
        "hit_rate": sum(c for _, _, c in later) / sum(p for _, p, _ in later),
        "ttft_s": [t for t, _, _ in later],
        "first_turn_ttft_s": [conv[0][0] for conv in results],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    facts = machine_facts()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
    progress(f"starting {args.replicas} replicas, Envoy (ring hash and round robin), one replica")
    with (
        Cluster(args.replicas, server_args=SERVER_ARGS) as ring,
        llama_grpc_process(*SINGLE_ARGS) as (single, _),
    ):
        robin = Cluster(lb_policy="ROUND_ROBIN", members=ring.members)
        robin.start_envoy()
        try:
            targets = {"ring_hash": ring.target, "round_robin": robin.target, "single": single}
            for rep in range(args.reps):
                order = SETUPS[rep % 3 :] + SETUPS[: rep % 3]
                for setup in order:
                    got = asyncio.run(
                        workload(targets[setup], f"{setup}-{rep}", args.sessions, args.turns,
                                 args.max_tokens)
                    )  # fmt: skip
                    runs[setup].append(got)
                    progress(
                        f"rep {rep + 1}/{args.reps} {setup}: hit rate {got['hit_rate']:.2f}, "
                        f"TTFT p50 {statistics.median(got['ttft_s']) * 1000:.0f} ms, "
                        f"wall {got['wall_s']:.1f} s"
                    )
        finally:
            robin.close_envoy()
    rows = []
    for setup in SETUPS:
        ttft = [t for r in runs[setup] for t in r["ttft_s"]]
        rows.append(
            {
                "setup": setup,
                "hit_rate": statistics.median(r["hit_rate"] for r in runs[setup]),
                "hit_rate_per_rep": [r["hit_rate"] for r in runs[setup]],
                "ttft_p50_ms": percentile(ttft, 0.5) * 1000,
                "ttft_p95_ms": percentile(ttft, 0.95) * 1000,
                "wall_s_median": statistics.median(r["wall_s"] for r in runs[setup]),
                "wall_s_per_rep": [r["wall_s"] for r in runs[setup]],
            }
        )
    data = {
        "benchmark": "cluster",
        "command": "python bench/cluster.py " + " ".join(sys.argv[1:]),
        "workload": {
            "sessions": args.sessions,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "replicas": args.replicas,
            "server_args": list(SERVER_ARGS),
            "single_args": list(SINGLE_ARGS),
        },
        "machine": facts,
        "rows": rows,
    }
    write_json("cluster", finish_facts(data))
    plot(rows)
    for r in rows:
        print(
            f"{r['setup']:>12}  hit rate {r['hit_rate']:.2f}  TTFT p50 {r['ttft_p50_ms']:.0f} ms "
            f"p95 {r['ttft_p95_ms']:.0f} ms  wall {r['wall_s_median']:.1f} s"
        )
    return 0


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["setup"] for r in rows]
    colors = ["#27a", "#a72", "#888"]
    left.bar(names, [r["hit_rate"] for r in rows], color=colors)
    left.set_ylim(0, 1)
    left.set_ylabel("prefix-cache hit rate, turns 2..T")
    x = range(len(rows))
    right.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [r["ttft_p95_ms"] for r in rows], 0.4, label="p95")
    right.set_xticks(list(x), names)
    right.set_ylabel("TTFT of turns 2..T (ms)")
    right.legend()
    fig.suptitle("Multi-session chat: ring hash vs round robin (3 replicas) vs one replica")
    save_figure(fig, "cluster")


if __name__ == "__main__":
    raise SystemExit(main())
