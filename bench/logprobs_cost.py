"""Logprobs cost: decode tokens/s of the same greedy workload without logprobs, with logprobs
(sampled token only) and with top_logprobs=20, through StreamGenerate on a real server; plus the
in-process cost of one LogprobComputer call on a 262,144-wide row (no model). One run; modes are
interleaved so drift hits them alike. Never asserts timings.

    python bench/logprobs_cost.py            # writes bench/results/logprobs_cost.json
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
    progress,
    prompt_of,
    server_args,
    spread,
    stream_tokens,
    write_json,
)

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

MODES: dict[str, dict[str, Any]] = {
    "off": {},
    "logprobs": {"logprobs": True},
    "top_logprobs_20": {"logprobs": True, "top_logprobs": 20},
}


def params_for(mode: str, gen: int) -> Any:
    params = greedy_params(gen, cache_prompt=False)
    for name, value in MODES[mode].items():
        setattr(params.output, name, value)
    return params


async def one_round(stub: Any, prompts: list[list[int]], mode: str, gen: int) -> dict[str, float]:
    """All prompts at once (a batch of len(prompts) streams); tokens/s over the decode phase."""
    t0 = time.perf_counter()
    records = await asyncio.gather(
        *(stream_tokens(stub, p, params=params_for(mode, gen)) for p in prompts)
    )
    for rec in records:
        if rec.n_tokens != gen:
            raise RuntimeError(f"{mode}: expected {gen} tokens, got {rec.n_tokens}")
    first = min(rec.times[0] for rec in records)
    last = max(rec.t_done for rec in records)
    decoded = sum(rec.n_tokens - 1 for rec in records)
    return {"decode_tok_s": decoded / (last - first), "wall_s": last - t0}


async def measure(target: str, batch: int, reps: int, gen: int, n_prompt: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        prompts = [await prompt_of(stub, n_prompt, seed=100 + i) for i in range(batch)]
        await one_round(stub, prompts, "top_logprobs_20", 8)  # warm-up
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(reps):
            modes = list(MODES)[r % len(MODES) :] + list(MODES)[: r % len(MODES)]
            for mode in modes:
                result = await one_round(stub, prompts, mode, gen)
                rate = result["decode_tok_s"]
                rates[mode].append(rate)
                progress(f"batch {batch} rep {r + 1}/{reps} {mode:>16}: {rate:.1f} tok/s")
        for mode, values in rates.items():
            out[mode] = spread(values)
        base = statistics.median(rates["off"])
        out["slowdown_vs_off"] = {
            mode: 1.0 - statistics.median(values) / base for mode, values in rates.items()
        }
    return out


def in_process_cost(n_vocab: int = 262_144, calls: int = 200) -> dict[str, Any]:
    """Milliseconds per LogprobComputer call on a random row (k = 0 and k = 20)."""
    import numpy as np

    from llama_grpc_server.engine.logprobs import LogprobComputer

    rng = np.random.default_rng(0)
    row = (rng.standard_normal(n_vocab) * 3).astype(np.float32)
    computer = LogprobComputer(n_vocab)
    out: dict[str, Any] = {}
    for k in (0, 20):
        times = []
        for i in range(calls):
            t = time.perf_counter_ns()
            computer.from_row(row, i % n_vocab, k)
            times.append((time.perf_counter_ns() - t) / 1e6)
        out[f"k{k}_ms"] = spread(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gen", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    data: dict[str, Any] = {
        "benchmark": "logprobs_cost",
        "machine": machine_facts(),
        "config": vars(args),
        "in_process": in_process_cost(),
        "by_batch": {},
    }
    progress(f"in-process: {data['in_process']['k20_ms']['median']:.3f} ms per top-20 call")
    n_parallel = str(max(args.batches))
    with llama_grpc_server(*server_args(args.threads, "--n-parallel", n_parallel)) as target:
        for batch in args.batches:
            data["by_batch"][str(batch)] = asyncio.run(
                measure(target, batch, args.reps, args.gen, args.prompt)
            )
    write_json("logprobs_cost", finish_facts(data))


if __name__ == "__main__":
    main()
