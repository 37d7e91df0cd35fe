"""Prefix cache benchmark (issue 4), one llama-grpc server (4 slots, cache on), cold and warm
rounds alternating within every repetition:

1. Shared system prompt: a 1,500-token system prompt + 8 short distinct questions, all 8 sent
   together over 4 slots (16 greedy tokens each). TTFT p50/p95 of the 8 requests:
     - cold: cache_prompt=false on every request (each prefills all ~1,520 tokens);
     - warm: the system prompt was seen before (one priming request, not counted);
     - together: cache on, system prompt never seen, all 8 arrive at once (cross-slot copy:
       it should be prefilled once). Reported for information.
   Target: warm TTFT p50 at least 10x lower than cold.
2. Multi-turn chat: a 500-token system prompt, then 4 turns; each turn resends the whole
   history (system + earlier questions + earlier answers, as token ids) plus a ~40-token
   question and generates 32 greedy tokens. Total wall time of the 4 turns with cache_prompt
   true (same session_id) vs false. Target: >= 2x faster with the cache.

    make bench-prefix                 # or: python bench/prefix_cache.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DEFAULT_THREADS,
    GrpcBackend,
    StreamRecord,
    finish_facts,
    llama_grpc_server,
    machine_facts,
    percentile,
    progress,
    pyplot,
    save_figure,
    seeded_text,
    server_args,
    spread,
    write_json,
)

from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

SYSTEM_TOKENS = 1500
N_QUESTIONS = 8
ANSWER_TOKENS = 16
CHAT_SYSTEM_TOKENS = 500
CHAT_TURNS = 4
CHAT_ANSWER_TOKENS = 32
N_SLOTS = 4


class Backend(Protocol):
    name: str

    async def generate(
        self,
        ids: list[int],
        max_tokens: int,
        *,
        cache_prompt: bool | None = ...,
        session: str = ...,
    ) -> StreamRecord: ...

    async def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...


async def system_prompt(backend: Backend, n_tokens: int, seed: int) -> list[int]:
    ids = await backend.tokenize("System: " + seeded_text(n_tokens, seed), add_special=True)
    return ids[:n_tokens]


async def question(backend: Backend, i: int, seed: int) -> list[int]:
    text = f"\nQuestion {i}: " + seeded_text(12, seed * 100 + i) + "?\nAnswer:"
    return await backend.tokenize(text, add_special=False)


async def shared_round(
    backend: Backend, system: list[int], seed: int, *, cache_prompt: bool
) -> list[StreamRecord]:
    """The 8 questions sent together after the shared system prompt."""
    prompts = [system + await question(backend, i, seed) for i in range(N_QUESTIONS)]
    return list(
        await asyncio.gather(
            *(backend.generate(p, ANSWER_TOKENS, cache_prompt=cache_prompt) for p in prompts)
        )
    )


async def chat(backend: Backend, seed: int, *, cache_prompt: bool) -> dict[str, Any]:
    """A 4-turn conversation resending the whole history each turn."""
    history = await system_prompt(backend, CHAT_SYSTEM_TOKENS, seed)
    turns = []
    t0 = time.perf_counter()
    for turn in range(CHAT_TURNS):
        user = await backend.tokenize(
            f"\nUser: {seeded_text(30, seed * 10 + turn)}\nAssistant:", add_special=False
        )
        history = history + user
        rec = await backend.generate(
            history, CHAT_ANSWER_TOKENS, cache_prompt=cache_prompt, session=f"chat-{seed}"
        )
        history = history + rec.token_ids
        turns.append(rec.as_dict() | {"prompt_tokens": len(history) - len(rec.token_ids)})
    return {"total_s": time.perf_counter() - t0, "turns": turns}


MODES = ("cold", "warm", "together")


class Rounds:
    """Raw measurements of one backend, accumulated one repetition at a time so that callers
    can interleave several backends (peers.py) or run one (this file)."""

    def __init__(self, backend: Backend, modes: tuple[str, ...] = MODES, chat: bool = True):
        self.backend = backend
        self.modes = modes
        self.with_chat = chat
        self.shared: dict[str, list[StreamRecord]] = {m: [] for m in modes}
        self.first_contact: list[float] = []
        self.chats: dict[str, list[dict[str, Any]]] = {"with_cache": [], "without_cache": []}
        self.chat_modes = ("with_cache", "without_cache") if chat else ()

    async def warm_up(self) -> None:
        """One small request first, so no timing pays for first use."""
        await self.backend.generate(await system_prompt(self.backend, 64, 1), 4, cache_prompt=False)
        progress(f"{self.backend.name}: warm-up done")

    async def rep(self, rep: int, reps: int) -> None:
        """Every mode of both scenarios once, the order rotating with `rep`."""
        backend, modes = self.backend, self.modes
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for mode in order:
            seed = 1000 + 10 * rep + MODES.index(mode)
            system = await system_prompt(backend, SYSTEM_TOKENS, seed)
            if mode == "warm":  # prime: the system prompt is then cached in one slot
                prime = await backend.generate(
                    system + await question(backend, 99, seed), 1, cache_prompt=True
                )
                self.first_contact.append(prime.ttft_s)
            recs = await shared_round(backend, system, seed, cache_prompt=mode != "cold")
            self.shared[mode] += recs
            ttft = [r.ttft_s * 1000 for r in recs]
            progress(
                f"{backend.name} rep {rep + 1}/{reps} shared prompt {mode:<8}: TTFT p50 "
                f"{percentile(ttft, 0.5):8.1f} ms p95 {percentile(ttft, 0.95):8.1f} ms, cached "
                f"{statistics.median(r.cached_prompt_tokens for r in recs):.0f} tokens (median)"
            )
        chat_order = self.chat_modes[:: 1 if rep % 2 == 0 else -1]
        for key in chat_order:
            # A fresh conversation per mode: a server that keeps the KV of a cache_prompt=false
            # request (llama-server does) must not hand it to the with-cache run.
            seed = 5000 + 10 * rep + self.chat_modes.index(key)
            result = await chat(backend, seed, cache_prompt=key == "with_cache")
            self.chats[key].append(result)
            progress(
                f"{backend.name} rep {rep + 1}/{reps} chat {key:<13}: {result['total_s']:.2f} s "
                f"for {CHAT_TURNS} turns"
            )

    def summary(self) -> dict[str, Any]:
        return summarize(self.shared, self.first_contact, self.chats)


def summarize(
    shared: dict[str, list[StreamRecord]],
    first_contact: list[float],
    chats: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    out: dict[str, Any] = {"shared_prompt": {}, "chat": {}}
    for mode, recs in shared.items():
        if recs:
            out["shared_prompt"][mode] = {
                "ttft_ms": spread([r.ttft_s * 1000 for r in recs]),
                "cached_prompt_tokens": spread([r.cached_prompt_tokens for r in recs]),
                "ttft_samples_ms": [r.ttft_s * 1000 for r in recs],
            }
    if first_contact:
        out["shared_prompt"]["priming_request_ttft_ms"] = spread([t * 1000 for t in first_contact])
    sp = out["shared_prompt"]
    if "cold" in sp and "warm" in sp:
        sp["warm_speedup_p50"] = sp["cold"]["ttft_ms"]["p50"] / sp["warm"]["ttft_ms"]["p50"]
        sp["warm_speedup_p95"] = sp["cold"]["ttft_ms"]["p95"] / sp["warm"]["ttft_ms"]["p95"]
    for key, results in chats.items():
        if results:
            out["chat"][key] = {
                "total_s": spread([r["total_s"] for r in results]),
                "runs": results,
            }
    if chats.get("with_cache") and chats.get("without_cache"):
        out["chat"]["speedup"] = (
            out["chat"]["without_cache"]["total_s"]["median"]
            / out["chat"]["with_cache"]["total_s"]["median"]
        )
    return out


async def measure(target: str, reps: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        rounds = Rounds(GrpcBackend(pb_grpc.LlmServiceStub(channel)))
        await rounds.warm_up()
        for rep in range(reps):
            await rounds.rep(rep, reps)
        return rounds.summary()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS)
    parser.add_argument("--chat-system-tokens", type=int, default=CHAT_SYSTEM_TOKENS)
    args = parser.parse_args()
    facts = machine_facts(args.threads)  # the load average before the run
    configure(args.system_tokens, args.chat_system_tokens)
    progress("starting llama-grpc")
    with llama_grpc_server(*server_args(args.threads, "--n-parallel", str(N_SLOTS))) as target:
        result = asyncio.run(measure(target, args.reps))
    data = {
        "benchmark": "prefix_cache",
        "command": "python bench/prefix_cache.py " + " ".join(sys.argv[1:]),
        "workload": workload(),
        "settings": vars(args),
        "machine": facts,
        "llama_grpc": result,
    }
    write_json("prefix_cache", finish_facts(data))
    plot({"llama-grpc": result}, "prefix_cache")
    report("llama-grpc", result)
    return 0


def configure(system_tokens: int, chat_system_tokens: int) -> None:
    """Shrink or grow the workload (smoke runs); the defaults are the issue's."""
    global SYSTEM_TOKENS, CHAT_SYSTEM_TOKENS
    SYSTEM_TOKENS, CHAT_SYSTEM_TOKENS = system_tokens, chat_system_tokens


def workload() -> dict[str, Any]:
    return {
        "system_prompt_tokens": SYSTEM_TOKENS,
        "questions": N_QUESTIONS,
        "answer_tokens": ANSWER_TOKENS,
        "slots": N_SLOTS,
        "chat_system_tokens": CHAT_SYSTEM_TOKENS,
        "chat_turns": CHAT_TURNS,
        "chat_answer_tokens": CHAT_ANSWER_TOKENS,
    }


def report(name: str, result: dict[str, Any]) -> None:
    sp = result["shared_prompt"]
    for mode in ("cold", "warm", "together"):
        if mode in sp:
            t = sp[mode]["ttft_ms"]
            print(
                f"{name} shared prompt {mode:<8} TTFT p50 {t['p50']:8.1f} ms p95 {t['p95']:8.1f} ms"
            )
    if "warm_speedup_p50" in sp:
        print(f"{name} warm vs cold TTFT: x{sp['warm_speedup_p50']:.1f} (p50)")
    ch = result["chat"]
    for key in ("with_cache", "without_cache"):
        if key in ch:
            print(f"{name} chat {key:<13} {ch[key]['total_s']['median']:.2f} s (median)")
    if "speedup" in ch:
        print(f"{name} chat speedup with cache: x{ch['speedup']:.2f}")


def plot(results: dict[str, dict[str, Any]], name: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = ("cold", "together", "warm")
    width = 0.8 / max(1, len(results))
    for i, (server, result) in enumerate(results.items()):
        sp = result["shared_prompt"]
        present = [m for m in modes if m in sp]
        xs = [modes.index(m) + i * width for m in present]
        p50 = [sp[m]["ttft_ms"]["p50"] for m in present]
        p95 = [sp[m]["ttft_ms"]["p95"] for m in present]
        ax1.bar(xs, p50, width=width, color=f"C{i}", label=f"{server} p50")
        ax1.scatter(xs, p95, color=f"C{i}", marker="_", s=300, label=f"{server} p95")
        for x, v in zip(xs, p50, strict=True):
            ax1.annotate(f"{v:.0f}", (x, v), textcoords="offset points", xytext=(0, 3),
                         ha="center", fontsize=7)  # fmt: skip
        ch = result["chat"]
        keys = [k for k in ("without_cache", "with_cache") if k in ch]
        cx = [j + i * width for j in range(len(keys))]
        ax2.bar(cx, [ch[k]["total_s"]["median"] for k in keys], width=width, color=f"C{i}",
                label=server)  # fmt: skip
    ax1.set_yscale("log")
    ax1.set_xticks([m + 0.4 - width / 2 for m in range(len(modes))], list(modes))
    ax1.set_ylabel("TTFT (ms, log)")
    ax1.set_title(f"{SYSTEM_TOKENS}-token shared system prompt, {N_QUESTIONS} questions, 4 slots")
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    ax2.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["without cache", "with cache"])
    ax2.set_ylabel("total seconds for 4 turns (median)")
    ax2.set_title(f"{CHAT_TURNS}-turn chat resending history")
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    save_figure(fig, name)


if __name__ == "__main__":
    sys.exit(main())
