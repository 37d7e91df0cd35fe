"""Does a stream on one model keep going while another model loads? (issue 15: "loading never
blocks other models' streams")

One in-process server (the e2e tests' kind: grpc.aio on loopback, an AsyncClient) serves the
embedded Gemma 3 270M (Q4_K_M, the default) and the same model re-quantized to Q8_0, both may be
resident. Per load: a greedy stream runs on the default model; once it is in its stride,
LoadModel(q8) loads the other (file, context, vocabulary tables, warm-up decode: what the
server's load_seconds covers); the stream goes on for another second, then q8 is unloaded. It
reports, for the load's window: the deltas and tokens that arrived, the longest time without a
delta, the stream's pace before and after, the default engine's forward passes (wall and
engine-thread CPU ms), and per thread kind the CPU and run-queue wait (schedstat).

Variants (each a fresh process, interleaved by repetition):
  stall     the engines keep their threads during a load (engine/cpu_share.py turned off)
  fix       the engines leave each load a core (cpu_share, the server's behaviour)
  passive   like stall, with OMP_WAIT_POLICY=passive (OpenMP threads sleep at once at a barrier)
  spin10k   like stall, with GOMP_SPINCOUNT=10000 (spin 1/30 of libgomp's default, then sleep)
  norepack  like stall, q8 loaded without the CPU repack buffers (use_extra_bufts=False)
  threads1  like stall, with --threads 1 (no OpenMP team at all)

    python bench/load_stall.py --reps 3     # writes bench/results/load_stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import machine_facts, progress, spread, write_json

from llama_grpc_testkit.models import second_model_file

VARIANTS = ("stall", "fix", "passive", "spin10k", "norepack", "threads1")
ENV = {"passive": {"OMP_WAIT_POLICY": "passive"}, "spin10k": {"GOMP_SPINCOUNT": "10000"}}
Q8 = "q8"
PROMPT = "Write a long story about a lighthouse keeper and a storm."
AFTER_S = 1.0  # how long the stream goes on after the load
BEFORE_S = 1.0  # the stream's pace is measured over this long before the load


# -- the child: one server, a few loads --------------------------------------------------------


class Marks:
    """Timestamps (time.monotonic) of llama.cpp calls made by the loads, recorded by wrapping
    llama_cpp's functions (the engine calls them through the module)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float]] = []  # (time, what, thread CPU s so far)
        self._lock = threading.Lock()
        self.loader_tids: set[int] = set()  # the threads that ran llama_model_load_from_file
        self.no_repack = False  # load without the CPU repack buffers (use_extra_bufts=False)

    def add(self, what: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), what, time.thread_time()))

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        def wrapped(*args: Any) -> Any:
            if self.no_repack and name == "llama_model_load_from_file":
                args[1].use_extra_bufts = False
            if name == "llama_model_load_from_file":
                self.loader_tids.add(threading.get_native_id())
            self.add(f"{name}:start")
            try:
                return inner(*args)
            finally:
                self.add(f"{name}:end")

        setattr(module, name, wrapped)


def schedstat() -> dict[int, tuple[str, int, int]]:
    """tid -> (name, CPU ns, run-queue wait ns) for this process's threads."""
    out = {}
    for entry in Path("/proc/self/task").iterdir():
        try:
            name = (entry / "comm").read_text().strip()
            cpu, wait, _ = (int(x) for x in (entry / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = (name, cpu, wait)
    return out


def busy_cpu_s() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, this process's CPU seconds): their
    deltas over a load tell what other processes took meanwhile (the box is shared)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (sum(ticks[:8]) - idle) / hz, own.user + own.system


def sched_delta(
    before: dict[int, tuple[str, int, int]],
    after: dict[int, tuple[str, int, int]],
    loaders: set[int],
) -> dict[str, dict[str, float]]:
    """CPU and run-queue wait seconds per thread name between two readings."""
    out: dict[str, dict[str, float]] = {}
    for tid, (name, cpu, wait) in after.items():
        _, cpu0, wait0 = before.get(tid, (name, 0, 0))
        kind = "loader" if tid in loaders else name
        row = out.setdefault(kind, {"cpu_s": 0.0, "runqueue_wait_s": 0.0, "threads": 0})
        row["cpu_s"] += (cpu - cpu0) / 1e9
        row["runqueue_wait_s"] += (wait - wait0) / 1e9
        row["threads"] += 1
    return {k: {m: round(v, 4) for m, v in row.items()} for k, row in sorted(out.items())}


def window_stats(arrivals: list[tuple[float, int]], t0: float, t1: float) -> dict[str, Any]:
    """What the stream did during [t0, t1] (the load) and around it."""
    times = [t for t, _ in arrivals]
    during = [(t, n) for t, n in arrivals if t0 <= t <= t1]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > t0 and a < t1]
    before = [(t, n) for t, n in arrivals if t0 - BEFORE_S <= t < t0]
    after = [(t, n) for t, n in arrivals if t1 < t <= t1 + AFTER_S]
    before_gaps = [b[0] - a[0] for a, b in itertools.pairwise(before)]
    return {
        "deltas_during_load": len(during),
        "tokens_during_load": sum(n for _, n in during),
        "longest_gap_during_load_s": max(gaps, default=t1 - t0),
        "median_gap_before_s": statistics.median(before_gaps) if before_gaps else None,
        "tok_s_before": sum(n for _, n in before) / BEFORE_S,
        "tok_s_during": sum(n for _, n in during) / (t1 - t0),
        "tok_s_after": sum(n for _, n in after) / AFTER_S,
    }


async def child(variant: str, loads: int, lead_s: float) -> dict[str, Any]:
    import llama_cpp
    from tests.e2e.conftest import settings

    from llama_grpc import AsyncClient, Delta
    from llama_grpc_server.config import PoolSettings
    from llama_grpc_server.core.scheduling.plan import StepPlan, StepResult
    from llama_grpc_server.core.scheduling.scheduler import Scheduler
    from llama_grpc_server.engine import build as build_module
    from llama_grpc_server.engine import cpu_share
    from llama_grpc_server.engine.build import build_engine
    from llama_grpc_server.engine.llama import LlamaModel
    from llama_grpc_server.models.pool import ModelSpec, model_specs, settings_for
    from llama_grpc_server.rpc.plumbing.server import start_server

    cpu_share.SHARE.enabled = variant == "fix"
    marks = Marks()
    for name in ("llama_model_load_from_file", "llama_init_from_model", "llama_model_free"):
        marks.wrap(llama_cpp, name)
    marks.wrap(LlamaModel, "_piece_table")  # the vocabulary tables (Python, holding the GIL)
    marks.wrap(LlamaModel, "set_threads")  # cpu_share changing an engine's threads
    marks.wrap(build_module, "warm_up")  # on the new engine's thread, after LoadModel returned
    conf = settings(n_parallel=2, max_queue=16, n_ctx=4096)
    threads = 1 if variant == "threads1" else 0  # 0: one per CPU, the server's default
    conf = replace(
        conf,
        model=replace(conf.model, n_threads=threads, n_threads_batch=threads),
        pool=PoolSettings(models=((Q8, str(second_model_file())),), max_loaded_models=2),
    )
    ticks: list[tuple[float, float, float, int]] = []  # (end, eval ms, eval CPU ms, tokens)

    def on_tick(plan: StepPlan, result: StepResult, _: Scheduler) -> None:
        n = sum(len(c.tokens) for c in plan.chunks)
        ticks.append((time.monotonic(), result.eval_ms, result.eval_cpu_ms, n))

    def build(spec: ModelSpec) -> Any:
        is_default = spec.name == default.name
        engine = build_engine(settings_for(conf, spec), on_tick=on_tick if is_default else None)
        marks.add("engine_built")
        return engine

    default = model_specs(conf)[0]
    runs: list[dict[str, Any]] = []
    async with start_server(conf, lambda: build(default), model_factory=build) as running:
        assert await running.wait_loaded()
        if variant == "norepack":  # only q8's loads: the default model keeps its repacking
            marks.no_repack = True
        async with AsyncClient(f"127.0.0.1:{running.port}", timeout=600) as client:
            started = time.monotonic()
            status = await client.load_model(Q8)  # alone: nothing streams
            alone = {"wall_s": time.monotonic() - started, "server_s": status.load_seconds}
            await client.unload_model(Q8)
            for _ in range(loads):
                runs.append(await one_load(client, Delta, marks, ticks, lead_s))
    return {"variant": variant, "load_alone": alone, "loads": runs}


async def one_load(
    client: Any, delta_type: type, marks: Marks, ticks: list[Any], lead_s: float
) -> dict[str, Any]:
    arrivals: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def stream() -> None:
        async with client.stream(
            PROMPT, max_tokens=3500, ignore_eos=True, temperature=0.0, cache_prompt=False,
            cache_response=False,
        ) as events:  # fmt: skip
            async for event in events:
                if isinstance(event, delta_type):
                    arrivals.append((time.monotonic(), len(event.token_ids)))
                if stop.is_set():
                    return

    task = asyncio.create_task(stream())
    while not arrivals:
        await asyncio.sleep(0.005)
    await asyncio.sleep(lead_s)
    n_marks, n_ticks = len(marks.events), len(ticks)
    sched0, cpu0 = schedstat(), busy_cpu_s()
    t0 = time.monotonic()
    status = await client.load_model(Q8)
    t1 = time.monotonic()
    rpc_s = t1 - t0
    sched1, cpu1 = schedstat(), busy_cpu_s()
    await asyncio.sleep(AFTER_S)
    stop.set()
    await asyncio.wait_for(task, 60)
    await client.unload_model(Q8)
    # The load's window ends when the new engine's warm-up decode has (its thread runs it
    # after LoadModel returned).
    warmed = [t for t, what, _ in marks.events[n_marks:] if what == "warm_up:end"]
    t1 = max([t1, *warmed])
    passes = [(t, ms, cpu, n) for t, ms, cpu, n in ticks[n_ticks:] if t0 <= t <= t1 and n == 1]
    eval_ms = [ms for _, ms, _, _ in passes]
    return {
        "load_s": t1 - t0,
        "rpc_s": rpc_s,
        "server_load_s": status.load_seconds,
        "other_processes_cpu_s": round((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 3),
        **window_stats(arrivals, t0, t1),
        "decode_passes_during_load": len(passes),
        "decode_ms_during_load": spread(eval_ms) if eval_ms else None,
        "decode_cpu_ms_during_load": (spread([cpu for _, _, cpu, _ in passes]) if passes else None),
        "phases_s": [
            (round(t - t0, 4), what, round(cpu, 4))
            for t, what, cpu in marks.events[n_marks:]
            if t0 <= t <= t1
        ],
        "threads": sched_delta(sched0, sched1, marks.loader_tids),
        "arrivals_s": [(round(t - t0, 4), n) for t, n in arrivals if t0 - 0.3 <= t <= t1 + 0.3],
    }


# -- the parent: interleaved variants ---------------------------------------------------------


def run_child(variant: str, loads: int, lead_s: float) -> dict[str, Any]:
    env = {**os.environ, **ENV.get(variant, {})}
    cmd = [sys.executable, __file__, "--child", variant, "--loads", str(loads)]
    cmd += ["--lead-s", str(lead_s)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    loads = [run for result in results for run in result["loads"]]
    keys = (
        "load_s", "server_load_s", "deltas_during_load", "tokens_during_load",
        "longest_gap_during_load_s", "tok_s_before", "tok_s_during", "tok_s_after",
    )  # fmt: skip
    out: dict[str, Any] = {k: spread([float(run[k]) for run in loads]) for k in keys}
    out["load_alone_s"] = spread([r["load_alone"]["wall_s"] for r in results])
    out["gap_over_load"] = spread([r["longest_gap_during_load_s"] / r["load_s"] for r in loads])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="processes per variant")
    parser.add_argument("--loads", type=int, default=2, help="measured loads per process")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="load_stall")
    parser.add_argument(
        "--lead-s", type=float, default=BEFORE_S, help="stream this long before the load"
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.loads, args.lead_s))))
        return 0
    variants = args.variants.split(",")
    facts = machine_facts(None)
    second_model_file()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for variant in order:
            result = run_child(variant, args.loads, args.lead_s)
            results[variant].append(result)
            for run in result["loads"]:
                progress(
                    f"rep {rep} {variant}: load {run['load_s']:.2f} s, "
                    f"{run['deltas_during_load']} deltas ({run['tokens_during_load']} tokens) "
                    f"during it, longest gap {run['longest_gap_during_load_s']:.3f} s, "
                    f"tok/s before {run['tok_s_before']:.1f} during {run['tok_s_during']:.1f}; "
                    f"other processes {run['other_processes_cpu_s']:.2f} CPU s"
                )
    data = {
        "benchmark": "load_stall",
        "command": "python bench/load_stall.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "machine": facts,
        "summary": {v: aggregate(results[v]) for v in variants},
        "runs": results,
    }
    data["machine"]["load_average_at_end"] = list(os.getloadavg())
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
