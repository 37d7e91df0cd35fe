"""What a prompt-lookup step costs (core.speculation.ngram.NgramIndex): a 4,000-token prompt indexed
once, then 1,000 steps of one new token + a lookup, as in decoding. Per-step microseconds, the
median of 5 runs (was a timed assertion in tests/unit/core/test_speculative.py: ~10 us measured,
bounded at 200 us). Run: python bench/ngram_lookup.py"""

from __future__ import annotations

import json
import random
import statistics
import time

from llama_grpc_server.core.speculation.ngram import NgramIndex

PROMPT_TOKENS = 4000
STEPS = 1000
RUNS = 5


def per_step_us(seed: int) -> float:
    rng = random.Random(seed)
    tokens = [rng.randint(0, 5000) for _ in range(PROMPT_TOKENS)]
    index = NgramIndex(2, 4)
    index.draft(tokens, 8)
    start = time.perf_counter()
    for _ in range(STEPS):
        tokens.append(rng.randint(0, 5000))
        index.draft(tokens, 8)
    return (time.perf_counter() - start) / STEPS * 1e6


def main() -> None:
    runs = [per_step_us(seed) for seed in range(RUNS)]
    print(
        json.dumps(
            {
                "prompt_tokens": PROMPT_TOKENS,
                "steps": STEPS,
                "per_step_us_median": round(statistics.median(runs), 2),
                "per_step_us_runs": [round(r, 2) for r in runs],
            }
        )
    )


if __name__ == "__main__":
    main()
