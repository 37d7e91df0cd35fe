"""Marginal cost of k extra tokens in one B = 1 decode step, the basis of a speculative-decoding
policy (issue 17): the raw llama.cpp loop decodes 1 + k tokens of one sequence after a prompt,
with logits for every position (what verifying a k-token draft needs) and with logits for the
last one only (the transformer body alone), and reports the median llama_decode time.

    python bench/decode_cost.py [--reps 3]
    python bench/decode_cost.py --rows 32 --name decode_cost_shape   # every N = 1 .. 32

The second form is the source of core.speculation.policy.PRIOR_SHAPE: on the development box an odd
number of logits rows >= 3 costs ~10 ms more than one row more (llama.cpp's CPU matmul of the
262,144 x 640 Q8_0 output matrix), which a curve sampled at 1, 2, 4, 8, 16 cannot show.
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

EXTRA = (0, 1, 2, 4, 8, 16)
PROMPT = "Write a long story about a harbour town and its people. " * 4


def median_ms(raw: RawLoop, pos: int, k: int, all_logits: bool, samples: int) -> float:
    times = []
    for _ in range(samples):
        entries = [(100 + j, pos + j, 0, all_logits or j == k) for j in range(k + 1)]
        t0 = time.perf_counter()
        raw._decode(entries)  # the raw loop's own batch filler
        times.append(time.perf_counter() - t0)
        llama_cpp.llama_memory_seq_rm(raw.model.memory, 0, pos, -1)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, help="time every N from 1 to this many rows")
    parser.add_argument("--name", default="decode_cost", help="results file name")
    args = parser.parse_args()
    extra = EXTRA if args.rows is None else tuple(range(args.rows))
    facts = machine_facts(args.threads)
    raw = RawLoop(str(default_model_path()), 4096, 1, args.threads)
    prompt = raw.model.tokenize(PROMPT, add_special=True, parse_special=False)
    llama_cpp.llama_memory_clear(raw.model.memory, True)
    raw._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
    rows: dict[str, dict[int, list[float]]] = {"all_logits": {}, "last_logits": {}}
    for rep in range(args.reps):
        for mode, rows_of in rows.items():
            for k in extra:
                ms = median_ms(raw, len(prompt), k, mode == "all_logits", args.samples)
                rows_of.setdefault(k, []).append(ms)
        progress(f"rep {rep + 1}/{args.reps} done")
    raw.close()
    out = {
        mode: [
            {"extra_tokens": k, "ms_median": statistics.median(v), "ms_per_rep": v}
            for k, v in rows_of.items()
        ]
        for mode, rows_of in rows.items()
    }
    data = {
        "benchmark": "decode_cost",
        "command": "python bench/decode_cost.py " + " ".join(sys.argv[1:]),
        "workload": {"prompt_tokens": len(prompt), "batch": 1},
        "machine": facts,
        "rows": out,
    }
    write_json(args.name, finish_facts(data))
    base = out["all_logits"][0]["ms_median"]
    for a, b in zip(out["all_logits"], out["last_logits"], strict=True):
        print(
            f"1+{a['extra_tokens']:>2} tokens: {a['ms_median']:6.2f} ms with logits at every "
            f"position ({a['ms_median'] / base:.2f}x), {b['ms_median']:6.2f} ms with the last only"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
