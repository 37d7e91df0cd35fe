"""What security costs: B concurrent GenerateTokens streams (41-token prompts, 64 greedy tokens,
ignore_eos, cache_prompt=false; B = 8 by default) against three llama-grpc servers started side
by side: plaintext, TLS, and TLS with a bearer token checked on every call. The modes take turns
within every repetition (the order rotates), so background noise hits all three. Reported per
mode: tokens/s (medians), the ratio to plaintext of each repetition (median and spread), and the
server's CPU time per streamed token outside llama_decode and the client's, which noise does not
move as much. Certificates are made with openssl (tests/support/certs.py) in a temporary directory.

    make bench-security           # or: python bench/security_overhead.py --reps 7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    DEFAULT_THREADS,
    finish_facts,
    greedy_params,
    llama_grpc_process,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    server_args,
    spread,
    stream_tokens,
    write_json,
)
from overhead import split_cpu, thread_cpu
from tests.support.certs import Pki, make_pki

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.auth import token_digest

PROMPT_TOKENS = 41
GEN_TOKENS = 64
MODES = ("plaintext", "tls", "tls_token")
TOKEN = "bench-token-0123456789abcdef"
SETTLE_S = 0.25


@contextlib.contextmanager
def servers(
    directory: Path, threads: int, n_parallel: int
) -> Iterator[dict[str, tuple[str, int, grpc.ChannelCredentials | None]]]:
    """mode -> (target, server pid, channel credentials), all three serving."""
    pki = make_pki(directory / "pki", "bench")
    tokens = directory / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\ntenant = "bench"\nrole = "admin"\nsha256 = "{token_digest(TOKEN)}"\n'
    )
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    extra = {
        "plaintext": [],
        "tls": tls,
        "tls_token": [*tls, "--auth-tokens-file", str(tokens)],
    }
    base = server_args(threads, "--n-parallel", str(n_parallel))
    with contextlib.ExitStack() as stack:
        out = {}
        for mode in MODES:
            credentials = None if mode == "plaintext" else credentials_of(pki)
            target, proc = stack.enter_context(
                llama_grpc_process(*base, *extra[mode], credentials=credentials)
            )
            out[mode] = (target, proc.pid, credentials)
            progress(f"{mode} server at {target}")
        yield out


def credentials_of(pki: Pki) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=pki.ca_cert.read_bytes())


def channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, credentials)


async def prompts_of(stub: Any, metadata: Any, batch: int, rep: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        text = f"Request {i + 100 * rep}: " + "tell the story of the harbour town. " * 8
        reply = await stub.Tokenize(pb.TokenizeRequest(text=text), metadata=metadata)
        out.append(list(reply.token_ids)[:PROMPT_TOKENS])
    return out


async def run(stub: Any, metadata: Any, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    params = greedy_params(gen, cache_prompt=False)
    t0 = time.perf_counter()
    records = await asyncio.gather(
        *(stream_tokens(stub, p, params=params, metadata=metadata) for p in prompts)
    )
    return time.perf_counter() - t0, sum(r.n_tokens for r in records)


async def measured(
    stub: Any, metadata: Any, pid: int, prompts: list[list[int]], gen: int
) -> dict[str, float]:
    """Wall seconds, and CPU µs per streamed token: server outside llama_decode, client."""
    await asyncio.sleep(SETTLE_S)
    s0 = await stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
    t0, c0 = thread_cpu(pid), time.process_time()
    seconds, n = await run(stub, metadata, prompts, gen)
    t1, c1 = thread_cpu(pid), time.process_time()
    s1 = await stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
    if n != len(prompts) * gen:
        raise RuntimeError(f"expected {len(prompts) * gen} tokens, got {n}")
    cpu = split_cpu(pid, t0, t1)
    in_decode = s1.decode_cpu_seconds - s0.decode_cpu_seconds
    outside = cpu["engine_total"] - in_decode + cpu["event_loop"] + cpu["grpc_threads"]
    return {
        "seconds": seconds,
        "server_outside_decode_us": outside / n * 1e6,
        "event_loop_and_grpc_us": (cpu["event_loop"] + cpu["grpc_threads"]) / n * 1e6,
        "client_us": (c1 - c0) / n * 1e6,
    }


async def measure(
    running: dict[str, tuple[str, int, grpc.ChannelCredentials | None]],
    batch: int,
    reps: int,
    gen: int,
) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    async with contextlib.AsyncExitStack() as stack:
        stubs = {}
        for mode, (target, pid, credentials) in running.items():
            ch = await stack.enter_async_context(channel(target, credentials))
            metadata = (("authorization", f"Bearer {TOKEN}"),) if mode == "tls_token" else ()
            stubs[mode] = (pb_grpc.LlmServiceStub(ch), metadata, pid)
        for stub, metadata, _ in stubs.values():  # warm-up: connections, model, caches
            await run(stub, metadata, await prompts_of(stub, metadata, batch, 999), 8)
        progress("warm-up done")
        for rep in range(reps):
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            line = []
            for mode in order:
                stub, metadata, pid = stubs[mode]
                prompts = await prompts_of(stub, metadata, batch, rep)
                got = await measured(stub, metadata, pid, prompts, gen)
                results[mode].append(got)
                line.append(f"{mode} {batch * gen / got['seconds']:.1f} tok/s")
            progress(f"rep {rep + 1}/{reps}: " + ", ".join(line))
    return results


def rows_of(
    results: dict[str, list[dict[str, float]]], batch: int, gen: int
) -> list[dict[str, Any]]:
    plain = [r["seconds"] for r in results["plaintext"]]
    rows = []
    for mode in MODES:
        seconds = [r["seconds"] for r in results[mode]]
        ratios = [p / s for p, s in zip(plain, seconds, strict=True)]
        rows.append(
            {
                "mode": mode,
                "tok_s": batch * gen / statistics.median(seconds),
                "seconds": spread(seconds),
                "ratio_to_plaintext": spread(ratios),
                "ratio_per_rep": ratios,
                "server_outside_decode_us": spread(
                    [r["server_outside_decode_us"] for r in results[mode]]
                ),
                "event_loop_and_grpc_us": spread(
                    [r["event_loop_and_grpc_us"] for r in results[mode]]
                ),
                "client_us": spread([r["client_us"] for r in results[mode]]),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--gen-tokens", type=int, default=GEN_TOKENS)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    with (
        tempfile.TemporaryDirectory() as tmp,
        servers(Path(tmp), args.threads, args.batch) as running,
    ):
        results = asyncio.run(measure(running, args.batch, args.reps, args.gen_tokens))
    rows = rows_of(results, args.batch, args.gen_tokens)
    data = {
        "benchmark": "security_overhead",
        "command": "python bench/security_overhead.py " + " ".join(sys.argv[1:]),
        "workload": {
            "batch": args.batch,
            "prompt_tokens": PROMPT_TOKENS,
            "generated_tokens": args.gen_tokens,
        },
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
    }
    write_json("security_overhead", finish_facts(data))
    plot(rows)
    for r in rows:
        ratio = r["ratio_to_plaintext"]
        print(
            f"{r['mode']:>10}  {r['tok_s']:6.1f} tok/s  ratio {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f})  "
            f"server {r['server_outside_decode_us']['median']:.0f} µs/token outside decode"
        )
    return 0


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["mode"] for r in rows]
    ratio = [r["ratio_to_plaintext"]["median"] for r in rows]
    low = [r["ratio_to_plaintext"]["median"] - r["ratio_to_plaintext"]["min"] for r in rows]
    high = [r["ratio_to_plaintext"]["max"] - r["ratio_to_plaintext"]["median"] for r in rows]
    left.bar(names, ratio, yerr=[low, high], capsize=4, color=["#888", "#4a7", "#27a"])
    left.axhline(0.97, color="red", linestyle="--", linewidth=1, label="target 0.97")
    left.set_ylim(0.8, 1.1)
    left.set_ylabel("tokens/s relative to plaintext")
    left.legend(loc="lower right")
    cpu = [r["server_outside_decode_us"]["median"] for r in rows]
    right.bar(names, cpu, color=["#888", "#4a7", "#27a"])
    right.set_ylabel("server CPU µs per token outside llama_decode")
    fig.suptitle("Security overhead (B streams, medians; bars: min-max over repetitions)")
    save_figure(fig, "security_overhead")


if __name__ == "__main__":
    raise SystemExit(main())
