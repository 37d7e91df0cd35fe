"""Embeddings in the shared scheduler (issue 41), in one run on the embedded Gemma 3 270M:

1. pass costs: llama_decode of a 4-row decode tick, of an N-token embedding pass (every token
   an output: llama.cpp computes the logits of all of them too) and of an N-token prefill (one
   logits row), N = 16, 64, 128;
2. throughput: inputs/s and per-input latency p50/p95 for batches of 1, 16 and 64 short inputs
   (~12 tokens) and of 1 and 16 ~512-token inputs, through the engine (EngineLoop, as an Embed call
   submits them);
3. starvation: the inter-token latency (p50/p95) of a generating stream alone and beside a
   flood of embedding requests (16 in flight at all times): its decode rows ride in the
   embedding passes, whose embedding tokens add about half a decode tick.

    python bench/embeddings.py [--threads 1] [--flood-inputs 16] [--reps 3] [--itl-only]

4. a peer in the same run: llama-cpp-python's own `Llama(embedding=True).embed` (the same
   llama.cpp, in-process, no server), which packs up to n_batch tokens of as many inputs as
   fit into one llama_decode (n_seq_max up to 256), on the same inputs and threads.

Not yet: llama-server --embedding (bench/setup_peers.sh builds it, ~20 min on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_facts, machine_facts, percentile, progress, seeded_text, write_json

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.embedding import EmbeddingParams
from llama_grpc_server.core.plan import Chunk
from llama_grpc_server.core.request import (
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.loop import EngineLoop
from llama_grpc_server.models.files import default_model_path

PASS_TOKENS = (16, 64, 128)
BATCHES = (1, 16, 64)
LONG_BATCHES = (1, 16)  # 64 x 512 tokens: minutes on the 2-core box
STREAM_TOKENS = 96


def pass_costs(threads: int, samples: int) -> dict[str, Any]:
    """Median llama_decode ms of a decode tick and of embedding / prefill passes."""
    path = str(default_model_path())
    model = LlamaModel(
        ModelSettings(model_path=path, n_ctx=4096, n_threads=threads), path, n_seq_max=5
    )
    batch = Batch(model.n_batch)

    def timed(chunks: list[Chunk], *, embed: bool) -> float:
        times = []
        for _ in range(samples):
            for c in chunks:
                model.seq_remove(c.slot_id, c.start_pos, -1)
            batch.fill(chunks, every_output=embed)
            llama_cpp.llama_set_embeddings(model.ctx, embed)
            t0 = time.perf_counter()
            status = llama_cpp.llama_decode(model.ctx, batch.struct)
            times.append((time.perf_counter() - t0) * 1000)
            llama_cpp.llama_set_embeddings(model.ctx, False)
            assert status == 0, status
        return statistics.median(times)

    prompts = [Chunk(s, f"p{s}", 0, tuple(range(300, 364)), True) for s in range(4)]
    batch.fill(prompts)
    llama_cpp.llama_decode(model.ctx, batch.struct)
    decode = [Chunk(s, f"p{s}", 64, (500,), True) for s in range(4)]
    out: dict[str, Any] = {"decode_tick_4_rows_ms": timed(decode, embed=False), "passes": {}}
    for n in PASS_TOKENS:
        chunk = [Chunk(4, "e", 0, tuple(range(1000, 1000 + n)), True)]
        embed_ms, prefill_ms = timed(chunk, embed=True), timed(chunk, embed=False)
        out["passes"][n] = {
            "embedding_pass_ms": embed_ms,
            "prefill_pass_ms": prefill_ms,
            "embedding_over_prefill": embed_ms / prefill_ms,
            "embedding_over_decode_tick": embed_ms / out["decode_tick_4_rows_ms"],
        }
        progress(f"pass {n} tokens: embed {embed_ms:.1f} ms, prefill {prefill_ms:.1f} ms")
    model.close()
    return out


async def embed_one(engine: EngineLoop, tokens: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    async for event in engine.submit(
        GenerationRequest(rid, tuple(tokens), embedding=EmbeddingParams())
    ):
        if not isinstance(event, Finished):
            raise RuntimeError(f"embedding {rid} ended with {event}")
    return time.perf_counter() - t0


async def throughput(engine: EngineLoop, words: int, batch: int, seed: int) -> dict[str, Any]:
    texts = [seeded_text(words, seed + i) for i in range(batch)]
    inputs = [engine.tokenize(t, add_special=True, parse_special=False) for t in texts]
    t0 = time.perf_counter()
    latencies = await asyncio.gather(
        *(embed_one(engine, ids, f"b{seed}-{i}") for i, ids in enumerate(inputs))
    )
    wall = time.perf_counter() - t0
    return {
        "inputs": batch,
        "mean_tokens": statistics.mean(len(i) for i in inputs),
        "inputs_per_s": batch / wall,
        "latency_p50_ms": percentile(latencies, 0.5) * 1000,
        "latency_p95_ms": percentile(latencies, 0.95) * 1000,
    }


async def stream_itl(engine: EngineLoop, rid: str) -> list[float]:
    prompt = engine.tokenize(seeded_text(40, 7), add_special=True, parse_special=False)
    spec = GenerationRequest(
        rid,
        tuple(prompt),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=STREAM_TOKENS, ignore_eos=True),
    )
    arrivals: list[float] = []
    async for event in engine.submit(spec):
        if isinstance(event, TokenDelta) and event.token_ids:
            arrivals.append(time.perf_counter())
    # the gaps after the second token (the first gap still holds the prompt's prefill)
    return [(b - a) * 1000 for a, b in itertools.pairwise(arrivals[1:])]


async def beside_flood(engine: EngineLoop, in_flight: int) -> tuple[list[float], int]:
    stop = asyncio.Event()
    done = 0
    inputs = [
        engine.tokenize(seeded_text(30, 100 + i), add_special=True, parse_special=False)
        for i in range(in_flight)
    ]

    async def flooder(i: int) -> None:
        nonlocal done
        n = 0
        while not stop.is_set():
            await embed_one(engine, inputs[i], f"flood-{i}-{n}")
            n += 1
            done += 1

    tasks = [asyncio.ensure_future(flooder(i)) for i in range(in_flight)]
    await asyncio.sleep(1.0)  # the flood is on before the stream starts
    gaps = await stream_itl(engine, "beside")
    stop.set()
    await asyncio.gather(*tasks)
    return gaps, done


def itl(gaps: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(gaps, 0.5), "p95_ms": percentile(gaps, 0.95), "n": len(gaps)}


async def itl_reps(engine: EngineLoop, flood_inputs: int, reps: int) -> dict[str, Any]:
    """Alone and beside the flood, alternating, `reps` times (other work on a shared box moves
    the tail between any two runs): each rep's p50/p95 and ratios, and their medians."""
    rows = []
    for rep in range(reps):
        alone = await stream_itl(engine, f"alone-{rep}")
        beside, flood_done = await beside_flood(engine, flood_inputs)
        rows.append(
            {
                "alone": itl(alone),
                "beside_flood": itl(beside),
                "flood_inputs_embedded_meanwhile": flood_done,
                "p95_ratio": percentile(beside, 0.95) / percentile(alone, 0.95),
                "p50_ratio": percentile(beside, 0.5) / percentile(alone, 0.5),
            }
        )
        progress(
            f"rep {rep}: ITL p95 ratio {rows[-1]['p95_ratio']:.2f}, "
            f"p50 ratio {rows[-1]['p50_ratio']:.2f}"
        )
    return {
        "flood_inputs_in_flight": flood_inputs,
        "reps": rows,
        "median_p95_ratio": statistics.median(r["p95_ratio"] for r in rows),
        "median_p50_ratio": statistics.median(r["p50_ratio"] for r in rows),
    }


async def engine_runs(
    threads: int, flood_inputs: int, reps: int, *, itl_only: bool = False
) -> dict[str, Any]:
    settings = Settings(
        model=ModelSettings(n_ctx=8192, n_batch=512, n_threads=threads),
        scheduler=SchedulerSettings(n_parallel=4, max_queue=256),
    )
    engine = build_engine(settings)
    try:
        out: dict[str, Any] = {"throughput": {}}
        warm = engine.tokenize(seeded_text(8, 1), add_special=True, parse_special=False)
        await embed_one(engine, warm, "warm-up")  # the first embedding pass allocates buffers
        for words, label, batches in ((8, "short", BATCHES), (380, "512_tokens", LONG_BATCHES)):
            for batch in () if itl_only else batches:
                row = await throughput(engine, words, batch, seed=batch * 1000 + words)
                out["throughput"][f"{label}_batch_{batch}"] = row
                progress(f"{label} x{batch}: {row['inputs_per_s']:.1f} inputs/s")
        out["itl"] = await itl_reps(engine, flood_inputs, reps)
        out["stats"] = {
            "ticks": engine.stats().ticks,
            "avg_batch_size": engine.stats().avg_batch_size,
        }
        return out
    finally:
        engine.close()


def peer_throughput(threads: int) -> dict[str, Any]:
    """llama-cpp-python's Llama.embed on the same batches: inputs/s (one call per batch)."""
    model = llama_cpp.Llama(
        str(default_model_path()),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=8192,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    out: dict[str, Any] = {}
    try:
        model.embed("warm-up")
        for words, label, batches in ((8, "short", BATCHES), (380, "512_tokens", LONG_BATCHES)):
            for batch in batches:
                seed = batch * 1000 + words
                texts = [seeded_text(words, seed + i) for i in range(batch)]
                t0 = time.perf_counter()
                model.embed(texts, normalize=True)
                wall = time.perf_counter() - t0
                out[f"{label}_batch_{batch}"] = {"inputs": batch, "inputs_per_s": batch / wall}
                progress(f"peer Llama.embed {label} x{batch}: {batch / wall:.1f} inputs/s")
    finally:
        model.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--flood-inputs", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3, help="alternating ITL reps")
    parser.add_argument("--itl-only", action="store_true", help="only the ITL reps")
    args = parser.parse_args()
    data: dict[str, Any] = {"machine": machine_facts(args.threads)}
    if not args.itl_only:
        data["pass_costs"] = pass_costs(args.threads, args.samples)
        data["peer_llama_cpp_python_embed"] = peer_throughput(args.threads)
    runs = engine_runs(args.threads, args.flood_inputs, args.reps, itl_only=args.itl_only)
    data.update(asyncio.run(runs))
    write_json("embeddings_itl" if args.itl_only else "embeddings", finish_facts(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
