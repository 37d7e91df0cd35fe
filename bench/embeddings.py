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
        [--stream-shares 0.5,0.3]   # the ITL under several budgets, alternating

   Each run beside the flood logs the engine's passes (its on_tick hook): the embedding tokens
   riding in each pass with decode rows, those passes' and the decode-only passes' times.

4. peers in the same run: llama-cpp-python's own `Llama(embedding=True).embed` (the same
   llama.cpp, in-process, no server), which packs up to n_batch tokens of as many inputs as
   fit into one llama_decode (n_seq_max up to 256), on the same inputs and threads; and
   llama.cpp's llama-server `--embedding --pooling mean` ($LLAMA_SERVER_BINARY, as
   bench/peers.py finds it: built from the pinned sdist's llama.cpp), the same GGUF, threads,
   slots (4), n_ctx and batch, each input its own concurrent `/v1/embeddings` request of token
   ids (as each of an Embed call's inputs is its own engine request), the same inputs. The
   throughput reps alternate: each batch goes to the engine, then to llama-server, --reps
   times; the rows hold each rep and the medians. A vector from each is compared (cosine).

    python bench/embeddings.py --no-itl --long-batches 1 --reps 3   # throughput vs peers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    finish_facts,
    free_port,
    machine_facts,
    percentile,
    progress,
    seeded_text,
    spread,
    write_json,
)
from peers import llama_server_binary, peer_process

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.requests import embedding
from llama_grpc_server.core.requests.embedding import EmbeddingParams
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenDelta,
)
from llama_grpc_server.core.scheduling.plan import Chunk, StepPlan, StepResult
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.models.files import default_model_path

N_CTX, N_PARALLEL = 8192, 4
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


EmbedOne = Callable[[list[int], str], Awaitable[float]]  # (ids, request id) -> seconds


async def throughput(embed: EmbedOne, inputs: Sequence[list[int]], tag: str) -> dict[str, Any]:
    """Every input submitted at once, each its own request: inputs/s and latency p50/p95."""
    t0 = time.perf_counter()
    latencies = await asyncio.gather(*(embed(ids, f"{tag}-{i}") for i, ids in enumerate(inputs)))
    wall = time.perf_counter() - t0
    return {
        "inputs": len(inputs),
        "mean_tokens": statistics.mean(len(i) for i in inputs),
        "inputs_per_s": len(inputs) / wall,
        "latency_p50_ms": percentile(latencies, 0.5) * 1000,
        "latency_p95_ms": percentile(latencies, 0.95) * 1000,
    }


class LlamaServerEmbeddings:
    """llama-server's /v1/embeddings, one input (token ids) per request, from a thread pool wide
    enough that every input of a batch is in flight at once."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/embeddings"
        self.pool = ThreadPoolExecutor(max_workers=64)

    def vector(self, ids: list[int]) -> list[float]:
        body = json.dumps({"input": [ids], "encoding_format": "float"}).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=900) as reply:
            data = json.loads(reply.read())["data"]
        if len(data) != 1:
            raise RuntimeError(f"llama-server answered {len(data)} embeddings for one input")
        return [float(v) for v in data[0]["embedding"]]

    async def embed_one(self, ids: list[int], rid: str) -> float:
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self.pool, self.vector, ids)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


@contextlib.contextmanager
def llama_server_embeddings(binary: str, threads: int) -> Iterator[LlamaServerEmbeddings]:
    """llama-server --embedding on the embedded model: the engine's slots, n_ctx and batch."""
    port = free_port()
    cmd = [binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--embedding", "--pooling", "mean", "-c", str(N_CTX), "-np", str(N_PARALLEL)]
    cmd += ["-kvu", "--swa-full", "--no-webui", "--cache-ram", "0", "--fit", "off"]
    cmd += ["-t", str(threads), "-tb", str(threads), "-b", "512", "-ub", "512", "--log-disable"]
    with peer_process(cmd, port, "/health"):
        peer = LlamaServerEmbeddings(port)
        try:
            yield peer
        finally:
            peer.close()


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5


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


class PassLog:
    """The engine's forward passes (its on_tick hook, on the engine thread): for each embedding
    pass with decode rows riding in it, its embedding tokens and milliseconds; for each
    decode-only pass, its milliseconds."""

    def __init__(self) -> None:
        self.mixed: list[tuple[int, float]] = []
        self.decode_ms: list[float] = []

    def on_tick(self, plan: StepPlan, result: StepResult, _scheduler: Any) -> None:
        rows = sum(1 for c in plan.chunks if c.embedding is None and c.is_decode)
        tokens = sum(len(c.tokens) for c in plan.chunks if c.embedding is not None)
        if plan.is_embedding and rows and tokens:
            self.mixed.append((tokens, result.eval_ms))
        elif not plan.is_embedding and plan.chunks and all(c.is_decode for c in plan.chunks):
            self.decode_ms.append(result.eval_ms)

    def summary(self) -> dict[str, Any]:
        tokens = [float(n) for n, _ in self.mixed]
        return {
            "mixed_passes": len(self.mixed),
            "embedding_tokens_per_mixed_pass": spread(tokens) if tokens else {},
            "mixed_pass_ms": spread([ms for _, ms in self.mixed]) if tokens else {},
            "decode_only_pass_ms": spread(self.decode_ms) if self.decode_ms else {},
        }

    def clear(self) -> None:
        self.mixed, self.decode_ms = [], []


async def itl_reps(
    engine: EngineLoop,
    flood_inputs: int,
    reps: int,
    log: PassLog,
    shares: Sequence[float] = (embedding.STREAM_SHARE,),
) -> dict[str, Any]:
    """Alone and beside the flood, alternating, `reps` times (other work on a shared box moves
    the tail between any two runs): each rep's p50/p95 and ratios, and their medians. With
    several `shares` (core.requests.embedding.STREAM_SHARE: the part of a decode tick the embedding
    tokens riding with decode rows may add), each rep runs beside the flood once per share, in
    a rotating order, against the same alone run; each run logs its passes (PassLog)."""
    rows: dict[float, list[dict[str, Any]]] = {share: [] for share in shares}
    for rep in range(reps):
        alone = await stream_itl(engine, f"alone-{rep}")
        order = list(shares[rep % len(shares) :]) + list(shares[: rep % len(shares)])
        for share in order:
            embedding.STREAM_SHARE = share  # read by PassCosts.budget at each pass
            log.clear()
            beside, flood_done = await beside_flood(engine, flood_inputs)
            rows[share].append(
                {
                    "alone": itl(alone),
                    "beside_flood": itl(beside),
                    "flood_inputs_embedded_meanwhile": flood_done,
                    "p95_ratio": percentile(beside, 0.95) / percentile(alone, 0.95),
                    "p50_ratio": percentile(beside, 0.5) / percentile(alone, 0.5),
                    "passes": log.summary(),
                }
            )
            got = rows[share][-1]
            progress(
                f"rep {rep} share {share}: ITL p95 ratio {got['p95_ratio']:.2f}, p50 ratio "
                f"{got['p50_ratio']:.2f}, {flood_done} embedded"
            )
    embedding.STREAM_SHARE = shares[0]
    out: dict[str, Any] = {"flood_inputs_in_flight": flood_inputs}
    for share, got in rows.items():
        key = "by_share" if len(shares) > 1 else ""
        row = {
            "reps": got,
            "median_p95_ratio": statistics.median(r["p95_ratio"] for r in got),
            "median_p50_ratio": statistics.median(r["p50_ratio"] for r in got),
            "median_flood_inputs_embedded": statistics.median(
                r["flood_inputs_embedded_meanwhile"] for r in got
            ),
        }
        if key:
            out.setdefault(key, {})[str(share)] = row
        else:
            out.update(row)
    return out


def workloads(long_batches: Sequence[int]) -> list[tuple[str, int, int]]:
    """(row name, words per input, inputs)."""
    rows = [(f"short_batch_{b}", 8, b) for b in BATCHES]
    return rows + [(f"512_tokens_batch_{b}", 380, b) for b in long_batches]


async def compare_throughput(
    engine: EngineLoop, peer: LlamaServerEmbeddings | None, reps: int, long_batches: Sequence[int]
) -> dict[str, Any]:
    """Each workload on the engine, then on llama-server, `reps` times in turn: every rep's row
    and, per system, the median and spread of inputs/s and latency."""

    async def ours(ids: list[int], rid: str) -> float:
        return await embed_one(engine, ids, rid)

    systems: dict[str, EmbedOne] = {"llama_grpc_engine": ours}
    if peer is not None:
        systems["llama_server"] = peer.embed_one
    out: dict[str, Any] = {}
    for name, words, batch in workloads(long_batches):
        seed = batch * 1000 + words
        texts = [seeded_text(words, seed + i) for i in range(batch)]
        inputs = [engine.tokenize(t, add_special=True, parse_special=False) for t in texts]
        rows: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        for rep in range(reps):
            for system, embed in systems.items():
                row = await throughput(embed, inputs, f"{name}-{rep}-{system}")
                rows[system].append(row)
                progress(f"{name} rep {rep} {system}: {row['inputs_per_s']:.2f} inputs/s")
        out[name] = {
            system: {
                "reps": got,
                "inputs_per_s": spread([r["inputs_per_s"] for r in got]),
                "latency_p50_ms": spread([r["latency_p50_ms"] for r in got]),
                "latency_p95_ms": spread([r["latency_p95_ms"] for r in got]),
            }
            for system, got in rows.items()
        }
        if peer is not None:
            ratio = [
                a["inputs_per_s"] / b["inputs_per_s"]
                for a, b in zip(rows["llama_grpc_engine"], rows["llama_server"], strict=True)
            ]
            out[name]["engine_over_llama_server_inputs_per_s"] = spread(ratio)
    return out


async def same_vector(engine: EngineLoop, peer: LlamaServerEmbeddings) -> float:
    """The cosine between the engine's and llama-server's vector of one input."""
    ids = engine.tokenize(seeded_text(20, 5), add_special=True, parse_special=False)
    done = None
    async for event in engine.submit(
        GenerationRequest("same-vector", tuple(ids), embedding=EmbeddingParams())
    ):
        done = event
    if not isinstance(done, Finished) or done.embedding is None:
        raise RuntimeError(f"the engine's embedding ended with {done}")
    theirs = await asyncio.get_running_loop().run_in_executor(peer.pool, peer.vector, ids)
    return cosine(done.embedding.rows()[0], theirs)


async def engine_runs(
    threads: int,
    flood_inputs: int,
    reps: int,
    *,
    itl_only: bool = False,
    itl: bool = True,
    throughput_reps: int = 3,
    long_batches: Sequence[int] = LONG_BATCHES,
    shares: Sequence[float] = (embedding.STREAM_SHARE,),
) -> dict[str, Any]:
    settings = Settings(
        model=ModelSettings(n_ctx=N_CTX, n_batch=512, n_threads=threads),
        scheduler=SchedulerSettings(n_parallel=N_PARALLEL, max_queue=256),
    )
    binary = None if itl_only else llama_server_binary()
    log = PassLog()
    engine = build_engine(settings, on_tick=log.on_tick)
    try:
        out: dict[str, Any] = {"throughput": {}}
        warm = engine.tokenize(seeded_text(8, 1), add_special=True, parse_special=False)
        await embed_one(engine, warm, "warm-up")  # the first embedding pass allocates buffers
        if not itl_only:
            with contextlib.ExitStack() as stack:
                peer = None
                if binary is None:
                    out["llama_server"] = "skipped: no binary ($LLAMA_SERVER_BINARY)"
                else:
                    peer = stack.enter_context(llama_server_embeddings(binary, threads))
                    await peer.embed_one(warm, "warm-up")
                    out["llama_server"] = {
                        "binary": binary,
                        "cosine_with_engine": await same_vector(engine, peer),
                    }
                    progress(f"llama-server vs engine cosine {out['llama_server']}")
                out["throughput"] = await compare_throughput(
                    engine, peer, throughput_reps, long_batches
                )
        if itl:
            out["itl"] = await itl_reps(engine, flood_inputs, reps, log, shares)
        out["stats"] = {
            "ticks": engine.stats().ticks,
            "avg_batch_size": engine.stats().avg_batch_size,
        }
        return out
    finally:
        engine.close()


def peer_throughput(threads: int, long_batches: Sequence[int]) -> dict[str, Any]:
    """llama-cpp-python's Llama.embed on the same batches: inputs/s (one call per batch)."""
    model = llama_cpp.Llama(
        str(default_model_path()),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=N_CTX,
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
        for name, words, batch in workloads(long_batches):
            seed = batch * 1000 + words
            texts = [seeded_text(words, seed + i) for i in range(batch)]
            t0 = time.perf_counter()
            model.embed(texts, normalize=True)
            wall = time.perf_counter() - t0
            out[name] = {"inputs": batch, "inputs_per_s": batch / wall}
            progress(f"peer Llama.embed {name}: {batch / wall:.1f} inputs/s")
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
    parser.add_argument("--no-itl", action="store_true", help="no ITL reps")
    parser.add_argument("--throughput-reps", type=int, default=3, help="alternating reps")
    parser.add_argument(
        "--long-batches", default=",".join(map(str, LONG_BATCHES)), help="e.g. 1,16 or 1"
    )
    parser.add_argument("--out", default="", help="results file name (default: by mode)")
    parser.add_argument(
        "--stream-shares",
        default=str(embedding.STREAM_SHARE),
        help="ITL beside the flood under each core.requests.embedding.STREAM_SHARE, e.g. 0.5,0.3",
    )
    args = parser.parse_args()
    long_batches = [int(b) for b in args.long_batches.split(",") if b]
    data: dict[str, Any] = {"machine": machine_facts(args.threads)}
    if not args.itl_only:
        data["pass_costs"] = pass_costs(args.threads, args.samples)
        data["peer_llama_cpp_python_embed"] = peer_throughput(args.threads, long_batches)
    runs = engine_runs(
        args.threads,
        args.flood_inputs,
        args.reps,
        itl_only=args.itl_only,
        itl=not args.no_itl,
        throughput_reps=args.throughput_reps,
        long_batches=long_batches,
        shares=[float(v) for v in args.stream_shares.split(",")],
    )
    data.update(asyncio.run(runs))
    name = args.out or ("embeddings_itl" if args.itl_only else "embeddings")
    write_json(name, finish_facts(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
