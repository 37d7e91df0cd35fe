"""Per-token overhead: where the CPU goes for each streamed token, next to the efficiency ratio.

The workload and the interleaving are concurrency.py's (B concurrent GenerateTokens streams,
41-token prompts, 64 greedy tokens, the raw in-process llama.cpp loop alternating with
llama-grpc within every repetition). For each llama-grpc run it also reads:

- the server's CPU time per thread (/proc/PID/task/*/schedstat, nanoseconds), split into
  * decode: llama.cpp's helper threads ("llama-decode", all of their time, their spinning
    between passes included) plus the engine thread's own CPU time inside llama_decode
    (GetStats decode_cpu_seconds, measured with the thread's CPU clock around the call);
  * outside decode, per thread: the engine thread's remainder (scheduling, sampling, text,
    stats, delivery), the asyncio event loop (the main thread: servicer, interceptor, protobuf,
    grpc's Python and Cython send path) and grpc's C-core threads (everything else);
- the benchmark client's own CPU time (this process, time.process_time; the raw loop is idle
  then, after a settle pause that lets its helper threads stop spinning);
- forward passes and tokens from GetStats (tokens per forward pass does not move with noise);
- the engine thread's CPU outside llama_decode per forward pass (engine_us_per_tick: what one
  tick of schedule, update, stats and delivery costs, whatever the tokens per pass).

Everything is divided by the tokens streamed in the run and reported as µs per token: the
median and spread over the repetitions, with the load average at start and end. Optionally
(--profile-seconds) a py-spy recording of the server under the largest B is saved to
bench/results/overhead_profile_b{B}.svg (flame graph) and .txt (collapsed stacks), and its top
costs outside llama_decode are summarized in the JSON.

    make bench-overhead               # or: python bench/overhead.py --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    finish_facts,
    llama_grpc_process,
    machine_facts,
    progress,
    pyplot,
    save_figure,
    server_args,
    spread,
    write_json,
)
from concurrency import add_workload_args, grpc_run, make_prompts
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.engine.thread_names import DECODE_THREAD_NAME, ENGINE_THREAD_NAME
from llama_grpc_server.models.files import default_model_path

PROFILE_RATE_HZ = 50  # py-spy --native pauses the process per sample: keep the rate low
IDLE_FRAMES = ("epoll_wait", "pthread_cond_wait", "pthread_cond_timedwait", "__futex_abstimed_wait",
               "poll (", "select (", "sem_wait", "nanosleep")  # fmt: skip
SETTLE_S = 0.25  # before each measured run: llama.cpp's helper threads stop spinning
PARTS = ("engine", "event_loop", "grpc_threads")


def thread_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (name, CPU nanoseconds) for every thread of `pid` (Linux schedstat)."""
    out: dict[int, tuple[str, int]] = {}
    task = Path(f"/proc/{pid}/task")
    for entry in task.iterdir():
        try:
            name = (entry / "comm").read_text().strip()
            cpu_ns = int((entry / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        out[int(entry.name)] = (name, cpu_ns)
    return out


def split_cpu(
    pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]
) -> dict[str, float]:
    """Seconds of CPU per thread class between two thread_cpu() readings."""
    out = dict.fromkeys(("decode_helpers", "engine_total", "event_loop", "grpc_threads"), 0.0)
    for tid, (name, cpu_ns) in after.items():
        seconds = (cpu_ns - before.get(tid, (name, 0))[1]) / 1e9
        if name == DECODE_THREAD_NAME:
            out["decode_helpers"] += seconds
        elif name == ENGINE_THREAD_NAME:
            out["engine_total"] += seconds
        elif tid == pid:
            out["event_loop"] += seconds
        else:
            out["grpc_threads"] += seconds
    return out


async def stats(stub: Any) -> Any:
    return await stub.GetStats(pb.GetStatsRequest())


async def measured_grpc_run(
    stub: Any, pid: int, prompts: list[list[int]], gen: int
) -> tuple[float, dict[str, float]]:
    """One llama-grpc run: wall seconds and CPU µs per streamed token by part."""
    await asyncio.sleep(SETTLE_S)
    s0 = await stats(stub)
    t0, c0 = thread_cpu(pid), time.process_time()
    seconds, n = await grpc_run(stub, prompts, gen)
    t1, c1 = thread_cpu(pid), time.process_time()
    s1 = await stats(stub)
    if n != len(prompts) * gen or s1.generated_tokens - s0.generated_tokens != n:
        raise RuntimeError(f"expected {len(prompts) * gen} tokens, got {n}")
    cpu = split_cpu(pid, t0, t1)
    engine_in_decode = s1.decode_cpu_seconds - s0.decode_cpu_seconds
    parts = {
        "decode": cpu["decode_helpers"] + engine_in_decode,
        "engine": cpu["engine_total"] - engine_in_decode,
        "event_loop": cpu["event_loop"],
        "grpc_threads": cpu["grpc_threads"],
    }
    us = {k: v / n * 1e6 for k, v in parts.items()}
    us["server_outside_decode"] = sum(us[k] for k in PARTS)
    us["client"] = (c1 - c0) / n * 1e6
    us["forward_passes"] = s1.ticks - s0.ticks
    us["tokens_per_forward_pass"] = n / max(1, s1.ticks - s0.ticks)
    us["engine_us_per_tick"] = parts["engine"] / max(1, s1.ticks - s0.ticks) * 1e6
    us["decode_wall_s"] = s1.decode_seconds - s0.decode_seconds
    return seconds, us


async def measure(
    raw: RawLoop, target: str, pid: int, *, batches: list[int], reps: int, gen: int
) -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        for b in (1, max(batches)):  # warm-up both paths, small and large
            raw.run(make_prompts(raw, b, 999), 8)
            await grpc_run(stub, make_prompts(raw, b, 998), 8)
        progress("warm-up done")
        for b in batches:
            raw_t: list[float] = []
            grpc_t: list[float] = []
            per_token: list[dict[str, float]] = []
            raw_cpu: list[float] = []  # the raw loop's CPU µs per token (both its threads)
            for rep in range(reps):
                prompts = make_prompts(raw, b, rep)
                order = ("raw", "grpc") if rep % 2 == 0 else ("grpc", "raw")
                for which in order:
                    if which == "raw":
                        await asyncio.sleep(SETTLE_S)
                        c0 = time.process_time()
                        raw_t.append(raw.run(prompts, gen))
                        raw_cpu.append((time.process_time() - c0) / (b * gen) * 1e6)
                    else:
                        seconds, us = await measured_grpc_run(stub, pid, prompts, gen)
                        grpc_t.append(seconds)
                        per_token.append(us)
                us = per_token[-1]
                progress(
                    f"B={b:>2} rep {rep + 1}/{reps}: efficiency {raw_t[-1] / grpc_t[-1]:.3f}  "
                    f"server outside decode {us['server_outside_decode']:.0f} µs/token "
                    f"(engine {us['engine']:.0f}, event loop {us['event_loop']:.0f}, grpc "
                    f"threads {us['grpc_threads']:.0f})  client {us['client']:.0f} µs/token  "
                    f"decode {us['decode']:.0f} vs raw loop {raw_cpu[-1]:.0f} µs/token  "
                    f"engine {us['engine_us_per_tick']:.0f} µs/tick"
                )
            rows.append(row(b, gen, raw_t, grpc_t, per_token))
            rows[-1]["raw_cpu_us_per_token"] = spread(raw_cpu)
    return rows


def row(
    b: int, gen: int, raw_t: list[float], grpc_t: list[float], per_token: list[dict[str, float]]
) -> dict[str, Any]:
    raw_m, grpc_m = statistics.median(raw_t), statistics.median(grpc_t)
    keys = [*PARTS, "server_outside_decode", "decode", "client", "tokens_per_forward_pass"]
    keys.append("engine_us_per_tick")  # µs per forward pass, not per token
    return {
        "batch": b,
        "raw_s": spread(raw_t),
        "llama_grpc_s": spread(grpc_t),
        "efficiency": raw_m / grpc_m,
        "efficiency_per_rep": [r / g for r, g in zip(raw_t, grpc_t, strict=True)],
        "us_per_token": {k: spread([u[k] for u in per_token]) for k in keys},
        "per_rep": per_token,
        "tokens_per_run": b * gen,
    }


# -- py-spy --------------------------------------------------------------------------------------


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: make bench-overhead installs it (--group bench)")
    return found


async def load_for(stub: Any, raw: RawLoop, b: int, gen: int, seconds: float) -> int:
    """Keep B streams busy for `seconds`; returns the tokens streamed."""
    t_end, tokens, rep = time.monotonic() + seconds, 0, 0
    while time.monotonic() < t_end:
        _, n = await grpc_run(stub, make_prompts(raw, b, 500 + rep), gen)
        tokens, rep = tokens + n, rep + 1
    return tokens


async def profile(
    raw: RawLoop, target: str, pid: int, *, b: int, gen: int, seconds: float
) -> dict[str, Any]:
    """py-spy under B streams, with native frames (llama.cpp, grpc's C core and Cython): a
    flame graph and the collapsed stacks. Sampling pauses the server briefly, so the tokens
    streamed meanwhile are recorded next to the measured rate. Returns the top costs outside
    llama_decode."""
    name = f"overhead_profile_b{b}"
    svg, collapsed = RESULTS / f"{name}.svg", RESULTS / f"{name}.txt"
    out: dict[str, Any] = {"batch": b, "seconds": seconds, "files": [svg.name, collapsed.name]}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        for fmt, path in (("flamegraph", svg), ("raw", collapsed)):
            argv = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                    "--rate", str(PROFILE_RATE_HZ), "--native", "--threads", "--format", fmt,
                    "--output", str(path)]  # fmt: skip
            spy = await asyncio.create_subprocess_exec(
                *argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            out[f"tokens_during_{fmt}"] = await load_for(stub, raw, b, gen, seconds + 1)
            await spy.wait()
    out.update(top_costs(collapsed))
    return out


def top_costs(collapsed: Path, limit: int = 25) -> dict[str, Any]:
    """Busy samples per thread (in llama_decode or not), and the functions with the most busy
    samples (inclusive) outside llama_decode, from py-spy's collapsed stacks ("thread;frame;...
    count" lines). A sample whose innermost frame is a wait (epoll_wait, a condition...) is idle."""
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    functions: collections.Counter[str] = collections.Counter()
    modules: collections.Counter[str] = collections.Counter()
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        thread = frames[0].split(": ", 1)[-1]
        if frames[-1].startswith(IDLE_FRAMES):
            threads[thread]["idle"] += n
            continue
        if any(f.startswith("llama_decode ") for f in frames):
            threads[thread]["in_llama_decode"] += n
            continue
        threads[thread]["busy_outside_llama_decode"] += n
        modules[f"{thread}: {module_of(frames[-1])}"] += n
        for frame in set(frames[1:]):
            functions[frame] += n
    return {
        "samples_by_thread": {name: dict(c) for name, c in threads.items()},
        "self_samples_outside_llama_decode_by_thread_and_module": modules.most_common(limit),
        "top_functions_outside_llama_decode": functions.most_common(limit),
    }


def module_of(frame: str) -> str:
    """'func (path/file.py:12)' -> 'path/file.py'; '0x7f.. (lib.so)' -> 'lib.so'."""
    where = frame.rpartition(" (")[2].rstrip(")")
    return where.rsplit(":", 1)[0] if where.endswith(tuple("0123456789")) else where


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, "1,8,16")
    parser.add_argument("--profile-seconds", type=float, default=0.0, help="0: no py-spy run")
    parser.add_argument("--name", default="overhead", help="results file name (without .json)")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the server alone (repeatable)",
    )
    parser.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    n_par = max(batches)
    progress("loading the raw loop model")
    raw = RawLoop(str(default_model_path()), args.n_ctx, n_par, args.threads)
    extra = ["--n-parallel", str(n_par), "--n-ctx", str(args.n_ctx), *args.server_args]
    progress("starting llama-grpc")
    env = dict(item.split("=", 1) for item in args.server_env)
    with llama_grpc_process(*server_args(args.threads, *extra), env=env) as (target, proc):
        rows = asyncio.run(
            measure(raw, target, proc.pid, batches=batches, reps=args.reps, gen=args.gen_tokens)
        )
        spy = None
        if args.profile_seconds > 0:
            progress(f"py-spy: {args.profile_seconds:.0f} s at B={n_par}, twice")
            spy = asyncio.run(
                profile(
                    raw,
                    target,
                    proc.pid,
                    b=n_par,
                    gen=args.gen_tokens,
                    seconds=args.profile_seconds,
                )
            )
    raw.close()
    data = {
        "benchmark": "overhead",
        "command": "python bench/overhead.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt_tokens": 41, "generated_tokens": args.gen_tokens},
        "settings": vars(args),
        "machine": facts,
        "rows": rows,
        "profile": spy,
        "cpu_split": __doc__.split("\n\n")[1],
    }
    write_json(args.name, finish_facts(data))
    plot(rows, args.name)
    for r in rows:
        us = r["us_per_token"]
        print(
            f"B={r['batch']:>2}  efficiency {r['efficiency']:.3f}  server outside decode "
            f"{us['server_outside_decode']['median']:.0f} µs/token (engine "
            f"{us['engine']['median']:.0f}, event loop {us['event_loop']['median']:.0f}, grpc "
            f"threads {us['grpc_threads']['median']:.0f})  client {us['client']['median']:.0f}"
            f" µs/token  decode {us['decode']['median']:.0f} µs/token  engine "
            f"{us['engine_us_per_tick']['median']:.0f} µs/tick"
        )
    return 0


def plot(rows: list[dict[str, Any]], name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"B={r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    parts = [("engine", "engine thread"), ("event_loop", "event loop"),
             ("grpc_threads", "grpc threads"), ("client", "bench client")]  # fmt: skip
    for key, label in parts:
        values = [r["us_per_token"][key]["median"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(rows):
        ax.annotate(f"eff {r['efficiency']:.2f}", (i, bottom[i]), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=8)  # fmt: skip
    ax.set_ylabel("CPU µs per streamed token, outside llama_decode")
    ax.set_title("llama-grpc per-token CPU (medians) and efficiency vs the raw loop")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save_figure(fig, name)


if __name__ == "__main__":
    sys.exit(main())
