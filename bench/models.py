"""Multi-model serving: what loading, swapping and the response cache cost, and whether an idle
engine's threads cost anything. Two real models: the embedded Gemma 3 270M (Q4_K_M) and the same
model re-quantized to Q8_0 (built once and cached like the tests' second model).

- Cold load: LoadModel with nothing to unload (both unloaded first), wall time at the client and
  the server's own load_seconds (file -> engine warmed up with one decode).
- Swap: --max-loaded-models 1 with the other model resident and idle, a 1-token stream for this
  one: its time to first token (unload the other + load + prefill) next to the same request
  again once resident (warm).
- Response-cache hit: a greedy Generate, then the same request again (answered from
  --response-cache-mb without the engine), wall time at the client.
- Idle engine threads: --max-loaded-models 2, the second model loaded and idle while the default
  one generates: CPU seconds its engine thread and llama.cpp helper threads used per second of
  wall time (schedstat), next to the busy engine's; and the default model's tokens/s alone
  versus beside the idle engine (a second llama.cpp thread team in the process).

    python bench/models.py --reps 5        # writes bench/results/models.{json,png}
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    DEFAULT_THREADS,
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
from overhead import thread_cpu

from llama_grpc import Client, Delta
from llama_grpc_server.engine.thread_names import DECODE_THREAD_NAME, ENGINE_THREAD_NAME
from llama_grpc_server.models.files import default_model_path
from llama_grpc_testkit.models import second_model_file

SMALL, Q8 = "q4", "q8"
PROMPT = "Write a short story about a lighthouse keeper and a storm."


@contextlib.contextmanager
def two_model_server(threads: int, max_loaded: int, second: Path) -> Iterator[tuple[Client, int]]:
    """A server with both models (the Q4 one the default), yielding a client and its pid."""
    args = server_args(
        threads,
        "--model", f"{SMALL}={default_model_path()}", "--model", f"{Q8}={second}",
        "--max-loaded-models", str(max_loaded), "--response-cache-mb", "64",
        "--n-ctx", "2048", "--n-parallel", "2",
    )  # fmt: skip
    with llama_grpc_process(*args) as (target, proc), Client(target, timeout=600) as client:
        yield client, proc.pid


def first_token_s(client: Client, model: str, prompt: str = PROMPT) -> float:
    """Time to the first delta of a 1-token stream."""
    started = time.perf_counter()
    with client.stream(prompt, model=model, max_tokens=1, temperature=0.0) as stream:
        for event in stream:
            if isinstance(event, Delta):
                return time.perf_counter() - started
    raise RuntimeError("no token")


def measure_cold(client: Client, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in (SMALL, Q8):
        wall, server = [], []
        for _ in range(reps):
            for name in (SMALL, Q8):
                client.unload_model(name)
            started = time.perf_counter()
            status = client.load_model(model)
            wall.append(time.perf_counter() - started)
            server.append(status.load_seconds)
        out[model] = {
            "wall_s": spread(wall),
            "server_load_s": spread(server),
            "size_bytes": status.size_bytes,
        }
        progress(f"cold load {model}: {out[model]['wall_s']['median']:.2f} s")
    return out


def measure_swap(client: Client, reps: int) -> dict[str, Any]:
    """One resident model: the first token of the other (a swap), then again (warm)."""
    out: dict[str, Any] = {}
    for model, other in ((SMALL, Q8), (Q8, SMALL)):
        swap, warm = [], []
        for rep in range(reps):
            first_token_s(client, other, f"{PROMPT} ({rep})")
            swap.append(first_token_s(client, model, f"{PROMPT} [{rep}]"))
            warm.append(first_token_s(client, model, f"{PROMPT} <{rep}>"))
        out[model] = {"swap_ttft_s": spread(swap), "warm_ttft_s": spread(warm)}
        progress(f"swap to {model}: {out[model]['swap_ttft_s']['median']:.2f} s")
    return out


def measure_cache(client: Client, reps: int, gen_tokens: int) -> dict[str, Any]:
    miss, hit = [], []
    for rep in range(reps):
        prompt = f"{PROMPT} Chapter {rep}."
        started = time.perf_counter()
        first = client.generate(prompt, model=SMALL, max_tokens=gen_tokens, temperature=0.0)
        miss.append(time.perf_counter() - started)
        started = time.perf_counter()
        again = client.generate(prompt, model=SMALL, max_tokens=gen_tokens, temperature=0.0)
        hit.append(time.perf_counter() - started)
        if not again.usage.cached_response or again.text != first.text:
            raise RuntimeError("the repeated request was not answered from the response cache")
    out = {"miss_s": spread(miss), "hit_s": spread(hit), "gen_tokens": gen_tokens}
    progress(f"response cache: hit {out['hit_s']['median'] * 1e3:.2f} ms")
    return out


def engine_threads(pid: int, tids: set[int]) -> set[int]:
    """Those of `tids` that are engine or llama.cpp helper threads."""
    names = {DECODE_THREAD_NAME, ENGINE_THREAD_NAME}
    return {tid for tid, (name, _) in thread_cpu(pid).items() if tid in tids and name in names}


def new_threads(pid: int, before: set[int]) -> set[int]:
    """Threads started since `before`, but asyncio's worker threads (which ran the load)."""
    return {
        tid
        for tid, (name, _) in thread_cpu(pid).items()
        if tid not in before and not name.startswith("asyncio_")
    }


def cpu_s(pid: int, tids: set[int]) -> float:
    return sum(ns for tid, (_, ns) in thread_cpu(pid).items() if tid in tids) / 1e9


def generate_s(client: Client, gen_tokens: int) -> float:
    started = time.perf_counter()
    client.generate(
        PROMPT, model=SMALL, max_tokens=gen_tokens, ignore_eos=True, temperature=0.0,
        cache_response=False,
    )  # fmt: skip
    return time.perf_counter() - started


def measure_idle(client: Client, pid: int, gen_tokens: int, reps: int) -> dict[str, Any]:
    """--max-loaded-models 2. Per repetition: the default model generates alone, then again
    with the Q8 model loaded and idle beside it (its threads are those that appear when it
    loads); then Q8 is unloaded. Then the whole process's CPU for 3 s with both loaded, idle."""
    client.unload_model(Q8)
    busy_tids = engine_threads(pid, set(thread_cpu(pid)))
    alone, beside, idle_cpu, busy_cpu = [], [], [], []
    idle_tids: set[int] = set()
    for _ in range(reps):
        alone.append(generate_s(client, gen_tokens))
        before = set(thread_cpu(pid))
        client.load_model(Q8)
        first_token_s(client, Q8)  # warm, then idle
        idle_tids = new_threads(pid, before)
        time.sleep(0.5)
        idle0, busy0 = cpu_s(pid, idle_tids), cpu_s(pid, busy_tids)
        wall = generate_s(client, gen_tokens)
        beside.append(wall)
        idle_cpu.append((cpu_s(pid, idle_tids) - idle0) / wall)
        busy_cpu.append((cpu_s(pid, busy_tids) - busy0) / wall)
        client.unload_model(Q8)
    client.load_model(Q8)
    time.sleep(0.5)
    every = set(thread_cpu(pid))
    process0, started = cpu_s(pid, every), time.perf_counter()
    time.sleep(3.0)
    all_idle = (cpu_s(pid, every) - process0) / (time.perf_counter() - started)
    out = {
        "idle_threads": len(idle_tids),
        "busy_threads": len(busy_tids),
        "gen_tokens": gen_tokens,
        "alone_tok_s": spread([gen_tokens / s for s in alone]),
        "beside_idle_engine_tok_s": spread([gen_tokens / s for s in beside]),
        "other_generating": {
            "idle_engine_cpu_per_s": spread(idle_cpu),
            "busy_engine_cpu_per_s": spread(busy_cpu),
        },
        "all_idle_process_cpu_per_s": all_idle,
    }
    progress(
        f"idle engine: {out['other_generating']['idle_engine_cpu_per_s']['median']:.4f} CPU s/s; "
        f"tok/s alone {out['alone_tok_s']['median']:.1f}, beside an idle engine "
        f"{out['beside_idle_engine_tok_s']['median']:.1f}"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    second = second_model_file()
    with two_model_server(args.threads, 1, second) as (client, _):
        cold = measure_cold(client, args.reps)
        swap = measure_swap(client, args.reps)
        cache = measure_cache(client, args.reps, args.gen_tokens)
    with two_model_server(args.threads, 2, second) as (client, pid):
        idle = measure_idle(client, pid, args.gen_tokens, args.reps)
    data = {
        "benchmark": "models",
        "command": "python bench/models.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt": PROMPT, "models": {SMALL: "Q4_K_M (embedded)", Q8: "Q8_0"}},
        "settings": vars(args),
        "machine": facts,
        "cold_load": cold,
        "swap": swap,
        "response_cache": cache,
        "idle_threads": idle,
    }
    write_json("models", finish_facts(data))
    plot(data)
    return 0


def plot(data: dict[str, Any]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [SMALL, Q8]
    x = range(len(names))
    cold = [data["cold_load"][m]["wall_s"]["median"] for m in names]
    swap = [data["swap"][m]["swap_ttft_s"]["median"] for m in names]
    warm = [data["swap"][m]["warm_ttft_s"]["median"] for m in names]
    width = 0.27
    left.bar([i - width for i in x], cold, width, label="cold LoadModel", color="#888")
    left.bar(list(x), swap, width, label="first token after a swap", color="#27a")
    left.bar([i + width for i in x], warm, width, label="first token, resident", color="#4a7")
    left.set_xticks(list(x), names)
    left.set_ylabel("seconds (median)")
    left.legend(fontsize=8)
    cache = data["response_cache"]
    right.bar(
        ["engine (miss)", "response cache (hit)"],
        [cache["miss_s"]["median"] * 1e3, cache["hit_s"]["median"] * 1e3],
        color=["#888", "#27a"],
    )
    right.set_yscale("log")
    right.set_ylabel(f"Generate wall ms ({cache['gen_tokens']} tokens, median)")
    fig.suptitle("Multi-model serving: load, swap, response-cache hit")
    save_figure(fig, "models")


if __name__ == "__main__":
    raise SystemExit(main())
