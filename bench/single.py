"""Single request: time to first token and decode tokens/s for prompts of 32, 512 and 2,048
tokens, one request at a time through GenerateTokens (greedy, ignore_eos, cache_prompt=false so
every repetition prefills the whole prompt). Lengths are interleaved within each repetition.

    make bench-single                 # or: python bench/single.py --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    llama_grpc_server,
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

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc


async def measure(target: str, lengths: list[int], reps: int, gen: int) -> dict[int, list[Any]]:
    from common import greedy_params

    params = greedy_params(gen, cache_prompt=False)
    out: dict[int, list[Any]] = {n: [] for n in lengths}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        prompts = {
            n: [await prompt_of(stub, n, seed=1000 * n + r) for r in range(reps)] for n in lengths
        }
        for n in lengths:  # warm-up: one of each length
            await stream_tokens(stub, await prompt_of(stub, n, seed=7), params=params)
        progress("warm-up done")
        for r in range(reps):
            order = lengths[r % len(lengths) :] + lengths[: r % len(lengths)]
            for n in order:
                rec = await stream_tokens(stub, prompts[n][r], params=params)
                if rec.n_tokens != gen:
                    raise RuntimeError(f"expected {gen} tokens, got {rec.n_tokens}")
                out[n].append(rec)
                progress(
                    f"rep {r + 1}/{reps} prompt {n:>4}: TTFT {1000 * rec.ttft_s:7.1f} ms, "
                    f"decode {rec.decode_tok_s:6.1f} tok/s"
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,512,2048")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    data: dict[str, Any] = {
        "benchmark": "single",
        "command": "python bench/single.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "machine": machine_facts(args.threads),
    }
    progress("starting llama-grpc")
    with llama_grpc_server(*server_args(args.threads)) as target:
        records = asyncio.run(measure(target, lengths, args.reps, args.gen_tokens))
    rows = []
    for n in lengths:
        recs = records[n]
        ttft = [r.ttft_s * 1000 for r in recs]
        tps = [r.decode_tok_s for r in recs]
        rows.append(
            {
                "prompt_tokens": n,
                "generated_tokens": args.gen_tokens,
                "ttft_ms": spread(ttft),
                "server_ttft_ms": spread([r.server_ttft_ms for r in recs]),
                "decode_tok_s": spread(tps),
                "prefill_tok_s": n / (statistics.median(ttft) / 1000),
                "end_to_end_tok_s": spread([r.n_tokens / (r.t_done - r.t_send) for r in recs]),
            }
        )
    data["rows"] = rows
    write_json("single", finish_facts(data))
    plot(rows)
    for r in rows:
        print(
            f"prompt {r['prompt_tokens']:>5}: TTFT {r['ttft_ms']['median']:8.1f} ms "
            f"(min {r['ttft_ms']['min']:.1f}, max {r['ttft_ms']['max']:.1f}), prefill "
            f"{r['prefill_tok_s']:7.1f} tok/s, decode {r['decode_tok_s']['median']:6.1f} tok/s"
        )
    return 0


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = [str(r["prompt_tokens"]) for r in rows]
    for ax, key, title in (
        (ax1, "ttft_ms", "time to first token (ms)"),
        (ax2, "decode_tok_s", "decode tokens/s (one stream)"),
    ):
        med = [r[key]["median"] for r in rows]
        err = [
            [m - r[key]["min"] for m, r in zip(med, rows, strict=True)],
            [r[key]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.bar(labels, med, yerr=err, capsize=4, color="#4c72b0")
        for i, m in enumerate(med):
            ax.annotate(f"{m:.0f}", (i, m), textcoords="offset points", xytext=(0, 4), ha="center")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("llama-grpc, one request, Gemma 3 270M Q4_K_M (median, min-max)")
    save_figure(fig, "single")


if __name__ == "__main__":
    sys.exit(main())
