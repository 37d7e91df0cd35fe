"""What a prompt chunk's size costs per token (issue 40): the raw llama.cpp loop runs one
llama_decode of N prompt tokens (logits for the last only) on an empty KV, for N = 8 .. 512, and
reports the engine thread's CPU time and the wall time, median over repetitions. With one
thread the CPU time is all of llama.cpp's work and does not depend on what else the box runs
(bench/aiperf.py's tick logs say how big the scheduler's chunks were).

    python bench/prefill_chunk.py [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_facts, machine_facts, progress, write_json
from raw_limit import RawLoop

from llama_grpc_server.models.files import default_model_path

SIZES = (8, 16, 32, 64, 128, 256, 512)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="prefill_chunk", help="results file name")
    args = parser.parse_args()
    facts = machine_facts(args.threads)
    raw = RawLoop(str(default_model_path()), 8192, 4, args.threads)
    raw._decode([(100, 0, 0, True)])  # warm-up: the thread team and the buffers
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in SIZES}
    for rep in range(args.reps):
        for n in SIZES:
            llama_cpp.llama_memory_clear(raw.model.memory, True)
            entries = [(200 + p % 1000, p, 0, p == n - 1) for p in range(n)]
            c0, t0 = time.thread_time(), time.perf_counter()
            raw._decode(entries)
            samples[n].append((1e3 * (time.thread_time() - c0), 1e3 * (time.perf_counter() - t0)))
        progress(f"rep {rep + 1}/{args.reps} done")
    raw.close()
    rows = []
    for n, got in samples.items():
        cpu = statistics.median(c for c, _ in got)
        wall = statistics.median(w for _, w in got)
        rows.append({"tokens": n, "cpu_ms": cpu, "wall_ms": wall, "cpu_ms_per_token": cpu / n,
                     "wall_ms_per_token": wall / n, "samples": got})  # fmt: skip
        print(f"N={n:4d}  {cpu:8.1f} CPU ms  {cpu / n:5.2f} CPU ms/token  {wall / n:5.2f} ms/token")
    data = {
        "benchmark": "prefill_chunk",
        "command": "python bench/prefill_chunk.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "rows": rows,
    }
    write_json(args.name, finish_facts(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
