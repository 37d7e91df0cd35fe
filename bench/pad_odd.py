"""Padding decode ticks: B concurrent greedy streams on two llama-grpc servers, one with
--pad-odd-ticks (the default) and one with --no-pad-odd-ticks, alternating rep by rep. Some
row counts cost more than a larger one (bench/decode_cost.py --rows 32): with the x86-64-v3
build every odd count >= 3 (3 rows 42.8 ms, 4 rows 34.6), with the AVX-512 build the counts
that are not a multiple of 4 (6 rows 54.4 ms, 8 rows 47.5). So the padded server should be
faster where its build's curve has such a step and the same elsewhere (the noise floor).
Measured per run: aggregate tok/s, forward passes and server CPU ms per token; medians of the
paired per-rep ratios, and the load average.

    python bench/pad_odd.py [--reps 5] [--batches 3,5,6,7,11] [--gen-tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

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

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

MODES = {"padded": "--pad-odd-ticks", "plain": "--no-pad-odd-ticks"}
PROMPTS = (
    "Write a short story about a fox who learns to swim.",
    "Describe a busy railway station in the early morning.",
    "Explain how a bicycle gear system works.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe the life of a lighthouse keeper in winter.",
    "Write a recipe for bread, step by step.",
    "Tell the history of a small fishing village.",
)


async def run(meter: Meter, batch: int, gen: int) -> dict[str, float]:
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    return await concurrent(meter, texts, greedy_params(gen))


async def measure(targets: dict[str, tuple[str, int]], args: argparse.Namespace) -> list[dict]:
    batches = [int(b) for b in args.batches.split(",") if b]
    got: dict[int, dict[str, list[dict[str, float]]]] = {
        b: {mode: [] for mode in MODES} for b in batches
    }
    async with contextlib.AsyncExitStack() as stack:
        meters = {}
        for mode, (target, pid) in targets.items():
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
            meters[mode] = Meter(pb_grpc.LlmServiceStub(channel), pid)
            await run(meters[mode], 3, 8)  # warm-up
        for rep in range(args.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for b in batches:
                for mode in order:
                    got[b][mode].append(await run(meters[mode], b, args.gen_tokens))
                progress(
                    f"rep {rep + 1}/{args.reps} B={b}: padded "
                    f"{got[b]['padded'][-1]['tok_s']:.1f} plain {got[b]['plain'][-1]['tok_s']:.1f}"
                )
    rows = []
    for b in batches:
        pad, plain = got[b]["padded"], got[b]["plain"]
        ratios = [p["tok_s"] / q["tok_s"] for p, q in zip(pad, plain, strict=True)]
        cpu = [
            q["cpu_ms_per_token"] / p["cpu_ms_per_token"] for p, q in zip(pad, plain, strict=True)
        ]
        rows.append(
            {
                "batch": b,
                **{
                    f"{mode}_{key}": spread([r[key] for r in got[b][mode]])
                    for mode in MODES
                    for key in ("tok_s", "passes_per_token", "cpu_ms_per_token")
                },
                "speedup": statistics.median(ratios),
                "speedup_per_rep": ratios,
                "cpu_saving": statistics.median(cpu),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", default="3,5,6,7,11")
    parser.add_argument("--gen-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    n_par = str(max(int(b) for b in args.batches.split(",") if b))
    with contextlib.ExitStack() as stack:
        targets = {}
        for mode, flag in MODES.items():
            progress(f"starting llama-grpc {flag}")
            target, proc = stack.enter_context(
                llama_grpc_process(*server_args(args.threads, "--n-parallel", n_par, flag))
            )
            targets[mode] = (target, proc.pid)
        rows = asyncio.run(measure(targets, args))
    data = {
        "benchmark": "pad_odd",
        "command": "python bench/pad_odd.py " + " ".join(sys.argv[1:]),
        "workload": {"prompts": PROMPTS, "generated_tokens": args.gen_tokens, "greedy": True},
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json("pad_odd", finish_facts(data))
    for r in rows:
        print(
            f"B={r['batch']}: padded {r['padded_tok_s']['median']:.1f} plain "
            f"{r['plain_tok_s']['median']:.1f} tok/s, x{r['speedup']:.3f} (per rep "
            f"{', '.join(f'{x:.2f}' for x in r['speedup_per_rep'])}); CPU ms/token "
            f"{r['padded_cpu_ms_per_token']['median']:.1f} / "
            f"{r['plain_cpu_ms_per_token']['median']:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
