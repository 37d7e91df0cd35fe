"""Sampler cost: microseconds per sampled token of the engine's RequestSampler on the embedded
Gemma 3's logits (a 262,144-token vocabulary), for the seeded/temperature chain with top-k 40 and
without top-k (top-p 0.95 and min-p 0.05 then bound the candidates), plus plain greedy for
scale; and, beside each sampling mode, the same chain ending in llama.cpp's own dist sampler
(`<mode>_dist`: the chain before the position-keyed draw, engine/sampler.PositionDraw), sampled
with llama_sampler_sample directly. One forward pass of a short prompt, then each sampler
samples the same logits row many times (its penalty history grows, nothing else changes). The
modes take turns call by call (in an order reversed every other step), so load changes hit
them alike; each call is timed, the median
(and the 10th percentile, the quietest calls) reported, with the median of the per-step
differences between a mode and its `_dist` twin. Never asserts timings.

    python bench/sampler_cost.py                 # prints a JSON line
    python bench/sampler_cost.py --out sampler   # also writes bench/results/sampler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from llama_grpc_server.config import ModelSettings
from llama_grpc_server.core.requests.request import SamplingParams
from llama_grpc_server.core.scheduling.plan import Chunk
from llama_grpc_server.engine.batch import Batch
from llama_grpc_server.engine.llama import LlamaModel
from llama_grpc_server.engine.sampler import Candidates, RequestSampler, _chain
from llama_grpc_server.models.files import default_model_path

MODES: dict[str, SamplingParams] = {
    "top_k_40": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7),
    "no_top_k": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.05, seed=7),
    "no_top_k_no_min_p": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0, seed=7),
    "greedy": SamplingParams(temperature=0.0),
}


class DistChain:
    """The chain as it was before PositionDraw: top-k, top-p, min-p, temperature, dist (or,
    with dist=False, without it: what a draw chooses from)."""

    def __init__(self, params: SamplingParams, seed: int, *, dist: bool = True) -> None:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        if params.top_k > 0:
            add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
        if dist:
            add(chain, llama_cpp.llama_sampler_init_dist(seed))
        self.chain = chain

    def sample(self, ctx: object, index: int) -> int:
        return int(llama_cpp.llama_sampler_sample(self.chain, ctx, index))

    def close(self) -> None:
        llama_cpp.llama_sampler_free(self.chain)


def draw_only(samples: int) -> dict[str, dict[str, float]]:
    """The last sampler alone on candidate arrays of a few sizes (what a chain leaves): the
    position draw (a Python callback) against llama.cpp's dist, median microseconds per apply
    through llama_sampler_apply, the two taking turns."""
    out: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    for size in (1, 40, 800):
        candidates = Candidates(size)
        row = rng.normal(size=size).astype(np.float32)
        draw_chain, position_draw = _chain(
            SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), 7, size
        )
        dist = llama_cpp.llama_sampler_init_dist(7)
        times: dict[str, list[int]] = {"position": [], "dist": []}
        for step in range(samples):
            assert position_draw is not None
            position_draw.position = step
            for name, sampler in (("position", position_draw.sampler), ("dist", dist))[
                :: 1 if step % 2 else -1
            ]:
                candidates.load(row)
                t0 = time.perf_counter_ns()
                llama_cpp.llama_sampler_apply(sampler, candidates.ref)
                times[name].append(time.perf_counter_ns() - t0)
        llama_cpp.llama_sampler_free(dist)
        llama_cpp.llama_sampler_free(draw_chain)
        out[str(size)] = {k: round(statistics.median(v) / 1000, 1) for k, v in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="samples per mode")
    parser.add_argument(
        "--prompt",
        default="The quick brown fox jumps over",
        help="its next token's distribution sets how many candidates the draw sees",
    )
    parser.add_argument("--out", default="", help="write bench/results/<out>.json")
    args = parser.parse_args()
    path = str(default_model_path())
    model = LlamaModel(ModelSettings(model_path=path, n_ctx=512, n_threads=1), path, 1)
    prompt = model.tokenize(args.prompt, add_special=True, parse_special=False)
    batch = Batch(model.n_batch)
    (index,) = batch.fill([Chunk(0, "bench", 0, tuple(prompt), True)])
    if llama_cpp.llama_decode(model.ctx, batch.struct) != 0:
        raise SystemExit("llama_decode failed")
    samplers: dict[str, RequestSampler | DistChain] = {}
    for mode, params in MODES.items():
        samplers[mode] = RequestSampler(params, 7, model.n_vocab, vocab=model.vocab)
        if not params.is_greedy:
            samplers[f"{mode}_dist"] = DistChain(params, 7)
    # every mode samples once per step, in turn (the order reversed every other step: a call
    # right after another costs differently), so load changes hit each mode alike
    calls: dict[str, list[int]] = {mode: [] for mode in samplers}
    order = list(samplers.items())
    for step in range(args.tokens):
        for mode, sampler in order if step % 2 == 0 else order[::-1]:
            t0 = time.perf_counter_ns()
            sampler.sample(model.ctx, index)
            calls[mode].append(time.perf_counter_ns() - t0)
    for sampler in samplers.values():
        sampler.close()
    left: dict[str, int] = {}  # the candidates a draw chooses from, per sampling mode
    candidates = Candidates(model.n_vocab)
    row = np.ctypeslib.as_array(
        llama_cpp.llama_get_logits_ith(model.ctx, index), shape=(model.n_vocab,)
    ).copy()
    for mode, params in MODES.items():
        if not params.is_greedy:
            chain = DistChain(params, 7, dist=False)
            candidates.load(row)
            llama_cpp.llama_sampler_apply(chain.chain, candidates.ref)
            left[mode] = int(candidates._array.size)  # (a bench may read it)
            chain.close()
    result = {
        "draw_only_us": draw_only(args.tokens),
        "n_vocab": model.n_vocab,
        "prompt": args.prompt,
        "candidates_left": left,
        "samples_per_mode": args.tokens,
        "us_per_token_median": {m: round(statistics.median(v) / 1000, 1) for m, v in calls.items()},
        "us_per_token_p10": {
            m: round(statistics.quantiles(v, n=10)[0] / 1000, 1) for m, v in calls.items()
        },
        # the position-keyed draw's extra cost: this step's call less the dist chain's, median
        "us_extra_median": {
            m: round(
                statistics.median(a - b for a, b in zip(calls[m], calls[f"{m}_dist"], strict=True))
                / 1000,
                1,
            )
            for m in MODES
            if f"{m}_dist" in calls
        },
    }
    model.close()
    print(json.dumps(result))
    if args.out:
        out = Path(__file__).resolve().parent / "results" / f"{args.out}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
