"""Batch strategies on a mixed workload: short interactive streams are generating when long
prompts arrive. For each configuration (strategy, chunk size, prefill stall) one llama-grpc
server runs with `--batch-strategy`; all servers are started up front and the repetitions
rotate through them, so background noise hits every strategy alike (an idle server's engine
thread sleeps).

One episode: 4 interactive streams (32-token prompts, greedy) start together; once each has
generated 24 tokens (the idle window: from each stream's 4th token to then), two 2,048-token
prompts arrive 0.5 s apart (16 tokens each); the streams are stopped 0.3 s after both long
requests have finished. Measured per configuration, over all repetitions:
  - inter-token latency (ITL) of the interactive streams while idle (before the first long
    prompt arrives) and while a long prompt is prefilling (arrival to its first token): p50/p95,
    and the ratio p95 during prefill / p95 idle (target for decode_maximal with
    --prefill-stall 2, the interactive setting: <= 2; the default, no stall bound, feeds a
    prompt in whole chunks, as llama-server does);
  - TTFT of the long prompts;
  - throughput: generated tokens/s and all tokens (prompt + generated)/s over the episode.

    make bench-strategies             # or: python bench/strategies.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    StreamRecord,
    finish_facts,
    greedy_params,
    llama_grpc_server,
    machine_facts,
    percentile,
    progress,
    prompt_of,
    pyplot,
    save_figure,
    server_args,
    spread,
    stream_tokens,
    write_json,
)

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

N_STREAMS = 4
SHORT_PROMPT = 32
LONG_PROMPT = 2048
N_LONG = 2
LONG_GEN = 16
IDLE_TOKENS = 24  # every stream has generated this many before the long prompts arrive
SKIP_TOKENS = 4  # a stream's first tokens are not part of the idle window
LONG_GAP_S = 0.5
SETTLE_S = 0.3


async def interactive(
    stub: Any, ids: list[int], record: StreamRecord, ready: asyncio.Event, records: list[Any]
) -> None:
    """Stream until cancelled, recording each token's arrival into `record`; set `ready` once
    every stream has IDLE_TOKENS tokens."""
    params = greedy_params(4000, cache_prompt=False)
    call = stub.GenerateTokens(pb.GenerateTokensRequest(token_ids=ids, params=params))
    try:
        async for msg in call:
            if msg.HasField("delta"):
                now = time.perf_counter()
                record.times += [now] * len(msg.delta.token_ids)
                record.n_tokens += len(msg.delta.token_ids)
                if not ready.is_set() and all(r.n_tokens >= IDLE_TOKENS for r in records):
                    ready.set()
    finally:
        call.cancel()
        record.t_done = time.perf_counter()


async def episode(stub: Any, rep: int) -> dict[str, Any]:
    shorts = [await prompt_of(stub, SHORT_PROMPT, seed=100 * rep + i) for i in range(N_STREAMS)]
    longs = [await prompt_of(stub, LONG_PROMPT, seed=100 * rep + 50 + i) for i in range(N_LONG)]
    t0 = time.perf_counter()
    records = [StreamRecord(t0) for _ in shorts]
    ready = asyncio.Event()
    tasks = [
        asyncio.create_task(interactive(stub, ids, rec, ready, records))
        for ids, rec in zip(shorts, records, strict=True)
    ]
    long_params = greedy_params(LONG_GEN, cache_prompt=False)
    await ready.wait()
    first_arrival = time.perf_counter()

    async def late(i: int) -> StreamRecord:
        await asyncio.sleep(i * LONG_GAP_S)
        return await stream_tokens(stub, longs[i], params=long_params)

    long_records = await asyncio.gather(*(late(i) for i in range(N_LONG)))
    await asyncio.sleep(SETTLE_S)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task
    t_end = time.perf_counter()
    windows = [(r.t_send, r.times[0]) for r in long_records]
    idle_gaps: list[float] = []
    prefill_gaps: list[float] = []
    for rec in records:
        for k, (a, b) in enumerate(zip(rec.times, rec.times[1:], strict=False)):
            if k + 1 >= SKIP_TOKENS and b <= first_arrival:
                idle_gaps.append(b - a)
            elif any(w0 <= b <= w1 for w0, w1 in windows):
                prefill_gaps.append(b - a)
    generated = sum(r.n_tokens for r in records) + sum(r.n_tokens for r in long_records)
    prompt_tokens = N_STREAMS * SHORT_PROMPT + N_LONG * LONG_PROMPT
    return {
        "idle_gaps_s": idle_gaps,
        "prefill_gaps_s": prefill_gaps,
        "long_ttft_s": [r.ttft_s for r in long_records],
        "stream_ttft_s": [r.ttft_s for r in records],
        "episode_s": t_end - t0,
        "generated_tokens": generated,
        "generated_tok_s": generated / (t_end - t0),
        "all_tok_s": (generated + prompt_tokens) / (t_end - t0),
    }


def parse_configs(spec: str) -> list[tuple[str, int, float]]:
    """strategy[@chunk_size[@prefill_stall]],... -> (strategy, chunk size, stall); the chunk size
    512 and the stall 0 (no bound: the default) where not given."""
    out = []
    for item in spec.split(","):
        name, chunk, stall, *_ = [*item.split("@"), "", ""]
        out.append((name, int(chunk or 512), float(stall or 0)))
    return out


def config_key(name: str, chunk: int, stall: float) -> str:
    return f"{name}@{chunk}" + (f"@{stall:g}" if stall else "")


async def measure(targets: dict[str, str], reps: int) -> dict[str, list[dict[str, Any]]]:
    channels = {k: grpc.aio.insecure_channel(t) for k, t in targets.items()}
    stubs = {k: pb_grpc.LlmServiceStub(c) for k, c in channels.items()}
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in targets}
    try:
        for key, stub in stubs.items():  # warm-up: one long and one short request each
            params = greedy_params(4, cache_prompt=False)
            await stream_tokens(stub, await prompt_of(stub, LONG_PROMPT, seed=9), params=params)
            await stream_tokens(stub, await prompt_of(stub, SHORT_PROMPT, seed=9), params=params)
            progress(f"warm-up {key} done")
        keys = list(targets)
        for rep in range(reps):
            order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
            for key in order:
                ep = await episode(stubs[key], rep)
                out[key].append(ep)
                idle = percentile(ep["idle_gaps_s"], 0.95) * 1000
                busy = percentile(ep["prefill_gaps_s"], 0.95) * 1000
                progress(
                    f"rep {rep + 1}/{reps} {key:<22}: ITL p95 idle {idle:6.1f} ms, during "
                    f"prefill {busy:7.1f} ms; long TTFT "
                    + ", ".join(f"{t:.2f}s" for t in ep["long_ttft_s"])
                    + f"; {ep['generated_tok_s']:.1f} gen tok/s"
                )
    finally:
        for c in channels.values():
            await c.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="decode_maximal,decode_maximal@512@2,prefill_priority,balanced",
        help="strategy[@chunk_size[@prefill_stall]],... (chunk size 512, stall 0 by default)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    configs = parse_configs(args.configs)
    n_par = N_STREAMS + N_LONG
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, chunk, stall in configs:
            key = config_key(name, chunk, stall)
            progress(f"starting llama-grpc {key}")
            extra = ["--batch-strategy", name, "--chunk-size", str(chunk)]
            extra += ["--prefill-stall", f"{stall:g}", "--n-parallel"]
            targets[key] = stack.enter_context(
                llama_grpc_server(*server_args(args.threads, *extra, str(n_par)))
            )
        episodes = asyncio.run(measure(targets, args.reps))
    rows = []
    for key, eps in episodes.items():
        idle = [g * 1000 for ep in eps for g in ep["idle_gaps_s"]]
        busy = [g * 1000 for ep in eps for g in ep["prefill_gaps_s"]]
        idle_p95, busy_p95 = percentile(idle, 0.95), percentile(busy, 0.95)
        name, chunk, *stall = key.split("@")
        rows.append(
            {
                "config": key,
                "strategy": name,
                "chunk_size": int(chunk),
                "prefill_stall": float(stall[0]) if stall else 0.0,
                "itl_idle_ms": spread(idle),
                "itl_during_prefill_ms": spread(busy),
                "p95_ratio_prefill_vs_idle": busy_p95 / idle_p95,
                "p50_ratio_prefill_vs_idle": percentile(busy, 0.5) / percentile(idle, 0.5),
                "long_ttft_s": spread([t for ep in eps for t in ep["long_ttft_s"]]),
                "generated_tok_s": spread([ep["generated_tok_s"] for ep in eps]),
                "all_tok_s": spread([ep["all_tok_s"] for ep in eps]),
                "episode_s": spread([ep["episode_s"] for ep in eps]),
                "itl_idle_samples_ms": idle,
                "itl_during_prefill_samples_ms": busy,
            }
        )
    data = {
        "benchmark": "strategies",
        "command": "python bench/strategies.py " + " ".join(sys.argv[1:]),
        "workload": {
            "interactive_streams": N_STREAMS,
            "short_prompt_tokens": SHORT_PROMPT,
            "long_prompts": N_LONG,
            "long_prompt_tokens": LONG_PROMPT,
            "long_generated_tokens": LONG_GEN,
            "idle_tokens_before_long_prompts": IDLE_TOKENS,
            "long_arrival_gap_s": LONG_GAP_S,
            "n_parallel": n_par,
        },
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json("strategies", finish_facts(data))
    plot(rows)
    for r in rows:
        print(
            f"{r['config']:<22} ITL p50/p95 idle {r['itl_idle_ms']['p50']:6.1f}/"
            f"{r['itl_idle_ms']['p95']:6.1f} ms, during prefill "
            f"{r['itl_during_prefill_ms']['p50']:7.1f}/{r['itl_during_prefill_ms']['p95']:7.1f} ms "
            f"(p95 x{r['p95_ratio_prefill_vs_idle']:.1f}); long TTFT "
            f"{r['long_ttft_s']['median']:.2f} s; {r['generated_tok_s']['median']:.1f} gen tok/s, "
            f"{r['all_tok_s']['median']:.1f} all tok/s"
        )
    return 0


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(rows):
        color = f"C{i}"
        for key, style, label in (
            ("itl_during_prefill_samples_ms", "-", "during prefill"),
            ("itl_idle_samples_ms", ":", "idle"),
        ):
            xs = sorted(r[key])
            if xs:
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
                ax1.step(xs, ys, style, color=color, where="post", label=f"{r['config']} {label}")
    ax1.set_xscale("log")
    ax1.set_xlabel("inter-token latency of running streams (ms, log)")
    ax1.set_ylabel("CDF")
    ax1.set_title("running streams while 2,048-token prompts arrive")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    labels = [r["config"] for r in rows]
    ttft = [r["long_ttft_s"]["median"] for r in rows]
    tput = [r["generated_tok_s"]["median"] for r in rows]
    xs = range(len(rows))
    ax2.bar([x - 0.2 for x in xs], ttft, width=0.4, color="C3", label="long-prompt TTFT (s)")
    ax2.set_ylabel("TTFT of the 2,048-token prompts (s)")
    ax2.set_xticks(list(xs), labels, rotation=15, fontsize=8)
    ax3 = ax2.twinx()
    ax3.bar([x + 0.2 for x in xs], tput, width=0.4, color="C2", label="generated tok/s")
    ax3.set_ylabel("generated tokens/s over the episode")
    ax2.set_title("TTFT of new long prompts (red) and throughput (green)")
    save_figure(fig, "strategies")


if __name__ == "__main__":
    sys.exit(main())
