"""Concurrency benchmark: the raw in-process llama.cpp loop vs llama-grpc through gRPC with B
concurrent streaming clients doing the same work (41-token prompts, 48 greedy tokens,
ignore_eos), for B = 1, 4, 8, 16. Efficiency = raw wall time / llama-grpc wall time.

    make bench-concurrency            # or: python bench/concurrency.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import llama_grpc_server, machine_facts, progress, summary, write_json
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.model_files import default_model_path

PROMPT_TOKENS = 41
GEN_TOKENS = 48
TEXT = (
    "Request {i}: write a short paragraph about the history of the city, its rivers, bridges, "
    "markets, music and the people who lived there across many centuries of change and growth, "
    "with attention to trade, architecture, food, festivals and the seasons of the year."
)


def make_prompts(model: RawLoop, batch: int, rep: int) -> list[list[int]]:
    prompts = []
    for i in range(batch):
        ids = model.model.tokenize(
            TEXT.format(i=i + 100 * rep), add_special=True, parse_special=False
        )
        assert len(ids) >= PROMPT_TOKENS, len(ids)
        prompts.append(ids[:PROMPT_TOKENS])
    return prompts


async def grpc_run(target: str, prompts: list[list[int]]) -> tuple[float, int]:
    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=GEN_TOKENS, ignore_eos=True),
        cache_prompt=False,
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)

        async def one(prompt: list[int]) -> int:
            n = 0
            call = stub.GenerateTokens(pb.GenerateTokensRequest(token_ids=prompt, params=params))
            async for msg in call:
                if msg.HasField("delta"):
                    n += len(msg.delta.token_ids)
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, sum(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=8192)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    n_par = max(batches)
    path = str(default_model_path())
    progress("loading the raw loop model")
    raw = RawLoop(path, args.n_ctx, n_par, args.threads)
    raw.run(make_prompts(raw, 1, 999), 4)  # warm-up
    rows = []
    server_args = ["--n-parallel", str(n_par), "--n-ctx", str(args.n_ctx)]
    server_args += ["--threads", str(args.threads)]
    with llama_grpc_server(*server_args) as target:
        asyncio.run(grpc_run(target, make_prompts(raw, 2, 998)))  # warm-up
        for b in batches:
            raw_t, grpc_t = [], []
            for rep in range(args.reps):
                prompts = make_prompts(raw, b, rep)
                raw_t.append(raw.run(prompts, GEN_TOKENS))
                seconds, n = asyncio.run(grpc_run(target, prompts))
                if n != b * GEN_TOKENS:
                    raise RuntimeError(f"expected {b * GEN_TOKENS} tokens, got {n}")
                grpc_t.append(seconds)
                progress(
                    f"B={b} rep {rep + 1}/{args.reps}: raw {raw_t[-1]:.3f}s grpc {seconds:.3f}s"
                )
            raw_m, grpc_m = statistics.median(raw_t), statistics.median(grpc_t)
            rows.append(
                {
                    "batch": b,
                    "raw_s": summary(raw_t),
                    "llama_grpc_s": summary(grpc_t),
                    "raw_tok_s": b * GEN_TOKENS / raw_m,
                    "llama_grpc_tok_s": b * GEN_TOKENS / grpc_m,
                    "efficiency": raw_m / grpc_m,
                }
            )
    raw.close()
    data = {
        "benchmark": "concurrency",
        "command": "python bench/concurrency.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt_tokens": PROMPT_TOKENS, "generated_tokens": GEN_TOKENS},
        "settings": vars(args),
        "machine": machine_facts(),
        "rows": rows,
    }
    write_json("concurrency", data)
    plot(rows)
    for r in rows:
        print(
            f"B={r['batch']:>2}  raw {r['raw_tok_s']:7.1f} tok/s  llama-grpc "
            f"{r['llama_grpc_tok_s']:7.1f} tok/s  efficiency {r['efficiency']:.3f}"
        )
    return 0


def plot(rows: list[dict[str, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["raw_tok_s"] for r in rows], "o-", label="raw llama.cpp loop (limit)")
    ax.plot(xs, [r["llama_grpc_tok_s"] for r in rows], "s-", label="llama-grpc (gRPC streams)")
    for r in rows:
        ax.annotate(
            f"{r['efficiency']:.2f}",
            (r["batch"], r["llama_grpc_tok_s"]),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("concurrent sequences B")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Gemma 3 270M Q4_K_M, 41-token prompts, 48 tokens")
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "concurrency.png", dpi=120)
    progress("wrote bench/results/concurrency.png")


if __name__ == "__main__":
    sys.exit(main())
