"""Concurrency benchmark: the raw in-process llama.cpp loop (the limit) vs llama-grpc through
gRPC with B concurrent GenerateTokens streams doing the same work (41-token prompts, 64 greedy
tokens, ignore_eos, cache_prompt=false), for B = 1, 4, 8, 16. Both run in this one run and
alternate within every repetition (raw first on even repetitions, llama-grpc first on odd ones),
so background noise hits both. Efficiency = raw wall time / llama-grpc wall time (medians;
`efficiency_best` compares the fastest repetition of each, the least disturbed by other work).

    make bench-concurrency            # or: python bench/concurrency.py --reps 5
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
    finish_facts,
    greedy_params,
    llama_grpc_server,
    machine_facts,
    plot_rates,
    progress,
    pyplot,
    save_figure,
    server_args,
    spread,
    stream_tokens,
    write_json,
)
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.models.files import default_model_path

PROMPT_TOKENS = 41
GEN_TOKENS = 64
TEXT = (
    "Request {i}: write a short paragraph about the history of the city, its rivers, bridges, "
    "markets, music and the people who lived there across many centuries of change and growth, "
    "with attention to trade, architecture, food, festivals and the seasons of the year."
)


def prompt_text(i: int, rep: int) -> str:
    return TEXT.format(i=i + 100 * rep)


def make_prompts(raw: RawLoop, batch: int, rep: int) -> list[list[int]]:
    prompts = []
    for i in range(batch):
        ids = raw.model.tokenize(prompt_text(i, rep), add_special=True, parse_special=False)
        assert len(ids) >= PROMPT_TOKENS, len(ids)
        prompts.append(ids[:PROMPT_TOKENS])
    return prompts


async def grpc_run(stub: Any, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    """Wall seconds for B concurrent streams (send of the first to end of the last), tokens."""
    params = greedy_params(gen, cache_prompt=False)
    t0 = time.perf_counter()
    records = await asyncio.gather(*(stream_tokens(stub, p, params=params) for p in prompts))
    return time.perf_counter() - t0, sum(r.n_tokens for r in records)


async def measure(
    raw: RawLoop, target: str, batches: list[int], reps: int, gen: int
) -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        for b in (1, max(batches)):  # warm-up both paths, small and large
            raw.run(make_prompts(raw, b, 999), 8)
            await grpc_run(stub, make_prompts(raw, b, 998), 8)
        progress("warm-up done")
        for b in batches:
            raw_t: list[float] = []
            grpc_t: list[float] = []
            for rep in range(reps):
                prompts = make_prompts(raw, b, rep)
                order = ("raw", "grpc") if rep % 2 == 0 else ("grpc", "raw")
                for which in order:
                    if which == "raw":
                        raw_t.append(raw.run(prompts, gen))
                    else:
                        seconds, n = await grpc_run(stub, prompts, gen)
                        if n != b * gen:
                            raise RuntimeError(f"expected {b * gen} tokens, got {n}")
                        grpc_t.append(seconds)
                progress(
                    f"B={b:>2} rep {rep + 1}/{reps}: raw {raw_t[-1]:.3f}s "
                    f"llama-grpc {grpc_t[-1]:.3f}s ({raw_t[-1] / grpc_t[-1]:.3f})"
                )
            raw_m, grpc_m = statistics.median(raw_t), statistics.median(grpc_t)
            rows.append(
                {
                    "batch": b,
                    "raw_s": spread(raw_t),
                    "llama_grpc_s": spread(grpc_t),
                    "raw_tok_s": b * gen / raw_m,
                    "llama_grpc_tok_s": b * gen / grpc_m,
                    "efficiency": raw_m / grpc_m,
                    "efficiency_best": min(raw_t) / min(grpc_t),
                    "efficiency_per_rep": [r / g for r, g in zip(raw_t, grpc_t, strict=True)],
                }
            )
    return rows


def add_workload_args(parser: argparse.ArgumentParser, batches: str) -> None:
    """The concurrency workload's options (overhead.py and gateway.py run it too)."""
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=GEN_TOKENS)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--n-ctx", type=int, default=8192)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, "1,4,8,16")
    parser.add_argument(
        "--name", default="concurrency", help="results file name (concurrency_rerun: a rerun)"
    )
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    batches = [int(b) for b in args.batches.split(",")]
    n_par = max(batches)
    progress("loading the raw loop model")
    raw = RawLoop(str(default_model_path()), args.n_ctx, n_par, args.threads)
    extra = ["--n-parallel", str(n_par), "--n-ctx", str(args.n_ctx)]
    progress("starting llama-grpc")
    with llama_grpc_server(*server_args(args.threads, *extra)) as target:
        rows = asyncio.run(measure(raw, target, batches, args.reps, args.gen_tokens))
    raw.close()
    data = {
        "benchmark": "concurrency",
        "command": "python bench/concurrency.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt_tokens": PROMPT_TOKENS, "generated_tokens": args.gen_tokens},
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json(args.name, finish_facts(data))
    plot(rows, args.gen_tokens, args.name)
    for r in rows:
        print(
            f"B={r['batch']:>2}  raw {r['raw_tok_s']:7.1f} tok/s  llama-grpc "
            f"{r['llama_grpc_tok_s']:7.1f} tok/s  efficiency {r['efficiency']:.3f}"
        )
    return 0


def plot(rows: list[dict[str, Any]], gen: int, name: str) -> None:
    plt = pyplot()
    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    series = [("raw_tok_s", "o-", "raw llama.cpp loop (limit)"),
              ("llama_grpc_tok_s", "s-", "llama-grpc (gRPC streams)")]  # fmt: skip
    plot_rates(ax, rows, series, "efficiency")
    ax.set_title(f"Gemma 3 270M Q4_K_M, {PROMPT_TOKENS}-token prompts, {gen} tokens")
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    sys.exit(main())
