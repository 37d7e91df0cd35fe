"""Scale-out benchmark: a multi-session chat workload (S sessions at once, T turns each, every
turn resending the whole history) through Envoy with ring hash on x-session-id, through Envoy
with round robin, both in front of the same 3 replicas (deploy/cluster.py, 1 llama.cpp thread
each on this 2-core box), and against one replica with both threads. Reported per setup:
prefix-cache hit rate (cached / prompt tokens of turns 2..T), time to first token p50/p95 of
those turns, and the wall time of the whole workload. Setups alternate in every repetition and
each repetition uses new session names, so no setup inherits another's caches.

Throughput does not scale here: three replicas share the same 2 cores. What the cluster changes
and this measures is affinity (hit rate) and its effect on latency.

The SMG gateway (deploy/gateway.py) joins them in front of the same replicas: `smg_cache_aware`
(SMG's cache_aware policy fed by the replicas' own KV events, no session header) and
`smg_round_robin`, called with the openai SDK (streamed completions of the same text). A second
workload, shared prefixes: P long system prompts (1,500 tokens each) x U users asking one
question each (no history), U requests at most C at a time, interleaved over the prompts.
Reported: the hit rate, and on how many replicas each system prompt got computed (the
replicas' own KV events, subscribed to directly: a replica that announced the prompt's last
whole 16-token block computed it, or restored it from its disk tier).

Targets: on the chat workload, smg_cache_aware's hit rate >= ring hash's and its TTFT p50 <= ring
hash's; on the shared prefixes, smg_cache_aware's hit rate >= ring hash's + 20 points.

    make bench-cluster           # or: python bench/cluster.py --reps 3
    make bench-cluster ARGS="--reps 1 --sessions 3 --turns 2 --prompts 2 --users 4 --name x"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import openai

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
    seeded_text,
    write_json,
)
from deploy.cluster import START_TIMEOUT_S, Cluster, Replica, free_port, terminate, wait_for
from deploy.gateway import CPU_LIVENESS_ARGS, NO_WARM_UP, SMG_STOP_S, Gateway
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llama_grpc import AsyncClient
from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.core.kv.events import BLOCK_SIZE, chain

SETUPS: tuple[str, ...] = (
    "ring_hash",
    "round_robin",
    "smg_cache_aware",
    "smg_round_robin",
    "single",
)
SMG_POLICIES = {"smg_cache_aware": "cache_aware", "smg_round_robin": "round_robin"}
SYSTEM_TOKENS = 1500
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
    """One streamed turn: (TTFT s, prompt tokens, cached prompt tokens, reply text); the
    x-session-id header unless `session` is empty."""
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    ttft: float | None = None
    text = []
    call = stub.StreamGenerate(
        pb.StreamGenerateRequest(prompt=prompt, params=params, session_id=session),
        metadata=(("x-session-id", session),) if session else (),
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


class Front:
    """One setup's client: v1 StreamGenerate through Envoy (with the x-session-id header when
    `sessions`) or to one replica, or the openai SDK's streamed completions through SMG (no
    session header: SMG routes on the prompt alone)."""

    def __init__(self, target: str, *, sdk: Any = None, model: str = "", sessions: bool = True):
        self.target, self.sdk, self.model, self.sessions = target, sdk, model, sessions
        self.channel: Any = None
        self.stub: Any = None

    async def __aenter__(self) -> Front:
        if self.sdk is None:
            self.channel = grpc.aio.insecure_channel(self.target)
            self.stub = pb_grpc.LlmServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def turn(self, prompt: str, session: str, max_tokens: int) -> tuple[float, int, int, str]:
        if self.sdk is None:
            return await turn(self.stub, prompt, session if self.sessions else "", max_tokens)
        t0 = time.perf_counter()
        ttft: float | None = None
        text = []
        prompt_tokens = cached = 0
        stream = await self.sdk.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = details.cached_tokens if details is not None else 0
        return (ttft if ttft is not None else float("nan")), prompt_tokens, cached, "".join(text)


async def conversation(
    front: Front, session: str, turns: int, max_tokens: int
) -> list[tuple[float, int, int]]:
    history = SYSTEM + f"\n(conversation {session})\n"
    out = []
    for question in QUESTIONS[:turns]:
        history += f"User: {question}\nAssistant:"
        ttft, prompt_tokens, cached, reply = await front.turn(history, session, max_tokens)
        out.append((ttft, prompt_tokens, cached))
        history += reply + "\n"
    return out


async def chat_workload(
    front: Front, tag: str, sessions: int, turns: int, max_tokens: int
) -> dict[str, Any]:
    async with front:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(conversation(front, f"{tag}-{i}", turns, max_tokens) for i in range(sessions))
        )
        wall = time.perf_counter() - t0
    later = [t for conv in results for t in conv[1:]]
    return {
        "wall_s": wall,
        "hit_rate": sum(c for _, _, c in later) / sum(p for _, p, _ in later),
        "ttft_s": [t for t, _, _ in later],
        "first_turn_ttft_s": [conv[0][0] for conv in results],
    }


class KvWatch:
    """Every block hash each replica announces (SubscribeKvEvents, any tier), from its snapshot
    on: which replicas computed (or restored) a prefix."""

    def __init__(self, members: list[Replica]) -> None:
        self.members = members
        self.seen: list[set[int]] = [set() for _ in members]
        self.tasks: list[asyncio.Task[None]] = []

    async def _follow(self, index: int) -> None:
        async with grpc.aio.insecure_channel(self.members[index].target) as channel:
            stream = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                cpb.SubscribeKvEventsRequest()
            )
            async for batch in stream:
                for event in batch.events:
                    if event.WhichOneof("data") == "stored":
                        self.seen[index].update(b.block_hash for b in event.stored.blocks)

    async def __aenter__(self) -> KvWatch:
        self.tasks = [asyncio.create_task(self._follow(i)) for i in range(len(self.members))]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def holders(self, block_hash: int) -> int:
        return sum(1 for seen in self.seen if block_hash in seen)


async def system_prompts(target: str, count: int, tag: str) -> list[tuple[str, int]]:
    """`count` distinct system prompts of SYSTEM_TOKENS tokens: (text, the hash of the last
    whole block inside the prompt's tokens with BOS, as the replicas announce it)."""
    out = []
    async with AsyncClient(target, timeout=60) as client:
        for p in range(count):
            words = seeded_text(SYSTEM_TOKENS, seed=hash((tag, p)) & 0xFFFF)
            ids = await client.tokenize(f"[{tag} system {p}] {words}")
            text = await client.detokenize(ids[1 : SYSTEM_TOKENS + 1])  # without the BOS
            ids = await client.tokenize(text)
            whole = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token may merge
            out.append((text, chain("", ids[:whole])[-1].hash))
    return out


async def shared_workload(
    front: Front, watch: KvWatch, prompts: list[tuple[str, int]], *, users: int, concurrency: int,
    max_tokens: int, tag: str,
) -> dict[str, Any]:  # fmt: skip
    """`users` requests, user u asking one question under system prompt u % P, at most
    `concurrency` at a time; each user is its own session (ring hash's header)."""
    gate = asyncio.Semaphore(concurrency)

    async def user(u: int) -> tuple[float, int, int]:
        system, _ = prompts[u % len(prompts)]
        question = QUESTIONS[u % len(QUESTIONS)]
        async with gate:
            ttft, prompt_tokens, cached, _ = await front.turn(
                f"{system}\nUser ({tag} {u}): {question}\nAssistant:", f"{tag}-u{u}", max_tokens
            )
        return ttft, prompt_tokens, cached

    async with front:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # the last announcements (a flush per engine tick) on their way
    return {
        "wall_s": wall,
        "hit_rate": sum(c for _, _, c in results) / sum(p for _, p, _ in results),
        "ttft_s": [t for t, _, _ in results],
        "replicas_per_prompt": [watch.holders(last) for _, last in prompts],
    }


def smg_front(cluster: Cluster, policy: str) -> Gateway:
    """SMG with `policy` in front of the cluster's running replicas (close with terminate)."""
    gateway = Gateway(len(cluster.members), port=free_port(), policy=policy, smg_args=NO_WARM_UP)
    gateway.cluster = cluster  # the replicas already running, not new ones
    gateway.start_smg()
    wait_for(gateway.is_ready, START_TIMEOUT_S, f"SMG ({policy}) not ready", interval_s=0.5)
    return gateway


async def run_rep(
    args: argparse.Namespace, rep: int, fronts: dict[str, Front], *, members: list[Replica],
    single: list[Replica], runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:  # fmt: skip
    order = SETUPS[rep % len(SETUPS) :] + SETUPS[: rep % len(SETUPS)]
    for setup in order:
        got = await chat_workload(
            fronts[setup], f"{setup}-{rep}", args.sessions, args.turns, args.max_tokens
        )
        runs["chat"][setup].append(got)
        progress(
            f"rep {rep + 1}/{args.reps} chat {setup}: hit rate {got['hit_rate']:.2f}, "
            f"TTFT p50 {statistics.median(got['ttft_s']) * 1000:.0f} ms, wall {got['wall_s']:.1f} s"
        )
    for setup in order:
        tag = f"{setup}-{rep}"
        watched = single if setup == "single" else members
        prompts = await system_prompts(watched[0].target, args.prompts, tag)
        async with KvWatch(watched) as watch:
            got = await shared_workload(
                fronts[setup], watch, prompts, users=args.users, concurrency=args.concurrency,
                max_tokens=args.max_tokens, tag=tag,
            )  # fmt: skip
        runs["shared"][setup].append(got)
        progress(
            f"rep {rep + 1}/{args.reps} shared {setup}: hit rate {got['hit_rate']:.2f}, "
            f"replicas per prompt {got['replicas_per_prompt']}, wall {got['wall_s']:.1f} s"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    parser.add_argument("--users", type=int, default=24, help="users, one question each")
    parser.add_argument("--concurrency", type=int, default=6, help="users in flight at once")
    parser.add_argument("--name", default="cluster", help="results file name (a smoke: other)")
    args = parser.parse_args()
    facts = machine_facts()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {s: [] for s in SETUPS} for w in ("chat", "shared")
    }
    progress(f"starting {args.replicas} replicas, Envoy (ring hash, round robin), SMG "
             "(cache_aware, round_robin), one replica")  # fmt: skip
    gateways: list[Gateway] = []
    with (
        Cluster(args.replicas, server_args=SERVER_ARGS) as ring,
        llama_grpc_process(*SINGLE_ARGS) as (single, _),
    ):
        robin = Cluster(lb_policy="ROUND_ROBIN", members=ring.members)
        robin.start_envoy()
        try:
            for policy in SMG_POLICIES.values():
                gateways.append(smg_front(ring, policy))
            asyncio.run(run_all(args, ring, robin, single, gateways=gateways, runs=runs))
        finally:
            for gateway in gateways:
                terminate(gateway.smg, SMG_STOP_S)
            robin.close_envoy()
    data: dict[str, Any] = {
        "benchmark": "cluster",
        "command": "python bench/cluster.py " + " ".join(sys.argv[1:]),
        "workload": {
            "sessions": args.sessions,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "replicas": args.replicas,
            "prompts": args.prompts,
            "system_tokens": SYSTEM_TOKENS,
            "users": args.users,
            "concurrency": args.concurrency,
            "reps": args.reps,
            "server_args": list(SERVER_ARGS),
            "single_args": list(SINGLE_ARGS),
            "smg_args": [*CPU_LIVENESS_ARGS, *NO_WARM_UP],
        },
        "machine": facts,
        "rows": rows_of(runs["chat"]),
        "shared_rows": rows_of(runs["shared"]),
    }
    write_json(args.name, finish_facts(data))
    plot(data, args.name)
    for label, key in (("chat", "rows"), ("shared prefixes", "shared_rows")):
        print(label)
        for r in data[key]:
            extra = (
                f"  replicas per prompt {r['replicas_per_prompt']}" if key == "shared_rows" else ""
            )
            print(
                f"{r['setup']:>16}  hit rate {r['hit_rate']:.2f}  TTFT p50 {r['ttft_p50_ms']:.0f} "
                f"ms p95 {r['ttft_p95_ms']:.0f} ms  wall {r['wall_s_median']:.1f} s{extra}"
            )
    return 0


async def run_all(
    args: argparse.Namespace, ring: Cluster, robin: Cluster, single: str, *,
    gateways: list[Gateway], runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:  # fmt: skip
    sdks = [openai.AsyncOpenAI(base_url=g.base_url, api_key="unused", max_retries=0,
                               timeout=600) for g in gateways]  # fmt: skip
    fronts = {
        "ring_hash": Front(ring.target),
        "round_robin": Front(robin.target, sessions=False),
        "single": Front(single),
    }
    for setup, gateway, sdk in zip(SMG_POLICIES, gateways, sdks, strict=True):
        fronts[setup] = Front(gateway.base_url, sdk=sdk, model=gateway.model, sessions=False)
    port = int(single.rsplit(":", 1)[1])
    single_replica = [Replica(0, port, (), Path(os.devnull))]  # to watch its KV events
    try:
        for rep in range(args.reps):
            await run_rep(args, rep, fronts, members=ring.members, single=single_replica, runs=runs)
    finally:
        for sdk in sdks:
            await sdk.close()


def rows_of(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for setup in SETUPS:
        ttft = [t for r in runs[setup] for t in r["ttft_s"]]
        row = {
            "setup": setup,
            "hit_rate": statistics.median(r["hit_rate"] for r in runs[setup]),
            "hit_rate_per_rep": [r["hit_rate"] for r in runs[setup]],
            "ttft_p50_ms": percentile(ttft, 0.5) * 1000,
            "ttft_p95_ms": percentile(ttft, 0.95) * 1000,
            "wall_s_median": statistics.median(r["wall_s"] for r in runs[setup]),
            "wall_s_per_rep": [r["wall_s"] for r in runs[setup]],
        }
        if "replicas_per_prompt" in runs[setup][0]:
            per_rep = [r["replicas_per_prompt"] for r in runs[setup]]
            row["replicas_per_prompt"] = statistics.median(statistics.mean(p) for p in per_rep)
            row["replicas_per_prompt_per_rep"] = per_rep
        rows.append(row)
    return rows


def plot(data: dict[str, Any], name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    colors = ["#27a", "#a72", "#2a7", "#a27", "#888"]
    chat, shared = data["rows"], data["shared_rows"]
    names = [r["setup"].replace("_", "\n", 1) for r in chat]
    axes[0].bar(names, [r["hit_rate"] for r in chat], color=colors)
    axes[0].set_ylim(0, 1)
    axes[0].set_title("chat: hit rate, turns 2..T")
    x = range(len(chat))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in chat], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p95_ms"] for r in chat], 0.4, label="p95")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("chat: TTFT of turns 2..T (ms)")
    axes[1].legend()
    axes[2].bar(names, [r["hit_rate"] for r in shared], color=colors)
    axes[2].set_ylim(0, 1)
    axes[2].set_title("shared system prompts: hit rate")
    for i, r in enumerate(shared):
        axes[2].text(i, r["hit_rate"] + 0.02, f"{r['replicas_per_prompt']:.1f} repl.",
                     ha="center", fontsize=8)  # fmt: skip
    fig.suptitle("Routing: Envoy ring hash / round robin vs SMG on KV events / round robin "
                 "(3 replicas) vs one replica")  # fmt: skip
    fig.tight_layout()
    save_figure(fig, name)


if __name__ == "__main__":
    raise SystemExit(main())
