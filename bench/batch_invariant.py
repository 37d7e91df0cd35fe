"""The batch-invariant mode (--batch-invariant) on the embedded Gemma 3 270M: what makes llama.cpp's
greedy output depend on the batch a sequence is decoded in, and what the mode costs.

    python bench/batch_invariant.py [--reps 5] [--check] [--explore] [--model GGUF]
                                    [--name batch_invariant]

A run with --reps 0 times nothing; a run without --check compares nothing: the results file
keeps the other part from its last run (with that run's command and machine facts), so the two
can be run apart on a busy box.

Every configuration runs in a worker process of its own (llama.cpp reads GGML_CPU_TILED_MM once
per process), on the raw llama_cpp API with the server's context parameters (unified KV, 4
sequences, n_ctx 4096, flash attention on).

--check: one prompt (233 tokens) decoded greedily alone, its prompt in one pass, is the
reference (64 tokens: the KV passes 256 cells, so llama.cpp's view of it grows to 512); every
other condition decodes the same tokens (teacher-forced) and compares each step's logits with
the reference's: the prompt in other chunks, beside 3 other streams, in one pass with their
prompts, after a cached prefix of 1, 16 or 100 tokens, with 1 thread instead of 2, and into KV
cells freed below the prompt's (a residual the mode does not remove: flash attention sums a
sequence's cells in cell order). --explore adds the steps between the default and the mode.

Cost (--reps, default 5): the reps are interleaved across the configurations (one rep of each
in turn, the order reversed every other rep); each rep times, on one llama.cpp thread, with
time.perf_counter around llama_decode and the process's CPU time (getrusage), a 512-token prompt
in one pass, 32 steps of one stream (after a 256-token prompt) and 32 steps of 4 streams (after
64-token prompts); medians over the reps, and the median over the reps of each configuration's
CPU time over the default's in the same rep (paired_cpu_ratio_to_default). The load average is
recorded before every rep: another job on the box slows every configuration's wall time, less its
one thread's CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_facts, progress, write_json

THREADS = 2
# The costs are timed on one thread: its CPU time is all of llama.cpp's work, which another job
# on the box does not inflate as it does two threads' (their barriers spin while one waits).
COST_THREADS = 1
N_CTX = 4096
N_SEQ = 4
N_GEN = 64
PROMPT = (
    "You are a careful assistant. Summarise the following notes about lighthouses, keeping "
    "every date and name. The first lighthouse on the rock was built of timber in 1698 by "
    "Henry Winstanley, and it was washed away in the great storm of 1703 with its builder "
    "inside. John Rudyerd built a second tower of timber and stone that stood until a fire "
    "in 1755. John Smeaton then built a granite tower whose dovetailed blocks became the model "
    "for every rock lighthouse after it; it stood until erosion of the rock beneath it forced "
    "its removal in 1877, and its upper part was rebuilt on Plymouth Hoe as a memorial. The "
    "present tower, designed by James Douglass, was lit in 1882 and automated in 1982. "
    "Keepers served in threes, one month on and one month off, and the logbooks record fog, "
    "shipwrecks, supply boats that could not land for weeks, and long winter nights. Write the "
    "summary as a short story told by the last keeper, warm and a little sad, ending with hope."
)
Row = tuple[int, int, int, bool]  # token, position, sequence, logits
OTHERS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
)


def configs(explore: bool) -> dict[str, dict[str, Any]]:
    """name -> {repack, env, n_ubatch, spare}: the server's default, then the mode as
    engine/llama.py sets it (and, exploring, the steps in between)."""
    from llama_grpc_server.engine.llama import BATCH_INVARIANT_ENV, BATCH_INVARIANT_UBATCH

    out: dict[str, dict[str, Any]] = {
        "default": {"repack": True, "env": {}, "n_ubatch": 512, "spare": False},
    }
    if explore:
        out["no repack"] = {"repack": False, "env": {}, "n_ubatch": 512, "spare": False}
        out["no repack, no tiled matmul"] = {
            "repack": False, "env": BATCH_INVARIANT_ENV, "n_ubatch": 512, "spare": False,
        }  # fmt: skip
        out[f"... + n_ubatch {BATCH_INVARIANT_UBATCH}"] = {
            "repack": False, "env": BATCH_INVARIANT_ENV, "n_ubatch": BATCH_INVARIANT_UBATCH,
            "spare": False,
        }  # fmt: skip
    out["batch-invariant"] = {
        "repack": False, "env": BATCH_INVARIANT_ENV, "n_ubatch": BATCH_INVARIANT_UBATCH,
        "spare": True,
    }  # fmt: skip
    return out


# -- the worker (one configuration, its own process) ------------------------------------------


class Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        import llama_cpp

        from llama_grpc_server.engine import logs
        from llama_grpc_server.engine.batch import needs_spare_row
        from llama_grpc_server.models.files import default_model_path

        logs.install(debug=False)
        self.lc = llama_cpp
        self.needs_spare_row = needs_spare_row
        self.config = config
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = config["repack"]
        path = (config.get("model") or str(default_model_path())).encode()
        self.model = llama_cpp.llama_model_load_from_file(path, mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = N_CTX, 512, config["n_ubatch"]
        cparams.n_seq_max, cparams.kv_unified, cparams.swa_full = N_SEQ, True, True
        cparams.n_threads = cparams.n_threads_batch = THREADS
        cparams.no_perf = True
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(1024, 0, 1)
        self.prompt = self.tokenize(vocab, PROMPT)
        self.others = [self.tokenize(vocab, t) for t in OTHERS]

    def tokenize(self, vocab: Any, text: str) -> list[int]:
        data = text.encode()
        out = (self.lc.llama_token * (len(data) + 8))()
        n = self.lc.llama_tokenize(vocab, data, len(data), out, len(out), True, True)
        return list(out[:n])

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.memory, True)

    def decode(self, rows: list[Row], *, copy: bool = True) -> dict[int, Any]:
        """One llama_decode of (token, pos, seq, logits) rows; {row: logits} for the marked ones.
        The mode's spare row (engine/batch.py) is added where the server's runner adds it."""
        import numpy as np

        spare = None
        if self.config["spare"] and self.needs_spare_row(len(rows), self.config["n_ubatch"]):
            token, pos, seq, _ = rows[-1]
            spare = (seq, pos + 1)
            rows = [*rows, (token, pos + 1, seq, False)]
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if spare is not None:
            self.lc.llama_memory_seq_rm(self.memory, spare[0], spare[1], spare[1] + 1)
        if not copy:
            return {}
        out = {}
        for i, (_, _, _, logits) in enumerate(rows):
            if logits:
                row = self.lc.llama_get_logits_ith(self.ctx, i)
                out[i] = np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()
        return out

    def prefill(self, seq: int, tokens: list[int], start: int, sizes: list[int]) -> Any:
        """tokens[start:] of `seq` in chunks of `sizes` (then the rest); the last one's logits."""
        pos, last, sizes = start, None, list(sizes)
        while pos < len(tokens):
            n = min(sizes.pop(0) if sizes else len(tokens) - pos, len(tokens) - pos)
            rows = [(tokens[p], p, seq, p == len(tokens) - 1) for p in range(pos, pos + n)]
            out = self.decode(rows)
            if out:
                last = out[len(rows) - 1]
            pos += n
        return last

    # -- check --------------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        lc, prompt, others = self.lc, self.prompt, self.others
        self.clear()
        first = self.prefill(0, prompt, 0, [len(prompt)])
        ref_logits, ref_tokens = [first], [int(first.argmax())]
        for i in range(N_GEN - 1):
            row = self.decode([(ref_tokens[-1], len(prompt) + i, 0, True)])[0]
            ref_logits.append(row)
            ref_tokens.append(int(row.argmax()))

        def forced(first: Any, neighbours: dict[int, dict[str, int]] | None = None) -> list[Any]:
            logits = [first]
            for i, token in enumerate(ref_tokens[:-1]):
                rows = [(token, len(prompt) + i, 0, True)]
                rows += [(n["next"], n["pos"], s, True) for s, n in (neighbours or {}).items()]
                out = self.decode(rows)
                logits.append(out[0])
                for j, n in enumerate((neighbours or {}).values(), start=1):
                    n["next"], n["pos"] = int(out[j].argmax()), n["pos"] + 1
            return logits

        def chunked(sizes: list[int]) -> list[Any]:
            return forced(self.prefill(0, prompt, 0, sizes))

        def beside() -> list[Any]:
            neighbours = {}
            for s, other in enumerate(others, start=1):
                last = self.prefill(s, other, 0, [len(other)])
                neighbours[s] = {"next": int(last.argmax()), "pos": len(other)}
            return forced(self.prefill(0, prompt, 0, [len(prompt)]), neighbours)

        def mixed() -> list[Any]:
            rows = []
            for s, tokens in enumerate([prompt, *others]):
                rows += [(t, p, s, p == len(tokens) - 1) for p, t in enumerate(tokens)]
            out = self.decode(rows)
            last = [i for i, row in enumerate(rows) if row[3]]
            neighbours = {
                s: {"next": int(out[last[s]].argmax()), "pos": len(tokens)}
                for s, tokens in enumerate(others, start=1)
            }
            return forced(out[last[0]], neighbours)

        def cached(k: int) -> Any:
            def run() -> list[Any]:
                # sequence 3 holds the prompt's first k tokens and other text: the prefix is
                # copied to sequence 0 (llama_memory_seq_cp, as the server shares prefixes)
                self.prefill(3, prompt[:k] + others[0][1:], 0, [k + len(others[0]) - 1])
                lc.llama_memory_seq_cp(self.memory, 3, 0, 0, k)
                lc.llama_memory_seq_rm(self.memory, 3, -1, -1)
                return forced(self.prefill(0, prompt, k, [len(prompt)]))

            return run

        def one_thread() -> list[Any]:
            lc.llama_set_n_threads(self.ctx, 1, 1)
            try:
                return chunked([len(prompt)])
            finally:
                lc.llama_set_n_threads(self.ctx, THREADS, THREADS)

        def freed_below() -> list[Any]:
            filler = (others[2] * 40)[:300]
            self.prefill(1, filler, 0, [len(filler)])
            first = self.prefill(0, prompt, 0, [len(prompt)])
            lc.llama_memory_seq_rm(self.memory, 1, -1, -1)  # the next cells go below the prompt
            return forced(first)

        conditions = {
            "again": lambda: chunked([len(prompt)]),
            "prompt in chunks 1 + rest": lambda: chunked([1]),
            "prompt in chunks 5 + rest": lambda: chunked([5]),
            "prompt in chunks of 7": lambda: chunked([7] * 64),
            "prompt in chunks of 32": lambda: chunked([32] * 16),
            "prompt in chunks 100 + rest": lambda: chunked([100]),
            "beside 3 streams": beside,
            "one pass with 3 prompts, then beside them": mixed,
            "cached prefix of 1": cached(1),
            "cached prefix of 16": cached(16),
            "cached prefix of 100": cached(100),
            "1 thread instead of 2": one_thread,
            "decoded into cells freed below the prompt": freed_below,
        }
        results = {}
        for name, run in conditions.items():
            self.clear()
            logits = run()
            diffs = [float(abs(a - b).max()) for a, b in zip(ref_logits, logits, strict=True)]
            differ = [i for i, row in enumerate(logits) if int(row.argmax()) != ref_tokens[i]]
            results[name] = {
                "max_abs_logit_diff": max(diffs),
                "prompt_logit_diff": diffs[0],
                "identical_steps": sum(d == 0.0 for d in diffs),
                "steps": len(diffs),
                "first_greedy_divergence": differ[0] if differ else None,
            }
        return {"prompt_tokens": len(prompt), "results": results}

    # -- cost ---------------------------------------------------------------------------------

    def timed(self, rows: list[Row]) -> tuple[float, float]:
        """(wall ms, CPU ms of the whole process) of one decode."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0 = usage.ru_utime + usage.ru_stime
        t0 = time.perf_counter()
        self.decode(rows, copy=False)
        wall = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return 1e3 * wall, 1e3 * (usage.ru_utime + usage.ru_stime - cpu0)

    def cost(self) -> dict[str, Any]:
        self.lc.llama_set_n_threads(self.ctx, COST_THREADS, COST_THREADS)
        try:
            return self._cost()
        finally:
            self.lc.llama_set_n_threads(self.ctx, THREADS, THREADS)

    def _cost(self) -> dict[str, Any]:
        prompt = (self.prompt * 3)[:512]
        self.clear()
        prefill = self.timed([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self.clear()
        self.prefill(0, prompt[:256], 0, [256])
        one = [self.timed([(prompt[256 + i], 256 + i, 0, True)]) for i in range(32)]
        self.clear()
        for s in range(N_SEQ):
            self.prefill(s, prompt[s * 64 : (s + 1) * 64], 0, [64])
        four = [
            self.timed([(prompt[300 + i], 64 + i, s, True) for s in range(N_SEQ)])
            for i in range(32)
        ]
        return {
            "prefill_512": {"wall_ms": prefill[0], "cpu_ms": prefill[1]},
            "decode_1_stream": {
                "wall_ms": statistics.median(w for w, _ in one),
                "cpu_ms": statistics.median(c for _, c in one),
            },
            "decode_4_streams": {
                "wall_ms": statistics.median(w for w, _ in four),
                "cpu_ms": statistics.median(c for _, c in four),
            },
        }


def worker_main(config_json: str) -> int:
    config = json.loads(config_json)
    os.environ.update(config["env"])  # before llama.cpp's first matmul in this process
    answers = os.fdopen(os.dup(1), "w")  # llama.cpp may print to stdout: results go apart
    os.dup2(2, 1)
    worker = Worker(config)
    worker.decode([(2, 0, 0, True)], copy=False)  # warm-up: the thread team and the buffers
    for line in sys.stdin:
        command = line.strip()
        result = worker.check() if command == "check" else worker.cost()
        print(json.dumps(result), file=answers, flush=True)
    return 0


# -- the parent ---------------------------------------------------------------------------------


class Remote:
    def __init__(self, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the worker exited")
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def medians(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, tokens in (("prefill_512", 512), ("decode_1_stream", 1), ("decode_4_streams", 4)):
        wall = statistics.median(r[key]["wall_ms"] for r in reps)
        cpu = statistics.median(r[key]["cpu_ms"] for r in reps)
        out[key] = {
            "wall_ms": round(wall, 2),
            "cpu_ms": round(cpu, 2),
            "cpu_ms_min": round(min(r[key]["cpu_ms"] for r in reps), 2),
            "tokens_per_s": round(1e3 * tokens / wall, 1),
            "cpu_ms_per_token": round(cpu / tokens, 3),
        }
    return out


def paired(reps: list[dict[str, Any]], default: list[dict[str, Any]]) -> dict[str, float]:
    """Median over the reps of a configuration's CPU time over the default's in the same rep
    (interleaved: a slow spell of the box slows both)."""
    return {
        key: round(
            statistics.median(
                r[key]["cpu_ms"] / d[key]["cpu_ms"] for r, d in zip(reps, default, strict=True)
            ),
            3,
        )
        for key in ("prefill_512", "decode_1_stream", "decode_4_streams")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="compare logits across batch shapes")
    parser.add_argument("--explore", action="store_true", help="the steps between default and mode")
    parser.add_argument("--model", default="", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--name", default="batch_invariant", help="results file name")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)
    facts = machine_facts(COST_THREADS)
    named = configs(args.explore)
    remotes = {name: Remote({**config, "model": args.model}) for name, config in named.items()}
    run = {
        "command": "python bench/batch_invariant.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "model": args.model or "embedded Gemma 3 270M Q4_K_M",
    }
    data: dict[str, Any] = {"benchmark": "batch_invariant"}
    try:
        if args.check:
            check = {}
            for name, remote in remotes.items():
                progress(f"check: {name}")
                check[name] = remote.ask("check")
            data["check"] = {"run": run, "configs": named, "results": check}
        if args.reps > 0:
            samples: dict[str, list[dict[str, Any]]] = {name: [] for name in remotes}
            loads = []
            for rep in range(args.reps):
                order = list(remotes) if rep % 2 == 0 else list(reversed(remotes))
                for name in order:
                    loads.append(os.getloadavg()[0])
                    samples[name].append(remotes[name].ask("cost"))
                progress(f"cost rep {rep + 1}/{args.reps}")
            data["cost"] = {
                "run": run,
                "configs": named,
                "threads": COST_THREADS,
                "medians": {name: medians(reps) for name, reps in samples.items()},
                "paired_cpu_ratio_to_default": {
                    name: paired(reps, samples["default"]) for name, reps in samples.items()
                },
                "samples": samples,
                "load_average_per_rep": loads,
            }
    finally:
        for remote in remotes.values():
            remote.close()
    facts["load_average_at_end"] = list(os.getloadavg())
    path = RESULTS / f"{args.name}.json"
    if path.exists():  # keep the part this run did not redo
        old = json.loads(path.read_text())
        data = {key: old[key] for key in ("check", "cost") if key in old} | data
    write_json(args.name, data)
    for name, cost in data.get("cost", {}).get("medians", {}).items():
        ratios = data["cost"]["paired_cpu_ratio_to_default"][name]
        cells = [f"{k} {v['tokens_per_s']} tok/s {v['cpu_ms_per_token']} CPU ms/token "
                 f"(x{ratios[k]})" for k, v in cost.items()]  # fmt: skip
        print(f"{name:32s}", "  ".join(cells))
    for name, check in data.get("check", {}).get("results", {}).items():
        print(name)
        for condition, r in check["results"].items():
            print(f"  {condition:44s} max |dlogit| {r['max_abs_logit_diff']:.4f}  "
                  f"identical {r['identical_steps']}/{r['steps']}  "
                  f"greedy diverges at {r['first_greedy_divergence']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
