"""Gateway benchmark (issue 31): the concurrency workload (B concurrent streams of 42-token
prompts, 64 greedy tokens each, ignore_eos) sent straight to one llama-grpc replica over v1
GenerateTokens, against the same replica through the SMG gateway (OpenAI /v1/completions,
streamed as SSE), for B = 1, 8, 16. SMG fronts that one replica alone (deploy/gateway.py's
Gateway with replicas=1), so the comparison isolates the gateway's cost. The two paths alternate
in every repetition (direct first on even repetitions, the gateway first on odd ones).

Reported per B (medians over repetitions, with their spread and the load average):
  - tok/s of each path and the ratio gateway / direct;
  - added TTFT: the gateway's TTFT p50 (p95) minus the direct path's, over every stream of
    every repetition;
  - SMG's CPU time per generated token: utime + stime of the smg process (and any children)
    from /proc/<pid>/stat before and after each gateway run, and the cores that is during the
    run; its idle CPU during the direct runs, for reference;
  - the replica's CPU per token on either path, and this client's;
  - added TTFT measured apart (`--ttft-pairs`, default 60): single short streams (4 tokens),
    direct and through SMG back to back in alternating order, each pair on a prompt of its own;
    the median of the per-pair differences and its quartiles, and SMG's CPU time per request.
    The B = 1 rows hold one stream per repetition, too few for a few-ms difference.
The cores SMG takes on a shared box are the ones llama.cpp then does not get (the tok/s ratio);
its CPU per token times the direct tok/s is what a gateway on its own machine would need.

SMG takes only text prompts (token ids get 400) and encodes completions without BOS (the
worker then puts the model's BOS in front), so each prompt is the concurrency text tokenized
without BOS (v1 Tokenize, add_special=false) and cut to 41 ids; SMG gets those ids
detokenized (checked to tokenize back to the same ids), v1 gets BOS + the ids, which is what
the worker runs for SMG. Every gateway answer must report those 42 prompt tokens and every
stream on either
path exactly the requested tokens (SMG forwards `ignore_eos`), or the run stops. The replica
runs with --no-cache-prompt (the concurrency workload's cache_prompt=false, which the engine
protocol cannot ask for per request), so neither path reuses the other's prompt.

    make bench-gateway                # or: python bench/gateway.py --reps 5
    make bench-gateway ARGS="--reps 1 --batches 1,8 --gen-tokens 16 --name gateway_smoke"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    GrpcBackend,
    StreamRecord,
    finish_facts,
    free_port,
    machine_facts,
    percentile,
    plot_rates,
    progress,
    pyplot,
    save_figure,
    spread,
    write_json,
)
from concurrency import PROMPT_TOKENS, add_workload_args, prompt_text
from deploy.gateway import Gateway
from peers import sse_post

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

PATHS = ("direct", "gateway")
RUN_TIMEOUT_S = 600.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- CPU accounting from /proc -----------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on: the command name may hold spaces."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(_stat_fields(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) and its live descendants, in seconds."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            fields = _stat_fields(p)
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15
            todo += _children(p)
    return total


# -- the two paths -----------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]  # what v1 gets: BOS + the ids SMG makes of `text` (what the worker runs)
    text: str  # what SMG gets


@dataclass
class Stream:
    record: StreamRecord
    prompt_tokens: int
    text: str


class SmgBackend:
    """SMG's OpenAI /v1/completions, streamed (bench/peers.py's SSE client): greedy, ignore_eos,
    usage in the last event. One SSE event per token; its arrival is the token's."""

    name = "smg"

    def __init__(self, port: int, model: str) -> None:
        self.port = port
        self.model = model

    async def generate(self, text: str, max_tokens: int) -> Stream:
        body = {
            "model": self.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 1234,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rec = StreamRecord(time.perf_counter())
        parts: list[str] = []
        prompt_tokens = 0
        async for event in sse_post(self.port, "/v1/completions", body):
            now = time.perf_counter()
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                rec.times.append(now)
                parts.append(choices[0]["text"])
            usage = event.get("usage")
            if usage:
                rec.n_tokens = int(usage["completion_tokens"])
                prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                rec.cached_prompt_tokens = int(details.get("cached_tokens") or 0)
        rec.t_done = time.perf_counter()
        return Stream(rec, prompt_tokens, "".join(parts))


async def make_prompts(stub: Any, batch: int, rep: int) -> list[Prompt]:
    """The concurrency workload's texts as SMG tokenizes them (no BOS), PROMPT_TOKENS ids each,
    with the BOS the worker puts in front."""
    tok = GrpcBackend(stub)
    bos = await tok.tokenize("", add_special=True)
    prompts = []
    for i in range(batch):
        ids = (await tok.tokenize(prompt_text(i, rep), add_special=False))[:PROMPT_TOKENS]
        if len(ids) < PROMPT_TOKENS:
            raise RuntimeError(f"prompt {i} has {len(ids)} tokens, fewer than {PROMPT_TOKENS}")
        text = (await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))).text
        if await tok.tokenize(text, add_special=False) != ids:
            raise RuntimeError(f"prompt {i}: its {PROMPT_TOKENS} ids do not survive detokenizing")
        prompts.append(Prompt(bos + ids, text))
    return prompts


@dataclass
class Paths:
    """Both ways to the one replica, and the processes whose CPU time is counted."""

    stub: Any  # v1 on the replica
    smg: SmgBackend
    smg_pid: int
    replica_pid: int


async def run_once(which: str, to: Paths, prompts: list[Prompt], gen: int) -> dict[str, Any]:
    """One run of B concurrent streams on one path: wall time (send of the first to the end of
    the last), TTFTs, and the CPU seconds SMG, the replica and this client spent meanwhile."""
    smg0, rep0, me0 = cpu_seconds(to.smg_pid), cpu_seconds(to.replica_pid), time.process_time()
    t0 = time.perf_counter()
    if which == "direct":
        backend = GrpcBackend(to.stub)
        calls = [backend.generate(p.ids, gen, cache_prompt=False) for p in prompts]
        records = await asyncio.wait_for(asyncio.gather(*calls), RUN_TIMEOUT_S)
        streams = [Stream(r, len(p.ids), "") for r, p in zip(records, prompts, strict=True)]
    else:
        calls2 = [to.smg.generate(p.text, gen) for p in prompts]
        streams = await asyncio.wait_for(asyncio.gather(*calls2), RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    me1, rep1, smg1 = time.process_time(), cpu_seconds(to.replica_pid), cpu_seconds(to.smg_pid)
    for s, p in zip(streams, prompts, strict=True):
        if s.record.n_tokens != gen or s.prompt_tokens != len(p.ids):
            raise RuntimeError(
                f"{which}: {s.record.n_tokens} tokens for {s.prompt_tokens} prompt tokens, "
                f"expected {gen} for {len(p.ids)}"
            )
    return {
        "path": which,
        "wall_s": wall,
        "tokens": sum(s.record.n_tokens for s in streams),
        "ttft_s": [s.record.ttft_s for s in streams],
        "smg_cpu_s": smg1 - smg0,
        "replica_cpu_s": rep1 - rep0,
        "client_cpu_s": me1 - me0,
        "load_1m": os.getloadavg()[0],
        "_streams": streams,
    }


TTFT_PAIR_TOKENS = 4


async def ttft_pairs(to: Paths, n: int) -> dict[str, Any]:
    """`n` pairs of single streams, direct and through SMG back to back (the order alternates),
    each pair on a fresh prompt: the gateway's added TTFT per pair, and SMG's CPU per request."""
    diffs, direct, gateway, smg_cpu = [], [], [], []
    for i in range(n):
        prompts = await make_prompts(to.stub, 1, 1000 + i)
        order = PATHS if i % 2 == 0 else PATHS[::-1]
        got = {w: await run_once(w, to, prompts, TTFT_PAIR_TOKENS) for w in order}
        d, g = got["direct"]["ttft_s"][0], got["gateway"]["ttft_s"][0]
        direct.append(d)
        gateway.append(g)
        diffs.append(g - d)
        smg_cpu.append(got["gateway"]["smg_cpu_s"])
    ms = [x * 1e3 for x in diffs]
    return {
        "pairs": n,
        "tokens_per_stream": TTFT_PAIR_TOKENS,
        "added_ttft_ms": {"p50": percentile(ms, 0.5), "p25": percentile(ms, 0.25),
                          "p75": percentile(ms, 0.75)},
        "direct_ttft_ms_p50": percentile(direct, 0.5) * 1e3,
        "gateway_ttft_ms_p50": percentile(gateway, 0.5) * 1e3,
        # the mean: /proc counts CPU in 10 ms ticks, so most single requests read 0
        "smg_cpu_ms_per_request": 1e3 * statistics.fmean(smg_cpu),
        "load_1m": os.getloadavg()[0],
    }  # fmt: skip


async def same_text(
    stub: Any, direct: dict[str, Any], gateway: dict[str, Any]
) -> tuple[int, list[dict[str, str]]]:
    """How many streams gave the gateway the text v1's greedy ids detokenize to, and the first
    one that did not (greedy decoding of a batch may differ with the rows' order in it)."""
    n, differ = 0, []
    for d, g in zip(direct["_streams"], gateway["_streams"], strict=True):
        reply = await stub.Detokenize(pb.DetokenizeRequest(token_ids=d.record.token_ids))
        n += reply.text == g.text
        if reply.text != g.text and not differ:
            differ.append({"direct": reply.text, "gateway": g.text})
    return n, differ


async def measure(
    gw: Gateway, batches: list[int], reps: int, gen: int, pairs: int
) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]], dict[str, Any]]:
    replica = gw.cluster.members[0]
    if gw.smg is None or replica.proc is None:
        raise RuntimeError("the gateway is not running")
    rows, runs_by_batch = [], {}
    async with grpc.aio.insecure_channel(replica.target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        to = Paths(stub, SmgBackend(gw.port, gw.model), gw.smg.pid, replica.proc.pid)
        for b in (1, max(batches)):  # warm-up both paths, small and large
            warm = await make_prompts(stub, b, 999)
            for which in PATHS:
                await run_once(which, to, warm, 8)
        progress("warm-up done")
        added = await ttft_pairs(to, pairs) if pairs else {}
        if added:
            progress(
                f"added TTFT over {pairs} pairs: p50 {added['added_ttft_ms']['p50']:+.1f} ms "
                f"(quartiles {added['added_ttft_ms']['p25']:+.1f} / "
                f"{added['added_ttft_ms']['p75']:+.1f}), SMG "
                f"{added['smg_cpu_ms_per_request']:.1f} CPU ms per request"
            )
        for b in batches:
            runs: list[dict[str, Any]] = []
            for rep in range(reps):
                prompts = await make_prompts(stub, b, rep)
                order = PATHS if rep % 2 == 0 else PATHS[::-1]
                got = {w: await run_once(w, to, prompts, gen) for w in order}
                matching, differ = await same_text(stub, got["direct"], got["gateway"])
                for which in PATHS:
                    got[which].pop("_streams")
                    runs.append({**got[which], "rep": rep, "same_text": matching})
                runs[-1]["text_differs"] = differ
                d, g = got["direct"], got["gateway"]
                progress(
                    f"B={b:>2} rep {rep + 1}/{reps}: direct {d['wall_s']:.3f}s gateway "
                    f"{g['wall_s']:.3f}s ({d['wall_s'] / g['wall_s']:.3f}), TTFT p50 "
                    f"{statistics.median(d['ttft_s']) * 1e3:.1f} / "
                    f"{statistics.median(g['ttft_s']) * 1e3:.1f} ms, SMG CPU "
                    f"{g['smg_cpu_s'] * 1e3:.0f} ms, same text {matching}/{b}, "
                    f"load {g['load_1m']:.2f}"
                )
            rows.append(analyse(b, gen, runs))
            runs_by_batch[b] = runs
    return rows, runs_by_batch, added


# -- analysis (pure) ---------------------------------------------------------------------------


def analyse(batch: int, gen: int, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row per B from its runs (both paths, every repetition): medians, spreads, ratios,
    added TTFT and CPU per token."""
    by = {w: sorted((r for r in runs if r["path"] == w), key=lambda r: r["rep"]) for w in PATHS}
    direct, gateway = by["direct"], by["gateway"]
    if not direct or [r["rep"] for r in direct] != [r["rep"] for r in gateway]:
        raise ValueError("every repetition needs one run of each path")
    d_wall = [r["wall_s"] for r in direct]
    g_wall = [r["wall_s"] for r in gateway]
    tokens = batch * gen
    d_ttft = [t for r in direct for t in r["ttft_s"]]
    g_ttft = [t for r in gateway for t in r["ttft_s"]]

    def per_token_ms(key: str, rs: list[dict[str, Any]]) -> float:
        return 1e3 * sum(r[key] for r in rs) / sum(r["tokens"] for r in rs)

    def cores(key: str, rs: list[dict[str, Any]]) -> float:
        return sum(r[key] for r in rs) / sum(r["wall_s"] for r in rs)

    direct_tok_s = tokens / statistics.median(d_wall)
    smg_ms = per_token_ms("smg_cpu_s", gateway)
    return {
        "batch": batch,
        "direct_s": spread(d_wall),
        "gateway_s": spread(g_wall),
        "direct_tok_s": direct_tok_s,
        "gateway_tok_s": tokens / statistics.median(g_wall),
        "ratio": statistics.median(d_wall) / statistics.median(g_wall),
        "ratio_best": min(d_wall) / min(g_wall),
        "ratio_per_rep": [d / g for d, g in zip(d_wall, g_wall, strict=True)],
        "direct_ttft_ms": {"p50": percentile(d_ttft, 0.5) * 1e3,
                           "p95": percentile(d_ttft, 0.95) * 1e3},
        "gateway_ttft_ms": {"p50": percentile(g_ttft, 0.5) * 1e3,
                            "p95": percentile(g_ttft, 0.95) * 1e3},
        "added_ttft_p50_ms": (percentile(g_ttft, 0.5) - percentile(d_ttft, 0.5)) * 1e3,
        "added_ttft_p95_ms": (percentile(g_ttft, 0.95) - percentile(d_ttft, 0.95)) * 1e3,
        "added_ttft_p50_ms_per_rep": [
            (statistics.median(g["ttft_s"]) - statistics.median(d["ttft_s"])) * 1e3
            for d, g in zip(direct, gateway, strict=True)
        ],
        "smg_cpu_ms_per_token": smg_ms,
        "smg_cpu_ms_per_token_per_rep": [1e3 * r["smg_cpu_s"] / r["tokens"] for r in gateway],
        "smg_cores": cores("smg_cpu_s", gateway),
        "smg_idle_cores": cores("smg_cpu_s", direct),
        "smg_cores_at_direct_tok_s": smg_ms * direct_tok_s / 1e3,
        "replica_cpu_ms_per_token": {"direct": per_token_ms("replica_cpu_s", direct),
                                     "gateway": per_token_ms("replica_cpu_s", gateway)},
        "replica_cores": {"direct": cores("replica_cpu_s", direct),
                          "gateway": cores("replica_cpu_s", gateway)},
        "client_cpu_ms_per_token": {"direct": per_token_ms("client_cpu_s", direct),
                                    "gateway": per_token_ms("client_cpu_s", gateway)},
        "same_text": sum(r["same_text"] for r in direct),
        "streams": batch * len(direct),
        "load_1m": spread([r["load_1m"] for r in runs]),
    }  # fmt: skip


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, "1,8,16")
    parser.add_argument("--name", default="gateway", help="results file name (JSON and PNG)")
    parser.add_argument("--ttft-pairs", type=int, default=60, help="single-stream pairs (0: none)")
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    batches = [int(b) for b in args.batches.split(",")]
    extra = ["--n-parallel", str(max(batches)), "--n-ctx", str(args.n_ctx), "--no-cache-prompt"]
    progress("starting one replica and SMG in front of it")
    with Gateway(replicas=1, port=free_port(), server_args=extra, threads=args.threads) as gw:
        rows, runs, added = asyncio.run(
            measure(gw, batches, args.reps, args.gen_tokens, args.ttft_pairs)
        )
    data = {
        "benchmark": "gateway",
        "command": "python bench/gateway.py " + " ".join(sys.argv[1:]),
        "workload": {
            "prompt_tokens": PROMPT_TOKENS,
            "prompt_bos": True,
            "generated_tokens": args.gen_tokens,
            "replica_args": extra,
        },
        "cpu_tick_s": 1 / CLK_TCK,  # /proc/<pid>/stat's resolution, per reading
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
        "added_ttft": added,
        "runs": {str(b): rs for b, rs in runs.items()},
    }
    write_json(args.name, finish_facts(data))
    plot(rows, args.gen_tokens, args.name)
    for r in rows:
        print(
            f"B={r['batch']:>2}  direct {r['direct_tok_s']:7.1f} tok/s  gateway "
            f"{r['gateway_tok_s']:7.1f} tok/s  ratio {r['ratio']:.3f}  added TTFT p50 "
            f"{r['added_ttft_p50_ms']:+.1f} ms p95 {r['added_ttft_p95_ms']:+.1f} ms  SMG "
            f"{r['smg_cpu_ms_per_token']:.3f} CPU ms/token ({r['smg_cores']:.2f} cores)  replica "
            f"{r['replica_cpu_ms_per_token']['direct']:.2f} / "
            f"{r['replica_cpu_ms_per_token']['gateway']:.2f} CPU ms/token  same text "
            f"{r['same_text']}/{r['streams']}"
        )
    return 0


def plot(rows: list[dict[str, Any]], gen: int, name: str) -> None:
    plt = pyplot()
    xs = [r["batch"] for r in rows]
    fig, (tps, ttft, cpu) = plt.subplots(1, 3, figsize=(13, 4))
    series = [("direct_tok_s", "o-", "direct (v1 GenerateTokens)"),
              ("gateway_tok_s", "s-", "through SMG (completions)")]  # fmt: skip
    plot_rates(tps, rows, series, "ratio")
    tps.legend()
    width = 0.35
    at = range(len(rows))
    ttft.bar([i - width / 2 for i in at], [r["added_ttft_p50_ms"] for r in rows], width,
             label="p50")  # fmt: skip
    ttft.bar([i + width / 2 for i in at], [r["added_ttft_p95_ms"] for r in rows], width,
             label="p95")  # fmt: skip
    ttft.axhline(5, color="grey", linestyle=":", linewidth=1, label="target p50 ≤ 5 ms")
    ttft.set_xticks(list(at), [str(x) for x in xs])
    ttft.set_xlabel("concurrent sequences B")
    ttft.set_ylabel("gateway TTFT - direct TTFT (ms)")
    ttft.legend()
    w3 = 0.27
    cpu.bar([i - w3 for i in at], [r["smg_cpu_ms_per_token"] for r in rows], w3, label="SMG")
    cpu.bar(list(at), [r["replica_cpu_ms_per_token"]["direct"] for r in rows], w3,
            label="replica, direct")  # fmt: skip
    cpu.bar([i + w3 for i in at], [r["replica_cpu_ms_per_token"]["gateway"] for r in rows], w3,
            label="replica, through SMG")  # fmt: skip
    cpu.set_xticks(list(at), [str(x) for x in xs])
    cpu.set_xlabel("concurrent sequences B")
    cpu.set_ylabel("CPU ms per generated token")
    cpu.legend()
    for ax in (tps, ttft, cpu):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"One replica direct vs through SMG: {PROMPT_TOKENS}-token prompts, {gen} tokens each"
    )
    save_figure(fig, name)


if __name__ == "__main__":
    raise SystemExit(main())
