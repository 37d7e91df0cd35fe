"""Where a multi-turn chat spends its time, with and without the prefix cache: the realistic
workload of issue 16 (a 500-token system prompt, 4 turns of ~30 user words, 64-token answers,
each turn resending the whole history as token ids), per turn: prompt tokens, cached tokens, and
the server's own prefill and decode times. Three modes take turns in every repetition, each with
its own text:

- cache: the prefix cache on (the default), the system prompt never seen before;
- cache_warm_system: the same, after one request carried the system prompt (what every
  conversation but the first sees when many share one system prompt);
- no_cache: cache_prompt=false on every turn.

Then one conversation through the chat API (messages rendered by the chat template on the server,
the assistant's earlier answers sent back as text): how many of each turn's prompt tokens were
cached, to show whether re-rendering and re-tokenizing the history changes earlier tokens.

The ceiling: no cache can remove decode time. If every prompt token were free (even the new
user tokens, which no cache can hold), a chat would take only its decode time; the no-cache
time over that is the most any cache could give here.

    python bench/chat_turns.py --reps 3

`--shared` runs the many-sessions variant instead (chat_turns_shared.json): 8 sessions sharing
one 1,000-token system prompt take turns (s0, s1, ..., s7, then s0's second turn, ...), 4 turns
each, on 4 slots, each turn resending its whole history with its session id. Three servers take
turns in every repetition, each conversation set with its own text: llama-grpc with its default
caching (prefix cache and RAM tier), llama-grpc with cache_prompt=false, and llama.cpp's
llama-server (bench/setup_peers.sh; its defaults: 8 GiB --cache-ram, slot prompt similarity
0.1) with cache_prompt. Reported: total time, and per later turn the share of the previous
history found cached.

    python bench/chat_turns.py --shared --reps 3

LLAMA_SERVER_BINARY=PATH takes that llama-server instead of bench/.venv-peers' (for example the
one `bench/gpu.sh --cpu` builds from the pinned llama-cpp-python sdist's own llama.cpp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import (
    DEFAULT_THREADS,
    GrpcBackend,
    finish_facts,
    llama_grpc_server,
    machine_facts,
    progress,
    seeded_text,
    server_args,
    spread,
    write_json,
)

from llama_grpc import AsyncClient, Done
from llama_grpc.v1 import llm_service_pb2_grpc as pb_grpc

SYSTEM_TOKENS = 500
TURNS = 4
USER_WORDS = 30
ANSWER_TOKENS = 64
MODES = ("cache", "cache_warm_system", "no_cache")


async def answer(client: AsyncClient, ids: list[int], cache_prompt: bool) -> tuple[Done, list[int]]:
    done = None
    stream = client.generate_tokens(
        ids, max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True, cache_prompt=cache_prompt
    )
    tokens: list[int] = []
    async for event in stream:
        if isinstance(event, Done):
            done = event
        else:
            tokens += event.token_ids
    assert done is not None
    return done, tokens


async def system_prompt(client: AsyncClient, seed: int) -> list[int]:
    ids = await client.tokenize(seeded_text(SYSTEM_TOKENS, seed))
    return ids[:SYSTEM_TOKENS]


async def conversation(client: AsyncClient, mode: str, seed: int) -> dict[str, Any]:
    history = await system_prompt(client, seed)
    cache = mode != "no_cache"
    if mode == "cache_warm_system":
        await answer(client, history, True)  # another conversation with this system prompt
    turns = []
    for turn in range(TURNS):
        user = await client.tokenize(
            f"\nUser: {seeded_text(USER_WORDS, seed * 10 + turn)}\nAssistant:", add_special=False
        )
        history = history + user
        done, tokens = await answer(client, history, cache)
        t = done.timings
        turns.append(
            {
                "prompt_tokens": len(history),
                "cached_prompt_tokens": done.usage.cached_prompt_tokens,
                "queue_ms": t.queue_ms,
                "prefill_ms": t.prefill_ms,
                "decode_ms": t.decode_ms,
                "total_ms": t.total_ms,
            }
        )
        history = history + tokens
    return {"mode": mode, "turns": turns, "total_ms": sum(t["total_ms"] for t in turns)}


async def chat_api(client: AsyncClient, seed: int) -> list[dict[str, int]]:
    """The chat API: the history as messages, answers sent back as text."""
    messages = [{"role": "system", "content": seeded_text(350, seed)}]
    out = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": seeded_text(USER_WORDS, seed * 10 + turn)})
        result = await client.chat(
            messages,
            max_tokens=ANSWER_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            chat_template="gemma",  # the embedded model's GGUF carries none
        )
        out.append(
            {
                "prompt_tokens": result.usage.prompt_tokens,
                "cached_prompt_tokens": result.usage.cached_prompt_tokens,
            }
        )
        messages.append({"role": "assistant", "content": result.text})
    return out


async def measure(target: str, reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    async with AsyncClient(target, timeout=600) as client:
        await answer(client, await system_prompt(client, 1), True)  # warm-up
        for rep in range(reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            for i, mode in enumerate(order):
                run = await conversation(client, mode, seed=100 + rep * 10 + i)
                runs[mode].append(run)
                progress(f"rep {rep + 1}/{reps} {mode:<18}: {run['total_ms'] / 1000:.2f} s")
        chat = await chat_api(client, seed=999)
    return {"runs": runs, "chat_api": chat}


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["runs"]
    no_cache = runs["no_cache"]
    prefill_rate = statistics.median(
        t["prompt_tokens"] / t["prefill_ms"] for r in no_cache for t in r["turns"]
    )  # tokens per ms, computing the whole prompt
    out: dict[str, Any] = {"prefill_tokens_per_s": prefill_rate * 1000, "modes": {}}
    base_total = statistics.median(r["total_ms"] for r in no_cache)
    base_later = statistics.median(sum(t["total_ms"] for t in r["turns"][1:]) for r in no_cache)
    for mode in MODES:
        rs = runs[mode]
        total = statistics.median(r["total_ms"] for r in rs)
        later = statistics.median(sum(t["total_ms"] for t in r["turns"][1:]) for r in rs)
        per_turn = [
            {key: statistics.median(r["turns"][i][key] for r in rs) for key in rs[0]["turns"][i]}
            for i in range(TURNS)
        ]
        # the ceiling: every prompt token free, only this mode's decoding left
        decode = [t["decode_ms"] for t in per_turn]
        out["modes"][mode] = {
            "total_s": spread([r["total_ms"] / 1000 for r in rs]),
            "speedup": base_total / total,
            "speedup_turns_2_to_4": base_later / later,
            "bound": base_total / sum(decode),
            "bound_turns_2_to_4": base_later / sum(decode[1:]),
            "decode_share": sum(t["decode_ms"] for t in per_turn)
            / sum(t["total_ms"] for t in per_turn),
            "per_turn": per_turn,
        }
    return out


# -- --shared: many sessions, one system prompt ----------------------------------------------

SHARED_SESSIONS = 8
SHARED_SYSTEM_TOKENS = 1000
SHARED_ANSWER_TOKENS = 32
SHARED_SLOTS = 4


async def shared_sessions(backend: Any, cache: bool, seed: int) -> dict[str, Any]:
    """One set of sessions taking turns on `backend`; the per-turn records."""
    system = (await backend.tokenize(seeded_text(SHARED_SYSTEM_TOKENS, seed), add_special=True))[
        :SHARED_SYSTEM_TOKENS
    ]
    history = [list(system) for _ in range(SHARED_SESSIONS)]
    turns: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for turn in range(TURNS):
        for n in range(SHARED_SESSIONS):
            text = f"\nUser {n}: {seeded_text(USER_WORDS, seed * 100 + n * 10 + turn)}\nAssistant:"
            prompt = history[n] + await backend.tokenize(text, add_special=False)
            rec = await backend.generate(
                prompt, SHARED_ANSWER_TOKENS, cache_prompt=cache, session=f"{seed}-{n}"
            )
            turns.append(
                {
                    "session": n,
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "previous_history": len(history[n]) if turn else 0,
                    "cached_prompt_tokens": rec.cached_prompt_tokens,
                    "ttft_ms": rec.ttft_s * 1000,
                    "tokens": rec.n_tokens,
                }
            )
            history[n] = prompt + rec.token_ids
    return {"total_s": time.perf_counter() - t0, "turns": turns}


async def measure_shared(backends: dict[str, tuple[Any, bool]], reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    for backend, _ in backends.values():  # warm-up
        await backend.generate(await backend.tokenize(seeded_text(50, 7), add_special=True), 4)
    names = list(backends)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for i, name in enumerate(order):
            backend, cache = backends[name]
            run = await shared_sessions(backend, cache, seed=500 + rep * 10 + i)
            runs[name].append(run)
            progress(f"rep {rep + 1}/{reps} {name:<22}: {run['total_s']:.1f} s")
    return runs


def analyse_shared(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = statistics.median(r["total_s"] for r in runs["llama-grpc no cache"])
    for name, rs in runs.items():
        later = [t for r in rs for t in r["turns"] if t["turn"] > 0]
        total = statistics.median(r["total_s"] for r in rs)
        out[name] = {
            "total_s": spread([r["total_s"] for r in rs]),
            "speedup_vs_no_cache": base / total,
            "later_turns_history_cached": statistics.fmean(
                min(1.0, t["cached_prompt_tokens"] / t["previous_history"]) for t in later
            ),
            "later_turns_full_history": sum(
                t["cached_prompt_tokens"] >= t["previous_history"] - 1 for t in later
            )
            / len(later),
            "ttft_ms_later_turns": spread([t["ttft_ms"] for t in later]),
        }
    return out


def main_shared(args: argparse.Namespace) -> int:
    from peers import LlamaServerBackend, llama_server, llama_server_binary, peer_facts

    from llama_grpc_server.models.files import default_model_path

    facts = machine_facts(args.threads)
    binary = llama_server_binary()
    skipped = {} if binary else {"llama-server": "not installed (make bench-peers builds it)"}
    slots = ("--n-parallel", str(SHARED_SLOTS))
    with contextlib.ExitStack() as stack:
        target = stack.enter_context(llama_grpc_server(*server_args(args.threads, *slots)))
        port = None
        if binary:
            port = stack.enter_context(
                llama_server(
                    binary, str(default_model_path()), SHARED_SLOTS, args.threads, cache_ram_mb=None
                )
            )

        async def go() -> dict[str, Any]:
            async with grpc.aio.insecure_channel(target) as channel:
                grpc_backend = GrpcBackend(pb_grpc.LlmServiceStub(channel))
                backends: dict[str, tuple[Any, bool]] = {
                    "llama-grpc": (grpc_backend, True),
                    "llama-grpc no cache": (grpc_backend, False),
                }
                if port is not None:
                    backends["llama-server"] = (LlamaServerBackend(port, grpc_backend), True)
                return await measure_shared(backends, args.reps)

        runs = asyncio.run(go())
    data = {
        "command": "python bench/chat_turns.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "skipped": skipped,
        "llama_server": binary or "",
        "llama_server_version": peer_facts().get("llama_server_version", "") if binary else "",
        "workload": {
            "sessions": SHARED_SESSIONS,
            "slots": SHARED_SLOTS,
            "system_tokens": SHARED_SYSTEM_TOKENS,
            "turns": TURNS,
            "user_words": USER_WORDS,
            "answer_tokens": SHARED_ANSWER_TOKENS,
            "reps": args.reps,
        },
        "runs": runs,
        "analysis": analyse_shared(runs),
    }
    write_json("chat_turns_shared", finish_facts(data))
    for name, a in data["analysis"].items():
        progress(
            f"{name:<22} total {a['total_s']['median']:.1f} s  x{a['speedup_vs_no_cache']:.2f} "
            f"vs no cache; later turns: {a['later_turns_history_cached']:.0%} of history cached, "
            f"{a['later_turns_full_history']:.0%} whole; TTFT p50 "
            f"{a['ttft_ms_later_turns']['median']:.0f} ms"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--shared", action="store_true", help="the many-sessions variant")
    args = parser.parse_args()
    if args.shared:
        return main_shared(args)
    facts = machine_facts(args.threads)
    with llama_grpc_server(*server_args(args.threads, "--n-parallel", "4")) as target:
        result = asyncio.run(measure(target, args.reps))
    data = {
        "command": "python bench/chat_turns.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "workload": {
            "system_tokens": SYSTEM_TOKENS,
            "turns": TURNS,
            "user_words": USER_WORDS,
            "answer_tokens": ANSWER_TOKENS,
            "reps": args.reps,
        },
        "result": result,
        "analysis": analyse(result),
    }
    write_json("chat_turns", finish_facts(data))
    for mode, m in data["analysis"]["modes"].items():
        progress(
            f"{mode:<18} total {m['total_s']['median']:.2f} s  x{m['speedup']:.2f} "
            f"(turns 2-4 x{m['speedup_turns_2_to_4']:.2f}); bound x{m['bound']:.2f} "
            f"(turns 2-4 x{m['bound_turns_2_to_4']:.2f}); decode share {m['decode_share']:.0%}"
        )
    for i, t in enumerate(result["chat_api"]):
        progress(f"chat API turn {i + 1}: {t['cached_prompt_tokens']}/{t['prompt_tokens']} cached")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
