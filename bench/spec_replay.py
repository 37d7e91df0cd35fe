"""Replay the AUTO speculation policy offline (issue 17). The outputs of bench/speculative.py's
prompts (greedy, the control's seeded and sampled as there) are recorded once from a real server
(speculation off: verification is exact-match, so they are what AUTO generates too, up to the
numerics of batch shape); then core.speculation.speculator.Speculator runs over them as the
scheduler drives it for one stream, each tick costed at a measured curve of forward-pass times
(bench/results/decode_cost_shape*.json), next to the perfect-foresight bound (each step's best
draft length known in advance, with the same n-gram lookup).

Deterministic, so a policy change's effect shows without the box's ±10 % run-to-run noise. It
leaves out what the server adds per tick (~1 ms here), so it predicts AUTO / off rather than AUTO
/ raw: form_fields replayed 0.99, measured 0.96-1.01 in five runs. Record again after any change
to the build or the model: outputs recorded with the x86-64-v3 build differed from the AVX-512
build's in form_fields from its second token.

    python bench/spec_replay.py record      # writes bench/results/spec_outputs.json (~15 s)
    python bench/spec_replay.py             # the replay, at this build's cost curve
    python bench/spec_replay.py --costs bench/results/decode_cost_shape.json --draft-max 24

A policy tuned on the benchmark's own prompts would flatter it: bench/spec_prompts/ holds two
more sets of 6 input-grounded prompts and 2 free-writing ones (tune.json to tune on, val.json to
check), written for this, replayed the same way:

    python bench/spec_replay.py record --prompts bench/spec_prompts/tune.json \
        --outputs bench/results/spec_outputs_tune.json
    python bench/spec_replay.py --prompts bench/spec_prompts/tune.json \
        --outputs bench/results/spec_outputs_tune.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, llama_grpc_process, progress, server_args, stream_tokens
from speculative import CONTROL, GEN_TOKENS, GROUNDED, params

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_server.core.requests.request import (
    GenerationRequest,
    Request,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeMode,
    SpeculativeParams,
    StoppingParams,
)
from llama_grpc_server.core.speculation.ngram import NgramIndex
from llama_grpc_server.core.speculation.policy import PRIOR_AVX512, PRIOR_X86_64_V3
from llama_grpc_server.core.speculation.speculator import Speculator

OUTPUTS = RESULTS / "spec_outputs.json"


def prompt_sets(path: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """(grounded, control) prompts: speculative.py's, or a file's ({"grounded": {name: text},
    "control": {name: text}})."""
    if path is None:
        return GROUNDED, CONTROL
    sets = json.loads(path.read_text())
    return sets["grounded"], sets["control"]


async def record_outputs(
    target: str, grounded: dict[str, str], control: dict[str, str]
) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LlmServiceStub(channel)
        for name, text in {**grounded, **control}.items():
            prompt = await stub.Tokenize(pb.TokenizeRequest(text=text))
            sampled = name in control  # as speculative.py sends them: seeded, temperature 0.8
            got = await stream_tokens(
                stub, text=text, params=params("off", GEN_TOKENS, sampled=sampled)
            )
            out[name] = [list(prompt.token_ids), list(got.token_ids)]
            progress(f"{name}: {len(prompt.token_ids)} prompt tokens, {got.n_tokens} generated")
    return out


def cost_curve(path: Path) -> dict[int, float]:
    """rows -> ms of a decode-only pass with logits for every row (the fastest rep of each)."""
    data = json.loads(path.read_text())
    return {r["extra_tokens"] + 1: min(r["ms_per_rep"]) for r in data["rows"]["all_logits"]}


def replay(
    prompt: list[int], gen: list[int], costs: dict[int, float], avx512: bool, k: int
) -> float:
    """Milliseconds AUTO takes for `gen` alone at `costs` (draft_max k)."""
    spec = Speculator(SpeculativeConfig(SpeculativeMode.AUTO, k, 2, 4))
    spec.costs.prior = PRIOR_AVX512 if avx512 else PRIOR_X86_64_V3
    spec.costs.calibrate(costs.items())
    auto = SpeculativeParams(SpeculativeMode.AUTO)
    stop = StoppingParams(max_tokens=len(gen))
    request = Request(
        GenerationRequest("r", tuple(prompt), SamplingParams(), stop, speculative=auto)
    )
    request.slot_id = 0
    i, ms = 0, 0.0
    while i < len(gen):
        draft = spec.propose([request], num_rows=1, room=64, n_ctx=1 << 20, has_prefill=False)
        tokens = draft.get(0, ())
        n = 0
        while n < len(tokens) and i + n < len(gen) and tokens[n] == gen[i + n]:
            n += 1
        ms += costs[len(tokens) + 1]
        if tokens:
            spec.verified(request, len(tokens), n)
        take = min(n + 1, len(gen) - i)
        request.tokens += gen[i : i + take]
        i += take
        spec.observe_tokens(request)
    return ms


def oracle(prompt: list[int], gen: list[int], costs: dict[int, float], k: int) -> float:
    """Milliseconds with every step's best draft length known in advance (the same lookup)."""
    index = NgramIndex(2, 4)
    found = []  # per position: (draft length available, how many of it are right)
    for i in range(len(gen)):
        draft = index.lookup([*prompt, *gen[:i]], k).draft
        n = 0
        while n < len(draft) and i + n < len(gen) and draft[n] == gen[i + n]:
            n += 1
        found.append((len(draft), n))
    best = [0.0] * (len(gen) + 1)
    for i in range(len(gen) - 1, -1, -1):
        length, right = found[i]
        best[i] = min(
            [costs[1] + best[i + 1]]
            + [
                costs[j + 1] + best[min(i + min(j, right) + 1, len(gen))]
                for j in range(1, length + 1)
            ]
        )
    return best[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("replay", "record"), default="replay")
    parser.add_argument(
        "--costs", type=Path, help="a decode_cost.py --rows result (default: this build's)"
    )
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--outputs", type=Path, default=OUTPUTS)
    parser.add_argument(
        "--prompts", type=Path, help="another prompt set, e.g. bench/spec_prompts/tune.json"
    )
    args = parser.parse_args()
    grounded, control = prompt_sets(args.prompts)
    if args.mode == "record":
        with llama_grpc_process(*server_args(2, "--n-ctx", "8192")) as (target, _):
            recorded = asyncio.run(record_outputs(target, grounded, control))
            args.outputs.write_text(json.dumps(recorded))
        progress(f"wrote {args.outputs}")
        return 0
    from llama_grpc_server.engine.llama import system_info

    avx512 = "AVX512 = 1" in system_info()
    path = args.costs or RESULTS / (
        "decode_cost_shape_avx512.json" if avx512 else "decode_cost_shape.json"
    )
    costs = cost_curve(path)
    outputs: dict[str, Any] = json.loads(args.outputs.read_text())
    totals = {kind: [0.0, 0.0, 0] for kind in ("grounded", "control")}
    for name, (prompt, gen) in outputs.items():
        auto, best = (
            replay(prompt, gen, costs, avx512, args.draft_max),
            oracle(prompt, gen, costs, args.draft_max),
        )
        off = costs[1] * len(gen)
        kind = "grounded" if name in grounded else "control"
        totals[kind][0] += auto
        totals[kind][1] += best
        totals[kind][2] += len(gen)
        print(f"{name:>18} ({kind}): AUTO / off x{off / auto:.3f}, foresight x{off / best:.3f}")
    for kind, (auto, best, n) in totals.items():
        off = costs[1] * n
        print(f"{kind} set: AUTO / off x{off / auto:.3f}, foresight x{off / best:.3f}")
    print(f"costs {path.name}, draft_max {args.draft_max}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
