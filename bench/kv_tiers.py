"""Where a conversation's KV comes from, and what each tier costs: time to first token of a
follow-up to a 2,000-token history (GenerateTokens, the history + 8 new tokens, 8 greedy tokens)
when the history's KV is

- cold: computed from scratch (cache_prompt=false on the slot server);
- slot: still in the slot that served it (the slot server, n_parallel 1);
- ram: evicted from the slot by an unrelated request into the RAM tier (--prompt-cache-ram-mb)
  and restored from it;
- disk: saved by a server with --kv-cache-dir at SIGTERM and restored by a new server process
  started on the same directory (a restart).

Every repetition takes a new history (different text) and runs the four in rotating order; the
two long-lived servers sit idle while another is measured. Reported: TTFT medians (min-max) at
the client and as the server measured it, the cached prompt tokens, the disk file's size and
the disk tier's read + verify rate (GetStats: bytes / disk_cache_read_seconds).

    make bench-kv-tiers          # or: python bench/kv_tiers.py --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    greedy_params,
    llama_grpc_process,
    machine_facts,
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

HISTORY_TOKENS = 2000
TAIL_TOKENS = 8
GEN_TOKENS = 8
N_CTX = 4096
TIERS = ("cold", "slot", "ram", "disk")


@contextlib.contextmanager
def server(threads: int, *extra: str) -> Iterator[tuple[str, Any]]:
    args = server_args(threads, "--n-ctx", str(N_CTX), "--n-parallel", "1", *extra)
    with llama_grpc_process(*args) as running:
        yield running


async def follow_up(target: str, history: list[int], tail: list[int], **kw: Any) -> Any:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        return await stream_tokens(stub, [*history, *tail], params=greedy_params(GEN_TOKENS, **kw))


async def serve_history(target: str, history: list[int]) -> None:
    """Turn 1: the history becomes this server's slot cache (1 generated token)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        await stream_tokens(stub, history, params=greedy_params(1))


async def disk_stats(target: str) -> Any:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.LlmServiceStub(channel).GetStats(pb.GetStatsRequest())


def run_disk(threads: int, history: list[int], tail: list[int]) -> tuple[Any, dict[str, Any]]:
    """A server saves the history at SIGTERM; a new one on the same directory restores it."""
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as directory:
        tier = ("--kv-cache-dir", directory)
        with server(threads, *tier) as (target, proc):
            asyncio.run(serve_history(target, history))
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            shutdown_s = time.perf_counter() - t0
        files = list(Path(directory).glob("*.lgkv"))
        size = sum(f.stat().st_size for f in files)
        t0 = time.perf_counter()
        with server(threads, *tier) as (target, _):
            start_s = time.perf_counter() - t0
            record = asyncio.run(follow_up(target, history, tail))
            stats = asyncio.run(disk_stats(target))
    extra = {
        "file_bytes": size,
        "files": len(files),
        "read_seconds": stats.disk_cache_read_seconds,
        "hits": stats.disk_cache_hits,
        "shutdown_s": shutdown_s,
        "restart_to_serving_s": start_s,
    }
    return record, extra


def measure(threads: int, reps: int) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {t: [] for t in TIERS}
    with (
        server(threads) as (slot_target, _),
        server(threads, "--prompt-cache-ram-mb", "1024") as (ram_target, _),
    ):
        for rep in range(reps):
            seed = 1000 + rep

            async def ids(target: str, n: int, s: int) -> list[int]:
                async with grpc.aio.insecure_channel(target) as channel:
                    return await prompt_of(pb_grpc.LlmServiceStub(channel), n, s)

            history = asyncio.run(ids(slot_target, HISTORY_TOKENS, seed))
            tail = asyncio.run(ids(slot_target, TAIL_TOKENS + 1, seed + 500))[1:]
            unrelated = asyncio.run(ids(slot_target, 300, seed + 900))
            order = TIERS[rep % len(TIERS) :] + TIERS[: rep % len(TIERS)]
            for tier in order:
                extra: dict[str, Any] = {}
                if tier == "cold":
                    record = asyncio.run(follow_up(slot_target, history, tail, cache_prompt=False))
                elif tier == "slot":
                    asyncio.run(serve_history(slot_target, history))
                    record = asyncio.run(follow_up(slot_target, history, tail))
                elif tier == "ram":
                    asyncio.run(serve_history(ram_target, history))
                    asyncio.run(serve_history(ram_target, unrelated))  # evicts it into RAM
                    record = asyncio.run(follow_up(ram_target, history, tail))
                else:
                    record, extra = run_disk(threads, history, tail)
                row = {**record.as_dict(), **extra, "rep": rep}
                samples[tier].append(row)
                progress(
                    f"rep {rep + 1}/{reps} {tier}: TTFT {record.ttft_s * 1000:.0f} ms, "
                    f"cached {record.cached_prompt_tokens}"
                )
    return samples


def summarize(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    cold = spread([s["ttft_s"] for s in samples["cold"]])["median"]
    for tier in TIERS:
        runs = samples[tier]
        ttft = spread([s["ttft_s"] * 1000 for s in runs])
        row: dict[str, Any] = {
            "tier": tier,
            "ttft_ms": ttft,
            "server_ttft_ms": spread([s["server_ttft_ms"] for s in runs]),
            "cached_prompt_tokens": spread([s["cached_prompt_tokens"] for s in runs]),
            "speedup_vs_cold": cold * 1000 / ttft["median"],
        }
        if tier == "disk":
            row["file_mb"] = spread([s["file_bytes"] / 2**20 for s in runs])
            row["read_verify_mb_s"] = spread(
                [s["file_bytes"] / 2**20 / s["read_seconds"] for s in runs if s["read_seconds"]]
            )
            row["restart_to_serving_s"] = spread([s["restart_to_serving_s"] for s in runs])
            row["shutdown_s"] = spread([s["shutdown_s"] for s in runs])
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--name", default="kv_tiers")
    args = parser.parse_args()
    data: dict[str, Any] = {
        "command": "python bench/kv_tiers.py " + " ".join(sys.argv[1:]),
        "machine": machine_facts(args.threads),
        "workload": {
            "history_tokens": HISTORY_TOKENS,
            "tail_tokens": TAIL_TOKENS,
            "gen_tokens": GEN_TOKENS,
            "n_ctx": N_CTX,
            "reps": args.reps,
        },
    }
    samples = measure(args.threads, args.reps)
    data["samples"] = samples
    data["rows"] = summarize(samples)
    disk = next(r for r in data["rows"] if r["tier"] == "disk")
    data["targets"] = {"disk_restore_vs_recompute_10x": disk["speedup_vs_cold"] >= 10}
    write_json(args.name, finish_facts(data))
    plot(data["rows"], args.name)
    os.sync()
    return 0


def plot(rows: list[dict[str, Any]], name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = [r["tier"] for r in rows]
    med = [r["ttft_ms"]["median"] for r in rows]
    low = [r["ttft_ms"]["median"] - r["ttft_ms"]["min"] for r in rows]
    high = [r["ttft_ms"]["max"] - r["ttft_ms"]["median"] for r in rows]
    ax.bar(names, med, yerr=[low, high], capsize=4, color=["#888", "#4a7", "#27a", "#a63"])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT ms (log)")
    for i, r in enumerate(rows):
        ax.text(
            i, med[i], f"{med[i]:.0f} ms\nx{r['speedup_vs_cold']:.1f}", ha="center", va="bottom"
        )
    ax.set_title(f"Follow-up to a {HISTORY_TOKENS}-token history: where its KV comes from")
    save_figure(fig, name)


if __name__ == "__main__":
    raise SystemExit(main())
