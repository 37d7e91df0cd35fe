"""The GPU benchmark's measuring part (bench/gpu.sh builds, installs and makes the models, then
calls this): on one model, llama-grpc (defaults, --n-gpu-layers -1, --overlap-decode on and
off), llama.cpp's llama-server from the same build (-np B, unified KV) and the raw loop (in this
process: one batched llama_decode per step and one argmax over every row; and llama.cpp's own
llama-batched-bench, no sampling at all), B = 1, 4, 8, 16, 32, 64 concurrent greedy streams of
41 prompt tokens and 64 generated ones (bench/concurrency.py's workload), the four rotating
within every repetition; then time to first token of a 512-token prompt, alone.

The models have random weights (llama_grpc_testkit.synth_gguf): a forward pass costs the same
whatever the weights, so the timings stand for a real model of the same shape; outputs are noise, so
every request uses ignore_eos and token-id prompts.

One JSON (--out), rewritten after every step, so a run cut off by its time limit keeps what it
measured; steps that no longer fit before --deadline-s are listed as skipped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import concurrency
from common import (
    GrpcBackend,
    free_port,
    llama_grpc_process,
    machine_facts,
    progress,
    spread,
)
from peers import LlamaServerBackend, peer_process
from raw_limit import RawLoop

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc
from llama_grpc_testkit.synth_gguf import FIRST_PIECE

N_CTX = 8192
N_BATCH, N_UBATCH = 2048, 512
TTFT_PROMPT = 512
NOTE = (
    "Random weights (llama_grpc_testkit.synth_gguf): timing does not depend on the weights, "
    "outputs are noise; every request is greedy with ignore_eos and a token-id prompt."
)
GRPC_VARIANTS = {"llama-grpc": "on", "llama-grpc-no-overlap": "off"}


class Clock:
    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def prompts_for(n: int, length: int, seed: int, n_vocab: int) -> list[list[int]]:
    """n prompts of `length` ordinary token ids (no BOS: the synthetic vocabulary's pieces),
    different for every seed so no prefix is shared."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PIECE, n_vocab) for _ in range(length)] for _ in range(n)]


@contextlib.contextmanager
def llama_server(
    binary: str, model: str, slots: int, n_gpu_layers: int, threads: int
) -> Iterator[int]:
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(N_CTX)]
    cmd += ["-np", str(slots), "-kvu", "--swa-full", "--cache-ram", "0", "--no-webui"]
    cmd += ["-b", str(N_BATCH), "-ub", str(N_UBATCH), "-ngl", str(n_gpu_layers), "-fa", "on"]
    cmd += ["--fit", "off", "--log-disable"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    with peer_process(cmd, port, "/health") as p:
        yield p


def batched_bench(
    binary: str, model: str, batches: Sequence[int], gen: int, *, ngl: int, threads: int
) -> list[dict[str, Any]]:
    """llama.cpp's own loop: per B, one B-sequence prefill, then `gen` decode steps, no
    sampling (its S_TG is the tokens/s of the decode steps alone)."""
    cmd = [binary, "-m", model, "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_UBATCH)]
    cmd += ["-npp", str(concurrency.PROMPT_TOKENS), "-ntg", str(gen)]
    cmd += ["-npl", ",".join(map(str, batches)), "-ngl", str(ngl), "-fa", "on", "-kvu"]
    cmd += ["--output-format", "jsonl"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line) for line in (out.stdout + "\n" + out.stderr).splitlines()
            if line.startswith("{")]  # fmt: skip


async def timed_streams(backend: Any, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(backend.generate(p, gen, cache_prompt=False) for p in prompts))
    return time.perf_counter() - t0, sum(r.n_tokens for r in recs)


async def ttft(backend: Any, prompt: list[int]) -> float:
    rec = await backend.generate(prompt, 2, cache_prompt=False)
    return rec.ttft_s


class Run:
    """One model's measurements, appended to `result` as they come."""

    def __init__(
        self, args: argparse.Namespace, clock: Clock, result: dict[str, Any], out: Path
    ) -> None:
        self.args, self.clock, self.result, self.out = args, clock, result, out

    def save(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, sort_keys=True))
        tmp.replace(self.out)

    def skip(self, what: str) -> None:
        progress(f"skipped (time): {what}")
        self.result.setdefault("skipped", []).append(what)
        self.save()

    async def model(self, name: str, path: str) -> None:
        a = self.args
        entry: dict[str, Any] = {"file": path, "size_bytes": os.path.getsize(path)}
        self.result["models"][name] = entry
        threads = a.threads
        if a.batched_bench and self.clock.left() > 60:
            progress(f"{name}: llama-batched-bench")
            try:
                entry["batched_bench"] = batched_bench(
                    a.batched_bench, path, a.batches, a.gen, ngl=a.ngl_peer, threads=threads
                )
            except (subprocess.SubprocessError, OSError) as exc:
                entry["batched_bench_error"] = str(exc)[-2000:]
            self.save()
        with contextlib.ExitStack() as stack:
            progress(f"{name}: starting llama-grpc (overlap on, off) and the raw loop")
            targets = {}
            for label, overlap in GRPC_VARIANTS.items():
                server_args = ["--model", path, "--n-gpu-layers", str(a.ngl),
                               "--n-parallel", str(max(a.batches)), "--n-ctx", str(N_CTX),
                               "--overlap-decode", overlap]  # fmt: skip
                if threads:
                    server_args += ["--threads", str(threads), "--threads-batch", str(threads)]
                target, proc = stack.enter_context(llama_grpc_process(*server_args, timeout_s=240))
                targets[label] = target
                entry.setdefault("pids", {})[label] = proc.pid
            raw = RawLoop(path, N_CTX, max(a.batches), threads or (os.cpu_count() or 1),
                          n_gpu_layers=a.ngl, batched_argmax=True)  # fmt: skip
            stack.callback(raw.close)
            channels = {k: grpc.aio.insecure_channel(t) for k, t in targets.items()}
            grpc_backends = {k: GrpcBackend(pb_grpc.LlmServiceStub(c)) for k, c in channels.items()}
            try:
                await self.measure(name, entry, raw, grpc_backends)
            finally:
                for channel in channels.values():
                    await channel.close()

    async def measure(
        self, name: str, entry: dict[str, Any], raw: RawLoop, grpc_backends: dict[str, Any]
    ) -> None:
        a, path, threads = self.args, entry["file"], self.args.threads
        n_vocab = raw.model.n_vocab
        await self.warm_up(raw, grpc_backends, n_vocab)
        entry["concurrency"] = []
        for b in a.batches:
            if self.clock.left() < a.min_step_s:
                self.skip(f"{name} B={b}")
                continue
            with llama_server(a.llama_server, path, b, a.ngl_peer, threads) as port:
                peer = LlamaServerBackend(port, grpc_backends["llama-grpc"])
                backends = {**grpc_backends, "llama-server": peer}
                entry["concurrency"].append(await self.batch_row(raw, backends, b, n_vocab))
                self.save()
                if b == 1 and self.clock.left() > a.min_step_s:
                    entry["ttft_512"] = await self.ttft_row(raw, backends, n_vocab)
                    self.save()
        if a.profile and self.clock.left() > a.min_step_s and shutil.which("py-spy"):
            entry["profile"] = await self.profile(name, entry, grpc_backends, n_vocab)
            self.save()

    async def warm_up(self, raw: RawLoop, backends: dict[str, Any], n_vocab: int) -> None:
        for b in (1, max(self.args.batches)):
            prompts = prompts_for(b, concurrency.PROMPT_TOKENS, 999, n_vocab)
            raw.run(prompts, 8)
            for backend in backends.values():
                await timed_streams(backend, prompts, 8)

    async def batch_row(
        self, raw: RawLoop, backends: dict[str, Any], b: int, n_vocab: int
    ) -> dict[str, Any]:
        gen, reps = self.args.gen, self.args.reps
        names = ["raw", *backends]
        walls: dict[str, list[float]] = {n: [] for n in names}
        short: dict[str, int] = {}
        first = prompts_for(b, concurrency.PROMPT_TOKENS, 500 + b, n_vocab)
        await timed_streams(backends["llama-server"], first, 8)  # the new peer's warm-up
        for rep in range(reps):
            prompts = prompts_for(b, concurrency.PROMPT_TOKENS, 1000 * b + rep, n_vocab)
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                if name == "raw":
                    walls[name].append(raw.run(prompts, gen))
                    continue
                wall, n = await timed_streams(backends[name], prompts, gen)
                walls[name].append(wall)
                if n != b * gen:
                    short[name] = n
            progress(f"B={b:>2} rep {rep + 1}/{reps}: "
                     + ", ".join(f"{n} {walls[n][-1]:.3f}s" for n in names))  # fmt: skip
        row: dict[str, Any] = {"batch": b, "short_outputs": short}
        for name in names:
            med = sorted(walls[name])[len(walls[name]) // 2]
            row[name] = {"wall_s": spread(walls[name]), "tok_s": b * gen / med}
        raw_tok_s, peer_tok_s = row["raw"]["tok_s"], row["llama-server"]["tok_s"]
        for name in names:
            row[name]["fraction_of_raw"] = row[name]["tok_s"] / raw_tok_s
            row[name]["fraction_of_llama_server"] = row[name]["tok_s"] / peer_tok_s
        return row

    async def ttft_row(
        self, raw: RawLoop, backends: dict[str, Any], n_vocab: int
    ) -> dict[str, Any]:
        names = ["raw", *backends]
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(self.args.ttft_reps):
            prompt = prompts_for(1, TTFT_PROMPT, 7000 + rep, n_vocab)[0]
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                if name == "raw":
                    times[name].append(raw.run([prompt], 1))
                else:
                    times[name].append(await ttft(backends[name], prompt))
        row = {n: spread([t * 1000 for t in v]) for n, v in times.items()}
        peer = row["llama-server"]["median"]
        for name in names:
            row[name]["vs_llama_server"] = row[name]["median"] / peer
        progress("TTFT 512 ms: " + ", ".join(f"{n} {row[n]['median']:.2f}" for n in names))
        return {"prompt_tokens": TTFT_PROMPT, "ms": row}

    async def profile(
        self, name: str, entry: dict[str, Any], backends: dict[str, Any], n_vocab: int
    ) -> dict[str, Any]:
        """py-spy (the carried wheel) on the default llama-grpc server while B streams run:
        collapsed stacks into the output folder, the hottest frames into the JSON."""
        b = self.args.profile_batch
        pid = entry["pids"]["llama-grpc"]
        path = self.out.parent / f"profile_{name}_b{b}.txt"
        cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(self.args.profile_s),
               "--rate", "250", "--format", "raw", "--output", str(path), "--nonblocking",
               "--threads", "--idle"]  # fmt: skip
        spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t_end = time.monotonic() + self.args.profile_s
        rep = 0
        while time.monotonic() < t_end and spy.poll() is None:
            prompts = prompts_for(b, concurrency.PROMPT_TOKENS, 90000 + rep, n_vocab)
            await timed_streams(backends["llama-grpc"], prompts, self.args.gen)
            rep += 1
        try:
            output, _ = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            output = "py-spy did not finish"
        if spy.returncode != 0 or not path.exists():
            return {"error": (output or "")[-1500:], "returncode": spy.returncode}
        return {"file": path.name, "batch": b, "top_self": top_frames(path)}


def top_frames(path: Path, n: int = 25) -> list[tuple[str, float]]:
    """The frames with the most samples at the top of the stack (self time), as fractions of
    the engine thread's samples (py-spy's raw format: 'thread;frame;...;frame count')."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "llama-engine" not in stack.split(";", 1)[0] or not count.isdigit():
            continue
        total += int(count)
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(count)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return [(frame, round(c / total, 4)) for frame, c in ranked] if total else []


def targets_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, per model: llama-grpc >= 0.9x raw at B >= 8 and >= llama-server at
    every B (aggregate tok/s), TTFT (512) within 10 % of llama-server's."""
    out: dict[str, Any] = {}
    for name, entry in result["models"].items():
        rows = entry.get("concurrency", [])
        checks: dict[str, Any] = {}
        for row in rows:
            g = row["llama-grpc"]
            checks[f"B={row['batch']}"] = {
                "vs_raw": round(g["fraction_of_raw"], 3),
                "vs_llama_server": round(g["fraction_of_llama_server"], 3),
                "overlap_on_vs_off": round(g["tok_s"] / row["llama-grpc-no-overlap"]["tok_s"], 3),
                "met": (row["batch"] < 8 or g["fraction_of_raw"] >= 0.9)
                and g["fraction_of_llama_server"] >= 1.0,
            }
        if "ttft_512" in entry:
            ratio = entry["ttft_512"]["ms"]["llama-grpc"]["vs_llama_server"]
            checks["ttft_512"] = {"vs_llama_server": round(ratio, 3), "met": ratio <= 1.1}
        out[name] = checks
    return out


async def main_async(args: argparse.Namespace) -> int:
    clock = Clock(args.deadline_s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "note": NOTE,
        "command": "python bench/gpu_bench.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "model"}
        | {
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "n_ubatch": N_UBATCH,
            "prompt_tokens": concurrency.PROMPT_TOKENS,
        },
        "machine": machine_facts(args.threads or None),
        "models": {},
    }
    run = Run(args, clock, result, out)
    for spec in args.model:
        name, _, path = spec.partition("=")
        if clock.left() < 2 * args.min_step_s:
            run.skip(f"model {name}")
            continue
        try:
            await run.model(name, path)
        except Exception as exc:  # keep what the other models measured
            result["models"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
            progress(f"{name}: failed: {exc}")
        result["targets"] = targets_summary(result)
        run.save()
    result["elapsed_s"] = round(time.monotonic() - clock.t0, 1)
    result["targets"] = targets_summary(result)
    run.save()
    print(json.dumps(result["targets"], indent=1))
    return 0 if all("error" not in m for m in result["models"].values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--llama-server", required=True, metavar="BIN")
    parser.add_argument("--batched-bench", metavar="BIN")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                        default=[1, 4, 8, 16, 32, 64])  # fmt: skip
    parser.add_argument("--gen", type=int, default=concurrency.GEN_TOKENS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ttft-reps", type=int, default=5)
    parser.add_argument("--ngl", type=int, default=-1, help="llama-grpc's --n-gpu-layers")
    parser.add_argument("--ngl-peer", type=int, default=999, help="llama-server's -ngl")
    parser.add_argument("--threads", type=int, default=0, help="0 = each program's default")
    parser.add_argument("--deadline-s", type=float, default=400.0)
    parser.add_argument("--min-step-s", type=float, default=25.0,
                        help="start no step with less time than this left")  # fmt: skip
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-batch", type=int, default=8)
    parser.add_argument("--profile-s", type=int, default=6)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
