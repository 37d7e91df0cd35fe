"""Tokenization overhead: 16 concurrent callers, each sending a ~100-token prompt and streaming
32 greedy tokens (cache_prompt=false), once as text through StreamGenerate (the server tokenizes)
and once as token ids tokenized by the client beforehand through GenerateTokens. Same server,
same prompts, rounds alternating ABBA within one run. Reported: round wall time, aggregate
tokens/s, TTFT p50/p95, and the pre-tokenized path's speedup (target: >= 1.0).

    make bench-tokenize               # or: python bench/tokenize_overhead.py --reps 6
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

from common import (
    DEFAULT_THREADS,
    StreamRecord,
    finish_facts,
    greedy_params,
    llama_grpc_server,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    seeded_text,
    server_args,
    spread,
    stream_tokens,
    tokenize,
    write_json,
)

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

CALLERS = 16
PROMPT_WORDS = 80  # ~100 tokens
GEN_TOKENS = 32
MODES = ("text", "ids")


async def round_(
    stub: Any, mode: str, texts: list[str], ids: list[list[int]]
) -> tuple[float, list[StreamRecord]]:
    params = greedy_params(GEN_TOKENS, cache_prompt=False)
    t0 = time.perf_counter()
    if mode == "text":
        calls = [stream_tokens(stub, text=t, params=params) for t in texts]
    else:
        calls = [stream_tokens(stub, i, params=params) for i in ids]
    records = await asyncio.gather(*calls)
    return time.perf_counter() - t0, list(records)


async def measure(target: str, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {m: {"wall": [], "records": []} for m in MODES}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        rounds = []
        for rep in range(reps + 1):
            texts = [seeded_text(PROMPT_WORDS, 7000 + 100 * rep + i) for i in range(CALLERS)]
            rounds.append((texts, [await tokenize(stub, t) for t in texts]))
        out["prompt_tokens"] = [len(i) for _, ids in rounds for i in ids]
        for mode in MODES:  # warm-up round of each mode
            await round_(stub, mode, *rounds[reps])
        progress("warm-up done")
        for rep in range(reps):
            order = MODES if rep % 4 in (0, 3) else MODES[::-1]  # ABBA
            for mode in order:
                wall, records = await round_(stub, mode, *rounds[rep])
                if any(r.n_tokens != GEN_TOKENS for r in records):
                    raise RuntimeError("a stream ended early")
                out[mode]["wall"].append(wall)
                out[mode]["records"] += records
                progress(
                    f"rep {rep + 1}/{reps} {mode:<4}: {wall:.3f} s, "
                    f"{CALLERS * GEN_TOKENS / wall:.1f} tok/s, TTFT p50 "
                    f"{1000 * statistics.median(r.ttft_s for r in records):.0f} ms"
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    progress("starting llama-grpc")
    extra = ["--n-parallel", str(CALLERS)]
    with llama_grpc_server(*server_args(args.threads, *extra)) as target:
        raw = asyncio.run(measure(target, args.reps))
    rows = {}
    for mode in MODES:
        wall, records = raw[mode]["wall"], raw[mode]["records"]
        ttft = [r.ttft_s * 1000 for r in records]
        rows[mode] = {
            "wall_s": spread(wall),
            "tok_s": CALLERS * GEN_TOKENS / statistics.median(wall),
            "ttft_ms": spread(ttft),
            "wall_samples_s": wall,
        }
    speedup = rows["text"]["wall_s"]["median"] / rows["ids"]["wall_s"]["median"]
    per_rep = [t / i for t, i in zip(raw["text"]["wall"], raw["ids"]["wall"], strict=True)]
    data = {
        "benchmark": "tokenize_overhead",
        "command": "python bench/tokenize_overhead.py " + " ".join(sys.argv[1:]),
        "workload": {
            "callers": CALLERS,
            "prompt_words": PROMPT_WORDS,
            "prompt_tokens_median": statistics.median(raw["prompt_tokens"]),
            "generated_tokens": GEN_TOKENS,
        },
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
        "ids_speedup_over_text": speedup,
        "ids_speedup_per_rep": per_rep,
    }
    write_json("tokenize_overhead", finish_facts(data))
    plot(rows, speedup)
    for mode in MODES:
        r = rows[mode]
        print(
            f"{mode:<4}: round {r['wall_s']['median']:.3f} s (min {r['wall_s']['min']:.3f}, max "
            f"{r['wall_s']['max']:.3f}), {r['tok_s']:.1f} tok/s, TTFT p50 "
            f"{r['ttft_ms']['p50']:.0f} ms p95 {r['ttft_ms']['p95']:.0f} ms"
        )
    print(f"pre-tokenized vs text: x{speedup:.3f} (>1 means ids are faster)")
    return 0


def plot(rows: dict[str, dict[str, Any]], speedup: float) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = ["StreamGenerate (text)", "GenerateTokens (ids)"]
    for ax, key, title in (
        (ax1, "tok_s", "aggregate tokens/s (median round)"),
        (ax2, "ttft_ms", "TTFT p50 / p95 (ms)"),
    ):
        if key == "tok_s":
            vals = [rows[m]["tok_s"] for m in MODES]
            ax.bar(labels, vals, color=["C0", "C1"])
        else:
            vals = [rows[m]["ttft_ms"]["p50"] for m in MODES]
            ax.bar(labels, vals, color=["C0", "C1"])
            ax.scatter(labels, [rows[m]["ttft_ms"]["p95"] for m in MODES], marker="_", s=400,
                       color="k", label="p95")  # fmt: skip
            ax.legend()
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.0f}", (i, v), textcoords="offset points", xytext=(0, 3), ha="center")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{CALLERS} concurrent callers, ~100-token prompts: ids x{speedup:.3f} vs text")
    save_figure(fig, "tokenize_overhead")


if __name__ == "__main__":
    sys.exit(main())
