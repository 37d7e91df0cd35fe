"""LoRA serving throughput: S concurrent greedy streams on the trained Qwen 2.5 Coder 0.5B
Instruct (the catalog's Q4_K_M) with no adapter (base), all on one adapter (lora1), and 2 or 4
adapters interleaved (lora2, lora4: stream i applies adapter i mod k), on llama-grpc and on
llama.cpp's llama-server with the same adapters, in the same run.

The adapters are random (llama_grpc_testkit.synth_lora's write_lora: rank 8, alpha 16, attn_q,
attn_v and ffn_up of every layer, seeds 0..3, A and B of std ADAPTER_STD), written into a temp dir
at the start: not a fine-tune's words, a real rank-8 adapter's cost. Both servers load all four at
start: llama-grpc `--lora aN=PATH`; llama-server `--lora PATH ... --lora-init-without-apply`, then
every global scale set to 0 (POST /lora-adapters), and each request lists every adapter, its own at
scale 1 and the others at 0 (this llama-server gives a request without a `lora` field every adapter
at its global scale, which --lora-init-without-apply leaves at 1).

Workload: each stream a fixed 64-token prompt (token ids, the same on both servers, in every
configuration and rep) and 64 greedy tokens with ignore_eos; no prompt cache (llama-grpc
--no-cache-prompt --prompt-cache-ram-mb 0 and params.cache_prompt false; llama-server
--cache-ram 0 and cache_prompt false); --n-parallel = -np = the largest S; the same threads,
batch sizes and context. Both servers stay up but only one works at a time: rep by rep, every
S and configuration in turn (ABAB), both systems back to back, the one going first
alternating, so drift on a shared box hits every cell alike.

Threads: 1 llama.cpp thread per server by default. The box has 2 cores, and the benchmark's
client (asyncio: a gRPC message or an SSE event per token) and each server's other threads
(gRPC, the scheduler; the HTTP loop) need CPU while a pass runs: with 2 llama.cpp threads they
take turns with the pass's own, and a preempted thread stalls the whole pass at its barrier
(noise that hits hardest the server with more work per token). One thread leaves a core for
all that; --threads 2 on a bigger or quiet machine.

Reported per S, configuration and system: total output tok/s (median and spread of the reps),
its ratio to the same system's base (rep by rep, then the median) and llama-grpc / llama-server
(likewise); server CPU ms per output token (/proc of the server process: other work moves it
less than wall time); forward passes (llama-grpc GetStats ticks, llama-server /metrics
n_decode_total) and generated tokens per pass; llama-grpc's adapter_switches and tokens per
pass (GetStats avg_batch_size); when each adapter set's streams got their first token and
finished (finish ratio: the last set's finish over the first's; llama-grpc gives the sets
strict turns, llama-server serves the set of its lowest busy slot and leaves the others
waiting); and how many leading tokens each stream shares between the systems and with the
base model's output (rep 0).

    make bench-lora                                   # bench/results/lora.json + lora.png
    python bench/lora.py --reps 3 --streams 4,8 --threads 1
    python bench/lora.py --quick                      # a check of the script (lora_quick.*)

llama-server comes from $LLAMA_SERVER_BINARY, else bench/build_llama_server.sh's build
(bench/peers.py: llama_server_binary)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# configuration -> how many adapters its streams take turns over (0: the base model)
CONFIGS: dict[str, int] = {"base": 0, "lora1": 1, "lora2": 2, "lora4": 4}
SYSTEMS = ("llama-grpc", "llama-server")
RANK, ALPHA = 8, 16.0
TARGETS = ("attn_q", "attn_v", "ffn_up")
# A's and B's element std: alpha / rank * B A moves each weight by ~0.0023 (std), a fifth to
# a twentieth of its own (0.01-0.05): the text changes yet stays text. synth_lora's default
# turns Qwen's output to noise, whose near-tied logits flip with the batch's make-up, so the two
# systems' tokens could not be compared. The values do not change the cost.
ADAPTER_STD = 0.02
PROMPT_TOKENS, GEN_TOKENS = 64, 64
N_CTX = 2048  # the largest S x (prompt + generated) with room to spare
N_BATCH, N_UBATCH = 2048, 512  # both servers' defaults, given to both
SEED = 1234
PROMPT_SEED = 500  # stream i's prompt: seeded_text(..., PROMPT_SEED + i)
REQUEST_TIMEOUT_S = 900.0


# -- requests (pure) -----------------------------------------------------------------------------


def adapter_of(stream: int, n_adapters: int) -> int | None:
    """The adapter stream `stream` applies when the streams take turns over `n_adapters`
    adapters (None: the base model)."""
    return None if n_adapters == 0 else stream % n_adapters


def adapter_name(index: int) -> str:
    """llama-grpc's name for adapter `index` (llama-server's id is the index itself)."""
    return f"a{index}"


def grpc_params(adapter: int | None, max_tokens: int) -> Any:
    """v1 GenerationParams: greedy, ignore_eos, no prompt cache, the adapter at scale 1."""
    from llama_grpc.v1 import llm_service_pb2 as pb

    params = pb.GenerationParams(
        sampling=pb.SamplingParams(temperature=0.0, seed=SEED),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        cache_prompt=False,
    )
    if adapter is not None:
        params.lora.add(name=adapter_name(adapter), scale=1.0)
    return params


def server_lora(adapter: int | None, n_loaded: int) -> list[dict[str, Any]]:
    """llama-server's per-request `lora`: every loaded adapter by id, scale 1 for the chosen
    one and 0 for the others (an absent or empty list would take the global scales)."""
    return [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(n_loaded)]


def server_body(
    ids: Sequence[int], adapter: int | None, n_loaded: int, max_tokens: int
) -> dict[str, Any]:
    """A streaming /completion request: token ids, greedy, ignore_eos, no prompt cache."""
    return {
        "prompt": list(ids),
        "n_predict": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
        "lora": server_lora(adapter, n_loaded),
    }


@dataclass(frozen=True, slots=True)
class Run:
    rep: int
    streams: int
    config: str
    system: str


def run_order(
    reps: int, streams: Sequence[int], configs: Sequence[str], systems: Sequence[str]
) -> list[Run]:
    """Rep by rep, each S and configuration in turn, both systems back to back; which system
    goes first alternates from one (S, configuration) to the next and from rep to rep."""
    out, k = [], 0
    for rep in range(reps):
        for s in streams:
            for config in configs:
                first = (k + rep) % len(systems)
                for system in (*systems[first:], *systems[:first]):
                    out.append(Run(rep, s, config, system))
                k += 1
    return out


# -- figures (pure) ------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max, mean and (max - min) / median of some reps."""
    ordered = sorted(values)
    median = statistics.median(ordered)
    return {
        "median": median,
        "min": ordered[0],
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
        "rel_spread": (ordered[-1] - ordered[0]) / median if median else 0.0,
        "n": len(ordered),
    }


def paired_ratio(num: Mapping[int, float], den: Mapping[int, float]) -> dict[str, float] | None:
    """The ratio num / den rep by rep (the two measured minutes apart at most), summarized;
    None when no rep has both."""
    ratios = [num[r] / den[r] for r in sorted(num) if r in den and den[r] > 0]
    return spread(ratios) if ratios else None


def stats_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """llama-grpc's GetStats over one run: passes, adapter switches, tokens, and tokens per
    pass (batch tokens are avg_batch_size x ticks, cumulative)."""
    d = {k: after[k] - before[k] for k in after if k in before and k != "avg_batch_size"}
    batch_tokens = round(after["avg_batch_size"] * after["ticks"]) - round(
        before["avg_batch_size"] * before["ticks"]
    )
    passes = d["ticks"]
    d["batch_tokens"] = batch_tokens
    d["tokens_per_pass"] = batch_tokens / passes if passes else 0.0
    d["generated_per_pass"] = d["generated_tokens"] / passes if passes else 0.0
    return d


def metrics_value(text: str, name: str) -> float:
    """A value of llama-server's Prometheus text (/metrics): `llamacpp:NAME VALUE`."""
    for line in text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise KeyError(f"llama-server /metrics has no llamacpp:{name}")


def set_finish(
    finish_s: Sequence[float], ttft_s: Sequence[float], adapters: Sequence[int | None]
) -> dict[str, Any]:
    """Per adapter set (by adapter, "base" for none): when its first token came and when its
    last stream finished (seconds from the run's start), and the last set's finish over the
    first's (1: the sets advance together; about k: served one after another)."""
    sets: dict[str, dict[str, float]] = {}
    for done, first, adapter in zip(finish_s, ttft_s, adapters, strict=True):
        key = "base" if adapter is None else adapter_name(adapter)
        cell = sets.setdefault(key, {"first_token_s": first, "finish_s": done})
        cell["first_token_s"] = min(cell["first_token_s"], first)
        cell["finish_s"] = max(cell["finish_s"], done)
    ends = [c["finish_s"] for c in sets.values()]
    return {"sets": sets, "finish_ratio": max(ends) / min(ends) if min(ends) > 0 else 0.0}


def summarize(runs: Sequence[Mapping[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (S, configuration): per system the medians and spreads over reps, the ratio
    to its base configuration and llama-grpc / llama-server (both paired by rep)."""
    rate: dict[tuple[int, str, str], dict[int, float]] = {}
    for r in runs:
        key = (r["streams"], r["config"], r["system"])
        rate.setdefault(key, {})[r["rep"]] = r["tok_s"]
    rows = []
    for s in sorted({r["streams"] for r in runs}):
        for config in configs:
            row: dict[str, Any] = {"streams": s, "config": config, "adapters": CONFIGS[config]}
            for system in SYSTEMS:
                mine = [
                    r
                    for r in runs
                    if (r["streams"], r["config"], r["system"]) == (s, config, system)
                ]
                if not mine:
                    continue
                cell: dict[str, Any] = {
                    "tok_s": spread([r["tok_s"] for r in mine]),
                    "cpu_ms_per_token": spread([1000 * r["cpu_s_per_token"] for r in mine]),
                    "passes": spread([r["passes"] for r in mine]),
                    "generated_per_pass": spread([r["generated_per_pass"] for r in mine]),
                    "finish_ratio": spread([r["fairness"]["finish_ratio"] for r in mine]),
                    "max_ttft_s": spread([r["max_ttft_s"] for r in mine]),
                }
                base = rate.get((s, "base", system))
                if base is not None:
                    cell["ratio_to_base"] = paired_ratio(rate[(s, config, system)], base)
                if system == "llama-grpc":
                    cell["adapter_switches"] = spread(
                        [r["grpc_stats"]["adapter_switches"] for r in mine]
                    )
                    cell["tokens_per_pass"] = spread(
                        [r["grpc_stats"]["tokens_per_pass"] for r in mine]
                    )
                row[system] = cell
            ours, theirs = rate.get((s, config, SYSTEMS[0])), rate.get((s, config, SYSTEMS[1]))
            if ours and theirs:
                row["grpc_over_server"] = paired_ratio(ours, theirs)
            rows.append(row)
    return rows


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def token_checks(tokens: Mapping[tuple[str, int, str], Sequence[Sequence[int]]]) -> dict[str, Any]:
    """From one rep's token ids, keyed (system, S, configuration) -> per stream: for each
    (S, configuration), the leading tokens both systems share per stream (all of them: the same
    output); for each adapter configuration and system, those it shares with the base
    configuration's output of the same prompt (fewer than all: the adapter was applied)."""
    out: dict[str, Any] = {"shared_with_other_system": {}, "shared_with_base": {}}
    for (system, s, config), streams in sorted(tokens.items()):
        label = f"S{s}/{config}"
        other = tokens.get((SYSTEMS[1], s, config))
        if system == SYSTEMS[0] and other is not None:
            out["shared_with_other_system"][label] = [
                common_prefix(a, b) for a, b in zip(streams, other, strict=True)
            ]
        base = tokens.get((system, s, "base"))
        if config != "base" and base is not None:
            out["shared_with_base"][f"{system} {label}"] = [
                common_prefix(a, b) for a, b in zip(streams, base, strict=True)
            ]
    return out


# -- the systems ---------------------------------------------------------------------------------


@dataclass
class Stream:
    """One request's client-side view: tokens, first-token and finish times from the start."""

    tokens: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    finish_s: float = float("nan")
    n_tokens: int = 0


class GrpcSystem:
    name = "llama-grpc"

    def __init__(self, stub: Any, pid: int) -> None:
        self.stub = stub
        self.pid = pid

    async def stream(self, ids: Sequence[int], adapter: int | None, gen: int, t0: float) -> Stream:
        from llama_grpc.v1 import llm_service_pb2 as pb

        out = Stream()
        request = pb.GenerateTokensRequest(token_ids=list(ids), params=grpc_params(adapter, gen))
        async for message in self.stub.GenerateTokens(request, timeout=REQUEST_TIMEOUT_S):
            if message.HasField("delta") and message.delta.token_ids:
                if not out.tokens:
                    out.ttft_s = time.perf_counter() - t0
                out.tokens += message.delta.token_ids
        out.finish_s = time.perf_counter() - t0
        out.n_tokens = len(out.tokens)
        return out

    async def counters(self) -> dict[str, float]:
        from llama_grpc.v1 import llm_service_pb2 as pb

        s = await self.stub.GetStats(pb.GetStatsRequest())
        out = {
            k: float(getattr(s, k))
            for k in (
                "ticks",
                "avg_batch_size",
                "adapter_switches",
                "generated_tokens",
                "prompt_tokens",
                "decode_seconds",
                "decode_cpu_seconds",
            )
        }
        for a in s.adapters:
            out[f"passes_{a.name}"] = float(a.passes)
        return out


class ServerSystem:
    name = "llama-server"

    def __init__(self, port: int, pid: int, n_loaded: int) -> None:
        self.port = port
        self.pid = pid
        self.n_loaded = n_loaded

    async def stream(self, ids: Sequence[int], adapter: int | None, gen: int, t0: float) -> Stream:
        from peers import sse_post

        out = Stream()
        predicted = 0
        async for event in sse_post(
            self.port, "/completion", server_body(ids, adapter, self.n_loaded, gen)
        ):
            toks = event.get("tokens") or []
            if toks and not out.tokens:
                out.ttft_s = time.perf_counter() - t0
            out.tokens += toks
            if event.get("stop"):
                predicted = int((event.get("timings") or {}).get("predicted_n", 0) or 0)
        out.finish_s = time.perf_counter() - t0
        # tokens generated but not streamed (an unfinished UTF-8 character at the end) count
        out.n_tokens = max(len(out.tokens), predicted)
        return out

    async def counters(self) -> dict[str, float]:
        text = await asyncio.to_thread(_http_get, self.port, "/metrics")
        return {
            "n_decode_total": metrics_value(text, "n_decode_total"),
            "tokens_predicted_total": metrics_value(text, "tokens_predicted_total"),
            "prompt_tokens_total": metrics_value(text, "prompt_tokens_total"),
        }


def _http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        return str(reply.read().decode())


def _http_post(port: int, path: str, body: bytes) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return str(reply.read().decode())


def cpu_seconds(pid: int) -> float:
    from gateway import cpu_seconds as of  # /proc utime + stime, threads and children

    return float(of(pid))


async def measure(
    system: Any, prompts: Sequence[Sequence[int]], n_adapters: int, gen: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """One run: every stream at once; wall, server CPU and counters around it."""
    adapters = [adapter_of(i, n_adapters) for i in range(len(prompts))]
    before = await system.counters()
    cpu0 = cpu_seconds(system.pid)
    t0 = time.perf_counter()
    streams = await asyncio.gather(
        *(system.stream(p, a, gen, t0) for p, a in zip(prompts, adapters, strict=True))
    )
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(system.pid) - cpu0
    after = await system.counters()
    tokens = sum(s.n_tokens for s in streams)
    record: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "expected_tokens": len(prompts) * gen,
        "tok_s": tokens / wall,
        "cpu_s": cpu,
        "cpu_s_per_token": cpu / tokens if tokens else float("nan"),
        "max_ttft_s": max(s.ttft_s for s in streams),
        "fairness": set_finish(
            [s.finish_s for s in streams], [s.ttft_s for s in streams], adapters
        ),
        "per_stream": [
            {"adapter": a, "ttft_s": s.ttft_s, "finish_s": s.finish_s, "n_tokens": s.n_tokens}
            for a, s in zip(adapters, streams, strict=True)
        ],
    }
    if system.name == "llama-grpc":
        delta = stats_delta(before, after)
        record["grpc_stats"] = delta
        record["passes"] = delta["ticks"]
        record["generated_per_pass"] = delta["generated_per_pass"]
    else:
        delta = {k: after[k] - before[k] for k in after}
        record["server_metrics"] = delta
        record["passes"] = delta["n_decode_total"]
        passes = delta["n_decode_total"]
        record["generated_per_pass"] = delta["tokens_predicted_total"] / passes if passes else 0.0
    return record, [s.tokens for s in streams]


# -- the run -------------------------------------------------------------------------------------


def write_adapters(base: Path, n: int, directory: Path, std: float | None) -> list[Path]:
    from llama_grpc_testkit import synth_lora

    paths = []
    for seed in range(n):
        path = directory / f"{base.stem}-lora-r{RANK}-seed{seed}.gguf"
        synth_lora.write_lora(
            base, path, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=seed, std=std
        )
        paths.append(path)
    return paths


def llama_server_cmd(
    binary: str, model: Path, port: int, *, slots: int, threads: int, adapters: Sequence[Path]
) -> list[str]:
    """llama-server with llama-grpc's KV layout and batch sizes, /metrics on, every adapter
    loaded (applied only where a request names it)."""
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(N_CTX), "-np", str(slots), "-kvu", "--no-webui", "--cache-ram", "0"]
    cmd += ["-t", str(threads), "-tb", str(threads), "-b", str(N_BATCH), "-ub", str(N_UBATCH)]
    cmd += ["--fit", "off", "--metrics", "--log-disable"]
    for path in adapters:
        cmd += ["--lora", str(path)]
    return [*cmd, "--lora-init-without-apply"]


def grpc_server_args(model: Path, slots: int, threads: int, adapters: Sequence[Path]) -> list[str]:
    """llama-grpc's options: the same slots, context, batch sizes and threads, no prompt cache
    (nor its RAM tier), adapter i as `a<i>`."""
    from common import server_args

    args = server_args(threads, "--model", str(model), "--n-parallel", str(slots))
    args += ["--n-ctx", str(N_CTX), "--n-batch", str(N_BATCH), "--n-ubatch", str(N_UBATCH)]
    args += ["--no-cache-prompt", "--prompt-cache-ram-mb", "0"]
    for i, path in enumerate(adapters):
        args += ["--lora", f"{adapter_name(i)}={path}"]
    return args


async def drive(
    args: argparse.Namespace,
    systems: dict[str, Any],
    prompt_stub: Any,
    configs: Sequence[str],
) -> dict[str, Any]:
    from common import progress, prompt_of

    prompts = [
        await prompt_of(prompt_stub, PROMPT_TOKENS, PROMPT_SEED + i)
        for i in range(max(args.streams))
    ]
    for name, system in systems.items():  # warm-up: every adapter set's first passes
        for config in configs:
            await measure(system, prompts, CONFIGS[config], 4)
        progress(f"{name} warmed up")
    runs: list[dict[str, Any]] = []
    tokens: dict[tuple[str, int, str], list[list[int]]] = {}
    order = run_order(args.reps, args.streams, configs, list(systems))
    for i, run in enumerate(order):
        record, ids = await measure(
            systems[run.system], prompts[: run.streams], CONFIGS[run.config], args.gen
        )
        record.update(
            rep=run.rep,
            streams=run.streams,
            config=run.config,
            system=run.system,
            load_1m=os.getloadavg()[0],
        )
        runs.append(record)
        if run.rep == 0:
            tokens[(run.system, run.streams, run.config)] = ids
        short = (
            ""
            if record["tokens"] == record["expected_tokens"]
            else f" ({record['tokens']} of {record['expected_tokens']} tokens!)"
        )
        progress(
            f"[{i + 1}/{len(order)}] rep {run.rep} S={run.streams} {run.config:<5} "
            f"{run.system:<12} {record['tok_s']:6.1f} tok/s  cpu "
            f"{1000 * record['cpu_s_per_token']:5.1f} ms/tok  passes {record['passes']:.0f}"
            f"  finish ratio {record['fairness']['finish_ratio']:.2f}{short}  "
            f"load {record['load_1m']:.2f}"
        )
    return {
        "runs": runs,
        "checks": token_checks(tokens),
        "prompt_tokens": [len(p) for p in prompts],
    }


def run(args: argparse.Namespace, configs: Sequence[str]) -> dict[str, Any]:
    from common import free_port, llama_grpc_process, progress
    from peers import llama_server_binary, wait_http

    from llama_grpc_server.models import assemble, trained

    model = Path(args.model) if args.model else assemble.fetch(trained.QWEN_CODER_05B)
    binary = llama_server_binary() if "llama-server" in args.systems else None
    if "llama-server" in args.systems and binary is None:
        raise SystemExit(
            "no llama-server: set $LLAMA_SERVER_BINARY or run bench/build_llama_server.sh"
        )
    n_adapters = max(CONFIGS[c] for c in configs)
    slots = max(args.streams)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        t = time.perf_counter()
        adapters = write_adapters(model, n_adapters, Path(tmp), args.std)
        progress(f"wrote {n_adapters} adapters in {time.perf_counter() - t:.1f}s")
        out: dict[str, Any] = {
            "model": {"path": str(model), "bytes": model.stat().st_size},
            "adapters": [
                {"name": adapter_name(i), "seed": i, "bytes": p.stat().st_size}
                for i, p in enumerate(adapters)
            ],
            "llama_server": binary,
        }
        with contextlib.ExitStack() as stack:
            systems: dict[str, Any] = {}
            progress("starting llama-grpc")
            # it also tokenizes the prompts, so it runs even when only llama-server is measured
            target, proc = stack.enter_context(
                llama_grpc_process(
                    *grpc_server_args(model, slots, args.threads, adapters), timeout_s=300
                )
            )
            if "llama-grpc" in args.systems:
                systems["llama-grpc"] = GrpcSystem(None, proc.pid)  # its stub: in the loop
            if binary is not None:
                progress(f"starting llama-server ({binary})")
                port = free_port()
                cmd = llama_server_cmd(
                    binary, model, port, slots=slots, threads=args.threads, adapters=adapters
                )
                out["llama_server_cmd"] = cmd
                server = stack.enter_context(_process(cmd))
                wait_http(port, "/health", server, 300)
                if server.stderr is not None:
                    server.stderr.close()
                zeros = [{"id": i, "scale": 0.0} for i in range(n_adapters)]
                _http_post(port, "/lora-adapters", json.dumps(zeros).encode())
                out["llama_server_adapters"] = json.loads(_http_get(port, "/lora-adapters"))
                systems["llama-server"] = ServerSystem(port, server.pid, n_adapters)
            out["llama_grpc_args"] = grpc_server_args(model, slots, args.threads, adapters)
            result = asyncio.run(_drive_in_loop(args, systems, target, configs))
        out.update(result)
    out["summary"] = summarize(out["runs"], configs)
    return out


async def _drive_in_loop(
    args: argparse.Namespace, systems: dict[str, Any], target: str, configs: Sequence[str]
) -> dict[str, Any]:
    """The aio channel must live in the loop that uses it: llama-grpc's stub is made here."""
    import grpc

    from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        if "llama-grpc" in systems:
            systems["llama-grpc"].stub = stub
        return await drive(args, systems, stub, configs)


@contextlib.contextmanager
def _process(cmd: list[str]) -> Any:
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- output --------------------------------------------------------------------------------------


def plot(rows: Sequence[Mapping[str, Any]], name: str, title: str) -> None:
    from common import pyplot, save_figure

    plt = pyplot()
    streams = sorted({r["streams"] for r in rows})
    fig, axes = plt.subplots(
        2,
        len(streams),
        figsize=(max(7.0, 5.5 * len(streams)), 7.5),
        squeeze=False,
        gridspec_kw={"height_ratios": [2.2, 1]},
    )
    width = 0.38
    for col, s in enumerate(streams):
        mine = [r for r in rows if r["streams"] == s]
        top, bottom = axes[0][col], axes[1][col]
        systems = [x for x in SYSTEMS if any(x in r for r in mine)]
        for k, system in enumerate(systems):
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(mine))]
            cells = [r.get(system) for r in mine]
            med = [c["tok_s"]["median"] if c else 0.0 for c in cells]
            err = [
                [m - c["tok_s"]["min"] if c else 0.0 for m, c in zip(med, cells, strict=True)],
                [c["tok_s"]["max"] - m if c else 0.0 for m, c in zip(med, cells, strict=True)],
            ]
            top.bar(xs, med, width, yerr=err, capsize=3, label=system, color=f"C{k}")
            for x, c in zip(xs, cells, strict=True):
                ratio = (c or {}).get("ratio_to_base")
                if c and ratio:
                    top.annotate(
                        f"{ratio['median']:.2f}",
                        (x, c["tok_s"]["max"]),
                        textcoords="offset points",
                        xytext=(0, 3),
                        ha="center",
                        fontsize=7,
                    )
            cpu = [c["cpu_ms_per_token"]["median"] if c else 0.0 for c in cells]
            bottom.bar(xs, cpu, width, label=system, color=f"C{k}")
        labels = []
        for r in mine:
            pair = r.get("grpc_over_server")
            labels.append(f"{r['config']}\n{pair['median']:.2f}x" if pair else r["config"])
        for ax in (top, bottom):
            ax.set_xticks(range(len(mine)), labels if ax is top else [r["config"] for r in mine])
            ax.grid(alpha=0.3, axis="y")
        top.set_title(
            f"S = {s} streams (label: llama-grpc / llama-server; bar: x base)", fontsize=9
        )
        top.set_ylabel("total output tok/s (median, min-max)")
        bottom.set_ylabel("server CPU ms per output token")
        top.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, name)


def report(rows: Sequence[Mapping[str, Any]]) -> None:
    for r in rows:
        parts = []
        for system in SYSTEMS:
            c = r.get(system)
            if not c:
                continue
            base = c.get("ratio_to_base")
            extra = ""
            if system == "llama-grpc":
                extra = (
                    f", {c['tokens_per_pass']['median']:.2f} tok/pass, "
                    f"{c['adapter_switches']['median']:.0f} switches"
                )
            parts.append(
                f"{system} {c['tok_s']['median']:6.1f} tok/s (x{base['median']:.2f} base"
                if base
                else f"{system} {c['tok_s']['median']:6.1f} tok/s ("
            )
            parts[-1] += (
                f", spread {c['tok_s']['rel_spread']:.0%}, "
                f"{c['cpu_ms_per_token']['median']:.1f} CPU ms/tok, "
                f"{c['passes']['median']:.0f} passes, finish ratio "
                f"{c['finish_ratio']['median']:.2f}{extra})"
            )
        pair = r.get("grpc_over_server")
        tail = f"  grpc/server {pair['median']:.2f}" if pair else ""
        print(f"S={r['streams']} {r['config']:<5} " + "  |  ".join(parts) + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="4,8", help="concurrent streams S, comma-separated")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"of {', '.join(CONFIGS)} (base is every ratio's reference)",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gen", type=int, default=GEN_TOKENS, help="tokens per stream")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per server")
    parser.add_argument(
        "--std", type=float, default=ADAPTER_STD, help="of the adapters' A and B elements"
    )
    parser.add_argument("--model", default="", help="a GGUF (default: the catalog's Qwen 0.5B)")
    parser.add_argument("--out", default="", help="results name (default lora, lora_quick)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check of the script: S=4, 1 rep, 16 tokens (lora_quick.*)",
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.reps, args.gen = "4", 1, 16
    args.streams = [int(s) for s in str(args.streams).split(",") if s]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "base" not in configs:
        raise SystemExit(f"--configs: need base, and only of {', '.join(CONFIGS)} ({unknown})")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(args.systems) - set(SYSTEMS):
        raise SystemExit(f"--systems: of {', '.join(SYSTEMS)}")
    name = args.out or ("lora_quick" if args.quick else "lora")

    from common import finish_facts, machine_facts, write_json
    from peers import peer_facts

    facts = machine_facts(args.threads) | peer_facts()  # the load average before the run
    t0 = time.perf_counter()
    result = run(args, configs)
    data = {
        "benchmark": "lora",
        "command": "python bench/lora.py " + " ".join(sys.argv[1:]),
        "settings": {
            "streams": args.streams,
            "configs": {c: CONFIGS[c] for c in configs},
            "systems": args.systems,
            "reps": args.reps,
            "prompt_tokens": PROMPT_TOKENS,
            "gen_tokens": args.gen,
            "threads": args.threads,
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "n_ubatch": N_UBATCH,
            "adapter": {"rank": RANK, "alpha": ALPHA, "targets": list(TARGETS), "std": args.std},
            "ignore_eos": True,
            "temperature": 0.0,
            "prompt_cache": False,
        },
        "machine": facts,
        "duration_s": time.perf_counter() - t0,
        **result,
    }
    write_json(name, finish_facts(data))
    model = Path(result["model"]["path"]).name
    plot(
        result["summary"],
        name,
        f"LoRA adapters interleaved, {model}:\n{args.gen} greedy tokens per stream after "
        f"{PROMPT_TOKENS}-token prompts, {args.threads} thread(s), median of {args.reps}",
    )
    report(result["summary"])
    print(f"checks: {json.dumps(result['checks'])}")
    m = data["machine"]
    print(
        f"load average {m['load_average_at_start'][0]:.2f} at start, "
        f"{m['load_average_at_end'][0]:.2f} at end; {data['duration_s']:.0f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
