"""How the scheduler packs prompt-heavy traffic into passes (issue 40), in process, without a
client on the box: `concurrency` closed-loop streams each send requests of PROMPT distinct
random tokens and take ANSWER tokens (ignore_eos), as aiperf's concurrency mode does, on the
embedded model with one llama.cpp thread. Each stream waits 0-50 ms (--jitter-ms) before a
request, as a client over HTTP and a gateway does: the arrivals are not in lockstep. For each
configuration (strategy, --prefill-stall) one engine runs; repetitions alternate the order.

Reported per configuration (median over repetitions, with min/max): process CPU ms per token
(prompt + generated) and per generated token, which background load does not move; forward
passes, prompt and generated tokens per pass; output tok/s; TTFT and ITL p50/p99 (wall).

    python bench/packing.py [--configs decode_maximal@2,decode_maximal@8,prefill_priority@2]
        [--concurrency 4] [--lengths 512/64] [--requests 12] [--reps 2]

A configuration may end in /CHUNK (--chunk-size; 0 by default). Issue 53, four 2,048-token
prompts arriving together, served shortest remaining first (the default) against the 512-token
round robin of before (ttft_mean_passes: passes from a request's arrival to its first token):

    python bench/packing.py --configs decode_maximal/512,decode_maximal --lengths 2048/64 \
        --requests 4 --jitter-ms 0 --reps 2 --name prompt_order
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_facts, machine_facts, percentile, progress, spread, write_json

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make(config: str, threads: int, n_parallel: int, n_ctx: int = 8192) -> EngineLoop:
    """config: strategy[@prefill_stall][/chunk_size] (chunk_size 0, the default: prompts take
    the pass shortest remaining first; 512: the round robin of 512 tokens a prompt before
    issue 53)."""
    config, _, chunk = config.partition("/")
    strategy, _, stall = config.partition("@")
    settings = Settings(
        model=ModelSettings(n_ctx=n_ctx, n_threads=threads),
        scheduler=SchedulerSettings(
            n_parallel=n_parallel,
            batch_strategy=strategy,
            prefill_stall=float(stall or 0.0),
            chunk_size=int(chunk or 0),
            prompt_cache_ram_mb=0,
        ),
    )
    return build_engine(settings)


async def one(  # noqa: PLR0917
    engine: EngineLoop,
    tokens: list[int],
    answer: int,
    ttft: list[float],
    itl: list[float],
    ttft_passes: list[int],
) -> int:
    request = GenerationRequest(
        request_id=f"p{random.getrandbits(64):x}",
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=answer, ignore_eos=True),
        cache_prompt=False,
    )
    start = last = time.perf_counter()
    ticks = engine.stats().ticks  # the passes before it arrived
    generated = 0
    async for event in engine.submit(request):
        if isinstance(event, TokenDelta) and event.token_ids:
            now = time.perf_counter()
            if generated == 0:
                ttft.append((now - start) * 1000)
                ttft_passes.append(engine.stats().ticks - ticks)
            else:
                itl.append((now - last) * 1000 / len(event.token_ids))
            last = now
            generated += len(event.token_ids)
    return generated


async def episode(engine: EngineLoop, args: argparse.Namespace, rep: int) -> dict[str, float]:
    prompt, answer = (int(x) for x in args.lengths.split("/"))
    rng = random.Random(args.seed + rep)
    n_vocab = engine.model_info.n_vocab
    bos = engine.tokenize("", add_special=True, parse_special=False)
    prompts = [bos + [rng.randrange(1000, n_vocab - 1000) for _ in range(prompt - len(bos))]
               for _ in range(args.requests)]  # fmt: skip
    ttft: list[float] = []
    itl: list[float] = []
    ttft_passes: list[int] = []  # passes from a request's arrival to its first token
    todo = iter(prompts)

    async def stream() -> int:
        total = 0
        for p in todo:  # a client's own time between requests (aiperf over HTTP and SMG)
            await asyncio.sleep(rng.uniform(0, args.jitter_ms) / 1000)
            total += await one(engine, p, answer, ttft, itl, ttft_passes)
        return total

    before, c0, t0 = engine.stats(), cpu_s(), time.perf_counter()
    generated = sum(await asyncio.gather(*(stream() for _ in range(args.concurrency))))
    wall, cpu, after = time.perf_counter() - t0, cpu_s() - c0, engine.stats()
    passes = after.ticks - before.ticks
    prompt_done = after.prompt_tokens - before.prompt_tokens
    decode_cpu = after.decode_cpu_seconds - before.decode_cpu_seconds
    return {
        "cpu_ms_per_token": cpu * 1000 / (prompt_done + generated),
        "decode_cpu_ms_per_pass": decode_cpu * 1000 / passes,
        "cpu_ms_per_output_token": cpu * 1000 / generated,
        "passes": passes,
        "prompt_per_pass": prompt_done / passes,
        "decode_per_pass": generated / passes,
        "output_tok_s": generated / wall,
        "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_mean_passes": statistics.fmean(ttft_passes),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5),
        "itl_p99_ms": percentile(itl, 0.99),
        "load_1m": os.getloadavg()[0],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    configs = args.configs.split(",")
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for config in configs if rep % 2 == 0 else configs[::-1]:
            # every stream's prompt and answer in the KV at once (2,048/64 at 4 did not fit
            # 8,192 cells: the last prompt was preempted and waited for the first answer)
            prompt, answer = (int(x) for x in args.lengths.split("/"))
            n_ctx = max(8192, args.concurrency * (prompt + answer + 64))
            engine = make(config, args.threads, args.concurrency, n_ctx)
            try:
                result = await episode(engine, args, rep)
            finally:
                engine.close()
            runs[config].append(result)
            progress(f"rep {rep} {config}: " + " ".join(f"{k} {v:.2f}" for k, v in result.items()))
    rows = []
    for config, results in runs.items():
        row: dict[str, Any] = {"config": config}
        for key in results[0]:
            values = [r[key] for r in results]
            row[key] = statistics.median(values)
            row[f"{key}_range"] = spread(values)
        rows.append(row)
    return {"rows": rows, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="decode_maximal,decode_maximal@2,decode_maximal@8,prefill_priority",
        help="strategy[@prefill_stall][/chunk_size],... (0 where not given: the defaults)",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lengths", default="512/64")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jitter-ms", type=float, default=50.0,
                        help="a stream waits 0..this before each request")  # fmt: skip
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--name", default="packing")
    args = parser.parse_args()
    data: dict[str, Any] = {
        "benchmark": "packing",
        "command": "python bench/packing.py " + " ".join(sys.argv[1:]),
        "machine": machine_facts(args.threads),
    }
    data.update(asyncio.run(main_async(args)))
    path = write_json(args.name, finish_facts(data))
    for row in data["rows"]:
        print(
            f"{row['config']:24} cpu/tok {row['cpu_ms_per_token']:.2f} "
            f"cpu/out {row['cpu_ms_per_output_token']:.1f} passes {row['passes']:.0f} "
            f"pp {row['prompt_per_pass']:.1f} dp {row['decode_per_pass']:.2f} "
            f"tok/s {row['output_tok_s']:.2f} ttft mean {row['ttft_mean_ms']:.0f} ms "
            f"{row['ttft_mean_passes']:.2f} passes "
            f"p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} "
            f"itl50 {row['itl_p50_ms']:.0f} itl99 {row['itl_p99_ms']:.0f}"
        )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
