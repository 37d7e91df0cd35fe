"""Which llama.cpp build to install: two llama-cpp-python wheels side by side in the raw loop
(same model, same settings, 2 threads), alternating child processes rep by rep.

Measured per build, median over reps of each rep's median pass time: one forward pass of N
tokens with logits for every row (N = 1 .. 17: a B = N decode tick, or verifying an N - 1
token draft) and a 256-token prompt pass with logits for the last row only (prefill).

    make bench-build-isa    # baseline x86-64-v3 (AVX2) against the wheel `make install` uses
    python bench/build_isa.py --baseline DIR --candidate DIR [--reps 5]

A wheelhouse DIR holds one llama_cpp_python-0.3.36 wheel; each is unpacked once into a
temporary folder that goes first on the child's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_facts, machine_facts, progress, pyplot, save_figure, spread, write_json

ROWS = tuple(range(1, 18))
PREFILL = 256
PROMPT = "Write a long story about a harbour town and its people. " * 4


def child(samples: int) -> dict[str, Any]:
    """One rep in this process, with whatever llama_cpp the PYTHONPATH gives."""
    import llama_cpp
    from raw_limit import RawLoop

    from llama_grpc_server.models.files import default_model_path

    raw = RawLoop(str(default_model_path()), 4096, 1, 2)
    prompt = raw.model.tokenize(PROMPT, add_special=True, parse_special=False)
    raw._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
    pos = len(prompt)

    def median_ms(n: int, all_logits: bool, times: int) -> float:
        got = []
        for _ in range(times):
            entries = [(100 + j % 50, pos + j, 0, all_logits or j == n - 1) for j in range(n)]
            t0 = time.perf_counter()
            raw._decode(entries)
            got.append(time.perf_counter() - t0)
            llama_cpp.llama_memory_seq_rm(raw.model.memory, 0, pos, -1)
        return statistics.median(got) * 1000

    rows = {n: median_ms(n, True, samples) for n in ROWS}
    prefill = median_ms(PREFILL, False, max(3, samples // 3))
    raw.close()
    return {"rows_ms": rows, "prefill_ms": prefill, "llama_cpp": llama_cpp.__file__}


def unpack(wheelhouse: Path, into: Path) -> Path:
    wheels = sorted(wheelhouse.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"{wheelhouse}: expected one llama_cpp_python wheel, found {len(wheels)}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(into)
    return into


def run_child(path: Path, samples: int) -> dict[str, Any]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--samples", str(samples)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if not got["llama_cpp"].startswith(str(path)):
        raise SystemExit(f"the child imported {got['llama_cpp']}, not the wheel in {path}")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="wheelhouse of the baseline build")
    parser.add_argument("--candidate", type=Path, help="wheelhouse of the candidate build")
    parser.add_argument("--baseline-name", default="x86-64-v3")
    parser.add_argument("--candidate-name", default="make install's build")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--name", default="build_isa", help="results file name")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.samples)))
        return 0
    if args.baseline is None or args.candidate is None:
        parser.error("--baseline and --candidate are required")
    facts = machine_facts(2)
    builds = {args.baseline_name: args.baseline, args.candidate_name: args.candidate}
    reps: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            name: unpack(house, Path(tmp) / str(i))
            for i, (name, house) in enumerate(builds.items())
        }
        for rep in range(args.reps):
            order = list(builds) if rep % 2 == 0 else list(reversed(builds))
            for name in order:
                got = run_child(paths[name], args.samples)
                reps[name].append(got)
                progress(
                    f"rep {rep + 1}/{args.reps} {name}: N=1 {got['rows_ms']['1']:.1f} ms, "
                    f"N=16 {got['rows_ms']['16']:.1f} ms, prefill {got['prefill_ms']:.0f} ms"
                )
    results: dict[str, dict[str, Any]] = {
        name: {
            "wheelhouse": str(builds[name]),
            "rows_ms": {n: spread([r["rows_ms"][str(n)] for r in got]) for n in ROWS},
            "prefill_ms": spread([r["prefill_ms"] for r in got]),
        }
        for name, got in reps.items()
    }
    base, cand = (results[n] for n in builds)
    data: dict[str, Any] = {
        "benchmark": "build_isa",
        "command": "python bench/build_isa.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt_tokens_before": "~50", "prefill_tokens": PREFILL, "threads": 2},
        "machine": facts,
        "baseline": args.baseline_name,
        "candidate": args.candidate_name,
        "builds": results,
        "speedup": {
            "rows": {n: base["rows_ms"][n]["median"] / cand["rows_ms"][n]["median"] for n in ROWS},
            "prefill": base["prefill_ms"]["median"] / cand["prefill_ms"]["median"],
        },
    }
    write_json(args.name, finish_facts(data))
    plot(data, args.name)
    for n in ROWS:
        print(
            f"N={n:>2}: {base['rows_ms'][n]['median']:6.1f} -> {cand['rows_ms'][n]['median']:6.1f}"
            f" ms (x{data['speedup']['rows'][n]:.2f})"
        )
    print(
        f"prefill {PREFILL}: {base['prefill_ms']['median']:.0f} -> "
        f"{cand['prefill_ms']['median']:.0f} ms (x{data['speedup']['prefill']:.2f})"
    )
    return 0


def plot(data: dict[str, Any], name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for build, got in data["builds"].items():
        ax.plot(ROWS, [got["rows_ms"][n]["median"] for n in ROWS], marker="o", label=build)
    ax.set_xlabel("tokens in the pass, logits for every row")
    ax.set_ylabel("ms per forward pass (median)")
    ax.set_title("llama.cpp build: one forward pass of Gemma 3 270M, 2 threads")
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    raise SystemExit(main())
