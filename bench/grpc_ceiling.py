"""The ceiling of any grpc.aio server on this box: the concurrency workload (B streams of
41-token prompts, 64 greedy tokens) three ways, alternating in every repetition:

- raw: the in-process llama.cpp loop (the hardware limit; no gRPC);
- bare: the same raw loop inside a bare grpc.aio server (its own process), each step's tokens
  streamed at once, one GenerateTokens delta per token, with one call_soon_threadsafe per step;
  no scheduler, validation, interceptor, telemetry or text: the least any Python gRPC server
  around llama.cpp can do per token;
- llama-grpc: the real server with its defaults.

The bench client (this process) is the same for bare and llama-grpc. bare / raw is therefore the
best efficiency a grpc.aio server can reach here, with the client on the same 2 cores; llama-grpc
/ bare is what llama-grpc itself costs on top of it.

    python bench/grpc_ceiling.py --batches 1,4,8,16 --reps 7
    python bench/grpc_ceiling.py --batches 1,4,8,16 --reps 7 --name grpc_ceiling_rerun
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    free_port,
    llama_grpc_server,
    machine_facts,
    progress,
    server_args,
    spread,
    write_json,
)
from concurrency import GEN_TOKENS, grpc_run, make_prompts
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.models.files import default_model_path

MODES = ("raw", "bare", "llama_grpc")


class BareRawService(pb_grpc.LlmServiceServicer):
    """GenerateTokens over the raw loop: streams wait until `batch` of them have arrived (the
    client sends them together), then one run serves them all, step by step."""

    def __init__(self, raw: RawLoop, batch: int) -> None:
        self._raw = raw
        self._batch = batch
        # one OS thread decodes, always: llama.cpp's OpenMP team belongs to it (see build.py)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._waiting: list[tuple[list[int], asyncio.Queue[int | None]]] = []

    async def GenerateTokens(self, request: Any, context: Any) -> Any:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._waiting.append((list(request.token_ids), queue))
        if len(self._waiting) == self._batch:
            batch, self._waiting = self._waiting, []
            asyncio.get_running_loop().run_in_executor(
                self._thread, self._run, batch, request.params.stopping.max_tokens
            )
        while (token := await queue.get()) is not None:
            yield pb.GenerateTokensResponse(delta=pb.GenerationDelta(token_ids=[token]))
        yield pb.GenerateTokensResponse(
            done=pb.GenerationDone(finish_reason=pb.FINISH_REASON_MAX_TOKENS)
        )

    def _run(self, batch: list[tuple[list[int], asyncio.Queue[int | None]]], n: int) -> None:
        loop = self._loop
        queues = [q for _, q in batch]

        def post(tokens: list[int]) -> None:
            loop.call_soon_threadsafe(_put_all, queues, tokens)

        self._raw.run([p for p, _ in batch], n, on_step=post)
        loop.call_soon_threadsafe(_put_all, queues, [None] * len(queues))

    def warm_up(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        prompt = self._raw.model.tokenize("Hello there", add_special=True, parse_special=False)
        self._thread.submit(self._raw.run, [prompt], 4).result()


def _put_all(queues: list[asyncio.Queue[int | None]], tokens: list[int | None]) -> None:
    for queue, token in zip(queues, tokens, strict=True):
        queue.put_nowait(token)


async def serve(port: int, batch: int, n_ctx: int, threads: int) -> None:
    raw = RawLoop(str(default_model_path()), n_ctx, batch, threads)
    service = BareRawService(raw, batch)
    service.warm_up(asyncio.get_running_loop())
    server = grpc.aio.server()
    pb_grpc.add_LlmServiceServicer_to_server(service, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def start_bare(batch: int, n_ctx: int, threads: int) -> tuple[str, subprocess.Popen[str]]:
    port = free_port()
    argv = [sys.executable, __file__, "--serve", str(port), "--batches", str(batch)]
    argv += ["--n-ctx", str(n_ctx), "--threads", str(threads)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # llama.cpp's log lines come first
        if line.strip() == "ready":
            break
    else:
        raise RuntimeError("the bare server did not start")
    return f"127.0.0.1:{port}", proc


async def timed(target: str, prompts: list[list[int]], gen: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        seconds, n = await grpc_run(pb_grpc.LlmServiceStub(channel), prompts, gen)
    if n != len(prompts) * gen:
        raise RuntimeError(f"expected {len(prompts) * gen} tokens, got {n}")
    return seconds


def measure_batch(  # noqa: PLR0917  # one call site
    raw: RawLoop, grpc_target: str, b: int, reps: int, gen: int, n_ctx: int, threads: int
) -> dict[str, Any]:
    bare_target, bare = start_bare(b, n_ctx, threads)
    try:
        asyncio.run(timed(bare_target, make_prompts(raw, b, 998), 8))  # warm-up
        asyncio.run(timed(grpc_target, make_prompts(raw, b, 997), 8))
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(reps):
            prompts = make_prompts(raw, b, rep)
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            for mode in order:
                if mode == "raw":
                    times[mode].append(raw.run(prompts, gen))
                else:
                    target = bare_target if mode == "bare" else grpc_target
                    times[mode].append(asyncio.run(timed(target, prompts, gen)))
            progress(
                f"B={b:>2} rep {rep + 1}/{reps}: "
                + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in MODES)
            )
    finally:
        bare.terminate()
        bare.wait(timeout=30)
    raw_m = statistics.median(times["raw"])
    per_rep = {
        "bare_vs_raw": [r / x for r, x in zip(times["raw"], times["bare"], strict=True)],
        "llama_grpc_vs_raw": [
            r / x for r, x in zip(times["raw"], times["llama_grpc"], strict=True)
        ],
        "llama_grpc_vs_bare": [
            b_ / x for b_, x in zip(times["bare"], times["llama_grpc"], strict=True)
        ],
    }
    return {
        "batch": b,
        "seconds": {m: spread(times[m]) for m in MODES},
        "tok_s": {m: b * gen / statistics.median(times[m]) for m in MODES},
        "bare_vs_raw": raw_m / statistics.median(times["bare"]),
        "llama_grpc_vs_raw": raw_m / statistics.median(times["llama_grpc"]),
        "llama_grpc_vs_bare": statistics.median(times["bare"])
        / statistics.median(times["llama_grpc"]),
        "per_rep": per_rep,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--name", default="grpc_ceiling", help="results file name (a rerun)")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.serve:
        asyncio.run(serve(args.serve, batches[0], args.n_ctx, args.threads))
        return 0
    facts = machine_facts(args.threads)
    raw = RawLoop(str(default_model_path()), args.n_ctx, max(batches), args.threads)
    extra = ["--n-parallel", str(max(batches)), "--n-ctx", str(args.n_ctx)]
    rows = []
    with llama_grpc_server(*server_args(args.threads, *extra)) as target:
        raw.run(make_prompts(raw, 1, 999), 8)
        for b in batches:
            rows.append(
                measure_batch(raw, target, b, args.reps, GEN_TOKENS, args.n_ctx, args.threads)
            )
    raw.close()
    data = {
        "benchmark": "grpc_ceiling",
        "command": "python bench/grpc_ceiling.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json(args.name, finish_facts(data))
    for r in rows:
        print(
            f"B={r['batch']:>2}  bare/raw {r['bare_vs_raw']:.3f}  llama-grpc/raw "
            f"{r['llama_grpc_vs_raw']:.3f}  llama-grpc/bare {r['llama_grpc_vs_bare']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
